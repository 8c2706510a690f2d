//! The front end's stand-in for a sub-server in another process. The inter-model loop
//! delivers to it as to a sub-server thread; it sends each arriving request as a hand-off
//! (only the delta after the first contact), parks the request while the remote holds it,
//! applies the tokens the remote writes (so the client streams them as they come), and
//! gives the request back to the loop when the remote hands it on or finishes it. When the
//! connection breaks the model is down (`/health` names it, its requests fail at once) and
//! the proxy reconnects by itself.

use super::convert::{handoff, reason_from_pb, token_from_pb};
use super::dial::{send, Connected, Dial, FrontTx, Session};
use super::saturating_dec;
use crate::exchange::ToExchange;
use crate::request::Req;
use crate::subserver::{Inbound, Outbound, Shared};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokenrouter_api::ModelIndex;
use tokenrouter_wire::{pb, rng_pos_from, source_chain};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Live counters of the proxies, for metrics and tests.
#[derive(Default)]
pub struct ProxyStats {
    pub reconnects: AtomicUsize,
    pub first_contact_resends: AtomicUsize,
}

struct Proxy {
    dial: Dial,
    configure: pb::Configure,
    shared: Arc<Shared>,
    exchange: mpsc::Sender<ToExchange>,
    parked: HashMap<u64, Parked>,
    /// Positions of each live request's copy at the remote, after its last visit there.
    remote_len: HashMap<u64, usize>,
    seq: u64,
    timeout: Duration,
    max_backoff: Duration,
    stats: Arc<ProxyStats>,
}

struct Parked {
    req: Box<Req>,
    abort_sent: bool,
}

/// Start the proxy of a connected remote on `rt`; the returned sender is its inbox.
pub(crate) fn spawn_proxy(
    rt: &tokio::runtime::Handle,
    c: Connected,
    shared: Arc<Shared>,
    exchange: mpsc::Sender<ToExchange>,
    stats: Arc<ProxyStats>,
) -> UnboundedSender<Inbound> {
    let Connected {
        dial,
        session,
        configure,
        timings,
    } = c;
    let (tx, rx) = unbounded_channel();
    let proxy = Proxy {
        dial,
        configure,
        shared,
        exchange,
        parked: HashMap::new(),
        remote_len: HashMap::new(),
        seq: 0,
        timeout: timings.timeout,
        max_backoff: timings.max_backoff,
        stats,
    };
    rt.spawn(proxy.run(rx, session));
    tx
}

impl Proxy {
    fn idx(&self) -> ModelIndex {
        self.dial.idx
    }

    async fn run(mut self, mut inbox: UnboundedReceiver<Inbound>, first: Session) {
        let mut session = Some(first);
        loop {
            if let Some(s) = session.take() {
                match self.serve(s, &mut inbox).await {
                    None => return,
                    Some(reason) => self.go_down(reason),
                }
            }
            let mut backoff = Duration::from_millis(100);
            while session.is_none() {
                tokio::select! {
                    m = inbox.recv() => match m {
                        None => return,
                        Some(m) => self.accept_while_down(m),
                    },
                    _ = tokio::time::sleep(backoff) => {
                        match self.reopen().await {
                            Ok(s) => {
                                tracing::info!(model = %self.dial.name, addr = %self.dial.addr, "reconnected");
                                self.stats.reconnects.fetch_add(1, Ordering::SeqCst);
                                self.shared
                                    .metrics
                                    .remote_reconnects
                                    .with_label_values(&[self.dial.name.as_str()])
                                    .inc();
                                if let Ok(mut slot) = self.shared.down[self.idx()].lock() {
                                    *slot = None;
                                }
                                session = Some(s);
                            }
                            Err(e) => {
                                self.set_down(format!("unreachable at {}: {e}", self.dial.addr));
                                backoff = (backoff * 2).min(self.max_backoff);
                            }
                        }
                    }
                }
            }
        }
    }

    async fn reopen(&self) -> Result<Session, String> {
        let mut s = self.dial.open().await?;
        s.configure(self.configure, Duration::from_secs(60)).await?;
        Ok(s)
    }

