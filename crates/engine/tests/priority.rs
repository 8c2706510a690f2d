//! vLLM's priority scheduling through the engine's config (`system.scheduling_policy:
//! priority`): with a batch of one, the requests queued behind a running one finish lowest
//! `priority` first. (The queue order and the preemption choice, step by step, are in
//! `kv_pressure.rs`; the refusal of a priority under first come, first served in
//! `faults.rs`.)

mod common;

use std::sync::{Arc, Mutex};

use common::{greedy_request, pair, prompt, start};
use tokenrouter_api::{Backend, GenerateEvent};
use tokenrouter_engine::EngineConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_finish_by_priority() {
    let p = pair();
    let file = common::config_file(&p, "slm_only", "{}", "slm_only", "", "async");
    let yaml = std::fs::read_to_string(&file).unwrap().replace(
        "system:\n",
        "system:\n  max_batch_size: 1\n  scheduling_policy: priority\n",
    );
    std::fs::write(&file, yaml).unwrap();
    let e = start(EngineConfig::from_file(&file).unwrap());

    // A long request runs first; the others queue behind it (a batch of one).
    let mut first = e.submit(greedy_request(prompt(20, 1), 480)).unwrap();
    assert!(matches!(
        first.events.recv().await,
        Some(GenerateEvent::PromptCached(_) | GenerateEvent::Token(_))
    ));
    let finished = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, priority) in [("b", 5), ("c", -1), ("d", 3), ("e", 5)] {
        let mut req = greedy_request(prompt(20, 2), 4);
        req.priority = priority;
        let mut s = e.submit(req).unwrap();
        let finished = finished.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(ev) = s.events.recv().await {
                match ev {
                    GenerateEvent::Finished { .. } => break,
                    GenerateEvent::Error(m) => panic!("{name} failed: {m}"),
                    _ => {}
                }
            }
            finished.lock().unwrap().push(name);
        }));
    }
    while let Some(ev) = first.events.recv().await {
        if matches!(ev, GenerateEvent::Finished { .. }) {
            break;
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*finished.lock().unwrap(), ["c", "d", "b", "e"]);
    e.shutdown();
}
