//! `Engine` as the server's `Backend`: model list, readiness, tokenizer and chat template,
//! and request submission (validation, sampling state, hand-over to the inter-model loop).

use super::Engine;
use crate::exchange::ToExchange;
use crate::request::Req;
use std::sync::atomic::Ordering;
use tokenrouter_api::{
    Backend, ChatMessage, GenerateRequest, GenerateStream, ModelInfo, SubmitError, TextError,
};
use tokenrouter_runtime::{Message, Sampler, SamplingConfig};

impl Backend for Engine {
    fn models(&self) -> Vec<ModelInfo> {
        match self.inner.infos.get() {
            Some(i) => i.clone(),
            None => self
                .inner
                .config
                .models()
                .unwrap_or_default()
                .into_iter()
                .map(|m| ModelInfo {
                    name: m.name,
                    source: m.section.model_path,
                    context_length: 0,
                })
                .collect(),
        }
    }

    fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst) && self.inner.alive.load(Ordering::SeqCst)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let t = self
            .text()
            .ok_or_else(|| TextError::Tokenizer("the models are still loading".into()))?;
        t.encode(text)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        let t = self
            .text()
            .ok_or_else(|| TextError::Tokenizer("the models are still loading".into()))?;
        t.decode(ids, skip_special)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Value,
    ) -> Result<String, TextError> {
        let t = self
            .text()
            .ok_or_else(|| TextError::Template("the models are still loading".into()))?;
        let msgs: Vec<Message> = messages
            .iter()
            .map(|m| Message {
                role: m.role.clone(),
                content: m.content.clone(),
            })
            .collect();
        t.apply_chat_template(&msgs, add_generation_prompt, kwargs)
            .map_err(|e| TextError::Template(e.to_string()))
    }

    fn submit(&self, request: GenerateRequest) -> Result<GenerateStream, SubmitError> {
        if !self.is_ready() {
            return Err(SubmitError::NotReady(
                self.load_error()
                    .unwrap_or_else(|| "the models are still loading".into()),
            ));
        }
        self.submit_loaded(request)
    }

    fn metrics_text(&self) -> String {
        self.inner.metrics.text()
    }
}

impl Engine {
    /// Forget request metrics served before now (see `EngineMetrics::reset_requests`).
    pub(crate) fn reset_request_metrics(&self) {
        self.inner.metrics.reset_requests();
    }

    /// `submit` once the loops run, before or after the engine reports ready (the warm-up
    /// uses it before).
    pub(crate) fn submit_loaded(
        &self,
        request: GenerateRequest,
    ) -> Result<GenerateStream, SubmitError> {
        let (Some(shared), Some(text)) = (self.inner.shared.get(), self.text()) else {
            return Err(SubmitError::NotReady("the models are still loading".into()));
        };
        if request.prompt_ids.is_empty() {
            return Err(SubmitError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some(p) = request.pinned_model {
            if p >= shared.names.len() {
                return Err(SubmitError::InvalidRequest(format!(
                    "no model with index {p}"
                )));
            }
        }
        if request.max_tokens == 0 {
            return Err(SubmitError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        let need = request.prompt_ids.len() + request.max_tokens;
        if need > shared.context_limit {
            return Err(SubmitError::ContextTooLong {
                prompt_tokens: request.prompt_ids.len(),
                max_tokens: request.max_tokens,
                context_length: shared.context_limit,
            });
        }
        let limit = self.inner.config.system.max_queued_requests;
        let active = shared.active.load(Ordering::SeqCst);
        if active >= limit {
            return Err(SubmitError::QueueFull {
                queued: active,
                limit,
            });
        }
        let rid = self.inner.next_rid.fetch_add(1, Ordering::SeqCst);
        let s = &request.sampling;
        let seed = s.seed.unwrap_or_else(rand::random);
        let cfg = SamplingConfig {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: s.logit_bias.clone(),
        };
        let sampler = Sampler::new(cfg, seed, &request.prompt_ids);
        let mut stop_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_ids.extend_from_slice(text.eos_ids());
        }
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        let req = Req::new(
            rid,
            request.prompt_ids,
            sampler,
            seed,
            request.max_tokens,
            stop_ids,
            request.pinned_model,
            request.top_logprobs,
            etx,
        );
        let tx = self.inner.to_exchange.lock().ok().and_then(|t| t.clone());
        let Some(tx) = tx else {
            return Err(SubmitError::NotReady("the engine is shutting down".into()));
        };
        shared.active.fetch_add(1, Ordering::SeqCst);
        self.inner.metrics.active.inc();
        if tx.send(ToExchange::Submit(Box::new(req))).is_err() {
            shared.active.fetch_sub(1, Ordering::SeqCst);
            self.inner.metrics.active.dec();
            return Err(SubmitError::NotReady("the engine has stopped".into()));
        }
        Ok(GenerateStream {
            request_id: rid,
            events: erx,
        })
    }
}
