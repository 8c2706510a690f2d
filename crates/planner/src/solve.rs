//! Long-run throughput of an embedded chain by renewal-reward: X = Σ π_s R_s / (δ Σ π_s τ_s).
//!
//! The reachable graph is split into strongly connected components (iterative Tarjan). The closed
//! (recurrent) classes get a stationary distribution each, by Gauss-Seidel on π = πP to an L1 residual
//! below 1e-12; transient states have π = 0. With several closed classes (possible only with degenerate
//! routing), the answer is the expectation over the class the chain is absorbed into, the absorption
//! probabilities coming from propagating the initial mass through the transient states.

use crate::chain::Chain;
use crate::input::{PlanError, Result};

/// L1 residual ‖πP − π‖ accepted as converged.
const TOLERANCE: f64 = 1e-12;
/// Gauss-Seidel sweeps allowed per class.
const MAX_SWEEPS: usize = 200_000;

/// Tokens per second of the chain with quantum `delta_ms`.
pub(crate) fn throughput(chain: &Chain, delta_ms: f64) -> Result<f64> {
    let (comp, count) = tarjan(chain);
    let mut closed = vec![true; count];
    for i in 0..chain.len() {
        if chain.edges(i).any(|(t, _)| comp[t] != comp[i]) {
            closed[comp[i]] = false;
        }
    }
    let classes: Vec<usize> = (0..count).filter(|&c| closed[c]).collect();
    let weights = if classes.len() == 1 {
        vec![1.0]
    } else {
        absorption(chain, &comp, &closed, &classes)?
    };
    let mut x = 0.0;
    for (&class, &w) in classes.iter().zip(&weights) {
        if w <= 0.0 {
            continue;
        }
        let members: Vec<usize> = (0..chain.len()).filter(|&i| comp[i] == class).collect();
        let pi = stationary(chain, &members)?;
        let reward: f64 = members
            .iter()
            .zip(&pi)
            .map(|(&i, p)| p * chain.reward[i])
            .sum();
        let ticks: f64 = members
            .iter()
            .zip(&pi)
            .map(|(&i, p)| p * chain.ticks[i])
            .sum();
        x += w * reward / (delta_ms * ticks) * 1000.0;
    }
    Ok(x)
}

