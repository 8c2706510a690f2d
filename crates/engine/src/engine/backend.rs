//! `Engine` as the server's `Backend`: model list, readiness, tokenizer and chat template,
//! and request submission (validation, sampling state, hand-over to the inter-model loop).

use super::Engine;
use crate::exchange::ToExchange;
use crate::request::Req;
use crate::subserver::Shared;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokenrouter_api::{
    Backend, ChatMessage, GenerateRequest, GenerateStream, ModelInfo, ModelLoad, OutputConstraint,
    RoutingOverrides, SamplingParams, SubmitError, TextError, CONSTRAINT_PARAM,
};
use tokenrouter_grammar::{Grammar, GrammarCompiler, GrammarError};
use tokenrouter_runtime::sampling::DryBreakers;
use tokenrouter_runtime::Sampler;

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
        t.apply_chat_template(messages, add_generation_prompt, kwargs)
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

    fn submit_all(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateStream>, SubmitError> {
        if !self.is_ready() {
            return Err(SubmitError::NotReady(
                self.load_error()
                    .unwrap_or_else(|| "the models are still loading".into()),
            ));
        }
        self.submit_all_loaded(requests)
    }

    fn metrics_text(&self) -> String {
        self.inner.metrics.text()
    }

    fn load(&self) -> Vec<ModelLoad> {
        let m = &self.inner.metrics;
        self.models()
            .into_iter()
            .map(|model| {
                let of = |g: &prometheus::GaugeVec| g.with_label_values(&[&model.name]).get();
                ModelLoad {
                    running: of(&m.running) as usize,
                    waiting: of(&m.waiting) as usize,
                    kv_usage: of(&m.kv_usage),
                    kv_tokens: of(&m.kv_used_tokens) as usize,
                    name: model.name,
                }
            })
            .collect()
    }

    fn flush_cache(&self) -> Result<(), SubmitError> {
        let tx = self.inner.to_exchange.lock().ok().and_then(|t| t.clone());
        match tx.map(|tx| tx.send(ToExchange::FlushCache)) {
            Some(Ok(())) => Ok(()),
            _ => Err(SubmitError::NotReady("the engine is not running".into())),
        }
    }

    fn unhealthy(&self) -> Vec<(String, String)> {
        self.inner
            .shared
            .get()
            .map(|s| s.unhealthy())
            .unwrap_or_default()
    }

    fn fim_routing(&self) -> RoutingOverrides {
        self.inner
            .shared
            .get()
            .and_then(|s| s.tunables.get())
            .map(|t| t.fim().clone())
            .unwrap_or_default()
    }
}

/// Most `logit_bias` entries a request may carry (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Most `stop_token_ids` a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// Most token ids in a request's `bad_words`, all words together (each is checked at every
/// step).
pub const MAX_BAD_WORD_IDS: usize = 4096;

