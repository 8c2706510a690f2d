//! vLLM's token restrictions on the tiny pair (`SamplingParams::min_tokens`,
//! `allowed_token_ids`, `bad_words`): they hold whichever model writes a position — routed
//! (both models writing), pinned, greedy and sampled — and bad values are refused at
//! submission, naming the field.

mod common;

use common::*;
use tokenrouter_api::{
    Backend, FinishReason, GenerateEvent, GenerateRequest, SamplingParams, SubmitError,
};
use tokenrouter_engine::Engine;

/// The tokens a request wrote, their sources and its finish.
async fn answer(e: &Engine, req: GenerateRequest) -> (Vec<u32>, Vec<usize>, FinishReason) {
    let mut s = e.submit(req).unwrap();
    let (mut ids, mut sources) = (Vec::new(), Vec::new());
    loop {
        match s.events.recv().await.expect("the request ends") {
            GenerateEvent::Token(t) => {
                ids.push(t.id);
                sources.push(t.source);
            }
            GenerateEvent::Finished { reason } => return (ids, sources, reason),
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
            GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
        }
    }
}

/// Every way a request is served here: routed greedy, routed sampled, pinned to the large
/// model sampled.
fn variants(salt: u32, sampling: SamplingParams) -> Vec<GenerateRequest> {
    [(None, 0.0), (None, 1.0), (Some(1), 1.0)]
        .into_iter()
        .map(|(pinned, temperature)| GenerateRequest {
            sampling: SamplingParams {
                temperature,
                seed: Some(u64::from(salt)),
                ..sampling.clone()
            },
            pinned_model: pinned,
            ..greedy_request(prompt(9, salt), 24)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restrictions_hold_whichever_model_writes() {
    let (_pair, e) = routed_pair();
    let mut both_models = 0;
    for salt in 0..4u32 {
        // A stop id the models are pushed to write at once: without min_tokens the answer
        // is that id alone; with it, min_tokens other ids come first.
        let stop = 40 + salt;
        let pushed = SamplingParams {
            logit_bias: vec![(stop, 100.0)],
            ..Default::default()
        };
        for mut req in variants(salt, pushed.clone()) {
            req.stop_token_ids = vec![stop];
            let (ids, _, reason) = answer(&e, req.clone()).await;
            assert_eq!((ids, reason), (vec![stop], FinishReason::Stop));
            req.sampling.min_tokens = 6;
            let (ids, sources, reason) = answer(&e, req).await;
            assert_eq!(ids.len(), 7, "{ids:?}");
            assert!(!ids[..6].contains(&stop) && ids[6] == stop, "{ids:?}");
            assert_eq!(reason, FinishReason::Stop);
            both_models += usize::from(sources.contains(&0) && sources.contains(&1));
        }

        let only: Vec<u32> = (0..5).map(|i| 60 + 17 * i + salt).collect();
        let restricted = SamplingParams {
            allowed_token_ids: Some(only.clone()),
            ..Default::default()
        };
        for req in variants(salt, restricted) {
            let (ids, _, _) = answer(&e, req).await;
            assert_eq!(ids.len(), 24);
            assert!(
                ids.iter().all(|id| only.contains(id)),
                "{ids:?} not in {only:?}"
            );
        }

        // `a` is pushed at every position: a bad word `a a` makes every other token
        // something else; the bad word `b`, pushed as hard, never appears.
        let (a, b) = (90 + salt, 120 + salt);
        let pushed = SamplingParams {
            logit_bias: vec![(a, 100.0), (b, 100.0)],
            bad_words: vec![vec![a, a], vec![b]],
            ..Default::default()
        };
        for req in variants(salt, pushed) {
            let (ids, _, _) = answer(&e, req).await;
            assert!(!ids.contains(&b), "{ids:?}");
            assert!(ids.windows(2).all(|w| w != [a, a]), "{ids:?}");
            assert_eq!(ids.iter().filter(|&&t| t == a).count(), 12, "{ids:?}");
        }
    }
    assert!(
        both_models > 0,
        "no min_tokens answer was written by both models"
    );
    assert_all_free(&e, std::time::Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_restrictions_are_refused_naming_the_field() {
    let p = pair();
    let e = start(config(&p, "random", "{p: 0.5}", "random", "", "async"));
    let limit = e.shared().unwrap().sample_limit as u32;
    let refused = |sampling: SamplingParams| {
        let req = GenerateRequest {
            sampling,
            ..greedy_request(prompt(5, 1), 8)
        };
        match e.submit(req) {
            Err(SubmitError::InvalidField { param, .. }) => param,
            Err(other) => panic!("refused without naming the field: {other}"),
            Ok(_) => panic!("accepted"),
        }
    };
    let cases = [
        (
            SamplingParams {
                allowed_token_ids: Some(vec![]),
                ..Default::default()
            },
            "allowed_token_ids",
        ),
        (
            SamplingParams {
                allowed_token_ids: Some(vec![3, limit]),
                ..Default::default()
            },
            "allowed_token_ids",
        ),
        (
            SamplingParams {
                bad_words: vec![vec![3], vec![]],
                ..Default::default()
            },
            "bad_words",
        ),
        (
            SamplingParams {
                bad_words: vec![vec![limit + 5]],
                ..Default::default()
            },
            "bad_words",
        ),
        (
            SamplingParams {
                bad_words: vec![vec![1; 5000]],
                ..Default::default()
            },
            "bad_words",
        ),
        (
            SamplingParams {
                min_tokens: 9,
                ..Default::default()
            },
            "min_tokens",
        ),
    ];
    for (sampling, param) in cases {
        assert_eq!(refused(sampling), param);
    }
}
