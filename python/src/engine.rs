//! The routing engine in a Python process: load a config, submit prompts (all of one call
//! admitted together and run concurrently by the engine), tokenize and template. The
//! Python-facing API (`TokenRoutingEngine`) is written in Python over this class.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use tokenrouter_api::{Backend, ChatMessage, SubmitError};
use tokenrouter_server::text::ChoiceDecoder;

use crate::stream::Stream;
use crate::EngineError;
use tokenrouter_server::sglang::Params;

#[pyclass(module = "tokenrouter._native", frozen)]
pub struct Engine {
    engine: tokenrouter_engine::Engine,
    /// Drives the timers of stream waits (the engine itself runs on its own threads).
    rt: Arc<tokio::runtime::Runtime>,
}

fn submit_error(e: SubmitError) -> PyErr {
    match e {
        SubmitError::InvalidRequest(_)
        | SubmitError::InvalidField { .. }
        | SubmitError::ContextTooLong { .. } => PyValueError::new_err(e.to_string()),
        SubmitError::QueueFull { .. }
        | SubmitError::PromptTokensFull { .. }
        | SubmitError::NotReady(_) => EngineError::new_err(e.to_string()),
    }
}

impl Engine {
    /// Model index for a `model` argument: None (or a routed alias) routes; a configured
    /// name pins the request to that model.
    fn pinned(&self, model: Option<&str>) -> PyResult<Option<usize>> {
        let Some(name) = model else { return Ok(None) };
        let system = &self.engine.config().system;
        let routed = system
            .served_model_name
            .as_deref()
            .unwrap_or(tokenrouter_server::DEFAULT_SERVED_MODEL_NAME);
        if name == routed || system.served_model_aliases.iter().any(|a| a == name) {
            return Ok(None);
        }
        let names: Vec<String> = self.engine.models().into_iter().map(|m| m.name).collect();
        match names.iter().position(|n| n == name) {
            Some(i) => Ok(Some(i)),
            None => Err(PyValueError::new_err(format!(
                "unknown model `{name}`: use one of {} to pin a model, or `{routed}` to route",
                names.join(", ")
            ))),
        }
    }

    fn context_limit(&self) -> usize {
        self.engine
            .models()
            .iter()
            .map(|m| m.context_length)
            .min()
            .unwrap_or(0)
    }
}

