//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes, and llama.cpp's `content` and
//! `with_pieces`), handy to count tokens or check what a chat template produces without
//! generating; llama.cpp's `POST /apply-template`, the chat template's text alone.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::request::{DetokenizeRequest, TokenizeRequest};
use crate::routes::chat::{render_prompt, PromptEnd};
use crate::state::AppState;
use crate::tools::ToolUse;

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    /// Ids, or with `with_pieces` llama.cpp's `{"id", "piece"}` objects.
    pub tokens: Vec<Value>,
    pub count: usize,
    pub max_model_len: usize,
}

/// vLLM's `prompt` and llama.cpp's `content`: the same text.
#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
    pub content: String,
}

pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let model = state.resolve_model(req.model.as_deref())?;
    state.check_ready()?;
    let text = match (req.messages, req.prompt) {
        (Some(messages), _) => render_prompt(
            &state,
            &messages,
            PromptEnd::new(req.add_generation_prompt, req.continue_final_message)?,
            req.chat_template_kwargs,
            template_tools(&state, req.tools)?,
        )?,
        (None, Some(prompt)) => prompt,
        (None, None) => return Err(ApiError::MissingField("prompt".into())),
    };
    let ids = state.backend.encode(&text)?;
    let tokens = ids
        .iter()
        .map(|&id| match req.with_pieces {
            true => state
                .backend
                .decode(&[id], false)
                .map(|piece| json!({"id": id, "piece": piece})),
            false => Ok(json!(id)),
        })
        .collect::<Result<_, _>>()?;
    Ok(Json(TokenizeResponse {
        count: ids.len(),
        tokens,
        max_model_len: model.context_length,
    }))
}

pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    state.resolve_model(req.model.as_deref())?;
    state.check_ready()?;
    let prompt = state.backend.decode(&req.tokens, false)?;
    Ok(Json(DetokenizeResponse {
        content: prompt.clone(),
        prompt,
    }))
}

/// llama.cpp's `POST /apply-template`: `{"messages": [...]}` (with the chat request's
/// `tools`, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`) →
/// `{"prompt": text}`, the prompt a chat request with those messages would be given.
pub async fn apply_template(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    state.resolve_model(req.model.as_deref())?;
    state.check_ready()?;
    let messages = req
        .messages
        .ok_or_else(|| ApiError::MissingField("messages".into()))?;
    let prompt = render_prompt(
        &state,
        &messages,
        PromptEnd::new(req.add_generation_prompt, req.continue_final_message)?,
        req.chat_template_kwargs,
        template_tools(&state, req.tools)?,
    )?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// A request's `tools` checked and given to the template as a chat request gives them.
fn template_tools(
    state: &AppState,
    tools: Option<Vec<Value>>,
) -> Result<Option<Vec<Value>>, ApiError> {
    Ok(ToolUse::new(tools, None, state.config.tool_call_parser)?.tools)
}
