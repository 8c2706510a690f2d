//! After a step: the policy sees every row and decides; each request then keeps or drops
//! the token just written, finishes, stays, or is handed to another model. Rows whose
//! logits were invalid fail alone here.

use super::masks::RowMask;
use super::{Outbound, SubServer};
use crate::policy::{AllowedTokens, Decision, RowView, SendMode, StepView};
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokenrouter_api::TokenEvent;
use tokenrouter_runtime::Sampled;

impl SubServer {
    pub(super) fn after_step(
        &mut self,
        sampled: Vec<Sampled>,
        seen: StepSeen<'_>,
        out: &mut Vec<Outbound>,
    ) {
        let StepSeen {
            logits,
            entropy,
            top_logits,
            hidden,
            forced,
            allowed,
        } = seen;
        let limit = self.sample_limit;
        let decisions: Vec<Decision> = {
            let views: Vec<RowView<'_>> = self
                .running
                .iter()
                .enumerate()
                .zip(&sampled)
                .map(|((i, r), s)| RowView {
                    rid: r.rid,
                    logits: logits.map_or(&[][..], |l| &l[i][..limit.min(l[i].len())]),
                    token: s.token,
                    prompt: &r.prompt,
                    output: &r.output,
                    sources: &r.sources,
                    visit_tokens: r.visit_tokens,
                    seed: r.seed,
                    entropy: entropy.and_then(|e| e.get(i).copied()),
                    top_logits: top_logits.and_then(|t| t.get(i)).map(|t| &t[..]),
                    routing: &r.routing,
                    allowed: allowed
                        .get(i)
                        .and_then(Option::as_ref)
                        .map(|m| m as &dyn AllowedTokens),
                })
                .collect();
            let step = StepView {
                model: self.idx,
                rows: &views,
                hidden,
            };
            let mut d = self.policy.route(&step);
            d.resize(views.len(), Decision::STAY);
            d
        };
        let running = std::mem::take(&mut self.running);
        let mut counts = vec![0u64; self.shared.names.len()];
        let mut credits = vec![0u64; self.shared.names.len()];
        // Finished after the step's statistics are recorded, so a client that sees the end of
        // its request also sees everything the request's last step counted (the warm-up
        // resets the statistics when its requests end).
        let mut done = Vec::new();
        let mut failed = Vec::new();
        for (i, ((mut req, s), d)) in running.into_iter().zip(sampled).zip(decisions).enumerate() {
            if let Some(fault) = req.fault.take() {
                req.fail(fault);
                failed.push(req);
                continue;
            }
            if s.logprob.is_nan() {
                // This row's distribution is invalid: only its request fails.
                req.fail(format!(
                    "model `{}` produced invalid (NaN) logits for this request",
                    self.name()
                ));
                failed.push(req);
                continue;
            }
            // A pinned request never leaves its model. A position its constraint forces is
            // not rewritten: the other model could only write the same token.
            let to = if req.pinned.is_some() {
                None
            } else {
                d.to.filter(|&t| t != self.idx && t < self.shared.names.len())
                    .filter(|&t| {
                        !(forced.get(i).copied().unwrap_or(false)
                            && self.policy.send(req.rid, t) == SendMode::DropLast)
                    })
            };
            counts[to.unwrap_or(self.idx)] += 1;
            let keep = match to {
                None => true,
                Some(t) => self.policy.send(req.rid, t) == SendMode::KeepLast,
            };
            credits[to.unwrap_or(self.idx)] += u64::from(keep);
            if keep {
                req.push_token(TokenEvent {
                    id: s.token,
                    source: self.idx,
                    logprob: s.logprob,
                    top_logprobs: s.top,
                    router_score: d.score,
                    rank: None,
                });
                if let Some(fault) = req.fault.take() {
                    req.fail(fault);
                    failed.push(req);
                    continue;
                }
                self.shared
                    .metrics
                    .tokens
                    .with_label_values(&[self.name()])
                    .inc();
                if let Some(reason) = req.finish_reason(self.shared.context_limit) {
                    done.push((req, reason));
                    continue;
                }
            }
            match to {
                None => self.running.push(req),
                Some(t) => {
                    self.shared
                        .metrics
                        .switches
                        .with_label_values(&[self.name(), &self.shared.names[t]])
                        .inc();
                    req.handed_off = Some((self.idx, Instant::now()));
                    self.shared.in_transit.fetch_add(1, Ordering::SeqCst);
                    out.push(Outbound::Handoff { req, to: t });
                }
            }
        }
        if let Ok(mut rc) = self.shared.route_counts.lock() {
            for (t, c) in counts.into_iter().enumerate() {
                rc[self.idx][t] += c;
            }
        }
        if let Ok(mut cc) = self.shared.credit_counts.lock() {
            for (t, c) in credits.into_iter().enumerate() {
                cc[self.idx][t] += c;
            }
        }
        for (req, reason) in done {
            self.finish(req, Some(reason), out);
        }
        if !failed.is_empty() {
            tracing::error!(
                model = self.name(),
                rows = failed.len(),
                "rows failed (NaN logits or a failed output constraint)"
            );
            self.shared
                .metrics
                .failed_rows
                .with_label_values(&[self.name()])
                .inc_by(failed.len() as u64);
        }
        for req in failed {
            self.finish(req, None, out);
        }
    }
}

/// What a step produced besides the sampled tokens, for the policy's view.
pub(super) struct StepSeen<'a> {
    /// Host logits per row (absent when sampled on the device).
    pub logits: Option<&'a [Vec<f32>]>,
    /// Normalised entropy per row (`Needs::entropy`).
    pub entropy: Option<&'a [f32]>,
    /// The largest logits per row, descending (`Needs::top_logits`).
    pub top_logits: Option<&'a [Vec<f32>]>,
    pub hidden: Option<&'a candle_core::Tensor>,
    /// Per row: its constraint left one token (or only the end) to pick.
    pub forced: &'a [bool],
    /// Per row: the tokens it may write (`None`: unconstrained).
    pub allowed: &'a [Option<RowMask>],
}
