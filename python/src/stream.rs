//! One generation in flight, as Python iterates it: engine tokens become text chunks with
//! the model that wrote each token, through the same decoder the HTTP server uses (stop
//! strings, incremental detokenization). Waiting happens without the GIL and in short
//! slices, so Ctrl-C reaches Python; closing (or dropping) the stream aborts the request
//! in every model and frees its KV.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokenrouter_api::{Backend, FinishReason, GenerateEvent, GenerateStream, TokenEvent};
use tokenrouter_server::text::{ChoiceDecoder, Delta, Step, StopMatch};

use crate::EngineError;
use tokenrouter_server::sglang::InputLogprobs;

/// How long one wait lasts before Python gets to check for signals.
const WAIT_SLICE: Duration = Duration::from_millis(100);

struct Live {
    events: GenerateStream,
    decoder: ChoiceDecoder,
    engine: tokenrouter_engine::Engine,
    skip_special_tokens: bool,
}

/// A scored token's top alternatives, `(logprob, token id)`, best first.
type Alternatives = Vec<(f32, u32)>;

/// What one wait produced.
enum Poll {
    /// Nothing releasable yet (the slice ended or the token's text is held back).
    Pending,
    /// Released text; on the last chunk its finish reason and what stopped it.
    Chunk(Delta, Option<&'static str>, Option<StopMatch>),
    Failed(String),
    Closed,
}

#[pyclass(module = "tokenrouter._native")]
pub struct Stream {
    live: Mutex<Option<Live>>,
    rt: Arc<tokio::runtime::Runtime>,
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    prompt_tokens: usize,
    #[pyo3(get)]
    max_new_tokens: usize,
    /// The request asked for per-token log-probabilities in its result.
    #[pyo3(get)]
    return_logprob: bool,
    /// The prompt's scores, when asked for: which, the prompt's first token (it has none),
    /// and the engine's scores of the others once they arrived.
    input: Option<(InputLogprobs, u32)>,
    input_scores: Mutex<Option<Vec<TokenEvent>>>,
    /// Prompt tokens the first model took from its prefix cache (SGLang's `cached_tokens`).
    cached_tokens: AtomicUsize,
}

impl Stream {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        events: GenerateStream,
        engine: tokenrouter_engine::Engine,
        decoder: ChoiceDecoder,
        skip_special_tokens: bool,
        rt: Arc<tokio::runtime::Runtime>,
        prompt_tokens: usize,
        max_new_tokens: usize,
        return_logprob: bool,
        input: Option<(InputLogprobs, u32)>,
    ) -> Self {
        Self {
            request_id: events.request_id,
            live: Mutex::new(Some(Live {
                events,
                decoder,
                engine,
                skip_special_tokens,
            })),
            rt,
            prompt_tokens,
            max_new_tokens,
            return_logprob,
            input,
            input_scores: Mutex::new(None),
            cached_tokens: AtomicUsize::new(0),
        }
    }

    /// Per reported prompt position `f(score)`: `None` for the first token (nothing before
    /// it), the engine's score for the others. `None` unless the prompt was scored.
    fn per_prompt_token<T>(&self, f: impl Fn(Option<&TokenEvent>, u32) -> T) -> Option<Vec<T>> {
        let (which, first) = self.input?;
        let scores = self.input_scores.lock().ok()?;
        let scores = scores.as_ref()?;
        let all = std::iter::once(f(None, first)).chain(scores.iter().map(|s| f(Some(s), s.id)));
        Some(all.skip(which.start).collect())
    }

