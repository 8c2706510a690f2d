//! llama.cpp's sampler chain on the tiny pair, through the real engine: DRY holds
//! whichever model writes a position (the sampler's window follows the request from model
//! to model), greedy and sampled; XTC and the other samplers run to the end; sequence
//! breakers given as text resolve in the served vocabulary; llama.cpp's `ignore_eos` never
//! draws an end id.

mod common;

use common::*;
use tokenrouter_api::{DryParams, GenerateRequest, LlamaChain, SamplingParams};

/// Output positions whose token made a three-token sequence the context already held.
fn repeats(prompt: &[u32], output: &[u32]) -> usize {
    let all: Vec<u32> = prompt.iter().chain(output).copied().collect();
    (prompt.len().max(2)..all.len())
        .filter(|&i| (2..i).any(|j| all[j - 2..=j] == all[i - 2..=i]))
        .count()
}

fn dry(multiplier: f32, breakers: &[&str]) -> LlamaChain {
    LlamaChain {
        dry: Some(DryParams {
            multiplier,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: None,
            sequence_breakers: breakers.iter().map(|s| s.to_string()).collect(),
        }),
        ..LlamaChain::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_holds_whichever_model_writes() {
    let (_pair, e) = routed_pair();
    let (mut without, mut both_models) = (0, 0);
    for salt in 0..4u32 {
        // A short prompt repeated: the tiny models, greedy, fall into loops.
        let p: Vec<u32> = prompt(4, salt).repeat(3);
        for temperature in [0.0, 1.0] {
            let plain = GenerateRequest {
                sampling: SamplingParams {
                    temperature,
                    seed: Some(u64::from(salt)),
                    ..SamplingParams::default()
                },
                ..greedy_request(p.clone(), 40)
            };
            let (ids, _) = run(&e, plain.clone()).await;
            without += repeats(&p, &ids);
            let mut with_dry = plain;
            with_dry.sampling.llama = Some(dry(100.0, &[]));
            let (ids, sources) = run(&e, with_dry).await;
            assert_eq!(repeats(&p, &ids), 0, "salt {salt} t {temperature}: {ids:?}");
            both_models += usize::from(sources.contains(&0) && sources.contains(&1));
        }
    }
    // The check can fail: without DRY the same requests repeat themselves.
    assert!(
        without > 0,
        "no repeats without DRY: the test shows nothing"
    );
    assert!(both_models > 0, "no answer written by both models");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_llama_cpp_sampler_runs_and_breakers_resolve() {
    let (_pair, e) = routed_pair();
    let chain = LlamaChain {
        typical_p: 0.9,
        top_n_sigma: 2.0,
        xtc_probability: 0.5,
        xtc_threshold: 0.05,
        dynatemp_range: 0.5,
        ..dry(0.8, &["\n", "ab", ":"])
    };
    for (temperature, top_k) in [(0.0, 0), (0.8, 40), (1.0, 0)] {
        let req = GenerateRequest {
            sampling: SamplingParams {
                temperature,
                top_k,
                seed: Some(5),
                llama: Some(chain.clone()),
                ..SamplingParams::default()
            },
            ..greedy_request(prompt(9, 1), 24)
        };
        let (ids, _) = run(&e, req.clone()).await;
        assert_eq!(ids.len(), 24);
        // A seeded request draws the same tokens again.
        assert_eq!(run(&e, req).await.0, ids);
    }
}

/// llama.cpp's `ignore_eos` (`ban_eos`): an end-of-generation id the bias pushes to the top
/// is never drawn, by either model; with vLLM's `ignore_eos` alone it is drawn and the answer
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_cpp_ignore_eos_never_draws_an_end_id() {
    let (_pair, e) = routed_pair();
    let eos = tokenrouter_runtime::synth::eos_id();
    let pushed = |ban_eos: bool| GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(eos, 50.0)],
            ban_eos,
            ..SamplingParams::default()
        },
        ..greedy_request(prompt(9, 2), 16)
    };
    let (ids, _) = run(&e, pushed(false)).await;
    assert!(ids.contains(&eos), "{ids:?}");
    let (ids, sources) = run(&e, pushed(true)).await;
    assert!(!ids.contains(&eos), "{ids:?}");
    assert!(sources.contains(&0) && sources.contains(&1), "{sources:?}");
}
