//! Request bodies of the OpenAI-compatible endpoints, split into views parsed from the same
//! JSON object: [`CommonFields`] (sampling, stop, stream, n, extensions) shared by chat and
//! completions, plus one struct per endpoint. Unknown fields are ignored, as OpenAI
//! clients send many we do not use.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value};

/// Fields shared by `/v1/chat/completions` and `/v1/completions`.
#[derive(Debug, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// llama.cpp's spelling of `repetition_penalty` (its OpenAI endpoints take its keys).
    pub repeat_penalty: Option<f64>,
    /// llama.cpp's penalty window: given, all three penalties count the last n tokens of
    /// prompt and answer (0: none; -1: all); absent, vLLM's rule.
    pub repeat_last_n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// llama.cpp's samplers and chain order (DRY, XTC, typical-p, …; see
    /// `crate::llama_samplers`): given, the request samples through llama.cpp's chain.
    #[serde(flatten)]
    pub llama_samplers: crate::llama_samplers::LlamaSamplerFields,
    /// Token id (as a decimal string, OpenAI's shape) → bias added to the logit.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<u64>,
    /// `{"type": "text"}`, `json_object` or `json_schema` (see `constraint`).
    pub response_format: Option<Value>,
    /// vLLM's structured output fields (see `constraint`).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// vLLM's newer spelling: `{"json" | "regex" | "choice" | "grammar" | "json_object"}`.
    pub structured_outputs: Option<Value>,
    /// llama.cpp's GBNF grammar (its OpenAI endpoints take it too).
    pub grammar: Option<String>,
    /// SGLang's structured output fields on its OpenAI endpoints: a regex, an EBNF grammar.
    pub regex: Option<String>,
    pub ebnf: Option<String>,
    /// vLLM's extension: score the prompt with this many alternatives a token.
    pub prompt_logprobs: Option<i64>,
    /// vLLM's token restrictions: no stop token or stop string before `min_tokens` tokens;
    /// only `allowed_token_ids`; never `bad_words` (see `SamplingParams`).
    pub min_tokens: Option<u64>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub bad_words: Option<Vec<String>>,
    /// vLLM's: the matched stop string (or stop token's text) stays in the answer.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: special tokens are left out of the text (default true).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: keep the prompt's last k tokens (-1: as many as fit the context).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: logprob entries name tokens as `token_id:{id}`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's: lower is served first under priority scheduling (0 otherwise).
    pub priority: Option<i64>,
    /// vLLM's: the request shares prefix-cache blocks only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// SGLang's: the request's id, which `/abort_request` names to stop it.
    pub rid: Option<String>,
    /// Extension: report which model wrote each token.
    pub return_token_sources: Option<bool>,
    /// Extension: per-request overrides of the routing method's kwargs
    /// (`{"threshold": 0.1}`); the engine checks keys and ranges.
    pub routing: Option<Map<String, Value>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's: usage so far on every chunk too (with `include_usage`).
    pub continuous_usage_stats: Option<bool>,
}

/// `stop`: one string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    /// The non-empty stop strings.
    pub fn into_vec(self) -> Vec<String> {
        let all = match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        };
        all.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

/// Fields of `/v1/chat/completions` beyond [`CommonFields`].
#[derive(Debug, Deserialize)]
pub struct ChatFields {
    pub messages: Vec<RequestMessage>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM's: return the thinking (`--reasoning-parser`); default true.
    pub include_reasoning: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    /// vLLM's / HF's: the answer continues the last message (an assistant's prefix)
    /// instead of starting a new one; needs `add_generation_prompt: false`.
    pub continue_final_message: Option<bool>,
    /// Passed to the chat template as the `tools` variable (checked in `tools::ToolUse`).
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (the default), `"none"`; `"required"` and named functions are refused.
    pub tool_choice: Option<Value>,
    /// `false`: at most one tool call is returned.
    pub parallel_tool_calls: Option<bool>,
}

/// One chat message; `content` may be a string, a list of text parts, or null.
#[derive(Debug, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    /// An assistant's earlier calls, fed back to the template.
    pub tool_calls: Option<Vec<Value>>,
    /// A tool message's call id.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
    /// An assistant's earlier thinking, under either name clients send it.
    pub reasoning_content: Option<String>,
    pub reasoning: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// Fields of `/v1/completions` beyond [`CommonFields`].
#[derive(Debug, Deserialize)]
pub struct CompletionFields {
    pub prompt: PromptField,
    /// Legacy shape: number of top alternatives per token (0 = only the chosen token).
    pub logprobs: Option<u64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
}

/// `prompt`: text, token ids, or a batch of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

/// `POST /tokenize`: either `prompt` or `messages`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    /// llama.cpp names it `content`.
    #[serde(alias = "content")]
    pub prompt: Option<String>,
    /// llama.cpp's: each token as `{"id", "piece"}`.
    #[serde(default)]
    pub with_pieces: bool,
    pub messages: Option<Vec<RequestMessage>>,
    /// Tools the chat template lists (as a chat request's `tools`).
    pub tools: Option<Vec<Value>>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}
