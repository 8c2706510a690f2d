//! The live web view (axum oneshot, no port): `/` serves the page, every front-end file is
//! embedded and served with the right type, every asset the page references exists, the
//! page stays reachable when an API key protects `/v1`, and the per-token `text` of
//! `token_details` (which the page uses to colour tokens one by one) always concatenates to
//! the content it belongs to. The browser test is `tests/browser/run.sh`.

#[path = "server/common.rs"]
mod common;
#[path = "server/mock.rs"]
mod mock;

use std::path::PathBuf;

use axum::http::{header, StatusCode};
use common::*;
use serde_json::{json, Value};
use tokenrouter_server::{router, ServerConfig};

fn web_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("web")
}

fn content_type(resp: &axum::response::Response) -> String {
    resp.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn root_serves_the_page_with_html_type_and_security_headers() {
    let m = mock();
    let resp = send(app(&m), get("/")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(content_type(&resp), "text/html; charset=utf-8");
    let csp = resp.headers()[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap()
        .to_string();
    assert!(csp.contains("default-src 'self'"), "{csp}");
    assert_eq!(resp.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    let html = text(resp).await;
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains(r#"<script type="module" src="/web/app.js"></script>"#));
    assert!(html.contains(r#"href="/web/style.css""#));
    // No network beyond this server: nothing loaded from elsewhere.
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "{html}"
    );
    let head = send(app(&m), get("/")).await;
    assert_eq!(head.status(), StatusCode::OK);
}

#[tokio::test]
async fn every_front_end_file_is_embedded_and_served_with_its_type() {
    let m = mock();
    let mut names: Vec<String> = std::fs::read_dir(web_dir())
        .expect("crates/server/web")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert!(names.len() >= 5, "{names:?}");
    for name in names {
        let resp = send(app(&m), get(&format!("/web/{name}"))).await;
        assert_eq!(resp.status(), StatusCode::OK, "/web/{name} is not embedded");
        let expected_type = match name.rsplit_once('.').map(|(_, ext)| ext) {
            Some("js") => "text/javascript; charset=utf-8",
            Some("css") => "text/css; charset=utf-8",
            Some("html") => "text/html; charset=utf-8",
            Some("svg") => "image/svg+xml",
            other => panic!("unexpected file type {other:?} in web/: {name}"),
        };
        assert_eq!(content_type(&resp), expected_type, "{name}");
        assert_eq!(resp.headers()[header::CACHE_CONTROL], "no-cache");
        let body = text(resp).await;
        let on_disk = std::fs::read_to_string(web_dir().join(&name)).unwrap();
        assert_eq!(body, on_disk, "{name} differs from the embedded copy");
    }
}

/// `src="/web/x"`, `href="/web/x"` in the page and `from "./x.js"` in the modules.
fn references(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    for marker in ["\"/web/", "from \"./"] {
        let mut rest = source;
        while let Some(i) = rest.find(marker) {
            rest = &rest[i + marker.len()..];
            let end = rest.find('"').unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = &rest[end..];
        }
    }
    out
}

#[tokio::test]
async fn every_asset_the_page_references_is_served() {
    let m = mock();
    let mut pending = vec!["index.html".to_string()];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(name) = pending.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let path = if name == "index.html" {
            "/".to_string()
        } else {
            format!("/web/{name}")
        };
        let resp = send(app(&m), get(&path)).await;
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        pending.extend(references(&text(resp).await));
    }
    for must in [
        "app.js",
        "api.js",
        "answer.js",
        "metrics.js",
        "tooltip.js",
        "style.css",
    ] {
        assert!(
            seen.contains(must),
            "{must} not reached from the page: {seen:?}"
        );
    }
}

#[tokio::test]
async fn unknown_assets_are_404_and_the_page_needs_no_api_key() {
    let m = mock();
    let resp = send(app(&m), get("/web/nope.js")).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let body: Value = serde_json::from_str(&text(resp).await).unwrap();
    assert_eq!(body["error"]["code"], "not_found");
    let resp = send(app(&m), get("/web/../Cargo.toml")).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);

    let cfg = ServerConfig {
        api_key: Some("k".into()),
        ..ServerConfig::default()
    };
    let locked = || router(m.clone(), cfg.clone());
    assert_eq!(send(locked(), get("/")).await.status(), StatusCode::OK);
    assert_eq!(
        send(locked(), get("/web/app.js")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(locked(), get("/v1/models")).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

fn detail_texts(choice: &Value) -> (Vec<String>, Vec<String>) {
    let details = choice["token_details"].as_array().expect("token_details");
    let texts = details
        .iter()
        .map(|d| d["text"].as_str().expect("text").to_string())
        .collect();
    let sources = details
        .iter()
        .map(|d| d["source"].as_str().unwrap().to_string())
        .collect();
    (texts, sources)
}

#[tokio::test]
async fn token_detail_texts_concatenate_to_each_streamed_delta() {
    let m = mock();
    for stop in [json!(null), json!(["END"])] {
        let body = json!({
            "messages": [{"role": "user", "content": "hi"}], "stream": true, "seed": 3,
            "return_token_sources": true, "stop": stop
        });
        let chunks = stream_chunks(app(&m), "/v1/chat/completions", body).await;
        let mut content = String::new();
        let mut streamed_sources = Vec::new();
        let mut pieces = Vec::new();
        for c in &chunks {
            let choice = &c["choices"][0];
            let delta = choice["delta"]["content"].as_str().unwrap_or("");
            let (texts, sources) = detail_texts(choice);
            assert_eq!(texts.concat(), delta, "{c}");
            assert_eq!(
                sources,
                choice["token_sources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_string())
                    .collect::<Vec<_>>()
            );
            content.push_str(delta);
            pieces.extend(texts);
            streamed_sources.extend(sources);
        }
        // "日" is three byte tokens: two carry no text, the third the whole character.
        let i = pieces.iter().position(|p| p == "日").expect("日 in output");
        assert_eq!(&pieces[i - 2..i], ["", ""]);

        // The non-streamed answer to the same request has the same tokens, texts and sources.
        let body = json!({
            "messages": [{"role": "user", "content": "hi"}], "seed": 3,
            "return_token_sources": true, "stop": stop
        });
        let (status, resp) = post_json(app(&m), "/v1/chat/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{resp}");
        let choice = &resp["choices"][0];
        assert_eq!(choice["message"]["content"], content.as_str());
        let (texts, sources) = detail_texts(choice);
        assert_eq!(texts, pieces);
        assert_eq!(sources, streamed_sources);
        if stop.is_array() {
            assert!(!content.contains("END"));
            assert!(
                texts.iter().rev().take(3).all(String::is_empty),
                "{texts:?}"
            );
        }
    }
}

#[tokio::test]
async fn token_detail_texts_in_completions_match_the_text() {
    let m = mock();
    let body = json!({"prompt": "x", "max_tokens": 9, "return_token_sources": true});
    let (status, resp) = post_json(app(&m), "/v1/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    let choice = &resp["choices"][0];
    let (texts, _) = detail_texts(choice);
    assert_eq!(texts.len(), 9);
    assert_eq!(texts.concat(), choice["text"].as_str().unwrap());
}
