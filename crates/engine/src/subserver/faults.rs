//! Faults, contained and told truthfully. A sub-server whose step panics is *down*: every
//! request it holds or later receives ends at once with an error naming the model, the
//! counters are corrected as for any finished request, and `Shared::down` tells `/health`
//! and admission (routed requests and requests pinned to it get 503; requests pinned to a
//! healthy model still run). A step running past the watchdog deadline is reported in the
//! logs, the metrics and `/health` while it lasts. Faults can be injected at a given step
//! of a given model (`system.fault_injection`, for tests), so all of this is tested.

use super::{Inbound, Outbound, SubServer};
use crate::config::{FaultKind, FaultSpec};
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the epoch (0 is reserved for "no step running").
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64)
        .max(1)
}

/// The faults planned for one model, by step number (1-based).
#[derive(Clone, Debug, Default)]
pub struct InjectedFaults {
    planned: Vec<(u64, FaultKind, u64)>,
    steps: u64,
}

impl InjectedFaults {
    pub fn for_model(specs: &[FaultSpec], model: &str) -> Self {
        Self {
            planned: specs
                .iter()
                .filter(|f| f.model == model)
                .map(|f| (f.step, f.kind, f.stall_ms))
                .collect(),
            steps: 0,
        }
    }

    /// Count a step; the fault planned for it, if any.
    pub fn next_step(&mut self) -> Option<(FaultKind, u64)> {
        self.steps += 1;
        let n = self.steps;
        self.planned
            .iter()
            .find(|(s, _, _)| *s == n)
            .map(|&(_, k, ms)| (k, ms))
    }
}

impl SubServer {
    /// After a panic in this sub-server: fail everything it holds and mark the model down.
    pub fn go_down(&mut self, reason: String, out: &mut Vec<Outbound>) {
        tracing::error!(model = self.name(), %reason, "sub-server is down");
        if let Ok(mut slot) = self.shared.down[self.idx].lock() {
            *slot = Some(reason.clone());
        }
        self.shared.step_started_ms[self.idx].store(0, Ordering::SeqCst);
        let message = format!("model `{}` is down: {reason}", self.name());
        let held: Vec<_> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for req in held {
            req.fail(message.clone());
            self.finish(req, None, out);
        }
        self.publish();
    }

    /// A down sub-server still answers its messages: requests are failed at once (so no
    /// hand-off to it ever hangs), frees are honoured.
    pub fn accept_while_down(&mut self, msg: Inbound, out: &mut Vec<Outbound>) {
        let reason = self
            .shared
            .down_reason(self.idx)
            .unwrap_or_else(|| "stopped".into());
        match msg {
            Inbound::Admit(req) => {
                if req.handed_off.is_some() {
                    self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                }
                req.fail(format!("model `{}` is down: {reason}", self.name()));
                self.finish(req, None, out);
            }
            Inbound::Free(rid) => {
                self.runner.free(rid);
                self.policy.forget(rid);
            }
            Inbound::FlushCache => {}
        }
        self.publish();
    }

    /// Apply an injected fault before the step runs; `Err` fails this step.
    pub(super) fn inject(&mut self) -> Result<bool, String> {
        match self.faults.next_step() {
            None => Ok(false),
            Some((FaultKind::Panic, _)) => {
                panic!("injected fault: panic in a step of model `{}`", self.name())
            }
            Some((FaultKind::Fail, _)) => Err("injected fault: the step failed".into()),
            Some((FaultKind::Stall, ms)) => {
                std::thread::sleep(Duration::from_millis(ms));
                Ok(false)
            }
            Some((FaultKind::NanRow, _)) => Ok(true),
        }
    }

    /// Record the end of a step for the watchdog.
    pub(super) fn step_ended(&self, seconds: f64) {
        self.shared.step_started_ms[self.idx].store(0, Ordering::SeqCst);
        if seconds > self.shared.step_watchdog.as_secs_f64() {
            tracing::warn!(
                model = self.name(),
                seconds,
                deadline = self.shared.step_watchdog.as_secs_f64(),
                "a step exceeded the watchdog deadline"
            );
            self.shared
                .metrics
                .slow_steps
                .with_label_values(&[self.name()])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_fire_at_their_step_for_their_model_only() {
        let specs = vec![
            FaultSpec {
                model: "quick".into(),
                step: 2,
                kind: FaultKind::Fail,
                stall_ms: 0,
            },
            FaultSpec {
                model: "reference".into(),
                step: 1,
                kind: FaultKind::Panic,
                stall_ms: 0,
            },
        ];
        let mut q = InjectedFaults::for_model(&specs, "quick");
        assert_eq!(q.next_step(), None);
        assert_eq!(q.next_step(), Some((FaultKind::Fail, 0)));
        assert_eq!(q.next_step(), None);
        let mut none = InjectedFaults::for_model(&specs, "other");
        assert_eq!(none.next_step(), None);
    }
}
