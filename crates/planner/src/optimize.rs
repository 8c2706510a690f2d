//! Exact throughput for given thresholds and the search for the best thresholds.
//!
//! Search: when at most two thresholds are free (M ≤ 2, or the others pinned) every combination of
//! B_m in 1..=N is solved (exhaustive). With three or more free thresholds the search is coordinate
//! descent: start from all ones (or, in `optimize_up_to`, from the optimum at N−1), then for each
//! model in turn try every B_m in 1..=N holding the others fixed and keep the best; repeat until a
//! full round changes nothing. This finds a coordinate-wise optimum, not necessarily the global one. Solved combinations are
//! memoised. Ties (within a relative 1e-9) keep the smaller thresholds.

use std::collections::HashMap;

use serde::Serialize;

use crate::chain::{self, MAX_STATES};
use crate::input::{PlanError, PlanInput, Result};
use crate::solve;

/// Optimal thresholds for one concurrency.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Concurrency N the plan is for.
    pub concurrency: usize,
    /// Best delayed-batching threshold B_m per model.
    pub thresholds: Vec<usize>,
    /// Predicted tokens/s with those thresholds.
    pub tokens_per_s: f64,
    /// Predicted tokens/s with every B_m = 1 (no delayed batching).
    pub baseline_tokens_per_s: f64,
}

/// Exact steady-state tokens/s of the model with the given thresholds (one per model, values above
/// N act as N, 0 acts as 1).
pub fn throughput(input: &PlanInput, thresholds: &[usize]) -> Result<f64> {
    input.validate()?;
    if thresholds.len() != input.models() {
        return Err(PlanError::ThresholdCount {
            got: thresholds.len(),
            expected: input.models(),
        });
    }
    throughput_unchecked(input, thresholds)
}

fn throughput_unchecked(input: &PlanInput, thresholds: &[usize]) -> Result<f64> {
    let chain = chain::build(input, thresholds, MAX_STATES)?;
    solve::throughput(&chain, input.delta_ms)
}

/// Memoised solver for one input; solves independent combinations on several threads.
struct Evaluator<'a> {
    input: &'a PlanInput,
    memo: HashMap<Vec<usize>, f64>,
}

impl<'a> Evaluator<'a> {
    fn new(input: &'a PlanInput) -> Self {
        Evaluator {
            input,
            memo: HashMap::new(),
        }
    }

