//! Runs `tests/openai_client.py` (the official `openai` Python package) and
//! `tests/anthropic_client.py` (the official `anthropic` one) against `serve` on a real port
//! with the mock backend. Skipped with a note when python3 or the package is missing (CI
//! installs them).

use std::process::Command;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_end_to_end() {
    if !client_available("openai") {
        return;
    }
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
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base_url = format!("http://{addr}/v1");
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args([script, "--base-url", &base_url, "--api-key", "test-key"])
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
        "openai_client.py failed:\n{stdout}\n{stderr}"
    );
    assert!(
        !m.log().aborted.is_empty(),
        "the disconnect test did not abort an engine request"
    );
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_anthropic_client_end_to_end() {
    if !client_available("anthropic") {
        return;
    }
    let m = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(1),
        calls_tools: true,
        ..MockConfig::default()
    });
    let cfg = ServerConfig {
        api_key: Some("test-key".into()),
        ..ServerConfig::default()
    };
    let (addr, stop, server) = start(m.clone(), cfg).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/anthropic_client.py");
    let base_url = format!("http://{addr}");
    let output = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args([script, "--base-url", &base_url, "--api-key", "test-key"])
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
        "anthropic_client.py failed:\n{stdout}\n{stderr}"
    );
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok());
}
