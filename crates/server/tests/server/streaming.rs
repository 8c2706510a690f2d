//! SSE format (role with the first content, include_usage and continuous usage, [DONE]),
//! provenance per delta,
//! stop strings while streaming, n=2, and client disconnects aborting the engine request.

use std::time::Duration;

use axum::http::StatusCode;
use http_body_util::BodyExt;
use serde_json::{json, Value};

use crate::common::{app, chat_body, get, mock, post, send, stream_chunks, text};
use crate::mock::{MockBackend, MockConfig};

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

fn content_of(chunks: &[Value], index: usize) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["index"] == index)
        .filter_map(|c| {
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(String::from)
        })
        .collect()
}

#[tokio::test]
async fn chat_stream_sends_role_with_first_content_and_ends_with_done() {
    let m = mock();
    let mut body = chat_body("hi");
    body["stream"] = json!(true);
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    assert!(chunks.len() > 3);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert!(
            c.get("usage").is_none(),
            "usage must be absent without include_usage: {c}"
        );
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
    }
    let first = &chunks[0]["choices"][0];
    assert_eq!(first["delta"]["role"], "assistant");
    assert!(
        !first["delta"]["content"].as_str().unwrap().is_empty(),
        "empty first delta: {first}"
    );
    assert!(chunks[1..]
        .iter()
        .all(|c| c["choices"][0]["delta"].get("role").is_none()));
    // Every chunk but the last carries text; none is an empty delta.
    for c in &chunks[..chunks.len() - 1] {
        assert!(
            !c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .is_empty(),
            "{c}"
        );
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        assert!(c.get("tokenrouter").is_none());
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert!(
        last["tokenrouter"]["tokens_by_model"]["quick"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(content_of(&chunks, 0), SCRIPT);
}

#[tokio::test]
async fn include_usage_puts_null_usage_on_chunks_then_a_final_usage_chunk() {
    let m = mock();
    let mut body = chat_body("hi");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["max_tokens"] = json!(10);
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    let (last, content) = chunks.split_last().unwrap();
    for c in content {
        assert_eq!(c["usage"], Value::Null, "{c}");
        assert!(c.as_object().unwrap().contains_key("usage"));
        assert_eq!(c["choices"].as_array().unwrap().len(), 1);
        assert!(c.get("tokenrouter").is_none());
    }
    assert_eq!(
        content.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 10);
    let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(last["usage"]["total_tokens"], prompt + 10);
    assert_eq!(
        last["tokenrouter"],
        json!({"tokens_by_model": {"quick": 6, "reference": 4}, "switches": 4})
    );
}

/// vLLM's `continuous_usage_stats`: every chunk carries the usage so far (completion
/// tokens counting up), the final usage chunk the totals; without `include_usage` it does
/// nothing.
#[tokio::test]
async fn continuous_usage_stats_count_up_on_every_chunk() {
    let m = mock();
    for endpoint in ["/v1/chat/completions", "/v1/completions"] {
        let mut body = match endpoint {
            "/v1/completions" => json!({"prompt": "hi"}),
            _ => chat_body("hi"),
        };
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
        body["max_tokens"] = json!(10);
        let chunks = stream_chunks(app(&m), endpoint, body.clone()).await;
        let (last, content) = chunks.split_last().unwrap();
        let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
        let mut seen = 0;
        for c in content {
            let u = &c["usage"];
            let done = u["completion_tokens"]
                .as_u64()
                .expect("usage on every chunk");
            assert!(done >= seen && done <= 10, "{c}");
            assert_eq!(u["prompt_tokens"], prompt);
            assert_eq!(u["total_tokens"], prompt + done);
            seen = done;
        }
        assert_eq!(seen, 10, "{endpoint}");
        assert_eq!(last["usage"]["completion_tokens"], 10);

        body["stream_options"] = json!({"continuous_usage_stats": true});
        let chunks = stream_chunks(app(&m), endpoint, body).await;
        assert!(
            chunks.iter().all(|c| c.get("usage").is_none()),
            "{endpoint}"
        );
    }
}

#[tokio::test]
async fn token_sources_and_logprobs_follow_each_delta() {
    let m = mock();
    let body = json!({
        "messages": [{"role": "user", "content": "hi"}], "stream": true,
        "return_token_sources": true, "logprobs": true, "top_logprobs": 1,
        "stream_options": {"include_usage": true}
    });
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    let mut all_sources = Vec::new();
    for c in chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
    {
        let choice = &c["choices"][0];
        let sources = choice["token_sources"].as_array().unwrap();
        let logprobs = choice["logprobs"]["content"].as_array().unwrap();
        let details = choice["token_details"].as_array().unwrap();
        assert_eq!(sources.len(), logprobs.len(), "{c}");
        assert_eq!(sources.len(), details.len());
        for (s, lp) in sources.iter().zip(logprobs) {
            assert_eq!(*s, lp["source"]);
        }
        // "日" is three byte tokens: one delta with its three sources.
        if choice["delta"]["content"] == "日" {
            assert_eq!(sources.len(), 3);
        }
        all_sources.extend(sources.iter().cloned());
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        all_sources.len() as u64,
        usage["completion_tokens"].as_u64().unwrap()
    );
    let expected: Vec<&str> = (0..all_sources.len())
        .map(|i| {
            if (i / 2) % 2 == 0 {
                "quick"
            } else {
                "reference"
            }
        })
        .collect();
    assert_eq!(all_sources, expected);
}

#[tokio::test]
async fn completion_stream_and_stop_string_spanning_models() {
    let m = mock();
    let body = json!({"prompt": "x", "stream": true, "stop": "END", "return_token_sources": true});
    let chunks = stream_chunks(app(&m), "/v1/completions", body).await;
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
    }
    let text = content_of(&chunks, 0);
    assert_eq!(text, &SCRIPT[..SCRIPT.find("END").unwrap()]);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    // The held-back "END" tokens arrive with the finish chunk, from both models.
    let sources = last["choices"][0]["token_sources"].as_array().unwrap();
    assert!(
        sources.contains(&json!("quick")) && sources.contains(&json!("reference")),
        "{last}"
    );
    let generated: usize = chunks
        .iter()
        .map(|c| {
            c["choices"][0]["token_sources"]
                .as_array()
                .map_or(0, Vec::len)
        })
        .sum();
    assert_eq!(generated, SCRIPT.find("END").unwrap() + 3);
}

#[tokio::test]
async fn n_two_streams_both_choices_each_with_role_and_finish() {
    let m = mock();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 2,
                      "seed": 1, "max_tokens": 12, "stream_options": {"include_usage": true}});
    let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
    for index in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == index))
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            mine.iter()
                .filter(|c| c["choices"][0]["delta"].get("role").is_some())
                .count(),
            1
        );
        assert_eq!(
            mine.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    assert_eq!(content_of(&chunks, 0), "seed 1: Hell");
    assert_eq!(content_of(&chunks, 1), "seed 2: Hell");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 24);
}