/// Every token id a request carries must be a real token of every model (below the shared
/// sample limit: padding ids and ids past a model's vocabulary are refused here, so a bad id
/// never reaches a step it would share with other requests).
fn check_token_ids(request: &GenerateRequest, limit: usize) -> Result<(), SubmitError> {
    let invalid = |param: &str, message: String| SubmitError::InvalidField {
        param: param.to_string(),
        message,
    };
    if let Some((i, id)) = request
        .prompt_ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= limit)
    {
        return Err(invalid(
            "prompt",
            format!(
                "token id {id} at position {i} is not in the vocabulary (valid ids: 0..{limit})"
            ),
        ));
    }
    if request.sampling.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(invalid(
            "logit_bias",
            format!(
                "at most {MAX_LOGIT_BIAS} entries, got {}",
                request.sampling.logit_bias.len()
            ),
        ));
    }
    if let Some((id, _)) = request
        .sampling
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= limit)
    {
        return Err(invalid(
            "logit_bias",
            format!("token id {id} is not in the vocabulary (valid ids: 0..{limit})"),
        ));
    }
    if request.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} ids, got {}",
                request.stop_token_ids.len()
            ),
        ));
    }
    if let Some(id) = request
        .stop_token_ids
        .iter()
        .find(|&&id| id as usize >= limit)
    {
        return Err(invalid(
            "stop_token_ids",
            format!("token id {id} is not in the vocabulary (valid ids: 0..{limit})"),
        ));
    }
    let s = &request.sampling;
    let allowed = s.allowed_token_ids.iter().flatten();
    if let Some(id) = allowed.clone().find(|&&id| id as usize >= limit) {
        return Err(invalid(
            "allowed_token_ids",
            format!("token id {id} is not in the vocabulary (valid ids: 0..{limit})"),
        ));
    }
    let bad_ids: usize = s.bad_words.iter().map(Vec::len).sum();
    if bad_ids > MAX_BAD_WORD_IDS {
        return Err(invalid(
            "bad_words",
            format!("at most {MAX_BAD_WORD_IDS} tokens in all, got {bad_ids}"),
        ));
    }
    if let Some(id) = s
        .bad_words
        .iter()
        .flatten()
        .find(|&&id| id as usize >= limit)
    {
        return Err(invalid(
            "bad_words",
            format!("token id {id} is not in the vocabulary (valid ids: 0..{limit})"),
        ));
    }
    if let Some(max) = request.max_tokens.filter(|&max| s.min_tokens > max) {
        return Err(invalid(
            "min_tokens",
            format!(
                "`min_tokens` ({}) must not exceed `max_tokens` ({max})",
                s.min_tokens
            ),
        ));
    }
    s.validate()?;
    Ok(())
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
        let mut streams = self.submit_all_loaded(vec![request])?;
        streams
            .pop()
            .ok_or_else(|| SubmitError::NotReady("nothing was submitted".into()))
    }

    /// Admission of several requests as one (the choices and prompts of one HTTP request):
    /// every request is validated first, then room for all of them is reserved in one atomic
    /// step, so a refused batch holds nothing and never crowds out other clients.
    pub(crate) fn submit_all_loaded(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<GenerateStream>, SubmitError> {
        let (Some(shared), Some(text)) = (self.inner.shared.get(), self.text()) else {
            return Err(SubmitError::NotReady("the models are still loading".into()));
        };
        let bounds = requests
            .iter()
            .map(|request| validate(request, shared))
            .collect::<Result<Vec<_>, _>>()?;
        let mut grammars = requests
            .iter()
            .map(|request| self.grammar_for(request))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let mut breakers = requests
            .iter()
            .map(|request| self.dry_breakers_for(&request.sampling))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let n = requests.len();
        let limit = self.inner.config.system.max_queued_requests;
        if let Err(active) = shared
            .active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |a| {
                (a + n <= limit).then_some(a + n)
            })
        {
            return Err(SubmitError::QueueFull {
                queued: active,
                limit,
            });
        }
        let tokens: usize = requests.iter().map(|r| r.prompt_ids.len()).sum();
        let token_limit = self.inner.config.system.max_queued_prompt_tokens;
        if let Err(queued) =
            shared
                .queued_prompt_tokens
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                    (q + tokens <= token_limit).then_some(q + tokens)
                })
        {
            shared.active.fetch_sub(n, Ordering::SeqCst);
            return Err(SubmitError::PromptTokensFull {
                queued,
                requested: tokens,
                limit: token_limit,
            });
        }
        let tx = self.inner.to_exchange.lock().ok().and_then(|t| t.clone());
        let Some(tx) = tx else {
            shared.active.fetch_sub(n, Ordering::SeqCst);
            shared
                .queued_prompt_tokens
                .fetch_sub(tokens, Ordering::SeqCst);
            return Err(SubmitError::NotReady("the engine is shutting down".into()));
        };
        let mut streams = Vec::with_capacity(n);
        let mut unsent_tokens = tokens;
        for (i, (request, max_tokens)) in requests.into_iter().zip(bounds).enumerate() {
            let len = request.prompt_ids.len();
            let (mut req, stream) = self.build_req(request, max_tokens, text.eos_ids());
            if let Some(b) = breakers.next().flatten() {
                req.sampler.set_dry_breakers(b);
            }
            let req = req.with_constraint(grammars.next().flatten());
            self.inner.metrics.active.inc();
            if tx.send(ToExchange::Submit(Box::new(req))).is_err() {
                // The loop is gone: this and the unsent ones were never admitted (the ones
                // already sent end with the loop).
                shared.active.fetch_sub(n - i, Ordering::SeqCst);
                shared
                    .queued_prompt_tokens
                    .fetch_sub(unsent_tokens, Ordering::SeqCst);
                self.inner.metrics.active.sub((n - i) as i64);
                return Err(SubmitError::NotReady("the engine has stopped".into()));
            }
            unsent_tokens -= len;
            streams.push(stream);
        }
        Ok(streams)
    }

    /// A constrained request's constraint and its grammar state
    /// (`GenerateRequest::constraint`).
    fn grammar_for(
        &self,
        request: &GenerateRequest,
    ) -> Result<Option<(OutputConstraint, Grammar)>, SubmitError> {
        let Some(constraint) = &request.constraint else {
            return Ok(None);
        };
        let compiler = self
            .grammar_compiler()
            .map_err(|e| SubmitError::InvalidRequest(e.to_string()))?;
        match compiler.compile(constraint) {
            Ok(grammar) => Ok(Some((constraint.clone(), grammar))),
            Err(GrammarError::Invalid(reason)) => Err(SubmitError::InvalidField {
                param: CONSTRAINT_PARAM.into(),
                message: format!("invalid output constraint: {reason}"),
            }),
            Err(e) => Err(SubmitError::InvalidRequest(e.to_string())),
        }
    }

    /// DRY's sequence breakers for a request that runs DRY, in the served vocabulary.
    fn dry_breakers_for(
        &self,
        sampling: &SamplingParams,
    ) -> Result<Option<Arc<DryBreakers>>, SubmitError> {
        let compiler = self.inner.grammar.get().map(Arc::as_ref);
        self.inner
            .dry
            .for_sampling(sampling, compiler)
            .map_err(|e| SubmitError::NotReady(format!("DRY sequence breakers: {e}")))
    }

    /// The token table of structured output, built once (the entry model's tokenizer: the
    /// models share their token ids).
    pub(crate) fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, GrammarError> {
        self.inner
            .grammar
            .get()
            .ok_or_else(|| GrammarError::Tokenizer("the models are still loading".into()))?
            .get()
    }

    /// The engine-side request (sampling state, stop ids) and the client's stream.
    fn build_req(
        &self,
        request: GenerateRequest,
        max_tokens: usize,
        eos_ids: &[u32],
    ) -> (Req, GenerateStream) {
        let rid = self.inner.next_rid.fetch_add(1, Ordering::SeqCst);
        let mut s = request.sampling.clone();
        if s.ban_eos && request.ignore_eos {
            // llama.cpp's ignore_eos: the ids that would end the answer are never drawn.
            s.bad_words.extend(eos_ids.iter().map(|&id| vec![id]));
            s.ban_eos = false;
        }
        let seed = s.seed.unwrap_or_else(rand::random);
        let sampler = Sampler::new(s, seed, &request.prompt_ids);
        let mut stop_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_ids.extend_from_slice(eos_ids);
        }
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        let req = Req::new(
            rid,
            request.prompt_ids,
            sampler,
            seed,
            max_tokens,
            stop_ids.clone(),
            request.pinned_model,
            request.top_logprobs,
            etx,
        )
        .with_routing(request.routing)
        .with_prompt_logprobs(request.prompt_logprobs)
        .with_scheduling(request.priority, request.cache_salt);
        (
            req,
            GenerateStream {
                request_id: rid,
                max_tokens,
                stop_ids,
                events: erx,
            },
        )
    }
}

