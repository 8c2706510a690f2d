//! Start-up latency profile for `delayed_batching_threshold: auto` (what vLLM-style engines
//! do before serving): each model times decode steps of a few batch sizes on a short dummy
//! context, so the online tuner plans from a measured latency curve from the first request
//! instead of extrapolating from the few batch sizes it happened to observe. The dummy
//! sequences use ids no request can have and are freed afterwards.

use std::time::Instant;
use tokenrouter_runtime::{Row, Runner, RuntimeError, SeqId, StepOptions};

/// Batch sizes profiled (capped by `max_batch_size` and the KV capacity).
pub const PROFILE_BATCHES: [usize; 4] = [1, 2, 4, 8];
/// Tokens of the dummy prompt every profiled sequence starts with.
const PROMPT_TOKENS: usize = 2;
/// Timed decode steps per batch size (the median counts).
const TIMED_STEPS: usize = 3;

/// Request ids count up from 1; the dummy sequences count down from the top.
fn dummy_seq(i: usize) -> SeqId {
    SeqId::MAX - i as SeqId
}

/// Batch sizes of [`PROFILE_BATCHES`] that fit `max_batch` and `free_blocks` blocks of
/// `block_size` tokens when every sequence grows to `seq_tokens`.
pub fn profile_sizes(
    max_batch: usize,
    free_blocks: usize,
    block_size: usize,
    seq_tokens: usize,
) -> Vec<usize> {
    let per_seq = seq_tokens.div_ceil(block_size.max(1)).max(1);
    let fit = free_blocks / per_seq;
    PROFILE_BATCHES
        .iter()
        .copied()
        .filter(|&b| b <= max_batch && b <= fit)
        .collect()
}

/// Median step time (ms) of decode batches of each profiled size: a prefill of
/// `PROMPT_TOKENS` per sequence (untimed; it also warms the weights up), then per size
/// `TIMED_STEPS` one-token steps over the first `b` sequences. Every dummy sequence is freed before
/// returning, also on error.
pub fn decode_latency(
    runner: &mut Runner,
    max_batch: usize,
    opts: StepOptions,
) -> Result<Vec<(usize, f64)>, RuntimeError> {
    let usage = runner.usage();
    let steps = PROFILE_BATCHES.len() * TIMED_STEPS;
    let sizes = profile_sizes(
        max_batch,
        usage.total_blocks - usage.used_blocks,
        usage.block_size,
        PROMPT_TOKENS + steps,
    );
    let Some(&largest) = sizes.last() else {
        return Ok(Vec::new());
    };
    let vocab = runner.config().vocab_size.max(1) as u32;
    let token = |i: usize| (100 + 7 * i as u32) % vocab;
    let result = (|| {
        let prefill: Vec<Row> = (0..largest)
            .map(|i| {
                Row::new(
                    dummy_seq(i),
                    (0..PROMPT_TOKENS).map(|k| token(i + k)).collect(),
                )
            })
            .collect();
        runner.step(&prefill, opts)?;
        let mut out = Vec::with_capacity(sizes.len());
        for &b in &sizes {
            let rows: Vec<Row> = (0..b)
                .map(|i| Row::new(dummy_seq(i), vec![token(i)]))
                .collect();
            let mut times: Vec<f64> = (0..TIMED_STEPS)
                .map(|_| {
                    let t = Instant::now();
                    runner.step(&rows, opts).map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<Result<_, _>>()?;
            times.sort_by(f64::total_cmp);
            out.push((b, times[times.len() / 2] * 1000.0));
        }
        Ok(out)
    })();
    for i in 0..largest {
        runner.free(dummy_seq(i));
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_capped_by_batch_and_kv() {
        assert_eq!(profile_sizes(64, 1000, 16, 20), vec![1, 2, 4, 8]);
        assert_eq!(profile_sizes(3, 1000, 16, 20), vec![1, 2]);
        // 20 tokens need 2 blocks of 16: 9 blocks hold 4 sequences.
        assert_eq!(profile_sizes(64, 9, 16, 20), vec![1, 2, 4]);
        assert!(profile_sizes(64, 1, 16, 20).is_empty());
    }
}