    /// One session, until the inbox closes (engine shutdown: None) or the connection breaks.
    async fn serve(
        &mut self,
        s: Session,
        inbox: &mut UnboundedReceiver<Inbound>,
    ) -> Option<String> {
        let Session { tx, mut rx, .. } = s;
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ping = tokio::time::interval(Duration::from_millis(500));
        let mut last_heard = Instant::now();
        let mut last_load = None;
        loop {
            tokio::select! {
                m = inbox.recv() => match m {
                    None => return None,
                    Some(Inbound::Admit(req)) => {
                        if !self.admit(req, &tx) {
                            return Some("the connection closed".into());
                        }
                    }
                    Some(Inbound::Free(rid)) => {
                        self.remote_len.remove(&rid);
                        send(&tx, pb::front_msg::M::Free(pb::Free { rid }));
                    }
                    Some(Inbound::FlushCache) => {
                        send(&tx, pb::front_msg::M::FlushCache(pb::FlushCache {}));
                    }
                },
                msg = rx.message() => match msg {
                    Ok(Some(pb::RemoteMsg { m: Some(m) })) => {
                        last_heard = Instant::now();
                        self.on_remote(m, &tx);
                    }
                    Ok(Some(_)) => last_heard = Instant::now(),
                    Ok(None) => return Some("the sub-server closed the connection".into()),
                    Err(status) => return Some(source_chain(&status)),
                },
                _ = tick.tick() => {
                    self.send_load(&tx, &mut last_load);
                    for p in self.parked.values_mut() {
                        if !p.abort_sent && p.req.is_cancelled() {
                            p.abort_sent = true;
                            send(&tx, pb::front_msg::M::Abort(pb::Abort { rid: p.req.rid }));
                        }
                    }
                    if last_heard.elapsed() > self.timeout {
                        return Some(format!("no answer for {:.1} s", self.timeout.as_secs_f64()));
                    }
                }
                _ = ping.tick() => {
                    send(&tx, pb::front_msg::M::Ping(pb::Ping { t0_ns: tokenrouter_wire::unix_ns() }));
                }
            }
        }
    }

    fn observe_bytes(&self, h: &pb::Handoff) {
        let kind = if h.first.is_some() { "first" } else { "delta" };
        self.shared
            .metrics
            .handoff_bytes
            .with_label_values(&[self.dial.name.as_str(), kind])
            .observe(prost::Message::encoded_len(h) as f64);
    }

    /// What the remote's delayed batching needs from here, when it changed.
    fn send_load(&self, tx: &FrontTx, last: &mut Option<pb::FrontLoad>) {
        let sh = &self.shared;
        let load = pb::FrontLoad {
            active: sh.active.load(Ordering::SeqCst) as u32,
            held: sh
                .held
                .iter()
                .map(|h| h.load(Ordering::SeqCst) as u32)
                .collect(),
            delaying: sh
                .delaying
                .iter()
                .map(|d| d.load(Ordering::SeqCst))
                .collect(),
            in_transit: sh.in_transit.load(Ordering::SeqCst) as u32,
        };
        if last.as_ref() != Some(&load) {
            send(tx, pb::front_msg::M::Load(load.clone()));
            *last = Some(load);
        }
    }

    fn publish_held(&self) {
        self.shared.held[self.idx()].store(self.parked.len(), Ordering::SeqCst);
    }

    fn admit(&mut self, mut req: Box<Req>, tx: &FrontTx) -> bool {
        if req.handed_off.is_some() {
            // The remote counts its own arrivals; here the hand-off has landed.
            saturating_dec(&self.shared.in_transit, 1);
        }
        req.visit_tokens = 0;
        self.seq += 1;
        let h = handoff(&req, self.remote_len.get(&req.rid).copied(), self.seq);
        self.observe_bytes(&h);
        self.parked.insert(
            req.rid,
            Parked {
                req,
                abort_sent: false,
            },
        );
        self.publish_held();
        send(tx, pb::front_msg::M::Handoff(h))
    }

