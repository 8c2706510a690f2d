//! `sampling_params` as the research system and SGLang spell them (`max_new_tokens`,
//! `top_k = -1`, `stop`, `sampling_seed`, …), parsed once into the engine's request type:
//! shared by SGLang's native `POST /generate` and the Python engine's `generate`.
//! Unknown keys are refused by name: a misspelt key silently ignored is a wrong experiment.

use std::collections::BTreeMap;

use crate::params::GenerationPlan;
use crate::state::ModelChoice;
use crate::stop::StopStrings;
use serde::Deserialize;
use tokenrouter_api::{GenerateRequest, OutputConstraint, RoutingOverrides, SamplingParams};

/// SGLang's default when `max_new_tokens` is absent.
const DEFAULT_MAX_NEW_TOKENS: usize = 128;

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// The keys a `sampling_params` dict may hold. `null` means the default everywhere, except
/// `max_new_tokens: null`, which means "up to the context length" (as in SGLang).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawParams {
    #[serde(default = "default_max_new_tokens")]
    max_new_tokens: Option<usize>,
    /// Samples per prompt (parallel sampling).
    n: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// -1 (SGLang) or 0 disables it.
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stop: Option<OneOrMany>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    skip_special_tokens: Option<bool>,
    /// No stop token or stop string before this many tokens.
    min_new_tokens: Option<usize>,
    /// Keep a matched stop string, or a stop token's text, in the output.
    no_stop_trim: Option<bool>,
    #[serde(alias = "sampling_seed")]
    seed: Option<u64>,
    /// Token id (as a string key, like OpenAI's) → bias added to its logit.
    logit_bias: Option<BTreeMap<String, f32>>,
    /// Also return each token's log-probability in `meta_info`.
    return_logprob: Option<bool>,
    /// With `return_logprob`: also score the prompt from this position on (SGLang's
    /// `logprob_start_len`; -1, the default, scores none). Needs a pinned model.
    logprob_start_len: Option<i64>,
    /// With a scored prompt: this many top alternatives a prompt token (SGLang's
    /// `top_logprobs_num`).
    top_logprobs_num: Option<usize>,
    /// Our extension: per-request overrides of the routing method's kwargs.
    routing: Option<BTreeMap<String, f64>>,
    /// Structured output (SGLang's keys): the text of a JSON schema the output must follow.
    json_schema: Option<String>,
    /// Structured output: a regular expression the whole output must match.
    regex: Option<String>,
    /// Structured output: an EBNF grammar (xgrammar's dialect, which is GBNF's).
    ebnf: Option<String>,
}

/// SGLang's structured output keys as one constraint (at most one of them).
fn constraint(
    json_schema: Option<String>,
    regex: Option<String>,
    ebnf: Option<String>,
) -> Result<Option<OutputConstraint>, String> {
    match (json_schema, regex, ebnf) {
        (None, None, None) => Ok(None),
        (Some(schema), None, None) => serde_json::from_str(&schema)
            .map(|s| Some(OutputConstraint::JsonSchema(s)))
            .map_err(|e| format!("sampling_params: json_schema is not JSON: {e}")),
        (None, Some(rx), None) => Ok(Some(OutputConstraint::Regex(rx))),
        (None, None, Some(grammar)) => Ok(Some(OutputConstraint::Gbnf(grammar))),
        _ => Err("sampling_params: give one of json_schema, regex and ebnf".into()),
    }
}

fn default_max_new_tokens() -> Option<usize> {
    Some(DEFAULT_MAX_NEW_TOKENS)
}

/// A parsed `sampling_params`: what every prompt of one `generate` call shares.
#[derive(Clone, Debug)]
pub struct Params {
    /// None: up to the context length.
    pub max_new_tokens: Option<usize>,
    /// Samples per prompt; the i-th is seeded `seed + i` (see [`Params::sample`]).
    pub n: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// A matched stop string, or a stop token's text, stays in the output (`no_stop_trim`).
    pub no_stop_trim: bool,
    pub return_logprob: bool,
    /// Top alternatives a token with `return_logprob` (`top_logprobs_num`).
    pub top_logprobs_num: usize,
    /// Score the prompt (`return_logprob` with `logprob_start_len >= 0`).
    pub input_logprobs: Option<InputLogprobs>,
    pub routing: RoutingOverrides,
    /// Structured output (`json_schema` or `regex`).
    pub constraint: Option<OutputConstraint>,
}

/// Which prompt scores a request returns (`input_token_logprobs`, `input_top_logprobs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InputLogprobs {
    /// First prompt position reported.
    pub start: usize,
    /// Top alternatives a token.
    pub top: usize,
}

/// Most top alternatives a scored prompt token may ask for (as the server's `logprobs`).
const MAX_TOP_LOGPROBS: usize = 20;

