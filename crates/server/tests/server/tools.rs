//! Tool calling on `/v1/chat/completions`: `tools` reach the template, a `<tool_call>`
//! answer comes back as `tool_calls` (whole and streamed) with `finish_reason:
//! "tool_calls"`, earlier calls and tool results are fed back to the template, a forced
//! call is a constraint (see `structured.rs`), and bad tool requests are refused by name.

use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_server::{router, ServerConfig, ToolCallParser};

use crate::common::*;
use crate::mock::{MockBackend, MockConfig};

const ANSWER: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"C\"}}\n</tool_call>";

fn mock_answering(script: &str) -> Arc<MockBackend> {
    MockBackend::new(MockConfig {
        script: script.into(),
        ..MockConfig::default()
    })
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

fn with_tools(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                          "tools": tools()});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        body[k] = v;
    }
    body
}

fn arguments(call: &Value) -> Value {
    let text = call["function"]["arguments"]
        .as_str()
        .expect("arguments string");
    serde_json::from_str(text).expect("arguments JSON")
}

#[tokio::test]
async fn a_tool_call_answer_comes_back_as_tool_calls() {
    let m = mock_answering(ANSWER);
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", with_tools(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let choice = &resp["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Let me check.\n");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert!(calls[0].get("index").is_none());
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(arguments(&calls[0]), json!({"city": "Paris", "unit": "C"}));
    // The tools reached the template; every generated token is still counted (the
    // script's bytes and the end-of-sequence token).
    let (_, _, kwargs) = m.log().last_template.clone().unwrap();
    assert_eq!(kwargs["tools"], tools());
    assert_eq!(
        resp["usage"]["completion_tokens"].as_u64(),
        Some(ANSWER.len() as u64 + 1)
    );
}

#[tokio::test]
async fn without_tools_or_with_tool_choice_none_the_text_is_returned_as_written() {
    let m = mock_answering(ANSWER);
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["content"], ANSWER);
    assert!(resp["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");

    let body = with_tools(json!({"tool_choice": "none"}));
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["content"], ANSWER);
    let (_, _, kwargs) = m.log().last_template.clone().unwrap();
    assert!(kwargs.get("tools").is_none(), "{kwargs}");

    // A server started with `--tool-call-parser none` passes the tools but not the calls.
    let cfg = ServerConfig {
        tool_call_parser: ToolCallParser::None,
        ..ServerConfig::default()
    };
    let (status, resp) = post_json(
        router(m.clone(), cfg),
        "/v1/chat/completions",
        with_tools(json!({"tool_choice": "auto"})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["content"], ANSWER);
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn streamed_tool_calls_arrive_whole_in_one_delta() {
    let m = mock_answering(&format!("{ANSWER}\n{ANSWER}"));
    let body = with_tools(json!({"stream": true, "logprobs": true}));
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant");
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    // The text between the two calls ("\nLet me check.\n") is more than whitespace.
    assert_eq!(content, "Let me check.\n\nLet me check.\n");
    let calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 2);
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(call["index"], i);
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(arguments(call), json!({"city": "Paris", "unit": "C"}));
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    let finishes: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(finishes, vec!["tool_calls"]);
    // Every token's logprob is still sent, the calls' tokens and the end's included.
    let logprobs: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(logprobs, 2 * ANSWER.len() + 2);
}

#[tokio::test]
async fn a_call_cut_by_max_tokens_is_text_and_finishes_on_length() {
    let m = mock_answering(ANSWER);
    for stream in [false, true] {
        let body = with_tools(json!({"max_tokens": 40, "stream": stream}));
        let (content, reason) = match stream {
            false => {
                let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
                assert_eq!(status, StatusCode::OK, "{resp}");
                assert!(resp["choices"][0]["message"].get("tool_calls").is_none());
                let choice = &resp["choices"][0];
                (
                    choice["message"]["content"].as_str().unwrap().to_string(),
                    choice["finish_reason"].clone(),
                )
            }
            true => {
                let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
                let choices = chunks.iter().map(|c| &c["choices"][0]);
                let content = choices
                    .clone()
                    .filter_map(|c| c["delta"]["content"].as_str())
                    .collect();
                let reason = choices.clone().next_back().unwrap()["finish_reason"].clone();
                (content, reason)
            }
        };
        assert_eq!(content, ANSWER[..40], "stream {stream}");
        assert_eq!(reason, "length");
    }
}

