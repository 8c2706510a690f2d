//! One sub-server per model: it owns the model's runner (weights + paged KV), its waiting
//! queue and its running batch, and steps at its own pace. Requests join and leave between
//! steps; a request that arrives extends this model's KV by the tokens it has not seen
//! (lazily prefilling prompt + output on first contact), so extend rows and decode rows
//! share one step. After a step the policy decides who stays and who moves on.

use crate::policy::{Needs, Policy};
use crate::request::Req;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokenrouter_api::{FinishReason, ModelIndex};
use tokenrouter_runtime::{Runner, RuntimeError, StepOptions};

mod after_step;
mod faults;
mod masks;
mod run_step;
mod score_prompt;
mod shared;
pub use faults::InjectedFaults;
pub use shared::{BusyClock, Shared, StepSample};

/// Messages into a sub-server.
pub enum Inbound {
    /// A request arrives (new, or handed over by another model).
    Admit(Box<Req>),
    /// A request finished elsewhere: free its KV here.
    Free(u64),
    /// Forget every cached prefix (`/flush_cache`): requests that arrive after it reuse
    /// nothing computed before.
    FlushCache,
}

/// Messages out of a sub-server, for the inter-model loop.
pub enum Outbound {
    Handoff {
        req: Box<Req>,
        to: ModelIndex,
    },
    /// The request finished or was aborted here (its KV here is already free).
    Done {
        rid: u64,
    },
}

pub struct SubServer {
    pub idx: ModelIndex,
    runner: Runner,
    policy: Box<dyn Policy>,
    needs: Needs,
    waiting: VecDeque<Box<Req>>,
    // Boxed: requests travel between sub-server threads as boxes; unboxing here would copy.
    #[allow(clippy::vec_box)]
    running: Vec<Box<Req>>,
    sample_limit: usize,
    max_batch: usize,
    shared: Arc<Shared>,
    faults: InjectedFaults,
    /// Set when a step panicked: the sub-server only fails what reaches it (`faults.rs`).
    down: bool,
    /// What `accept` produced while down, handed out by the next `step`.
    down_out: Vec<Outbound>,
}

impl SubServer {
    pub fn new(
        idx: ModelIndex,
        runner: Runner,
        policy: Box<dyn Policy>,
        sample_limit: usize,
        max_batch: usize,
        shared: Arc<Shared>,
    ) -> Self {
        let needs = policy.needs();
        Self {
            idx,
            runner,
            policy,
            needs,
            waiting: VecDeque::new(),
            running: Vec::new(),
            sample_limit,
            max_batch: max_batch.max(1),
            shared,
            faults: InjectedFaults::default(),
            down: false,
            down_out: Vec::new(),
        }
    }

    /// Faults to inject into this model's steps (tests).
    pub fn with_faults(mut self, faults: InjectedFaults) -> Self {
        self.faults = faults;
        self
    }