    fn on_remote(&mut self, m: pb::remote_msg::M, tx: &FrontTx) {
        use pb::remote_msg::M;
        match m {
            M::Token(t) => {
                if let Some(p) = self.parked.get_mut(&t.rid) {
                    let len = p.req.output.len();
                    let pos = t.pos as usize;
                    if pos > len {
                        tracing::warn!(rid = t.rid, pos, len, "token beyond the output");
                        return;
                    }
                    p.req.drop_last(len - pos);
                    let ev = token_from_pb(&t);
                    if ev.source == self.dial.idx {
                        self.shared
                            .metrics
                            .tokens
                            .with_label_values(&[&self.dial.name])
                            .inc();
                    }
                    p.req.push_token(ev);
                }
            }
            M::PromptScores(scores) => {
                if let Some(p) = self.parked.get_mut(&scores.rid) {
                    p.req.prompt_logprobs = None;
                    p.req
                        .send_prompt_scores(scores.tokens.iter().map(token_from_pb).collect());
                }
            }
            M::PromptCached(c) => {
                if let Some(p) = self.parked.get_mut(&c.rid) {
                    p.req.report_cached_prompt(c.tokens as usize);
                }
            }
            M::Finished(f) => {
                if let Some(p) = self.parked.get(&f.rid) {
                    p.req.finish(reason_from_pb(f.reason));
                }
            }
            M::Failed(f) => {
                if let Some(p) = self.parked.get(&f.rid) {
                    p.req.fail(f.message);
                }
            }
            M::HandBack(h) => {
                let Some(Parked { mut req, .. }) = self.parked.remove(&h.rid) else {
                    return;
                };
                self.publish_held();
                let len = req.output.len();
                req.drop_last(len.saturating_sub(h.output_len as usize));
                if let Ok(pos) = rng_pos_from(&h.rng_word_pos) {
                    req.sampler.set_rng_position(pos);
                }
                req.mark_returned();
                self.remote_len.insert(req.rid, req.total_len());
                let to = h.to as ModelIndex;
                if to >= self.shared.names.len() {
                    req.fail(format!(
                        "model `{}` handed the request to model {to}",
                        self.dial.name
                    ));
                    self.finish_here(req);
                    return;
                }
                self.shared
                    .metrics
                    .switches
                    .with_label_values(&[&self.dial.name, &self.shared.names[to]])
                    .inc();
                self.shared
                    .metrics
                    .handoff_transport
                    .with_label_values(&[&self.shared.names[to]])
                    .observe(
                        tokenrouter_wire::unix_ns().saturating_sub(h.sent_unix_ns) as f64 * 1e-9,
                    );
                req.handed_off = Some((self.idx(), Instant::now()));
                self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
                let _ = self
                    .exchange
                    .send(ToExchange::Out(self.idx(), Outbound::Handoff { req, to }));
            }
            M::Done(d) => {
                self.remote_len.remove(&d.rid);
                if let Some(p) = self.parked.remove(&d.rid) {
                    self.publish_held();
                    self.finish_here(p.req);
                }
            }
            M::Unknown(u) => {
                // The remote lost its copy (restarted, or evicted it): send everything once.
                self.remote_len.remove(&u.rid);
                if let Some(p) = self.parked.get(&u.rid) {
                    self.stats
                        .first_contact_resends
                        .fetch_add(1, Ordering::SeqCst);
                    self.shared
                        .metrics
                        .remote_resends
                        .with_label_values(&[self.dial.name.as_str()])
                        .inc();
                    self.seq += 1;
                    let h = handoff(&p.req, None, self.seq);
                    self.observe_bytes(&h);
                    send(tx, pb::front_msg::M::Handoff(h));
                }
            }
            M::Load(l) => {
                let idx = self.idx();
                self.shared.kv_used[idx].store(l.kv_used_blocks as usize, Ordering::SeqCst);
                self.shared.delaying[idx].store(l.delaying, Ordering::SeqCst);
                let m = &self.shared.metrics;
                m.running
                    .with_label_values(&[&self.dial.name])
                    .set(l.running as f64);
                m.waiting
                    .with_label_values(&[&self.dial.name])
                    .set(l.waiting as f64);
                if let Some(reason) = l.down {
                    self.set_down(reason);
                }
            }
            M::Pong(_) | M::Welcome(_) | M::Ready(_) | M::Refuse(_) => {}
        }
    }

    /// The front's half of a request finishing at the remote: the engine's counters, and the
    /// loop frees its KV at the models it visited before.
    fn finish_here(&self, req: Box<Req>) {
        saturating_dec(&self.shared.active, 1);
        saturating_dec(&self.shared.queued_prompt_tokens, req.prompt.len());
        self.shared.metrics.active.dec();
        let _ = self
            .exchange
            .send(ToExchange::Out(self.idx(), Outbound::Done { rid: req.rid }));
    }

    fn set_down(&self, reason: String) {
        if let Ok(mut slot) = self.shared.down[self.idx()].lock() {
            *slot = Some(reason);
        }
    }

    /// The connection broke: every request the remote held fails now, with the reason.
    fn go_down(&mut self, reason: String) {
        let reason = format!("unreachable at {}: {reason}", self.dial.addr);
        tracing::error!(model = %self.dial.name, %reason, "remote sub-server is down");
        self.set_down(reason.clone());
        let message = format!("model `{}` is down: {reason}", self.dial.name);
        for (_, p) in std::mem::take(&mut self.parked) {
            p.req.fail(message.clone());
            self.finish_here(p.req);
        }
        self.remote_len.clear();
        self.publish_held();
        self.shared.kv_used[self.idx()].store(0, Ordering::SeqCst);
        self.shared.delaying[self.idx()].store(false, Ordering::SeqCst);
    }

    fn accept_while_down(&mut self, m: Inbound) {
        if let Inbound::Admit(req) = m {
            if req.handed_off.is_some() {
                saturating_dec(&self.shared.in_transit, 1);
            }
            let reason = self
                .shared
                .down_reason(self.idx())
                .unwrap_or_else(|| "disconnected".into());
            req.fail(format!("model `{}` is down: {reason}", self.dial.name));
            self.finish_here(req);
        }
    }
}
