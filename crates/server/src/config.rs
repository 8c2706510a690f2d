//! Settings of the HTTP layer only (the engine has its own YAML config). Kept as a plain
//! struct with defaults so the CLI can fill it from flags/env and tests from literals.

use std::time::Duration;

pub use crate::cors::CorsPolicy;
pub use crate::reasoning::ReasoningParser;
pub use crate::tools::ToolCallParser;

/// Name under which the token-routed (not pinned) model is served, listed first by
/// `/v1/models`.
pub const DEFAULT_SERVED_MODEL_NAME: &str = "tokenrouter";

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// When set, every `/v1/*` request needs `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    /// Larger request bodies are answered 413.
    pub max_body_bytes: usize,
    /// Name of the routed model: a request whose `model` is this name (or omitted) is routed
    /// token by token; a configured model's name pins the request to that model.
    pub served_model_name: String,
    /// Other names that also mean the routed model (the research system's clients send
    /// `model="default"`); listed by `/v1/models` after the served name.
    pub served_model_aliases: Vec<String>,
    /// On shutdown, in-flight requests may finish for this long before they are aborted.
    pub shutdown_grace: Duration,
    /// Largest accepted `n`.
    pub max_n: usize,
    /// Largest accepted `top_logprobs` (chat) / `logprobs` (completions).
    pub max_top_logprobs: usize,
    /// Prompt text (bytes, all messages together) beyond this many per token of the
    /// model's context is refused before tokenizing: no tokenizer produces fewer tokens, so
    /// such a prompt could never fit, and refusing it costs nothing.
    pub max_prompt_bytes_per_token: usize,
    /// Which browser origins may call the API (CORS); off by default.
    pub cors: CorsPolicy,
    /// How tool calls are read out of chat answers to requests with `tools`.
    pub tool_call_parser: ToolCallParser,
    /// How reasoning models' thinking is told from their answer.
    pub reasoning_parser: ReasoningParser,
    /// Responses API answers kept for `previous_response_id` and `GET /v1/responses/{id}`
    /// (the oldest dropped first; 0 keeps none).
    pub max_stored_responses: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: 4 * 1024 * 1024,
            served_model_name: DEFAULT_SERVED_MODEL_NAME.to_string(),
            served_model_aliases: vec!["default".to_string()],
            shutdown_grace: Duration::from_secs(30),
            max_n: 16,
            max_top_logprobs: 20,
            max_prompt_bytes_per_token: 64,
            cors: CorsPolicy::Off,
            tool_call_parser: ToolCallParser::Hermes,
            reasoning_parser: ReasoningParser::None,
            max_stored_responses: 1000,
        }
    }
}
