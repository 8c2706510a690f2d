//! Monte-Carlo simulation of the delayed-batching model, tick by tick, with the shared rules of
//! [`crate::rules`]: an independent cross-check of the exact solver (which jumps between epochs and
//! uses expected rewards, while this samples every request's route and credits actual tokens).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::input::{PlanError, PlanInput, Result};
use crate::rules::Rules;

/// Simulates `ticks` ticks of progress from the initial state and returns the measured tokens per
/// second of wall-clock time.
pub fn simulate(input: &PlanInput, thresholds: &[usize], ticks: u64, seed: u64) -> Result<f64> {
    input.validate()?;
    if thresholds.len() != input.models() {
        return Err(PlanError::ThresholdCount {
            got: thresholds.len(),
            expected: input.models(),
        });
    }
    if ticks == 0 {
        return Err(PlanError::Argument(
            "simulate needs at least one tick".into(),
        ));
    }
    let rules = Rules::new(input, thresholds);
    let mut rng = StdRng::seed_from_u64(seed);
    let cumulative: Vec<Vec<f64>> = input
        .routing
        .iter()
        .map(|row| {
            row.iter()
                .scan(0.0, |acc, p| {
                    *acc += p;
                    Some(*acc)
                })
                .collect()
        })
        .collect();
    let last_positive: Vec<usize> = input
        .routing
        .iter()
        .map(|row| row.iter().rposition(|&p| p > 0.0).unwrap_or(0))
        .collect();
    let mut s = rules.initial(input.concurrency);
    let mut tokens = 0.0;
    // Wall-clock time in ticks: a tick of progress lasts `dilation(busy)` (shared processor).
    let mut wall = 0.0;
    for _ in 0..ticks {
        wall += input.dilation((0..rules.models).filter(|&m| s.r[m] > 0).count());
        let mut arrivals = [0u8; crate::input::MAX_MODELS];
        for m in 0..rules.models {
            if s.r[m] == 0 {
                continue;
            }
            s.r[m] -= 1;
            if s.r[m] > 0 {
                continue;
            }
            for _ in 0..s.b[m] {
                let u: f64 = rng.random();
                let j = cumulative[m]
                    .iter()
                    .position(|&c| u < c)
                    .unwrap_or(last_positive[m]);
                let j = if input.routing[m][j] > 0.0 {
                    j
                } else {
                    last_positive[m]
                };
                tokens += input.credits[m][j];
                arrivals[j] += 1;
            }
            s.b[m] = 0;
        }
        for j in 0..rules.models {
            s.q[j] += arrivals[j];
        }
        rules.start_phase(&mut s);
    }
    Ok(tokens / (wall * input.delta_ms) * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::Latency;

    #[test]
    fn one_model_is_deterministic() {
        let input = PlanInput {
            latencies: vec![Latency::Constant(2.0)],
            routing: vec![vec![1.0]],
            credits: vec![vec![1.0]],
            delta_ms: 0.5,
            concurrency: 3,
            sharing: 0.0,
        };
        // 3 tokens every 4 ticks of 0.5 ms
        let x = simulate(&input, &[1], 4000, 1).expect("simulate");
        assert!((x - 1500.0).abs() < 1e-9, "{x}");
    }

    #[test]
    fn threshold_count_is_checked() {
        let input = PlanInput {
            latencies: vec![Latency::Constant(2.0)],
            routing: vec![vec![1.0]],
            credits: vec![vec![1.0]],
            delta_ms: 0.5,
            concurrency: 3,
            sharing: 0.0,
        };
        assert!(matches!(
            simulate(&input, &[1, 2], 10, 1),
            Err(PlanError::ThresholdCount { .. })
        ));
    }
}
