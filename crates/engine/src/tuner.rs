//! Online tuning of delayed batching (`delayed_batching_threshold: auto`): start from each
//! model's start-up latency profile (`profile`), refine it with the decode/extend steps
//! measured while serving (prefill steps excluded; converted to solo latencies with the
//! measured contention between models, which the planner models as a shared processor),
//! estimate the routing matrix P and the credit matrix C from step outcomes, and solve the
//! planner's exact Markov model for the number of active requests whenever that number has
//! no fresh plan (a new count, or a plan older than the period); apply the best thresholds
//! per count and export them (and the predicted throughput) in /metrics. Models with fixed
//! thresholds stay pinned to theirs.

use crate::config::Threshold;
use crate::profile::Profile;
use crate::subserver::Shared;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenrouter_planner::{optimize_pinned, Latency, Plan, PlanInput, MAX_CONCURRENCY};

/// The start-up profile counts as this many observations of each batch size it measured.
const SEED_WEIGHT: f64 = 4.0;
/// Step outcomes the entry model must have seen before its routing row is trusted: until
/// then nothing is planned and `auto` thresholds stay at 1 (no delay).
const MIN_ENTRY_OUTCOMES: u64 = 32;
/// Rows of the other models blend their observed outcomes with this many pseudo-outcomes of
/// the prior "one step, keep the token, back to the entry model" (the large-model side of
/// one-token methods such as R2R and random).
const PRIOR_OUTCOMES: f64 = 8.0;
/// How often the tuner looks at new observations and the number of active requests.
const TICK: Duration = Duration::from_millis(20);

/// Thresholds the tuner chose for one `auto` model, by number of active requests, so a
/// change of concurrency takes the plan made for it at once.
pub struct TunedThresholds {
    by_active: Vec<AtomicUsize>,
    latest: AtomicUsize,
}

impl Default for TunedThresholds {
    fn default() -> Self {
        Self::new()
    }
}

impl TunedThresholds {
    pub fn new() -> Self {
        Self {
            by_active: (0..=MAX_CONCURRENCY).map(|_| AtomicUsize::new(0)).collect(),
            latest: AtomicUsize::new(1),
        }
    }

    /// The plan for `active` requests; for a count not planned yet, the latest plan (1
    /// before the first).
    pub fn get(&self, active: usize) -> usize {
        match self.by_active.get(active).map(|b| b.load(Ordering::SeqCst)) {
            Some(b) if b > 0 => b,
            _ => self.latest.load(Ordering::SeqCst).max(1),
        }
    }

    pub fn set(&self, active: usize, threshold: usize) {
        let b = threshold.max(1);
        if let Some(slot) = self.by_active.get(active) {
            slot.store(b, Ordering::SeqCst);
        }
        self.latest.store(b, Ordering::SeqCst);
    }
}

/// Piecewise-linear curve through `(batch, ms)` points sorted by batch, for batch 1..=max:
/// flat before the first point, linear between points, and beyond the last point linear with
/// the slope of the last two (never decreasing; flat with a single point).
fn curve(pts: &[(usize, f64)], max: usize) -> Option<Vec<f64>> {
    if pts.is_empty() {
        return None;
    }
    Some((1..=max).map(|b| curve_at(pts, b)).collect())
}

fn curve_at(pts: &[(usize, f64)], b: usize) -> f64 {
    match pts.iter().position(|&(pb, _)| pb >= b) {
        Some(0) => pts[0].1,
        Some(i) if pts[i].0 == b => pts[i].1,
        Some(i) => {
            let ((b0, l0), (b1, l1)) = (pts[i - 1], pts[i]);
            l0 + (l1 - l0) * (b - b0) as f64 / (b1 - b0) as f64
        }
        None if pts.len() >= 2 => {
            let ((b0, l0), (b1, l1)) = (pts[pts.len() - 2], pts[pts.len() - 1]);
            let slope = ((l1 - l0) / (b1 - b0) as f64).max(0.0);
            l1 + slope * (b - b1) as f64
        }
        None => pts[pts.len() - 1].1,
    }
}

/// Step latency (ms) by batch size of one model: the start-up profile (if any) refined by
/// the decode/extend steps observed while serving.
#[derive(Default)]
struct LatencyTable {
    /// Start-up profile, (batch, ms) sorted by batch.
    seed: Vec<(usize, f64)>,
    /// Observed steps: batch -> (sum of ms, count).
    observed: BTreeMap<usize, (f64, u64)>,
}

impl LatencyTable {
    fn seed(&mut self, profile: &[(usize, f64)]) {
        self.seed = profile
            .iter()
            .copied()
            .filter(|&(b, ms)| b > 0 && ms.is_finite() && ms > 0.0)
            .collect();
        self.seed.sort_by_key(|&(b, _)| b);
        self.seed.dedup_by_key(|&mut (b, _)| b);
    }

