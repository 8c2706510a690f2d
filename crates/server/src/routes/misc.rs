//! Operational endpoints: `/health` (503 until the backend is ready and while shutting
//! down), SGLang's `/health_generate` (a token from every model), `/get_model_info`,
//! `/get_server_info`, `/get_load` (what SGLang's router polls) and `/flush_cache` (vLLM's
//! `/reset_prefix_cache`), `/abort_request`,
//! `/metrics` (engine exposition followed by the server's own), `/version`, and the
//! OpenAI-shaped 404 for unknown routes.

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;
use tokenrouter_api::{GenerateEvent, GenerateRequest, SamplingParams, SubmitError};

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::state::AppState;

pub async fn health(State(state): State<AppState>) -> Response {
    let (status, word) = if state.lifecycle.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else if !state.backend.is_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    } else {
        let unhealthy = state.backend.unhealthy();
        if !unhealthy.is_empty() {
            let models: serde_json::Map<String, serde_json::Value> = unhealthy
                .into_iter()
                .map(|(name, why)| (name, serde_json::Value::String(why)))
                .collect();
            let body = json!({ "status": "unhealthy", "models": models });
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "5")],
                Json(body),
            )
                .into_response();
        }
        (StatusCode::OK, "ok")
    };
    (status, Json(json!({ "status": word }))).into_response()
}

/// How long `/health_generate` waits for its tokens.
const HEALTH_GENERATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// SGLang's `/health_generate`: one token from each model, pinned to it, so a sub-server
/// that is alive but stuck fails the probe; 200 with each model's seconds, else 503 naming
/// what failed. It goes through admission like any request (a full queue is a 503).
pub async fn health_generate(State(state): State<AppState>) -> Result<Response, ApiError> {
    state.check_ready()?;
    state.check_accepting()?;
    let prompt = state.backend.encode("ping")?;
    let names: Vec<String> = state.backend.models().into_iter().map(|m| m.name).collect();
    let requests = (0..names.len())
        .map(|m| GenerateRequest {
            prompt_ids: prompt.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: Some(1),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            pinned_model: Some(m),
            top_logprobs: 0,
            routing: Default::default(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
            cache_salt: None,
        })
        .collect();
    let started = std::time::Instant::now();
    let streams = state.backend.submit_all(requests)?;
    let mut seconds = serde_json::Map::new();
    for (mut stream, name) in streams.into_iter().zip(names) {
        let finished = tokio::time::timeout(HEALTH_GENERATE_TIMEOUT, async {
            loop {
                match stream.events.recv().await {
                    Some(GenerateEvent::Finished { .. }) => return Ok(()),
                    Some(GenerateEvent::Error(e)) => return Err(e),
                    None => return Err("the request ended without finishing".to_string()),
                    Some(_) => {}
                }
            }
        })
        .await;
        match finished {
            Ok(Ok(())) => {
                seconds.insert(name, json!(started.elapsed().as_secs_f64()));
            }
            Ok(Err(why)) => {
                return Err(ApiError::from(SubmitError::NotReady(format!(
                    "model `{name}` failed to generate: {why}"
                ))))
            }
            Err(_) => {
                return Err(ApiError::from(SubmitError::NotReady(format!(
                    "model `{name}` wrote no token within {} s",
                    HEALTH_GENERATE_TIMEOUT.as_secs()
                ))))
            }
        }
    }
    Ok(Json(json!({"status": "ok", "seconds": seconds})).into_response())
}

/// SGLang's `/get_model_info`: the entry model's path (the pair shares its tokenizer), and
/// every model of the pair.
pub async fn model_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let models = state.backend.models();
    let path = models.first().map(|m| m.source.clone()).unwrap_or_default();
    Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "served_model_name": state.config.served_model_name,
        "models": models,
    }))
}

/// SGLang's `/get_server_info` (and its newer name `/server_info`): what a client or SGLang's
/// router reads about the server — the entry model and its context, every model of the pair,
/// one data-parallel rank of one tensor-parallel rank, and each model's load now.
pub async fn server_info(State(state): State<AppState>) -> Json<serde_json::Value> {
    let models = state.backend.models();
    let entry = models.first();
    let path = entry.map(|m| m.source.clone()).unwrap_or_default();
    let loads: Vec<serde_json::Value> = state
        .backend
        .load()
        .iter()
        .map(|l| {
            json!({"model": l.name, "num_running_reqs": l.running, "num_queue_reqs": l.waiting,
                "token_usage": l.kv_usage, "num_used_tokens": l.kv_tokens})
        })
        .collect();
    Json(json!({
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": state.config.served_model_name,
        "context_length": entry.map(|m| m.context_length),
        "is_embedding": false,
        "dp_size": 1,
        "tp_size": 1,
        "api_key_required": state.config.api_key.is_some(),
        "models": models,
        "internal_states": [{"dp_rank": 0, "models": loads}],
        "version": env!("CARGO_PKG_VERSION"),
    }))
}

/// SGLang's `/get_load`, which its router's load-aware policies poll: one entry per
/// data-parallel rank (one here) with the requests in the models' running batches, those
/// queued, and the tokens their KV blocks hold — summed over the pair, as `/metrics` sums them.
pub async fn get_load(State(state): State<AppState>) -> Json<serde_json::Value> {
    let load = state.backend.load();
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": load.iter().map(|m| m.running).sum::<usize>(),
        "num_waiting_reqs": load.iter().map(|m| m.waiting).sum::<usize>(),
        "num_tokens": load.iter().map(|m| m.kv_tokens).sum::<usize>(),
    }]))
}

/// SGLang's `/flush_cache` and vLLM's `/reset_prefix_cache`: every model forgets its cached
/// prefixes before any request that arrives after this answer (running requests keep what
/// they hold, so unlike SGLang it need not wait for an idle server).
pub async fn flush_cache(State(state): State<AppState>) -> Result<&'static str, ApiError> {
    state.backend.flush_cache()?;
    Ok("Cache flushed.\n")
}

/// SGLang's `/abort_request` body: the rid of a running request, or all.
#[derive(Debug, Deserialize)]
pub struct AbortRequest {
    #[serde(default)]
    rid: String,
    #[serde(default)]
    abort_all: bool,
}

/// SGLang's `/abort_request`: the requests running under `rid` (or all, with
/// `abort_all`) end now with finish reason `abort` and what they wrote; 200 whether or not
/// any was running, as SGLang answers.
pub async fn abort_request(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<AbortRequest>,
) -> StatusCode {
    let stopped = match body.abort_all {
        true => state.aborts.abort_all(),
        false => state.aborts.abort(&body.rid),
    };
    tracing::info!(rid = %body.rid, abort_all = body.abort_all, stopped, "abort_request");
    StatusCode::OK
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    let mut text = state.backend.metrics_text();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&state.metrics.render());
    text.push_str(&crate::metrics::load_text(
        &state.backend.load(),
        &state.config.served_model_name,
    ));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn version() -> Json<serde_json::Value> {
    Json(json!({ "name": "tokenrouter", "version": env!("CARGO_PKG_VERSION") }))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::RouteNotFound(crate::error::truncate_for_echo(uri.path()))
}

/// A known route asked with the wrong method: 405 with an OpenAI-shaped body.
pub async fn method_not_allowed(method: axum::http::Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: crate::error::truncate_for_echo(method.as_str()),
        path: crate::error::truncate_for_echo(uri.path()),
    }
}