    /// `step`, with a panic contained: the sub-server goes down (its requests fail at once,
    /// health says so) instead of taking the process's other requests with it.
    pub fn step_guarded(&mut self, out: &mut Vec<Outbound>) -> bool {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step(out)));
        match result {
            Ok(stepped) => stepped,
            Err(payload) => {
                let reason = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a step panicked".into());
                self.down = true;
                self.go_down(format!("a step panicked: {reason}"), out);
                true
            }
        }
    }

    fn name(&self) -> &str {
        &self.shared.names[self.idx]
    }

    pub fn held(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    pub fn has_work(&self) -> bool {
        if self.down {
            return !self.down_out.is_empty();
        }
        self.held() > 0
    }

    /// The longest sequence this model's runner holds.
    pub fn max_len(&self) -> usize {
        self.runner.max_len()
    }

    pub fn kv_used_blocks(&self) -> usize {
        self.runner.usage().used_blocks
    }

    fn publish(&self) {
        let m = &self.shared.metrics;
        let name = self.name();
        m.running
            .with_label_values(&[name])
            .set(self.running.len() as f64);
        m.waiting
            .with_label_values(&[name])
            .set(self.waiting.len() as f64);
        let usage = self.runner.usage();
        m.kv_usage.with_label_values(&[name]).set(usage.fraction());
        m.kv_used_tokens
            .with_label_values(&[name])
            .set((usage.used_blocks * usage.block_size) as f64);
        let (queried, hits) = self.runner.prefix_hits();
        m.prefix_queried
            .with_label_values(&[name])
            .set(queried as f64);
        m.prefix_hits.with_label_values(&[name]).set(hits as f64);
        let active = self.shared.active.load(Ordering::SeqCst);
        m.threshold
            .with_label_values(&[name])
            .set(self.shared.threshold(self.idx, active) as f64);
        self.shared.held[self.idx].store(self.held(), Ordering::SeqCst);
        self.shared.kv_used[self.idx].store(self.runner.usage().used_blocks, Ordering::SeqCst);
    }

    pub fn accept(&mut self, msg: Inbound) {
        if self.down {
            let mut out = std::mem::take(&mut self.down_out);
            self.accept_while_down(msg, &mut out);
            self.down_out = out;
            return;
        }
        match msg {
            Inbound::Admit(mut req) => {
                if let Some((from, _)) = req.handed_off {
                    self.shared.in_transit.fetch_sub(1, Ordering::SeqCst);
                    let cached = self.runner.seq_len(req.rid).unwrap_or(0);
                    let delta = req.tokens_from(cached);
                    let accepted = self.policy.receive(req.rid, from, &delta);
                    if accepted < delta.len() {
                        req.drop_last(delta.len() - accepted);
                    }
                }
                req.visit_tokens = 0;
                self.enqueue(req, false);
            }
            Inbound::Free(rid) => {
                self.runner.free(rid);
                self.policy.forget(rid);
            }
            Inbound::FlushCache => self.flush_cache(),
        }
        self.publish();
    }

    fn flush_cache(&mut self) {
        let dropped = self.runner.flush_prefix_cache();
        tracing::info!(
            model = self.name(),
            blocks = dropped,
            "prefix cache flushed"
        );
    }

    /// Delayed batching: hold back while fewer requests are here than the threshold for the
    /// current concurrency, but never wait for requests that cannot arrive.
    pub fn should_wait(&self) -> bool {
        let active = self.shared.active.load(Ordering::SeqCst);
        let here = self.held();
        let want = self.shared.threshold(self.idx, active).min(active);
        let wait = if here == 0 || here >= want {
            false
        } else {
            // Someone must be able to send us more: a request in transit, or one held by a
            // model that is not itself waiting.
            let elsewhere = (0..self.shared.held.len()).any(|m| {
                m != self.idx
                    && self.shared.held[m].load(Ordering::SeqCst) > 0
                    && !self.shared.delaying[m].load(Ordering::SeqCst)
            });
            elsewhere
                || self.shared.in_transit.load(Ordering::SeqCst) > 0
                || self.shared.peer_in_transit.load(Ordering::SeqCst) > 0
        };
        self.shared.delaying[self.idx].store(wait, Ordering::SeqCst);
        wait
    }

    fn finish(&mut self, req: Box<Req>, reason: Option<FinishReason>, out: &mut Vec<Outbound>) {
        self.runner.free(req.rid);
        self.policy.forget(req.rid);
        if let Some(r) = reason {
            req.finish(r);
        }
        // Saturating: a remote sub-server's counters mirror requests its front end admitted.
        crate::remote::saturating_dec(&self.shared.active, 1);
        crate::remote::saturating_dec(&self.shared.queued_prompt_tokens, req.prompt.len());
        self.shared.metrics.active.dec();
        out.push(Outbound::Done { rid: req.rid });
    }

    /// Drop requests whose client went away, wherever they are in this sub-server.
    fn reap_cancelled(&mut self, out: &mut Vec<Outbound>) {
        let (gone, keep): (Vec<_>, Vec<_>) = self.running.drain(..).partition(|r| r.is_cancelled());
        self.running = keep;
        let (gone_w, keep_w): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(|r| r.is_cancelled());
        self.waiting = keep_w.into();
        for r in gone.into_iter().chain(gone_w) {
            self.finish(r, None, out);
        }
    }

    /// Move waiting requests into the batch while the KV cache has room for their deltas.
    fn admit(&mut self, out: &mut Vec<Outbound>) {
        while self.running.len() < self.max_batch {
            let Some(req) = self.waiting.front() else {
                break;
            };
            let mut wants: Vec<(u64, usize)> = self
                .running
                .iter()
                .map(|r| (r.rid, self.delta_len(r)))
                .collect();
            wants.push((req.rid, self.delta_len(req)));
            let mut needed = self.runner.blocks_needed(&wants);
            if needed > self.runner.free_blocks() {
                self.evict_pending(needed);
                needed = self.runner.blocks_needed(&wants);
            }
            if needed > self.runner.free_blocks() && self.running.is_empty() {
                // Nothing runs, so nothing will free KV: the rest of the queue (requests back
                // from another model, holding their earlier KV here) gives theirs up, newest
                // first, or the loop would spin on a head that never fits.
                self.evict_waiting(needed, true);
                needed = self.runner.blocks_needed(&wants);
            }
            if needed <= self.runner.free_blocks() {
                if let Some(req) = self.waiting.pop_front() {
                    if let Some((_, at)) = req.handed_off {
                        self.shared
                            .metrics
                            .handoff_latency
                            .with_label_values(&[self.name()])
                            .observe(at.elapsed().as_secs_f64());
                    }
                    self.running.push(req);
                }
            } else if self.running.is_empty() && needed > self.runner.usage().total_blocks {
                // It can never fit: fail it rather than wait forever.
                if let Some(req) = self.waiting.pop_front() {
                    let total = self.runner.usage().total_blocks;
                    req.fail(format!(
                        "the request needs {needed} KV blocks but model `{}` has only {total}",
                        self.name()
                    ));
                    self.finish(req, None, out);
                }
            } else {
                break;
            }
        }
    }

    /// Free the KV of requests that are away at another model (pending here) until
    /// `needed` blocks are free; they re-prefill here when they come back.
    fn evict_pending(&mut self, needed: usize) {
        let present: std::collections::HashSet<u64> = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .map(|r| r.rid)
            .collect();
        let pending: Vec<u64> = self
            .runner
            .cached_sequences()
            .into_iter()
            .filter(|s| !present.contains(s))
            .collect();
        for rid in pending {
            if self.runner.free_blocks() >= needed {
                break;
            }
            tracing::debug!(
                model = self.name(),
                rid,
                "KV cache full: evicting a pending request"
            );
            self.runner.free(rid);
        }
    }

    /// Free the KV held here by queued requests (newest first; behind the head, or the head
    /// too) until `needed` blocks are free; they re-prefill when admitted.
    fn evict_waiting(&mut self, needed: usize, spare_head: bool) {
        let skip = usize::from(spare_head);
        let queued: Vec<u64> = self
            .waiting
            .iter()
            .skip(skip)
            .rev()
            .map(|r| r.rid)
            .collect();
        for rid in queued {
            if self.runner.free_blocks() >= needed {
                break;
            }
            if self.runner.seq_len(rid).is_some_and(|n| n > 0) {
                tracing::debug!(
                    model = self.name(),
                    rid,
                    "KV cache full: evicting a queued request's KV"
                );
                self.runner.free(rid);
            }
        }
    }

    /// Running requests grow by a token per step; when the KV cache cannot hold the next
    /// step, KV nobody steps on goes first — requests away at other models, then queued
    /// requests back from one (a full batch or a full cache keeps them queued with their
    /// KV) — and then the newest running requests go back to the queue and give up theirs
    /// (all are recomputed when readmitted), so the others keep going instead of failing.
    fn preempt_to_fit(&mut self) {
        loop {
            let wants: Vec<(u64, usize)> = self
                .running
                .iter()
                .map(|r| (r.rid, self.delta_len(r)))
                .collect();
            let needed = self.runner.blocks_needed(&wants);
            if needed <= self.runner.free_blocks() {
                return;
            }
            // Pending KV of requests away at other models goes first (cheapest to redo).
            self.evict_pending(needed);
            self.evict_waiting(needed, false);
            if needed <= self.runner.free_blocks() || self.running.len() <= 1 {
                return;
            }
            if let Some(req) = self.preemption_victim() {
                tracing::warn!(
                    model = self.name(),
                    rid = req.rid,
                    "KV cache full: preempting a request"
                );
                self.shared
                    .metrics
                    .preemptions
                    .with_label_values(&[self.name()])
                    .inc();
                self.runner.free(req.rid);
                self.enqueue(req, true);
            }
        }
    }

    /// Queue a request: at the back as it arrives, or at the front when preempted; under
    /// priority scheduling, before the first request of a larger `schedule_key` (lower
    /// priority value first, then older), preempted or not.
    fn enqueue(&mut self, req: Box<Req>, preempted: bool) {
        if self.shared.priority_scheduling {
            let key = req.schedule_key();
            let at = self.waiting.partition_point(|w| w.schedule_key() <= key);
            self.waiting.insert(at, req);
        } else if preempted {
            self.waiting.push_front(req);
        } else {
            self.waiting.push_back(req);
        }
    }

    /// The running request to preempt: the newest, or under priority scheduling the one
    /// served last (highest priority value, then newest), as vLLM picks.
    fn preemption_victim(&mut self) -> Option<Box<Req>> {
        let at = match self.shared.priority_scheduling {
            true => (0..self.running.len()).max_by_key(|&i| self.running[i].schedule_key())?,
            false => self.running.len().checked_sub(1)?,
        };
        Some(self.running.remove(at))
    }

    /// Start-up latency profile (see `profile`): median ms of decode steps by batch size,
    /// measured with the options real steps of this model use. Leaves the KV cache empty.
    pub fn profile_latency(&mut self) -> Vec<(usize, f64)> {
        let opts = StepOptions {
            want_hidden: self.needs.hidden,
            all_logits: false,
        };
        let started = Instant::now();
        let result = crate::profile::decode_latency(&mut self.runner, self.max_batch, opts);
        self.publish();
        match result {
            Ok(table) => {
                tracing::info!(
                    model = self.name(),
                    step_ms_by_batch = ?table,
                    took_s = started.elapsed().as_secs_f64(),
                    "step latency profiled"
                );
                table
            }
            Err(e) => {
                tracing::warn!(model = self.name(), error = %e, "step latency profile failed");
                Vec::new()
            }
        }
    }

    /// Contention part of the start-up profile (see `profile::overlapped_decode`): mean ms of
    /// one-token steps while the other models step too.
    pub fn profile_overlapped(
        &mut self,
        barrier: &std::sync::Barrier,
        window: std::time::Duration,
    ) -> Option<f64> {
        let opts = StepOptions {
            want_hidden: self.needs.hidden,
            all_logits: false,
        };
        let shared = self.shared.clone();
        let turn = self
            .runner
            .model()
            .device()
            .is_cpu()
            .then_some(&shared.cpu_turn);
        let result =
            crate::profile::overlapped_decode(&mut self.runner, opts, barrier, window, turn);
        self.publish();
        match result {
            Ok(ms) => ms,
            Err(e) => {
                tracing::warn!(model = self.name(), error = %e, "contention profile failed");
                None
            }
        }
    }

    fn delta_len(&self, req: &Req) -> usize {
        let cached = self.runner.seq_len(req.rid).unwrap_or(0);
        req.total_len().saturating_sub(cached).max(1)
    }

    /// Run one step over the running batch. Returns whether a step ran.
    pub fn step(&mut self, out: &mut Vec<Outbound>) -> bool {
        if self.down {
            out.append(&mut self.down_out);
            return false;
        }
        self.reap_cancelled(out);
        self.admit(out);
        if self.running.is_empty() {
            self.publish();
            return false;
        }
        self.preempt_to_fit();
        // CPU models take turns (waiting is not part of the step's latency).
        let shared = self.shared.clone();
        let _turn = self
            .runner
            .model()
            .device()
            .is_cpu()
            .then(|| shared.cpu_turn.acquire());
        if self.running.iter().any(|r| r.prompt_logprobs.is_some()) {
            self.score_prompts(out);
            if self.running.is_empty() {
                self.publish();
                return true;
            }
        }
        let (rows, prefill) = self.build_rows();
        let started = Instant::now();
        let mark = self.shared.busy.begin(started);
        self.shared.step_started_ms[self.idx].store(faults::now_ms(), Ordering::SeqCst);
        let poison_first = match self.inject() {
            Ok(p) => p,
            Err(e) => {
                self.shared.busy.end(mark, Instant::now(), 0.0);
                self.step_ended(0.0);
                self.fail_batch(RuntimeError::InvalidStep(e), out);
                return true;
            }
        };
        let result = self.forward_and_sample(&rows, poison_first);
        // Timed until the results are on the host: GPU steps run asynchronously.
        let ended = Instant::now();
        let elapsed = (ended - started).as_secs_f64();
        let busy = self.shared.busy.end(mark, ended, elapsed);
        self.step_ended(elapsed);
        let mut stepped = match result {
            Ok(r) => r,
            Err(e) => {
                self.fail_batch(e, out);
                return true;
            }
        };
        self.record_step(rows.len(), prefill, elapsed, busy);
        let sampled = std::mem::take(&mut stepped.sampled);
        self.after_step(sampled, stepped.seen(), out);
        self.publish();
        true
    }

    fn fail_batch(&mut self, e: RuntimeError, out: &mut Vec<Outbound>) {
        tracing::error!(model = self.name(), error = %e, "step failed");
        self.shared
            .metrics
            .failed_rows
            .with_label_values(&[self.name()])
            .inc_by(self.running.len() as u64);
        for req in std::mem::take(&mut self.running) {
            req.fail(format!("model `{}` failed: {e}", self.name()));
            self.finish(req, None, out);
        }
        self.publish();
    }
}
