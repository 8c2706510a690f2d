//! Every error the API answers: status, OpenAI error shape, and the `param` it names.

use std::time::Duration;

use axum::http::{header, Request, StatusCode};
use serde_json::{json, Value};
use tokenrouter_server::{router, CorsPolicy, ServerConfig};

use crate::common::{app, chat_body, error_of, get, mock, post, post_json, send, text};
use crate::mock::{MockBackend, MockConfig};

async fn expect_400(path: &str, body: Value, param: Option<&str>) {
    let (status, resp) = post_json(app(&mock()), path, body.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {resp}");
    let err = error_of(&resp);
    assert_eq!(err["type"], "invalid_request_error");
    assert_eq!(
        err["param"],
        param.map_or(Value::Null, Value::from),
        "{body} -> {resp}"
    );
}

#[tokio::test]
async fn malformed_json_is_400_without_param() {
    for raw in ["{\"messages\": [", "not json", "[1, 2]", ""] {
        let resp = send(app(&mock()), post("/v1/chat/completions", raw)).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{raw}");
        let body: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(error_of(&body)["param"], Value::Null);
        assert_eq!(body["error"]["code"], "invalid_json");
    }
}

#[tokio::test]
async fn wrong_types_are_400_naming_the_field() {
    let chat = |extra: Value| {
        let mut body = chat_body("hi");
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (body, param) in [
        (chat(json!({"temperature": "hot"})), "temperature"),
        (chat(json!({"max_tokens": -1})), "max_tokens"),
        (chat(json!({"n": 1.5})), "n"),
        (chat(json!({"stream": "yes"})), "stream"),
        (chat(json!({"stop": 3})), "stop"),
        (
            chat(json!({"stream_options": {"include_usage": "x"}})),
            "stream_options.include_usage",
        ),
        (chat(json!({"logprobs": 2})), "logprobs"),
        (
            chat(json!({"chat_template_kwargs": []})),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": [{"role": 1, "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"messages": "hi"}), "messages"),
    ] {
        expect_400("/v1/chat/completions", body, Some(param)).await;
    }
    expect_400(
        "/v1/completions",
        json!({"prompt": {"a": 1}}),
        Some("prompt"),
    )
    .await;
    expect_400("/tokenize", json!({"prompt": 5}), Some("prompt")).await;
    expect_400("/detokenize", json!({"tokens": ["a"]}), Some("tokens[0]")).await;
}

#[tokio::test]
async fn missing_messages_or_prompt_is_400() {
    let (status, resp) = post_json(
        app(&mock()),
        "/v1/chat/completions",
        json!({"model": "quick"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&resp)["param"], "messages");
    assert_eq!(resp["error"]["code"], "missing_required_parameter");
    expect_400("/v1/completions", json!({"max_tokens": 3}), Some("prompt")).await;
    expect_400(
        "/v1/chat/completions",
        json!({"messages": []}),
        Some("messages"),
    )
    .await;
    expect_400("/v1/completions", json!({"prompt": ""}), Some("prompt")).await;
    expect_400("/v1/completions", json!({"prompt": []}), Some("prompt")).await;
    expect_400("/tokenize", json!({}), Some("prompt")).await;
}

#[tokio::test]
async fn out_of_range_values_are_400_with_param() {
    for (extra, param) in [
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"top_p": 1.01}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "grammar"}}),
            "response_format",
        ),
        (json!({"response_format": "json"}), "response_format"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
    ] {
        let mut body = chat_body("hi");
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        expect_400("/v1/chat/completions", body, Some(param)).await;
    }
    expect_400(
        "/v1/completions",
        json!({"prompt": "x", "logprobs": 50}),
        Some("logprobs"),
    )
    .await;
    expect_400(
        "/v1/completions",
        // Scoring the prompt of a routed request (see echo.rs).
        json!({"prompt": "x", "echo": true, "logprobs": 1}),
        Some("echo"),
    )
    .await;
    expect_400(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        Some("messages[0].content[0]"),
    )
    .await;
}