    /// Waits one slice for the engine and runs what arrived through the decoder.
    fn poll(&self) -> Poll {
        let Ok(mut slot) = self.live.lock() else {
            return Poll::Failed("the stream's state was poisoned by a panic".into());
        };
        let Some(live) = slot.as_mut() else {
            return Poll::Closed;
        };
        let event = self
            .rt
            .block_on(async { tokio::time::timeout(WAIT_SLICE, live.events.events.recv()).await });
        let skip = live.skip_special_tokens;
        let engine = &live.engine;
        let decode = |ids: &[u32]| engine.decode(ids, skip);
        let outcome = match event {
            Err(_elapsed) => return Poll::Pending,
            Ok(Some(GenerateEvent::Token(token))) => match live.decoder.push(token, decode) {
                Ok(Step::Continue(Some(delta))) => return Poll::Chunk(delta, None, None),
                Ok(Step::Continue(None)) => return Poll::Pending,
                Ok(Step::Stopped(delta)) => Poll::Chunk(delta, Some("stop"), None),
                // The engine's Python streams set no line limits; were one to end it, it ends
                // as a length limit does.
                Ok(Step::Limited(delta)) => Poll::Chunk(delta, Some("length"), None),
                Err(e) => Poll::Failed(e.to_string()),
            },
            Ok(Some(GenerateEvent::Finished { reason })) => match live.decoder.finish(decode) {
                Ok((delta, true)) => Poll::Chunk(delta, Some("stop"), None),
                Ok((delta, false)) => Poll::Chunk(delta, Some(reason_name(reason)), None),
                Err(e) => Poll::Failed(e.to_string()),
            },
            Ok(Some(GenerateEvent::Error(message))) => Poll::Failed(message),
            Ok(Some(GenerateEvent::PromptCached(n))) => {
                self.cached_tokens.store(n, Ordering::Relaxed);
                return Poll::Pending;
            }
            Ok(Some(GenerateEvent::Prompt(scores))) => {
                if let Ok(mut slot) = self.input_scores.lock() {
                    *slot = Some(scores);
                }
                return Poll::Pending;
            }
            // The engine went away (shut down) without finishing the request.
            Ok(None) => match live.decoder.finish(decode) {
                Ok((delta, _)) => Poll::Chunk(delta, Some("abort"), None),
                Err(e) => Poll::Failed(e.to_string()),
            },
        };
        // Finished one way or another: dropping the engine stream ends the request.
        let outcome = match outcome {
            Poll::Chunk(delta, Some("stop"), _) => {
                Poll::Chunk(delta, Some("stop"), live.decoder.stopped_by().cloned())
            }
            other => other,
        };
        *slot = None;
        outcome
    }
}

fn reason_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
    }
}

#[pymethods]
impl Stream {
    /// The next chunk — a dict with `text`, `token_ids`, `sources` (model index per token),
    /// `logprobs` and `finish_reason` (None until the last chunk) — or None once finished.
    /// Blocks without the GIL; a KeyboardInterrupt aborts the request.
    fn next_chunk<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        loop {
            match py.detach(|| self.poll()) {
                Poll::Pending => {
                    if let Err(interrupt) = py.check_signals() {
                        self.close();
                        return Err(interrupt);
                    }
                }
                Poll::Closed => return Ok(None),
                Poll::Failed(message) => return Err(EngineError::new_err(message)),
                Poll::Chunk(delta, finish, matched) => {
                    let chunk = PyDict::new(py);
                    let tokens = &delta.tokens;
                    chunk.set_item("text", delta.text.as_str())?;
                    chunk.set_item(
                        "token_ids",
                        tokens.iter().map(|t| t.event.id).collect::<Vec<_>>(),
                    )?;
                    chunk.set_item(
                        "sources",
                        tokens.iter().map(|t| t.event.source).collect::<Vec<_>>(),
                    )?;
                    chunk.set_item(
                        "logprobs",
                        tokens.iter().map(|t| t.event.logprob).collect::<Vec<_>>(),
                    )?;
                    chunk.set_item("finish_reason", finish)?;
                    match matched {
                        Some(StopMatch::Text(text)) => chunk.set_item("matched", text)?,
                        Some(StopMatch::Token(id)) => chunk.set_item("matched", id)?,
                        None => chunk.set_item("matched", py.None())?,
                    }
                    return Ok(Some(chunk));
                }
            }
        }
    }

    /// Aborts the request (if still running): every model frees its KV within a step.
    fn close(&self) {
        if let Ok(mut slot) = self.live.lock() {
            *slot = None;
        }
    }

    /// The scored prompt tokens from `logprob_start_len` on, as `(logprob, token id)` (the
    /// prompt's first token: `(None, id)`); None unless asked for (`return_logprob` with
    /// `logprob_start_len >= 0`).
    #[getter]
    fn input_token_logprobs(&self) -> Option<Vec<(Option<f32>, u32)>> {
        self.per_prompt_token(|s, id| (s.map(|s| s.logprob), id))
    }

    /// Per scored prompt token its `top_logprobs_num` alternatives as `(logprob, token id)`,
    /// best first (the prompt's first token: None).
    #[getter]
    fn input_top_logprobs(&self) -> Option<Vec<Option<Alternatives>>> {
        self.per_prompt_token(|s, _| {
            s.map(|s| s.top_logprobs.iter().map(|&(id, lp)| (lp, id)).collect())
        })
    }

    /// Prompt tokens the first model took from its prefix cache instead of computing them.
    #[getter]
    fn cached_tokens(&self) -> usize {
        self.cached_tokens.load(Ordering::Relaxed)
    }

    /// True until the last chunk was returned or the stream was closed.
    #[getter]
    fn running(&self) -> bool {
        self.live.lock().map(|s| s.is_some()).unwrap_or(false)
    }
}
