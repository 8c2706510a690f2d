//! `echo` on `/v1/completions`: the prompt before the completion, its tokens' scores with
//! `logprobs` (the first `null`), `max_tokens: 0` for the prompt alone, streamed as a first
//! chunk; scoring a prompt needs a pinned model. vLLM's `prompt_logprobs` shows the same
//! scores in its own shape.

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::common::*;
use crate::mock::{logprob_of, prompt_logprob_of};

fn approx(v: &Value, want: f32) -> bool {
    v.as_f64()
        .is_some_and(|x| (x - f64::from(want)).abs() < 1e-6)
}

#[tokio::test]
async fn echo_shows_the_prompt_before_the_completion() {
    let m = mock();
    let body = json!({"prompt": "ab", "echo": true, "max_tokens": 3});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["text"], "abHel");
    assert_eq!(resp["usage"]["completion_tokens"], 3);
    // No logprobs asked: the prompt is not scored.
    assert_eq!(m.log().submitted[0].prompt_logprobs, None);
    // Token ids are shown decoded, special tokens kept.
    let body = json!({"prompt": [[257, 120]], "echo": true, "max_tokens": 1});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"][0]["text"], "<|im_start|>xH");
}

#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt_first() {
    let m = mock();
    let body = json!({"model": "quick", "prompt": "abc", "echo": true, "logprobs": 1,
                      "max_tokens": 2, "temperature": 0});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[0].prompt_logprobs, Some(1));
    let choice = &resp["choices"][0];
    assert_eq!(choice["text"], "abcHe");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["a", "b", "c", "H", "e"]));
    let values = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(values[0], Value::Null);
    assert!(approx(&values[1], prompt_logprob_of(0)) && approx(&values[2], prompt_logprob_of(1)));
    assert!(approx(&values[3], logprob_of(0)) && approx(&values[4], logprob_of(1)));
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(top[0], Value::Null);
    assert_eq!(top[1].as_object().unwrap().len(), 1);
    assert!(approx(&top[2]["c"], 0.0), "{top:?}");
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    assert_eq!(lp["sources"], json!(vec!["quick"; 5]));
}

#[tokio::test]
async fn max_tokens_zero_with_echo_gives_the_prompt_alone() {
    let m = mock();
    let body = json!({"model": "reference", "prompt": "xyz", "echo": true, "logprobs": 0,
                      "max_tokens": 0});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    // One token is generated and dropped.
    assert_eq!(m.log().submitted[0].max_tokens, Some(1));
    let choice = &resp["choices"][0];
    assert_eq!(choice["text"], "xyz");
    assert_eq!(choice["finish_reason"], "length");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["x", "y", "z"]));
    assert_eq!(lp["top_logprobs"], json!([null, null, null]));
    assert_eq!(lp["sources"], json!(vec!["reference"; 3]));
    assert_eq!(resp["usage"]["completion_tokens"], 0);
    assert_eq!(resp["usage"]["prompt_tokens"], 3);
    // Without echo, 0 stays refused.
    let body = json!({"prompt": "xyz", "max_tokens": 0});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&resp)["param"], "max_tokens");
}

