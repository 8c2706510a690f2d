//! A full KV cache at one sub-server, driven step by step (no threads, no timing): KV that
//! no running request steps on is given up before anyone fails. The case CI once hit by
//! timing — requests back from another model queued with their KV here while the one
//! running request needs the next block — made deterministic with a batch of one. Priority
//! scheduling (vLLM's): the queue served by priority, preemption taking the lowest first.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokenrouter_api::{GenerateEvent, SamplingParams};
use tokenrouter_engine::metrics::EngineMetrics;
use tokenrouter_engine::policy::{Decision, Policy, StepView};
use tokenrouter_engine::request::Req;
use tokenrouter_engine::subserver::{Inbound, Outbound, Shared, SubServer};
use tokenrouter_engine::Threshold;
use tokenrouter_runtime::{load_model, KvBudget, LoadOptions, Sampler};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Sends each listed request to model 1 after its first step here; the rest stay.
struct AwayOnce {
    away: HashSet<u64>,
}

impl Policy for AwayOnce {
    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                if self.away.remove(&r.rid) {
                    Decision::go(1, None)
                } else {
                    Decision::stay(None)
                }
            })
            .collect()
    }
}

fn request(
    rid: u64,
    prompt_len: usize,
    max_tokens: usize,
) -> (Box<Req>, UnboundedReceiver<GenerateEvent>) {
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 1 + (i * 7 + rid as u32) % 50)
        .collect();
    let (tx, rx) = unbounded_channel();
    let sampler = Sampler::new(SamplingParams::greedy(), rid, &prompt);
    let req = Req::new(
        rid,
        prompt,
        sampler,
        rid,
        max_tokens,
        Vec::new(),
        None,
        0,
        tx,
    );
    (Box::new(req), rx)
}

/// Steps until nothing is left; returns the requests handed to model 1 (boxed, as they
/// travel) and the finished ids.
#[allow(clippy::vec_box)]
fn step_all(sub: &mut SubServer, limit: usize) -> (Vec<Box<Req>>, Vec<u64>) {
    let (mut away, mut done) = (Vec::new(), Vec::new());
    for _ in 0..limit {
        let mut out = Vec::new();
        if !sub.step(&mut out) {
            break;
        }
        for o in out {
            match o {
                Outbound::Handoff { req, .. } => away.push(req),
                Outbound::Done { rid } => done.push(rid),
            }
        }
    }
    (away, done)
}

fn outcome(rx: &mut UnboundedReceiver<GenerateEvent>) -> Result<usize, String> {
    let mut tokens = 0;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            GenerateEvent::Token(_) => tokens += 1,
            GenerateEvent::Finished { .. } => return Ok(tokens),
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => return Err(m),
            GenerateEvent::Prompt(_) => return Err("prompt scores were not asked for".into()),
        }
    }
    Err(format!("not finished after {tokens} tokens"))
}

/// The small model of the tiny pair with a 512-token (32-block) cache, as a sub-server
/// stepping `max_batch` requests, sending `away` to model 1 after their first step.
fn sub_server(
    p: &common::Pair,
    max_batch: usize,
    priority: bool,
    away: &[u64],
) -> (SubServer, Arc<EngineMetrics>) {
    let opts = LoadOptions {
        kv: KvBudget::Tokens(512),
        ..LoadOptions::default()
    };
    let model = load_model(&p.small, &opts).unwrap();
    let runner = model.runner;
    assert_eq!(runner.usage().total_blocks, 32, "16-token blocks");
    let sample_limit = runner.config().vocab_size;
    let metrics = Arc::new(EngineMetrics::new().unwrap());
    let mut shared = Shared::new(
        vec!["quick".into(), "reference".into()],
        4096,
        sample_limit,
        vec![Threshold::default(), Threshold::default()],
        metrics.clone(),
        Duration::from_secs(60),
    );
    shared.priority_scheduling = priority;
    let policy = AwayOnce {
        away: away.iter().copied().collect(),
    };
    let sub = SubServer::new(
        0,
        runner,
        Box::new(policy),
        sample_limit,
        max_batch,
        Arc::new(shared),
    );
    (sub, metrics)
}

