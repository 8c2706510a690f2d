//! Start-up latency profile for `delayed_batching_threshold: auto` (what vLLM-style engines
//! do before serving): each model alone times decode steps of a few batch sizes on a short
//! dummy context, so the online tuner plans from a measured latency curve from the first
//! request instead of extrapolating from the few batch sizes it happened to observe. Then all
//! models step at once for a moment, which measures how much they slow each other down
//! (`sharing`: ~1 for models on the same CPU cores, ~0 on separate devices). The dummy
//! sequences use ids no request can have and are freed afterwards.

use crate::subserver::SubServer;
use std::sync::Barrier;
use std::time::{Duration, Instant};
use tokenrouter_runtime::{Row, Runner, RuntimeError, SeqId, StepOptions};

/// How long all models step together to measure contention, at least: long enough for
/// `OVERLAP_STEPS` solo batch-1 steps of the slowest model, twice (they run slower together).
const OVERLAP_WINDOW: Duration = Duration::from_millis(400);
const OVERLAP_STEPS: f64 = 3.0;
/// Largest contention factor believed (a measurement above it is noise or a stall).
const MAX_SHARING: f64 = 2.0;

/// What the start-up profile measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// Per model: (batch, median solo step ms).
    pub step_ms: Vec<Vec<(usize, f64)>>,
    /// Contention: with k models in a step at once, each runs at 1/(1 + sharing·(k−1)) of its
    /// solo speed (the planner's `PlanInput::sharing`).
    pub sharing: f64,
}

/// Profiles every model alone, then their contention; logs both. Leaves every KV cache empty.
pub fn profile_models(subs: &mut [SubServer]) -> Profile {
    let started = Instant::now();
    let step_ms: Vec<Vec<(usize, f64)>> = subs.iter_mut().map(|s| s.profile_latency()).collect();
    let mut sharing = 0.0;
    if subs.len() >= 2 {
        let slowest = step_ms
            .iter()
            .filter_map(|t| t.iter().find(|&&(b, _)| b == 1).map(|&(_, ms)| ms))
            .fold(0.0, f64::max);
        let window = OVERLAP_WINDOW.max(Duration::from_secs_f64(
            2.0 * OVERLAP_STEPS * slowest / 1000.0,
        ));
        let barrier = Barrier::new(subs.len());
        let overlapped: Vec<Option<f64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = subs
                .iter_mut()
                .map(|s| {
                    let barrier = &barrier;
                    scope.spawn(move || s.profile_overlapped(barrier, window))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().ok().flatten())
                .collect()
        });
        let slowdowns: Vec<f64> = overlapped
            .iter()
            .zip(&step_ms)
            .filter_map(|(o, solo)| {
                let solo1 = solo.iter().find(|&&(b, _)| b == 1)?.1;
                Some(o.as_ref()? / solo1)
            })
            .collect();
        if slowdowns.len() == subs.len() {
            sharing = sharing_from_slowdowns(&slowdowns);
        }
        tracing::info!(
            ?slowdowns,
            sharing,
            "contention between models measured (all stepping at once)"
        );
    }
    tracing::info!(
        took_s = started.elapsed().as_secs_f64(),
        "start-up latency profile done"
    );
    Profile { step_ms, sharing }
}

/// The contention factor of `slowdowns` measured with all `k = slowdowns.len()` models busy.
/// The planner's model is symmetric (each busy model runs `1 + sharing·(k − 1)` times slower
/// than alone); real contention is not: CPU models taking turns slow the short steps more
/// than the long ones, and on one GPU the small model's many short kernels hold the SMs
/// while the large model nearly stalls. What the symmetric model must get right is the work
/// done per second by all models together, `Σ 1/slowdown`, so `sharing` matches that
/// (the harmonic mean of the slowdowns), clamped.
pub fn sharing_from_slowdowns(slowdowns: &[f64]) -> f64 {
    let k = slowdowns.len();
    if k < 2 {
        return 0.0;
    }
    let rate: f64 = slowdowns.iter().map(|s| 1.0 / s).sum();
    let s = (k as f64 / rate - 1.0) / (k - 1) as f64;
    if s.is_finite() {
        s.clamp(0.0, MAX_SHARING)
    } else {
        0.0
    }
}

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
                    runner
                        .step(&rows, opts)
                        .and_then(|o| o.wait())
                        .map(|_| t.elapsed().as_secs_f64())
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

/// Mean ms of one-token steps of a single dummy sequence while every other model does the
/// same: all start at `barrier` and step for `window`; only steps that end inside the window
/// count (until then every model is certainly busy). `None` without such a step.
pub fn overlapped_decode(
    runner: &mut Runner,
    opts: StepOptions,
    barrier: &Barrier,
    window: Duration,
    turn: Option<&crate::turn::TurnLock>,
) -> Result<Option<f64>, RuntimeError> {
    let seq = dummy_seq(0);
    let vocab = runner.config().vocab_size.max(1) as u32;
    let prefill = runner.step(&[Row::new(seq, vec![100 % vocab; PROMPT_TOKENS])], opts);
    // Every model must reach the barrier, also after an error.
    barrier.wait();
    let start = Instant::now();
    let deadline = start + window;
    let result = prefill.and_then(|_| {
        let room = runner.max_len().saturating_sub(PROMPT_TOKENS + 1);
        let mut times = Vec::new();
        while Instant::now() < deadline && times.len() < room {
            let t = Instant::now();
            {
                // Models that take turns in serving take them here too.
                let _turn = turn.map(|t| t.acquire());
                runner
                    .step(&[Row::new(seq, vec![101 % vocab])], opts)?
                    .wait()?;
            }
            let end = Instant::now();
            if end <= deadline {
                times.push((end - t).as_secs_f64() * 1000.0);
            }
        }
        Ok(if times.is_empty() {
            None
        } else {
            Some(times.iter().sum::<f64>() / times.len() as f64)
        })
    });
    runner.free(seq);
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

    #[test]
    fn sharing_matches_the_combined_work_rate() {
        assert_eq!(sharing_from_slowdowns(&[2.0]), 0.0);
        assert!((sharing_from_slowdowns(&[2.0, 2.0]) - 1.0).abs() < 1e-12);
        assert!((sharing_from_slowdowns(&[1.0, 1.0]) - 0.0).abs() < 1e-12);
        // Turns: a 10 ms and a 30 ms step alternate: 4x and 1.33x slower, one processor's
        // worth of work in all (1/4 + 3/4 = 1): processor sharing.
        assert!((sharing_from_slowdowns(&[4.0, 4.0 / 3.0]) - 1.0).abs() < 1e-12);
        // One model barely slowed, the other stalled: worse than processor sharing.
        assert!(sharing_from_slowdowns(&[1.1, 50.0]) > 1.0);
        // Three models, each 2x slower: half of a processor-sharing slowdown.
        assert!((sharing_from_slowdowns(&[2.0, 2.0, 2.0]) - 0.5).abs() < 1e-12);
        assert_eq!(sharing_from_slowdowns(&[0.5, 0.9]), 0.0);
        assert_eq!(sharing_from_slowdowns(&[9.0, 9.0]), MAX_SHARING);
        assert_eq!(sharing_from_slowdowns(&[f64::NAN, 1.0]), 0.0);
    }
}
