//! End to end on the real models: the default config (Qwen2.5-Coder 0.5B ⇄ 1.5B, Q4_K_M
//! GGUF, R-Stitch) served in-process, one chat request and one streamed completion.
//! Skipped with a note when the models are not in the cache (`tokenrouter fetch`), unless
//! `TOKENROUTER_NO_SKIP` is set: then a missing model is a failure.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokenrouter_engine::{Engine, EngineConfig};
use tokenrouter_server::ServerConfig;

fn models_cached() -> bool {
    let dir = tokenrouter_fetch::default_cache_dir();
    let missing: Vec<&str> = tokenrouter_fetch::DEFAULT_MODELS
        .iter()
        .filter(|m| {
            !matches!(
                tokenrouter_fetch::cached_default_model(m, &dir),
                Ok(Some(_))
            )
        })
        .map(|m| m.name)
        .collect();
    if missing.is_empty() {
        return true;
    }
    let note = format!(
        "models not in {}: {} (run `cargo run --release -- fetch`)",
        dir.display(),
        missing.join(", ")
    );
    if std::env::var("TOKENROUTER_NO_SKIP").is_ok_and(|v| !v.is_empty() && v != "0") {
        panic!("TOKENROUTER_NO_SKIP is set but {note}");
    }
    println!("SKIPPED: {note}");
    false
}

/// `data:` payloads of an SSE body, `[DONE]` included.
fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn check_provenance(p: &Value, completion_tokens: u64) {
    let by_model = p["tokens_by_model"]
        .as_object()
        .unwrap_or_else(|| panic!("no tokens_by_model: {p}"));
    let sum: u64 = by_model.values().filter_map(Value::as_u64).sum();
    assert_eq!(sum, completion_tokens, "{p}");
    assert!(
        by_model.keys().all(|k| k == "quick" || k == "reference"),
        "{p}"
    );
    assert!(p["switches"].is_u64(), "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_config_serves_the_real_pair() {
    if !models_cached() {
        return;
    }
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml");
    let cfg = EngineConfig::from_file(&file).unwrap();
    let t0 = Instant::now();
    let engine = Engine::start(cfg).unwrap();
    let e2 = engine.clone();
    tokio::task::spawn_blocking(move || e2.wait_ready(Duration::from_secs(600)))
        .await
        .unwrap()
        .expect("the real pair loads");
    println!("loaded in {:.1}s", t0.elapsed().as_secs_f64());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let backend: Arc<dyn tokenrouter_api::Backend> = Arc::new(engine.clone());
    let server = tokio::spawn(tokenrouter_server::serve(
        listener,
        backend,
        ServerConfig::default(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let client = reqwest::Client::new();
    let base = format!("http://{addr}");

    let health = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    // One chat request (the README's first curl, shortened).
    let t0 = Instant::now();
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({
            "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}],
            "max_tokens": 40,
            "temperature": 0,
            "return_token_sources": true
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    let content = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("");
    assert!(!content.trim().is_empty(), "empty answer: {body}");
    let n = body["usage"]["completion_tokens"].as_u64().unwrap();
    check_provenance(&body["tokenrouter"], n);
    let sources = body["choices"][0]["token_sources"].as_array().unwrap();
    assert_eq!(sources.len() as u64, n, "{body}");
    println!(
        "chat: {n} tokens in {:.1}s, by model {}: {content:?}",
        t0.elapsed().as_secs_f64(),
        body["tokenrouter"]
    );

    // One streamed completion with usage.
    let t0 = Instant::now();
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({
            "prompt": "def fibonacci(n):",
            "max_tokens": 24,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert!(!text.trim().is_empty(), "empty streamed text: {chunks:?}");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    let n = last["usage"]["completion_tokens"].as_u64().unwrap();
    check_provenance(&last["tokenrouter"], n);
    println!(
        "stream: {n} tokens in {:.1}s, by model {}: {text:?}",
        t0.elapsed().as_secs_f64(),
        last["tokenrouter"]
    );

    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), server).await;
    engine.shutdown();
}