#[tokio::test]
async fn scoring_a_prompt_needs_a_pinned_model() {
    let m = mock();
    let body = json!({"prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 1});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
    let err = error_of(&resp);
    assert_eq!(err["param"], "echo");
    let message = err["message"].as_str().unwrap();
    assert!(message.contains("quick, reference"), "{message}");
    assert!(m.log().submitted.is_empty());
}

#[tokio::test]
async fn a_streamed_echo_shows_the_prompt_first() {
    let m = mock();
    for (logprobs, max_tokens) in [(None, 3), (Some(1), 3), (Some(1), 0)] {
        let mut body = json!({"model": "quick", "prompt": ["ab", "c"], "echo": true,
                              "max_tokens": max_tokens, "stream": true,
                              "stream_options": {"include_usage": true}});
        if let Some(k) = logprobs {
            body["logprobs"] = json!(k);
        }
        let chunks = stream_chunks(app(&m), "/v1/completions", body).await;
        for (index, prompt) in [(0, "ab"), (1, "c")] {
            let mine: Vec<&Value> = chunks
                .iter()
                .flat_map(|c| c["choices"].as_array().unwrap())
                .filter(|c| c["index"] == index)
                .collect();
            assert_eq!(mine[0]["text"], prompt, "{logprobs:?} {max_tokens}");
            if logprobs.is_some() {
                let first = &mine[0]["logprobs"];
                assert_eq!(first["token_logprobs"][0], Value::Null);
                assert_eq!(first["tokens"].as_array().unwrap().len(), prompt.len());
            }
            let text: String = mine.iter().map(|c| c["text"].as_str().unwrap()).collect();
            let want = match max_tokens {
                0 => prompt.to_string(),
                _ => format!("{prompt}Hel"),
            };
            assert_eq!(text, want, "{logprobs:?} {max_tokens}");
            assert_eq!(mine.last().unwrap()["finish_reason"], "length");
            if logprobs.is_some() && max_tokens > 0 {
                // The completion's offsets continue after the prompt's.
                let second = &mine[1]["logprobs"]["text_offset"][0];
                assert_eq!(second.as_u64(), Some(prompt.len() as u64), "{mine:?}");
            }
        }
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(
            usage["completion_tokens"],
            if max_tokens == 0 { 0 } else { 6 }
        );
    }
}

/// vLLM's `prompt_logprobs`: per prompt position (the first `null`) a map from token id to
/// `{logprob, rank, decoded_token}`, the prompt's token and the top k; on each completion
/// choice, and once at the top of a chat response.
#[tokio::test]
async fn prompt_logprobs_score_the_prompt_as_vllm_shows_them() {
    let m = mock();
    let body = json!({"model": "quick", "prompt": "abc", "prompt_logprobs": 2, "max_tokens": 2});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[0].prompt_logprobs, Some(2));
    let choice = &resp["choices"][0];
    // Not echoed: the text is the completion's alone, and no legacy logprobs were asked.
    assert_eq!(choice["text"], "He");
    assert_eq!(choice["logprobs"], Value::Null);
    let plp = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), 3);
    assert_eq!(plp[0], Value::Null);
    // The mock scores "b" (98) first among its alternatives 98, 99.
    let b = plp[1].as_object().unwrap();
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(approx(&b["98"]["logprob"], prompt_logprob_of(0)));
    assert_eq!(b["98"]["rank"], 1);
    assert_eq!(b["98"]["decoded_token"], "b");
    assert_eq!(b["99"]["rank"], 2);
    assert_eq!(b["99"]["decoded_token"], "c");

    // With echo and logprobs: both shapes, each with its own count of alternatives.
    let body = json!({"model": "quick", "prompt": "abc", "echo": true, "logprobs": 1,
                      "prompt_logprobs": 3, "max_tokens": 1});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[1].prompt_logprobs, Some(3));
    let choice = &resp["choices"][0];
    assert_eq!(
        choice["logprobs"]["top_logprobs"][1]
            .as_object()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(choice["prompt_logprobs"][1].as_object().unwrap().len(), 3);

    // Chat: once, beside the choices; 0 alternatives = the prompt's tokens alone.
    let body = json!({"model": "reference", "messages": [{"role": "user", "content": "hi"}],
                      "prompt_logprobs": 0, "max_tokens": 1, "n": 2});
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let plp = resp["prompt_logprobs"].as_array().unwrap();
    assert!(plp.len() > 2 && plp[0].is_null());
    assert!(plp[1..].iter().all(|p| p.as_object().unwrap().len() == 1));
    assert!(resp["choices"][0].get("prompt_logprobs").is_none());

    // Absent unless asked.
    let body = json!({"model": "quick", "prompt": "abc", "max_tokens": 1});
    let (_, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert!(resp["choices"][0].get("prompt_logprobs").is_none());
    assert!(resp.get("prompt_logprobs").is_none());
}

#[tokio::test]
async fn prompt_logprobs_are_refused_where_vllm_refuses_them() {
    let m = mock();
    for (body, says) in [
        (
            json!({"model": "quick", "prompt": "a", "prompt_logprobs": -1}),
            "between 0 and",
        ),
        (
            json!({"model": "quick", "prompt": "a", "prompt_logprobs": 1000}),
            "between 0 and",
        ),
        (
            json!({"model": "quick", "prompt": "a", "prompt_logprobs": 1, "stream": true}),
            "stream",
        ),
        // A routed request: whose scores would they be?
        (
            json!({"prompt": "a", "prompt_logprobs": 1}),
            "quick, reference",
        ),
    ] {
        let (status, resp) = post_json(app(&m), "/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {resp}");
        assert_eq!(resp["error"]["param"], "prompt_logprobs", "{resp}");
        let message = resp["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
    }
    assert!(m.log().submitted.is_empty());
}
