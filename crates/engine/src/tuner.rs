//! Online tuning of delayed batching (`delayed_batching_threshold: auto`): while serving,
//! measure each model's step latency by batch size, the routing matrix P and the credit
//! matrix C, and periodically re-solve the planner's exact Markov model for the current
//! number of active requests; apply the best thresholds and export them (and the predicted
//! throughput) in /metrics. Models with fixed thresholds stay pinned to theirs.

use crate::config::Threshold;
use crate::subserver::Shared;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenrouter_planner::{optimize_pinned, Latency, PlanInput};

/// Mean step latency (ms) per batch size, per model.
#[derive(Default)]
struct LatencyTable {
    by_batch: BTreeMap<usize, (f64, u64)>,
}

impl LatencyTable {
    fn add(&mut self, batch: usize, seconds: f64) {
        let e = self.by_batch.entry(batch).or_insert((0.0, 0));
        e.0 += seconds * 1000.0;
        e.1 += 1;
    }

    /// Latency for batch 1..=max, filling gaps from the nearest measured sizes (linear
    /// between neighbours, flat beyond the ends).
    fn table(&self, max: usize) -> Option<Vec<f64>> {
        let pts: Vec<(usize, f64)> = self
            .by_batch
            .iter()
            .map(|(&b, &(s, n))| (b, s / n as f64))
            .collect();
        if pts.is_empty() {
            return None;
        }
        Some(
            (1..=max)
                .map(|b| match pts.iter().position(|&(pb, _)| pb >= b) {
                    Some(0) => pts[0].1,
                    Some(i) if pts[i].0 == b => pts[i].1,
                    Some(i) => {
                        let ((b0, l0), (b1, l1)) = (pts[i - 1], pts[i]);
                        l0 + (l1 - l0) * (b - b0) as f64 / (b1 - b0) as f64
                    }
                    None => pts[pts.len() - 1].1,
                })
                .collect(),
        )
    }
}

/// Build the planner input from what has been observed so far.
fn observed_input(shared: &Shared, tables: &[LatencyTable], active: usize) -> Option<PlanInput> {
    let n = shared.names.len();
    let counts = shared.route_counts.lock().ok()?.clone();
    let credits = shared.credit_counts.lock().ok()?.clone();
    let mut routing = vec![vec![0.0; n]; n];
    let mut credit = vec![vec![0.0; n]; n];
    for m in 0..n {
        let total: u64 = counts[m].iter().sum();
        for j in 0..n {
            if total == 0 {
                // Never stepped: assume it hands straight back to the entry model.
                routing[m][j] = if j == 0 { 1.0 } else { 0.0 };
                credit[m][j] = 1.0;
            } else {
                routing[m][j] = counts[m][j] as f64 / total as f64;
                credit[m][j] = if counts[m][j] == 0 {
                    0.0
                } else {
                    credits[m][j] as f64 / counts[m][j] as f64
                };
            }
        }
    }
    let mut latencies = Vec::with_capacity(n);
    for t in tables {
        latencies.push(Latency::ByBatch(t.table(active.max(1))?));
    }
    let min_ms = latencies
        .iter()
        .map(|l| l.at(1))
        .fold(f64::INFINITY, f64::min);
    // A quantum of ~1/20 of the fastest step keeps rounding error small and states few.
    let delta_ms = (min_ms / 20.0).max(0.01);
    Some(PlanInput {
        latencies,
        routing,
        credits: credit,
        delta_ms,
        concurrency: active,
    })
}

/// Runs until `stop`; re-plans every `period`.
pub fn run_tuner(shared: Arc<Shared>, stop: Arc<AtomicBool>, period: Duration) {
    let n = shared.names.len();
    let mut tables: Vec<LatencyTable> = (0..n).map(|_| LatencyTable::default()).collect();
    let auto: Vec<bool> = shared
        .thresholds
        .iter()
        .map(|t| {
            t.lock()
                .map(|t| matches!(*t, Threshold::Auto(_)))
                .unwrap_or(false)
        })
        .collect();
    let mut last: Option<(usize, Vec<usize>)> = None;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(period);
        if let Ok(mut log) = shared.latency_log.lock() {
            for (m, b, s) in log.drain(..) {
                tables[m].add(b, s);
            }
        }
        let active = shared.active.load(Ordering::SeqCst);
        if active == 0 {
            continue;
        }
        let Some(input) = observed_input(&shared, &tables, active) else {
            continue;
        };
        let pins: Vec<Option<usize>> = (0..n)
            .map(|m| {
                if auto[m] {
                    None
                } else {
                    Some(shared.threshold(m, active))
                }
            })
            .collect();
        match optimize_pinned(&input, &pins) {
            Ok(plan) => {
                for (m, &b) in plan.thresholds.iter().enumerate() {
                    if auto[m] {
                        shared.tuned[m].store(b, Ordering::SeqCst);
                    }
                    shared
                        .metrics
                        .threshold
                        .with_label_values(&[&shared.names[m]])
                        .set(b as f64);
                }
                shared.metrics.predicted_throughput.set(plan.tokens_per_s);
                let now = (active, plan.thresholds.clone());
                if last.as_ref() != Some(&now) {
                    tracing::info!(
                        active,
                        thresholds = ?plan.thresholds,
                        predicted_tok_s = plan.tokens_per_s,
                        baseline_tok_s = plan.baseline_tokens_per_s,
                        "delayed batching re-planned"
                    );
                    last = Some(now);
                }
            }
            Err(e) => tracing::warn!(error = %e, "delayed-batching planner failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_table_interpolates_and_extends() {
        let mut t = LatencyTable::default();
        t.add(1, 0.010);
        t.add(1, 0.012);
        t.add(4, 0.020);
        let v = t.table(6).unwrap();
        assert!((v[0] - 11.0).abs() < 1e-9);
        assert!((v[1] - 14.0).abs() < 1e-9);
        assert!((v[3] - 20.0).abs() < 1e-9);
        assert!((v[5] - 20.0).abs() < 1e-9);
        assert!(LatencyTable::default().table(3).is_none());
    }
}