#[pymethods]
impl Engine {
    /// Loads the models of a YAML (or JSON) config — None: the built-in default pair,
    /// fetched on first use — and waits until they are ready. `origin` names the config in
    /// errors and anchors its relative paths.
    #[new]
    #[pyo3(signature = (config_text, origin, timeout_s = 3600.0))]
    fn new(
        py: Python<'_>,
        config_text: Option<&str>,
        origin: &str,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let cfg = match config_text {
            Some(text) => tokenrouter::engine_config_from_yaml(text, Path::new(origin)),
            None => tokenrouter::engine_config(None),
        }
        .map_err(|e| PyValueError::new_err(format!("{e:#}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tokenrouter-py-timer")
            .enable_time()
            .build()
            .map_err(|e| EngineError::new_err(format!("cannot start a timer thread: {e}")))?;
        let engine = tokenrouter_engine::Engine::start(cfg)
            .map_err(|e| EngineError::new_err(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_s.max(0.0));
        loop {
            let ready = py.detach(|| engine.wait_ready(Duration::from_millis(100)));
            if ready.is_ok() {
                break;
            }
            if let Some(e) = engine.load_error() {
                engine.shutdown();
                return Err(EngineError::new_err(e));
            }
            if let Err(interrupt) = py.check_signals() {
                engine.shutdown();
                return Err(interrupt);
            }
            if Instant::now() > deadline {
                engine.shutdown();
                return Err(PyTimeoutError::new_err(format!(
                    "the models did not load within {timeout_s} s"
                )));
            }
        }
        Ok(Self {
            engine,
            rt: Arc::new(rt),
        })
    }

    /// Configured model names, entry model first.
    fn model_names(&self) -> Vec<String> {
        self.engine.models().into_iter().map(|m| m.name).collect()
    }

    /// The longest prompt + output every model accepts.
    #[getter]
    fn context_length(&self) -> usize {
        self.context_limit()
    }

    fn encode(&self, py: Python<'_>, text: &str) -> PyResult<Vec<u32>> {
        py.detach(|| self.engine.encode(text))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        py.detach(|| self.engine.decode(&ids, skip_special_tokens))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Renders the chat template; `messages_json` is a JSON list of {role, content},
    /// `kwargs_json` extra template variables (a JSON object).
    fn apply_chat_template(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        kwargs_json: &str,
    ) -> PyResult<String> {
        let messages: Vec<ChatMessage> = serde_json::from_str(messages_json).map_err(|e| {
            PyValueError::new_err(format!(
                "messages must be a list of {{\"role\": str, \"content\": str}}: {e}"
            ))
        })?;
        let kwargs: serde_json::Value = serde_json::from_str(kwargs_json)
            .map_err(|e| PyValueError::new_err(format!("chat template kwargs: {e}")))?;
        self.engine
            .apply_chat_template(&messages, add_generation_prompt, &kwargs)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Submits one request per prompt (token ids), all admitted or none, and returns their
    /// streams in order. `params_json`: the `sampling_params` dict as JSON.
    #[pyo3(signature = (prompts, params_json, model = None))]
    fn submit(
        &self,
        prompts: Vec<Vec<u32>>,
        params_json: &str,
        model: Option<&str>,
    ) -> PyResult<Vec<Stream>> {
        let params = Params::from_json(params_json).map_err(PyValueError::new_err)?;
        let pinned = self.pinned(model)?;
        // `n` samples: the prompts once per sample, sample i seeded `seed + i` (SGLang's order).
        let samples: Vec<Params> = (0..params.n).map(|i| params.sample(i)).collect();
        let requests: Vec<_> = samples
            .iter()
            .flat_map(|sample| prompts.iter().map(|p| sample.request(p.clone(), pinned)))
            .collect();
        let prompt_sizes: Vec<(usize, Option<u32>)> = requests
            .iter()
            .map(|r| (r.prompt_ids.len(), r.prompt_ids.first().copied()))
            .collect();
        let streams = self.engine.submit_all(requests).map_err(submit_error)?;
        Ok(streams
            .into_iter()
            .zip(prompt_sizes)
            .map(|(events, (prompt_tokens, first))| {
                let max_new_tokens = events.max_tokens;
                let decoder = ChoiceDecoder::new(params.stop_strings())
                    .with_stop_ids(events.stop_ids.clone())
                    .including_stops(params.no_stop_trim)
                    .with_min_tokens(params.sampling.min_tokens);
                Stream::new(
                    events,
                    self.engine.clone(),
                    decoder,
                    params.skip_special_tokens,
                    self.rt.clone(),
                    prompt_tokens,
                    max_new_tokens,
                    params.return_logprob,
                    params.input_logprobs.zip(first),
                )
            })
            .collect())
    }

    /// Requests inside the engine and KV blocks in use per model (for leak checks).
    fn stats(&self) -> (usize, Vec<usize>) {
        use std::sync::atomic::Ordering;
        match self.engine.shared() {
            Some(s) => (
                s.active.load(Ordering::SeqCst),
                s.kv_used.iter().map(|k| k.load(Ordering::SeqCst)).collect(),
            ),
            None => (0, Vec::new()),
        }
    }

    /// Every model forgets its cached prefixes (SGLang's `flush_cache`).
    fn flush_cache(&self) -> PyResult<()> {
        use tokenrouter_api::Backend;
        self.engine.flush_cache().map_err(submit_error)
    }

    /// Prometheus text exposition of the engine's metrics.
    fn metrics_text(&self) -> String {
        self.engine.metrics_text()
    }

    /// True while every model's loop is up.
    #[getter]
    fn ready(&self) -> bool {
        self.engine.is_ready()
    }

    /// Stops the engine's loops; running requests end with finish reason "abort".
    fn shutdown(&self) {
        self.engine.shutdown();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.engine.shutdown();
    }
}
