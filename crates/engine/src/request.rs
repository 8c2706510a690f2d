//! A request as it travels between sub-servers: the tokens (prompt + output so far), which
//! model wrote each output token, and the sampling state. This is the whole message a
//! hand-off carries; the KV cache stays behind at each model that has seen the request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokenrouter_api::{
    FinishReason, GenerateEvent, ModelIndex, OutputConstraint, RoutingOverrides, TokenEvent,
};
use tokenrouter_grammar::Grammar;
use tokenrouter_runtime::Sampler;
use tokio::sync::mpsc::UnboundedSender;

/// Where a request's events go: to its client, or (the copy a remote sub-server keeps) to
/// the session with the front end, which forwards them.
pub enum EventSink {
    Client(UnboundedSender<GenerateEvent>),
    Peer {
        out: UnboundedSender<PeerOut>,
        /// Set when the front end says the client went away.
        cancelled: Arc<AtomicBool>,
    },
}

/// What a remote sub-server sends its front end, in one queue so that order holds: a
/// request's tokens always precede its hand-back or its end.
pub enum PeerOut {
    /// An event of a request, with its output length before the event (a token's position).
    Event {
        rid: u64,
        pos: usize,
        event: GenerateEvent,
    },
    /// What the sub-server produced (a hand-off to another model, or the request is done).
    Out(crate::subserver::Outbound),
}

pub struct Req {
    pub rid: u64,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Which model wrote each output token.
    pub sources: Vec<ModelIndex>,
    pub sampler: Sampler,
    /// Seed of this request (stable routing decisions, see `RowView::seed`).
    pub seed: u64,
    pub max_tokens: usize,
    /// EOS ids (unless ignore_eos) plus the request's stop_token_ids.
    pub stop_ids: Vec<u32>,
    pub pinned: Option<ModelIndex>,
    pub top_logprobs: usize,
    /// Score the prompt with this many alternatives per token (see
    /// `GenerateRequest::prompt_logprobs`); taken when the scores are sent.
    pub prompt_logprobs: Option<usize>,
    /// The request's overrides of the routing kwargs (checked at submission).
    pub routing: RoutingOverrides,
    /// vLLM's `priority` (lower first) where a model schedules by priority.
    pub priority: i32,
    /// vLLM's `cache_salt`: prefix-cache blocks are shared only under the same salt.
    pub cache_salt: Option<String>,
    /// Structured output: the constraint (sent to remote models, which compile their own
    /// state) and its state here, advanced by each kept token (so it travels with the
    /// request and holds whichever model writes next).
    pub constraint: Option<OutputConstraint>,
    pub grammar: Option<Box<Grammar>>,
    /// Why the request must fail at its model's next look at it (its constraint failed).
    pub fault: Option<String>,
    /// Tokens written by the current model since the request arrived there.
    pub visit_tokens: usize,
    /// The model the request came from and when it left there (hand-off latency).
    pub handed_off: Option<(ModelIndex, Instant)>,
    /// Shortest `total_len()` since [`Req::mark_returned`]: tokens at and beyond it may
    /// differ from what a remote copy of the request holds.
    low_water: usize,
    /// The cached prompt tokens were told (by the first model; a model the request reaches
    /// later with its output rewritten to empty must not tell its own).
    cached_told: bool,
    events: EventSink,
}

