//! The seam between what users touch (HTTP server, library API, web view) and the
//! token-routing engine. The server only knows this trait, so it can be tested with a
//! mock backend, and the engine can evolve without touching HTTP code.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub mod fim_markers;
pub mod llama_chain;
pub use llama_chain::{DryParams, LlamaChain, LlamaStage};
use tokio::sync::mpsc;

/// Index of a configured model (0 = the entry model, usually the small one).
pub type ModelIndex = usize;

/// One configured model, as exposed by `/v1/models` and used in provenance fields.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelInfo {
    /// Name from the config (e.g. "quick", "reference").
    pub name: String,
    /// Where the weights came from (path or hub id), for display.
    pub source: String,
    /// Maximum sequence length (prompt + output) the model accepts.
    pub context_length: usize,
}

/// Sampling settings of one request; applied by whichever model writes a token. The one
/// sampling type from the HTTP layer down to the runtime's sampler, with OpenAI's defaults
/// (temperature 1.0).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means disabled.
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// (token id, bias added to the logit).
    pub logit_bias: Vec<(u32, f32)>,
    /// Seeds the request's own RNG; None = a random seed.
    pub seed: Option<u64>,
    /// vLLM's `min_tokens`: no stop id (EOS, `stop_token_ids`) is picked before this many
    /// tokens are written.
    #[serde(default)]
    pub min_tokens: usize,
    /// vLLM's `allowed_token_ids`: only these ids are picked (`None`: any).
    #[serde(default)]
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`, as token sequences: a sequence's last id is not picked right
    /// after the rest of it (a one-id sequence: never).
    #[serde(default)]
    pub bad_words: Vec<Vec<u32>>,
    /// llama.cpp's `repeat_last_n`: `Some(n)` makes all three penalties count the last n
    /// tokens of prompt and output (0: no penalties); `None` is vLLM's rule: the repetition
    /// penalty over prompt and output, presence and frequency over the output.
    #[serde(default)]
    pub penalty_last_n: Option<usize>,
    /// llama.cpp's sampler chain (its extra samplers and its order), for requests that ask
    /// for it; `None`: vLLM's order (temperature, then top-k, min-p, top-p).
    #[serde(default)]
    pub llama: Option<LlamaChain>,
    /// llama.cpp's `ignore_eos`: the ids that end generation are never drawn (llama.cpp
    /// biases them by -inf; vLLM's `ignore_eos` only keeps them from stopping the answer).
    /// The engine bans them as one-id `bad_words`.
    #[serde(default)]
    pub ban_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            min_tokens: 0,
            allowed_token_ids: None,
            bad_words: Vec::new(),
            penalty_last_n: None,
            llama: None,
            ban_eos: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), everything else at its default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// The one place sampling values are checked (the engine checks every request with it,
    /// whatever front end built it): finite, and within the ranges OpenAI and SGLang accept.
    /// The error names the field.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let fields = [
            (
                "temperature",
                self.temperature,
                0.0,
                f32::MAX,
                "must be >= 0",
            ),
            (
                "top_p",
                self.top_p,
                f32::MIN_POSITIVE,
                1.0,
                "must be in (0, 1]",
            ),
            ("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                f32::MIN_POSITIVE,
                f32::MAX,
                "must be > 0",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                -2.0,
                2.0,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                -2.0,
                2.0,
                "must be in [-2, 2]",
            ),
        ];
        for (param, value, low, high, rule) in fields {
            if !value.is_finite() {
                return Err(InvalidParam::new(
                    param,
                    format!("`{param}` must be a finite number"),
                ));
            }
            if !(low..=high).contains(&value) {
                return Err(InvalidParam::new(
                    param,
                    format!("`{param}` {rule}, got {value}"),
                ));
            }
        }
        if let Some((id, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(InvalidParam::new(
                "logit_bias",
                format!("`logit_bias` values must be in [-100, 100], got {bias} for {id}"),
            ));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(InvalidParam::new(
                "allowed_token_ids",
                "`allowed_token_ids` must not be empty".into(),
            ));
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return Err(InvalidParam::new(
                "bad_words",
                "a bad word must be at least one token".into(),
            ));
        }
        if let Some(chain) = &self.llama {
            chain.validate()?;
        }
        Ok(())
    }

    /// Whether some id may be masked at some step: `min_tokens`, `allowed_token_ids` or
    /// `bad_words` (see `TokenRestrictions` in the engine).
    pub fn restricts_tokens(&self) -> bool {
        self.min_tokens > 0 || self.allowed_token_ids.is_some() || !self.bad_words.is_empty()
    }

    /// Plain greedy decoding: the argmax of the raw logits is the token (no temperature,
    /// penalties or bias), so the choice can be made where the logits are (e.g. a GPU).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.is_empty()
            && !self.llama.as_ref().is_some_and(LlamaChain::extra_samplers)
    }
}

/// A request field with a bad value: which field, and why (OpenAI's error `param`).
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[error("{message}")]
pub struct InvalidParam {
    pub param: String,
    pub message: String,
}

impl InvalidParam {
    pub fn new(param: &str, message: String) -> Self {
        Self {
            param: param.to_string(),
            message,
        }
    }
}

impl From<InvalidParam> for SubmitError {
    fn from(e: InvalidParam) -> Self {
        SubmitError::InvalidField {
            param: e.param,
            message: e.message,
        }
    }
}

/// One generation (one choice). `n > 1` is n requests with derived seeds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Maximum number of generated tokens; `None` = up to the context length (see
    /// [`GenerateRequest::output_bound`], which every backend applies the same way).
    pub max_tokens: Option<usize>,
    /// Extra stop token ids (the model's EOS ids are always stop tokens unless ignore_eos).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Pin the whole request to one model (query-level routing), by model index.
    pub pinned_model: Option<ModelIndex>,
    /// Number of top alternatives to report per token (0 = none). The chosen token's
    /// logprob is always reported.
    pub top_logprobs: usize,
    /// Per-request overrides of the routing method's kwargs (e.g. `threshold`), checked by
    /// the engine against what the serving policies accept.
    #[serde(default)]
    pub routing: RoutingOverrides,
    /// Score the prompt (`echo` with `logprobs`, lm-eval's log-likelihood requests): the
    /// log-probability of every prompt token after the first under the model that reads
    /// the prompt, with this many top alternatives each, sent as one
    /// [`GenerateEvent::Prompt`] before any token. One model's numbers: it needs
    /// `pinned_model` (a routed request's prompt is read by the entry model only, so its
    /// scores would not be the routed system's).
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// Structured output: every token is chosen among those that can continue the
    /// constraint (`response_format` JSON modes, vLLM's `guided_*`); a pinned or routed
    /// request alike, whichever model writes a position.
    #[serde(default)]
    pub constraint: Option<OutputConstraint>,
    /// vLLM's `priority`: with priority scheduling, a model serves the requests waiting for
    /// it lowest value first (then oldest first), and frees KV from the highest first when
    /// it must preempt. 0 unless asked; without priority scheduling anything else is
    /// refused.
    #[serde(default)]
    pub priority: i32,
    /// vLLM's `cache_salt`: the request shares prefix-cache blocks only with requests of the
    /// same salt (tenants cannot time each other's prompts).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// The `param` a backend names when it refuses a request's constraint
/// (`SubmitError::InvalidField`); front ends rename it to the field their client sent.
pub const CONSTRAINT_PARAM: &str = "constraint";

/// What a constrained request's output must be (see `GenerateRequest::constraint`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema (`json_schema`, `guided_json`).
    JsonSchema(serde_json::Value),
    /// Text the whole of which matches this regular expression (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (`guided_grammar`).
    Lark(String),
    /// A GBNF grammar: llama.cpp's `grammar`, SGLang's `ebnf`, vLLM's `guided_grammar`
    /// written with `::=`.
    Gbnf(String),
}

impl OutputConstraint {
    /// A grammar in whichever of the two dialects it is written: GBNF when some line defines
    /// a rule with `::=` (Lark defines with `:`, and `::=` is no Lark syntax; vLLM tells
    /// them apart the same way), else Lark (llama.cpp's `%llguidance` grammars too).
    pub fn grammar(text: String) -> OutputConstraint {
        let is_gbnf = text.lines().any(|line| {
            let line = line.trim_start();
            let name_end = line
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
                .unwrap_or(line.len());
            name_end > 0 && line[name_end..].trim_start().starts_with("::=")
        });
        if is_gbnf && !text.trim_start().starts_with("%llguidance") {
            OutputConstraint::Gbnf(text)
        } else {
            OutputConstraint::Lark(text)
        }
    }
}

impl GenerateRequest {
    /// The output bound this request gets on a model with `context_length` tokens: its
    /// `max_tokens`, or whatever room the prompt leaves. A bound of 0, or a prompt plus bound
    /// beyond the context, is refused with the numbers the client needs to fix it.
    pub fn output_bound(&self, context_length: usize) -> Result<usize, SubmitError> {
        let prompt_tokens = self.prompt_ids.len();
        if self.max_tokens == Some(0) {
            return Err(SubmitError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let bound = self
            .max_tokens
            .unwrap_or_else(|| context_length.saturating_sub(prompt_tokens));
        if bound == 0 || prompt_tokens.saturating_add(bound) > context_length {
            return Err(SubmitError::ContextTooLong {
                prompt_tokens,
                max_tokens: bound,
                context_length,
            });
        }
        Ok(bound)
    }
}

/// Our extension `"routing": {"threshold": 0.1}`: one request overrides numeric kwargs of
/// the configured routing method, so one server serves every point of a threshold sweep and
/// a client can buy quality per request. Keys and ranges are checked by the engine against
/// the policies that will serve the request (unknown key or out of range: 400).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RoutingOverrides(pub BTreeMap<String, f64>);

impl RoutingOverrides {
    pub fn get(&self, key: &str) -> Option<f64> {
        self.0.get(key).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop token id.
    Stop,
    /// max_tokens or the context length reached.
    Length,
    /// Aborted by the client or the server (shutdown).
    Abort,
}

/// One generated token with its provenance.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Which model wrote it.
    pub source: ModelIndex,
    /// Natural-log probability of `id` under the writing model's (temperature-free) distribution.
    pub logprob: f32,
    /// Top alternatives (id, natural-log probability), best first; empty unless asked.
    pub top_logprobs: Vec<(u32, f32)>,
    /// The router's score for this position when the method has one (e.g. R2R probability,
    /// normalised entropy); None otherwise.
    pub router_score: Option<f32>,
    /// 1-based rank of `id` among the model's logits (prompt scores; None for written
    /// tokens).
    pub rank: Option<u32>,
}

/// What the engine streams back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerateEvent {
    /// The prompt's scores (see [`GenerateRequest::prompt_logprobs`]): one entry per prompt
    /// token after the first, in order; `source` is the scoring model, `router_score` None.
    Prompt(Vec<TokenEvent>),
    /// How many prompt tokens the request's first model took from its prefix cache instead
    /// of computing them (OpenAI's `cached_tokens`): sent once, before the first token, when
    /// that model caches prefixes.
    PromptCached(usize),
    Token(TokenEvent),
    Finished {
        reason: FinishReason,
    },
    Error(String),
}

/// Receiving half of a request. Dropping it aborts the request in every model
/// (the engine notices the closed channel within one step and frees all KV).
pub struct GenerateStream {
    pub request_id: u64,
    /// The output bound the backend applied ([`GenerateRequest::output_bound`]).
    pub max_tokens: usize,
    /// The ids that end the request (the models' EOS unless `ignore_eos`, and the
    /// request's `stop_token_ids`): a front end leaves such a last token's text out of the
    /// answer, as vLLM does unless `include_stop_str_in_output`.
    pub stop_ids: Vec<u32>,
    pub events: mpsc::UnboundedReceiver<GenerateEvent>,
}

/// Errors a submission can hit before any token is produced; each maps to one HTTP status.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum SubmitError {
    /// 429: the bounded queue is full.
    #[error(
        "the server is overloaded: {queued} requests are queued (max_queued_requests = {limit})"
    )]
    QueueFull { queued: usize, limit: usize },
    /// 429: the prompt tokens of the requests inside the engine would exceed the bound.
    #[error("the server is overloaded: {queued} prompt tokens are queued, {requested} more requested (max_queued_prompt_tokens = {limit})")]
    PromptTokensFull {
        queued: usize,
        requested: usize,
        limit: usize,
    },
    /// 400: prompt + max_tokens do not fit.
    #[error("this model's maximum context length is {context_length} tokens, but {prompt_tokens} prompt tokens + {max_tokens} max_tokens were requested")]
    ContextTooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        context_length: usize,
    },
    /// 400: bad parameters the engine detected (e.g. empty prompt, unknown pinned model).
    #[error("{0}")]
    InvalidRequest(String),
    /// 400: one named request field is invalid (`param` in the OpenAI error object).
    #[error("{message}")]
    InvalidField { param: String, message: String },
    /// 503: still loading or shutting down.
    #[error("the server is not ready: {0}")]
    NotReady(String),
}

/// A chat message as the chat template sees it. The tool fields are absent (undefined in
/// the template) unless set, which is how tool-aware templates such as Qwen2.5's tell a
/// plain message from an assistant's tool calls or a tool's result.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": {...}}}]`, the arguments as a JSON object (what templates expect; the
    /// OpenAI API carries them as a string, which the server parses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool message's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name (OpenAI's `name`; a tool message's function name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's earlier thinking (Qwen3's template reads `reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A plain message: no tool calls, no name.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// Errors from tokenizer and template calls (400 for user input).
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TextError {
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("chat template error: {0}")]
    Template(String),
}

