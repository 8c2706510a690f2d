//! SGLang's native `POST /generate` over the mock: one prompt or a batch, text or ids, one
//! `sampling_params` or one per prompt, `meta_info` (finish reason with what matched,
//! counts, provenance, log-probabilities), streaming of the text so far, and its errors;
//! SGLang's `/health_generate`, `/get_model_info` and `/abort_request`.

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::common::{app, error_of, get, mock, post, post_json, send, sse_data, text};
use crate::mock::{logprob_of, prompt_logprob_of, MockBackend, MockConfig, EOS};
use tokenrouter_api::ModelLoad;

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

async fn generate(body: Value) -> (StatusCode, Value) {
    post_json(app(&mock()), "/generate", body).await
}

#[tokio::test]
async fn one_prompt_gets_an_object_with_meta_info() {
    let (status, out) = generate(json!({"text": "abc", "rid": "r1"})).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["text"], SCRIPT);
    let ids = out["output_ids"].as_array().unwrap();
    let meta = &out["meta_info"];
    assert_eq!(meta["id"], "r1");
    // The script's bytes, then the mock's EOS: matched, its text left out.
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "stop", "matched": EOS})
    );
    assert_eq!(ids.last().unwrap(), &json!(EOS));
    assert_eq!(meta["prompt_tokens"], 3);
    assert_eq!(meta["completion_tokens"], ids.len());
    let sources = meta["token_sources"].as_array().unwrap();
    assert_eq!(sources.len(), ids.len());
    let by_model = &meta["tokens_by_model"];
    assert_eq!(
        by_model["quick"].as_u64().unwrap() + by_model["reference"].as_u64().unwrap(),
        ids.len() as u64
    );
    assert!(meta["e2e_latency"].as_f64().unwrap() >= 0.0);
    assert!(meta.get("output_token_logprobs").is_none());
}

#[tokio::test]
async fn a_batch_gets_a_list_and_each_prompt_its_params() {
    let params = json!([{"max_new_tokens": 5}, {"max_new_tokens": 3, "temperature": 0}]);
    let (status, out) = generate(json!({"text": ["ab", "cd"], "sampling_params": params,
        "rid": "b"}))
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let list = out.as_array().unwrap();
    assert_eq!(list.len(), 2);
    for (i, (answer, n)) in list.iter().zip([5, 3]).enumerate() {
        assert_eq!(answer["text"], SCRIPT[..n]);
        let meta = &answer["meta_info"];
        assert_eq!(meta["id"], format!("b_{i}"));
        assert_eq!(
            meta["finish_reason"],
            json!({"type": "length", "length": n})
        );
    }
    // Ids, one prompt and a batch.
    let (_, out) = generate(json!({"input_ids": [1, 2, 3], "sampling_params":
        {"max_new_tokens": 2}}))
    .await;
    assert_eq!(out["text"], "He");
    assert_eq!(out["meta_info"]["prompt_tokens"], 3);
    let (_, out) = generate(json!({"input_ids": [[1, 2], [3]], "sampling_params":
        {"max_new_tokens": 2}}))
    .await;
    assert_eq!(out.as_array().unwrap().len(), 2);
    assert_eq!(out[1]["meta_info"]["prompt_tokens"], 1);
}

#[tokio::test]
async fn a_stop_string_is_named_and_cut() {
    let (_, out) =
        generate(json!({"text": "x", "sampling_params": {"stop": ["world", "zzz"]}})).await;
    assert_eq!(out["text"], "Hello, ");
    assert_eq!(
        out["meta_info"]["finish_reason"],
        json!({"type": "stop", "matched": "world"})
    );
    let (_, out) = generate(json!({"text": "x", "sampling_params":
        {"stop": "world", "no_stop_trim": true}}))
    .await;
    assert_eq!(out["text"], "Hello, world");
}

