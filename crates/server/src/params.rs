//! Validation of the sampling fields shared by chat and completions, and their mapping onto
//! the engine's [`GenerateRequest`]. Every rejection is a 400 naming the field in `param`.

use tokenrouter_api::{
    Backend, GenerateRequest, OutputConstraint, RoutingOverrides, SamplingParams,
};

use crate::config::ServerConfig;
use crate::constraint::output_constraint;
use crate::error::ApiError;
use crate::openai::request::CommonFields;
use crate::state::ModelChoice;
use crate::stop::StopStrings;

/// A validated generation request, before tokenization-dependent parts are known.
#[derive(Debug, Clone)]
pub struct GenerationPlan {
    pub model: ModelChoice,
    pub stream: bool,
    pub include_usage: bool,
    /// Usage so far on every streamed chunk (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    pub n: usize,
    pub sampling: SamplingParams,
    /// Requested output bound; `None` = whatever fits in the context.
    pub max_tokens: Option<usize>,
    pub stop: StopStrings,
    /// A matched stop string, or a stop id's text, stays in the answer
    /// (`include_stop_str_in_output`).
    pub include_stops: bool,
    /// Special tokens' text is shown (`skip_special_tokens: false`).
    pub keep_special: bool,
    /// `bad_words` as given; tokenized into `sampling.bad_words` by [`GenerationPlan::tokenize_bad_words`].
    pub bad_words: Vec<String>,
    /// Keep the prompt's last k tokens; -1: as many as fit (`truncate_prompt_tokens`).
    pub truncate_prompt_tokens: Option<i64>,
    /// Logprob entries name tokens `token_id:{id}` (`return_tokens_as_token_ids`).
    pub tokens_as_ids: bool,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `None` = no logprobs; `Some(k)` = chosen token's logprob plus k alternatives.
    pub logprobs: Option<usize>,
    pub return_token_sources: bool,
    pub routing: RoutingOverrides,
    /// Score the prompt with this many alternatives a token (`echo` with `logprobs`,
    /// `prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// Show the prompt's scores as vLLM's `prompt_logprobs`, this many alternatives a token.
    pub shown_prompt_logprobs: Option<usize>,
    /// Read chat answers' thinking apart from their content (see `reasoning`).
    pub reasoning: Option<crate::reasoning::ReasoningStart>,
    /// Read chat answers' tool calls of these tools as `tool_calls` (see `tools`).
    pub tool_names: Option<std::sync::Arc<[String]>>,
    /// At most one tool call is returned (`parallel_tool_calls: false`).
    pub single_tool_call: bool,
    /// Structured output, and the request field that asked for it.
    pub constraint: Option<(OutputConstraint, &'static str)>,
    /// vLLM's `priority` (the engine refuses anything but 0 without priority scheduling).
    pub priority: i32,
    /// vLLM's `cache_salt` (prefix-cache blocks shared only under the same salt).
    pub cache_salt: Option<String>,
    /// SGLang's `rid`: `/abort_request` stops the request by it.
    pub rid: Option<String>,
    /// llama.cpp's `n_indent` and `t_max_predict_ms` (off elsewhere).
    pub line_limits: crate::line_limits::LineLimits,
}

impl GenerationPlan {
    /// A fill-in-the-middle request: the model's FIM end tokens stop it, and without its
    /// own `routing` it takes the server's defaults for editor completions.
    pub fn fill_in_the_middle(&mut self, tokens: &crate::fim::FimTokens, backend: &dyn Backend) {
        self.stop_token_ids.extend(tokens.stop_ids());
        if self.routing.is_empty() {
            self.routing = backend.fim_routing();
        }
    }

