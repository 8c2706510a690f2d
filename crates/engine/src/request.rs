//! A request as it travels between sub-servers: the tokens (prompt + output so far), which
//! model wrote each output token, and the sampling state. This is the whole message a
//! hand-off carries; the KV cache stays behind at each model that has seen the request.

use std::time::Instant;
use tokenrouter_api::{FinishReason, GenerateEvent, ModelIndex, RoutingOverrides, TokenEvent};
use tokenrouter_runtime::Sampler;
use tokio::sync::mpsc::UnboundedSender;

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
    /// The request's overrides of the routing kwargs (checked at submission).
    pub routing: RoutingOverrides,
    /// Tokens written by the current model since the request arrived there.
    pub visit_tokens: usize,
    /// The model the request came from and when it left there (hand-off latency).
    pub handed_off: Option<(ModelIndex, Instant)>,
    events: UnboundedSender<GenerateEvent>,
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
        events: UnboundedSender<GenerateEvent>,
    ) -> Self {
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
            routing: RoutingOverrides::default(),
            visit_tokens: 0,
            handed_off: None,
            events,
        }
    }

    /// The request's own routing kwargs (see `tokenrouter_api::RoutingOverrides`).
    pub fn with_routing(mut self, routing: RoutingOverrides) -> Self {
        self.routing = routing;
        self
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
        self.events.is_closed()
    }

    /// Append a written token and stream it out.
    pub fn push_token(&mut self, ev: TokenEvent) {
        self.sampler.observe(ev.id);
        self.output.push(ev.id);
        self.sources.push(ev.source);
        self.visit_tokens += 1;
        let _ = self.events.send(GenerateEvent::Token(ev));
    }

    /// Drop the last `n` output tokens (a receiver refused part of a delta).
    pub fn drop_last(&mut self, n: usize) {
        let keep = self.output.len().saturating_sub(n);
        self.output.truncate(keep);
        self.sources.truncate(keep);
    }

    /// Whether the request is done after its latest token, given the context limit.
    pub fn finish_reason(&self, context_limit: usize) -> Option<FinishReason> {
        if let Some(last) = self.output.last() {
            if self.stop_ids.contains(last) {
                return Some(FinishReason::Stop);
            }
        }
        if self.output.len() >= self.max_tokens || self.total_len() >= context_limit {
            return Some(FinishReason::Length);
        }
        None
    }

    pub fn finish(&self, reason: FinishReason) {
        let _ = self.events.send(GenerateEvent::Finished { reason });
    }

    pub fn fail(&self, message: String) {
        let _ = self.events.send(GenerateEvent::Error(message));
    }
}