/// Everything the server needs from the engine.
pub trait Backend: Send + Sync + 'static {
    /// Configured models, entry model first.
    fn models(&self) -> Vec<ModelInfo>;
    /// True once every model is loaded and every loop is alive.
    fn is_ready(&self) -> bool;
    /// Tokenize (special tokens such as `<|im_start|>` are parsed; no BOS added unless the
    /// tokenizer's post-processor does so).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError>;
    /// Detokenize; `skip_special` drops special tokens such as `<|im_end|>`.
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError>;
    /// Render the chat template; `kwargs` are extra template variables
    /// (e.g. `{"enable_thinking": false}`).
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Value,
    ) -> Result<String, TextError>;
    /// Queue a generation; tokens stream back on the returned channel.
    fn submit(&self, request: GenerateRequest) -> Result<GenerateStream, SubmitError>;
    /// Queue several generations as one (the choices and prompts of one API request): all
    /// are admitted or none. The default submits one by one and drops what was admitted
    /// when one is refused; the engine reserves room for all of them atomically.
    fn submit_all(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateStream>, SubmitError> {
        requests.into_iter().map(|r| self.submit(r)).collect()
    }
    /// Prometheus text exposition of the engine's metrics.
    fn metrics_text(&self) -> String;
    /// Every model forgets its cached prefixes (SGLang's `/flush_cache`, vLLM's
    /// `/reset_prefix_cache`): requests submitted after the call reuse nothing computed
    /// before it; running requests keep what they hold. `NotReady` once the engine stopped.
    fn flush_cache(&self) -> Result<(), SubmitError>;
    /// Routing overrides a fill-in-the-middle request (an editor's completion: `/infill`,
    /// `suffix`) gets when it gives none of its own; none by default.
    fn fim_routing(&self) -> RoutingOverrides {
        RoutingOverrides::default()
    }

    /// Models that cannot serve now (name, why): a model whose loop went down, or one stuck
    /// in a step past the watchdog. `/health` answers 503 naming them.
    fn unhealthy(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// How busy each model is now (for `/metrics`' vLLM and SGLang names, which load-aware
    /// routers and autoscalers read). None by default.
    fn load(&self) -> Vec<ModelLoad> {
        Vec::new()
    }
}

/// One model's load now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelLoad {
    pub name: String,
    /// Requests in its running batch.
    pub running: usize,
    /// Requests queued at it.
    pub waiting: usize,
    /// Fraction of its KV blocks in use.
    pub kv_usage: f64,
    /// Tokens its KV blocks in use can hold (whole blocks).
    pub kv_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(prompt_tokens: usize, max_tokens: Option<usize>) -> GenerateRequest {
        GenerateRequest {
            prompt_ids: vec![1; prompt_tokens],
            sampling: SamplingParams::greedy(),
            max_tokens,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            pinned_model: None,
            top_logprobs: 0,
            routing: RoutingOverrides::default(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
            cache_salt: None,
        }
    }

    #[test]
    fn grammars_are_read_as_gbnf_or_lark() {
        let gbnf = ["root ::= \"a\"", "# c\n  value-1 ::= [0-9]+\n", "r::=x"];
        for text in gbnf {
            assert!(matches!(
                OutputConstraint::grammar(text.into()),
                OutputConstraint::Gbnf(_)
            ));
        }
        let lark = [
            "start: \"a\" | \"b\"",
            "start: x\nx: \"::=\"",
            "%llguidance {}\nstart: x\n// root ::= x\nx: \"a\"",
        ];
        for text in lark {
            assert!(matches!(
                OutputConstraint::grammar(text.into()),
                OutputConstraint::Lark(_)
            ));
        }
    }

    #[test]
    fn default_max_tokens_fills_the_context_and_overflow_is_rejected() {
        assert_eq!(request(30, None).output_bound(100), Ok(70));
        assert_eq!(request(30, Some(10)).output_bound(100), Ok(10));
        assert_eq!(request(30, Some(70)).output_bound(100), Ok(70));
        let err = request(30, Some(80)).output_bound(100).unwrap_err();
        assert!(
            err.to_string().contains("100") && err.to_string().contains("80"),
            "{err}"
        );
        assert!(matches!(
            request(100, None).output_bound(100),
            Err(SubmitError::ContextTooLong { .. })
        ));
        assert!(request(30, Some(0)).output_bound(100).is_err());
    }

    #[test]
    fn validate_names_the_bad_field() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy().validate().is_ok());
        let bad = [
            SamplingParams {
                temperature: -0.1,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: f32::INFINITY,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(3, 101.0)],
                ..Default::default()
            },
        ];
        let params: Vec<String> = bad
            .iter()
            .map(|s| s.validate().unwrap_err().param)
            .collect();
        assert_eq!(
            params,
            [
                "temperature",
                "top_p",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "logit_bias"
            ]
        );
    }
}
