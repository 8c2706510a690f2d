//! Prompt scoring (`GenerateRequest::prompt_logprobs`, what `echo` with `logprobs` asks
//! for): the scores equal the runtime's own log-softmax at every prompt position, in
//! chunks or not, with the prefix cache holding the prompt or not; the answer after them
//! is the one an unscored request gets; a routed request cannot ask for them.

mod common;

use common::*;
use std::time::Duration;
use tokenrouter_api::{Backend, GenerateEvent, GenerateRequest, SubmitError, TokenEvent};
use tokenrouter_runtime::sampling::log_softmax;
use tokenrouter_runtime::{load_model, LoadOptions, Row, StepOptions};

/// Ids the synthetic tokenizer has (bytes, merges, ChatML and FIM specials): the rest of the
/// model's vocabulary is padding, never sampled.
fn limit() -> usize {
    tokenrouter_runtime::synth::token_table().len()
}

/// A request's prompt scores (if sent) and output tokens.
async fn scored(
    e: &tokenrouter_engine::Engine,
    req: GenerateRequest,
) -> (Option<Vec<TokenEvent>>, Vec<u32>) {
    let mut s = e.submit(req).unwrap();
    let (mut scores, mut ids) = (None, Vec::new());
    while let Some(ev) = s.events.recv().await {
        match ev {
            GenerateEvent::Prompt(p) => {
                assert!(ids.is_empty(), "prompt scores after a token");
                assert!(scores.replace(p).is_none(), "prompt scores sent twice");
            }
            GenerateEvent::Token(t) => ids.push(t.id),
            GenerateEvent::Finished { .. } => break,
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
        }
    }
    (scores, ids)
}

/// Log-softmax at every prompt position from the runtime alone, the prompt in passes of
/// `chunk` tokens (the engine scores in passes of 128: a pass's attention kernel depends on
/// its length, so other splits differ in the last digits).
fn reference(model: &std::path::Path, prompt: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut m = load_model(model, &LoadOptions::default()).unwrap();
    let opts = StepOptions {
        want_hidden: false,
        all_logits: true,
    };
    let mut out = Vec::new();
    for part in prompt.chunks(chunk) {
        let rows = m
            .runner
            .step(&[Row::new(1, part.to_vec())], opts)
            .unwrap()
            .logits_rows()
            .unwrap();
        out.extend(rows.iter().map(|l| log_softmax(&l[..limit()])));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_scores_are_the_models_log_softmax_and_leave_the_answer_alone() {
    let p = pair();
    let e = start(config(&p, "slm_only", "{}", "slm_only", "", "async"));
    // Longer than two scoring passes (128 tokens each), so the prompt is scored in three.
    for (len, model, path) in [(300, 0, &p.small), (7, 1, &p.large), (1, 0, &p.small)] {
        let pr = prompt(len, len as u32);
        let want = reference(path, &pr, 128);
        let whole = reference(path, &pr, pr.len());
        let mut plain = greedy_request(pr.clone(), 6);
        plain.pinned_model = Some(model);
        let mut asked = plain.clone();
        asked.prompt_logprobs = Some(3);
        // Twice: the second time the prefix cache holds the prompt from the first.
        for round in 0..2 {
            let (scores, ids) = scored(&e, asked.clone()).await;
            let scores = scores.expect("no prompt scores");
            assert_eq!(scores.len(), len - 1, "len {len}, round {round}");
            for (i, s) in scores.iter().enumerate() {
                // Position i's distribution scores token i + 1.
                let lp = &want[i];
                assert_eq!(s.id, pr[i + 1]);
                assert_eq!(s.source, model);
                let one_pass = whole[i][s.id as usize];
                assert!(
                    (s.logprob - one_pass).abs() < 0.05,
                    "{} vs {one_pass}",
                    s.logprob
                );
                assert!(
                    (s.logprob - lp[s.id as usize]).abs() < 1e-5,
                    "len {len}, position {i}: {} vs {}",
                    s.logprob,
                    lp[s.id as usize]
                );
                assert_eq!(s.top_logprobs.len(), 3);
                // vLLM's rank: one more than the count of more likely tokens (ties within
                // the tolerance of the two computations aside).
                let own = lp[s.id as usize];
                let above = |eps: f32| lp.iter().filter(|&&x| x > own + eps).count() as u32;
                let rank = s.rank.expect("a prompt score has a rank");
                assert!(
                    above(1e-4) < rank && rank <= above(-1e-4) + 1,
                    "rank {rank}"
                );
                let best = lp.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                assert!((s.top_logprobs[0].1 - best).abs() < 1e-4);
                assert!(s.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
            }
            let (none, plain_ids) = scored(&e, plain.clone()).await;
            assert!(none.is_none(), "scores that were not asked for");
            assert_eq!(ids, plain_ids, "len {len}: scoring changed the answer");
            assert_eq!(ids.len(), 6);
        }
    }
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_request_cannot_ask_for_prompt_scores() {
    let p = pair();
    let e = start(config(&p, "slm_only", "{}", "slm_only", "", "async"));
    let mut req = greedy_request(prompt(5, 1), 3);
    req.prompt_logprobs = Some(0);
    match e.submit(req) {
        Err(SubmitError::InvalidField { param, message }) => {
            assert_eq!(param, "prompt_logprobs");
            assert!(message.contains("pin"), "{message}");
        }
        other => panic!("expected a 400, got {:?}", other.map(|_| ())),
    }
    e.shutdown();
}
