//! vLLM's request fields beyond OpenAI's: `min_tokens`, `allowed_token_ids`, `bad_words`
//! (reaching the engine request), `include_stop_str_in_output`, `skip_special_tokens`,
//! stop ids' text, `truncate_prompt_tokens`, `continue_final_message`,
//! `return_tokens_as_token_ids`, `priority` (also SGLang's and the Responses API's), `cache_salt`.

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_api::{Backend, GenerateRequest};

use crate::common::{app, chat_body, error_of, mock, post_json, stream_chunks};
use crate::mock::MockBackend;

/// The mock's script: "Hello, world! The answer is 42. é日本🙂 END of story.".
fn completion(extra: Value) -> Value {
    let mut body = json!({"model": "quick", "prompt": "abcdefgh", "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn complete(m: &std::sync::Arc<MockBackend>, extra: Value) -> (StatusCode, Value) {
    post_json(app(m), "/v1/completions", completion(extra)).await
}

fn last_submitted(m: &MockBackend) -> GenerateRequest {
    m.log()
        .submitted
        .last()
        .cloned()
        .expect("a request reached the engine")
}

#[tokio::test]
async fn restrictions_reach_the_engine_request() {
    let m = mock();
    let (status, _) = complete(
        &m,
        json!({"min_tokens": 3, "allowed_token_ids": [72, 101], "bad_words": ["lo", "  END"]}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let s = last_submitted(&m).sampling;
    assert_eq!(s.min_tokens, 3);
    assert_eq!(s.allowed_token_ids, Some(vec![72, 101]));
    // Each word as it reads alone (leading spaces trimmed); the spaced form is one token
    // longer under the mock's byte tokenizer, so it is not added (vLLM's rule).
    assert_eq!(s.bad_words, vec![vec![108, 111], vec![69, 78, 68]]);
    for (extra, param) in [
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (json!({"bad_words": ["ok", " "]}), "bad_words[1]"),
        (json!({"min_tokens": -1}), "min_tokens"),
        (
            json!({"truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": -2}),
            "truncate_prompt_tokens",
        ),
    ] {
        let (status, body) = complete(&m, extra.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra} -> {body}");
        assert_eq!(error_of(&body)["param"], param, "{extra} -> {body}");
    }
}

#[tokio::test]
async fn stop_strings_wait_for_min_tokens_and_may_stay_in_the_text() {
    let m = mock();
    let text = |body: &Value| body["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, body) = complete(&m, json!({"stop": ["o"]})).await;
    assert_eq!(text(&body), "Hell");
    // The first "o" is the 5th token: within min_tokens 5 it stops, past it the next one.
    let (_, body) = complete(&m, json!({"stop": ["o"], "min_tokens": 5})).await;
    assert_eq!(text(&body), "Hell");
    let (_, body) = complete(&m, json!({"stop": ["o"], "min_tokens": 6})).await;
    assert_eq!(text(&body), "Hello, w");
    let (_, body) = complete(
        &m,
        json!({"stop": ["o"], "include_stop_str_in_output": true}),
    )
    .await;
    assert_eq!(text(&body), "Hello");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    // Streamed, the same text.
    let chunks = stream_chunks(
        app(&m),
        "/v1/completions",
        completion(json!({"stop": ["o"], "min_tokens": 6, "stream": true})),
    )
    .await;
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, "Hello, w");
}

/// A stop id's text is left out unless `include_stop_str_in_output`; special tokens' text
/// shows with `skip_special_tokens: false`.
#[tokio::test]
async fn stop_ids_and_special_tokens_text() {
    let m = mock();
    let text = |body: &Value| body["choices"][0]["text"].as_str().unwrap().to_string();
    // "," (44) is an ordinary token: stopping on it leaves it out, as vLLM does.
    let (_, body) = complete(&m, json!({"stop_token_ids": [44]})).await;
    assert_eq!(text(&body), "Hello");
    assert_eq!(body["usage"]["completion_tokens"], 6);
    let (_, body) = complete(
        &m,
        json!({"stop_token_ids": [44], "include_stop_str_in_output": true}),
    )
    .await;
    assert_eq!(text(&body), "Hello,");
    // The script ends with the mock's EOS, `<|endoftext|>`: shown only when both asked.
    let script = "Hello, world! The answer is 42. é日本🙂 END of story.";
    let (_, body) = complete(&m, json!({"skip_special_tokens": false})).await;
    assert_eq!(text(&body), script);
    let both = json!({"skip_special_tokens": false, "include_stop_str_in_output": true});
    let (_, body) = complete(&m, both).await;
    assert_eq!(text(&body), format!("{script}<|endoftext|>"));
    let (_, body) = complete(&m, json!({"include_stop_str_in_output": true})).await;
    assert_eq!(text(&body), script);
}

#[tokio::test]
async fn truncate_prompt_tokens_keeps_the_prompts_end() {
    let m = mock();
    let (status, body) = complete(
        &m,
        json!({"truncate_prompt_tokens": 3, "echo": true, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        last_submitted(&m).prompt_ids,
        b"fgh".map(u32::from).to_vec()
    );
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    // Echoed as the model read it.
    assert_eq!(body["choices"][0]["text"], "fghHe");
    // -1: as many as leave room for max_tokens in the 512-token context.
    let long = "x".repeat(600);
    let (status, _) = complete(
        &m,
        json!({"prompt": long, "truncate_prompt_tokens": -1, "max_tokens": 12}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(last_submitted(&m).prompt_ids.len(), 500);
    let (_, _) = post_json(
        app(&m),
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi there"}], "truncate_prompt_tokens": 4}),
    )
    .await;
    assert_eq!(last_submitted(&m).prompt_ids.len(), 4);
}

#[tokio::test]
async fn continue_final_message_leaves_the_last_message_open() {
    let m = mock();
    let messages = json!([
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Sure, here"}]);
    let body = json!({"messages": messages, "add_generation_prompt": false,
        "continue_final_message": true, "max_tokens": 2});
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let prompt = m.decode(&last_submitted(&m).prompt_ids, false).unwrap();
    assert!(
        prompt.ends_with("<|im_start|>assistant\nSure, here"),
        "{prompt:?}"
    );
    // Also without `add_generation_prompt` (it is implied off), and in /tokenize.
    let body = json!({"messages": messages, "continue_final_message": true, "max_tokens": 2});
    let (status, _) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    let (_, tokens) = post_json(
        app(&m),
        "/tokenize",
        json!({"messages": messages, "continue_final_message": true}),
    )
    .await;
    let ids: Vec<u32> = serde_json::from_value(tokens["tokens"].clone()).unwrap();
    assert!(m.decode(&ids, false).unwrap().ends_with("Sure, here"));
    let refused = [
        json!({"messages": messages, "continue_final_message": true,
            "add_generation_prompt": true}),
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
            "continue_final_message": true}),
    ];
    for body in refused {
        let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(error_of(&resp)["param"], "continue_final_message");
    }
}

#[tokio::test]
async fn tokens_as_token_ids_in_logprobs() {
    let m = mock();
    let mut body = chat_body("hi");
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(1);
    body["max_tokens"] = json!(2);
    body["return_tokens_as_token_ids"] = json!(true);
    let (_, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    let first = &resp["choices"][0]["logprobs"]["content"][0];
    assert_eq!(first["token"], "token_id:72");
    assert_eq!(first["top_logprobs"][0]["token"], "token_id:72");
    let (_, resp) = complete(
        &m,
        json!({"logprobs": 1, "max_tokens": 2, "return_tokens_as_token_ids": true}),
    )
    .await;
    assert_eq!(
        resp["choices"][0]["logprobs"]["tokens"],
        json!(["token_id:72", "token_id:101"])
    );
}

/// vLLM's `stop_reason`: the stop string or `stop_token_ids` id that ended a choice; null
/// for the EOS and for `max_tokens`; on the streamed finish chunk too.
#[tokio::test]
async fn stop_reason_names_what_stopped() {
    let m = mock();
    let reason = |body: &Value| body["choices"][0]["stop_reason"].clone();
    let (_, body) = complete(&m, json!({"stop": ["zz", "o"]})).await;
    assert_eq!(reason(&body), json!("o"));
    let (_, body) = complete(&m, json!({"stop_token_ids": [44]})).await;
    assert_eq!(reason(&body), json!(44));
    let (_, body) = complete(&m, json!({})).await;
    assert_eq!(
        (reason(&body), &body["choices"][0]["finish_reason"]),
        (Value::Null, &json!("stop"))
    );
    let (_, body) = complete(&m, json!({"max_tokens": 3})).await;
    assert_eq!(reason(&body), Value::Null);
    let (_, body) = post_json(
        app(&m),
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "stop": "world"}),
    )
    .await;
    assert_eq!(reason(&body), json!("world"));
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"model": "quick", "prompt": "x", "messages": [{"role": "user", "content": "hi"}],
            "stop": "world", "stream": true});
        let chunks = stream_chunks(app(&m), path, body).await;
        let last = chunks
            .iter()
            .rev()
            .find(|c| !c["choices"][0]["finish_reason"].is_null())
            .unwrap();
        assert_eq!(last["choices"][0]["stop_reason"], "world", "{path}");
        assert!(chunks[0]["choices"][0]["stop_reason"].is_null());
    }
}

#[tokio::test]
async fn priority_reaches_the_engine_request_from_every_endpoint() {
    let m = mock();
    let (status, _) = complete(&m, json!({"priority": -4})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(last_submitted(&m).priority, -4);
    let mut chat = chat_body("hi");
    chat["priority"] = json!(7);
    post_json(app(&m), "/v1/chat/completions", chat).await;
    assert_eq!(last_submitted(&m).priority, 7);
    post_json(
        app(&m),
        "/v1/responses",
        json!({"input": "hi", "priority": 2}),
    )
    .await;
    assert_eq!(last_submitted(&m).priority, 2);
    let (status, _) = post_json(
        app(&m),
        "/generate",
        json!({"text": ["a", "b"], "priority": 3, "sampling_params": {"max_new_tokens": 2}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let priorities: Vec<i32> = m.log().submitted.iter().map(|r| r.priority).collect();
    assert_eq!(priorities[priorities.len() - 2..], [3, 3]);
    complete(&m, json!({})).await;
    assert_eq!(last_submitted(&m).priority, 0, "0 unless asked");
    for bad in [json!(1u64 << 40), json!("high"), json!(1.5)] {
        let (status, body) = complete(&m, json!({"priority": bad})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(
            error_of(&body)["message"]
                .as_str()
                .unwrap()
                .contains("priority"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn cache_salt_reaches_the_engine_request_and_must_not_be_empty() {
    let m = mock();
    let (status, _) = complete(&m, json!({"cache_salt": "tenant-a"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(last_submitted(&m).cache_salt.as_deref(), Some("tenant-a"));
    let mut chat = chat_body("hi");
    chat["cache_salt"] = json!("tenant-b");
    post_json(app(&m), "/v1/chat/completions", chat).await;
    assert_eq!(last_submitted(&m).cache_salt.as_deref(), Some("tenant-b"));
    complete(&m, json!({})).await;
    assert_eq!(last_submitted(&m).cache_salt, None);
    let (status, body) = complete(&m, json!({"cache_salt": ""})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&body)["param"], "cache_salt");
}
