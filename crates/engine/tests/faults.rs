//! One client never hurts another, and faults are told truthfully: a bad token id is refused
//! at submission while the requests beside it finish; injected faults (a panicking step, a
//! failing step, NaN logits in one row, a stall) end exactly the requests they hit, with a
//! clear message, within bounded time; `/health`'s view (`unhealthy`) names the model;
//! admission of a batch is all or nothing. Every test is bounded in time.

mod common;

use common::*;
use std::time::Duration;
use tokenrouter_api::{Backend, GenerateEvent, GenerateStream, SubmitError};
use tokenrouter_engine::Engine;

/// How a request ended.
#[derive(Debug, PartialEq)]
enum End {
    Finished(usize),
    Error(String),
}

async fn drain(mut s: GenerateStream) -> End {
    let mut n = 0;
    let fut = async {
        while let Some(ev) = s.events.recv().await {
            match ev {
                GenerateEvent::Token(_) => n += 1,
                GenerateEvent::Finished { .. } => return End::Finished(n),
                GenerateEvent::PromptCached(_) => {}
                GenerateEvent::Error(m) => return End::Error(m),
                GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
            }
        }
        End::Error("stream closed without an end".into())
    };
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("a request ended within 30 s")
}

fn engine_with(
    system_extra: &str,
    llm_class: &str,
    slm_class: &str,
    kwargs: &str,
) -> (Pair, Engine) {
    let p = pair();
    let cfg = config(
        &p,
        slm_class,
        kwargs,
        llm_class,
        "",
        &format!("async\n{system_extra}"),
    );
    let e = start(cfg);
    (p, e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_vocabulary_ids_are_refused_and_neighbours_finish() {
    let (_p, e) = engine_with("", "random_llm", "random_slm", "{p: 0.3, seed: 1}");
    let shared = e.shared().expect("running");
    let innocent: Vec<_> = (0..4)
        .map(|i| {
            e.submit(greedy_request(prompt(8, i), 24))
                .expect("admitted")
        })
        .collect();
    for bad in [999_999u32, shared.sample_limit as u32, u32::MAX] {
        let mut req = greedy_request(prompt(8, 9), 8);
        req.prompt_ids.push(bad);
        match e.submit(req) {
            Err(SubmitError::InvalidField { param, message }) => {
                assert_eq!(param, "prompt");
                assert!(message.contains(&bad.to_string()), "{message}");
            }
            other => panic!(
                "expected a 400-type refusal, got {:?}",
                other.map(|s| s.request_id)
            ),
        }
    }
    let mut bias = greedy_request(prompt(8, 9), 8);
    bias.sampling.logit_bias = vec![(shared.sample_limit as u32 + 5, 1.0)];
    assert!(
        matches!(e.submit(bias), Err(SubmitError::InvalidField { param, .. }) if param == "logit_bias")
    );
    let mut stop = greedy_request(prompt(8, 9), 8);
    stop.stop_token_ids = vec![4_000_000];
    assert!(
        matches!(e.submit(stop), Err(SubmitError::InvalidField { param, .. }) if param == "stop_token_ids")
    );
    let mut urgent = greedy_request(prompt(8, 9), 8);
    urgent.priority = -3;
    assert!(
        matches!(e.submit(urgent), Err(SubmitError::InvalidField { param, .. }) if param == "priority"),
        "first come, first served takes no priority"
    );
    let mut hot = greedy_request(prompt(8, 9), 8);
    hot.sampling.temperature = f32::INFINITY;
    assert!(
        matches!(e.submit(hot), Err(SubmitError::InvalidField { param, .. }) if param == "temperature")
    );
    for s in innocent {
        assert_eq!(drain(s).await, End::Finished(24));
    }
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_resolves_an_absent_max_tokens_and_refuses_what_does_not_fit() {
    let (_p, e) = engine_with("", "random_llm", "random_slm", "{p: 0.3, seed: 1}");
    let context = e.shared().expect("running").context_limit;
    let mut open = greedy_request(prompt(8, 1), 1);
    open.max_tokens = None;
    let stream = e.submit(open).expect("admitted");
    assert_eq!(stream.max_tokens, context - 8, "fills the context");
    drop(stream);
    let mut too_long = greedy_request(prompt(8, 2), context - 7);
    match e.submit(too_long.clone()) {
        Err(SubmitError::ContextTooLong {
            prompt_tokens,
            max_tokens,
            context_length,
        }) => assert_eq!(
            (prompt_tokens, max_tokens, context_length),
            (8, context - 7, context)
        ),
        other => panic!(
            "expected ContextTooLong, got {:?}",
            other.map(|s| s.request_id)
        ),
    }
    too_long.max_tokens = None;
    too_long.prompt_ids = prompt(context, 3);
    assert!(matches!(
        e.submit(too_long),
        Err(SubmitError::ContextTooLong { max_tokens: 0, .. })
    ));
    let mut zero = greedy_request(prompt(8, 4), 1);
    zero.max_tokens = Some(0);
    assert!(matches!(
        e.submit(zero),
        Err(SubmitError::InvalidRequest(_))
    ));
    let fits = e.submit(greedy_request(prompt(8, 5), 6)).expect("admitted");
    assert_eq!(fits.max_tokens, 6);
    assert_eq!(drain(fits).await, End::Finished(6));
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_is_all_or_nothing() {
    let (_p, e) = engine_with(
        "  max_queued_requests: 4\n",
        "random_llm",
        "random_slm",
        "{p: 0.3, seed: 1}",
    );
    let five: Vec<_> = (0..5).map(|i| greedy_request(prompt(8, i), 4)).collect();
    assert!(matches!(
        e.submit_all(five),
        Err(SubmitError::QueueFull { limit: 4, .. })
    ));
    let shared = e.shared().expect("running");
    assert_eq!(
        shared.active.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a refused batch holds nothing"
    );
    // One bad request refuses the whole batch before anything is admitted.
    let mut mixed: Vec<_> = (0..3).map(|i| greedy_request(prompt(8, i), 4)).collect();
    mixed[2].prompt_ids.push(u32::MAX);
    assert!(e.submit_all(mixed).is_err());
    assert_eq!(shared.active.load(std::sync::atomic::Ordering::SeqCst), 0);
    let four: Vec<_> = (0..4).map(|i| greedy_request(prompt(8, i), 4)).collect();
    for s in e.submit_all(four).expect("four fit") {
        assert_eq!(drain(s).await, End::Finished(4));
    }
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_model_fails_its_requests_at_once_and_health_names_it() {
    // The large model panics in its 3rd step; the small one keeps serving pinned requests.
    let faults = "  fault_injection: [{model: reference, step: 3, kind: panic}]\n";
    let (_p, e) = engine_with(faults, "llm_only_llm", "llm_only_slm", "{}");
    let t0 = std::time::Instant::now();
    let routed: Vec<_> = (0..3)
        .map(|i| {
            e.submit(greedy_request(prompt(8, i), 40))
                .expect("admitted")
        })
        .collect();
    let mut pinned_req = greedy_request(prompt(8, 7), 40);
    pinned_req.pinned_model = Some(0);
    let pinned = e.submit(pinned_req).expect("admitted");
    for s in routed {
        match drain(s).await {
            End::Error(m) => assert!(m.contains("reference") && m.contains("down"), "{m}"),
            other => panic!("a request on the panicking model must fail, got {other:?}"),
        }
    }
    assert_eq!(drain(pinned).await, End::Finished(40));
    assert!(t0.elapsed() < Duration::from_secs(20));
    let unhealthy = e.unhealthy();
    assert_eq!(unhealthy.len(), 1, "{unhealthy:?}");
    assert_eq!(unhealthy[0].0, "reference");
    // New routed requests are refused (503-type) naming the model; pinned ones still run.
    match e.submit(greedy_request(prompt(8, 1), 4)) {
        Err(SubmitError::NotReady(m)) => assert!(m.contains("reference"), "{m}"),
        other => panic!("expected NotReady, got {:?}", other.map(|s| s.request_id)),
    }
    let mut again = greedy_request(prompt(8, 2), 5);
    again.pinned_model = Some(0);
    assert_eq!(
        drain(e.submit(again).expect("pinned to the healthy model")).await,
        End::Finished(5)
    );
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_fails_its_batch_and_the_model_stays_up() {
    let faults = "  fault_injection: [{model: quick, step: 2, kind: fail}]\n";
    let (_p, e) = engine_with(faults, "slm_only_llm", "slm_only_slm", "{}");
    let first = e
        .submit(greedy_request(prompt(8, 1), 20))
        .expect("admitted");
    match drain(first).await {
        End::Error(m) => assert!(m.contains("quick") && m.contains("injected"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(e.unhealthy().is_empty());
    assert_eq!(
        drain(e.submit(greedy_request(prompt(8, 2), 6)).expect("ok")).await,
        End::Finished(6)
    );
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nan_logits_fail_only_their_row() {
    // Step 3 of the small model gets NaN logits in its first row: that request alone fails.
    let faults = "  fault_injection: [{model: quick, step: 3, kind: nan_row}]\n";
    let (_p, e) = engine_with(faults, "slm_only_llm", "slm_only_slm", "{}");
    let streams: Vec<_> = (0..4)
        .map(|i| {
            e.submit(greedy_request(prompt(8, i), 16))
                .expect("admitted")
        })
        .collect();
    let mut ends = Vec::new();
    for s in streams {
        ends.push(drain(s).await);
    }
    let failed = ends
        .iter()
        .filter(|e| matches!(e, End::Error(m) if m.contains("NaN")))
        .count();
    let finished = ends.iter().filter(|e| **e == End::Finished(16)).count();
    assert_eq!((failed, finished), (1, 3), "{ends:?}");
    assert!(e.unhealthy().is_empty());
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_step_is_reported_while_it_lasts() {
    let faults = "  step_watchdog_s: 0.2\n  fault_injection: [{model: quick, step: 2, kind: stall, stall_ms: 1500}]\n";
    let (_p, e) = engine_with(faults, "slm_only_llm", "slm_only_slm", "{}");
    let s = e.submit(greedy_request(prompt(8, 1), 8)).expect("admitted");
    let mut seen = false;
    for _ in 0..100 {
        if e.unhealthy()
            .iter()
            .any(|(m, why)| m == "quick" && why.contains("watchdog"))
        {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen, "the stalled step was never reported");
    assert_eq!(drain(s).await, End::Finished(8));
    assert!(
        e.unhealthy().is_empty(),
        "healthy again once the step ended"
    );
    assert!(e
        .metrics_text()
        .contains("tokenrouter:slow_steps_total{model=\"quick\"} 1"));
    e.shutdown();
}