#[tokio::test]
async fn a_bare_call_without_tags_is_read_as_a_call() {
    // Qwen2.5-Coder's usual answer: the call's JSON alone.
    let m = mock_answering(" {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}");
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", with_tools(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(resp["choices"][0]["message"]["content"], Value::Null);
    let call = &resp["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(arguments(call), json!({"city": "Paris"}));
    let body = with_tools(json!({"stream": true}));
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(arguments(calls[0]), json!({"city": "Paris"}));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "");
}

#[tokio::test]
async fn a_required_call_is_constrained_and_read_back() {
    let m = mock_answering(ANSWER);
    let body = with_tools(json!({"tool_choice": "required"}));
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["finish_reason"], "tool_calls");
    let constraint = m.log().submitted[0].constraint.clone();
    assert!(
        matches!(constraint, Some(tokenrouter_api::OutputConstraint::Lark(_))),
        "{constraint:?}"
    );
}

#[tokio::test]
async fn earlier_calls_and_tool_results_reach_the_template() {
    let m = mock_answering("It is 18 C in Paris.");
    let body = json!({"tools": tools(), "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"}
    ]});
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(
        resp["choices"][0]["message"]["content"],
        "It is 18 C in Paris."
    );
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    let (messages, _, _) = m.log().last_template.clone().unwrap();
    let calls = messages[1].tool_calls.clone().unwrap();
    assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
    assert_eq!(calls[0]["id"], "call_1");
    assert_eq!(messages[1].content, "");
    assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(messages[2].name.as_deref(), Some("get_weather"));
    assert!(messages[0].tool_calls.is_none() && messages[0].tool_call_id.is_none());
}

#[tokio::test]
async fn bad_tool_requests_are_refused_by_name() {
    let m = mock_answering(ANSWER);
    let cases = [
        (
            with_tools(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
            "tool_choice",
        ),
        (
            with_tools(json!({"tools": [], "tool_choice": "required"})),
            "tool_choice",
        ),
        (
            with_tools(json!({"tools": [{"type": "function"}]})),
            "tools[0]",
        ),
        (
            with_tools(json!({"tools": [{"type": "function", "function": {"name": 3}}]})),
            "tools[0].function.name",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
    ];
    for (body, param) in cases {
        let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
        assert_eq!(error_of(&resp)["param"], param, "{resp}");
    }
    assert!(m.log().submitted.is_empty());
}

/// `parallel_tool_calls: false`: one call comes back of an answer with two, whole and
/// streamed, on chat and the Responses API; by default both.
#[tokio::test]
async fn parallel_tool_calls_false_returns_the_first_call_alone() {
    let two = format!("{ANSWER}\n{}", &ANSWER["Let me check.\n".len()..]);
    let m = mock_answering(&two);
    let calls_of = |body: &Value| {
        body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .map_or(0, Vec::len)
    };
    let (_, both) = post_json(app(&m), "/v1/chat/completions", with_tools(json!({}))).await;
    assert_eq!(calls_of(&both), 2, "{both}");
    let single = with_tools(json!({"parallel_tool_calls": false}));
    let (_, one) = post_json(app(&m), "/v1/chat/completions", single.clone()).await;
    assert_eq!(calls_of(&one), 1, "{one}");
    assert_eq!(one["choices"][0]["finish_reason"], "tool_calls");
    let mut streamed = single;
    streamed["stream"] = json!(true);
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", streamed).await;
    let calls: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(calls, 1);
    let flat =
        json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]);
    for (parallel, expected) in [(json!(false), 1), (json!(true), 2)] {
        let (_, r) = post_json(
            app(&m),
            "/v1/responses",
            json!({"input": "Weather?", "tools": flat, "parallel_tool_calls": parallel}),
        )
        .await;
        let calls = r["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["type"] == "function_call")
            .count();
        assert_eq!(calls, expected, "{r}");
        assert_eq!(r["parallel_tool_calls"], parallel);
    }
}
