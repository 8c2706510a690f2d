//! Runs `tests/openai_client.py` (the official `openai` Python package) and
//! `tests/anthropic_client.py` (the official `anthropic` one) against `serve` on a real port
//! with the mock backend. Skipped with a note when python3 or the package is missing (CI
//! installs them).

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tokenrouter_server::ServerConfig;

use crate::mock::{MockBackend, MockConfig};
use crate::shutdown::start;

fn importable(package: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {package}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Whether a client test may run; panics when it may not but must (`TOKENROUTER_NO_SKIP`).
fn client_available(package: &str) -> bool {
    if importable(package) {
        return true;
    }
    assert!(
        !std::env::var("TOKENROUTER_NO_SKIP").is_ok_and(|v| !v.is_empty() && v != "0"),
        "TOKENROUTER_NO_SKIP is set but python3 with the `{package}` package is missing"
    );
    println!(
        "SKIPPED: python3 with the `{package}` package is not installed (pip install {package})"
    );
    false
}

/// Runs `tests/{script}` against `serve` on a real port (API key `test-key`) over a
/// tool-calling mock; `base_path` is what the client's base URL ends with. The mock, to
/// check what reached it.
async fn run_client(script: &str, base_path: &str) -> Arc<MockBackend> {
    let m = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(2),
        calls_tools: true,
        ..MockConfig::default()
    });
    let cfg = ServerConfig {
        api_key: Some("test-key".into()),
        ..ServerConfig::default()
    };
    let (addr, stop, server) = start(m.clone(), cfg).await;
    let path = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let base_url = format!("http://{addr}{base_path}");
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args([&path, "--base-url", &base_url, "--api-key", "test-key"])
            .output()
    })
    .await
    .expect("join")
    .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok());
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_end_to_end() {
    if !client_available("openai") {
        return;
    }
    let m = run_client("openai_client.py", "/v1").await;
    assert!(
        !m.log().aborted.is_empty(),
        "the disconnect test did not abort an engine request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_anthropic_client_end_to_end() {
    if !client_available("anthropic") {
        return;
    }
    run_client("anthropic_client.py", "").await;
}
