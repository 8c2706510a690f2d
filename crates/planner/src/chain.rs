//! Enumeration of the Markov chain embedded at step-completion epochs.
//!
//! Between two completions nothing but the remaining-tick counters changes (idle models only start
//! when a completion delivers requests), so from an epoch state the chain jumps straight to the next
//! completion: `τ = min r_m` over busy models, every busy model loses `τ` ticks, the models reaching 0
//! complete together, their requests are routed (the joint arrival vector is the convolution of one
//! multinomial per completing model) and the start phase of [`crate::rules`] runs. The states are
//! (q, b, r) right after a start phase; they are discovered by BFS from the initial state, with the
//! expected tokens credited at the next completion (`R_s`) and the ticks until it (`τ_s`). With a
//! shared processor (`PlanInput::sharing`), `r` counts ticks of work and `τ_s` is stretched by the
//! dilation of the busy set, which stays the same until the next completion.

use std::collections::HashMap;

use crate::input::{PlanError, PlanInput, Result, MAX_MODELS};
use crate::rules::{FxBuild, Rules, State};

/// Default bound on the number of reachable states.
pub(crate) const MAX_STATES: usize = 4_000_000;

/// Sparse transition matrix of the embedded chain (CSR) with per-state reward and sojourn.
pub(crate) struct Chain {
    /// Index of the initial state.
    pub initial: usize,
    /// Row `i` has edges `row_start[i]..row_start[i + 1]`.
    pub row_start: Vec<usize>,
    pub target: Vec<u32>,
    pub prob: Vec<f64>,
    /// Expected tokens credited at the completion ending the sojourn in each state.
    pub reward: Vec<f64>,
    /// Ticks until the next completion, per state.
    pub ticks: Vec<f64>,
}

impl Chain {
    pub fn len(&self) -> usize {
        self.reward.len()
    }

    pub fn edges(&self, i: usize) -> impl Iterator<Item = (usize, f64)> + '_ {
        let range = self.row_start[i]..self.row_start[i + 1];
        self.target[range.clone()]
            .iter()
            .zip(&self.prob[range])
            .map(|(&t, &p)| (t as usize, p))
    }
}

type Arrivals = Vec<([u8; MAX_MODELS], f64)>;

/// `table[m][b]`: the distribution of where the `b` requests of a completed step at `m` go.
fn multinomial_tables(input: &PlanInput) -> Vec<Vec<Arrivals>> {
    let n = input.concurrency;
    input
        .routing
        .iter()
        .map(|row| {
            let mut tables: Vec<Arrivals> = vec![vec![([0; MAX_MODELS], 1.0)]];
            for b in 1..=n {
                let mut next: HashMap<[u8; MAX_MODELS], f64> = HashMap::new();
                for (k, p) in &tables[b - 1] {
                    for (j, &pj) in row.iter().enumerate() {
                        if pj > 0.0 {
                            let mut k2 = *k;
                            k2[j] += 1;
                            *next.entry(k2).or_insert(0.0) += p * pj;
                        }
                    }
                }
                let mut v: Arrivals = next.into_iter().collect();
                v.sort_by_key(|e| e.0);
                tables.push(v);
            }
            tables
        })
        .collect()
}

