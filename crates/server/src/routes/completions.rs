//! `POST /v1/completions`: a raw prompt (text, token ids, or a batch of either) →
//! generation. Choice `p * n + i` is the i-th sample of prompt p, as in OpenAI.

use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::Value;

use crate::error::ApiError;
use crate::extract::{parse_value, ApiJson};
use crate::openai::request::{CommonFields, CompletionFields, PromptField};
use crate::params::{completion_logprobs, GenerationPlan};
use crate::render::Kind;
use crate::respond::respond;
use crate::state::AppState;

pub async fn completions(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let common: CommonFields = parse_value(&body)?;
    let fields: CompletionFields = parse_value(&body)?;
    let model = state.resolve_model(common.model.as_deref())?;
    state.check_ready()?;
    if fields.echo == Some(true) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    if fields.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let max_tokens = common.max_tokens.map(|m| (m, "max_tokens"));
    let logprobs = completion_logprobs(fields.logprobs, &state.config)?;
    let plan = GenerationPlan::new(common, model, max_tokens, logprobs, &state.config)?;
    let context = plan.model.context_length;
    let prompts = match fields.prompt {
        PromptField::Text(text) => vec![state.encode_prompt(text, context).await?],
        PromptField::Texts(texts) => {
            let mut out = Vec::with_capacity(texts.len());
            for t in texts {
                out.push(state.encode_prompt(t, context).await?);
            }
            out
        }
        PromptField::Tokens(ids) => vec![ids],
        PromptField::TokenBatches(batches) => batches,
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    respond(&state, plan, Kind::Completion, prompts, arrival).await
}
