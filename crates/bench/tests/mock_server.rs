//! Runs the benchmark against small in-process mock OpenAI servers (axum on 127.0.0.1:0): healthy
//! streams with usage and tokenrouter provenance, flaky ones (HTTP 500, streams cut before [DONE],
//! connections aborted mid-stream), and servers without usage.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokenrouter_bench::{run, BenchArgs, CSV_COLUMNS};

#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    /// 3 content chunks, usage with provenance, [DONE].
    Healthy,
    /// Request n: n % 4 == 1 → HTTP 500, == 2 → stream ends without [DONE], == 3 → connection
    /// aborted after one chunk, == 0 → healthy.
    Flaky,
    /// 3 content chunks and [DONE], no usage, no provenance.
    NoUsage,
}

struct Mock {
    behaviour: Behaviour,
    count: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    bodies: Mutex<Vec<Value>>,
    auth: Mutex<Vec<String>>,
}

/// Decrements the in-flight counter when the response stream is dropped.
struct InFlight(Arc<Mock>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

enum Event {
    Data(String),
    Abort,
}

fn content(chat: bool, text: &str) -> Event {
    let chunk = if chat {
        json!({"object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
    } else {
        json!({"object": "text_completion",
               "choices": [{"index": 0, "text": text, "finish_reason": null}]})
    };
    Event::Data(chunk.to_string())
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "mock-model", "object": "model"}]}))
}

async fn chat(
    State(mock): State<Arc<Mock>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    respond(mock, headers, body, true)
}

async fn completions(
    State(mock): State<Arc<Mock>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    respond(mock, headers, body, false)
}

