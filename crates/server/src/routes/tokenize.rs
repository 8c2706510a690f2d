//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes), handy to count tokens or check
//! what a chat template produces without generating.

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::openai::request::{DetokenizeRequest, TokenizeRequest};
use crate::routes::chat::{render_prompt, PromptEnd};
use crate::state::AppState;

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
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
            None,
        )?,
        (None, Some(prompt)) => prompt,
        (None, None) => return Err(ApiError::MissingField("prompt".into())),
    };
    let tokens = state.backend.encode(&text)?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
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
    Ok(Json(DetokenizeResponse { prompt }))
}
