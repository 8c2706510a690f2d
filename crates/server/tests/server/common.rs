//! Helpers: build an app over a mock, send requests with `oneshot`, read JSON and SSE.

#![allow(dead_code)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tokenrouter_server::{router, ServerConfig};
use tower::ServiceExt;

use crate::mock::{MockBackend, MockConfig};

pub fn mock() -> Arc<MockBackend> {
    MockBackend::new(MockConfig::default())
}

pub fn app(mock: &Arc<MockBackend>) -> Router {
    router(mock.clone(), ServerConfig::default())
}

pub fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .expect("valid request")
}

pub fn get(path: &str) -> Request<Body> {
    Request::get(path)
        .body(Body::empty())
        .expect("valid request")
}

pub async fn send(app: Router, req: Request<Body>) -> Response {
    app.oneshot(req).await.expect("infallible service")
}

pub async fn text(resp: Response) -> String {
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8 body")
}

/// POSTs `body` as JSON; returns the status and the parsed JSON answer.
pub async fn post_json(app: Router, path: &str, body: Value) -> (StatusCode, Value) {
    let resp = send(app, post(path, body.to_string())).await;
    let status = resp.status();
    let body = text(resp).await;
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    (status, json)
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

/// Streams `body` and returns the parsed JSON chunks (without the final `[DONE]`, which
/// this asserts is the last event).
pub async fn stream_chunks(app: Router, path: &str, body: Value) -> Vec<Value> {
    let resp = send(app, post(path, body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()[header::CONTENT_TYPE].to_str().unwrap_or(""),
        "text/event-stream"
    );
    let data = sse_data(&text(resp).await);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad chunk {d}: {e}")))
        .collect()
}

/// The error object of an OpenAI error body, checked for shape.
pub fn error_of(body: &Value) -> &Value {
    let err = &body["error"];
    assert!(err["message"].is_string(), "{body}");
    assert!(err["type"].is_string(), "{body}");
    assert!(err.get("param").is_some(), "{body}");
    assert!(err["code"].is_string(), "{body}");
    err
}

pub fn chat_body(content: &str) -> Value {
    serde_json::json!({"messages": [{"role": "user", "content": content}]})
}
