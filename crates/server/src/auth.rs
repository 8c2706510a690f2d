//! API-key check for `/v1/*`, SGLang's `/generate`, `/health_generate`, `/get_model_info`,
//! `/get_server_info` (and their newer names), `/flush_cache` and `/abort_request`, vLLM's `/reset_prefix_cache`, and llama.cpp's
//! `/completion`, `/completions` and `/infill` (every route that generates, names
//! the models or changes the server's state) when a key is configured (`Authorization: Bearer <key>`); health, metrics (and SGLang's
//! `/get_load`, the same numbers), version and tokenize stay open, as in vLLM.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = state.config.api_key.as_deref() {
        let path = req.uri().path();
        let guarded = [
            "/generate",
            "/health_generate",
            "/get_model_info",
            "/model_info",
            "/get_server_info",
            "/server_info",
            "/flush_cache",
            "/reset_prefix_cache",
            "/abort_request",
            "/completion",
            "/completions",
            "/infill",
        ];
        if path == "/v1" || path.starts_with("/v1/") || guarded.contains(&path) {
            // OpenAI's clients send a bearer token, Anthropic's an `x-api-key`.
            let headers = req.headers();
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
                .map(str::trim);
            if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
                return ApiError::Unauthorized.into_response();
            }
        }
    }
    next.run(req).await
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn compares_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
