//! Runs the engine requests of one HTTP request (n choices, possibly several prompts) and
//! merges their progress into one sequence of [`ChoiceUpdate`]s, consumed by the streaming
//! and the non-streaming responders alike. Each choice owns its `GenerateStream`: dropping
//! the [`Generation`] (client gone, response finished) or a stop string drops it, which
//! aborts the request in the engine. A server shutdown aborts through the lifecycle signal.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use tokenrouter_api::{
    Backend, FinishReason, GenerateEvent, GenerateStream, SubmitError, TextError, TokenEvent,
    CONSTRAINT_PARAM,
};
use tokio::sync::watch;

use crate::aborts::AbortOnRid;
use crate::choice::{ChoiceDecoder, Delta, Step, StopMatch};
use crate::error::ApiError;
use crate::metrics::RequestTracker;
use crate::openai::response::Usage;
use crate::params::GenerationPlan;
use crate::state::AppState;

/// Progress of one choice.
#[derive(Debug)]
pub enum ChoiceUpdate {
    /// The prompt's scores (asked by `echo` with `logprobs`), before any delta.
    Prompt {
        index: usize,
        scores: Vec<TokenEvent>,
    },
    Delta {
        index: usize,
        delta: Delta,
    },
    Finished {
        index: usize,
        delta: Delta,
        reason: &'static str,
        /// The stop string or stop id that ended it, if one did.
        stopped_by: Option<StopMatch>,
    },
    Failed(ApiError),
}

/// All choices of one request, in flight.
pub struct Generation {
    choices: SelectAll<BoxStream<'static, ChoiceUpdate>>,
    tracker: RequestTracker,
    pub prompt_tokens: usize,
    pub num_choices: usize,
    /// Each choice's output bound, as the backend applied it.
    pub max_tokens: Vec<usize>,
    /// Each choice's prompt tokens taken from the prefix cache, as the engine reports them.
    cached: Arc<[AtomicUsize]>,
    /// Registered for SGLang's `/abort_request` while the generation lives.
    _abortable: Option<AbortOnRid>,
}

impl Generation {
    /// Submits `plan.n` engine requests per prompt (choice index = prompt * n + i). If any
    /// submission fails, the ones already made are dropped (aborted) and the error returned.
    /// SGLang's `/abort_request` stops it by its `rid` (one of its own when none was given,
    /// so that `abort_all` reaches every request, as SGLang's does).
    pub fn start(
        state: &AppState,
        plan: &GenerationPlan,
        prompts: &[Vec<u32>],
        arrival: Instant,
    ) -> Result<Self, ApiError> {
        let items: Vec<_> = prompts.iter().map(|p| (plan, p.as_slice())).collect();
        let rid = plan
            .rid
            .clone()
            .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        Self::start_each(state, &items, arrival, Some(state.aborts.register(&rid)))
    }

