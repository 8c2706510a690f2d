//! OpenAI's Responses API (`POST /v1/responses`) over the mock: the request read as its chat
//! request (instructions, items, flat tools, `text.format`, `max_output_tokens`), the
//! response object (message, reasoning and function-call items, status, usage), the event
//! stream's order and numbering, and refusals naming the Responses field. The official
//! client's run is in `openai_client.py`.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_api::OutputConstraint;
use tokenrouter_server::{router, ReasoningParser, ServerConfig};

use crate::common::{app, error_of, mock, post, post_json, send, text};
use crate::mock::{MockBackend, MockConfig};

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

pub fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .map(|part| part["text"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn a_response_object_with_a_message() {
    let m = mock();
    let (status, r) = post_json(
        app(&m),
        "/v1/responses",
        json!({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 100,
            "metadata": {"k": "v"}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(
        (&r["object"], &r["status"]),
        (&json!("response"), &json!("completed"))
    );
    assert_eq!(output_text(&r), SCRIPT);
    assert_eq!(r["output"][0]["role"], "assistant");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["metadata"], json!({"k": "v"}));
    let usage = &r["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    assert!(r["tokenrouter"]["tokens_by_model"].is_object());
    // The instructions are the system message, the input the user's.
    let (messages, add_generation_prompt, _) = m.log().last_template.clone().unwrap();
    assert!(add_generation_prompt);
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user"]);
    assert_eq!(m.log().submitted.last().unwrap().max_tokens, Some(100));

    let (_, r) = post_json(
        app(&m),
        "/v1/responses",
        json!({"input": "hi", "max_output_tokens": 5}),
    )
    .await;
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(output_text(&r), SCRIPT[..5]);
}

#[tokio::test]
async fn items_tools_and_formats_become_the_chat_request() {
    let m = mock();
    let input = json!([
        {"role": "system", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]);
    let tools = json!([{"type": "function", "name": "weather", "parameters": {"type": "object"}}]);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let (status, r) = post_json(
        app(&m),
        "/v1/responses",
        json!({"input": input, "tools": tools, "tool_choice": "none",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{r}");
    let (messages, _, kwargs) = m.log().last_template.clone().unwrap();
    let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    // The two calls joined one assistant message, as a chat client sends them.
    assert_eq!(messages[2].tool_calls.as_ref().unwrap().len(), 2);
    assert_eq!(messages[3].tool_call_id.as_deref(), Some("c1"));
    // tool_choice "none" leaves the tools out of the prompt.
    assert!(kwargs.get("tools").is_none());
    let submitted = m.log().submitted.last().cloned().unwrap();
    assert_eq!(
        submitted.constraint,
        Some(OutputConstraint::JsonSchema(schema))
    );
}

#[tokio::test]
async fn tool_calls_and_thinking_are_items() {
    let m = MockBackend::new(MockConfig {
        calls_tools: true,
        ..MockConfig::default()
    });
    let tools = json!([{"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let (_, r) = post_json(
        app(&m),
        "/v1/responses",
        json!({"input": "Paris?", "tools": tools}),
    )
    .await;
    let call = &r["output"][0];
    assert_eq!(
        (&call["type"], &call["name"]),
        (&json!("function_call"), &json!("get_weather"))
    );
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));

    let m = MockBackend::new(MockConfig {
        script: "<think>\nSum it.\n</think>\n\nIt is 4.".into(),
        ..MockConfig::default()
    });
    let cfg = ServerConfig {
        reasoning_parser: ReasoningParser::Qwen3,
        ..ServerConfig::default()
    };
    let app = router(m as Arc<MockBackend>, cfg);
    let (_, r) = post_json(app, "/v1/responses", json!({"input": "2+2?"})).await;
    assert_eq!(r["output"][0]["type"], "reasoning");
    assert_eq!(r["output"][0]["content"][0]["text"], "\nSum it.\n");
    // As chat shows it (vLLM's split: the text after `</think>` as written).
    assert_eq!(output_text(&r), "\n\nIt is 4.");
}

/// The events of a streamed response: `(event name, data)`.
async fn events(body: Value) -> Vec<(String, Value)> {
    let resp = send(app(&mock()), post("/v1/responses", body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let raw = text(resp).await;
    raw.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            (
                field("event:"),
                serde_json::from_str(&field("data:")).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_stream_is_ordered_numbered_typed_events() {
    let all = events(json!({"input": "hi", "stream": true, "max_output_tokens": 100})).await;
    let kinds: Vec<&str> = all.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in all.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    let deltas: String = all
        .iter()
        .filter(|(name, _)| name == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, SCRIPT);
    let (_, done) = all.last().unwrap();
    assert_eq!(output_text(&done["response"]), SCRIPT);
    assert_eq!(all[0].1["response"]["status"], "in_progress");
    let cut = events(json!({"input": "hi", "stream": true, "max_output_tokens": 3})).await;
    let (name, last) = cut.last().unwrap();
    assert_eq!(name, "response.incomplete");
    assert_eq!(last["response"]["output"][0]["status"], "incomplete");
}

#[tokio::test]
async fn refusals_name_the_responses_field() {
    for (body, param) in [
        (json!({"instructions": "x"}), "input"),
        (json!({"input": 5}), "input"),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"input": [{"type": "computer_call"}]}),
            "input[0].type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
            "text.format.type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}),
            "text.format.schema",
        ),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": [{"role": "wizard", "content": "x"}]}),
            "input",
        ),
    ] {
        let (status, r) = post_json(app(&mock()), "/v1/responses", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {r}");
        assert_eq!(error_of(&r)["param"], param, "{body} -> {r}");
    }
}

/// `include: ["message.output_text.logprobs"]` (and `top_logprobs`): each token of the
/// message text with its log-probability and alternatives, whole and streamed.
#[tokio::test]
async fn message_logprobs_when_included() {
    let body = json!({"input": "hi", "include": ["message.output_text.logprobs"],
        "top_logprobs": 2});
    let (status, r) = post_json(app(&mock()), "/v1/responses", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    let logprobs = r["output"][0]["content"][0]["logprobs"].as_array().unwrap();
    // One per byte-token of the text (the EOS, which writes none, is not the message's).
    assert_eq!(logprobs.len(), SCRIPT.len());
    assert_eq!(logprobs[0]["token"], "H");
    assert!(logprobs[0]["logprob"].as_f64().unwrap() < 0.0);
    assert_eq!(logprobs[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let all = events(streamed).await;
    let from_deltas: usize = all
        .iter()
        .filter(|(name, _)| name == "response.output_text.delta")
        .map(|(_, d)| d["logprobs"].as_array().unwrap().len())
        .sum();
    assert_eq!(from_deltas, SCRIPT.len());
    // Not asked: none.
    let (_, r) = post_json(app(&mock()), "/v1/responses", json!({"input": "hi"})).await;
    assert_eq!(r["output"][0]["content"][0]["logprobs"], json!([]));
}

/// A response stopped through SGLang's `/abort_request` ends `cancelled` with what it wrote
/// (whole), and streamed its last event is `response.incomplete` with that status.
#[tokio::test]
async fn an_aborted_response_ends_cancelled() {
    let m = MockBackend::new(MockConfig {
        token_delay: std::time::Duration::from_millis(5),
        ..MockConfig::default()
    });
    let router = app(&m);
    let wait_running = |n: usize| {
        let m = m.clone();
        async move {
            let started = std::time::Instant::now();
            while m.log().running < n {
                assert!(started.elapsed().as_secs() < 5, "never started");
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
    };
    let body = json!({"input": "hi", "max_output_tokens": 400, "ignore_eos": true});
    let whole = tokio::spawn(post_json(router.clone(), "/v1/responses", body.clone()));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = router.clone();
    let streamed = tokio::spawn(async move {
        text(send(r, post("/v1/responses", streamed.to_string())).await).await
    });
    wait_running(2).await;
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let resp = send(router, post("/abort_request", r#"{"abort_all": true}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, out) = whole.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["status"], "cancelled", "{out}");
    assert_eq!(out["output"][0]["status"], "incomplete", "{out}");
    let written = out["usage"]["output_tokens"].as_u64().unwrap();
    assert!(written > 0 && written < 400, "{written}");
    let sse = streamed.await.unwrap();
    let last: Value = sse
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .and_then(|d| serde_json::from_str(d).ok())
        .unwrap();
    assert_eq!(last["type"], "response.incomplete", "{last}");
    assert_eq!(last["response"]["status"], "cancelled", "{last}");
}
