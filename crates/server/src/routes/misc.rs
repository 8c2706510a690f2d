//! Operational endpoints: `/health` (503 until the backend is ready and while shutting
//! down), `/metrics` (engine exposition followed by the server's own), `/version`, and the
//! OpenAI-shaped 404 for unknown routes.

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
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

pub async fn metrics(State(state): State<AppState>) -> Response {
    let mut text = state.backend.metrics_text();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&state.metrics.render());
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
