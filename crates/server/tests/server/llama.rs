//! llama.cpp's native endpoints over the mock: `/completion` (prompt forms, llama.cpp's
//! sampling defaults, `n_predict`, stop words, `n_probs`, `logit_bias` lists,
//! `response_fields`, `grammar` / `json_schema`, streaming without `[DONE]`), `/infill` (the fill-in-the-middle prompt
//! with repository context, its end tokens, its field checks), `/props` and OpenAI's `suffix` on
//! `/v1/completions`.

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_api::{OutputConstraint, RoutingOverrides};

use crate::common::{app, error_of, mock, post, post_json, send, sse_data, text};
use crate::mock::{
    MockBackend, MockConfig, FIM_FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_REPO, FIM_SUFFIX,
};

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[tokio::test]
async fn completion_answers_in_llama_cpp_shape_with_its_sampling_defaults() {
    let m = mock();
    let (status, out) = post_json(app(&m), "/completion", json!({"prompt": "abc"})).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["content"], SCRIPT);
    assert_eq!(out["stop"], true);
    assert_eq!(out["stop_type"], "eos");
    assert_eq!(out["stopping_word"], "");
    assert_eq!(out["model"], "tokenrouter");
    assert_eq!(out["tokens_evaluated"], 3);
    assert_eq!(out["prompt"], "abc");
    assert_eq!(out["has_new_line"], false);
    assert_eq!(out["truncated"], false);
    assert_eq!(out["tokens"], json!([]));
    // The script's bytes and the mock's EOS.
    let predicted = out["tokens_predicted"].as_u64().unwrap();
    assert_eq!(predicted, SCRIPT.len() as u64 + 1);
    let timings = &out["timings"];
    assert_eq!(timings["prompt_n"], 3);
    assert_eq!(timings["predicted_n"], predicted);
    assert!(timings["predicted_ms"].as_f64().unwrap() >= 0.0);
    let by_model = &out["tokenrouter"]["tokens_by_model"];
    assert_eq!(
        by_model["quick"].as_u64().unwrap() + by_model["reference"].as_u64().unwrap(),
        predicted
    );
    assert_eq!(out["generation_settings"]["n_predict"], -1);
    let sent = m.log().submitted[0].clone();
    assert_eq!(sent.prompt_ids, bytes("abc"));
    assert_eq!((sent.sampling.temperature, sent.sampling.top_k), (0.8, 40));
    assert_eq!((sent.sampling.top_p, sent.sampling.min_p), (0.95, 0.05));
    assert_eq!(sent.sampling.penalty_last_n, Some(64));
    assert_eq!(out["generation_settings"]["repeat_last_n"], 64);
    assert_eq!(sent.max_tokens, None);
    assert_eq!(sent.pinned_model, None);
    // llama.cpp's penalty window: 0 (none) and -1 (the whole context) as it reads them.
    for (given, window, shown) in [(0, 0, 0), (-1, usize::MAX, -1), (200, 200, 200)] {
        let body = json!({"prompt": "abc", "repeat_last_n": given, "repeat_penalty": 1.1});
        let (status, out) = post_json(app(&m), "/completion", body).await;
        assert_eq!(status, StatusCode::OK, "{out}");
        let sent = m.log().submitted.last().cloned().unwrap();
        assert_eq!(sent.sampling.penalty_last_n, Some(window));
        assert_eq!(out["generation_settings"]["repeat_last_n"], shown);
    }
}

#[tokio::test]
async fn n_predict_stop_words_and_pinning_end_and_place_the_answer() {
    let m = mock();
    let (_, out) = post_json(
        app(&m),
        "/completion",
        json!({"prompt": "x", "n_predict": 5, "temperature": 0, "top_k": 0, "model": "quick"}),
    )
    .await;
    assert_eq!(out["content"], SCRIPT[..5]);
    assert_eq!(out["stop_type"], "limit");
    assert_eq!(out["model"], "quick");
    let sent = m.log().submitted[0].clone();
    assert_eq!((sent.max_tokens, sent.pinned_model), (Some(5), Some(0)));
    assert_eq!((sent.sampling.temperature, sent.sampling.top_k), (0.0, 0));

    let (_, out) = post_json(
        app(&m),
        "/completions",
        json!({"prompt": "x", "stop": ["world", "zzz"], "max_tokens": 40}),
    )
    .await;
    assert_eq!(out["content"], "Hello, ");
    assert_eq!(out["stop_type"], "word");
    assert_eq!(out["stopping_word"], "world");
    assert_eq!(m.log().submitted[1].max_tokens, Some(40));
}

