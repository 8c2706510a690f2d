//! Inputs of the delayed-batching model and their validation, kept apart so the exact solver and the
//! Monte-Carlo simulator check the very same preconditions.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Largest number of models the planner handles (states are packed into fixed arrays).
pub const MAX_MODELS: usize = 4;
/// Largest concurrency the planner handles (queue lengths are stored as `u8`).
pub const MAX_CONCURRENCY: usize = 255;

/// Errors of the planner: invalid inputs, unsolvable chains and bad command-line values.
#[derive(Debug, Error)]
pub enum PlanError {
    #[error("at least one model is needed")]
    NoModels,
    #[error("{0} models given, at most {MAX_MODELS} are supported")]
    TooManyModels(usize),
    #[error("concurrency must be between 1 and {MAX_CONCURRENCY}, got {0}")]
    BadConcurrency(usize),
    #[error("{what} has {got} rows/entries, expected {expected} (one per model)")]
    Dimension {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("row {row} of {what} has {got} entries, expected {expected}")]
    RowLength {
        what: &'static str,
        row: usize,
        got: usize,
        expected: usize,
    },
    #[error("routing row {row} sums to {sum}, expected 1 (within 1e-9)")]
    RoutingRowSum { row: usize, sum: f64 },
    #[error("{what}[{row}][{col}] = {value} is not a finite non-negative number")]
    BadEntry {
        what: &'static str,
        row: usize,
        col: usize,
        value: f64,
    },
    #[error("latency of model {model} (batch {batch}) is {value} ms; it must be finite and > 0")]
    BadLatency {
        model: usize,
        batch: usize,
        value: f64,
    },
    #[error("latency table of model {0} is empty")]
    EmptyLatencyTable(usize),
    #[error("sharing must be finite and >= 0, got {0}")]
    BadSharing(f64),
    #[error("time quantum delta must be finite and > 0 ms, got {0}")]
    BadDelta(f64),
    #[error("a step of model {model} lasts {ticks} ticks; more than 65535 (raise delta)")]
    TooManyTicks { model: usize, ticks: f64 },
    #[error("{got} thresholds given, expected {expected} (one per model)")]
    ThresholdCount { got: usize, expected: usize },
    #[error("the chain has more than {0} reachable states; lower the concurrency or raise delta")]
    StateSpaceTooLarge(usize),
    #[error("stationary solve did not converge (residual {residual:e} after {sweeps} sweeps)")]
    NotConverged { residual: f64, sweeps: usize },
    #[error("invalid argument: {0}")]
    Argument(String),
    #[error("cannot parse {what} as JSON: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// Result alias of the planner.
pub type Result<T> = std::result::Result<T, PlanError>;

/// Step latency of one model, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Latency {
    /// The same latency whatever the batch size.
    Constant(f64),
    /// Latency by batch size: entry `b - 1` is the latency of a batch of `b`; batches larger than the
    /// table use its last entry.
    ByBatch(Vec<f64>),
}

impl Latency {
    /// Latency in ms of a step with `batch` requests (`batch >= 1`).
    pub fn at(&self, batch: usize) -> f64 {
        match self {
            Latency::Constant(v) => *v,
            Latency::ByBatch(table) => {
                let idx = batch.clamp(1, table.len().max(1)) - 1;
                table.get(idx).copied().unwrap_or(f64::NAN)
            }
        }
    }
}

/// Everything the model needs besides the thresholds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    /// Step latency per model.
    pub latencies: Vec<Latency>,
    /// Routing matrix P: row m is the distribution of where a request goes after a step at model m.
    pub routing: Vec<Vec<f64>>,
    /// Credit matrix C: `credits[m][j]` tokens are credited when a request moves from m to j.
    pub credits: Vec<Vec<f64>>,
    /// Time quantum δ in ms.
    pub delta_ms: f64,
    /// Number of requests N in the closed loop.
    pub concurrency: usize,
    /// Contention between models that share one processor (e.g. two models on the same CPU
    /// cores): while k models are in a step, each progresses at 1 / (1 + sharing·(k − 1)) of its
    /// solo speed, so `latencies` are solo latencies. 0 = independent devices (the paper's
    /// setting), 1 = processor sharing.
    #[serde(default)]
    pub sharing: f64,
}

impl PlanInput {
    /// Number of models M.
    pub fn models(&self) -> usize {
        self.latencies.len()
    }

