//! A fuzzer for the HTTP layer: seeded random requests — methods, paths, headers, and JSON
//! bodies built from valid requests with fields mutated into wrong types, extreme numbers,
//! odd unicode, deep nesting and raw bytes — against the router over the mock backend.
//! Every answer must be below 500, and every 4xx must be an OpenAI-shaped error object.
//! `FUZZ_CASES` sets the number of cases (default 50,000; CI runs the default), `FUZZ_SEED`
//! the seed (default 0x5eed) for runs that explore other sequences.

use std::time::Instant;

use axum::body::Body;
use axum::http::{header, Method, Request};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use tower::ServiceExt;

use crate::common::{mock, text};

const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/quick",
    "/v1/models/%00",
    "/health",
    "/metrics",
    "/version",
    "/tokenize",
    "/detokenize",
    "/generate",
    "/v1/responses",
    "/v1/responses/resp_x",
    "/v1/responses/resp_x/cancel",
    "/v1/responses/resp_x/input_items?order=up&limit=0",
    "/v1/responses/resp_x?stream=true&starting_after=-1",
    "/health_generate",
    "/get_model_info",
    "/get_server_info",
    "/get_load",
    "/flush_cache",
    "/reset_prefix_cache",
    "/abort_request",
    "/completion",
    "/completions",
    "/infill",
    "/props",
    "/apply-template",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/",
    "/v2/x",
    "/",
    "/v1/../v1/models",
];

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

fn weird_string(rng: &mut StdRng) -> String {
    match rng.random_range(0..8) {
        0 => String::new(),
        1 => "\u{0}\u{fffd}\u{202e}é漢字🙂".into(),
        2 => "x".repeat(rng.random_range(1..5000)),
        3 => "<|im_start|>system\n<|im_end|>".into(),
        4 => "\\boxed{".into(),
        5 => (0..rng.random_range(1..40))
            .map(|_| char::from_u32(rng.random_range(0..0x2FFFF)).unwrap_or('?'))
            .collect(),
        6 => "user".into(),
        _ => "hello".into(),
    }
}

fn weird_value(rng: &mut StdRng, depth: usize) -> Value {
    match rng.random_range(0..14) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(rng.random_range(-5i64..5)),
        3 => json!(i64::MAX),
        4 => json!(u64::MAX),
        5 => json!(-1e308),
        6 => json!(3.5e38),
        7 => json!(1e-320),
        8 => json!(rng.random::<f64>()),
        9 => Value::String(weird_string(rng)),
        10 if depth < 6 => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| weird_value(rng, depth + 1))
                .collect(),
        ),
        11 if depth < 6 => {
            let mut m = Map::new();
            for _ in 0..rng.random_range(0..4) {
                m.insert(weird_string(rng), weird_value(rng, depth + 1));
            }
            Value::Object(m)
        }
        12 => json!([1, 2, 999999, 4294967295u64]),
        _ => json!({"threshold": rng.random::<f64>() * 2.0 - 0.5}),
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "routing",
    "return_token_sources",
    "chat_template_kwargs",
    "tools",
    "echo",
    "prompt_logprobs",
    "include_reasoning",
    "min_tokens",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "truncate_prompt_tokens",
    "return_tokens_as_token_ids",
    "continue_final_message",
    "text",
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "background",
    "store",
    "rid",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "suffix",
    "response_format",
    "tool_choice",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "tokens",
    "add_generation_prompt",
    "n_predict",
    "n_probs",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "n_indent",
    "t_max_predict_ms",
    "response_fields",
    "return_tokens",
    "json_schema",
    "grammar",
    "ebnf",
    "regex",
    "mirostat",
    "system",
    "stop_sequences",
    "thinking",
];

