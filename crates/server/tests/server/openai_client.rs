//! Runs `tests/openai_client.py` (the official `openai` Python package) against `serve` on
//! a real port with the mock backend. Skipped with a note when python3 or the package is
//! missing (CI installs it).

use std::process::Command;
use std::time::Duration;

use tokenrouter_server::ServerConfig;

use crate::mock::{MockBackend, MockConfig};
use crate::shutdown::start;

fn openai_available() -> bool {
    Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_end_to_end() {
    if !openai_available() {
        assert!(
            !std::env::var("TOKENROUTER_NO_SKIP").is_ok_and(|v| !v.is_empty() && v != "0"),
            "TOKENROUTER_NO_SKIP is set but python3 with the `openai` package is missing"
        );
        println!(
            "SKIPPED: python3 with the `openai` package is not installed (pip install openai)"
        );
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