    /// [`Generation::start`] with a plan per prompt (SGLang's list of `sampling_params`);
    /// the plans share their model. With `abortable`, its signal ends every choice with
    /// finish reason `abort` (SGLang's `/abort_request`).
    pub fn start_each(
        state: &AppState,
        items: &[(&GenerationPlan, &[u32])],
        arrival: Instant,
        abortable: Option<AbortOnRid>,
    ) -> Result<Self, ApiError> {
        state.check_accepting()?;
        let Some(&(plan, _)) = items.first() else {
            return Err(ApiError::invalid("prompt", "no prompt was given"));
        };
        let (mut requests, mut plans) = (Vec::new(), Vec::new());
        for &(item_plan, prompt) in items {
            let made = item_plan.requests(prompt)?;
            plans.extend(std::iter::repeat_n(item_plan, made.len()));
            requests.extend(made);
        }
        let prompt_tokens = requests.iter().map(|r| r.prompt_ids.len()).sum();
        // All choices of all prompts are admitted together or not at all.
        let streams = state.backend.submit_all(requests).map_err(|e| match e {
            // The engine names a constraint `constraint`; the client sent its own field.
            SubmitError::InvalidField { param, message } if param == CONSTRAINT_PARAM => {
                let field = plan
                    .constraint
                    .as_ref()
                    .map_or(CONSTRAINT_PARAM, |(_, f)| *f);
                ApiError::invalid(field, message)
            }
            e => ApiError::from(e),
        })?;
        let num_choices = streams.len();
        let max_tokens = streams.iter().map(|s| s.max_tokens).collect();
        let cached: Arc<[AtomicUsize]> = (0..num_choices).map(|_| AtomicUsize::new(0)).collect();
        let runs = streams.into_iter().zip(plans).enumerate();
        let choices = stream::select_all(runs.map(|(index, (s, plan))| {
            ChoiceRun {
                index,
                decoder: ChoiceDecoder::new(plan.stop.clone())
                    .with_stop_ids(s.stop_ids.clone())
                    .including_stops(plan.include_stops)
                    .with_min_tokens(plan.sampling.min_tokens)
                    .with_line_limits(plan.line_limits),
                stream: Some(s),
                cached: cached.clone(),
                skip_special: !plan.keep_special,
                backend: state.backend.clone(),
                abort: state.lifecycle.abort_signal(),
                stop_asked: abortable.as_ref().map(AbortOnRid::signal),
            }
            .into_stream()
        }));
        let tracker = RequestTracker::start(
            state.metrics.clone(),
            &plan.model.name,
            arrival,
            prompt_tokens,
        );
        Ok(Self {
            choices,
            tracker,
            prompt_tokens,
            num_choices,
            max_tokens,
            cached,
            _abortable: abortable,
        })
    }

    /// Prompt tokens of choice `index` that its first model took from the prefix cache.
    pub fn cached_tokens_of(&self, index: usize) -> usize {
        self.cached
            .get(index)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The usage so far with `completion_tokens`: prompt tokens counted once per choice, as
    /// their cached part.
    pub fn usage(&self, completion_tokens: usize) -> Usage {
        let cached = self.cached.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        Usage::new(self.prompt_tokens, completion_tokens).with_cached(cached)
    }

    /// Drops every choice still running, which aborts them in the engine (a background
    /// response cancelled); `next` then answers `None`.
    pub fn abort(&mut self) {
        self.choices = SelectAll::new();
        self.tracker.abort("cancelled");
    }

    /// Next update of any choice; `None` once all have finished.
    pub async fn next(&mut self) -> Option<ChoiceUpdate> {
        let update = self.choices.next().await;
        match &update {
            Some(ChoiceUpdate::Delta { delta, .. }) => self.tracker.on_tokens(delta.tokens.len()),
            Some(ChoiceUpdate::Finished { delta, reason, .. }) => {
                self.tracker.on_tokens(delta.tokens.len());
                self.tracker.on_choice_finished(reason);
            }
            Some(ChoiceUpdate::Failed(err)) => self.tracker.abort(match err {
                ApiError::ShuttingDown => "shutdown",
                _ => "error",
            }),
            Some(ChoiceUpdate::Prompt { .. }) => {}
            None => self.tracker.finish(),
        }
        update
    }
}

/// One engine request and its decoder.
struct ChoiceRun {
    index: usize,
    /// `None` once finished: dropping the stream tells the engine to stop.
    stream: Option<GenerateStream>,
    /// Where this choice's cached prompt tokens are told (`cached[index]`).
    cached: Arc<[AtomicUsize]>,
    decoder: ChoiceDecoder,
    /// Special tokens' text left out (vLLM's `skip_special_tokens`, the default).
    skip_special: bool,
    backend: Arc<dyn Backend>,
    abort: watch::Receiver<bool>,
    /// Set when a client asked this request to stop (`/abort_request`).
    stop_asked: Option<watch::Receiver<bool>>,
}

impl ChoiceRun {
    fn into_stream(self) -> BoxStream<'static, ChoiceUpdate> {
        stream::unfold(self, |mut run| async move {
            let update = run.next().await?;
            Some((update, run))
        })
        .boxed()
    }