    /// Validates `fields`; `max_tokens` and `logprobs` come from the endpoint's own fields
    /// (`max_completion_tokens`, chat's `logprobs`/`top_logprobs` or completions' `logprobs`).
    pub fn new(
        fields: CommonFields,
        model: ModelChoice,
        max_tokens: Option<(u64, &'static str)>,
        logprobs: Option<usize>,
        cfg: &ServerConfig,
    ) -> Result<Self, ApiError> {
        let n = fields.n.unwrap_or(1);
        if n < 1 || n > cfg.max_n as u64 {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {}, got {n}", cfg.max_n),
            ));
        }
        let max_tokens = match max_tokens {
            Some((0, param)) => {
                return Err(ApiError::invalid(
                    param,
                    format!("`{param}` must be at least 1"),
                ))
            }
            Some((v, _)) => Some(usize::try_from(v).unwrap_or(usize::MAX)),
            None => None,
        };
        let constraint = output_constraint(&fields)?;
        let sampling = sampling_params(&fields)?;
        let routing = routing_overrides(fields.routing.as_ref())?;
        let stream = fields.stream.unwrap_or(false);
        let include_usage = fields
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let continuous_usage = include_usage
            && fields
                .stream_options
                .as_ref()
                .and_then(|o| o.continuous_usage_stats)
                .unwrap_or(false);
        Ok(Self {
            model,
            stream,
            include_usage,
            continuous_usage,
            n: n as usize,
            sampling,
            max_tokens,
            stop: StopStrings::new(fields.stop.map(|s| s.into_vec()).unwrap_or_default()),
            include_stops: fields.include_stop_str_in_output.unwrap_or(false),
            keep_special: !fields.skip_special_tokens.unwrap_or(true),
            bad_words: fields.bad_words.unwrap_or_default(),
            truncate_prompt_tokens: truncation(fields.truncate_prompt_tokens)?,
            tokens_as_ids: fields.return_tokens_as_token_ids.unwrap_or(false),
            stop_token_ids: fields.stop_token_ids.unwrap_or_default(),
            ignore_eos: fields.ignore_eos.unwrap_or(false),
            logprobs,
            return_token_sources: fields.return_token_sources.unwrap_or(false),
            routing,
            prompt_logprobs: None,
            shown_prompt_logprobs: None,
            reasoning: None,
            tool_names: None,
            single_tool_call: false,
            constraint,
            priority: priority(fields.priority)?,
            cache_salt: cache_salt(fields.cache_salt)?,
            rid: fields.rid,
            line_limits: Default::default(),
        })
    }

    /// `bad_words` as token sequences, as vLLM makes them: each word (leading whitespace
    /// trimmed) as it reads at the start of a text, and with a space before it when that
    /// is a different first token of the same length (the word inside a sentence).
    pub fn tokenize_bad_words(&mut self, backend: &dyn Backend) -> Result<(), ApiError> {
        let mut out = Vec::new();
        for (i, word) in self.bad_words.iter().enumerate() {
            let word = word.trim_start();
            let encode = |text: &str| {
                backend
                    .encode(text)
                    .map_err(|e| ApiError::invalid(format!("bad_words[{i}]"), e.to_string()))
            };
            let alone = encode(word)?;
            if alone.is_empty() {
                return Err(ApiError::invalid(
                    format!("bad_words[{i}]"),
                    "a bad word must not be empty",
                ));
            }
            let spaced = encode(&format!(" {word}"))?;
            let differs = spaced.first() != alone.first() && spaced.len() == alone.len();
            out.push(alone);
            if differs {
                out.push(spaced);
            }
        }
        self.sampling.bad_words = out;
        Ok(())
    }

    /// A prompt's ids after `truncate_prompt_tokens`: its last k (-1: as many as leave
    /// room for `max_tokens`, or one token, in a context of `context_length`).
    pub fn truncate_prompt(&self, ids: &mut Vec<u32>, context_length: usize) {
        let keep = match self.truncate_prompt_tokens {
            None => return,
            Some(-1) => context_length.saturating_sub(self.max_tokens.unwrap_or(1)),
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        if ids.len() > keep {
            ids.drain(..ids.len() - keep);
        }
    }

    /// Score the prompt with `k` alternatives a token (at least: `echo` may ask for more).
    pub fn score_prompt(&mut self, k: usize) {
        self.prompt_logprobs = self.prompt_logprobs.max(Some(k));
    }

    /// The engine requests for one prompt: `n` of them, the i-th seeded with `seed + i`.
    pub fn requests(&self, prompt_ids: &[u32]) -> Result<Vec<GenerateRequest>, ApiError> {
        let prompt_tokens = prompt_ids.len();
        if prompt_tokens == 0 {
            return Err(ApiError::invalid("prompt", "the prompt is empty"));
        }
        Ok((0..self.n)
            .map(|i| {
                let mut sampling = self.sampling.clone();
                sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
                GenerateRequest {
                    prompt_ids: prompt_ids.to_vec(),
                    sampling,
                    max_tokens: self.max_tokens,
                    stop_token_ids: self.stop_token_ids.clone(),
                    ignore_eos: self.ignore_eos,
                    pinned_model: self.model.pinned,
                    top_logprobs: self.logprobs.unwrap_or(0),
                    routing: self.routing.clone(),
                    prompt_logprobs: self.prompt_logprobs,
                    constraint: self.constraint.as_ref().map(|(c, _)| c.clone()),
                    priority: self.priority,
                    cache_salt: self.cache_salt.clone(),
                }
            })
            .collect())
    }
}

/// `priority`, a 32-bit integer as vLLM's.
pub fn priority(value: Option<i64>) -> Result<i32, ApiError> {
    let value = value.unwrap_or(0);
    i32::try_from(value).map_err(|_| {
        ApiError::invalid(
            "priority",
            format!("`priority` must be a 32-bit integer, got {value}"),
        )
    })
}

/// `cache_salt`: a non-empty string, as vLLM asks.
fn cache_salt(value: Option<String>) -> Result<Option<String>, ApiError> {
    match value {
        Some(salt) if salt.is_empty() => Err(ApiError::invalid(
            "cache_salt",
            "`cache_salt` must be a non-empty string",
        )),
        other => Ok(other),
    }
}

/// `truncate_prompt_tokens`: -1 or at least 1.
fn truncation(value: Option<i64>) -> Result<Option<i64>, ApiError> {
    match value {
        Some(k) if k == 0 || k < -1 => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!("`truncate_prompt_tokens` must be -1 or at least 1, got {k}"),
        )),
        other => Ok(other),
    }
}

