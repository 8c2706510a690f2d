//! Every endpoint's happy path, and how request fields reach the engine request.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenrouter_api::Backend;

use crate::common::{app, chat_body, get, mock, post, post_json, send, text};
use crate::mock::{logprob_of, source_of, MockBackend, MockConfig};

const SCRIPT: &str = "Hello, world! The answer is 42. é日本🙂 END of story.";

#[tokio::test]
async fn models_lists_the_routed_model_first_then_each_configured_model() {
    let m = mock();
    let resp = send(app(&m), get("/v1/models")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(body["object"], "list");
    let ids: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["tokenrouter", "quick", "reference", "default"]);
    assert_eq!(body["data"][3]["routed"], true);
    assert_eq!(body["data"][0]["routed"], true);
    assert_eq!(body["data"][1]["routed"], false);
    assert_eq!(body["data"][2]["root"], "mock/large");
    assert_eq!(body["data"][1]["max_model_len"], 512);

    let resp = send(app(&m), get("/v1/models/reference")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let card: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(card["id"], "reference");
}

#[tokio::test]
async fn health_is_503_until_ready_then_200() {
    let m = MockBackend::new(MockConfig {
        ready: false,
        ..MockConfig::default()
    });
    let router = app(&m);
    let resp = send(router.clone(), get("/health")).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(text(resp).await.contains("loading"));
    m.set_ready(true);
    let resp = send(router, get("/health")).await;
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn metrics_joins_engine_and_server_metrics() {
    let m = mock();
    let router = app(&m);
    let (status, _) = post_json(router.clone(), "/v1/chat/completions", chat_body("hi")).await;
    assert_eq!(status, StatusCode::OK);
    let resp = send(router, get("/metrics")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let body = text(resp).await;
    assert!(body.contains("mock_engine_aborted_total 0"), "{body}");
    let completion_tokens = SCRIPT.len() + 1;
    for needle in [
        "tokenrouter:http_requests_total{path=\"/v1/chat/completions\",status=\"200\"} 1"
            .to_string(),
        format!("tokenrouter:generation_tokens_total{{model=\"tokenrouter\"}} {completion_tokens}"),
        "tokenrouter:prompt_tokens_total{model=\"tokenrouter\"}".to_string(),
        "tokenrouter:time_to_first_token_seconds_count{model=\"tokenrouter\"} 1".to_string(),
        "tokenrouter:time_per_output_token_seconds_count{model=\"tokenrouter\"} 1".to_string(),
        "tokenrouter:e2e_request_latency_seconds_count{model=\"tokenrouter\"} 1".to_string(),
        "tokenrouter:num_requests_running{model=\"tokenrouter\"} 0".to_string(),
        "tokenrouter:request_success_total{finished_reason=\"stop\",model=\"tokenrouter\"} 1"
            .to_string(),
    ] {
        assert!(body.contains(&needle), "missing {needle} in\n{body}");
    }
}

#[tokio::test]
async fn version_reports_the_crate_version() {
    let resp = send(app(&mock()), get("/version")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(body["version"], env!("CARGO_PKG_VERSION"));
}

#[tokio::test]
async fn tokenize_prompt_and_messages_and_detokenize() {
    let m = mock();
    let (status, body) = post_json(app(&m), "/tokenize", json!({"prompt": "hé"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["tokens"], json!([104, 0xC3, 0xA9]));
    assert_eq!(body["count"], 3);
    assert_eq!(body["max_model_len"], 512);

    let (status, body) = post_json(
        app(&m),
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "x"}],
               "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let expected = m
        .encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        .unwrap();
    assert_eq!(body["tokens"], json!(expected));

    let (status, body) =
        post_json(app(&m), "/detokenize", json!({"tokens": [257, 104, 105]})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["prompt"], "<|im_start|>hi");
    // llama.cpp's spelling: `content` in, `with_pieces`, `content` out.
    let (status, body) = post_json(
        app(&m),
        "/tokenize",
        json!({"content": "<|im_start|>hi", "with_pieces": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["tokens"],
        json!([{"id": 257, "piece": "<|im_start|>"}, {"id": 104, "piece": "h"},
            {"id": 105, "piece": "i"}])
    );
    assert_eq!(body["count"], 3);
    let (_, body) = post_json(app(&m), "/detokenize", json!({"tokens": [104, 105]})).await;
    assert_eq!(body["content"], "hi");
}

/// llama.cpp's `/apply-template`: the prompt a chat request with these messages (and tools)
/// would get, as text; without messages a 400 naming them.
#[tokio::test]
async fn apply_template_renders_the_chat_prompt() {
    let m = mock();
    let messages = json!([{"role": "user", "content": "x"}]);
    let (status, body) = post_json(app(&m), "/apply-template", json!({"messages": messages})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"prompt": "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"})
    );
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let (status, body) = post_json(
        app(&m),
        "/apply-template",
        json!({"messages": messages, "tools": tools, "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let prompt = body["prompt"].as_str().unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\n<tools>") && !prompt.ends_with("assistant\n"),
        "{prompt}"
    );
    let (status, body) = post_json(app(&m), "/apply-template", json!({"prompt": "x"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "messages", "{body}");
}

#[tokio::test]
async fn chat_completion_has_openai_shape_usage_and_provenance() {
    let m = mock();
    let (status, body) = post_json(app(&m), "/v1/chat/completions", chat_body("hi")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "tokenrouter");
    assert!(body["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], SCRIPT);
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["logprobs"], Value::Null);
    assert!(choice.get("token_sources").is_none());

    let prompt = m
        .encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let completion = SCRIPT.len() + 1; // every byte plus EOS
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": completion, "total_tokens": prompt.len() + completion,
            "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let quick = (0..completion)
        .filter(|&i| source_of(i, None, 2) == 0)
        .count();
    assert_eq!(
        body["tokenrouter"]["tokens_by_model"],
        json!({"quick": quick, "reference": completion - quick})
    );
    let switches = (1..completion)
        .filter(|&i| source_of(i, None, 2) != source_of(i - 1, None, 2))
        .count();
    assert_eq!(body["tokenrouter"]["switches"], switches);
}

#[tokio::test]
async fn chat_fields_reach_the_engine_and_the_template() {
    let m = mock();
    let body = json!({
        "model": "tokenrouter",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {"65": 5.0}, "seed": 3, "stop_token_ids": [33], "ignore_eos": true,
        "max_tokens": 50, "max_completion_tokens": 30,
        "chat_template_kwargs": {"enable_thinking": false},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "response_format": {"type": "text"},
        "user": "someone", "some_unknown_field": {"x": 1}
    });
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let log = m.log();
    let req = &log.submitted[0];
    assert_eq!(req.sampling.temperature, 0.5);
    assert_eq!(req.sampling.top_p, 0.9);
    assert_eq!(req.sampling.top_k, 20);
    assert_eq!(req.sampling.min_p, 0.05);
    assert!((req.sampling.repetition_penalty - 1.1).abs() < 1e-6);
    // vLLM's rule unless llama.cpp's window is asked for.
    assert_eq!(req.sampling.penalty_last_n, None);
    assert_eq!(req.sampling.presence_penalty, 0.5);
    assert_eq!(req.sampling.frequency_penalty, -0.5);
    assert_eq!(req.sampling.logit_bias, vec![(65, 5.0)]);
    assert_eq!(req.sampling.seed, Some(3));
    assert_eq!(req.stop_token_ids, vec![33]);
    assert!(req.ignore_eos);
    assert_eq!(
        req.max_tokens,
        Some(30),
        "max_completion_tokens wins over max_tokens"
    );
    assert_eq!(req.pinned_model, None);
    assert_eq!(req.top_logprobs, 0);
    let (messages, add_generation_prompt, kwargs) = log.last_template.clone().unwrap();
    assert_eq!(messages[1].content, "ab");
    assert!(add_generation_prompt);
    assert_eq!(kwargs["enable_thinking"], false);
    assert_eq!(kwargs["tools"][0]["function"]["name"], "f");
    // The rendered prompt included the no-thinking block.
    assert!(req
        .prompt_ids
        .ends_with(&m.encode("assistant\n<think>\n\n</think>\n\n").unwrap()));
    // "seed 3: Hello, world!" — the stop token id 33 ('!') ends the output, finish "stop",
    // and its text is left out (as vLLM leaves it out).
    assert_eq!(
        resp["choices"][0]["message"]["content"],
        "seed 3: Hello, world"
    );
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
}

/// llama.cpp's clients send its keys to its OpenAI endpoints too: `repeat_penalty` and the
/// penalty window `repeat_last_n`.
#[tokio::test]
async fn llama_cpp_penalty_keys_work_on_the_openai_endpoints() {
    let m = mock();
    for (path, extra) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}]}),
        ),
        ("/v1/completions", json!({"prompt": "a"})),
    ] {
        let mut body = json!({"max_tokens": 2, "repeat_penalty": 1.3, "repeat_last_n": 32});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, resp) = post_json(app(&m), path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {resp}");
        let req = m.log().submitted.last().cloned().unwrap();
        assert!(
            (req.sampling.repetition_penalty - 1.3).abs() < 1e-6,
            "{path}"
        );
        assert_eq!(req.sampling.penalty_last_n, Some(32), "{path}");
    }
    // vLLM's own key wins; -1 is the whole context; below -1 is refused by name.
    let body = json!({"prompt": "a", "max_tokens": 2, "repetition_penalty": 1.1,
        "repeat_penalty": 1.3, "repeat_last_n": -1});
    let (status, _) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    let req = m.log().submitted.last().cloned().unwrap();
    assert!((req.sampling.repetition_penalty - 1.1).abs() < 1e-6);
    assert_eq!(req.sampling.penalty_last_n, Some(usize::MAX));
    for (body, param) in [
        (json!({"prompt": "a", "repeat_last_n": -2}), "repeat_last_n"),
        (
            json!({"prompt": "a", "repeat_penalty": 0}),
            "repeat_penalty",
        ),
        (
            json!({"prompt": "a", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
    ] {
        let (status, out) = post_json(app(&m), "/v1/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {out}");
        assert_eq!(out["error"]["param"], param, "{body}");
    }
}

#[tokio::test]
async fn a_configured_model_name_pins_the_request() {
    let m = mock();
    let mut body = chat_body("hi");
    body["model"] = json!("reference");
    body["max_tokens"] = json!(6);
    body["return_token_sources"] = json!(true);
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[0].pinned_model, Some(1));
    assert_eq!(resp["model"], "reference");
    assert_eq!(
        resp["choices"][0]["token_sources"],
        json!(vec!["reference"; 6])
    );
    assert_eq!(
        resp["tokenrouter"],
        json!({"tokens_by_model": {"quick": 0, "reference": 6}, "switches": 0})
    );
    assert_eq!(
        resp["choices"][0]["token_details"][0]["router_score"],
        Value::Null
    );
}

#[tokio::test]
async fn max_tokens_gives_finish_reason_length() {
    let m = mock();
    let (status, resp) = post_json(
        app(&m),
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(resp["choices"][0]["text"], "Hello");
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert_eq!(resp["usage"]["completion_tokens"], 5);
    assert_eq!(resp["usage"]["prompt_tokens"], 1);
}

#[tokio::test]
async fn stop_string_spanning_tokens_of_two_models_truncates_and_aborts() {
    let m = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(2),
        ..MockConfig::default()
    });
    let body = json!({"prompt": "x", "stop": ["nope", "END"], "return_token_sources": true});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let visible = &SCRIPT[..SCRIPT.find("END").unwrap()];
    assert_eq!(resp["choices"][0]["text"], visible);
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    // Tokens up to and including the "D" of "END" count, as in vLLM.
    let generated = SCRIPT.find("END").unwrap() + 3;
    assert_eq!(resp["usage"]["completion_tokens"], generated);
    let sources = resp["choices"][0]["token_sources"].as_array().unwrap();
    assert_eq!(sources.len(), generated);
    let end_sources: Vec<&Value> = sources[generated - 3..].iter().collect();
    assert!(
        end_sources.iter().any(|s| *s == "quick") && end_sources.iter().any(|s| *s == "reference"),
        "the stop string must span both models: {end_sources:?}"
    );
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.aborted.len() == 1)
            .await,
        "the engine request was not aborted after the stop string"
    );
}

#[tokio::test]
async fn n_two_gives_two_choices_with_derived_seeds() {
    let m = mock();
    let mut body = chat_body("hi");
    body["n"] = json!(2);
    body["seed"] = json!(7);
    body["max_tokens"] = json!(7);
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let choices = resp["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[0]["message"]["content"], "seed 7:");
    assert_eq!(choices[1]["message"]["content"], "seed 8:");
    assert_eq!(resp["usage"]["completion_tokens"], 14);
    let seeds: Vec<Option<u64>> = m.log().submitted.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![Some(7), Some(8)]);
    // Provenance sums over choices: 3 switches in each 7-token choice (sources 0011001).
    assert_eq!(resp["tokenrouter"]["switches"], 6);
}

#[tokio::test]
async fn chat_logprobs_have_openai_shape_with_source() {
    let m = mock();
    let mut body = chat_body("hi");
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    body["max_tokens"] = json!(4);
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[0].top_logprobs, 2);
    let content = resp["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 4);
    let first = &content[0];
    assert_eq!(first["token"], "H");
    assert_eq!(first["bytes"], json!([72]));
    assert!((first["logprob"].as_f64().unwrap() - f64::from(logprob_of(0))).abs() < 1e-6);
    assert_eq!(first["source"], "quick");
    assert_eq!(content[2]["source"], "reference");
    let top = first["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[1]["token"], "I");
    assert!(top[1]["bytes"].is_array());
}

#[tokio::test]
async fn completion_logprobs_have_legacy_shape_with_sources() {
    let m = mock();
    let body = json!({"prompt": "x", "logprobs": 1, "max_tokens": 3});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert!(resp["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(resp["object"], "text_completion");
    let lp = &resp["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e", "l"]));
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 1);
    assert!((top["H"].as_f64().unwrap() - f64::from(logprob_of(0))).abs() < 1e-6);
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert_eq!(lp["sources"], json!(["quick", "quick", "reference"]));
}

#[tokio::test]
async fn completions_accept_token_ids_and_batched_prompts() {
    let m = mock();
    let body = json!({"prompt": [104, 105], "max_tokens": 2});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(m.log().submitted[0].prompt_ids, vec![104, 105]);
    assert_eq!(resp["usage"]["prompt_tokens"], 2);

    let body = json!({"prompt": ["ab", "cde"], "max_tokens": 2, "n": 2});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["choices"].as_array().unwrap().len(), 4);
    assert_eq!(resp["usage"]["prompt_tokens"], 2 * 2 + 3 * 2);
    let prompts: Vec<usize> = m.log().submitted[1..]
        .iter()
        .map(|r| r.prompt_ids.len())
        .collect();
    assert_eq!(prompts, vec![2, 2, 3, 3]);
}

#[tokio::test]
async fn token_sources_and_details_follow_each_token() {
    let m = mock();
    let body = json!({"prompt": "x", "max_tokens": 5, "return_token_sources": true});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let choice = &resp["choices"][0];
    assert_eq!(
        choice["token_sources"],
        json!(["quick", "quick", "reference", "reference", "quick"])
    );
    let details = choice["token_details"].as_array().unwrap();
    assert_eq!(details.len(), 5);
    assert_eq!(details[2]["source"], "reference");
    assert_eq!(details[2]["router_score"], 0.5);
    assert!((details[2]["logprob"].as_f64().unwrap() - f64::from(logprob_of(2))).abs() < 1e-6);
}

#[tokio::test]
async fn generation_without_messages_content_and_unknown_route() {
    let m = mock();
    // Assistant message with null content is accepted.
    let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}], "max_tokens": 1});
    let (status, _) = post_json(app(&m), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK);
    let resp = send(app(&m), post("/v1/nothing", "{}")).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(body["error"]["code"], "not_found");
}
