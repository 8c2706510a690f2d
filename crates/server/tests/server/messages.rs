//! Anthropic's Messages API over the mock: the message shape and its stop reasons, tool use
//! both ways (a `tool_use` block out; `tool_use` / `tool_result` blocks back in as the chat
//! template's tool turns), Anthropic's event stream, `count_tokens`, errors in Anthropic's
//! shape, and the `x-api-key` header.

use axum::http::{header, Request, StatusCode};
use serde_json::{json, Value};
use tokenrouter_api::Backend;
use tokenrouter_server::{router, ServerConfig};

use crate::common::{app, mock, post, post_json, send, text};
use crate::mock::{MockBackend, MockConfig};

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

fn body(max_tokens: usize) -> Value {
    json!({"model": "tokenrouter", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hello."}]})
}

/// The SSE events of a body: (event name, JSON data).
fn events(body: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in body.lines() {
        if let Some(n) = line.strip_prefix("event:") {
            name = n.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            let data: Value = serde_json::from_str(d.trim()).expect("JSON event");
            out.push((std::mem::take(&mut name), data));
        }
    }
    out
}

#[tokio::test]
async fn a_message_has_anthropic_shape_and_stop_reasons() {
    let m = mock();
    let (status, out) = post_json(app(&m), "/v1/messages", body(16)).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["type"], "message");
    assert_eq!(out["role"], "assistant");
    assert_eq!(out["model"], "tokenrouter");
    assert!(out["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        out["content"],
        json!([{"type": "text", "text": SCRIPT[..16]}])
    );
    assert_eq!(out["stop_reason"], "max_tokens");
    assert_eq!(out["stop_sequence"], Value::Null);
    assert_eq!(out["usage"]["output_tokens"], 16);
    let prompt = m.log().submitted[0].prompt_ids.len() as u64;
    assert_eq!(out["usage"]["input_tokens"], prompt);
    assert_eq!(out["usage"]["cache_read_input_tokens"], 0);
    assert!(out["tokenrouter"]["tokens_by_model"].is_object());
    // The same prompt again: its cached start is told apart.
    let (_, again) = post_json(app(&m), "/v1/messages", body(16)).await;
    let cached = again["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached > 0);
    assert_eq!(again["usage"]["input_tokens"], prompt - cached);

    let (_, out) = post_json(app(&m), "/v1/messages", body(400)).await;
    assert_eq!(out["stop_reason"], "end_turn");
    assert_eq!(out["content"][0]["text"], SCRIPT);
    let mut stopped = body(400);
    stopped["stop_sequences"] = json!(["world"]);
    stopped["system"] = json!("Be brief.");
    let (_, out) = post_json(app(&m), "/v1/messages", stopped).await;
    assert_eq!(out["stop_reason"], "stop_sequence");
    assert_eq!(out["stop_sequence"], "world");
    assert_eq!(out["content"][0]["text"], "Hello, ");
    let prompt = m.decode(&m.log().submitted[3].prompt_ids, false).unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\nBe brief."),
        "{prompt}"
    );
}

fn tool_mock() -> std::sync::Arc<MockBackend> {
    MockBackend::new(MockConfig {
        calls_tools: true,
        ..MockConfig::default()
    })
}

fn tool_body() -> Value {
    json!({"model": "quick", "max_tokens": 200,
        "tools": [{"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [{"role": "user", "content": "Weather in Paris?"}]})
}

#[tokio::test]
async fn tool_use_goes_out_as_a_block_and_comes_back_as_the_templates_tool_turn() {
    let m = tool_mock();
    let (status, out) = post_json(app(&m), "/v1/messages", tool_body()).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["stop_reason"], "tool_use");
    let call = &out["content"][0];
    assert_eq!(call["type"], "tool_use");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["input"], json!({"city": "Paris"}));
    let id = call["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("toolu_"));

    let mut next = tool_body();
    next["messages"] = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [call.clone()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id,
            "content": "Sunny, 24 C"}]}
    ]);
    let (status, out) = post_json(app(&m), "/v1/messages", next).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["stop_reason"], "end_turn");
    assert_eq!(out["content"][0]["text"], SCRIPT);
    let (messages, _, _) = m.log().last_template.clone().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[2].role, "tool");
    assert_eq!(messages[2].content, "Sunny, 24 C");
}

#[tokio::test]
async fn streaming_sends_anthropics_events() {
    let m = mock();
    let mut streamed = body(20);
    streamed["stream"] = json!(true);
    let resp = send(app(&m), post("/v1/messages", streamed.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let sent = events(&text(resp).await);
    let names: Vec<&str> = sent.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    for (name, data) in &sent {
        assert_eq!(data["type"], *name);
    }
    let start = &sent[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    let written: String = sent
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(written, SCRIPT[..20]);
    let delta = &sent[sent.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 20);

    let m = tool_mock();
    let mut streamed = tool_body();
    streamed["stream"] = json!(true);
    let resp = send(app(&m), post("/v1/messages", streamed.to_string())).await;
    let tool_events = events(&text(resp).await);
    let start = tool_events
        .iter()
        .find(|(n, _)| n == "content_block_start")
        .unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    let json_delta = tool_events
        .iter()
        .find(|(n, d)| n == "content_block_delta" && d["delta"]["type"] == "input_json_delta")
        .unwrap();
    let args: Value =
        serde_json::from_str(json_delta.1["delta"]["partial_json"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    let delta = tool_events
        .iter()
        .find(|(n, _)| n == "message_delta")
        .unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn count_tokens_counts_the_rendered_prompt() {
    let m = mock();
    let mut counted = body(1);
    counted.as_object_mut().unwrap().remove("max_tokens");
    let (status, out) = post_json(app(&m), "/v1/messages/count_tokens", counted).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let (_, tokenized) = post_json(
        app(&m),
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Say hello."}]}),
    )
    .await;
    assert_eq!(out, json!({"input_tokens": tokenized["count"]}));
    assert!(m.log().submitted.is_empty());
}

#[tokio::test]
async fn errors_come_in_anthropics_shape() {
    let m = mock();
    for (change, status, kind) in [
        (
            json!({"max_tokens": null}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"model": "claude-x"}),
            StatusCode::NOT_FOUND,
            "not_found_error",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"stop_sequences": "x"}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
    ] {
        let mut request = body(8);
        for (k, v) in change.as_object().unwrap() {
            request[k] = v.clone();
        }
        let (got, out) = post_json(app(&m), "/v1/messages", request).await;
        assert_eq!(got, status, "{change}: {out}");
        assert_eq!(out["type"], "error", "{out}");
        assert_eq!(out["error"]["type"], kind, "{out}");
        assert!(out["error"]["message"].is_string());
    }
}

#[tokio::test]
async fn anthropic_clients_authenticate_with_x_api_key() {
    let m = mock();
    let cfg = ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    };
    let app = router(m.clone(), cfg);
    let request = |key: Option<&str>| {
        let mut req =
            Request::post("/v1/messages").header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            req = req.header("x-api-key", key);
        }
        req.body(axum::body::Body::from(body(4).to_string()))
            .unwrap()
    };
    assert_eq!(
        send(app.clone(), request(None)).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(app.clone(), request(Some("nope"))).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(app, request(Some("sekrit"))).await.status(),
        StatusCode::OK
    );
}
