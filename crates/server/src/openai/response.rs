//! Response bodies of the OpenAI-compatible endpoints, including streamed chunks, plus
//! our extension fields (`tokenrouter`, `token_sources`, `token_details`, and `source` on
//! logprob entries), which are only ever added beside the standard ones.

use std::collections::BTreeMap;

use serde::Serialize;

pub use crate::tools::ToolCall;

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt tokens: how many were read from the prefix cache.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// With `cached` of the prompt tokens read from the prefix cache.
    pub fn with_cached(mut self, cached: usize) -> Self {
        self.prompt_tokens_details.cached_tokens = cached;
        self
    }
}

/// Top-level extension: `{"tokens_by_model": {"quick": 12, "reference": 3}, "switches": 4}`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Provenance {
    pub tokens_by_model: BTreeMap<String, usize>,
    /// Changes of source between consecutive tokens of a choice, summed over choices.
    pub switches: usize,
}

/// Per-token extension entry (with `return_token_sources`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TokenDetail {
    pub source: String,
    /// The part of the choice's visible text that this token produced (may be empty: the
    /// first bytes of a multi-byte character, or tokens of a stop string). Concatenated in
    /// order, the `text` of a choice's tokens is exactly its content.
    pub text: String,
    pub logprob: f32,
    pub router_score: Option<f32>,
}

/// Per-choice extension fields, flattened into a choice object.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChoiceExtension {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_sources: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_details: Option<Vec<TokenDetail>>,
}

// ---- chat ----

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's, when asked: the prompt's scores (see `prompt_logprobs.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    pub tokenrouter: Provenance,
}

/// vLLM's `prompt_logprobs`: per prompt position (the first `null`), token id → candidate.
pub type PromptLogprobs = Vec<Option<serde_json::Map<String, serde_json::Value>>>;

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's: the stop string or `stop_token_ids` id that ended the choice (null otherwise).
    pub stop_reason: serde_json::Value,
    #[serde(flatten)]
    pub ext: ChoiceExtension,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is tool calls alone (or thinking alone).
    pub content: Option<String>,
    /// The thinking (`--reasoning-parser`), under both names clients read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then null except on the final chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenrouter: Option<Provenance>,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: serde_json::Value,
    #[serde(flatten)]
    pub ext: ChoiceExtension,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Thinking written in this chunk (`--reasoning-parser`), under both names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Calls completed in this chunk, each whole (`index` counts the choice's calls).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// `choices[].logprobs` of chat: `{"content": [...]}`.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
    /// Extension: the model that wrote this token.
    pub source: String,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

// ---- completions ----

#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
    pub tokenrouter: Provenance,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<LegacyLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's: the stop string or `stop_token_ids` id that ended the choice (null otherwise).
    pub stop_reason: serde_json::Value,
    /// vLLM's, when asked (see `prompt_logprobs.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    #[serde(flatten)]
    pub ext: ChoiceExtension,
}

#[derive(Debug, Serialize)]
pub struct CompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenrouter: Option<Provenance>,
}

/// Legacy completions logprobs: parallel lists, plus our `sources` list.
#[derive(Debug, Default, Serialize)]
pub struct LegacyLogprobs {
    pub tokens: Vec<String>,
    /// `null` for an echoed prompt's first token (nothing before it to condition on).
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    pub text_offset: Vec<usize>,
    /// Extension: the model that wrote each token.
    pub sources: Vec<String>,
}

impl LegacyLogprobs {
    /// `other`'s entries after these (an echoed prompt's, then the completion's).
    pub fn append(&mut self, other: LegacyLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
        self.sources.extend(other.sources);
    }
}