#[tokio::test]
async fn prompts_may_mix_ids_and_text_or_come_as_a_batch() {
    let m = mock();
    let (status, out) = post_json(
        app(&m),
        "/completion",
        json!({"prompt": [104, "i", 33], "n_predict": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(m.log().submitted[0].prompt_ids, bytes("hi!"));
    assert_eq!(out["prompt"], "hi!");

    let (status, out) = post_json(
        app(&m),
        "/completion",
        json!({"prompt": ["ab", [99, 100, 101]], "n_predict": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let list = out.as_array().unwrap();
    assert_eq!(list.len(), 2);
    for (i, answer) in list.iter().enumerate() {
        assert_eq!(answer["index"], i);
        assert_eq!(answer["content"], SCRIPT[..3]);
        assert_eq!(answer["tokens_evaluated"], 2 + i);
    }
    let log = m.log();
    assert_eq!(log.submitted[1].prompt_ids, bytes("ab"));
    assert_eq!(log.submitted[2].prompt_ids, bytes("cde"));
}

#[tokio::test]
async fn streaming_sends_new_text_then_the_final_answer_without_done() {
    let m = mock();
    let resp = send(
        app(&m),
        post(
            "/completion",
            json!({"prompt": "a", "stream": true, "n_predict": 12, "return_tokens": true})
                .to_string(),
        ),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let data = sse_data(&text(resp).await);
    assert!(!data.iter().any(|d| d == "[DONE]"), "{data:?}");
    let events: Vec<Value> = data
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (last, partial) = events.split_last().unwrap();
    assert!(partial.iter().all(|e| e["stop"] == false));
    let streamed: String = partial
        .iter()
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, SCRIPT[..12]);
    let ids: Vec<u64> = partial
        .iter()
        .flat_map(|e| e["tokens"].as_array().unwrap().clone())
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 12);
    assert_eq!(
        partial.last().unwrap()["tokens_predicted"],
        12,
        "{partial:?}"
    );
    assert_eq!(last["stop"], true);
    assert_eq!(last["content"], "");
    assert_eq!(last["stop_type"], "limit");
    assert_eq!(last["tokens_predicted"], 12);
}

#[tokio::test]
async fn n_probs_gives_completion_probabilities_with_alternatives() {
    let m = mock();
    let (status, out) = post_json(
        app(&m),
        "/completion",
        json!({"prompt": "a", "n_predict": 4, "n_probs": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let probs = out["completion_probabilities"].as_array().unwrap();
    assert_eq!(probs.len(), 4);
    assert_eq!(probs[0]["token"], "H");
    assert_eq!(probs[0]["id"], u32::from(b'H'));
    assert_eq!(probs[0]["bytes"], json!([b'H']));
    assert!(probs[0]["logprob"].as_f64().unwrap() < 0.0);
    assert_eq!(probs[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(m.log().submitted[0].top_logprobs, 2);
}

#[tokio::test]
async fn logit_bias_reads_llama_cpp_lists_and_openai_objects() {
    let m = mock();
    let body = json!({"prompt": "a", "n_predict": 1,
        "logit_bias": [[65, 1.5], [66, false], ["hi", -2.0]]});
    let (status, out) = post_json(app(&m), "/completion", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(
        m.log().submitted[0].sampling.logit_bias,
        [(65, 1.5), (66, -100.0), (104, -2.0), (105, -2.0)]
    );
    let body = json!({"prompt": "a", "n_predict": 1, "logit_bias": {"67": 3}});
    post_json(app(&m), "/completion", body).await;
    assert_eq!(m.log().submitted[1].sampling.logit_bias, [(67, 3.0)]);
    for bad in [
        json!([[65]]),
        json!([[{"a": 1}, 1]]),
        json!("x"),
        json!({"x": 1}),
    ] {
        let body = json!({"prompt": "a", "logit_bias": bad});
        let (status, out) = post_json(app(&m), "/completion", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(error_of(&out)["param"], "logit_bias");
    }
}

#[tokio::test]
async fn response_fields_reduce_the_answer_to_their_paths() {
    let body = json!({"prompt": "a", "n_predict": 2,
        "response_fields": ["content", "timings/prompt_n", "truncated"]});
    let (_, out) = post_json(app(&mock()), "/completion", body).await;
    assert_eq!(
        out,
        json!({"content": SCRIPT[..2], "timings/prompt_n": 1, "truncated": false})
    );
}

#[tokio::test]
async fn grammar_and_json_schema_reach_the_engine_as_constraints() {
    let m = mock();
    for (extra, want) in [
        (
            json!({"grammar": "root ::= [0-9]+"}),
            OutputConstraint::Gbnf("root ::= [0-9]+".into()),
        ),
        // llama.cpp's llguidance grammars are Lark.
        (
            json!({"grammar": "%llguidance {}\nstart: \"a\""}),
            OutputConstraint::Lark("%llguidance {}\nstart: \"a\"".into()),
        ),
        (
            json!({"json_schema": {"type": "object"}, "grammar": ""}),
            OutputConstraint::JsonSchema(json!({"type": "object"})),
        ),
    ] {
        let mut body = json!({"prompt": "a", "n_predict": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, out) = post_json(app(&m), "/completion", body).await;
        assert_eq!(status, StatusCode::OK, "{out}");
        let last = m.log().submitted.last().unwrap().constraint.clone();
        assert_eq!(last, Some(want), "{extra}");
    }
}

/// The server's routing for editor completions reaches `/infill` and `suffix` requests that
/// give none; a request's own `routing` wins; other requests keep theirs (none).
#[tokio::test]
async fn fill_in_the_middle_requests_take_the_servers_routing_defaults() {
    let m = MockBackend::new(MockConfig {
        fim_routing: RoutingOverrides([("threshold".to_string(), 0.03)].into()),
        ..MockConfig::default()
    });
    let defaults = RoutingOverrides([("threshold".to_string(), 0.03)].into());
    let own = RoutingOverrides([("threshold".to_string(), 0.2)].into());
    for (path, body, want) in [
        (
            "/infill",
            json!({"input_prefix": "a", "input_suffix": "b"}),
            &defaults,
        ),
        (
            "/infill",
            json!({"input_prefix": "a", "input_suffix": "b", "routing": {"threshold": 0.2}}),
            &own,
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "suffix": "b"}),
            &defaults,
        ),
        (
            "/v1/completions",
            json!({"prompt": "a"}),
            &RoutingOverrides::default(),
        ),
        (
            "/completion",
            json!({"prompt": "a"}),
            &RoutingOverrides::default(),
        ),
    ] {
        let mut body = body;
        body["n_predict"] = json!(2);
        body["max_tokens"] = json!(2);
        let (status, out) = post_json(app(&m), path, body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{path} {body}: {out}");
        let last = m.log().submitted.last().unwrap().routing.clone();
        assert_eq!(&last, want, "{path} {body}");
    }
}

#[tokio::test]
async fn props_tell_the_context_default_sampling_and_model() {
    let m = mock();
    let response = send(
        app(&m),
        axum::http::Request::get("/props")
            .body(axum::body::Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let props: Value = serde_json::from_str(&text(response).await).unwrap();
    let settings = &props["default_generation_settings"];
    assert_eq!(settings["n_ctx"], 512);
    assert_eq!(
        settings["params"]["temperature"].as_f64(),
        Some(0.8f32 as f64)
    );
    assert_eq!(settings["params"]["top_k"], 40);
    assert_eq!(settings["params"]["repeat_last_n"], 64);
    assert_eq!(props["model_path"], "mock/small");
    assert_eq!(
        props["modalities"],
        json!({"vision": false, "audio": false})
    );
    assert_eq!(props["infill"], true);
    assert!(props["build_info"]
        .as_str()
        .unwrap()
        .starts_with("tokenrouter "));
}

#[tokio::test]
async fn mirostat_and_bad_values_are_refused_by_name() {
    let m = mock();
    for (body, param) in [
        (json!({"prompt": "a", "mirostat": 2}), "mirostat"),
        (
            json!({"prompt": "a", "dry_multiplier": -0.8}),
            "dry_multiplier",
        ),
        (
            json!({"prompt": "a", "xtc_probability": 2}),
            "xtc_probability",
        ),
        (json!({"prompt": "a", "samplers": 5}), "samplers"),
        (
            json!({"prompt": "a", "dry_multiplier": 1, "dry_penalty_last_n": -2}),
            "dry_penalty_last_n",
        ),
        (
            json!({"prompt": "a", "dry_multiplier": 1, "dry_sequence_breakers": [""]}),
            "dry_sequence_breakers",
        ),
        (
            json!({"prompt": "a", "post_sampling_probs": true}),
            "post_sampling_probs",
        ),
        (
            json!({"prompt": "a", "grammar": "root ::= \"a\"", "json_schema": {}}),
            "grammar",
        ),
        (json!({"prompt": "a", "n_probs": 1000}), "n_probs"),
        (json!({"prompt": "a", "n_predict": 0}), "n_predict"),
        (json!({"prompt": {"a": 1}}), "prompt"),
        (json!({"n_predict": 3}), "prompt"),
        (json!({"prompt": "a", "json_schema": "x"}), "json_schema"),
        (json!({"prompt": "a", "repeat_last_n": -2}), "repeat_last_n"),
        (
            json!({"prompt": "a", "repeat_penalty": 0}),
            "repeat_penalty",
        ),
        (json!({"prompt": "a", "top_p": 0}), "top_p"),
    ] {
        let (status, out) = post_json(app(&m), "/completion", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {out}");
        assert_eq!(error_of(&out)["param"], param, "{body}");
    }
    // Defaults sent explicitly, and bookkeeping keys, are fine.
    let body = json!({"prompt": "a", "n_predict": 1, "mirostat": 0, "typical_p": 1.0,
        "cache_prompt": true, "id_slot": -1, "samplers": ["top_k"], "t_max_predict_ms": 500});
    let (status, out) = post_json(app(&m), "/completion", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert!(m.log().submitted.len() == 1);
}

#[tokio::test]
async fn infill_builds_the_repository_level_fim_prompt() {
    // Room for the other files: beyond one 2,048-token batch and twice the output.
    let mut cfg = MockConfig::default();
    for model in &mut cfg.models {
        model.context_length = 4096;
    }
    let m = MockBackend::new(cfg);
    let body = json!({
        "input_prefix": "def f(x):\n    ",
        "input_suffix": "\n    return y\n",
        "input_extra": [{"filename": "a.py", "text": "K = 3\n"}],
        "prompt": "y",
        "n_predict": 8,
    });
    let (status, out) = post_json(app(&m), "/infill", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["content"], SCRIPT[..8]);
    let sent = m.log().submitted[0].clone();
    let mut want = vec![FIM_REPO];
    want.extend(bytes("myproject\n"));
    want.push(FIM_FILE_SEP);
    want.extend(bytes("a.py\nK = 3\n"));
    want.push(FIM_FILE_SEP);
    want.extend(bytes("filename\n"));
    want.push(FIM_PREFIX);
    want.extend(bytes("def f(x):\n    "));
    want.push(FIM_SUFFIX);
    want.extend(bytes("\n    return y\n"));
    want.push(FIM_MIDDLE);
    want.extend(bytes("y"));
    assert_eq!(sent.prompt_ids, want);
    // Padding, a repository name or a new file end the middle.
    assert_eq!(sent.stop_token_ids, [262, FIM_REPO, FIM_FILE_SEP]);
}

#[tokio::test]
async fn infill_checks_its_fields_and_the_model() {
    let m = mock();
    for (body, param) in [
        (json!({"input_suffix": ""}), "input_prefix"),
        (json!({"input_prefix": ""}), "input_suffix"),
        (
            json!({"input_prefix": 1, "input_suffix": ""}),
            "input_prefix",
        ),
        (
            json!({"input_prefix": "", "input_suffix": "", "input_extra": {"a": 1}}),
            "input_extra",
        ),
        (
            json!({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 5}]}),
            "input_extra",
        ),
        (
            json!({"input_prefix": "", "input_suffix": "", "prompt": [1, 2]}),
            "prompt",
        ),
    ] {
        let (status, out) = post_json(app(&m), "/infill", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {out}");
        assert_eq!(error_of(&out)["param"], param, "{body}");
    }
    let plain = MockBackend::new(MockConfig {
        fim: false,
        ..MockConfig::default()
    });
    let body = json!({"input_prefix": "a", "input_suffix": "b"});
    let (status, out) = post_json(app(&plain), "/infill", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_of(&out)["message"]
            .as_str()
            .unwrap()
            .contains("fill-in-the-middle"),
        "{out}"
    );
    assert!(plain.log().submitted.is_empty());
    // While the models load, both endpoints answer 503 (not a 400 about the tokenizer).
    let loading = mock();
    loading.set_ready(false);
    for path in ["/infill", "/completion"] {
        let body = json!({"input_prefix": "a", "input_suffix": "b", "prompt": "c"});
        let (status, _) = post_json(app(&loading), path, body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
}

#[tokio::test]
async fn openai_suffix_makes_a_fim_prompt() {
    let m = mock();
    let body =
        json!({"prompt": "def add(a, b):\n", "suffix": "\nprint(add(1, 2))", "max_tokens": 4});
    let (status, out) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["choices"][0]["text"], SCRIPT[..4]);
    let sent = m.log().submitted[0].clone();
    let mut want = vec![FIM_PREFIX];
    want.extend(bytes("def add(a, b):\n"));
    want.push(FIM_SUFFIX);
    want.extend(bytes("\nprint(add(1, 2))"));
    want.push(FIM_MIDDLE);
    assert_eq!(sent.prompt_ids, want);
    assert_eq!(sent.stop_token_ids, [262, FIM_REPO, FIM_FILE_SEP]);

    let body = json!({"prompt": "a", "suffix": "b", "echo": true});
    let (status, out) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&out)["param"], "echo");
    let plain = MockBackend::new(MockConfig {
        fim: false,
        ..MockConfig::default()
    });
    let body = json!({"prompt": "a", "suffix": "b"});
    let (status, out) = post_json(app(&plain), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&out)["param"], "suffix");
    // An empty suffix is no suffix.
    let body = json!({"prompt": "a", "suffix": "", "max_tokens": 1});
    let (status, _) = post_json(app(&plain), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn n_indent_and_t_max_predict_ms_end_an_infill_at_a_line() {
    let m = MockBackend::new(MockConfig {
        script: "a = 1\n    b = 2\nc = 3\n".into(),
        token_delay: std::time::Duration::from_millis(2),
        ..MockConfig::default()
    });
    let body = json!({"input_prefix": "def f():\n    ", "input_suffix": "", "n_indent": 4});
    let (status, out) = post_json(app(&m), "/infill", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    assert_eq!(out["content"], "a = 1\n    b = 2\n");
    assert_eq!(out["stop_type"], "limit");
    // The rest is not written: the engine request is dropped.
    let dropped = m
        .wait_for(std::time::Duration::from_secs(5), |log| {
            log.aborted.len() == 1
        })
        .await;
    assert!(dropped);

    let body = json!({"input_prefix": "", "input_suffix": "", "t_max_predict_ms": 1});
    let (_, out) = post_json(app(&m), "/infill", body).await;
    assert_eq!(out["content"], "a = 1\n");
    assert_eq!(out["stop_type"], "limit");
    // Neither limit reaches the OpenAI endpoints' answers.
    let body = json!({"prompt": "x", "n_indent": 4});
    let (_, out) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(out["choices"][0]["text"], "a = 1\n    b = 2\nc = 3\n");
}

/// llama.cpp's samplers reach the engine as its chain: on `/completion` always (its order,
/// its defaults shown in `generation_settings`), on the OpenAI endpoints when a request
/// sends one of their keys; `samplers` sets the order and switches off what it leaves out.
#[tokio::test]
async fn llama_cpp_samplers_reach_the_engine_as_its_chain() {
    use tokenrouter_api::{LlamaChain, LlamaStage};
    let m = mock();
    let (status, out) = post_json(app(&m), "/completion", json!({"prompt": "a"})).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let sent = m.log().submitted[0].clone();
    assert_eq!(sent.sampling.llama, Some(LlamaChain::default()));
    let settings = &out["generation_settings"];
    assert_eq!(settings["dry_multiplier"], 0.0);
    assert_eq!(
        settings["dry_sequence_breakers"],
        json!(["\n", ":", "\"", "*"])
    );
    assert_eq!(
        settings["samplers"],
        json!([
            "penalties",
            "dry",
            "top_n_sigma",
            "top_k",
            "typ_p",
            "top_p",
            "min_p",
            "xtc",
            "temperature"
        ])
    );

    let body = json!({"prompt": "a", "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"],
        "xtc_probability": 0.5, "xtc_threshold": 0.2, "typical_p": 0.9, "top_n_sigma": 1.5,
        "dynatemp_range": 0.3, "samplers": ["dry", "top_k", "xtc", "temperature"]});
    let (status, out) = post_json(app(&m), "/completion", body).await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let sent = m.log().submitted.last().cloned().unwrap();
    let chain = sent.sampling.llama.clone().unwrap();
    assert_eq!(
        chain.order,
        [
            LlamaStage::Dry,
            LlamaStage::TopK,
            LlamaStage::Xtc,
            LlamaStage::Temperature
        ]
    );
    assert_eq!((chain.xtc_probability, chain.xtc_threshold), (0.5, 0.2));
    assert_eq!(
        (chain.typical_p, chain.top_n_sigma, chain.dynatemp_range),
        (0.9, 1.5, 0.3)
    );
    let dry = chain.dry.unwrap();
    assert_eq!(
        (dry.multiplier, dry.sequence_breakers.as_slice()),
        (0.8, &["\n".to_string()][..])
    );
    // Top-p, min-p and the penalties were left out of `samplers`: off.
    assert_eq!(
        (
            sent.sampling.top_p,
            sent.sampling.min_p,
            sent.sampling.top_k
        ),
        (1.0, 0.0, 40)
    );
    assert_eq!(
        out["generation_settings"]["samplers"],
        json!(["penalties", "dry", "top_k", "xtc", "temperature"])
    );

    // OpenAI endpoints: vLLM's order unless a llama.cpp key is sent.
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let (status, _) = post_json(app(&m), "/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(m.log().submitted.last().unwrap().sampling.llama, None);
    let (status, out) = post_json(
        app(&m),
        "/v1/chat/completions",
        chat(json!({"dry_multiplier": 0.8})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{out}");
    let sent = m.log().submitted.last().cloned().unwrap();
    assert_eq!(sent.sampling.llama.unwrap().dry.unwrap().multiplier, 0.8);
    // llama.cpp's ignore_eos bans the end ids; vLLM's (the OpenAI endpoints) does not.
    let (status, _) = post_json(
        app(&m),
        "/completion",
        json!({"prompt": "a", "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(m.log().submitted.last().unwrap().sampling.ban_eos);
    let (status, _) = post_json(
        app(&m),
        "/v1/completions",
        json!({"prompt": "a", "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(!m.log().submitted.last().unwrap().sampling.ban_eos);
    let (status, out) = post_json(
        app(&m),
        "/v1/completions",
        json!({"prompt": "a", "mirostat": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{out}");
    assert_eq!(error_of(&out)["param"], "mirostat");
}
