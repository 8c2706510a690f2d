//! The engine invariants on the real Qwen2.5-Coder 0.5B/1.5B pair (from `tokenrouter
//! fetch`): never routing = the small model alone, always routing = the large model alone,
//! random routing independent of concurrency, many concurrent requests, aborts, KV freed.
//! Skipped with a note when the models are not cached, unless TOKENROUTER_NO_SKIP is set
//! (scripts/test.sh sets it): then a missing model fails.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenrouter_api::Backend;
use tokenrouter_engine::EngineConfig;

fn models() -> Option<(PathBuf, PathBuf)> {
    let dir = tokenrouter_fetch::default_cache_dir().join("models");
    let s = dir.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let l = dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    if s.exists() && l.exists() {
        return Some((s, l));
    }
    assert!(
        !std::env::var("TOKENROUTER_NO_SKIP").is_ok_and(|v| !v.is_empty() && v != "0"),
        "models missing in {}",
        dir.display()
    );
    eprintln!(
        "skipping: the Qwen2.5-Coder pair is not in {} (run `tokenrouter fetch`)",
        dir.display()
    );
    None
}

fn cfg(dir: &Path, s: &Path, l: &Path, class: &str, kwargs: &str) -> EngineConfig {
    let yaml = format!(
        "model:\n  quick: {{model_path: {}, scheduler_class: {class}, scheduler_kwargs: {kwargs}, kv_cache_tokens: 8192}}\n  reference: {{model_path: {}, scheduler_class: {class}, kv_cache_tokens: 8192}}\nsystem: {{entry_model: quick}}\n",
        s.display(),
        l.display()
    );
    let f = dir.join("real.yaml");
    std::fs::write(&f, yaml).unwrap();
    EngineConfig::from_file(&f).unwrap()
}

const LIMIT: usize = 151_665;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_pair_invariants() {
    let Some((s, l)) = models() else { return };
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<Vec<u32>> = [
        "def fibonacci(n):",
        "The capital of France is",
        "fn main() {",
    ]
    .iter()
    .map(|p| {
        let m = tokenrouter_runtime::inspect(&s).unwrap().1;
        m.encode(p).unwrap()
    })
    .collect();
    let n = 12;
    let e = start(cfg(dir.path(), &s, &l, "slm_only", "{}"));
    for p in &prompts {
        assert_eq!(
            run(&e, greedy_request(p.clone(), n)).await.0,
            greedy_alone(&s, p, n, LIMIT),
            "never routing = small model alone"
        );
    }
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
    let e = start(cfg(dir.path(), &s, &l, "random", "{p: 1.0, seed: 1}"));
    for p in &prompts {
        let (ids, src) = run(&e, greedy_request(p.clone(), n)).await;
        assert_eq!(
            ids,
            greedy_alone(&l, p, n, LIMIT),
            "always routing = large model alone"
        );
        assert!(src.iter().all(|&x| x == 1));
    }
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
    // Random routing: the same per-request outputs at concurrency 1 and 8.
    let e = start(cfg(dir.path(), &s, &l, "random", "{p: 0.3, seed: 7}"));
    let reqs: Vec<_> = (0..8)
        .map(|i| {
            greedy_request(
                prompts[i % 3]
                    .iter()
                    .copied()
                    .chain([i as u32 + 100])
                    .collect(),
                10,
            )
        })
        .collect();
    let mut alone = Vec::new();
    for r in &reqs {
        alone.push(run(&e, r.clone()).await);
    }
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| {
            let (e, r) = (e.clone(), r.clone());
            tokio::spawn(async move { run(&e, r).await })
        })
        .collect();
    for (h, a) in handles.into_iter().zip(&alone) {
        assert_eq!(&h.await.unwrap(), a, "concurrency 8 = concurrency 1");
    }
    assert!(
        alone.iter().flat_map(|(_, s)| s).any(|&x| x == 1),
        "the large model wrote some tokens"
    );
    assert_all_free(&e, Duration::from_secs(5));
    // 64 concurrent requests with mixed lengths all complete.
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let e = e.clone();
            let mut p = prompts[i % 3].clone();
            p.extend((0..(i % 7) as u32).map(|k| 100 + k));
            tokio::spawn(async move { run(&e, greedy_request(p, 2 + i % 4)).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().0.len(), 2 + i % 4);
    }
    assert_all_free(&e, Duration::from_secs(5));
    // Abort mid-flight frees KV on both models.
    let mut st = e.submit(greedy_request(prompts[0].clone(), 200)).unwrap();
    for _ in 0..6 {
        st.events.recv().await;
    }
    drop(st);
    assert_all_free(&e, Duration::from_secs(10));
}