    fn add(&mut self, batch: usize, seconds: f64) {
        if batch == 0 || !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        let e = self.observed.entry(batch).or_insert((0.0, 0));
        e.0 += seconds * 1000.0;
        e.1 += 1;
    }

    /// Latency for batch 1..=max. Without a profile: the observed means, interpolated.
    /// With one: the profile gives the shape and the observations the level (`scale`, the
    /// mean ratio of observed to profiled latency, which absorbs other load on the machine,
    /// the models slowing each other down and extend rows of several tokens); at each batch
    /// size the scaled profile then counts as `SEED_WEIGHT` observations next to the real
    /// ones.
    fn table(&self, max: usize) -> Option<Vec<f64>> {
        if self.seed.is_empty() {
            let pts: Vec<(usize, f64)> = self
                .observed
                .iter()
                .map(|(&b, &(s, n))| (b, s / n as f64))
                .collect();
            return curve(&pts, max);
        }
        let (mut ratios, mut count) = (SEED_WEIGHT, SEED_WEIGHT);
        for (&b, &(s, n)) in &self.observed {
            ratios += s / curve_at(&self.seed, b);
            count += n as f64;
        }
        let scale = ratios / count;
        let mut sizes: Vec<usize> = self.seed.iter().map(|&(b, _)| b).collect();
        sizes.extend(self.observed.keys().copied());
        sizes.sort_unstable();
        sizes.dedup();
        let pts: Vec<(usize, f64)> = sizes
            .into_iter()
            .map(|b| {
                let (s, n) = self.observed.get(&b).copied().unwrap_or((0.0, 0));
                let prior = scale * curve_at(&self.seed, b);
                (b, (SEED_WEIGHT * prior + s) / (SEED_WEIGHT + n as f64))
            })
            .collect();
        curve(&pts, max)
    }
}

/// Routing matrix P and credit matrix C from the observed step outcomes (`counts[m][j]`,
/// `credits[m][j]`), or `None` while the entry model (0) has seen fewer than
/// `MIN_ENTRY_OUTCOMES`. Other models blend in the prior "back to the entry, token kept"
/// with weight `PRIOR_OUTCOMES`, so a model rarely visited yet still has a sensible row.
fn routing_estimate(counts: &[Vec<u64>], credits: &[Vec<u64>]) -> Option<Matrices> {
    let n = counts.len();
    if n == 0 || counts[0].iter().sum::<u64>() < MIN_ENTRY_OUTCOMES {
        return None;
    }
    let mut routing = vec![vec![0.0; n]; n];
    let mut credit = vec![vec![0.0; n]; n];
    for m in 0..n {
        let total = counts[m].iter().sum::<u64>() as f64;
        let prior = if m == 0 { 0.0 } else { PRIOR_OUTCOMES };
        for j in 0..n {
            let (pc, pk) = if j == 0 { (prior, prior) } else { (0.0, 0.0) };
            let c = counts[m][j] as f64 + pc;
            routing[m][j] = c / (total + prior);
            credit[m][j] = if c == 0.0 {
                0.0
            } else {
                (credits[m][j] as f64 + pk) / c
            };
        }
    }
    Some(Matrices { routing, credit })
}

struct Matrices {
    routing: Vec<Vec<f64>>,
    credit: Vec<Vec<f64>>,
}

/// Build the planner input from what has been observed so far.
fn observed_input(
    shared: &Shared,
    tables: &[LatencyTable],
    active: usize,
    sharing: f64,
) -> Option<PlanInput> {
    let counts = shared.route_counts.lock().ok()?.clone();
    let credits = shared.credit_counts.lock().ok()?.clone();
    let Matrices { routing, credit } = routing_estimate(&counts, &credits)?;
    let active = active.clamp(1, MAX_CONCURRENCY);
    let mut latencies = Vec::with_capacity(tables.len());
    for t in tables {
        latencies.push(Latency::ByBatch(t.table(active)?));
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
        sharing,
    })
}

/// When to solve the planner: for a number of active requests with no plan yet, or whose plan
/// is older than `period` (new observations), checked every tick. Plans for other counts are
/// kept, so returning to a count planned recently needs no solve.
struct Schedule {
    period: Duration,
    planned: HashMap<usize, Instant>,
}

impl Schedule {
    fn new(period: Duration) -> Self {
        Self {
            period,
            planned: HashMap::new(),
        }
    }

    fn due(&self, active: usize, now: Instant) -> bool {
        active > 0
            && self
                .planned
                .get(&active)
                .is_none_or(|&t| now.saturating_duration_since(t) >= self.period)
    }

    fn done(&mut self, active: usize, now: Instant) {
        self.planned.insert(active, now);
    }
}

