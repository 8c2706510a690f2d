//! One front end's session at a remote sub-server: the copies of the requests it sent,
//! patched by each hand-off and handed back by the sub-server's output queue, and the
//! front end's load, which this model's delayed batching reads as in one process.

use super::convert::{apply_handoff, mirror_from_first, reason_to_pb, token_to_pb};
use super::host::{send, HostState, RemoteTx};
use super::saturating_dec;
use crate::request::{EventSink, PeerOut, Req};
use crate::subserver::{Inbound, Outbound, Shared};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokenrouter_api::{GenerateEvent, ModelIndex};
use tokenrouter_wire::{pb, rng_pos_bytes, unix_ns};

/// The remote's copy of a request.
pub(super) enum Copy {
    /// The sub-server holds it; the flag cancels it.
    Here(Arc<AtomicBool>),
    /// Handed back to the front end; kept to be patched by the next hand-off.
    Away(Box<Req>),
}

pub(super) struct HostSession {
    pub(super) state: Arc<HostState>,
    pub(super) inbox: mpsc::Sender<Inbound>,
    pub(super) shared: Arc<Shared>,
    pub(super) tx: RemoteTx,
    pub(super) copies: HashMap<u64, Copy>,
    pub(super) last_load: Option<pb::RemoteLoad>,
}

impl HostSession {
    pub(super) fn on_front(&mut self, m: pb::front_msg::M) {
        use pb::front_msg::M;
        match m {
            M::Handoff(h) => self.on_handoff(h),
            M::Free(f) => {
                if let Some(Copy::Away(req)) = self.copies.remove(&f.rid) {
                    self.forget(&req);
                }
                let _ = self.inbox.send(Inbound::Free(f.rid));
            }
            M::FlushCache(_) => {
                let _ = self.inbox.send(Inbound::FlushCache);
            }
            M::Abort(a) => {
                if let Some(Copy::Here(flag)) = self.copies.get(&a.rid) {
                    flag.store(true, Ordering::SeqCst);
                }
            }
            M::Ping(p) => {
                send(
                    &self.tx,
                    pb::remote_msg::M::Pong(pb::Pong {
                        t0_ns: p.t0_ns,
                        remote_ns: unix_ns(),
                    }),
                );
            }
            M::Load(l) => {
                // The front end's view, for this model's delayed batching (as in one process).
                let sh = &self.shared;
                for (m, (held, delaying)) in l.held.iter().zip(&l.delaying).enumerate() {
                    if m != self.state.idx && m < sh.held.len() {
                        sh.held[m].store(*held as usize, Ordering::SeqCst);
                        sh.delaying[m].store(*delaying, Ordering::SeqCst);
                    }
                }
                sh.active.store(l.active as usize, Ordering::SeqCst);
                sh.peer_in_transit
                    .store(l.in_transit as usize, Ordering::SeqCst);
            }
            M::Hello(_) | M::Configure(_) => {}
        }
    }

    /// The counters of a request this process will not see again.
    fn forget(&self, req: &Req) {
        saturating_dec(&self.shared.active, 1);
        saturating_dec(&self.shared.queued_prompt_tokens, req.prompt.len());
        self.shared.metrics.active.dec();
    }

    fn on_handoff(&mut self, h: pb::Handoff) {
        self.shared
            .metrics
            .handoff_transport
            .with_label_values(&[self.state.name.as_str()])
            .observe(unix_ns().saturating_sub(h.sent_unix_ns) as f64 * 1e-9);
        let flag = Arc::new(AtomicBool::new(false));
        let sink = || EventSink::Peer {
            out: self.state.out_tx.clone(),
            cancelled: flag.clone(),
        };
        let mut req = if h.anchor == 0 {
            match self.copies.remove(&h.rid) {
                Some(Copy::Away(old)) => self.forget(&old),
                Some(Copy::Here(f)) => {
                    self.copies.insert(h.rid, Copy::Here(f));
                    return self.fail(h.rid, "a first contact for a request already here".into());
                }
                None => {}
            }
            // Whatever KV an earlier copy left must not be extended by this one.
            let _ = self.inbox.send(Inbound::Free(h.rid));
            match mirror_from_first(&h, sink()).and_then(|r| self.in_this_vocabulary(r)) {
                Ok(r) => {
                    self.shared.active.fetch_add(1, Ordering::SeqCst);
                    self.shared
                        .queued_prompt_tokens
                        .fetch_add(r.prompt.len(), Ordering::SeqCst);
                    self.shared.metrics.active.inc();
                    Box::new(r)
                }
                Err(e) => return self.fail(h.rid, e),
            }
        } else {
            match self.copies.remove(&h.rid) {
                Some(Copy::Away(mut r)) => {
                    if let Err(e) = apply_handoff(&mut r, &h) {
                        self.forget(&r);
                        return self.fail(h.rid, e);
                    }
                    r.set_sink(sink());
                    r
                }
                other => {
                    if let Some(c) = other {
                        self.copies.insert(h.rid, c);
                    }
                    send(
                        &self.tx,
                        pb::remote_msg::M::Unknown(pb::Unknown {
                            rid: h.rid,
                            seq: h.seq,
                        }),
                    );
                    return;
                }
            }
        };
        req.handed_off = h.from.map(|f| (f as ModelIndex, Instant::now()));
        if req.handed_off.is_some() {
            self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
        }
        self.copies.insert(h.rid, Copy::Here(flag));
        let _ = self.inbox.send(Inbound::Admit(req));
    }