impl Req {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rid: u64,
        prompt: Vec<u32>,
        sampler: Sampler,
        seed: u64,
        max_tokens: usize,
        stop_ids: Vec<u32>,
        pinned: Option<ModelIndex>,
        top_logprobs: usize,
        events: impl Into<EventSink>,
    ) -> Self {
        let low_water = prompt.len();
        Self {
            rid,
            prompt,
            output: Vec::new(),
            sources: Vec::new(),
            sampler,
            seed,
            max_tokens,
            stop_ids,
            pinned,
            top_logprobs,
            prompt_logprobs: None,
            routing: RoutingOverrides::default(),
            priority: 0,
            cache_salt: None,
            constraint: None,
            grammar: None,
            fault: None,
            visit_tokens: 0,
            handed_off: None,
            low_water,
            cached_told: false,
            events: events.into(),
        }
    }

    /// The request's own routing kwargs (see `tokenrouter_api::RoutingOverrides`).
    pub fn with_routing(mut self, routing: RoutingOverrides) -> Self {
        self.routing = routing;
        self
    }

    /// Hold the output to `constraint`, compiled as `grammar` (see [`Req::grammar`]).
    pub fn with_constraint(mut self, constraint: Option<(OutputConstraint, Grammar)>) -> Self {
        if let Some((constraint, grammar)) = constraint {
            self.constraint = Some(constraint);
            self.grammar = Some(Box::new(grammar));
        }
        self
    }

    /// A remote copy's state of its constraint: `grammar` brought up to the output so far.
    pub(crate) fn attach_grammar(&mut self, mut grammar: Grammar) -> Result<(), String> {
        for &t in &self.output {
            grammar.accept(t).map_err(|e| e.to_string())?;
        }
        self.grammar = Some(Box::new(grammar));
        Ok(())
    }

    /// Ids the request may not pick next: its stop ids until `min_tokens` are written, and
    /// each bad word's last id right after the rest of it (vLLM's semantics: the output so
    /// far, whichever model wrote it).
    pub fn banned_now(&self) -> Vec<u32> {
        let config = &self.sampler.config;
        let mut banned = Vec::new();
        if self.output.len() < config.min_tokens {
            banned.extend_from_slice(&self.stop_ids);
        }
        for word in &config.bad_words {
            if let Some((&last, before)) = word.split_last() {
                if self.output.ends_with(before) {
                    banned.push(last);
                }
            }
        }
        banned
    }

    /// Ask for the prompt's scores (see [`Req::prompt_logprobs`]).
    pub fn with_prompt_logprobs(mut self, top: Option<usize>) -> Self {
        self.prompt_logprobs = top;
        self
    }

    /// vLLM's `priority` and `cache_salt`: where the request queues, which cache it shares.
    pub fn with_scheduling(mut self, priority: i32, cache_salt: Option<String>) -> Self {
        self.priority = priority;
        self.cache_salt = cache_salt;
        self
    }

    /// Scheduling order under priority scheduling: lower priority value, then older.
    pub fn schedule_key(&self) -> (i32, u64) {
        (self.priority, self.rid)
    }

    pub fn total_len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Prompt + output from position `start` on (what a model with `start` cached lacks).
    pub fn tokens_from(&self, start: usize) -> Vec<u32> {
        let p = self.prompt.len();
        if start < p {
            let mut v = self.prompt[start..].to_vec();
            v.extend_from_slice(&self.output);
            v
        } else {
            self.output[(start - p).min(self.output.len())..].to_vec()
        }
    }

    /// The client went away (its stream was dropped).
    pub fn is_cancelled(&self) -> bool {
        match &self.events {
            EventSink::Client(tx) => tx.is_closed(),
            EventSink::Peer { out, cancelled } => {
                cancelled.load(Ordering::SeqCst) || out.is_closed()
            }
        }
    }

    fn emit(&self, event: GenerateEvent, pos: usize) {
        match &self.events {
            EventSink::Client(tx) => {
                let _ = tx.send(event);
            }
            EventSink::Peer { out, .. } => {
                let _ = out.send(PeerOut::Event {
                    rid: self.rid,
                    pos,
                    event,
                });
            }
        }
    }

    /// Send the prompt's scores (one entry per prompt token after the first).
    pub fn send_prompt_scores(&self, scores: Vec<TokenEvent>) {
        self.emit(GenerateEvent::Prompt(scores), 0);
    }

    /// Tells the client how many prompt tokens the prefix cache gave, once: the first
    /// model's count (a remote copy's report is filtered by the front end's request).
    pub fn report_cached_prompt(&mut self, tokens: usize) {
        if !std::mem::replace(&mut self.cached_told, true) {
            self.emit(GenerateEvent::PromptCached(tokens), 0);
        }
    }

    /// Append a written token and stream it out.
    pub fn push_token(&mut self, ev: TokenEvent) {
        if let Some(grammar) = self.grammar.as_mut() {
            if let Err(e) = grammar.accept(ev.id) {
                self.fault = Some(e.to_string());
            }
        }
        let pos = self.output.len();
        self.sampler.observe(ev.id);
        self.output.push(ev.id);
        self.sources.push(ev.source);
        self.visit_tokens += 1;
        self.emit(GenerateEvent::Token(ev), pos);
    }

    /// Drop the last `n` output tokens (a receiver refused part of a delta).
    pub fn drop_last(&mut self, n: usize) {
        let keep = self.output.len().saturating_sub(n);
        if keep == self.output.len() {
            return;
        }
        if let Some(grammar) = self.grammar.as_mut() {
            if let Err(e) = grammar.rollback(self.output.len() - keep) {
                self.fault = Some(e.to_string());
            }
        }
        self.output.truncate(keep);
        self.sources.truncate(keep);
        self.sampler.rewind(&self.prompt, &self.output);
        self.low_water = self.low_water.min(self.total_len());
    }

    /// A remote copy's events go to its current visit's session.
    pub(crate) fn set_sink(&mut self, sink: EventSink) {
        self.events = sink;
    }

    /// The request came back from a remote copy that holds exactly its tokens now.
    pub(crate) fn mark_returned(&mut self) {
        self.low_water = self.total_len();
    }

    /// Positions that surely equal a remote copy last synced at `remote_len` positions.
    pub(crate) fn common_prefix(&self, remote_len: usize) -> usize {
        remote_len.min(self.low_water).max(self.prompt.len())
    }

    /// A remote copy catches up: keep `anchor` positions, then append output tokens (as
    /// [`Req::push_token`] would, counting them for penalties, but without events: the
    /// client already has them).
    pub(crate) fn apply_delta(
        &mut self,
        anchor: usize,
        tokens: &[u32],
        sources: &[ModelIndex],
    ) -> Result<(), String> {
        let p = self.prompt.len();
        if anchor < p || anchor > self.total_len() {
            return Err(format!(
                "delta anchored at {anchor}, outside the output (prompt {p}, total {})",
                self.total_len()
            ));
        }
        if tokens.len() != sources.len() {
            return Err(format!(
                "{} tokens but {} sources",
                tokens.len(),
                sources.len()
            ));
        }
        if let Some(grammar) = self.grammar.as_mut() {
            let dropped = self.output.len() - (anchor - p);
            grammar.rollback(dropped).map_err(|e| e.to_string())?;
            for &t in tokens {
                grammar.accept(t).map_err(|e| e.to_string())?;
            }
        }
        if self.output.len() > anchor - p {
            self.output.truncate(anchor - p);
            self.sources.truncate(anchor - p);
            self.sampler.rewind(&self.prompt, &self.output);
        }
        for (&t, &s) in tokens.iter().zip(sources) {
            self.sampler.observe(t);
            self.output.push(t);
            self.sources.push(s);
        }
        Ok(())
    }

    /// A first contact's output: appended as it was, the sampler already restored from it.
    pub(crate) fn set_output(&mut self, output: Vec<u32>, sources: Vec<ModelIndex>) {
        self.output = output;
        self.sources = sources;
        self.low_water = self.total_len();
    }

    /// Whether the request is done after its latest token, given the context limit.
    pub fn finish_reason(&self, context_limit: usize) -> Option<FinishReason> {
        if let Some(last) = self.output.last() {
            if self.stop_ids.contains(last) {
                return Some(FinishReason::Stop);
            }
        }
        // The constraint is complete: nothing but an end could follow.
        if self.grammar.as_ref().is_some_and(|g| g.must_end()) {
            return Some(FinishReason::Stop);
        }
        if self.output.len() >= self.max_tokens || self.total_len() >= context_limit {
            return Some(FinishReason::Length);
        }
        None
    }

    pub fn finish(&self, reason: FinishReason) {
        self.emit(GenerateEvent::Finished { reason }, self.output.len());
    }

    pub fn fail(&self, message: String) {
        self.emit(GenerateEvent::Error(message), self.output.len());
    }
}