#[tokio::test]
async fn logprobs_are_triples_from_logprob_start_len() {
    let body = json!({"text": "abcd", "model": "reference", "return_logprob": true,
        "logprob_start_len": 2, "top_logprobs_num": 2, "return_text_in_logprobs": true,
        "sampling_params": {"max_new_tokens": 3}});
    let (status, out) = generate(body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let meta = &out["meta_info"];
    let close = |entry: &Value, logprob: f32, id: u32, text: &str| {
        assert!(
            (entry[0].as_f64().unwrap() - f64::from(logprob)).abs() < 1e-6,
            "{entry}"
        );
        assert_eq!(
            (&entry[1], &entry[2]),
            (&json!(id), &json!(text)),
            "{entry}"
        );
    };
    close(&meta["output_token_logprobs"][1], logprob_of(1), 101, "e");
    assert_eq!(meta["output_top_logprobs"][0][1][1], 73);
    // Prompt positions 2 and 3 ("c", "d"), each scored after the tokens before it.
    let input = meta["input_token_logprobs"].as_array().unwrap();
    assert_eq!(input.len(), 2);
    close(&input[0], prompt_logprob_of(1), 99, "c");
    assert_eq!(meta["input_top_logprobs"].as_array().unwrap().len(), 2);
    // From 0 the first prompt token is null: nothing came before it.
    let (_, out) = generate(json!({"text": "abcd", "model": "reference",
        "return_logprob": true, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}))
    .await;
    assert_eq!(
        out["meta_info"]["input_token_logprobs"][0],
        json!([null, 97, null])
    );
}

#[tokio::test]
async fn streamed_chunks_carry_the_text_so_far() {
    let body = json!({"text": "x", "stream": true, "sampling_params": {"max_new_tokens": 12}});
    let resp = send(app(&mock()), post("/generate", body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let data = sse_data(&text(resp).await);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.len() > 1);
    let mut previous = String::new();
    for chunk in &chunks {
        let so_far = chunk["text"].as_str().unwrap();
        assert!(
            so_far.starts_with(&previous),
            "{so_far:?} after {previous:?}"
        );
        previous = so_far.to_string();
        assert_eq!(chunk["index"], 0);
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["text"], SCRIPT[..12]);
    assert_eq!(last["meta_info"]["completion_tokens"], 12);
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert!(chunks[0]["meta_info"]["finish_reason"].is_null());
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    for (body, param) in [
        (json!({"text": "a", "input_ids": [1]}), "input_ids"),
        (
            json!({"text": "a", "sampling_params": {"max_new_token": 3}}),
            "sampling_params",
        ),
        (
            json!({"text": ["a", "b"], "sampling_params": [{}]}),
            "sampling_params",
        ),
        (
            json!({"text": "a", "sampling_params": [1]}),
            "sampling_params",
        ),
        (json!({"text": "a", "image_data": "x.png"}), "image_data"),
        (json!({"text": 5}), "text"),
        (json!({"text": []}), "text"),
    ] {
        let (status, out) = generate(body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {out}");
        assert_eq!(error_of(&out)["param"], param, "{body} -> {out}");
    }
    let (status, out) = generate(json!({"sampling_params": {}})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
    let (status, _) = generate(json!({"text": "a", "model": "nope"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

async fn get_json(app: axum::Router, path: &str) -> (StatusCode, Value) {
    let resp = send(app, get(path)).await;
    let status = resp.status();
    (status, serde_json::from_str(&text(resp).await).unwrap())
}

#[tokio::test]
async fn health_generate_asks_every_model_for_a_token() {
    let m = mock();
    let (status, body) = get_json(app(&m), "/health_generate").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["seconds"]["quick"].is_number() && body["seconds"]["reference"].is_number());
    let pinned: Vec<_> = m
        .log()
        .submitted
        .iter()
        .map(|r| (r.pinned_model, r.max_tokens))
        .collect();
    assert_eq!(pinned, [(Some(0), Some(1)), (Some(1), Some(1))]);
    let failing = MockBackend::new(MockConfig {
        error_at: Some(0),
        ..MockConfig::default()
    });
    let (status, body) = get_json(app(&failing), "/health_generate").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        error_of(&body)["message"]
            .as_str()
            .unwrap()
            .contains("quick"),
        "{body}"
    );
    let loading = MockBackend::new(MockConfig {
        ready: false,
        ..MockConfig::default()
    });
    let (status, _) = get_json(app(&loading), "/health_generate").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn model_info_names_the_pair() {
    let (status, body) = get_json(app(&mock()), "/get_model_info").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["model_path"], "mock/small");
    assert_eq!(body["is_generation"], true);
    assert_eq!(body["models"].as_array().unwrap().len(), 2);
    assert_eq!(body["models"][1]["name"], "reference");
}

/// SGLang's `/get_load` (what its router's load-aware policies poll) sums the pair's load as
/// one data-parallel rank; `/get_server_info` (and `/server_info`) names the pair and tells
/// each model's load; `/model_info` is `/get_model_info`'s newer name.
#[tokio::test]
async fn server_info_and_load_in_sglangs_shape() {
    let load = |name: &str, running, waiting, kv_tokens| ModelLoad {
        name: name.into(),
        running,
        waiting,
        kv_usage: 0.25,
        kv_tokens,
    };
    let m = MockBackend::new(MockConfig {
        load: vec![load("quick", 2, 1, 48), load("reference", 1, 3, 32)],
        ..MockConfig::default()
    });
    let (status, body) = get_json(app(&m), "/get_load").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body,
        json!([{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 4, "num_tokens": 80}])
    );
    for path in ["/get_server_info", "/server_info"] {
        let (status, body) = get_json(app(&m), path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(body["model_path"], "mock/small", "{body}");
        assert_eq!(body["context_length"], 512, "{body}");
        assert_eq!(body["dp_size"], 1, "{body}");
        assert_eq!(body["models"][1]["name"], "reference", "{body}");
        let models = &body["internal_states"][0]["models"];
        assert_eq!(models[1]["num_queue_reqs"], 3, "{body}");
        assert_eq!(models[0]["num_used_tokens"], 48, "{body}");
        assert!(body["version"].is_string(), "{body}");
    }
    let (status, body) = get_json(app(&m), "/model_info").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["is_generation"], true);
}

/// SGLang's `n`: each prompt sampled n times, the batch once per sample (SGLang's order),
/// sample i seeded `seed + i`.
#[tokio::test]
async fn n_samples_come_back_in_sglangs_order() {
    let m = mock();
    let body = json!({"input_ids": [[1], [2, 3]],
        "sampling_params": {"n": 2, "max_new_tokens": 4, "sampling_seed": 5}});
    let (status, out) = post_json(app(&m), "/generate", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let sizes: Vec<u64> = out
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["meta_info"]["prompt_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [1, 2, 1, 2]);
    let seeds: Vec<_> = m.log().submitted.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, [Some(5), Some(5), Some(6), Some(6)]);
    // One prompt with n > 1 is a list too.
    let (_, out) = post_json(
        app(&m),
        "/generate",
        json!({"text": "x", "sampling_params": {"n": 3, "max_new_tokens": 2}}),
    )
    .await;
    assert_eq!(out.as_array().unwrap().len(), 3);
    for sampling in [
        json!({"n": 0}),
        json!({"n": 17}),
        json!([{"n": 2}, {"n": 1}]),
    ] {
        let (status, out) = post_json(
            app(&m),
            "/generate",
            json!({"text": ["a", "b"], "sampling_params": sampling}),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
        assert_eq!(error_of(&out)["param"], "sampling_params");
    }
}

/// Waits until the mock runs `n` requests.
async fn running(m: &MockBackend, n: usize) {
    let started = std::time::Instant::now();
    while m.log().running < n {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn abort_request_stops_a_running_generate_by_rid_or_all() {
    let m = MockBackend::new(MockConfig {
        token_delay: std::time::Duration::from_millis(5),
        ..MockConfig::default()
    });
    let router = app(&m);
    let long = |rid: &str| {
        json!({"text": "abc", "rid": rid,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": true}})
    };
    let first = tokio::spawn(post_json(router.clone(), "/generate", long("r1")));
    running(&m, 1).await;
    // Another rid, then no rid: nothing stops (200 all the same, as SGLang answers).
    for body in [json!({"rid": "other"}), json!({})] {
        let resp = send(router.clone(), post("/abort_request", body.to_string())).await;
        assert_eq!(resp.status(), StatusCode::OK);
    }
    assert_eq!(m.log().running, 1);
    tokio::time::sleep(std::time::Duration::from_millis(40)).await;
    let resp = send(router.clone(), post("/abort_request", r#"{"rid": "r1"}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, out) = first.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["meta_info"]["finish_reason"], json!({"type": "abort"}));
    let written = out["meta_info"]["completion_tokens"].as_u64().unwrap();
    assert!(written > 0 && written < 400, "{written}");
    assert_eq!(out["output_ids"].as_array().unwrap().len() as u64, written);

    // abort_all: every running /generate, a batch's prompts and a streamed one alike.
    let batch = json!({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 400,
        "ignore_eos": true}});
    let batch = tokio::spawn(post_json(router.clone(), "/generate", batch));
    let mut streamed = long("r3");
    streamed["stream"] = json!(true);
    let r = router.clone();
    let streamed =
        tokio::spawn(
            async move { text(send(r, post("/generate", streamed.to_string())).await).await },
        );
    running(&m, 3).await;
    // Another server's registry is its own.
    let resp = send(app(&m), post("/abort_request", r#"{"abort_all": true}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(m.log().running, 3);
    let resp = send(router, post("/abort_request", r#"{"abort_all": true}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, out) = batch.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    for answer in out.as_array().unwrap() {
        assert_eq!(
            answer["meta_info"]["finish_reason"],
            json!({"type": "abort"})
        );
    }
    let chunks = sse_data(&streamed.await.unwrap());
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&chunks[chunks.len() - 2]).unwrap();
    assert_eq!(last["meta_info"]["finish_reason"], json!({"type": "abort"}));
    // Each engine request was aborted (its stream dropped), none runs on.
    running_at_most(&m, 0).await;
}

/// Waits until the mock runs at most `n` requests.
async fn running_at_most(m: &MockBackend, n: usize) {
    let started = std::time::Instant::now();
    while m.log().running > n {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "still running"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// SGLang's `rid` on the OpenAI endpoints: `/abort_request` stops a chat completion by it
/// (finish reason `abort`, what it wrote kept), and `abort_all` reaches OpenAI requests
/// without one too.
#[tokio::test]
async fn abort_request_reaches_openai_requests() {
    let m = MockBackend::new(MockConfig {
        token_delay: std::time::Duration::from_millis(5),
        ..MockConfig::default()
    });
    let router = app(&m);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "rid": "c1",
        "max_tokens": 400, "ignore_eos": true});
    let chat = tokio::spawn(post_json(router.clone(), "/v1/chat/completions", chat));
    running(&m, 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let resp = send(router.clone(), post("/abort_request", r#"{"rid": "c1"}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, out) = chat.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "abort");
    let written = out["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(written > 0 && written < 400, "{written}");

    let completion = json!({"prompt": "hi", "max_tokens": 400, "ignore_eos": true});
    let completion = tokio::spawn(post_json(router.clone(), "/v1/completions", completion));
    running(&m, 1).await;
    let resp = send(router, post("/abort_request", r#"{"abort_all": true}"#)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, out) = completion.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "abort");
    running_at_most(&m, 0).await;
}
