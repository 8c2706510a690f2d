//! What all sub-servers, the inter-model loop and the tuner share: names, limits, counters,
//! thresholds, the step-latency log and routing counts the tuner plans from, and the clock
//! that tells how many models were stepping at once.

use crate::config::Threshold;
use crate::metrics::EngineMetrics;
use crate::tuner::TunedThresholds;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokenrouter_api::ModelIndex;

/// State every sub-server and the inter-model loop can read.
pub struct Shared {
    pub names: Vec<String>,
    /// Requests inside the engine (admitted, not finished).
    pub active: AtomicUsize,
    /// Prompt tokens of the requests inside the engine (admission bound).
    pub queued_prompt_tokens: AtomicUsize,
    /// Requests held by each model (waiting + running).
    pub held: Vec<AtomicUsize>,
    /// Whether each model is currently holding back a step (delayed batching).
    pub delaying: Vec<AtomicBool>,
    /// Hand-offs sent but not yet accepted by their receiver.
    pub in_transit: AtomicUsize,
    /// In a remote sub-server: the front end's hand-offs in transit (it reports them).
    pub peer_in_transit: AtomicUsize,
    /// KV blocks in use at each model (for metrics and leak checks).
    pub kv_used: Vec<AtomicUsize>,
    /// Smallest context length across models: a request must fit every model it may visit.
    pub context_limit: usize,
    /// Ids at or above this are padding or beyond some model's vocabulary: never valid in a
    /// request (prompt, logit_bias, stop_token_ids).
    pub sample_limit: usize,
    pub thresholds: Vec<Mutex<Threshold>>,
    pub metrics: Arc<EngineMetrics>,
    /// Step latency observations for online tuning.
    pub latency_log: Mutex<Vec<StepSample>>,
    /// Routing observations: counts[from][to] of step outcomes (to == from means stayed).
    pub route_counts: Mutex<Vec<Vec<u64>>>,
    /// Output tokens credited per outcome: credits[from][to] (a dropped token credits 0).
    pub credit_counts: Mutex<Vec<Vec<u64>>>,
    /// Thresholds chosen by the online tuner for models configured `auto`, by number of
    /// active requests.
    pub tuned: Vec<TunedThresholds>,
    /// How many models are in a step, integrated over time.
    pub busy: BusyClock,
    /// CPU models step one at a time (see `turn.rs`).
    pub cpu_turn: crate::turn::TurnLock,
    /// What a request may override in `"routing"`, set once the policies are built.
    pub tunables: std::sync::OnceLock<crate::routing_knob::Tunables>,
    /// Why each model is down (its sub-server panicked), if it is.
    pub down: Vec<Mutex<Option<String>>>,
    /// When each model's current step started (ms since the epoch; 0: not stepping).
    pub step_started_ms: Vec<std::sync::atomic::AtomicU64>,
    /// Steps longer than this are reported.
    pub step_watchdog: std::time::Duration,
    /// Waiting requests are served by `priority`, not arrival (`system.scheduling_policy`).
    pub priority_scheduling: bool,
}

/// Most step samples kept for the online tuner between its drains.
pub const MAX_LATENCY_SAMPLES: usize = 4096;

/// The number of models in a step, integrated over time: a step reads the integral when it
/// starts and ends, which gives the mean number of models that were stepping meanwhile (itself
/// included), i.e. how crowded a shared processor was.
#[derive(Debug)]
pub struct BusyClock {
    state: Mutex<ClockState>,
}

#[derive(Debug)]
struct ClockState {
    last: Instant,
    busy: usize,
    /// Model-seconds of stepping since the clock started.
    integral: f64,
}

impl Default for BusyClock {
    fn default() -> Self {
        Self {
            state: Mutex::new(ClockState {
                last: Instant::now(),
                busy: 0,
                integral: 0.0,
            }),
        }
    }
}

impl BusyClock {
    fn advance(s: &mut ClockState, now: Instant) {
        s.integral += s.busy as f64 * now.saturating_duration_since(s.last).as_secs_f64();
        s.last = s.last.max(now);
    }

    /// A step starts at `now`; returns the integral to pass to [`BusyClock::end`].
    pub fn begin(&self, now: Instant) -> f64 {
        let Ok(mut s) = self.state.lock() else {
            return 0.0;
        };
        Self::advance(&mut s, now);
        s.busy += 1;
        s.integral
    }