impl From<UnboundedSender<GenerateEvent>> for EventSink {
    fn from(tx: UnboundedSender<GenerateEvent>) -> Self {
        EventSink::Client(tx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter_api::SamplingParams;

    fn req(prompt: usize) -> Req {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let p: Vec<u32> = (0..prompt as u32).collect();
        let s = Sampler::new(SamplingParams::greedy(), 1, &p);
        Req::new(7, p, s, 1, 100, vec![], None, 0, tx)
    }

    fn tok(id: u32, source: ModelIndex) -> TokenEvent {
        TokenEvent {
            id,
            source,
            logprob: 0.0,
            top_logprobs: vec![],
            router_score: None,
            rank: None,
        }
    }

    /// Penalties count the tokens the answer holds: one a model dropped (or a remote's
    /// delta replaced) is no longer penalised.
    #[test]
    fn dropped_tokens_leave_the_penalty_counts() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let mut c = SamplingParams::greedy();
        c.frequency_penalty = 0.5;
        let s = Sampler::new(c, 1, &[1, 2]);
        let mut r = Req::new(7, vec![1, 2], s, 1, 100, vec![], None, 0, tx);
        for t in [5, 6, 6] {
            r.push_token(tok(t, 0));
        }
        r.drop_last(1);
        assert_eq!(r.sampler.counts(), vec![(5, 1), (6, 1)]);
        r.apply_delta(2, &[9], &[1]).unwrap();
        assert_eq!(r.output, vec![9]);
        assert_eq!(r.sampler.counts(), vec![(9, 1)]);
    }

    #[test]
    fn low_water_tracks_drops() {
        let mut r = req(3);
        for i in 0..5 {
            r.push_token(tok(10 + i, 0));
        }
        r.mark_returned();
        assert_eq!(r.common_prefix(8), 8);
        r.drop_last(2);
        r.push_token(tok(99, 0));
        assert_eq!(r.total_len(), 7);
        // The copy has 8 positions; two were dropped here since: only 6 surely agree.
        assert_eq!(r.common_prefix(8), 6);
        r.mark_returned();
        assert_eq!(r.common_prefix(7), 7);
    }

    #[test]
    fn apply_delta_truncates_then_appends() {
        let mut r = req(2);
        r.set_output(vec![5, 6, 7], vec![0, 1, 0]);
        r.apply_delta(3, &[8, 9], &[0, 0]).unwrap();
        assert_eq!(r.output, vec![5, 8, 9]);
        assert_eq!(r.sources, vec![0, 0, 0]);
        assert!(r.apply_delta(1, &[1], &[0]).is_err());
        assert!(r.apply_delta(9, &[1], &[0]).is_err());
        assert!(r.apply_delta(2, &[1], &[]).is_err());
    }
}