/// Strongly connected components; returns the component of every state and the count.
fn tarjan(chain: &Chain) -> (Vec<usize>, usize) {
    const NONE: usize = usize::MAX;
    let n = chain.len();
    let mut index = vec![NONE; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut comp = vec![NONE; n];
    let mut stack = Vec::new();
    let mut calls: Vec<(usize, usize)> = Vec::new();
    let mut next_index = 0;
    let mut count = 0;
    for root in 0..n {
        if index[root] != NONE {
            continue;
        }
        index[root] = next_index;
        low[root] = next_index;
        next_index += 1;
        stack.push(root);
        on_stack[root] = true;
        calls.push((root, chain.row_start[root]));
        while let Some(&mut (v, ref mut pos)) = calls.last_mut() {
            if *pos < chain.row_start[v + 1] {
                let w = chain.target[*pos] as usize;
                *pos += 1;
                if index[w] == NONE {
                    index[w] = next_index;
                    low[w] = next_index;
                    next_index += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    calls.push((w, chain.row_start[w]));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            calls.pop();
            if low[v] == index[v] {
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    comp[w] = count;
                    if w == v {
                        break;
                    }
                }
                count += 1;
            }
            if let Some(&(parent, _)) = calls.last() {
                low[parent] = low[parent].min(low[v]);
            }
        }
    }
    (comp, count)
}

/// Stationary distribution of the closed class `members` (global state indices, ascending).
fn stationary(chain: &Chain, members: &[usize]) -> Result<Vec<f64>> {
    let n = members.len();
    if n == 1 {
        return Ok(vec![1.0]);
    }
    let mut local = vec![usize::MAX; chain.len()];
    for (k, &i) in members.iter().enumerate() {
        local[i] = k;
    }
    // Incoming edges per local state (CSC), diagonal kept apart.
    let mut indeg = vec![0usize; n + 1];
    let mut diag = vec![0.0; n];
    for (k, &i) in members.iter().enumerate() {
        for (t, p) in chain.edges(i) {
            let lt = local[t];
            if lt == k {
                diag[k] += p;
            } else {
                indeg[lt + 1] += 1;
            }
        }
    }
    for k in 0..n {
        indeg[k + 1] += indeg[k];
    }
    let start = indeg.clone();
    let mut fill = indeg;
    let mut src = vec![0u32; start[n]];
    let mut w = vec![0.0; start[n]];
    for (k, &i) in members.iter().enumerate() {
        for (t, p) in chain.edges(i) {
            let lt = local[t];
            if lt != k {
                src[fill[lt]] = k as u32;
                w[fill[lt]] = p;
                fill[lt] += 1;
            }
        }
    }
    let mut pi = vec![1.0 / n as f64; n];
    let mut residual = f64::INFINITY;
    for sweep in 1..=MAX_SWEEPS {
        for j in 0..n {
            let s: f64 = (start[j]..start[j + 1])
                .map(|e| pi[src[e] as usize] * w[e])
                .sum();
            pi[j] = s / (1.0 - diag[j]);
        }
        let total: f64 = pi.iter().sum();
        pi.iter_mut().for_each(|p| *p /= total);
        if sweep % 4 == 0 || sweep < 4 {
            residual = (0..n)
                .map(|j| {
                    let inflow: f64 = (start[j]..start[j + 1])
                        .map(|e| pi[src[e] as usize] * w[e])
                        .sum();
                    (inflow + pi[j] * diag[j] - pi[j]).abs()
                })
                .sum();
            if residual < TOLERANCE {
                return Ok(pi);
            }
        }
    }
    Err(PlanError::NotConverged {
        residual,
        sweeps: MAX_SWEEPS,
    })
}

/// Probability of ending in each closed class, starting from the initial state.
fn absorption(
    chain: &Chain,
    comp: &[usize],
    closed: &[bool],
    classes: &[usize],
) -> Result<Vec<f64>> {
    let mut slot = vec![usize::MAX; closed.len()];
    for (k, &c) in classes.iter().enumerate() {
        slot[c] = k;
    }
    let mut absorbed = vec![0.0; classes.len()];
    let mut mass = vec![0.0; chain.len()];
    let mut next = vec![0.0; chain.len()];
    mass[chain.initial] = 1.0;
    for _ in 0..MAX_SWEEPS {
        let mut remaining = 0.0;
        for i in 0..chain.len() {
            let m = mass[i];
            if m == 0.0 {
                continue;
            }
            if closed[comp[i]] {
                absorbed[slot[comp[i]]] += m;
                continue;
            }
            for (t, p) in chain.edges(i) {
                next[t] += m * p;
            }
        }
        std::mem::swap(&mut mass, &mut next);
        next.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..chain.len() {
            if !closed[comp[i]] {
                remaining += mass[i];
            }
        }
        if remaining < TOLERANCE {
            for i in 0..chain.len() {
                if closed[comp[i]] {
                    absorbed[slot[comp[i]]] += mass[i];
                }
            }
            return Ok(absorbed);
        }
    }
    Err(PlanError::NotConverged {
        residual: 1.0 - absorbed.iter().sum::<f64>(),
        sweeps: MAX_SWEEPS,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chain from dense rows with given rewards and ticks.
    fn chain(rows: &[&[f64]], reward: &[f64], ticks: &[f64]) -> Chain {
        let mut c = Chain {
            initial: 0,
            row_start: vec![0],
            target: vec![],
            prob: vec![],
            reward: reward.to_vec(),
            ticks: ticks.to_vec(),
        };
        for row in rows {
            for (j, &p) in row.iter().enumerate() {
                if p > 0.0 {
                    c.target.push(j as u32);
                    c.prob.push(p);
                }
            }
            c.row_start.push(c.target.len());
        }
        c
    }

    #[test]
    fn two_state_chain_matches_closed_form() {
        // π = (b, a)/(a+b) for P = [[1-a, a], [b, 1-b]]
        let (a, b) = (0.3, 0.1);
        let c = chain(&[&[1.0 - a, a], &[b, 1.0 - b]], &[2.0, 5.0], &[10.0, 20.0]);
        let (p0, p1) = (b / (a + b), a / (a + b));
        let expect = (p0 * 2.0 + p1 * 5.0) / (0.1 * (p0 * 10.0 + p1 * 20.0)) * 1000.0;
        let got = throughput(&c, 0.1).expect("solve");
        assert!((got - expect).abs() < 1e-9 * expect, "{got} vs {expect}");
    }

    #[test]
    fn periodic_chain_converges() {
        let c = chain(
            &[&[0.0, 1.0, 0.0], &[0.0, 0.0, 1.0], &[1.0, 0.0, 0.0]],
            &[1.0, 0.0, 2.0],
            &[1.0, 1.0, 1.0],
        );
        let got = throughput(&c, 1.0).expect("solve");
        assert!((got - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn transient_states_are_ignored() {
        // state 0 is transient, {1, 2} closed
        let c = chain(
            &[&[0.5, 0.5, 0.0], &[0.0, 0.0, 1.0], &[0.0, 1.0, 0.0]],
            &[100.0, 1.0, 3.0],
            &[1.0, 1.0, 1.0],
        );
        let got = throughput(&c, 1.0).expect("solve");
        assert!((got - 2000.0).abs() < 1e-9);
    }

    #[test]
    fn several_closed_classes_are_weighted_by_absorption() {
        // from 0: to 1 (absorbing, reward 1) w.p. 0.25, to 2 (absorbing, reward 3) w.p. 0.75
        let c = chain(
            &[&[0.0, 0.25, 0.75], &[0.0, 1.0, 0.0], &[0.0, 0.0, 1.0]],
            &[0.0, 1.0, 3.0],
            &[1.0, 1.0, 1.0],
        );
        let got = throughput(&c, 1.0).expect("solve");
        assert!((got - 1000.0 * (0.25 + 2.25)).abs() < 1e-9);
    }
}