    /// Solves every combination not yet known (in parallel) and returns their values in order.
    fn eval_all(&mut self, combos: &[Vec<usize>]) -> Result<Vec<f64>> {
        let todo: Vec<&Vec<usize>> = combos
            .iter()
            .filter(|c| !self.memo.contains_key(*c))
            .collect();
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(todo.len())
            .max(1);
        let input = self.input;
        let results: Vec<Result<(Vec<usize>, f64)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|w| {
                    let todo = &todo;
                    scope.spawn(move || {
                        todo.iter()
                            .skip(w)
                            .step_by(workers)
                            .map(|c| Ok(((*c).clone(), throughput_unchecked(input, c)?)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| match h.join() {
                    Ok(v) => v,
                    Err(_) => vec![Err(PlanError::Argument("solver thread panicked".into()))],
                })
                .collect()
        });
        for r in results {
            let (c, x) = r?;
            self.memo.insert(c, x);
        }
        Ok(combos
            .iter()
            .map(|c| self.memo.get(c).copied().unwrap_or(f64::NAN))
            .collect())
    }
}

/// `true` when `x` beats `best` by more than the tie tolerance.
fn better(x: f64, best: f64) -> bool {
    x > best + 1e-9 * best.abs().max(1e-300)
}

/// Best thresholds for `input.concurrency` (see the module docs for the search).
pub fn optimize(input: &PlanInput) -> Result<Plan> {
    optimize_pinned(input, &vec![None; input.models()])
}

/// Like [`optimize`], but `pinned[m] = Some(b)` keeps model m's threshold at `b` (e.g. pin the
/// small model at 1 to search only the large model's threshold).
pub fn optimize_pinned(input: &PlanInput, pinned: &[Option<usize>]) -> Result<Plan> {
    optimize_from(input, pinned, None)
}

fn optimize_from(
    input: &PlanInput,
    pinned: &[Option<usize>],
    start: Option<&[usize]>,
) -> Result<Plan> {
    input.validate()?;
    let m = input.models();
    let n = input.concurrency;
    if pinned.len() != m {
        return Err(PlanError::ThresholdCount {
            got: pinned.len(),
            expected: m,
        });
    }
    let mut ev = Evaluator::new(input);
    let ones = vec![1; m];
    let baseline = ev.eval_all(std::slice::from_ref(&ones))?[0];
    let ranges: Vec<Vec<usize>> = pinned
        .iter()
        .map(|p| match p {
            Some(b) => vec![*b],
            None => (1..=n).collect(),
        })
        .collect();
    let free = pinned.iter().filter(|p| p.is_none()).count();
    let (thresholds, best) = if free <= 2 {
        let mut combos: Vec<Vec<usize>> = vec![Vec::new()];
        for range in &ranges {
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    range.iter().map(move |&b| {
                        let mut c = c.clone();
                        c.push(b);
                        c
                    })
                })
                .collect();
        }
        let values = ev.eval_all(&combos)?;
        let mut best: Option<(Vec<usize>, f64)> = None;
        for (c, x) in combos.into_iter().zip(values) {
            if best.as_ref().is_none_or(|(_, v)| better(x, *v)) {
                best = Some((c, x));
            }
        }
        best.unwrap_or((ones, baseline))
    } else {
        let mut current: Vec<usize> = (0..m)
            .map(|k| match (pinned[k], start) {
                (Some(b), _) => b,
                (None, Some(s)) => s.get(k).copied().unwrap_or(1).clamp(1, n),
                (None, None) => 1,
            })
            .collect();
        let mut value = ev.eval_all(std::slice::from_ref(&current))?[0];
        loop {
            let mut changed = false;
            for model in (0..m).filter(|&k| pinned[k].is_none()) {
                let combos: Vec<Vec<usize>> = (1..=n)
                    .map(|b| {
                        let mut c = current.clone();
                        c[model] = b;
                        c
                    })
                    .collect();
                let values = ev.eval_all(&combos)?;
                for (c, x) in combos.into_iter().zip(values) {
                    if better(x, value) {
                        current = c;
                        value = x;
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
        (current, value)
    };
    Ok(Plan {
        concurrency: n,
        thresholds,
        tokens_per_s: best,
        baseline_tokens_per_s: baseline,
    })
}

/// Plans for every concurrency 1..=`max_concurrency` (coordinate descent for M ≥ 3 starts from the
/// previous concurrency's optimum).
pub fn optimize_up_to(input: &PlanInput, max_concurrency: usize) -> Result<Vec<Plan>> {
    optimize_up_to_pinned(input, max_concurrency, &vec![None; input.models()])
}

/// [`optimize_up_to`] with some thresholds pinned (see [`optimize_pinned`]).
pub fn optimize_up_to_pinned(
    input: &PlanInput,
    max_concurrency: usize,
    pinned: &[Option<usize>],
) -> Result<Vec<Plan>> {
    input.with_concurrency(max_concurrency.max(1)).validate()?;
    let mut plans: Vec<Plan> = Vec::with_capacity(max_concurrency);
    for n in 1..=max_concurrency {
        let start = plans.last().map(|p| p.thresholds.clone());
        plans.push(optimize_from(
            &input.with_concurrency(n),
            pinned,
            start.as_deref(),
        )?);
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::Latency;

    fn one_model(n: usize) -> PlanInput {
        PlanInput {
            latencies: vec![Latency::Constant(10.0)],
            routing: vec![vec![1.0]],
            credits: vec![vec![1.0]],
            delta_ms: 1.0,
            concurrency: n,
            sharing: 0.0,
        }
    }

    #[test]
    fn ties_keep_smallest_threshold() {
        let plan = optimize(&one_model(3)).expect("plan");
        assert_eq!(plan.thresholds, vec![1]);
        assert!((plan.tokens_per_s - 300.0).abs() < 1e-9);
        assert_eq!(plan.tokens_per_s, plan.baseline_tokens_per_s);
    }

    #[test]
    fn threshold_count_is_checked() {
        assert!(matches!(
            throughput(&one_model(2), &[1, 1]),
            Err(PlanError::ThresholdCount {
                got: 2,
                expected: 1
            })
        ));
    }

    #[test]
    fn pinned_thresholds_are_kept() {
        let input = PlanInput {
            latencies: vec![Latency::Constant(6.0), Latency::Constant(27.9)],
            routing: vec![vec![0.65, 0.35], vec![1.0, 0.0]],
            credits: vec![vec![1.0, 0.0], vec![1.0, 0.0]],
            delta_ms: 0.1,
            concurrency: 5,
            sharing: 0.0,
        };
        let plan = optimize_pinned(&input, &[Some(2), None]).expect("plan");
        assert_eq!(plan.thresholds[0], 2);
        let free = optimize(&input).expect("plan");
        assert!(free.tokens_per_s >= plan.tokens_per_s - 1e-9);
        assert!(matches!(
            optimize_pinned(&input, &[None]),
            Err(PlanError::ThresholdCount { .. })
        ));
    }

    #[test]
    fn up_to_gives_one_plan_per_concurrency() {
        let plans = optimize_up_to(&one_model(1), 4).expect("plans");
        assert_eq!(
            plans.iter().map(|p| p.concurrency).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        assert!((plans[3].tokens_per_s - 400.0).abs() < 1e-9);
    }
}
