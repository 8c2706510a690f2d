//! The prompt tokens read from the prefix cache, as each API tells them: OpenAI's
//! `usage.prompt_tokens_details.cached_tokens` (whole and streamed), the Responses API's
//! `input_tokens_details`, SGLang's `meta_info.cached_tokens`. The mock caches like the
//! engine: a prompt's longest start shared with an earlier prompt, never all of it.
//! SGLang's `/flush_cache` and vLLM's `/reset_prefix_cache` forget what is cached.

use serde_json::json;

use axum::http::StatusCode;

use crate::common::{app, chat_body, get, mock, post, post_json, send, stream_chunks, text};
use crate::mock::{MockBackend, MockConfig};

#[tokio::test]
async fn chat_usage_counts_the_cached_start_of_a_repeated_prompt() {
    let m = mock();
    let (_, first) = post_json(app(&m), "/v1/chat/completions", chat_body("hi")).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = post_json(app(&m), "/v1/chat/completions", chat_body("hi")).await;
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        again["usage"]["prompt_tokens_details"],
        json!({"cached_tokens": prompt - 1})
    );
    // Another question shares the template's start only.
    let (_, other) = post_json(app(&m), "/v1/chat/completions", chat_body("bye")).await;
    let cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached < prompt - 1, "{cached} of {prompt}");
}

#[tokio::test]
async fn completions_count_each_choice_and_stream_the_count() {
    let m = mock();
    let body = json!({"prompt": "abcdef", "max_tokens": 3});
    post_json(app(&m), "/v1/completions", body.clone()).await;
    // Two choices of the same prompt: each counts its prompt and its cached part.
    let mut twice = body.clone();
    twice["n"] = json!(2);
    let (_, r) = post_json(app(&m), "/v1/completions", twice).await;
    assert_eq!(r["usage"]["prompt_tokens"], 12);
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 10);
    let mut streamed = body;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream_chunks(app(&m), "/v1/completions", streamed).await;
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 5,
        "{usage}"
    );
}

#[tokio::test]
async fn responses_and_generate_tell_the_cached_tokens() {
    let m = mock();
    let request = json!({"input": "hi", "max_output_tokens": 4});
    let (_, first) = post_json(app(&m), "/v1/responses", request.clone()).await;
    assert_eq!(first["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let (_, again) = post_json(app(&m), "/v1/responses", request).await;
    let input = again["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(
        again["usage"]["input_tokens_details"]["cached_tokens"],
        input - 1
    );

    let generate = json!({"text": ["xyz", "xyw"], "sampling_params": {"max_new_tokens": 2}});
    let (_, out) = post_json(app(&m), "/generate", generate).await;
    // The batch's prompts are submitted in order: the second shares "xy" with the first.
    assert_eq!(out[0]["meta_info"]["cached_tokens"], 0, "{out}");
    assert_eq!(out[1]["meta_info"]["cached_tokens"], 2, "{out}");
}

#[tokio::test]
async fn flush_cache_and_reset_prefix_cache_forget_what_is_cached() {
    let m = mock();
    let cached =
        |r: &serde_json::Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let ask = || post_json(app(&m), "/v1/chat/completions", chat_body("hi"));
    ask().await;
    assert_ne!(cached(&ask().await.1), 0);
    for flush in [
        post("/flush_cache", ""),
        get("/flush_cache"),
        post("/reset_prefix_cache", ""),
    ] {
        let resp = send(app(&m), flush).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(text(resp).await, "Cache flushed.\n");
        assert_eq!(cached(&ask().await.1), 0, "nothing is reused after a flush");
        assert_ne!(cached(&ask().await.1), 0);
    }
    // Still loading: 503, as for a generation.
    let loading = MockBackend::new(MockConfig {
        ready: false,
        ..MockConfig::default()
    });
    let resp = send(app(&loading), post("/flush_cache", "")).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
}
