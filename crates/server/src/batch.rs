//! OpenAI's batch file format run in-process (vLLM's `run_batch`): each line of the input
//! (`{"custom_id", "method": "POST", "url", "body"}`) goes through the same router as an HTTP
//! request, so a batch answers exactly what the server would; the answers are written one
//! line each, in input order (`{"id", "custom_id", "response": {"status_code",
//! "request_id", "body"}, "error"}`). Lines run concurrently so the engine batches them; a
//! line that cannot run (bad JSON, another URL, `stream: true`) is answered with its error
//! and the rest go on.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tower::ServiceExt;

/// The endpoints a batch line may name (OpenAI's batch API takes these three).
pub const BATCH_URLS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];

/// How a line that the engine turned away for load (HTTP 429) is retried: this many times,
/// waiting longer each time (up to a second).
const MAX_RETRIES: u32 = 60;

#[derive(Debug, Deserialize)]
struct BatchLine {
    custom_id: String,
    method: String,
    url: String,
    body: Value,
}

/// What a batch run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchSummary {
    /// Lines answered with a 2xx response.
    pub succeeded: usize,
    /// Lines answered with an error (their own or the endpoint's).
    pub failed: usize,
    /// Completion tokens of the succeeded lines' `usage`.
    pub completion_tokens: usize,
}

/// Runs every non-blank line of `lines` through `app`, `concurrency` at a time, and hands
/// each answer line to `write` in input order. `write` failing (the output is gone) stops
/// the run with its error.
pub async fn run_batch<E>(
    app: axum::Router,
    lines: Vec<String>,
    concurrency: usize,
    mut write: impl FnMut(&str) -> Result<(), E>,
) -> Result<BatchSummary, E> {
    let lines = lines.into_iter().filter(|l| !l.trim().is_empty());
    let mut answers =
        stream::iter(lines.map(|line| answer(app.clone(), line))).buffered(concurrency.max(1));
    let mut summary = BatchSummary::default();
    while let Some(out) = answers.next().await {
        match out.pointer("/response/status_code").and_then(Value::as_u64) {
            Some(200..=299) => {
                summary.succeeded += 1;
                summary.completion_tokens += completion_tokens(&out);
            }
            _ => summary.failed += 1,
        }
        write(&out.to_string())?;
    }
    Ok(summary)
}

/// The output line for one input line.
async fn answer(app: axum::Router, line: String) -> Value {
    let id = format!("batch_req_{:032x}", rand::random::<u128>());
    let request: BatchLine = match serde_json::from_str(&line) {
        Ok(r) => r,
        Err(e) => {
            // Still name the line when its custom_id can be read.
            let custom_id = serde_json::from_str::<Value>(&line)
                .ok()
                .and_then(|v| v.get("custom_id").cloned())
                .unwrap_or(Value::Null);
            return failed_line(&id, custom_id, &format!("not a batch request line: {e}"));
        }
    };
    let custom_id = Value::String(request.custom_id.clone());
    if !request.method.eq_ignore_ascii_case("POST") {
        let message = format!("method `{}`: a batch line is a POST", request.method);
        return failed_line(&id, custom_id, &message);
    }
    if !BATCH_URLS.contains(&request.url.as_str()) {
        let message = format!(
            "url `{}`: a batch line asks one of {}",
            request.url,
            BATCH_URLS.join(", ")
        );
        return failed_line(&id, custom_id, &message);
    }
    if request.body.get("stream") == Some(&Value::Bool(true)) {
        return failed_line(&id, custom_id, "`stream` is not supported in a batch");
    }
    let (status, body) = post(&app, &request.url, &request.body).await;
    let request_id = body
        .get("id")
        .and_then(Value::as_str)
        .map_or_else(|| id.clone(), str::to_string);
    let error = match status.is_success() {
        true => Value::Null,
        false => body.get("error").cloned().unwrap_or(Value::Null),
    };
    json!({
        "id": id,
        "custom_id": custom_id,
        "response": {"status_code": status.as_u16(), "request_id": request_id, "body": body},
        "error": error,
    })
}

/// POSTs `body` to `url` through the router, retrying while the engine is full (429).
async fn post(app: &axum::Router, url: &str, body: &Value) -> (StatusCode, Value) {
    let bytes = body.to_string();
    let mut attempt = 0;
    loop {
        let request = Request::post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(bytes.clone()));
        let Ok(request) = request else {
            return (
                StatusCode::BAD_REQUEST,
                json!({"error": {"message": "bad url"}}),
            );
        };
        let Ok(response) = app.clone().oneshot(request).await;
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null);
        if status != StatusCode::TOO_MANY_REQUESTS || attempt >= MAX_RETRIES {
            return (status, body);
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(u64::from(attempt * 20).min(1000))).await;
    }
}

/// A line answered without reaching an endpoint: no response, the reason as the error.
fn failed_line(id: &str, custom_id: Value, message: &str) -> Value {
    json!({
        "id": id,
        "custom_id": custom_id,
        "response": null,
        "error": {"code": "invalid_request", "message": message},
    })
}

/// A chat / completions answer's `usage.completion_tokens`, a Responses answer's
/// `usage.output_tokens`.
fn completion_tokens(line: &Value) -> usize {
    let usage = line.pointer("/response/body/usage");
    let count = usage
        .and_then(|u| {
            u.get("completion_tokens")
                .or_else(|| u.get("output_tokens"))
        })
        .and_then(Value::as_u64);
    count.unwrap_or(0) as usize
}
