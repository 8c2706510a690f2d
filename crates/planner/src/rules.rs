//! The tick rules of the delayed-batching model, written once and shared by the exact solver
//! (`chain`) and the Monte-Carlo simulator (`sim`) so both follow the very same dynamics.
//!
//! One tick:
//! 1. every busy model decrements `r_m`;
//! 2. every model whose `r_m` reached 0 (all of them together when several finish in the same tick)
//!    becomes idle and sends its `b_m` requests on as Multinomial(b_m, P_m·); arrivals are added to the
//!    destinations' waiting queues `q_j`, including the model's own queue when `P_mm > 0`;
//! 3. start phase (also applied once at time 0 to the initial state, all N waiting at model 0):
//!    - (a) every idle model with `q_m ≥ max(1, min(B_m, N))` starts a step with ALL its waiting
//!      requests (`b ← q`, `q ← 0`, `r ← max(1, round(L_m(b)/δ))`);
//!    - (b) "never wait for more requests than can still arrive": if after (a) no model at all is
//!      busy, nothing is in service anywhere, so no request can arrive at any idle model; then every
//!      idle model with `q_m ≥ 1` starts. Without (b), two thresholds > 1 could deadlock (e.g.
//!      N = 4, B = [3, 3], two requests waiting at each model).
//!
//! Requests reaching a model mid-step wait in `q_m` for its next step. Thresholds above N act as N.

use crate::input::{PlanInput, MAX_MODELS};

/// State of all models: waiting `q`, in the running step `b`, remaining ticks `r` (0 = idle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct State {
    pub q: [u8; MAX_MODELS],
    pub b: [u8; MAX_MODELS],
    pub r: [u16; MAX_MODELS],
}

impl State {
    /// The state as two words (for hashing).
    fn words(&self) -> (u64, u64) {
        let qb = u64::from_le_bytes([
            self.q[0], self.q[1], self.q[2], self.q[3], self.b[0], self.b[1], self.b[2], self.b[3],
        ]);
        let r = self
            .r
            .iter()
            .fold(0u64, |acc, &x| (acc << 16) | u64::from(x));
        (qb, r)
    }
}

impl std::hash::Hash for State {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let (a, b) = self.words();
        h.write_u64(a);
        h.write_u64(b);
    }
}

/// A fast multiplicative hasher (FxHash) for [`State`] keys; states are not attacker-controlled.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// Hash-map builder using [`FxHasher`].
pub(crate) type FxBuild = std::hash::BuildHasherDefault<FxHasher>;

/// Precomputed per-input rule data: effective thresholds and step lengths by batch size.
pub(crate) struct Rules {
    pub models: usize,
    /// `max(1, min(B_m, N))` per model.
    pub thresholds: Vec<u8>,
    /// `ticks[m][b]` = step length in ticks of a batch of `b` at model m (index 0 unused).
    pub ticks: Vec<Vec<u16>>,
}

impl Rules {
    /// Builds the rules of a validated input; `thresholds` has one entry per model.
    pub fn new(input: &PlanInput, thresholds: &[usize]) -> Rules {
        let n = input.concurrency;
        let models = input.models();
        let thresholds = thresholds
            .iter()
            .map(|&b| b.clamp(1, n) as u8)
            .collect::<Vec<_>>();
        let ticks = (0..models)
            .map(|m| {
                (0..=n)
                    .map(|b| if b == 0 { 0 } else { input.step_ticks(m, b) })
                    .collect()
            })
            .collect();
        Rules {
            models,
            thresholds,
            ticks,
        }
    }

    /// The initial state: all N requests waiting at model 0, then the start phase.
    pub fn initial(&self, n: usize) -> State {
        let mut s = State::default();
        s.q[0] = n as u8;
        self.start_phase(&mut s);
        s
    }

    /// Applies the start phase (rules 3a and 3b of the module docs) in place.
    pub fn start_phase(&self, s: &mut State) {
        let mut any_busy = false;
        for m in 0..self.models {
            if s.r[m] == 0 && s.q[m] >= self.thresholds[m] {
                self.start(s, m);
            }
            any_busy |= s.r[m] > 0;
        }
        if !any_busy {
            for m in 0..self.models {
                if s.q[m] >= 1 {
                    self.start(s, m);
                }
            }
        }
    }

    fn start(&self, s: &mut State, m: usize) {
        s.b[m] = s.q[m];
        s.q[m] = 0;
        s.r[m] = self.ticks[m][usize::from(s.b[m])];
    }
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
    fn initial_state_starts_model_zero_with_everyone() {
        let rules = Rules::new(&input(4), &[1, 3]);
        let s = rules.initial(4);
        assert_eq!((s.q[0], s.b[0], s.r[0]), (0, 4, 60));
        assert_eq!((s.q[1], s.b[1], s.r[1]), (0, 0, 0));
    }

    #[test]
    fn threshold_holds_requests_while_something_is_in_flight() {
        let rules = Rules::new(&input(4), &[1, 3]);
        let mut s = State::default();
        s.q[1] = 2;
        s.q[0] = 2;
        rules.start_phase(&mut s);
        assert_eq!((s.b[0], s.r[0]), (2, 60));
        assert_eq!((s.q[1], s.r[1]), (2, 0), "LLM waits for a third request");
    }

    #[test]
    fn no_deadlock_when_nothing_is_in_flight() {
        let rules = Rules::new(&input(4), &[3, 3]);
        let mut s = State::default();
        s.q[0] = 2;
        s.q[1] = 2;
        rules.start_phase(&mut s);
        assert_eq!((s.b[0], s.b[1]), (2, 2));
        assert!(s.r[0] > 0 && s.r[1] > 0);
    }

    #[test]
    fn thresholds_above_n_act_as_n() {
        let rules = Rules::new(&input(4), &[1, 50]);
        assert_eq!(rules.thresholds, vec![1, 4]);
        let mut s = State::default();
        s.q[1] = 4;
        rules.start_phase(&mut s);
        assert_eq!(s.b[1], 4);
    }
}