fn respond(mock: Arc<Mock>, headers: HeaderMap, body: Value, chat: bool) -> Response {
    let n = mock.count.fetch_add(1, Ordering::SeqCst);
    if let Ok(mut b) = mock.bodies.lock() {
        b.push(body);
    }
    if let Some(a) = headers.get("authorization").and_then(|v| v.to_str().ok()) {
        if let Ok(mut list) = mock.auth.lock() {
            list.push(a.to_string());
        }
    }
    let mode = match mock.behaviour {
        Behaviour::Flaky => n % 4,
        _ => 0,
    };
    if mode == 1 {
        return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
    }
    let now = mock.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    mock.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let mut events = vec![content(chat, "a"), content(chat, "b"), content(chat, "c")];
    match mode {
        2 => events.truncate(2),
        3 => {
            events.truncate(1);
            events.push(Event::Abort);
        }
        _ => {
            if mock.behaviour != Behaviour::NoUsage {
                events.push(Event::Data(
                    json!({"choices": [],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                           "tokenrouter": {"tokens_by_model": {"quick": 2, "reference": 1},
                                           "switches": 1}})
                    .to_string(),
                ));
            }
            events.push(Event::Data("[DONE]".into()));
        }
    }
    let guard = InFlight(mock.clone());
    let stream =
        futures_util::stream::unfold((events.into_iter(), guard), |(mut it, guard)| async move {
            let ev = it.next()?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            let item = match ev {
                Event::Data(d) => Ok::<_, std::io::Error>(Bytes::from(format!("data: {d}\n\n"))),
                Event::Abort => Err(std::io::Error::other("connection dropped")),
            };
            Some((item, (it, guard)))
        });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn start(behaviour: Behaviour) -> (SocketAddr, Arc<Mock>) {
    let mock = Arc::new(Mock {
        behaviour,
        count: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
        bodies: Mutex::new(Vec::new()),
        auth: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Without TCP_NODELAY, Nagle's algorithm coalesces the 5 ms-spaced chunks and distorts ITL.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, mock)
}

fn args(addr: SocketAddr, extra: &[&str]) -> BenchArgs {
    let base = format!("http://{addr}");
    let mut flags = vec!["--base-url", &base, "--no-progress", "--quiet"];
    flags.extend_from_slice(extra);
    BenchArgs::from_flags(flags).expect("flags")
}

fn read_csv(dir: &std::path::Path) -> (Vec<String>, Vec<csv::StringRecord>) {
    let mut r = csv::Reader::from_path(dir.join("requests.csv")).expect("csv");
    let headers = r
        .headers()
        .expect("headers")
        .iter()
        .map(str::to_string)
        .collect();
    let rows = r.records().collect::<Result<Vec<_>, _>>().expect("rows");
    (headers, rows)
}

fn col(headers: &[String], name: &str) -> usize {
    headers.iter().position(|h| h == name).expect(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_measures_tokens_latency_and_provenance() {
    let (addr, mock) = start(Behaviour::Healthy).await;
    let out = tempfile::tempdir().expect("tempdir");
    let out_dir = out.path().join("run");
    let a = args(
        addr,
        &[
            "--concurrency",
            "4",
            "--num-prompts",
            "10",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--temperature",
            "0",
            "--api-key",
            "secret",
            "--out-dir",
            out_dir.to_str().expect("utf8"),
        ],
    );
    let s = run(a).await.expect("run");
    assert_eq!((s.completed, s.failed), (10, 0));
    assert_eq!(s.model, "mock-model", "discovered from /v1/models");
    assert_eq!(s.mode, "closed");
    assert_eq!(s.total_output_tokens, 30);
    assert_eq!(s.total_input_tokens, 50);
    assert_eq!(s.tokens_by_model["quick"], 20);
    assert_eq!(s.tokens_by_model["reference"], 10);
    assert!((s.share_by_model["quick"] - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(s.switches_per_request, Some(1.0));
    assert_eq!(s.ttft_ms.count, 10);
    assert_eq!(
        s.itl_ms.count, 20,
        "two gaps between three chunks per request"
    );
    assert!(
        s.itl_ms.median >= 4.0,
        "chunks are 5 ms apart: {:?}",
        s.itl_ms
    );
    assert!(s.tpot_ms.mean >= 4.0 && s.e2e_ms.mean >= s.ttft_ms.mean);
    assert!(s.output_throughput > 0.0 && s.request_throughput > 0.0);
    let peak = mock.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=4).contains(&peak), "peak in flight {peak}");

    let bodies = mock.bodies.lock().expect("bodies").clone();
    assert_eq!(bodies.len(), 10);
    for b in &bodies {
        assert_eq!(b["model"], "mock-model");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["max_tokens"], 3);
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["messages"][0]["role"], "user");
    }
    let auth = mock.auth.lock().expect("auth").clone();
    assert!(auth.len() >= 10 && auth.iter().all(|a| a == "Bearer secret"));

    let (headers, rows) = read_csv(&out_dir);
    assert_eq!(headers, CSV_COLUMNS.to_vec());
    assert_eq!(rows.len(), 10);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.len(), CSV_COLUMNS.len());
        assert_eq!(&row[col(&headers, "index")], i.to_string());
        assert_eq!(&row[col(&headers, "success")], "true");
        assert_eq!(&row[col(&headers, "output_tokens")], "3");
        assert_eq!(&row[col(&headers, "http_status")], "200");
        assert_eq!(&row[col(&headers, "error")], "");
        let by: Value =
            serde_json::from_str(&row[col(&headers, "tokens_by_model")]).expect("provenance json");
        assert_eq!(by, json!({"quick": 2, "reference": 1}));
        let ttft: f64 = row[col(&headers, "ttft_ms")].parse().expect("ttft");
        assert!(ttft > 0.0);
    }
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("summary.json")).expect("summary.json"),
    )
    .expect("json");
    assert_eq!(summary["completed"], 10);
    assert_eq!(summary["tokens_by_model"]["reference"], 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_are_counted_and_recorded() {
    let (addr, mock) = start(Behaviour::Flaky).await;
    let out = tempfile::tempdir().expect("tempdir");
    let a = args(
        addr,
        &[
            "--model",
            "m",
            "--concurrency",
            "3",
            "--num-prompts",
            "4",
            "--repeats",
            "3",
            "--out-dir",
            out.path().to_str().expect("utf8"),
        ],
    );
    let s = run(a).await.expect("run never aborts on request failures");
    assert_eq!(mock.count.load(Ordering::SeqCst), 12);
    assert_eq!((s.completed, s.failed), (3, 9));
    assert_eq!(s.total_output_tokens, 9, "only completed requests count");
    assert_eq!(s.tokens_by_model["quick"], 6);
    let count = |needle: &str| -> usize {
        s.errors
            .iter()
            .filter(|(e, _)| e.contains(needle))
            .map(|(_, n)| n)
            .sum()
    };
    assert_eq!(count("HTTP 500"), 3, "{:?}", s.errors);
    assert_eq!(count("before [DONE]"), 3, "{:?}", s.errors);
    assert_eq!(count("stream error"), 3, "{:?}", s.errors);

    let (headers, rows) = read_csv(out.path());
    assert_eq!(rows.len(), 12);
    let failed = rows
        .iter()
        .filter(|r| &r[col(&headers, "success")] == "false")
        .inspect(|r| assert!(!r[col(&headers, "error")].is_empty()))
        .count();
    assert_eq!(failed, 9);
    assert_eq!(&rows[4][col(&headers, "repeat")], "1");
    assert_eq!(&rows[4][col(&headers, "prompt_index")], "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_completions_without_usage() {
    let (addr, mock) = start(Behaviour::NoUsage).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("prompts.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"one\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"two\"}]}\n",
    )
    .expect("write");
    let a = args(
        addr,
        &[
            "--model",
            "m",
            "--endpoint",
            "completions",
            "--request-rate",
            "500",
            "--max-concurrency",
            "2",
            "--num-prompts",
            "8",
            "--seed",
            "1",
            "--dataset",
            data.to_str().expect("utf8"),
        ],
    );
    let s = run(a).await.expect("run");
    assert_eq!((s.completed, s.failed), (8, 0));
    assert_eq!(s.mode, "open");
    assert_eq!(
        s.total_output_tokens, 24,
        "counted from chunks without usage"
    );
    assert!(s.tokens_by_model.is_empty() && s.switches_per_request.is_none());
    assert!(mock.max_in_flight.load(Ordering::SeqCst) <= 2);
    let bodies = mock.bodies.lock().expect("bodies").clone();
    let prompts: Vec<&str> = bodies.iter().filter_map(|b| b["prompt"].as_str()).collect();
    assert_eq!(prompts.len(), 8);
    assert_eq!(prompts.iter().filter(|p| **p == "two").count(), 4);
    assert!(bodies.iter().all(|b| b.get("ignore_eos").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_counts_every_request_as_failed() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let a = args(
        addr,
        &["--model", "m", "--concurrency", "2", "--num-prompts", "3"],
    );
    let s = run(a).await.expect("run");
    assert_eq!((s.completed, s.failed), (0, 3));
    assert!(s.errors.keys().all(|e| e.starts_with("request failed")));
    assert!(s.ttft_ms.mean.is_nan());
    let text = serde_json::to_string(&s).expect("summary serialises");
    assert!(text.contains("\"mean\":null"), "{text}");
}
