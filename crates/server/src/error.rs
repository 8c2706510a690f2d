//! Typed errors of the HTTP layer. Every variant knows its HTTP status and renders as the
//! OpenAI error body `{"error": {"message", "type", "param", "code"}}`, so handlers can
//! use `?` and clients written for OpenAI/vLLM parse our failures unchanged.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tokenrouter_api::{SubmitError, TextError};

/// An error answered to an HTTP client.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ApiError {
    /// 400: the body is not JSON, or a field has the wrong type.
    #[error("{message}")]
    InvalidJson {
        message: String,
        param: Option<String>,
    },
    /// 400: a field is present and well-typed but its value is not allowed.
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// 400: a required field is absent.
    #[error("the `{0}` field is required")]
    MissingField(String),
    /// 401: `Authorization: Bearer <key>` missing or wrong.
    #[error("invalid or missing API key; send `Authorization: Bearer <key>`")]
    Unauthorized,
    /// 404: the `model` field names no served model.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// 404: no stored response has this id (`param`: the field that named it, if any).
    #[error("no stored response has the id `{id}`")]
    ResponseNotFound { id: String, param: Option<String> },
    /// 404: no such route.
    #[error("no route for {0}")]
    RouteNotFound(String),
    /// 400: the prompt text is too long to ever fit, refused before tokenizing.
    #[error("the prompt has {bytes} bytes; at most {limit} are accepted for this model ({context_length} tokens of context)")]
    PromptTooLong {
        bytes: usize,
        limit: usize,
        context_length: usize,
    },
    /// 405: the route exists, the method does not.
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    /// 413: the body exceeds `max_body_bytes`.
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// 429 / 400 / 503: the engine refused the submission.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// 400: tokenizer or chat template failed on user input.
    #[error(transparent)]
    Text(#[from] TextError),
    /// 503: the server is draining for shutdown, or the request was aborted by it.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// 503: the engine aborted the request (e.g. its own shutdown).
    #[error("the request was aborted by the engine")]
    Aborted,
    /// 500: the engine reported a failure while generating.
    #[error("generation failed: {0}")]
    Engine(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidParam {
            param: param.into(),
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson { .. }
            | ApiError::InvalidParam { .. }
            | ApiError::MissingField(_)
            | ApiError::PromptTooLong { .. }
            | ApiError::Text(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_)
            | ApiError::RouteNotFound(_)
            | ApiError::ResponseNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Submit(e) => match e {
                SubmitError::QueueFull { .. } | SubmitError::PromptTokensFull { .. } => {
                    StatusCode::TOO_MANY_REQUESTS
                }
                SubmitError::ContextTooLong { .. }
                | SubmitError::InvalidRequest(_)
                | SubmitError::InvalidField { .. } => StatusCode::BAD_REQUEST,
                SubmitError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            },
            ApiError::ShuttingDown | ApiError::Aborted => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` field.
    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            StatusCode::INTERNAL_SERVER_ERROR => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's `param` field.
    pub(crate) fn param(&self) -> Option<String> {
        match self {
            ApiError::InvalidJson { param, .. } => param.clone(),
            ApiError::InvalidParam { param, .. } => Some(param.clone()),
            ApiError::MissingField(field) => Some(field.clone()),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::ResponseNotFound { param, .. } => param.clone(),
            ApiError::Submit(SubmitError::InvalidField { param, .. }) => Some(param.clone()),
            _ => None,
        }
    }

    /// OpenAI's `code` field: a stable machine-readable reason.
    fn code(&self) -> &'static str {
        match self {
            ApiError::InvalidJson { .. } => "invalid_json",
            ApiError::InvalidParam { .. } => "invalid_value",
            ApiError::MissingField(_) => "missing_required_parameter",
            ApiError::Unauthorized => "invalid_api_key",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::RouteNotFound(_) => "not_found",
            ApiError::ResponseNotFound { .. } => "response_not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::PromptTooLong { .. } => "context_length_exceeded",
            ApiError::BodyTooLarge { .. } => "request_too_large",
            ApiError::Submit(SubmitError::QueueFull { .. }) => "queue_full",
            ApiError::Submit(SubmitError::PromptTokensFull { .. }) => "queue_full",
            ApiError::Submit(SubmitError::ContextTooLong { .. }) => "context_length_exceeded",
            ApiError::Submit(SubmitError::InvalidRequest(_)) => "invalid_request",
            ApiError::Submit(SubmitError::InvalidField { .. }) => "invalid_value",
            ApiError::Submit(SubmitError::NotReady(_)) => "not_ready",
            ApiError::Text(_) => "invalid_text",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Aborted => "aborted",
            ApiError::Engine(_) => "engine_error",
        }
    }

    /// The JSON body (also sent as an SSE `data:` event when a stream fails mid-way).
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        }
    }
}

/// A user-supplied value as it may appear in an error message: at most 64 characters, so a
/// megabyte-long field is never echoed back whole.
pub fn truncate_for_echo(value: &str) -> String {
    const MAX: usize = 64;
    match value.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &value[..cut]),
        None => value.to_string(),
    }
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: &'static str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        }
        let mut response = (status, Json(self.body())).into_response();
        // Overload and unavailability are temporary: say when to come back.
        let retry_after = match status {
            StatusCode::TOO_MANY_REQUESTS => Some("1"),
            StatusCode::SERVICE_UNAVAILABLE => Some("5"),
            _ => None,
        };
        if let Some(v) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(v),
            );
        }
        response
    }
}

/// Errors that stop [`crate::serve`] itself.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("server I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("metrics registry error: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error(
        "invalid CORS origin `{0}`: expected `*` or an origin such as `https://app.example.com`"
    )]
    CorsOrigin(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_errors_map_to_their_statuses() {
        let full = ApiError::from(SubmitError::QueueFull {
            queued: 4,
            limit: 4,
        });
        assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
        let long = ApiError::from(SubmitError::ContextTooLong {
            prompt_tokens: 10,
            max_tokens: 20,
            context_length: 16,
        });
        assert_eq!(long.status(), StatusCode::BAD_REQUEST);
        assert!(long.to_string().contains("16"));
        let loading = ApiError::from(SubmitError::NotReady("loading".into()));
        assert_eq!(loading.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn body_has_openai_shape() {
        let body = serde_json::to_value(ApiError::invalid("top_p", "bad").body()).unwrap();
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "invalid_value");
        assert_eq!(body["error"]["message"], "bad");
    }
}
