//! llama.cpp's native `POST /completion` and `POST /infill` bodies, as llama.cpp's own web
//! UI, editor plugins (llama.vscode, llama.vim) and scripts send them: `prompt` (text,
//! token ids, a mix of both, or a batch), `n_predict`, llama.cpp's sampling defaults
//! (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05; penalties over the last
//! `repeat_last_n` = 64 tokens of prompt and output), `stop`, `n_probs`, `logit_bias`
//! in llama.cpp's list form, `json_schema` or a GBNF `grammar`, the editor's line limits `n_indent` and
//! `t_max_predict_ms` (`crate::line_limits`); `/infill` adds `input_prefix`,
//! `input_suffix` and `input_extra` (see `crate::fim`). Parsed once into the server's [`GenerationPlan`].
//! llama.cpp's own samplers (DRY, XTC, typical-p, top-n-sigma, dynamic temperature) and its
//! order (`samplers`; the temperature after the cuts) through `crate::llama_samplers`.
//! Keys llama.cpp accepts and we cannot honour (mirostat, post-sampling probabilities) are
//! refused by name when they would change the answer; bookkeeping keys (`cache_prompt`,
//! `id_slot`, …) are accepted and ignored.

pub mod answer;

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tokenrouter_api::{Backend, OutputConstraint, SamplingParams};

use crate::error::ApiError;
use crate::line_limits::LineLimits;
use crate::llama_samplers::LlamaSamplerFields;
use crate::params::GenerationPlan;
use crate::state::{AppState, ModelChoice};
use crate::stop::StopStrings;

/// The keys of a `/completion` or `/infill` body that we read.
#[derive(Debug, Default, Deserialize)]
pub struct Body {
    pub prompt: Option<Value>,
    /// -1 (the default): until EOS or the context is full.
    n_predict: Option<i64>,
    /// llama.cpp's alias of `n_predict`.
    max_tokens: Option<i64>,
    temperature: Option<f32>,
    top_k: Option<i64>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    /// The penalties' window: the last this many tokens of prompt and output (64; 0: no
    /// penalties; -1: the whole context).
    repeat_last_n: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    /// DRY, XTC, typical-p, top-n-sigma, dynamic temperature, `samplers` (the chain).
    #[serde(flatten)]
    samplers: LlamaSamplerFields,
    /// -1 (the default): a random seed.
    seed: Option<i64>,
    pub stop: Option<Vec<String>>,
    ignore_eos: Option<bool>,
    logit_bias: Option<Value>,
    /// The chosen token's log-probability and this many alternatives per token.
    n_probs: Option<usize>,
    post_sampling_probs: Option<bool>,
    pub stream: Option<bool>,
    /// Each answer's token ids in `tokens`.
    pub return_tokens: Option<bool>,
    /// Only these fields (`/`-separated paths, e.g. `timings/prompt_n`) of the final answer.
    pub response_fields: Option<Vec<String>>,
    json_schema: Option<Value>,
    grammar: Option<String>,
    /// A configured model's name pins the request to it (llama.cpp's router mode reads
    /// `model` the same way); absent or the served name: routed.
    pub model: Option<String>,
    /// Our extension: per-request overrides of the routing method's numbers.
    routing: Option<serde_json::Map<String, Value>>,
    pub input_prefix: Option<Value>,
    pub input_suffix: Option<Value>,
    pub input_extra: Option<Value>,
    /// End the answer before a later line indented less than this (editor completion).
    n_indent: Option<usize>,
    /// Past this many milliseconds of writing, end the answer at its next newline.
    t_max_predict_ms: Option<u64>,
}

/// One piece of a prompt: text to tokenize or ids as given.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    Ids(Vec<u32>),
}

/// The prompts of `prompt`, each the concatenation of its pieces: a string, an array of ids
/// (or ids mixed with strings: one prompt), or an array of those (a batch: one answer
/// each, as llama.cpp reads it).
pub fn prompts(prompt: Option<&Value>) -> Result<Vec<Vec<Piece>>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of token ids (and strings), or an array of those",
        )
    };
    let Some(prompt) = prompt else {
        return Err(ApiError::MissingField("prompt".into()));
    };
    let Value::Array(items) = prompt else {
        return one_prompt(prompt).map(|p| vec![p]).ok_or_else(bad);
    };
    if items.iter().any(Value::is_number) {
        return one_prompt(prompt).map(|p| vec![p]).ok_or_else(bad);
    }
    if items.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    items
        .iter()
        .map(|item| one_prompt(item).ok_or_else(bad))
        .collect()
}

/// One prompt: a string, or an array of ids and strings.
fn one_prompt(value: &Value) -> Option<Vec<Piece>> {
    match value {
        Value::String(text) => Some(vec![Piece::Text(text.clone())]),
        Value::Array(items) => {
            let mut pieces: Vec<Piece> = Vec::new();
            for item in items {
                match item {
                    Value::String(text) => pieces.push(Piece::Text(text.clone())),
                    Value::Number(n) => {
                        let id = u32::try_from(n.as_u64()?).ok()?;
                        match pieces.last_mut() {
                            Some(Piece::Ids(ids)) => ids.push(id),
                            _ => pieces.push(Piece::Ids(vec![id])),
                        }
                    }
                    _ => return None,
                }
            }
            Some(pieces)
        }
        _ => None,
    }
}