#[tokio::test]
async fn context_overflow_is_400_with_the_numbers() {
    let (status, resp) = post_json(
        app(&mock()),
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 510}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let err = error_of(&resp);
    assert_eq!(err["code"], "context_length_exceeded");
    let message = err["message"].as_str().unwrap();
    for number in ["512", "3 prompt tokens", "510"] {
        assert!(message.contains(number), "{message}");
    }
    // A prompt that fills the context leaves no room even without max_tokens.
    let long = "a".repeat(512);
    let (status, _) = post_json(app(&mock()), "/v1/completions", json!({"prompt": long})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn template_and_tokenizer_errors_are_400() {
    let body = json!({"messages": [{"role": "wizard", "content": "x"}]});
    let (status, resp) = post_json(app(&mock()), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_of(&resp)["message"]
        .as_str()
        .unwrap()
        .contains("wizard"));
    let (status, _) = post_json(app(&mock()), "/detokenize", json!({"tokens": [100000]})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn api_key_guards_v1_and_generate_only() {
    let m = mock();
    let cfg = ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    };
    let app = router(m.clone(), cfg);
    let with_auth = |value: Option<&str>| {
        let mut req =
            Request::post("/v1/chat/completions").header(header::CONTENT_TYPE, "application/json");
        if let Some(v) = value {
            req = req.header(header::AUTHORIZATION, v);
        }
        req.body(axum::body::Body::from(chat_body("hi").to_string()))
            .unwrap()
    };
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sekrit"),
        Some("Basic sekrit"),
    ] {
        let resp = send(app.clone(), with_auth(auth)).await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{auth:?}");
        let body: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(error_of(&body)["type"], "authentication_error");
    }
    assert_eq!(
        send(app.clone(), with_auth(Some("Bearer sekrit")))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(app.clone(), get("/v1/models")).await.status(),
        StatusCode::UNAUTHORIZED
    );
    // SGLang's /generate generates too: it needs the key.
    let generate = |auth: Option<&str>| {
        let mut req = Request::post("/generate").header(header::CONTENT_TYPE, "application/json");
        if let Some(v) = auth {
            req = req.header(header::AUTHORIZATION, v);
        }
        req.body(axum::body::Body::from(r#"{"text": "hi"}"#))
            .unwrap()
    };
    assert_eq!(
        send(app.clone(), generate(None)).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(app.clone(), generate(Some("Bearer sekrit")))
            .await
            .status(),
        StatusCode::OK
    );
    for guarded in [
        "/health_generate",
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/flush_cache",
    ] {
        assert_eq!(
            send(app.clone(), get(guarded)).await.status(),
            StatusCode::UNAUTHORIZED,
            "{guarded}"
        );
    }
    for guarded in [
        "/reset_prefix_cache",
        "/abort_request",
        "/completion",
        "/completions",
        "/infill",
    ] {
        assert_eq!(
            send(app.clone(), post(guarded, "{}")).await.status(),
            StatusCode::UNAUTHORIZED,
            "{guarded}"
        );
    }
    for open in ["/health", "/metrics", "/version", "/get_load"] {
        assert_eq!(
            send(app.clone(), get(open)).await.status(),
            StatusCode::OK,
            "{open}"
        );
    }
}

#[tokio::test]
async fn unknown_model_is_404_model_not_found() {
    let mut body = chat_body("hi");
    body["model"] = json!("gpt-4");
    let (status, resp) = post_json(app(&mock()), "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&resp)["code"], "model_not_found");
    assert_eq!(resp["error"]["param"], "model");
    let (status, _) = post_json(
        app(&mock()),
        "/v1/completions",
        json!({"prompt": "x", "model": "nope"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        send(app(&mock()), get("/v1/models/nope")).await.status(),
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let cfg = ServerConfig {
        max_body_bytes: 1000,
        ..ServerConfig::default()
    };
    let app = router(mock(), cfg);
    let body = chat_body(&"a".repeat(2000)).to_string();
    let resp = send(app.clone(), post("/v1/chat/completions", body)).await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(error_of(&body)["code"], "request_too_large");
    assert_eq!(
        send(
            app,
            post("/v1/chat/completions", chat_body("a").to_string())
        )
        .await
        .status(),
        StatusCode::OK
    );
}

/// A body declared over the limit is refused from its headers: the server never reads it, so
/// a client that sent `Expect: 100-continue` is not invited to upload before its 413.
#[tokio::test]
async fn a_declared_length_over_the_limit_is_413_without_reading_the_body() {
    let cfg = ServerConfig {
        max_body_bytes: 1000,
        ..ServerConfig::default()
    };
    // A body that never yields: were it read, the request would hang.
    let never = futures_util::stream::pending::<Result<axum::body::Bytes, std::io::Error>>();
    let req = Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "5000")
        .header(header::EXPECT, "100-continue")
        .body(axum::body::Body::from_stream(never))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), send(router(mock(), cfg), req))
        .await
        .expect("the body was read instead of refused from its length");
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(error_of(&body)["code"], "request_too_large");
}

#[tokio::test]
async fn full_queue_is_429_immediately() {
    let m = MockBackend::new(MockConfig {
        max_running: Some(1),
        token_delay: Duration::from_millis(50),
        ..MockConfig::default()
    });
    let mut body = chat_body("hi");
    body["stream"] = json!(true);
    // The first request holds the only slot while its body is not read.
    let first = send(app(&m), post("/v1/chat/completions", body.to_string())).await;
    assert_eq!(first.status(), StatusCode::OK);
    let started = std::time::Instant::now();
    let (status, resp) = post_json(app(&m), "/v1/chat/completions", chat_body("hi")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(error_of(&resp)["type"], "rate_limit_error");
    assert_eq!(resp["error"]["code"], "queue_full");
    drop(first);
}

#[tokio::test]
async fn not_ready_is_503() {
    let m = MockBackend::new(MockConfig {
        ready: false,
        ..MockConfig::default()
    });
    for (path, body) in [
        ("/v1/chat/completions", chat_body("hi")),
        ("/v1/completions", json!({"prompt": "x"})),
        ("/tokenize", json!({"prompt": "x"})),
    ] {
        let (status, resp) = post_json(app(&m), path, body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert_eq!(error_of(&resp)["code"], "not_ready");
    }
}

#[tokio::test]
async fn engine_failure_is_500_or_an_error_event() {
    let m = MockBackend::new(MockConfig {
        error_at: Some(3),
        ..MockConfig::default()
    });
    let (status, resp) = post_json(app(&m), "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(error_of(&resp)["message"]
        .as_str()
        .unwrap()
        .contains("mock failure"));

    let resp = send(
        app(&m),
        post(
            "/v1/completions",
            json!({"prompt": "x", "stream": true}).to_string(),
        ),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let data = crate::common::sse_data(&text(resp).await);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(error_of(&err)["code"], "engine_error");
}

#[tokio::test]
async fn wrong_methods_are_405_openai_shaped() {
    for (method, path) in [
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/chat/completions"),
        ("POST", "/v1/models"),
    ] {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = send(app(&mock()), req).await;
        assert_eq!(
            resp.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
        let body: Value = serde_json::from_str(&text(resp).await).unwrap();
        assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(method));
    }
}

#[tokio::test]
async fn unknown_roles_and_huge_prompts_are_400_before_any_work() {
    expect_400(
        "/v1/chat/completions",
        json!({"messages": [{"role": "wizard", "content": "x"}]}),
        Some("messages[0].role"),
    )
    .await;
    let huge_role = "r".repeat(100_000);
    let (status, resp) = post_json(
        app(&mock()),
        "/v1/chat/completions",
        json!({"messages": [{"role": huge_role, "content": "x"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        resp.to_string().len() < 1000,
        "a huge value is not echoed back whole"
    );
    // The mock's context is 512 tokens: 64 bytes per token at most, so 40 kB never fits.
    let big = "a".repeat(40_000);
    for (path, body) in [
        ("/v1/chat/completions", chat_body(&big)),
        ("/v1/completions", json!({"prompt": big})),
    ] {
        let (status, resp) = post_json(app(&mock()), path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
        assert_eq!(resp["error"]["code"], "context_length_exceeded", "{resp}");
    }
    // A long model name is echoed truncated.
    let (status, resp) = post_json(
        app(&mock()),
        "/v1/chat/completions",
        json!({"model": "m".repeat(1_000_000), "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(resp.to_string().len() < 1000);
}

#[tokio::test]
async fn float_fields_must_be_finite_as_f32() {
    expect_400(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3.5e38}),
        Some("temperature"),
    )
    .await;
}

#[tokio::test]
async fn cors_is_off_by_default_and_follows_the_configured_origins() {
    let m = mock();
    let origin_header = |resp: &axum::response::Response| {
        resp.headers()
            .get(header::ACCESS_CONTROL_ALLOW_ORIGIN)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let from = |origin: &str| {
        Request::get("/v1/models")
            .header(header::ORIGIN, origin)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let preflight = |origin: &str| {
        Request::options("/v1/chat/completions")
            .header(header::ORIGIN, origin)
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(
                header::ACCESS_CONTROL_REQUEST_HEADERS,
                "authorization,content-type",
            )
            .body(axum::body::Body::empty())
            .unwrap()
    };

    // Default: no CORS headers on answers, and a preflight is not approved.
    let resp = send(app(&m), from("https://evil.example")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(origin_header(&resp), None);
    let resp = send(app(&m), preflight("https://evil.example")).await;
    assert_eq!(origin_header(&resp), None);

    // Named origins, with an API key: the preflight passes without the key, the named
    // origin is echoed, another origin gets nothing, and a 401 still carries the header so
    // the page can read the error.
    let cfg = ServerConfig {
        api_key: Some("sekrit".into()),
        cors: CorsPolicy::parse(&["https://app.example"]).unwrap(),
        ..ServerConfig::default()
    };
    let keyed = router(m.clone(), cfg);
    let resp = send(keyed.clone(), preflight("https://app.example")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(origin_header(&resp).as_deref(), Some("https://app.example"));
    let methods = resp.headers()[header::ACCESS_CONTROL_ALLOW_METHODS]
        .to_str()
        .unwrap();
    assert!(methods.contains("POST"), "{methods}");
    let resp = send(keyed.clone(), preflight("https://evil.example")).await;
    assert_eq!(origin_header(&resp), None);
    let resp = send(keyed.clone(), from("https://app.example")).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(origin_header(&resp).as_deref(), Some("https://app.example"));

    // `*`: any origin.
    let cfg = ServerConfig {
        cors: CorsPolicy::parse(&["*"]).unwrap(),
        ..ServerConfig::default()
    };
    let resp = send(router(m.clone(), cfg), from("https://any.example")).await;
    assert_eq!(origin_header(&resp).as_deref(), Some("*"));
}
