//! Anthropic's `POST /v1/messages` and `POST /v1/messages/count_tokens` (see
//! `crate::anthropic`): the request read as a chat request, the answer in Anthropic's
//! shape, errors too.

use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde_json::{json, Value};

use crate::anthropic::message::Answer;
use crate::anthropic::{chat_request, messages_param, AnthropicError};
use crate::extract::ApiJson;
use crate::respond;
use crate::routes::chat;
use crate::state::AppState;

pub async fn messages(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, AnthropicError> {
    let arrival = Instant::now();
    let chat_body = chat_request(&body, false)?;
    let (mut plan, ids) = chat::prepare(&state, &chat_body)
        .await
        .map_err(messages_param)?;
    let generation = respond::start(&state, &mut plan, &[ids], arrival)?;
    let answer = Answer::new(&state, &plan, generation);
    match plan.stream {
        true => Ok(answer.stream()),
        false => Ok(answer.whole().await?),
    }
}

/// The prompt's tokens as the model reads it (template and tools included), nothing
/// generated: `{"input_tokens": N}`.
pub async fn count_tokens(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Json<Value>, AnthropicError> {
    let chat_body = chat_request(&body, true)?;
    let (_, ids) = chat::prepare(&state, &chat_body)
        .await
        .map_err(messages_param)?;
    Ok(Json(json!({"input_tokens": ids.len()})))
}