/// A prompt's ids: its texts tokenized (on the blocking pool) between its ids.
pub async fn encode(
    state: &AppState,
    pieces: Vec<Piece>,
    context: usize,
) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(text) if text.is_empty() => {}
            Piece::Text(text) => ids.extend(state.encode_prompt(text, context).await?),
            Piece::Ids(given) => ids.extend(given),
        }
    }
    Ok(ids)
}

/// llama.cpp's sampling defaults, where the body is silent.
const TEMPERATURE: f32 = 0.8;
const TOP_K: i64 = 40;
const TOP_P: f32 = 0.95;
const MIN_P: f32 = 0.05;
const REPEAT_LAST_N: i64 = 64;

impl Body {
    /// The plan every prompt of the request shares.
    pub fn plan(
        &self,
        model: ModelChoice,
        backend: &dyn Backend,
        max_top_logprobs: usize,
    ) -> Result<GenerationPlan, ApiError> {
        self.refuse_unsupported()?;
        let n_predict = self.n_predict.or(self.max_tokens).unwrap_or(-1);
        let max_tokens = match n_predict {
            n if n < 0 => None,
            0 => {
                return Err(ApiError::invalid(
                    "n_predict",
                    "`n_predict` must be -1 (until the end) or at least 1",
                ))
            }
            n => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };
        let n_probs = self.n_probs.unwrap_or(0);
        if n_probs > max_top_logprobs {
            return Err(ApiError::invalid(
                "n_probs",
                format!("`n_probs` must be at most {max_top_logprobs}, got {n_probs}"),
            ));
        }
        let penalty_last_n =
            crate::params::penalty_window(Some(self.repeat_last_n.unwrap_or(REPEAT_LAST_N)))?;
        let defaults = SamplingParams::default();
        let mut sampling = SamplingParams {
            // llama.cpp: a temperature at or below 0 picks greedily.
            temperature: self.temperature.unwrap_or(TEMPERATURE).max(0.0),
            top_k: usize::try_from(self.top_k.unwrap_or(TOP_K)).unwrap_or(0),
            top_p: self.top_p.unwrap_or(TOP_P),
            min_p: self.min_p.unwrap_or(MIN_P),
            repetition_penalty: self.repeat_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias: logit_bias(self.logit_bias.as_ref(), backend)?,
            seed: self.seed.and_then(|s| u64::try_from(s).ok()),
            penalty_last_n,
            // llama.cpp's ignore_eos bans the end-of-generation ids, not just the stop.
            ban_eos: self.ignore_eos.unwrap_or(false),
            ..defaults
        };
        self.samplers.apply(true, &mut sampling)?;
        let sampling = crate::params::validated(sampling, true)?;
        let grammar = self.grammar.clone().filter(|g| !g.is_empty());
        let constraint = match (&self.json_schema, grammar) {
            (None | Some(Value::Null), None) => None,
            (None | Some(Value::Null), Some(grammar)) => {
                Some((OutputConstraint::grammar(grammar), "grammar"))
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "grammar",
                    "either `json_schema` or `grammar` can be given, not both",
                ))
            }
            (Some(schema @ Value::Object(_)), None) => {
                Some((OutputConstraint::JsonSchema(schema.clone()), "json_schema"))
            }
            (Some(_), None) => {
                return Err(ApiError::invalid(
                    "json_schema",
                    "`json_schema` must be a JSON schema object",
                ))
            }
        };
        let routing = crate::params::routing_overrides(self.routing.as_ref())?;
        Ok(GenerationPlan {
            model,
            stream: self.stream.unwrap_or(false),
            include_usage: false,
            continuous_usage: false,
            n: 1,
            sampling,
            max_tokens,
            stop: StopStrings::new(self.stop.clone().unwrap_or_default()),
            include_stops: false,
            keep_special: false,
            bad_words: Vec::new(),
            truncate_prompt_tokens: None,
            tokens_as_ids: false,
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs: (n_probs > 0).then_some(n_probs),
            return_token_sources: true,
            routing,
            prompt_logprobs: None,
            shown_prompt_logprobs: None,
            reasoning: None,
            tool_names: None,
            single_tool_call: false,
            constraint,
            priority: 0,
            cache_salt: None,
            rid: None,
            line_limits: LineLimits {
                min_indent: self.n_indent.unwrap_or(0),
                max_time: self
                    .t_max_predict_ms
                    .filter(|&ms| ms > 0)
                    .map(Duration::from_millis),
            },
        })
    }

    /// A 400 naming what llama.cpp has and we lack, when it is switched on (mirostat is
    /// refused with the other samplers' keys, `crate::llama_samplers`).
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.post_sampling_probs == Some(true) {
            return Err(ApiError::invalid(
                "post_sampling_probs",
                "`post_sampling_probs` is not supported: leave it at its default",
            ));
        }
        Ok(())
    }
}