/// Enumerates the reachable states for `thresholds` and builds the transition matrix.
pub(crate) fn build(input: &PlanInput, thresholds: &[usize], max_states: usize) -> Result<Chain> {
    let n = input.concurrency;
    let rules = Rules::new(input, thresholds);
    let tables = multinomial_tables(input);
    let gain: Vec<f64> = input
        .routing
        .iter()
        .zip(&input.credits)
        .map(|(p, c)| p.iter().zip(c).map(|(p, c)| p * c).sum())
        .collect();

    let mut index: HashMap<State, u32, FxBuild> = HashMap::default();
    let mut states: Vec<State> = Vec::new();
    let initial = rules.initial(n);
    index.insert(initial, 0);
    states.push(initial);

    let mut chain = Chain {
        initial: 0,
        row_start: vec![0],
        target: Vec::new(),
        prob: Vec::new(),
        reward: Vec::new(),
        ticks: Vec::new(),
    };
    let mut row: Vec<(u32, f64)> = Vec::new();
    let mut arrivals: Arrivals = Vec::new();
    let mut scratch: Arrivals = Vec::new();
    let mut i = 0;
    while i < states.len() {
        let s = states[i];
        let tau = (0..rules.models)
            .filter(|&m| s.r[m] > 0)
            .map(|m| s.r[m])
            .min()
            .unwrap_or(0);
        // Shared processor: the busy set is fixed until the next completion, so every busy
        // model progresses `tau` ticks of work in `tau * dilation` ticks of time.
        let busy = (0..rules.models).filter(|&m| s.r[m] > 0).count();
        // The start phase guarantees at least one busy model whenever N >= 1.
        debug_assert!(tau > 0, "state without a busy model");
        let mut base = s;
        let mut reward = 0.0;
        arrivals.clear();
        arrivals.push(([0; MAX_MODELS], 1.0));
        for m in 0..rules.models {
            if base.r[m] == 0 {
                continue;
            }
            base.r[m] -= tau;
            if base.r[m] == 0 {
                let b = usize::from(base.b[m]);
                base.b[m] = 0;
                reward += b as f64 * gain[m];
                scratch.clear();
                for (k1, p1) in &arrivals {
                    for (k2, p2) in &tables[m][b] {
                        let mut k = *k1;
                        for j in 0..MAX_MODELS {
                            k[j] += k2[j];
                        }
                        scratch.push((k, p1 * p2));
                    }
                }
                std::mem::swap(&mut arrivals, &mut scratch);
            }
        }
        row.clear();
        for (k, p) in &arrivals {
            let mut t = base;
            for j in 0..rules.models {
                t.q[j] += k[j];
            }
            rules.start_phase(&mut t);
            let idx = match index.get(&t) {
                Some(&idx) => idx,
                None => {
                    if states.len() >= max_states {
                        return Err(PlanError::StateSpaceTooLarge(max_states));
                    }
                    let idx = states.len() as u32;
                    index.insert(t, idx);
                    states.push(t);
                    idx
                }
            };
            row.push((idx, *p));
        }
        row.sort_by_key(|e| e.0);
        let mut last: Option<u32> = None;
        for &(t, p) in &row {
            if last == Some(t) {
                if let Some(q) = chain.prob.last_mut() {
                    *q += p;
                }
            } else {
                chain.target.push(t);
                chain.prob.push(p);
                last = Some(t);
            }
        }
        chain.row_start.push(chain.target.len());
        chain.reward.push(reward);
        chain.ticks.push(f64::from(tau) * input.dilation(busy));
        i += 1;
    }
    Ok(chain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::Latency;

    fn input(n: usize) -> PlanInput {
        PlanInput {
            latencies: vec![Latency::Constant(6.0), Latency::Constant(27.9)],
            routing: vec![vec![0.65, 0.35], vec![1.0, 0.0]],
            credits: vec![vec![1.0, 0.0], vec![1.0, 0.0]],
            delta_ms: 0.1,
            concurrency: n,
            sharing: 0.0,
        }
    }

    #[test]
    fn multinomial_rows_are_distributions() {
        let tables = multinomial_tables(&input(5));
        for b in 0..=5 {
            let total: f64 = tables[0][b].iter().map(|e| e.1).sum();
            assert!((total - 1.0).abs() < 1e-12);
            assert_eq!(tables[0][b].len(), b + 1);
            assert!(tables[0][b]
                .iter()
                .all(|(k, _)| usize::from(k[0] + k[1]) == b));
        }
        // P(2 of 2 go to the LLM) = 0.35^2
        let both = tables[0][2].iter().find(|(k, _)| k[1] == 2).map(|e| e.1);
        assert!((both.unwrap_or(0.0) - 0.35 * 0.35).abs() < 1e-15);
        // the LLM sends everyone back
        assert_eq!(tables[1][3].len(), 1);
    }

    #[test]
    fn rows_are_stochastic_and_conserve_requests() {
        let chain = build(&input(3), &[1, 2], MAX_STATES).expect("chain");
        assert!(chain.len() > 1);
        for i in 0..chain.len() {
            let total: f64 = chain.edges(i).map(|e| e.1).sum();
            assert!((total - 1.0).abs() < 1e-12, "row {i} sums to {total}");
            assert!(chain.ticks[i] >= 1.0);
        }
        // the first sojourn is one SLM step of all three requests
        assert_eq!(chain.ticks[chain.initial], 60.0);
        assert!((chain.reward[chain.initial] - 3.0 * 0.65).abs() < 1e-12);
    }

    #[test]
    fn state_bound_is_enforced() {
        assert!(matches!(
            build(&input(4), &[1, 1], 3),
            Err(PlanError::StateSpaceTooLarge(3))
        ));
    }
}
