//! `serve` on a real port: graceful shutdown lets in-flight requests finish within the
//! grace period, aborts them after it, stops accepting, and returns Ok.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokenrouter_server::{serve, ServerConfig, ServerError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::mock::{MockBackend, MockConfig};

/// Starts `serve` on 127.0.0.1:0; returns its address, the shutdown trigger and the task.
pub async fn start(
    mock: Arc<MockBackend>,
    cfg: ServerConfig,
) -> (
    SocketAddr,
    oneshot::Sender<()>,
    JoinHandle<Result<(), ServerError>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, mock, cfg, async move {
        let _ = rx.await;
    }));
    (addr, tx, task)
}

/// Minimal HTTP/1.1 POST with `Connection: close`; returns status and body.
async fn post_raw(
    addr: SocketAddr,
    path: &'static str,
    body: Value,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

fn slow_mock() -> Arc<MockBackend> {
    MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(10),
        ..MockConfig::default()
    })
}

#[tokio::test]
async fn in_flight_requests_finish_within_the_grace_period() {
    let m = slow_mock();
    let cfg = ServerConfig {
        shutdown_grace: Duration::from_secs(10),
        ..ServerConfig::default()
    };
    let (addr, stop, server) = start(m.clone(), cfg).await;
    let client = tokio::spawn(post_raw(
        addr,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 20}),
    ));
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.running == 1)
            .await
    );
    let _ = stop.send(());
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok(), "{result:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let (status, body) = client.await.expect("join").expect("response");
    assert_eq!(status, 200, "{body}");
    let body: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 20);
    assert!(m.log().aborted.is_empty());
    // The listener is closed: new connections fail.
    assert!(post_raw(addr, "/v1/completions", json!({"prompt": "x"}))
        .await
        .is_err());
}

#[tokio::test]
async fn requests_still_running_after_the_grace_period_are_aborted() {
    let m = slow_mock();
    let cfg = ServerConfig {
        shutdown_grace: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let (addr, stop, server) = start(m.clone(), cfg).await;
    let body = json!({"prompt": "x", "max_tokens": 500, "ignore_eos": true});
    let client = tokio::spawn(post_raw(addr, "/v1/completions", body));
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.running == 1)
            .await
    );
    let _ = stop.send(());
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(4), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok(), "{result:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    let (status, body) = client.await.expect("join").expect("response");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("shutting_down"), "{body}");
    assert!(
        m.wait_for(Duration::from_secs(2), |log| log.aborted.len() == 1)
            .await,
        "engine request not aborted"
    );
}

#[tokio::test]
async fn an_idle_server_returns_at_once() {
    let (_, stop, server) = start(slow_mock(), ServerConfig::default()).await;
    let _ = stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("serve returned")
        .expect("join");
    assert!(result.is_ok());
}
