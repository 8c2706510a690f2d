//! `--reasoning-parser`: a reasoning model's `<think>…</think>` comes back as
//! `reasoning_content` and `reasoning` beside the answer's `content` (whole and streamed,
//! tool calls read from the answer alone), a prompt whose thinking is closed
//! (`enable_thinking: false`) leaves the answer as it is, and without the flag the text is
//! returned as written.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};
use tokenrouter_server::{router, ReasoningParser, ServerConfig};

use crate::common::*;
use crate::mock::{MockBackend, MockConfig};

const THOUGHT: &str = "<think>\nTwo and two.\n</think>\n\nIt is 4.";

fn server(script: &str, parser: ReasoningParser) -> Router {
    let m = MockBackend::new(MockConfig {
        script: script.into(),
        ..MockConfig::default()
    });
    let cfg = ServerConfig {
        reasoning_parser: parser,
        ..ServerConfig::default()
    };
    router(m as Arc<MockBackend>, cfg)
}

fn ask(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    body
}

#[tokio::test]
async fn thinking_comes_back_apart_from_the_answer() {
    let app = server(THOUGHT, ReasoningParser::Qwen3);
    let (status, resp) = post_json(app.clone(), "/v1/chat/completions", ask(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let msg = &resp["choices"][0]["message"];
    assert_eq!(msg["content"], "\n\nIt is 4.");
    assert_eq!(msg["reasoning_content"], "\nTwo and two.\n");
    assert_eq!(msg["reasoning"], "\nTwo and two.\n");
    // Streamed: the same split, the tags never shown, whatever the pieces.
    let chunks = stream_chunks(app, "/v1/chat/completions", ask(json!({"stream": true}))).await;
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant");
    let joined = |key: &str| -> String { deltas.iter().filter_map(|d| d[key].as_str()).collect() };
    assert_eq!(joined("content"), "\n\nIt is 4.");
    assert_eq!(joined("reasoning_content"), "\nTwo and two.\n");
    assert_eq!(joined("reasoning"), joined("reasoning_content"));
}

/// vLLM's `include_reasoning: false`: the thinking is still taken out of the answer, and
/// not returned.
#[tokio::test]
async fn include_reasoning_false_drops_the_thinking() {
    let app = server(THOUGHT, ReasoningParser::Qwen3);
    for stream in [false, true] {
        let body = ask(json!({"include_reasoning": false, "stream": stream}));
        if stream {
            let chunks = stream_chunks(app.clone(), "/v1/chat/completions", body).await;
            let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
            let content: String = deltas
                .iter()
                .filter_map(|d| d["content"].as_str())
                .collect();
            assert_eq!(content, "\n\nIt is 4.");
            assert!(deltas.iter().all(|d| d.get("reasoning").is_none()));
        } else {
            let (_, resp) = post_json(app.clone(), "/v1/chat/completions", body).await;
            let msg = &resp["choices"][0]["message"];
            assert_eq!(msg["content"], "\n\nIt is 4.");
            assert!(msg.get("reasoning").is_none() && msg.get("reasoning_content").is_none());
        }
    }
}

#[tokio::test]
async fn thinking_cut_short_has_no_answer_and_answers_without_thinking_have_no_reasoning() {
    let app = server(THOUGHT, ReasoningParser::Qwen3);
    let (_, resp) = post_json(
        app.clone(),
        "/v1/chat/completions",
        ask(json!({"max_tokens": 10})),
    )
    .await;
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["message"]["content"], Value::Null);
    // One byte a token: "<think>" and three more.
    assert_eq!(choice["message"]["reasoning_content"], "\nTw");

    // The mock's template closes the thinking in the prompt when it is switched off, as
    // Qwen3's does: what follows is answer, whatever it looks like.
    let body = ask(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    let (_, resp) = post_json(app, "/v1/chat/completions", body).await;
    let msg = &resp["choices"][0]["message"];
    assert_eq!(msg["content"], THOUGHT);
    assert!(msg.get("reasoning_content").is_none() && msg.get("reasoning").is_none());

    let plain = server("It is 4.", ReasoningParser::Qwen3);
    let (_, resp) = post_json(plain, "/v1/chat/completions", ask(json!({}))).await;
    assert_eq!(resp["choices"][0]["message"]["content"], "It is 4.");
    assert!(resp["choices"][0]["message"].get("reasoning").is_none());
}

#[tokio::test]
async fn deepseek_r1_thinks_from_the_start_and_none_leaves_the_text() {
    let app = server("Two and two.</think>It is 4.", ReasoningParser::DeepSeekR1);
    let (_, resp) = post_json(app, "/v1/chat/completions", ask(json!({}))).await;
    let msg = &resp["choices"][0]["message"];
    assert_eq!(
        (msg["reasoning_content"].as_str(), msg["content"].as_str()),
        (Some("Two and two."), Some("It is 4."))
    );

    let off = server(THOUGHT, ReasoningParser::None);
    let (_, resp) = post_json(off, "/v1/chat/completions", ask(json!({}))).await;
    assert_eq!(resp["choices"][0]["message"]["content"], THOUGHT);
    // Completions are raw text: never split.
    let app = server(THOUGHT, ReasoningParser::Qwen3);
    let body = json!({"prompt": "2+2?", "max_tokens": 200});
    let (_, resp) = post_json(app, "/v1/completions", body).await;
    assert_eq!(resp["choices"][0]["text"], THOUGHT);
}

#[tokio::test]
async fn tool_calls_are_read_from_the_answer_after_the_thinking() {
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let script = format!("<think>I should call get_weather.</think>\n{call}");
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let app = server(&script, ReasoningParser::Qwen3);
    for stream in [false, true] {
        let body = ask(json!({"tools": tools, "stream": stream}));
        let (reasoning, calls, finish) = if stream {
            let chunks = stream_chunks(app.clone(), "/v1/chat/completions", body).await;
            let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
            let reasoning: String = deltas
                .iter()
                .filter_map(|d| d["reasoning"].as_str())
                .collect();
            let calls: Vec<Value> = deltas
                .iter()
                .filter_map(|d| d["tool_calls"].as_array())
                .flatten()
                .cloned()
                .collect();
            let finish = chunks
                .iter()
                .rev()
                .find_map(|c| c["choices"][0]["finish_reason"].as_str())
                .map(String::from);
            (reasoning, calls, finish)
        } else {
            let (_, resp) = post_json(app.clone(), "/v1/chat/completions", body).await;
            let msg = &resp["choices"][0]["message"];
            (
                msg["reasoning"].as_str().unwrap_or_default().to_string(),
                msg["tool_calls"].as_array().cloned().unwrap_or_default(),
                resp["choices"][0]["finish_reason"]
                    .as_str()
                    .map(String::from),
            )
        };
        assert_eq!(reasoning, "I should call get_weather.", "stream {stream}");
        assert_eq!(calls.len(), 1, "stream {stream}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(finish.as_deref(), Some("tool_calls"));
    }
}

/// An assistant's earlier thinking sent back (`reasoning_content`, or vLLM's `reasoning`)
/// reaches the template as `reasoning_content`, the name Qwen3's template reads.
#[tokio::test]
async fn earlier_thinking_reaches_the_template() {
    for key in ["reasoning_content", "reasoning"] {
        let m = MockBackend::new(MockConfig::default());
        let body = json!({"messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", key: "Two and two."},
            {"role": "user", "content": "And 3+3?"}], "max_tokens": 2});
        let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{resp}");
        let (messages, _, _) = m
            .log()
            .last_template
            .clone()
            .expect("a template was rendered");
        assert_eq!(
            messages[1].reasoning_content.as_deref(),
            Some("Two and two."),
            "{key}"
        );
        assert_eq!(messages[0].reasoning_content, None);
    }
}