/// Solo-equivalent seconds of a step that took `seconds` while on average `busy` models were
/// stepping (itself included), given the measured contention `sharing`.
fn solo_seconds(seconds: f64, busy: f64, sharing: f64) -> f64 {
    seconds / (1.0 + sharing * (busy - 1.0).max(0.0))
}

/// Runs until `stop`. `profile` is the start-up profile (solo step latencies, possibly empty,
/// and the contention between models). Solves for the current number of active requests when
/// it has no fresh plan (see [`Schedule`]).
pub fn run_tuner(shared: Arc<Shared>, profile: Profile, stop: Arc<AtomicBool>, period: Duration) {
    let n = shared.names.len();
    let mut tables: Vec<LatencyTable> = (0..n).map(|_| LatencyTable::default()).collect();
    for (t, p) in tables.iter_mut().zip(&profile.step_ms) {
        t.seed(p);
    }
    // Latencies are kept as solo latencies; the planner adds the contention back.
    let sharing = profile.sharing;
    let auto: Vec<bool> = shared
        .thresholds
        .iter()
        .map(|t| {
            t.lock()
                .map(|t| matches!(*t, Threshold::Auto(_)))
                .unwrap_or(false)
        })
        .collect();
    let mut schedule = Schedule::new(period);
    // The latest plan per number of active requests.
    let mut plans: HashMap<usize, Plan> = HashMap::new();
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(TICK);
        if let Ok(mut log) = shared.latency_log.lock() {
            for s in log.drain(..) {
                // Prefill steps are not what delayed batching trades (see `StepSample`).
                if !s.prefill {
                    tables[s.model].add(s.batch, solo_seconds(s.seconds, s.busy, sharing));
                }
            }
        }
        let active = shared.active.load(Ordering::SeqCst);
        let now = Instant::now();
        if schedule.due(active, now) {
            if let Some(input) = observed_input(&shared, &tables, active, sharing) {
                schedule.done(active, now);
                let pins: Vec<Option<usize>> = (0..n)
                    .map(|m| (!auto[m]).then(|| shared.threshold(m, active)))
                    .collect();
                match optimize_pinned(&input, &pins) {
                    Ok(plan) => {
                        for (m, &b) in plan.thresholds.iter().enumerate() {
                            if auto[m] {
                                shared.tuned[m].set(active, b);
                            }
                        }
                        let changed = plans
                            .get(&active)
                            .is_none_or(|p| p.thresholds != plan.thresholds);
                        if changed {
                            let latency_ms: Vec<Vec<f64>> = input
                                .latencies
                                .iter()
                                .map(|l| {
                                    (1..=active)
                                        .map(|b| (l.at(b) * 10.0).round() / 10.0)
                                        .collect()
                                })
                                .collect();
                            tracing::info!(
                                active,
                                thresholds = ?plan.thresholds,
                                predicted_tok_s = plan.tokens_per_s,
                                baseline_tok_s = plan.baseline_tokens_per_s,
                                ?latency_ms,
                                p_route = input.routing[0].get(1).copied().unwrap_or(0.0),
                                "delayed batching re-planned"
                            );
                        }
                        plans.insert(active, plan);
                    }
                    Err(e) => tracing::warn!(error = %e, "delayed-batching planner failed"),
                }
            }
        }
        // Export the plan in force at the current number of active requests.
        if let Some(plan) = plans.get(&active) {
            for (m, &b) in plan.thresholds.iter().enumerate() {
                shared
                    .metrics
                    .threshold
                    .with_label_values(&[&shared.names[m]])
                    .set(b as f64);
            }
            shared.metrics.predicted_throughput.set(plan.tokens_per_s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn observed_only_table_interpolates_and_extends_the_last_slope() {
        let mut t = LatencyTable::default();
        t.add(1, 0.010);
        t.add(1, 0.012);
        t.add(4, 0.020);
        let v = t.table(6).unwrap();
        assert!(close(v[0], 11.0));
        assert!(close(v[1], 14.0));
        assert!(close(v[3], 20.0));
        // Beyond the last point: the slope of the last two (3 ms per row).
        assert!(close(v[5], 26.0));
        assert!(LatencyTable::default().table(3).is_none());
        // A single point, or a falling end, extends flat.
        let mut one = LatencyTable::default();
        one.add(2, 0.005);
        assert_eq!(one.table(3).unwrap(), vec![5.0, 5.0, 5.0]);
        assert!(close(curve(&[(1, 10.0), (2, 8.0)], 4).unwrap()[3], 8.0));
    }

    #[test]
    fn seed_alone_is_the_profile() {
        let mut t = LatencyTable::default();
        t.seed(&[(4, 20.0), (1, 10.0), (2, f64::NAN), (8, 28.0)]);
        let v = t.table(10).unwrap();
        assert!(close(v[0], 10.0));
        assert!(close(v[1], 40.0 / 3.0)); // NaN dropped: interpolated between 1 and 4
        assert!(close(v[3], 20.0));
        assert!(close(v[5], 24.0));
        assert!(close(v[7], 28.0));
        assert!(close(v[9], 32.0));
    }

    #[test]
    fn observations_set_the_level_and_refine_each_size() {
        let mut t = LatencyTable::default();
        t.seed(&[(1, 10.0), (2, 12.0), (4, 16.0), (8, 24.0)]);
        // Served steps of batch 1 take twice the profile (other load).
        for _ in 0..4 {
            t.add(1, 0.020);
        }
        // scale = (4 + 4 * 2) / (4 + 4) = 1.5
        let v = t.table(8).unwrap();
        assert!(close(v[0], (4.0 * 15.0 + 80.0) / 8.0));
        assert!(close(v[1], 18.0));
        assert!(close(v[7], 36.0));
        // Many observations of one size dominate its estimate.
        for _ in 0..10_000 {
            t.add(4, 0.050);
        }
        let v = t.table(8).unwrap();
        assert!((v[3] - 50.0).abs() < 0.1, "{}", v[3]);
        // An observed size between profiled ones blends the interpolated profile.
        let mut u = LatencyTable::default();
        u.seed(&[(1, 10.0), (4, 16.0)]);
        u.add(3, 0.014);
        // scale = (4 + 14/14) / 5 = 1; estimate at 3 = (4 * 14 + 14) / 5 = 14
        assert!(close(u.table(4).unwrap()[2], 14.0));
        // Zero or non-finite observations are ignored.
        u.add(0, 0.01);
        u.add(2, f64::NAN);
        assert_eq!(u.observed.len(), 1);
    }

    #[test]
    fn routing_needs_enough_entry_outcomes_and_blends_a_prior_elsewhere() {
        let few = vec![vec![20, 10], vec![0, 0]];
        assert!(routing_estimate(&few, &few).is_none());
        // 70 stay, 30 routed (token dropped: credit 0); the large model seen 2 times.
        let counts = vec![vec![70, 30], vec![2, 0]];
        let credits = vec![vec![70, 0], vec![2, 0]];
        let m = routing_estimate(&counts, &credits).unwrap();
        assert!(close(m.routing[0][0], 0.7) && close(m.routing[0][1], 0.3));
        assert!(close(m.credit[0][0], 1.0) && close(m.credit[0][1], 0.0));
        assert!(close(m.routing[1][0], 1.0) && close(m.routing[1][1], 0.0));
        assert!(close(m.credit[1][0], 1.0));
        // A large model that stays half the time: the prior weighs 8 outcomes.
        let counts = vec![vec![70, 30], vec![8, 8]];
        let credits = vec![vec![70, 0], vec![8, 8]];
        let m = routing_estimate(&counts, &credits).unwrap();
        assert!(close(m.routing[1][0], 16.0 / 24.0));
        assert!(close(m.routing[1][1], 8.0 / 24.0));
        for row in &m.routing {
            assert!(close(row.iter().sum::<f64>(), 1.0));
        }
    }

    #[test]
    fn replans_for_new_counts_and_stale_plans_only() {
        let t0 = Instant::now();
        let mut s = Schedule::new(Duration::from_secs(1));
        assert!(!s.due(0, t0), "nothing to plan without requests");
        assert!(s.due(4, t0));
        s.done(4, t0);
        assert!(!s.due(4, t0 + Duration::from_millis(500)));
        // The count changes: plan at once; back to 4 within the period: keep its plan.
        assert!(s.due(3, t0 + Duration::from_millis(500)));
        s.done(3, t0 + Duration::from_millis(500));
        assert!(!s.due(4, t0 + Duration::from_millis(900)));
        assert!(s.due(4, t0 + Duration::from_millis(1000)));
    }

    #[test]
    fn overlapped_steps_count_as_their_solo_time() {
        assert!(close(solo_seconds(0.1, 1.0, 1.0), 0.1));
        assert!(close(solo_seconds(0.1, 2.0, 1.0), 0.05));
        assert!(close(solo_seconds(0.1, 1.5, 0.5), 0.08));
        assert!(close(solo_seconds(0.1, 2.0, 0.0), 0.1));
        assert!(close(solo_seconds(0.1, 0.5, 1.0), 0.1));
    }

    #[test]
    fn tuned_thresholds_are_kept_per_count() {
        let t = TunedThresholds::new();
        assert_eq!(t.get(4), 1, "1 before any plan");
        t.set(4, 3);
        t.set(8, 6);
        assert_eq!(t.get(4), 3);
        assert_eq!(t.get(8), 6);
        // A count without a plan takes the latest one.
        assert_eq!(t.get(5), 6);
        assert_eq!(t.get(100_000), 6);
        t.set(2, 0);
        assert_eq!(t.get(2), 1);
    }
}