    /// A first contact's constraint compiled here and brought up to its output so far,
    /// and its DRY sequence breakers found in this vocabulary.
    fn in_this_vocabulary(&self, mut req: Req) -> Result<Req, String> {
        let grammar = Some(self.state.grammar.as_ref());
        if let Some(b) = self.state.dry.for_sampling(&req.sampler.config, grammar)? {
            req.sampler.set_dry_breakers(b);
        }
        if let Some(constraint) = &req.constraint {
            let compiler = self.state.grammar.get().map_err(|e| e.to_string())?;
            let grammar = compiler.compile(constraint).map_err(|e| e.to_string())?;
            req.attach_grammar(grammar)?;
        }
        Ok(req)
    }

    /// A hand-off this side cannot take: the request fails (and is done here).
    fn fail(&self, rid: u64, message: String) {
        tracing::warn!(rid, %message, "hand-off refused");
        send(
            &self.tx,
            pb::remote_msg::M::Failed(pb::Failed {
                rid,
                message: format!("sub-server `{}`: {message}", self.state.name),
            }),
        );
        send(&self.tx, pb::remote_msg::M::Done(pb::Done { rid }));
    }

    pub(super) fn on_out(&mut self, o: PeerOut) {
        use pb::remote_msg::M;
        match o {
            PeerOut::Event { rid, pos, event } => {
                if !matches!(self.copies.get(&rid), Some(Copy::Here(_))) {
                    return;
                }
                let m = match event {
                    GenerateEvent::Prompt(scores) => M::PromptScores(pb::PromptScores {
                        rid,
                        tokens: scores.iter().map(|t| token_to_pb(rid, 0, t)).collect(),
                    }),
                    GenerateEvent::PromptCached(tokens) => M::PromptCached(pb::PromptCached {
                        rid,
                        tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
                    }),
                    GenerateEvent::Token(t) => M::Token(token_to_pb(rid, pos, &t)),
                    GenerateEvent::Finished { reason } => M::Finished(pb::Finished {
                        rid,
                        reason: reason_to_pb(reason) as i32,
                    }),
                    GenerateEvent::Error(message) => M::Failed(pb::Failed { rid, message }),
                };
                send(&self.tx, m);
            }
            PeerOut::Out(Outbound::Handoff { req, to }) => {
                // The hand-off leaves this process: nobody here will take it off the count.
                saturating_dec(&self.shared.in_transit, 1);
                if !matches!(self.copies.get(&req.rid), Some(Copy::Here(_))) {
                    let _ = self.inbox.send(Inbound::Free(req.rid));
                    self.forget(&req);
                    return;
                }
                send(
                    &self.tx,
                    M::HandBack(pb::HandBack {
                        rid: req.rid,
                        to: to as u32,
                        output_len: req.output.len() as u32,
                        rng_word_pos: rng_pos_bytes(req.sampler.rng_position()),
                        sent_unix_ns: unix_ns(),
                    }),
                );
                self.copies.insert(req.rid, Copy::Away(req));
            }
            PeerOut::Out(Outbound::Done { rid }) => {
                if self.copies.remove(&rid).is_some() {
                    send(&self.tx, M::Done(pb::Done { rid }));
                }
            }
        }
    }

    pub(super) fn send_load(&mut self) {
        let idx = self.state.idx;
        let m = &self.shared.metrics;
        let load = pb::RemoteLoad {
            held: self.shared.held[idx].load(Ordering::SeqCst) as u32,
            delaying: self.shared.delaying[idx].load(Ordering::SeqCst),
            kv_used_blocks: self.shared.kv_used[idx].load(Ordering::SeqCst) as u64,
            down: self.shared.down_reason(idx),
            running: m.running.with_label_values(&[&self.state.name]).get() as u32,
            waiting: m.waiting.with_label_values(&[&self.state.name]).get() as u32,
        };
        if self.last_load.as_ref() != Some(&load) {
            send(&self.tx, pb::remote_msg::M::Load(load.clone()));
            self.last_load = Some(load);
        }
    }

    /// The session ended: requests here are cancelled (the sub-server frees their KV),
    /// copies away are freed.
    pub(super) fn end(&mut self) {
        for m in 0..self.shared.held.len() {
            if m != self.state.idx {
                self.shared.held[m].store(0, Ordering::SeqCst);
                self.shared.delaying[m].store(false, Ordering::SeqCst);
            }
        }
        self.shared.peer_in_transit.store(0, Ordering::SeqCst);
        for (rid, c) in std::mem::take(&mut self.copies) {
            match c {
                Copy::Here(flag) => flag.store(true, Ordering::SeqCst),
                Copy::Away(req) => {
                    self.forget(&req);
                    let _ = self.inbox.send(Inbound::Free(rid));
                }
            }
        }
    }
}
