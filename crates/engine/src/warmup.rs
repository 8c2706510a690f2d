//! Warm-up before the engine reports ready: a few short requests through every model and
//! through the routing policy, so first-use costs are paid at start-up instead of by the
//! first clients. On a GPU these are large: the driver compiles each kernel module from PTX
//! the first time a process on the machine loads it (H200, 2026-11-30: the first routed
//! requests on a fresh machine stalled ~16 s, a 5-step benchmark process took 25 s).
//! What the warm-up leaves behind (step latencies, routing counts, metrics of its own
//! requests) is reset so the tuner and `/metrics` start from the clients' traffic.

use crate::engine::{Engine, EngineError};
use crate::subserver::Shared;
use std::time::Instant;
use tokenrouter_api::{GenerateEvent, GenerateRequest, GenerateStream, SamplingParams};

/// Prompt tokens of a warm-up request: longer than the 64-token rows the GPU attention
/// kernels take, so the long-prefill path runs too.
const PROMPT_TOKENS: usize = 96;
/// Tokens each warm-up request generates (several decode steps, and hand-offs between models
/// for routed requests).
const MAX_TOKENS: usize = 8;
const TEXT: &str = "fn main() { let v: Vec<u64> = (0..10).map(|x| x * x).collect(); \
                    println!(\"{v:?}\"); } // warm-up ";

/// Runs one request pinned to each model and one routed request, greedy, to the end; then
/// clears what they left in the shared statistics.
pub(crate) fn warm_up(engine: &Engine, shared: &Shared) -> Result<(), EngineError> {
    let t0 = Instant::now();
    let text = engine
        .text()
        .ok_or_else(|| EngineError::Start("warm-up: no tokenizer".into()))?;
    let unit = text
        .encode(TEXT)
        .map_err(|e| EngineError::Start(format!("warm-up: {e}")))?;
    if unit.is_empty() {
        return Ok(());
    }
    let max_tokens = MAX_TOKENS
        .min(shared.context_limit.saturating_sub(1))
        .max(1);
    let prompt_len = PROMPT_TOKENS.min(shared.context_limit.saturating_sub(max_tokens));
    if prompt_len == 0 {
        return Ok(());
    }
    let prompt: Vec<u32> = unit.iter().copied().cycle().take(prompt_len).collect();
    let models = shared.names.len();
    let mut streams: Vec<GenerateStream> = Vec::new();
    for pinned in (0..models).map(Some).chain([None]) {
        let request = GenerateRequest {
            prompt_ids: prompt.clone(),
            sampling: SamplingParams {
                temperature: 0.0,
                seed: Some(0),
                ..Default::default()
            },
            max_tokens: Some(max_tokens),
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            pinned_model: pinned,
            top_logprobs: 0,
            routing: Default::default(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
            cache_salt: None,
        };
        streams.push(
            engine
                .submit_loaded(request)
                .map_err(|e| EngineError::Start(format!("warm-up: {e}")))?,
        );
    }
    for mut stream in streams {
        loop {
            match stream.events.blocking_recv() {
                Some(
                    GenerateEvent::Token(_)
                    | GenerateEvent::Prompt(_)
                    | GenerateEvent::PromptCached(_),
                ) => {}
                Some(GenerateEvent::Finished { .. }) => break,
                Some(GenerateEvent::Error(e)) => {
                    return Err(EngineError::Start(format!("warm-up request failed: {e}")))
                }
                None => {
                    return Err(EngineError::Start(
                        "warm-up: the engine stopped during the warm-up".into(),
                    ))
                }
            }
        }
    }
    reset_statistics(engine, shared);
    tracing::info!(
        took_s = t0.elapsed().as_secs_f64(),
        requests = models + 1,
        "warm-up done"
    );
    Ok(())
}

/// Forget the warm-up's step latencies (first uses are slow), routing counts and request
/// metrics.
fn reset_statistics(engine: &Engine, shared: &Shared) {
    if let Ok(mut log) = shared.latency_log.lock() {
        log.clear();
    }
    for counts in [&shared.route_counts, &shared.credit_counts] {
        if let Ok(mut c) = counts.lock() {
            c.iter_mut().flatten().for_each(|x| *x = 0);
        }
    }
    engine.reset_request_metrics();
}