    /// The step that began with `mark` ends at `now` after `seconds`: the mean number of
    /// models stepping during it (at least 1).
    pub fn end(&self, mark: f64, now: Instant, seconds: f64) -> f64 {
        let Ok(mut s) = self.state.lock() else {
            return 1.0;
        };
        Self::advance(&mut s, now);
        s.busy = s.busy.saturating_sub(1);
        if seconds > 0.0 {
            ((s.integral - mark) / seconds).max(1.0)
        } else {
            1.0
        }
    }
}

/// One measured step of a model, as the online tuner sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSample {
    pub model: ModelIndex,
    /// Rows in the step.
    pub batch: usize,
    /// Whether some row had nothing cached here (a request's first contact with this model,
    /// or a re-prefill after eviction or preemption): such a step prefills a whole prompt
    /// and is no sample of the decode/extend steps delayed batching trades.
    pub prefill: bool,
    pub seconds: f64,
    /// Mean number of models stepping during this step, itself included (see `BusyClock`).
    pub busy: f64,
}

impl Shared {
    pub fn new(
        names: Vec<String>,
        context_limit: usize,
        sample_limit: usize,
        thresholds: Vec<Threshold>,
        metrics: Arc<EngineMetrics>,
        step_watchdog: std::time::Duration,
    ) -> Self {
        let n = names.len();
        Self {
            names,
            active: AtomicUsize::new(0),
            queued_prompt_tokens: AtomicUsize::new(0),
            held: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            delaying: (0..n).map(|_| AtomicBool::new(false)).collect(),
            in_transit: AtomicUsize::new(0),
            peer_in_transit: AtomicUsize::new(0),
            kv_used: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            context_limit,
            sample_limit,
            thresholds: thresholds.into_iter().map(Mutex::new).collect(),
            metrics,
            latency_log: Mutex::new(Vec::new()),
            route_counts: Mutex::new(vec![vec![0; n]; n]),
            credit_counts: Mutex::new(vec![vec![0; n]; n]),
            tuned: (0..n).map(|_| TunedThresholds::new()).collect(),
            busy: BusyClock::default(),
            cpu_turn: crate::turn::TurnLock::default(),
            tunables: std::sync::OnceLock::new(),
            down: (0..n).map(|_| Mutex::new(None)).collect(),
            step_started_ms: (0..n)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            step_watchdog,
            priority_scheduling: false,
        }
    }

    pub fn down_reason(&self, model: ModelIndex) -> Option<String> {
        self.down.get(model)?.lock().ok()?.clone()
    }

    /// Models that cannot serve now, with why: down, or stuck in a step past the watchdog.
    pub fn unhealthy(&self) -> Vec<(String, String)> {
        let now = super::faults::now_ms();
        let deadline = self.step_watchdog.as_millis() as u64;
        (0..self.names.len())
            .filter_map(|m| {
                if let Some(reason) = self.down_reason(m) {
                    return Some((self.names[m].clone(), format!("down: {reason}")));
                }
                let started = self.step_started_ms[m].load(Ordering::SeqCst);
                (started > 0 && now.saturating_sub(started) > deadline).then(|| {
                    (
                        self.names[m].clone(),
                        format!(
                            "a step has been running for {:.1} s (watchdog {:.0} s)",
                            now.saturating_sub(started) as f64 / 1000.0,
                            self.step_watchdog.as_secs_f64()
                        ),
                    )
                })
            })
            .collect()
    }

    pub fn threshold(&self, model: ModelIndex, active: usize) -> usize {
        match self.thresholds[model].lock() {
            Ok(t) if matches!(*t, Threshold::Auto(_)) => self.tuned[model].get(active),
            Ok(t) => t.at(active),
            Err(_) => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BusyClock;
    use std::time::{Duration, Instant};

    #[test]
    fn busy_clock_gives_the_mean_number_of_models_stepping() {
        let c = BusyClock::default();
        let t0 = Instant::now();
        let s = |x: u64| t0 + Duration::from_secs(x);
        let a = c.begin(s(0));
        let b = c.begin(s(1));
        // A: 1 s alone, 1 s with B.
        assert!((c.end(a, s(2), 2.0) - 1.5).abs() < 1e-9);
        // B: 1 s with A, 1 s alone.
        assert!((c.end(b, s(3), 2.0) - 1.5).abs() < 1e-9);
        let d = c.begin(s(4));
        assert!((c.end(d, s(5), 1.0) - 1.0).abs() < 1e-9);
        assert_eq!(c.end(d, s(5), 0.0), 1.0);
    }
}