fn body(rng: &mut StdRng) -> Vec<u8> {
    if rng.random_range(0..20) == 0 {
        // Raw bytes, possibly not UTF-8, possibly truncated JSON.
        let n = rng.random_range(0..200);
        return (0..n).map(|_| rng.random::<u8>()).collect();
    }
    let mut v = match rng.random_range(0..5) {
        0 | 1 => json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        2 | 3 => json!({"prompt": "hi", "max_tokens": 4}),
        _ => json!({"input_prefix": "def f():\n", "input_suffix": "\n", "n_predict": 4}),
    };
    for _ in 0..rng.random_range(0..5) {
        let field = *pick(rng, FIELDS);
        v[field] = weird_value(rng, 0);
    }
    if rng.random_range(0..10) == 0 {
        v["messages"] = json!([{"role": weird_string(rng), "content": weird_value(rng, 0)}]);
    }
    if rng.random_range(0..8) == 0 {
        // Tool use: well-formed tools with odd names and schemas, odd choices and calls.
        let name = weird_string(rng);
        v["tools"] = json!([{"type": "function", "function": {"name": name.clone(),
            "parameters": weird_value(rng, 0)}}]);
        let choices = [
            json!("auto"),
            json!("none"),
            json!("required"),
            json!({"type": "function", "function": {"name": name}}),
            weird_value(rng, 0),
        ];
        v["tool_choice"] = pick(rng, &choices).clone();
        if rng.random_bool(0.5) {
            v["messages"] = json!([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": weird_value(rng, 0),
                    "type": "function", "function": {"name": weird_string(rng),
                    "arguments": weird_value(rng, 0)}}]},
                {"role": "tool", "tool_call_id": weird_value(rng, 0), "content": weird_value(rng, 0)}
            ]);
        }
    }
    let s = v.to_string();
    if rng.random_range(0..15) == 0 {
        let cut = rng.random_range(0..s.len().max(1));
        return s.as_bytes()[..cut].to_vec();
    }
    s.into_bytes()
}

fn request(rng: &mut StdRng) -> Request<Body> {
    let method = pick(
        rng,
        &[
            Method::POST,
            Method::POST,
            Method::POST,
            Method::GET,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
            Method::OPTIONS,
            Method::HEAD,
        ],
    )
    .clone();
    let path = *pick(rng, PATHS);
    let mut b = Request::builder().method(method).uri(path);
    match rng.random_range(0..6) {
        0 => {}
        1 => b = b.header(header::CONTENT_TYPE, "text/plain"),
        2 => b = b.header(header::CONTENT_TYPE, "application/json; charset=utf-8"),
        3 => b = b.header(header::AUTHORIZATION, "Bearer x"),
        4 => b = b.header("x-weird", "\u{7f}".to_string().as_str()),
        _ => b = b.header(header::CONTENT_TYPE, "application/json"),
    }
    b.body(Body::from(body(rng)))
        .unwrap_or_else(|_| Request::new(Body::empty()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_requests_never_panic_never_5xx_and_4xx_are_openai_shaped() {
    let cases: usize = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let backend = mock();
    let app =
        tokenrouter_server::router(backend.clone(), tokenrouter_server::ServerConfig::default());
    let seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = StdRng::seed_from_u64(seed);
    let t0 = Instant::now();
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..cases {
        let req = request(&mut rng);
        let head = req.method() == Method::HEAD;
        let shown = format!("{} {}", req.method(), req.uri());
        let resp = app
            .clone()
            .oneshot(req)
            .await
            .unwrap_or_else(|e| panic!("case {case} ({shown}): service error {e}"));
        let status = resp.status();
        *by_status.entry(status.as_u16()).or_default() += 1;
        // The mock is always ready, so no answer may be a 5xx (not even 503).
        assert!(!status.is_server_error(), "case {case} ({shown}): {status}");
        if head {
            // HEAD answers carry no body by definition.
            let _ = text(resp).await;
        } else if status.is_client_error() {
            let body = text(resp).await;
            let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| {
                panic!("case {case} ({shown}): {status} not JSON ({e}): {body}")
            });
            let err = &v["error"];
            let openai =
                err["message"].is_string() && err["type"].is_string() && err["code"].is_string();
            // Anthropic's endpoints answer in Anthropic's shape (their route layers, which
            // run first, in OpenAI's).
            let anthropic = shown.contains(" /v1/messages")
                && v["type"] == "error"
                && err["message"].is_string()
                && err["type"].is_string();
            assert!(
                openai || anthropic,
                "case {case} ({shown}): {status} not OpenAI-shaped: {body}"
            );
        } else {
            // Drain successful bodies (streams included) so every generation runs to its end.
            let _ = text(resp).await;
        }
    }
    println!(
        "fuzz: {cases} cases (seed {seed}) in {:.1} s, statuses {by_status:?}",
        t0.elapsed().as_secs_f64()
    );
}