/// `routing`: an object of finite numbers (which keys and ranges are allowed is the
/// engine's decision: it knows the policies that will serve the request).
pub(crate) fn routing_overrides(
    routing: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<RoutingOverrides, ApiError> {
    let mut out = RoutingOverrides::default();
    for (key, value) in routing.into_iter().flatten() {
        let param = format!("routing.{}", crate::error::truncate_for_echo(key));
        match value.as_f64() {
            Some(v) if v.is_finite() => {
                out.0.insert(key.clone(), v);
            }
            _ => {
                return Err(ApiError::invalid(
                    param.clone(),
                    format!("`{param}` must be a finite number"),
                ))
            }
        }
    }
    Ok(out)
}

/// Chat's `logprobs: bool` + `top_logprobs: k` → `Some(k)` / `None`.
pub fn chat_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
    cfg: &ServerConfig,
) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top_logprobs) {
        (false, Some(k)) if k > 0 => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs` to be true",
        )),
        (false, _) => Ok(None),
        (true, k) => bounded_logprobs("top_logprobs", k.unwrap_or(0), cfg).map(Some),
    }
}

/// Completions' legacy `logprobs: k`.
pub fn completion_logprobs(
    logprobs: Option<u64>,
    cfg: &ServerConfig,
) -> Result<Option<usize>, ApiError> {
    logprobs
        .map(|k| bounded_logprobs("logprobs", k, cfg))
        .transpose()
}

fn bounded_logprobs(param: &str, k: u64, cfg: &ServerConfig) -> Result<usize, ApiError> {
    if k > cfg.max_top_logprobs as u64 {
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` must be between 0 and {}, got {k}",
                cfg.max_top_logprobs
            ),
        ));
    }
    Ok(k as usize)
}