/// Most `logit_bias` entries, as the OpenAI endpoints allow.
const MAX_BIAS_ENTRIES: usize = 300;
/// Longest string a `logit_bias` entry may name.
const MAX_BIAS_TEXT: usize = 256;

/// llama.cpp's `logit_bias`: `[[id, bias], [id, false], ["text", bias]]` (`false` bans the
/// token; a string biases each of its tokens) or OpenAI's `{"id": bias}`.
fn logit_bias(value: Option<&Value>, backend: &dyn Backend) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |why: &str| ApiError::invalid("logit_bias", format!("`logit_bias`: {why}"));
    // `false` bans: OpenAI's -100, after which the token is never drawn in practice.
    let bias_of = |v: &Value| match v {
        Value::Bool(false) => Some(-100.0),
        Value::Number(n) => n.as_f64().map(|b| b as f32),
        _ => None,
    };
    let mut out = Vec::new();
    match value {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (key, bias) in map {
                let id = key
                    .parse::<u32>()
                    .map_err(|_| bad("keys must be token ids"))?;
                out.push((
                    id,
                    bias_of(bias).ok_or_else(|| bad("biases must be numbers"))?,
                ));
            }
        }
        Some(Value::Array(entries)) => {
            for entry in entries {
                let pair = entry.as_array().filter(|p| p.len() == 2);
                let pair = pair.ok_or_else(|| bad("each entry must be [token, bias]"))?;
                let bias =
                    bias_of(&pair[1]).ok_or_else(|| bad("a bias must be a number or false"))?;
                match &pair[0] {
                    Value::Number(n) => {
                        let id = n.as_u64().and_then(|i| u32::try_from(i).ok());
                        out.push((id.ok_or_else(|| bad("token ids must be integers"))?, bias));
                    }
                    Value::String(text) if text.len() <= MAX_BIAS_TEXT => {
                        let ids = backend.encode(text).map_err(ApiError::from)?;
                        out.extend(ids.into_iter().map(|id| (id, bias)));
                    }
                    Value::String(_) => {
                        return Err(bad(&format!(
                            "a string may be at most {MAX_BIAS_TEXT} bytes"
                        )))
                    }
                    _ => return Err(bad("a token must be an id or a string")),
                }
                if out.len() > MAX_BIAS_ENTRIES {
                    break;
                }
            }
        }
        Some(_) => return Err(bad("must be a list of [token, bias] or an object")),
    }
    if out.len() > MAX_BIAS_ENTRIES {
        return Err(bad(&format!(
            "at most {MAX_BIAS_ENTRIES} tokens may be biased"
        )));
    }
    Ok(out)
}

/// llama.cpp's `response_fields`: the answer reduced to the given `/`-separated paths, each
/// a key of the result (`{"content": …, "timings/prompt_n": 12}`); missing paths are left out.
pub fn select_fields(answer: &Value, paths: &[String]) -> Value {
    let mut out = serde_json::Map::new();
    for path in paths {
        let found = path
            .split('/')
            .try_fold(answer, |node, key| node.as_object()?.get(key));
        if let Some(value) = found {
            out.insert(path.clone(), value.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_read_as_llama_cpp_reads_them() {
        let one = |v: Value| prompts(Some(&v)).unwrap();
        assert_eq!(one(json!("hi")), [vec![Piece::Text("hi".into())]]);
        assert_eq!(one(json!([1, 2, 3])), [vec![Piece::Ids(vec![1, 2, 3])]]);
        assert_eq!(
            one(json!([1, "x", 2, 3])),
            [vec![
                Piece::Ids(vec![1]),
                Piece::Text("x".into()),
                Piece::Ids(vec![2, 3])
            ]]
        );
        assert_eq!(
            one(json!(["a", [5, 6]])),
            [vec![Piece::Text("a".into())], vec![Piece::Ids(vec![5, 6])]]
        );
        for bad in [
            json!(3),
            json!([-1]),
            json!([{"a": 1}]),
            json!([]),
            json!([[1.5]]),
        ] {
            let err = prompts(Some(&bad)).unwrap_err();
            assert!(err.to_string().contains("prompt"), "{bad}: {err}");
        }
        assert!(matches!(prompts(None), Err(ApiError::MissingField(_))));
    }

    #[test]
    fn response_fields_pick_nested_paths_as_flat_keys() {
        let answer = json!({"content": "x", "timings": {"prompt_n": 3, "predicted_ms": 1.5}});
        let paths = ["content", "timings/prompt_n", "timings/nope", "missing"].map(String::from);
        assert_eq!(
            select_fields(&answer, &paths),
            json!({"content": "x", "timings/prompt_n": 3})
        );
    }
}