/// Everything about one request that can be checked before admission, against the models
/// that will serve it.
/// Returns the request's output bound.
fn validate(request: &GenerateRequest, shared: &Shared) -> Result<usize, SubmitError> {
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
    if request.priority != 0 && !shared.priority_scheduling {
        return Err(SubmitError::InvalidField {
            param: "priority".into(),
            message: format!(
                "priority {} needs priority scheduling, which is off \
                 (system.scheduling_policy: priority; --scheduling-policy priority)",
                request.priority
            ),
        });
    }
    if request.prompt_logprobs.is_some() && request.pinned_model.is_none() {
        return Err(SubmitError::InvalidField {
            param: "prompt_logprobs".into(),
            message: "prompt log-probabilities come from one model: pin the request to one \
                      (a routed request's prompt is read by the entry model alone)"
                .into(),
        });
    }
    // A routed request may visit every model; a pinned one only its own.
    let visits: Vec<usize> = match request.pinned_model {
        Some(p) => vec![p],
        None => (0..shared.names.len()).collect(),
    };
    if let Some((m, reason)) = visits
        .iter()
        .find_map(|&m| shared.down_reason(m).map(|r| (m, r)))
    {
        return Err(SubmitError::NotReady(format!(
            "model `{}` is down: {reason}",
            shared.names[m]
        )));
    }
    check_token_ids(request, shared.sample_limit)?;
    if let Some(tunables) = shared.tunables.get() {
        tunables.check(&request.routing)?;
    }
    request.output_bound(shared.context_limit)
}
