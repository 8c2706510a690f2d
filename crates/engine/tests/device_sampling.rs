//! Rows drawn where the logits are (`runtime.sampling: device`, what a GPU does by
//! default), run here on the CPU: a seeded request writes the same tokens alone and beside
//! a row the host samples (more top logprobs than the device reports), penalised and greedy
//! rows, so the per-row split never leaks between requests; top-k 1 is greedy; greedy
//! penalised rows and top logprobs are what the host sampler gives.

mod common;

use common::*;
use tokenrouter_api::{Backend, GenerateEvent, GenerateRequest, SamplingParams};
use tokenrouter_engine::Engine;
use tokenrouter_runtime::sampling::race;

/// Both models drawing on the "device" (else the host), routing at random (p = 0.5).
fn engine(p: &Pair, sampling: &str) -> Engine {
    let runtime = format!("    runtime:\n      sampling: {sampling}\n");
    let yaml = format!(
        "model:\n  quick:\n    model_path: {}\n    scheduler_class: random\n    scheduler_kwargs: {{p: 0.5, seed: 3}}\n    kv_cache_tokens: 8192\n{runtime}  reference:\n    model_path: {}\n    scheduler_class: random\n    kv_cache_tokens: 8192\n{runtime}system:\n  entry_model: quick\n",
        p.small.display(),
        p.large.display()
    );
    let file = p.dir.path().join(format!("{sampling}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    start(tokenrouter_engine::EngineConfig::from_file(&file).unwrap())
}

fn sampled(salt: u32, pinned: usize) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            seed: Some(u64::from(salt) + 100),
            ..Default::default()
        },
        pinned_model: Some(pinned),
        ..greedy_request(prompt(7, salt), 20)
    }
}

/// (ids, logprobs) of a request.
async fn tokens(e: &Engine, req: GenerateRequest) -> (Vec<u32>, Vec<f32>) {
    with_top(e, req)
        .await
        .into_iter()
        .map(|(id, lp, _)| (id, lp))
        .unzip()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_row_draws_the_same_alone_and_beside_host_rows() {
    let p = pair();
    let e = engine(&p, "device");
    let mut distinct = std::collections::HashSet::new();
    for salt in 0..4u32 {
        for pinned in [0, 1] {
            let alone = tokens(&e, sampled(salt, pinned)).await;
            // Beside it: a row sampled on the host for its many top logprobs, a penalised
            // row, a greedy row.
            let mut logprobs = sampled(salt + 10, pinned);
            logprobs.top_logprobs = race::TOP_MAX + 1;
            let mut penalised = sampled(salt + 20, pinned);
            penalised.sampling.presence_penalty = 0.5;
            let greedy = GenerateRequest {
                pinned_model: Some(pinned),
                ..greedy_request(prompt(5, salt + 30), 20)
            };
            let (crowded, _, _, _) = tokio::join!(
                tokens(&e, sampled(salt, pinned)),
                tokens(&e, logprobs),
                tokens(&e, penalised),
                tokens(&e, greedy)
            );
            assert_eq!(alone.0, crowded.0, "salt {salt} pinned {pinned}");
            assert_eq!(alone.0.len(), 20);
            distinct.insert(alone.0);
        }
    }
    assert_eq!(distinct.len(), 8, "seeds gave the same answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_k_one_is_greedy_and_logprobs_are_the_models() {
    let p = pair();
    let e = engine(&p, "device");
    let limit = e.shared().unwrap().sample_limit;
    for salt in 0..3u32 {
        let want = greedy_alone(&p.small, &prompt(6, salt), 12, limit);
        let mut req = sampled(salt, 0);
        req.prompt_ids = prompt(6, salt);
        req.max_tokens = Some(12);
        req.sampling.top_k = 1;
        req.sampling.top_p = 1.0;
        let (ids, lps) = tokens(&e, req.clone()).await;
        assert_eq!(ids, want, "salt {salt}");
        // The same request sampled on the host reports the same log-probabilities.
        req.top_logprobs = race::TOP_MAX + 1;
        let (host_ids, host_lps) = tokens(&e, req).await;
        assert_eq!(host_ids, want);
        for (a, b) in lps.iter().zip(&host_lps) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

/// Events of a request: (ids, logprobs, top alternatives).
async fn with_top(e: &Engine, req: GenerateRequest) -> Vec<(u32, f32, Vec<(u32, f32)>)> {
    let mut s = e.submit(req).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.events.recv().await {
        match ev {
            GenerateEvent::Token(t) => out.push((t.id, t.logprob, t.top_logprobs)),
            GenerateEvent::Finished { .. } => break,
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
            GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_bias_and_top_logprobs_match_the_host() {
    let p = pair();
    let (device, host) = (engine(&p, "device"), engine(&p, "host"));
    for salt in 0..4u32 {
        for pinned in [0, 1] {
            let mut req = GenerateRequest {
                pinned_model: Some(pinned),
                top_logprobs: 4,
                ..greedy_request(prompt(8, salt), 16)
            };
            req.sampling.repetition_penalty = 1.4;
            req.sampling.presence_penalty = 0.6;
            req.sampling.frequency_penalty = 0.3;
            req.sampling.logit_bias = vec![(50 + salt, 1.5), (7, -2.0)];
            let (d, h) = (
                with_top(&device, req.clone()).await,
                with_top(&host, req).await,
            );
            assert_eq!(d.len(), 16);
            for ((dt, dl, dtop), (ht, hl, htop)) in d.iter().zip(&h) {
                assert_eq!(dt, ht, "salt {salt} pinned {pinned}");
                assert!((dl - hl).abs() < 1e-4, "{dl} vs {hl}");
                let ids = |t: &[(u32, f32)]| t.iter().map(|x| x.0).collect::<Vec<_>>();
                assert_eq!(ids(dtop), ids(htop));
                assert_eq!(dtop.len(), 4);
            }
        }
    }
}
