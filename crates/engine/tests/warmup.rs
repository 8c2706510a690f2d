//! The start-up warm-up (`system.warmup`): it serves requests through every model before the
//! engine reports ready, then leaves no trace a client or the tuner could see — free KV,
//! zero routing counts, no request metrics — and does not change what clients get.

mod common;
use common::*;
use std::time::Duration;
use tokenrouter_api::Backend;

fn random_pair_config(p: &Pair, warmup: bool) -> tokenrouter_engine::EngineConfig {
    let mut cfg = config(
        p,
        "random_slm",
        "{p: 0.4, seed: 5}",
        "random_llm",
        "",
        "async",
    );
    cfg.system.warmup = Some(warmup);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_runs_before_ready_and_leaves_no_trace() {
    let p = pair();
    let warm = start(random_pair_config(&p, true));
    let shared = warm.shared().unwrap();
    assert_all_free(&warm, Duration::from_secs(10));
    let routed: u64 = shared.route_counts.lock().unwrap().iter().flatten().sum();
    assert_eq!(
        routed, 0,
        "the warm-up's routing decisions must not reach the tuner"
    );
    assert!(shared.latency_log.lock().unwrap().is_empty());
    let metrics = warm.metrics_text();
    assert!(
        !metrics.contains("tokenrouter:tokens_by_model_total{"),
        "warm-up tokens counted: {metrics}"
    );

    // Request ids continue after the warm-up's: one request per model and one routed.
    let first = warm.submit(greedy_request(prompt(12, 1), 4)).unwrap();
    assert_eq!(first.request_id, 1 + 3);
    drop(first);

    // Same outputs and provenance as an engine that did not warm up.
    let cold = start(random_pair_config(&p, false));
    for salt in 0..3 {
        let req = || greedy_request(prompt(20 + salt as usize, salt), 12);
        assert_eq!(
            run(&warm, req()).await,
            run(&cold, req()).await,
            "prompt {salt}"
        );
    }
    assert!(warm
        .metrics_text()
        .contains("tokenrouter:tokens_by_model_total{"));
    assert_all_free(&warm, Duration::from_secs(10));
}