    async fn next(&mut self) -> Option<ChoiceUpdate> {
        loop {
            let stream = self.stream.as_mut()?;
            let event = tokio::select! {
                biased;
                () = aborted(&mut self.abort) => Wakeup::Shutdown,
                () = aborted_opt(&mut self.stop_asked) => Wakeup::StopAsked,
                event = stream.events.recv() => Wakeup::Event(event),
            };
            let (backend, skip_special) = (self.backend.clone(), self.skip_special);
            let decode = |ids: &[u32]| backend.decode(ids, skip_special);
            let event = match event {
                Wakeup::Event(event) => event,
                Wakeup::Shutdown => return self.fail(ApiError::ShuttingDown),
                // A client asked it to stop: it ends here, with what it wrote.
                Wakeup::StopAsked => match self.decoder.finish(decode) {
                    Ok((delta, _)) => return self.finished(delta, "abort"),
                    Err(e) => return self.fail(text_failure(e)),
                },
            };
            match event {
                Some(GenerateEvent::Prompt(scores)) => {
                    return Some(ChoiceUpdate::Prompt {
                        index: self.index,
                        scores,
                    })
                }
                Some(GenerateEvent::PromptCached(tokens)) => {
                    if let Some(slot) = self.cached.get(self.index) {
                        slot.store(tokens, Ordering::Relaxed);
                    }
                }
                Some(GenerateEvent::Token(token)) => match self.decoder.push(token, decode) {
                    Ok(Step::Continue(Some(delta))) => {
                        return Some(ChoiceUpdate::Delta {
                            index: self.index,
                            delta,
                        })
                    }
                    Ok(Step::Continue(None)) => continue,
                    Ok(Step::Stopped(delta)) => return self.finished(delta, "stop"),
                    Ok(Step::Limited(delta)) => return self.finished(delta, "length"),
                    Err(e) => return self.fail(text_failure(e)),
                },
                Some(GenerateEvent::Finished { reason }) => {
                    let (delta, hit_stop) = match self.decoder.finish(decode) {
                        Ok(done) => done,
                        Err(e) => return self.fail(text_failure(e)),
                    };
                    let reason = match reason {
                        _ if hit_stop => "stop",
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        FinishReason::Abort => return self.fail(ApiError::Aborted),
                    };
                    return self.finished(delta, reason);
                }
                Some(GenerateEvent::Error(message)) => return self.fail(ApiError::Engine(message)),
                None => {
                    return self.fail(ApiError::Engine(
                        "the engine closed the request without finishing it".into(),
                    ))
                }
            }
        }
    }

    fn finished(&mut self, delta: Delta, reason: &'static str) -> Option<ChoiceUpdate> {
        self.stream = None;
        Some(ChoiceUpdate::Finished {
            index: self.index,
            delta,
            reason,
            stopped_by: self.decoder.stopped_by().cloned(),
        })
    }

    fn fail(&mut self, error: ApiError) -> Option<ChoiceUpdate> {
        self.stream = None;
        Some(ChoiceUpdate::Failed(error))
    }
}

/// What woke a choice up.
enum Wakeup {
    Event(Option<GenerateEvent>),
    Shutdown,
    StopAsked,
}

/// [`aborted`] for an optional signal: never without one.
async fn aborted_opt(signal: &mut Option<watch::Receiver<bool>>) {
    match signal {
        Some(signal) => aborted(signal).await,
        None => std::future::pending::<()>().await,
    }
}

/// Resolves when the server aborts all requests; never if the signal's sender is gone
/// (a router dropped by a test while its response body is still streaming).
async fn aborted(signal: &mut watch::Receiver<bool>) {
    if signal.wait_for(|aborted| *aborted).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn text_failure(e: TextError) -> ApiError {
    ApiError::Engine(format!("detokenization failed: {e}"))
}