    /// Checks dimensions, that every routing row is a distribution, that credits are finite and
    /// non-negative, latencies positive and δ positive.
    pub fn validate(&self) -> Result<()> {
        let m = self.models();
        if m == 0 {
            return Err(PlanError::NoModels);
        }
        if m > MAX_MODELS {
            return Err(PlanError::TooManyModels(m));
        }
        if self.concurrency == 0 || self.concurrency > MAX_CONCURRENCY {
            return Err(PlanError::BadConcurrency(self.concurrency));
        }
        if !(self.delta_ms.is_finite() && self.delta_ms > 0.0) {
            return Err(PlanError::BadDelta(self.delta_ms));
        }
        if !(self.sharing.is_finite() && self.sharing >= 0.0) {
            return Err(PlanError::BadSharing(self.sharing));
        }
        check_matrix("routing matrix P", &self.routing, m)?;
        check_matrix("credit matrix C", &self.credits, m)?;
        for (row, r) in self.routing.iter().enumerate() {
            let sum: f64 = r.iter().sum();
            if (sum - 1.0).abs() > 1e-9 {
                return Err(PlanError::RoutingRowSum { row, sum });
            }
        }
        for (model, lat) in self.latencies.iter().enumerate() {
            let values: Vec<(usize, f64)> = match lat {
                Latency::Constant(v) => vec![(1, *v)],
                Latency::ByBatch(t) if t.is_empty() => {
                    return Err(PlanError::EmptyLatencyTable(model))
                }
                Latency::ByBatch(t) => t.iter().enumerate().map(|(i, v)| (i + 1, *v)).collect(),
            };
            for (batch, value) in values {
                if !(value.is_finite() && value > 0.0) {
                    return Err(PlanError::BadLatency {
                        model,
                        batch,
                        value,
                    });
                }
                let ticks = (value / self.delta_ms).round();
                if ticks > f64::from(u16::MAX) {
                    return Err(PlanError::TooManyTicks { model, ticks });
                }
            }
        }
        Ok(())
    }

    /// Number of ticks of a step of `batch` requests at `model`: `max(1, round(L_m(b) / δ))`.
    pub fn step_ticks(&self, model: usize, batch: usize) -> u16 {
        let ticks = (self.latencies[model].at(batch) / self.delta_ms).round();
        // Validation bounds the value; the clamp keeps the conversion total.
        ticks.clamp(1.0, f64::from(u16::MAX)) as u16
    }

    /// Wall-clock length of one tick of progress while `busy` models are in a step, in ticks
    /// (see `sharing`).
    pub fn dilation(&self, busy: usize) -> f64 {
        1.0 + self.sharing * busy.saturating_sub(1) as f64
    }

    /// Same input with another concurrency.
    pub fn with_concurrency(&self, concurrency: usize) -> PlanInput {
        PlanInput {
            concurrency,
            ..self.clone()
        }
    }
}

fn check_matrix(what: &'static str, mat: &[Vec<f64>], m: usize) -> Result<()> {
    if mat.len() != m {
        return Err(PlanError::Dimension {
            what,
            got: mat.len(),
            expected: m,
        });
    }
    for (row, r) in mat.iter().enumerate() {
        if r.len() != m {
            return Err(PlanError::RowLength {
                what,
                row,
                got: r.len(),
                expected: m,
            });
        }
        for (col, &value) in r.iter().enumerate() {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PlanError::BadEntry {
                    what,
                    row,
                    col,
                    value,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r2r() -> PlanInput {
        PlanInput {
            latencies: vec![Latency::Constant(6.0), Latency::Constant(27.9)],
            routing: vec![vec![0.65, 0.35], vec![1.0, 0.0]],
            credits: vec![vec![1.0, 0.0], vec![1.0, 0.0]],
            delta_ms: 0.1,
            concurrency: 4,
            sharing: 0.0,
        }
    }

    #[test]
    fn valid_input_passes() {
        assert!(r2r().validate().is_ok());
    }

    #[test]
    fn routing_rows_must_sum_to_one() {
        let mut p = r2r();
        p.routing[0] = vec![0.6, 0.35];
        assert!(matches!(
            p.validate(),
            Err(PlanError::RoutingRowSum { row: 0, .. })
        ));
    }

    #[test]
    fn dimensions_are_checked() {
        let mut p = r2r();
        p.credits.pop();
        assert!(matches!(p.validate(), Err(PlanError::Dimension { .. })));
        let mut p = r2r();
        p.routing[1].push(0.0);
        assert!(matches!(p.validate(), Err(PlanError::RowLength { .. })));
    }

    #[test]
    fn latencies_must_be_positive() {
        let mut p = r2r();
        p.latencies[1] = Latency::ByBatch(vec![27.9, 0.0]);
        assert!(matches!(
            p.validate(),
            Err(PlanError::BadLatency {
                model: 1,
                batch: 2,
                ..
            })
        ));
        let mut p = r2r();
        p.latencies[0] = Latency::ByBatch(vec![]);
        assert!(matches!(p.validate(), Err(PlanError::EmptyLatencyTable(0))));
        let mut p = r2r();
        p.delta_ms = 0.0;
        assert!(matches!(p.validate(), Err(PlanError::BadDelta(_))));
        let mut p = r2r();
        p.sharing = -0.5;
        assert!(matches!(p.validate(), Err(PlanError::BadSharing(_))));
        p.sharing = 1.0;
        assert!(p.validate().is_ok());
        assert_eq!(
            (p.dilation(1), p.dilation(2), p.dilation(3)),
            (1.0, 2.0, 3.0)
        );
    }

    #[test]
    fn latency_table_extends_flat_and_ticks_round() {
        let lat = Latency::ByBatch(vec![6.0, 6.1, 6.3]);
        assert_eq!(lat.at(1), 6.0);
        assert_eq!(lat.at(3), 6.3);
        assert_eq!(lat.at(10), 6.3);
        let p = r2r();
        assert_eq!(p.step_ticks(0, 1), 60);
        assert_eq!(p.step_ticks(1, 7), 279);
        let mut tiny = r2r();
        tiny.latencies[0] = Latency::Constant(0.01);
        assert_eq!(tiny.step_ticks(0, 1), 1, "a step lasts at least one tick");
    }
}