impl Params {
    /// Parses the JSON text of a `sampling_params` dict; the message names the bad key.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let raw: RawParams = if text.trim().is_empty() || text.trim() == "null" {
            RawParams {
                max_new_tokens: default_max_new_tokens(),
                ..RawParams::default()
            }
        } else {
            serde_json::from_str(text).map_err(|e| {
                // serde's position ("at line 1 column 13") is of our JSON, not the user's dict.
                let message = e.to_string();
                let message = message.split(" at line ").next().unwrap_or_default();
                format!("sampling_params: {message}")
            })?
        };
        let defaults = SamplingParams::default();
        let mut logit_bias = Vec::new();
        for (key, bias) in raw.logit_bias.unwrap_or_default() {
            let id = key.parse::<u32>().map_err(|_| {
                format!("sampling_params: logit_bias key `{key}` is not a token id")
            })?;
            logit_bias.push((id, bias));
        }
        let return_logprob = raw.return_logprob.unwrap_or(false);
        let start = raw.logprob_start_len.unwrap_or(-1);
        if start < -1 {
            return Err(format!(
                "sampling_params: logprob_start_len must be -1 (no prompt scores) or a position, got {start}"
            ));
        }
        let top = raw.top_logprobs_num.unwrap_or(0);
        if top > MAX_TOP_LOGPROBS {
            return Err(format!(
                "sampling_params: top_logprobs_num must be at most {MAX_TOP_LOGPROBS}, got {top}"
            ));
        }
        let input_logprobs = (return_logprob && start >= 0).then(|| InputLogprobs {
            start: usize::try_from(start).unwrap_or(usize::MAX),
            top,
        });
        let constraint = constraint(raw.json_schema, raw.regex, raw.ebnf)?;
        let top_k = raw.top_k.unwrap_or(0);
        if top_k < -1 {
            return Err(format!(
                "sampling_params: top_k must be -1 (off), 0 (off) or positive, got {top_k}"
            ));
        }
        Ok(Self {
            max_new_tokens: raw.max_new_tokens,
            n: match raw.n {
                None => 1,
                Some(0) => return Err("sampling_params: n must be at least 1".into()),
                Some(n) => n,
            },
            sampling: SamplingParams {
                temperature: raw.temperature.unwrap_or(defaults.temperature),
                top_p: raw.top_p.unwrap_or(defaults.top_p),
                top_k: top_k.max(0) as usize,
                min_p: raw.min_p.unwrap_or(defaults.min_p),
                repetition_penalty: raw
                    .repetition_penalty
                    .unwrap_or(defaults.repetition_penalty),
                presence_penalty: raw.presence_penalty.unwrap_or(defaults.presence_penalty),
                frequency_penalty: raw.frequency_penalty.unwrap_or(defaults.frequency_penalty),
                logit_bias,
                seed: raw.seed,
                min_tokens: raw.min_new_tokens.unwrap_or(0),
                ..defaults
            },
            stop: match raw.stop {
                None => Vec::new(),
                Some(OneOrMany::One(s)) => vec![s],
                Some(OneOrMany::Many(v)) => v,
            },
            stop_token_ids: raw.stop_token_ids.unwrap_or_default(),
            ignore_eos: raw.ignore_eos.unwrap_or(false),
            skip_special_tokens: raw.skip_special_tokens.unwrap_or(true),
            no_stop_trim: raw.no_stop_trim.unwrap_or(false),
            return_logprob,
            top_logprobs_num: top,
            input_logprobs,
            routing: RoutingOverrides(raw.routing.unwrap_or_default()),
            constraint,
        })
    }

    /// The engine request for one prompt (`max_new_tokens: null` is left to the engine, which
    /// fills the context).
    pub fn request(&self, prompt_ids: Vec<u32>, pinned_model: Option<usize>) -> GenerateRequest {
        GenerateRequest {
            prompt_ids,
            sampling: self.sampling.clone(),
            max_tokens: self.max_new_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            pinned_model,
            top_logprobs: 0,
            routing: self.routing.clone(),
            prompt_logprobs: self.input_logprobs.map(|i| i.top),
            constraint: self.constraint.clone(),
            priority: 0,
            cache_salt: None,
        }
    }

    /// The parameters of sample `i` of `n`: one sample, seeded `seed + i` (SGLang's and
    /// OpenAI's way to make parallel samples differ yet repeat).
    pub fn sample(&self, i: usize) -> Params {
        let mut one = self.clone();
        one.n = 1;
        one.sampling.seed = one.sampling.seed.map(|s| s.wrapping_add(i as u64));
        one
    }

    pub fn stop_strings(&self) -> StopStrings {
        StopStrings::new(self.stop.clone())
    }

    /// The server's plan of one `/generate` prompt under these parameters: the output's
    /// log-probabilities (with `top_logprobs_num` alternatives) when `return_logprob`, the
    /// prompt scored when `logprob_start_len >= 0`, provenance always.
    pub(crate) fn plan(&self, model: ModelChoice, stream: bool) -> GenerationPlan {
        GenerationPlan {
            model,
            stream,
            include_usage: false,
            continuous_usage: false,
            n: 1,
            sampling: self.sampling.clone(),
            max_tokens: self.max_new_tokens,
            stop: self.stop_strings(),
            include_stops: self.no_stop_trim,
            keep_special: !self.skip_special_tokens,
            bad_words: Vec::new(),
            truncate_prompt_tokens: None,
            tokens_as_ids: false,
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.return_logprob.then_some(self.top_logprobs_num),
            return_token_sources: true,
            routing: self.routing.clone(),
            prompt_logprobs: self.input_logprobs.map(|i| i.top),
            shown_prompt_logprobs: None,
            reasoning: None,
            tool_names: None,
            single_tool_call: false,
            constraint: self.constraint.clone().map(|c| (c, "sampling_params")),
            priority: 0,
            cache_salt: None,
            // `/generate` registers its own rid (its answers carry it).
            rid: None,
            line_limits: Default::default(),
        }
    }
}
