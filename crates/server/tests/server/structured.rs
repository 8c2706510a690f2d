//! Structured output on the HTTP side: `response_format` JSON modes, vLLM's `guided_*`
//! fields, llama.cpp's `grammar`, SGLang's `regex` / `ebnf` and forced tool calls reach the
//! engine as one `constraint`; the engine's refusal
//! names the field the client sent; conflicting constraints are a 400.

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_api::OutputConstraint;

use crate::common::*;

fn schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
}

#[tokio::test]
async fn each_field_reaches_the_engine_as_its_constraint() {
    let m = mock();
    let cases = [
        (
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "place", "schema": schema(), "strict": true}}}),
            OutputConstraint::JsonSchema(schema()),
        ),
        (
            json!({"response_format": {"type": "json_object"}}),
            OutputConstraint::JsonObject,
        ),
        (
            json!({"guided_json": schema()}),
            OutputConstraint::JsonSchema(schema()),
        ),
        (
            json!({"guided_regex": "[0-9]+"}),
            OutputConstraint::Regex("[0-9]+".into()),
        ),
        (
            json!({"guided_choice": ["a", "b"]}),
            OutputConstraint::Choice(vec!["a".into(), "b".into()]),
        ),
        // Grammars: vLLM's in either dialect (GBNF told by `::=`), llama.cpp's, SGLang's.
        (
            json!({"guided_grammar": "start: \"a\""}),
            OutputConstraint::Lark("start: \"a\"".into()),
        ),
        (
            json!({"guided_grammar": "root ::= \"a\""}),
            OutputConstraint::Gbnf("root ::= \"a\"".into()),
        ),
        (
            json!({"structured_outputs": {"grammar": "root ::= [0-9]+"}}),
            OutputConstraint::Gbnf("root ::= [0-9]+".into()),
        ),
        (
            json!({"grammar": "root ::= \"b\""}),
            OutputConstraint::Gbnf("root ::= \"b\"".into()),
        ),
        (
            json!({"ebnf": "root ::= \"c\""}),
            OutputConstraint::Gbnf("root ::= \"c\"".into()),
        ),
        (
            json!({"regex": "[a-z]+"}),
            OutputConstraint::Regex("[a-z]+".into()),
        ),
    ];
    for (path, base) in [
        ("/v1/chat/completions", chat_body("hi")),
        ("/v1/completions", json!({"prompt": "hi"})),
    ] {
        for (extra, want) in &cases {
            let mut body = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            body["max_tokens"] = json!(4);
            let (status, resp) = post_json(app(&m), path, body).await;
            assert_eq!(status, StatusCode::OK, "{resp}");
            let last = m.log().submitted.last().unwrap().constraint.clone();
            assert_eq!(last.as_ref(), Some(want), "{path} {extra}");
        }
    }
    // `{"type": "text"}` and nothing at all: no constraint.
    for body in [json!({"response_format": {"type": "text"}}), json!({})] {
        let mut body = body;
        body["prompt"] = json!("hi");
        let (status, _) = post_json(app(&m), "/v1/completions", body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(m.log().submitted.last().unwrap().constraint, None);
    }
}

#[tokio::test]
async fn a_forced_tool_call_is_a_call_grammar() {
    let m = mock();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": schema()}}]);
    let body = json!({"messages": [{"role": "user", "content": "Paris?"}], "tools": tools,
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                      "max_tokens": 4});
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let Some(OutputConstraint::Lark(grammar)) = m.log().submitted[0].constraint.clone() else {
        panic!("no grammar");
    };
    assert!(
        grammar.contains(r#"\"name\": \"get_weather\""#),
        "{grammar}"
    );
    assert!(
        grammar.contains(&format!("%json {}", schema())),
        "{grammar}"
    );
}

#[tokio::test]
async fn refusals_name_the_field_the_client_sent() {
    let m = mock();
    let cases = [
        // The engine's refusal (`constraint`) renamed to the client's field.
        (json!({"guided_regex": "(("}), "guided_regex"),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "tools": [{"type": "function",
                "function": {"name": "f"}}], "tool_choice": "required"}),
            "tool_choice",
        ),
    ];
    for (extra, param) in cases {
        let mut body = chat_body("hi");
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
        assert_eq!(error_of(&resp)["param"], param, "{resp}");
    }
}