/// The order requests finish in when `(rid, priority, tokens)` are queued behind a running
/// request 1 at a batch of one.
fn finishing_order(p: &common::Pair, priority: bool, queued: &[(u64, i32)]) -> Vec<u64> {
    let (mut sub, _) = sub_server(p, 1, priority, &[]);
    let (first, _rx) = request(1, 20, 8);
    sub.accept(Inbound::Admit(first));
    step_all(&mut sub, 1);
    let mut receivers = Vec::new();
    for &(rid, prio) in queued {
        let (mut req, rx) = request(rid, 20, 8);
        req.priority = prio;
        receivers.push(rx);
        sub.accept(Inbound::Admit(req));
    }
    let (_, done) = step_all(&mut sub, 1000);
    for mut rx in receivers {
        assert_eq!(outcome(&mut rx), Ok(8));
    }
    done
}

#[test]
fn priority_scheduling_serves_the_queue_lowest_value_first_then_oldest() {
    let p = common::pair();
    let queued = [(2, 5), (3, -1), (4, 3), (5, 5)];
    assert_eq!(finishing_order(&p, true, &queued), [1, 3, 4, 2, 5]);
    assert_eq!(finishing_order(&p, false, &queued), [1, 2, 3, 4, 5]);
}

/// Three long requests outgrow the cache together: which finishes first tells which were
/// preempted (recomputed later).
fn preemption_order(p: &common::Pair, priority: bool) -> Vec<u64> {
    let (mut sub, metrics) = sub_server(p, 4, priority, &[]);
    let mut receivers = Vec::new();
    for (rid, prio) in [(1, 9), (2, 0), (3, 5)] {
        let (mut req, rx) = request(rid, 20, 300);
        req.priority = if priority { prio } else { 0 };
        receivers.push(rx);
        sub.accept(Inbound::Admit(req));
    }
    let (_, done) = step_all(&mut sub, 5000);
    for mut rx in receivers {
        assert_eq!(outcome(&mut rx), Ok(300), "every request completes");
    }
    assert_eq!(sub.kv_used_blocks(), 0);
    let preempted = metrics.preemptions.with_label_values(&["quick"]).get();
    assert!(preempted >= 2, "{preempted} preemptions counted");
    done
}

#[test]
fn priority_preemption_takes_the_highest_value_first() {
    let p = common::pair();
    // The oldest request has the lowest priority: it gives way, the most urgent runs on.
    assert_eq!(preemption_order(&p, true), [2, 3, 1]);
    // First come, first served: the newest gives way.
    assert_eq!(preemption_order(&p, false), [1, 2, 3]);
}

#[test]
fn queued_requests_give_up_their_kv_before_the_running_one_fails() {
    let p = common::pair();
    let (mut sub, _) = sub_server(&p, 1, false, &[2, 3]);

    // B and C prefill here (7 blocks each) and leave for model 1, their KV pending here.
    let (b, mut b_rx) = request(2, 100, 10);
    let (c, mut c_rx) = request(3, 100, 10);
    let mut returned = Vec::new();
    for req in [b, c] {
        sub.accept(Inbound::Admit(req));
        let (away, done) = step_all(&mut sub, 1);
        assert!(done.is_empty());
        returned.extend(away);
    }
    assert_eq!(returned.len(), 2);
    assert_eq!(sub.kv_used_blocks(), 14);

    // A runs alone until the cache is full, then B and C come back: the batch (of one) is
    // full, so they queue holding their KV while A needs more blocks (27 in the end).
    let (a, mut a_rx) = request(1, 20, 400);
    sub.accept(Inbound::Admit(a));
    let mut steps = 0;
    while sub.kv_used_blocks() < 32 {
        let (away, done) = step_all(&mut sub, 1);
        assert!(away.is_empty() && done.is_empty(), "A runs on");
        steps += 1;
        assert!(steps < 400, "the cache never filled");
    }
    for req in returned {
        sub.accept(Inbound::Admit(req));
    }
    let (away, done) = step_all(&mut sub, 2000);
    assert!(away.is_empty());
    assert_eq!(outcome(&mut a_rx), Ok(400), "the running request completes");
    // B and C recompute their KV once A is done and finish too (one token was dropped
    // at the hand-off, and model 1 wrote nothing meanwhile).
    assert!(outcome(&mut b_rx).is_ok());
    assert!(outcome(&mut c_rx).is_ok());
    assert_eq!(done.len(), 3);
    assert_eq!(sub.kv_used_blocks(), 0, "all KV freed");
}
