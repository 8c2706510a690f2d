//! Soak: thousands of requests on the tiny pair at high concurrency, a third of them
//! (40% asked, ≥ 30% asserted: some end first) cancelled mid-stream, with faults injected into both models (failing steps, NaN logits).
//! Every request must end — tokens then a finish, a clean error, or a recorded cancel —
//! none may hang, the KV cache of every model must return to empty, and the process's
//! resident memory after warm-up must not grow by 5% or more. Prints the figures.
//! `SOAK_REQUESTS` sets the number of requests (default 5,000).

mod common;

use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenrouter_api::{Backend, GenerateEvent};

fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[derive(Default)]
struct Tally {
    finished: AtomicUsize,
    errors: AtomicUsize,
    cancelled: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_every_request_ends_kv_returns_to_zero_memory_stays_flat() {
    let total: usize = std::env::var("SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let concurrency = 32;
    let p = pair();
    let faults = "  max_queued_requests: 1024\n  fault_injection: [{model: quick, step: 900, kind: fail}, {model: reference, step: 700, kind: nan_row}, {model: quick, step: 2500, kind: nan_row}, {model: reference, step: 1800, kind: fail}]\n";
    let cfg = config(
        &p,
        "random_slm",
        "{p: 0.3, seed: 3}",
        "random_llm",
        "",
        &format!("async\n{faults}"),
    );
    let e = start(cfg);
    let tally = Arc::new(Tally::default());
    let next = Arc::new(AtomicUsize::new(0));
    let warm = (total / 5).max(1000).min(total);
    let mut rss_after_warmup = None;
    let t0 = Instant::now();
    // Two phases: a warm-up fifth (allocator pools, histograms and maps reach their
    // steady size), then the rest; memory is compared between their ends.
    for (phase_end, phase) in [(warm, "warm-up"), (total, "soak")] {
        let mut tasks = Vec::new();
        for _ in 0..concurrency {
            let (e, tally, next) = (e.clone(), tally.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let Ok(i) = next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |i| {
                        (i < phase_end).then_some(i + 1)
                    }) else {
                        return;
                    };
                    let mut req = greedy_request(prompt(4 + i % 13, i as u32), 6 + i % 11);
                    if i % 7 == 0 {
                        req.pinned_model = Some(1);
                    }
                    let cancel_after = (i % 10 < 4).then_some(1 + i % 3);
                    let mut s = match e.submit(req) {
                        Ok(s) => s,
                        Err(err) => panic!("request {i} refused: {err}"),
                    };
                    let mut tokens = 0;
                    let ended = tokio::time::timeout(Duration::from_secs(60), async {
                        while let Some(ev) = s.events.recv().await {
                            match ev {
                                GenerateEvent::Token(_) => {
                                    tokens += 1;
                                    if cancel_after == Some(tokens) {
                                        return "cancelled";
                                    }
                                }
                                GenerateEvent::Finished { .. } => return "finished",
                                GenerateEvent::Error(_) => return "error",
                            }
                        }
                        "closed"
                    })
                    .await
                    .unwrap_or_else(|_| panic!("request {i} hung"));
                    match ended {
                        "finished" => tally.finished.fetch_add(1, Ordering::SeqCst),
                        "error" => tally.errors.fetch_add(1, Ordering::SeqCst),
                        "cancelled" => tally.cancelled.fetch_add(1, Ordering::SeqCst),
                        other => panic!("request {i}: the stream {other} without an end"),
                    };
                    // Dropping the stream here cancels a request that has not ended.
                }
            }));
        }
        for t in tasks {
            t.await.expect("client task");
        }
        assert_all_free(&e, Duration::from_secs(10));
        if phase == "warm-up" {
            rss_after_warmup = rss_bytes();
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let (f, er, c) = (
        tally.finished.load(Ordering::SeqCst),
        tally.errors.load(Ordering::SeqCst),
        tally.cancelled.load(Ordering::SeqCst),
    );
    let rss_end = rss_bytes();
    let growth = match (rss_after_warmup, rss_end) {
        (Some(a), Some(b)) => (b as f64 - a as f64) / a as f64,
        _ => 0.0,
    };
    let failed_rows = e
        .metrics_text()
        .lines()
        .filter(|l| l.starts_with("tokenrouter:failed_requests_total"))
        .map(|l| l.to_string())
        .collect::<Vec<_>>();
    println!(
        "soak: {total} requests at concurrency {concurrency} in {elapsed:.1} s: {f} finished, {er} clean errors, {c} cancelled mid-stream ({:.0}%); KV back to 0 on every model; RSS {:.1} MB after warm-up -> {:.1} MB at the end ({:+.2}%); {failed_rows:?}",
        100.0 * c as f64 / total as f64,
        rss_after_warmup.unwrap_or(0) as f64 / 1e6,
        rss_end.unwrap_or(0) as f64 / 1e6,
        100.0 * growth
    );
    assert_eq!(f + er + c, total, "every request ended");
    assert!(c * 10 >= total * 3, "at least 30% cancelled ({c})");
    assert!(er >= 2, "the injected faults failed requests ({er})");
    assert!(
        growth < 0.05,
        "RSS grew {:.1}% after warm-up",
        100.0 * growth
    );
    assert!(e.unhealthy().is_empty());
    e.shutdown();
}