#[tokio::test]
async fn dropping_a_stream_mid_way_aborts_the_engine_request() {
    let m = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(5),
        ..MockConfig::default()
    });
    let router = app(&m);
    let body = json!({"prompt": "x", "stream": true, "max_tokens": 400, "ignore_eos": true});
    let resp = send(router.clone(), post("/v1/completions", body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut received = 0;
    while received < 2 {
        let frame = body.frame().await.expect("a frame").expect("no error");
        if frame.is_data() {
            received += 1;
        }
    }
    assert!(m.log().aborted.is_empty());
    drop(body);
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.aborted.len() == 1)
            .await,
        "engine request not aborted"
    );
    assert_eq!(m.log().running, 0);
    let metrics = text(send(router, get("/metrics")).await).await;
    assert!(metrics.contains("tokenrouter:requests_aborted_total{model=\"tokenrouter\",reason=\"client_disconnect\"} 1"), "{metrics}");
    assert!(metrics.contains("tokenrouter:num_requests_running{model=\"tokenrouter\"} 0"));
}

#[tokio::test]
async fn dropping_a_non_streaming_request_aborts_the_engine_request() {
    let m = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(5),
        ..MockConfig::default()
    });
    let router = app(&m);
    let body = json!({"prompt": "x", "max_tokens": 400, "ignore_eos": true});
    let task = tokio::spawn(send(router, post("/v1/completions", body.to_string())));
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.running == 1)
            .await
    );
    task.abort();
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.aborted.len() == 1)
            .await,
        "engine request not aborted"
    );
}