/// The request's sampling fields as the engine's type; the value rules are
/// `SamplingParams::validate`'s (the engine checks them again for every front end).
fn sampling_params(f: &CommonFields) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 (disabled) or positive, got {k}"),
            ))
        }
    };
    let mut logit_bias = Vec::new();
    for (key, &bias) in f.logit_bias.iter().flatten() {
        let id: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` keys must be token ids, got {key:?}"),
            )
        })?;
        logit_bias.push((id, finite(Some(bias), "logit_bias", 0.0)?));
    }
    let sampling = SamplingParams {
        temperature: finite(f.temperature, "temperature", d.temperature)?,
        top_p: finite(f.top_p, "top_p", d.top_p)?,
        top_k,
        min_p: finite(f.min_p, "min_p", d.min_p)?,
        repetition_penalty: match (f.repetition_penalty, f.repeat_penalty) {
            (None, Some(given)) => finite(Some(given), "repeat_penalty", d.repetition_penalty)?,
            (given, _) => finite(given, "repetition_penalty", d.repetition_penalty)?,
        },
        presence_penalty: finite(f.presence_penalty, "presence_penalty", d.presence_penalty)?,
        frequency_penalty: finite(
            f.frequency_penalty,
            "frequency_penalty",
            d.frequency_penalty,
        )?,
        logit_bias,
        seed: f.seed.map(|s| s as u64),
        min_tokens: f
            .min_tokens
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        allowed_token_ids: f.allowed_token_ids.clone(),
        bad_words: Vec::new(),
        penalty_last_n: penalty_window(f.repeat_last_n)?,
        llama: None,
        ban_eos: false,
    };
    let mut sampling = sampling;
    f.llama_samplers.apply(false, &mut sampling)?;
    let llama_spelling = f.repetition_penalty.is_none() && f.repeat_penalty.is_some();
    validated(sampling, llama_spelling)
}

/// `sampling` checked; an error about the repetition penalty names `repeat_penalty` when
/// that is how the client spelt it (llama.cpp's clients).
pub fn validated(
    sampling: SamplingParams,
    llama_spelling: bool,
) -> Result<SamplingParams, ApiError> {
    match sampling.validate() {
        Ok(()) => Ok(sampling),
        Err(e) if llama_spelling && e.param == "repetition_penalty" => Err(ApiError::invalid(
            "repeat_penalty",
            e.message.replace("repetition_penalty", "repeat_penalty"),
        )),
        Err(e) => Err(ApiError::invalid(&e.param, e.message)),
    }
}

/// llama.cpp's `repeat_last_n` as the sampler's window: -1 is the whole context.
pub fn penalty_window(repeat_last_n: Option<i64>) -> Result<Option<usize>, ApiError> {
    match repeat_last_n {
        None => Ok(None),
        Some(-1) => Ok(Some(usize::MAX)),
        Some(n) => usize::try_from(n).map(Some).map_err(|_| {
            ApiError::invalid(
                "repeat_last_n",
                format!("`repeat_last_n` must be -1 (the whole context) or at least 0, got {n}"),
            )
        }),
    }
}

/// An optional JSON number as an f32, or `default`.
fn finite(value: Option<f64>, param: &str, default: f32) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        // Finite as an f64 is not enough: 3.5e38 is infinite once it is an f32.
        Some(v) if !v.is_finite() || !(v as f32).is_finite() => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a finite number"),
        )),
        Some(v) => Ok(v as f32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::parse_json;

    fn model() -> ModelChoice {
        ModelChoice {
            name: "tokenrouter".into(),
            pinned: None,
            context_length: 100,
        }
    }

    fn plan(json: &str) -> Result<GenerationPlan, ApiError> {
        let fields: CommonFields = parse_json(json.as_bytes())?;
        let max = fields.max_tokens.map(|m| (m, "max_tokens"));
        GenerationPlan::new(fields, model(), max, None, &ServerConfig::default())
    }

    fn param_of(err: ApiError) -> String {
        match err {
            ApiError::InvalidParam { param, .. } => param,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn rejects_out_of_range_values_naming_the_field() {
        for (json, param) in [
            (r#"{"temperature": -0.5}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"presence_penalty": 3}"#, "presence_penalty"),
            (r#"{"frequency_penalty": -3}"#, "frequency_penalty"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"n": 1000}"#, "n"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"logit_bias": {"abc": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"5": 101}}"#, "logit_bias"),
        ] {
            assert_eq!(param_of(plan(json).unwrap_err()), param, "{json}");
        }
    }

    #[test]
    fn maps_fields_onto_engine_requests() {
        let p = plan(
            r#"{"temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "n": 2,
                "logit_bias": {"42": -100}, "stop_token_ids": [9], "ignore_eos": true,
                "max_tokens": 10, "stop": "x", "return_token_sources": true}"#,
        )
        .unwrap();
        assert!(p.return_token_sources);
        assert_eq!(p.stop.find("abxc", 0), Some(2));
        let reqs = p.requests(&[1, 2, 3]).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[0].sampling.seed, Some(7));
        assert_eq!(reqs[1].sampling.seed, Some(8));
        assert_eq!(reqs[0].sampling.top_k, 5);
        assert_eq!(reqs[0].sampling.temperature, 0.0);
        assert_eq!(reqs[0].sampling.logit_bias, vec![(42, -100.0)]);
        assert_eq!(reqs[0].stop_token_ids, vec![9]);
        assert!(reqs[0].ignore_eos);
        assert_eq!(reqs[0].max_tokens, Some(10));
        assert_eq!(reqs[0].prompt_ids, vec![1, 2, 3]);
    }

    #[test]
    fn an_absent_max_tokens_is_left_to_the_engine_and_an_empty_prompt_is_rejected() {
        // The engine resolves the bound (`GenerateRequest::output_bound`) and checks the
        // context; the plan passes the client's value through.
        assert_eq!(
            plan("{}").unwrap().requests(&[1; 30]).unwrap()[0].max_tokens,
            None
        );
        assert!(plan("{}").unwrap().requests(&[]).is_err());
    }

    #[test]
    fn logprob_options() {
        let cfg = ServerConfig::default();
        assert_eq!(chat_logprobs(Some(true), Some(3), &cfg).unwrap(), Some(3));
        assert_eq!(chat_logprobs(None, None, &cfg).unwrap(), None);
        assert!(chat_logprobs(Some(false), Some(2), &cfg).is_err());
        assert!(chat_logprobs(Some(true), Some(99), &cfg).is_err());
        assert_eq!(completion_logprobs(Some(0), &cfg).unwrap(), Some(0));
    }
}
