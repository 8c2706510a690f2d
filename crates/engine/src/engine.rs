//! Building and running the engine from a config: load every model, check that they
//! share a tokenizer, build each model's policy, then start one thread per sub-server plus
//! the inter-model loop (async), or one lockstep driver (sync). `Engine` implements the
//! server's `Backend` trait and offers a small library API (`generate`, `generate_stream`).

use crate::config::{ConfigError, EngineConfig, Execution, NamedModel};
use crate::exchange::{Exchange, ToExchange};
use crate::metrics::EngineMetrics;
use crate::policy::{PolicyContext, Registry};
use crate::request::Req;
use crate::subserver::{Inbound, Shared, SubServer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokenrouter_api::{
    Backend, ChatMessage, FinishReason, GenerateEvent, GenerateRequest, GenerateStream, ModelInfo,
    SubmitError, TextError,
};
use tokenrouter_runtime::{
    check_shared_vocab, load_model, load_random_model, KvBudget, LoadOptions, Message, Sampler,
    SamplingConfig, TextModel,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("model `{model}` ({path}): {message}")]
    Model {
        model: String,
        path: String,
        message: String,
    },
    #[error("{0}")]
    Start(String),
    #[error("request failed: {0}")]
    Request(String),
    #[error(transparent)]
    Submit(#[from] SubmitError),
}

/// What `load` produces before threads start.
struct Loaded {
    subs: Vec<SubServer>,
    text: Arc<TextModel>,
    infos: Vec<ModelInfo>,
    shared: Arc<Shared>,
}

struct Inner {
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    ready: AtomicBool,
    alive: Arc<AtomicBool>,
    load_error: Mutex<Option<String>>,
    text: OnceLock<Arc<TextModel>>,
    infos: OnceLock<Vec<ModelInfo>>,
    shared: OnceLock<Arc<Shared>>,
    to_exchange: Mutex<Option<mpsc::Sender<ToExchange>>>,
    next_rid: AtomicU64,
    tuner_stop: Arc<AtomicBool>,
}

/// The running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

fn parse_device(spec: &str) -> Result<candle_core::Device, String> {
    match spec {
        "cpu" => Ok(candle_core::Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let n = s
                .strip_prefix("cuda:")
                .unwrap_or("0")
                .parse::<usize>()
                .map_err(|_| format!("bad device `{s}`"))?;
            candle_core::Device::new_cuda(n).map_err(|e| format!("device `{s}`: {e}"))
        }
        other => Err(format!(
            "unknown device `{other}` (use cpu, cuda or cuda:N)"
        )),
    }
}

fn parse_dtype(
    spec: Option<&str>,
    device: &candle_core::Device,
) -> Result<candle_core::DType, String> {
    use candle_core::DType;
    match spec {
        None => Ok(if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        }),
        Some("f32") | Some("float32") => Ok(DType::F32),
        Some("bf16") | Some("bfloat16") => Ok(DType::BF16),
        Some("f16") | Some("float16") => Ok(DType::F16),
        Some(o) => Err(format!("unknown dtype `{o}` (use f32, bf16 or f16)")),
    }
}

/// The config.json of a `random_weights` model: relative to the config file, else as given.
fn shape_path(spec: &str, config_file: &Path) -> Result<PathBuf, String> {
    let p = Path::new(spec);
    let p = match config_file.parent() {
        Some(dir) if p.is_relative() && dir.join(p).is_file() => dir.join(p),
        _ => p.to_path_buf(),
    };
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "random_weights needs model_path to be a config.json file; `{spec}` is not one"
        ))
    }
}

/// A model path relative to the config file if it exists there, else as given (path,
/// model id or built-in name, resolved by the fetch crate).
fn resolve_path(spec: &str, config_file: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = config_file.parent() {
        let rel = dir.join(spec);
        if !Path::new(spec).is_absolute() && rel.exists() {
            return Ok(rel);
        }
    }
    tokenrouter_fetch::resolve_model(spec)
        .map(|l| l.path().to_path_buf())
        .map_err(|e| e.to_string())
}

fn load(
    config: &EngineConfig,
    metrics: Arc<EngineMetrics>,
    registry: &Registry,
) -> Result<Loaded, EngineError> {
    let models: Vec<NamedModel> = config.models()?;
    let mut loaded = Vec::new();
    for m in &models {
        let err = |message: String| EngineError::Model {
            model: m.name.clone(),
            path: m.section.model_path.clone(),
            message,
        };
        // The device first: a CPU-only build must not download a GPU model before failing.
        let device = parse_device(&m.section.device).map_err(err)?;
        let path = if m.section.random_weights {
            shape_path(&m.section.model_path, &config.file).map_err(err)?
        } else {
            resolve_path(&m.section.model_path, &config.file).map_err(err)?
        };
        let dtype = parse_dtype(m.section.dtype.as_deref(), &device).map_err(err)?;
        let opts = LoadOptions {
            device,
            kv: KvBudget::Tokens(m.section.kv_cache_tokens.unwrap_or(32_768)),
            dtype,
        };
        tracing::info!(model = %m.name, path = %path.display(), "loading");
        let lm = if m.section.random_weights {
            // `model_path` is a config.json giving the shape; every model gets its own seed.
            load_random_model(&path, &opts, 1 + loaded.len() as u64)
        } else {
            load_model(&path, &opts)
        }
        .map_err(|e| err(e.to_string()))?;
        loaded.push((m, path, lm));
    }
    let pairs: Vec<(&str, &TextModel, usize)> = loaded
        .iter()
        .map(|(m, _, lm)| (m.name.as_str(), &lm.text, lm.runner.config().vocab_size))
        .collect();
    let shared_vocab = check_shared_vocab(&pairs)
        .map_err(|e| EngineError::Start(format!("{}: {e}", config.file.display())))?;
    let context_limit = loaded
        .iter()
        .map(|(_, _, lm)| lm.runner.max_len())
        .min()
        .unwrap_or(0);
    let names: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
    let entry_text = &loaded[0].2.text;
    let token_text: Arc<Vec<String>> = Arc::new(
        (0..shared_vocab.sample_limit as u32)
            .map(|id| entry_text.decode(&[id], false).unwrap_or_default())
            .collect(),
    );
    let thresholds = models
        .iter()
        .map(|m| m.section.delayed_batching_threshold.clone())
        .collect();
    let shared = Arc::new(Shared::new(
        names.clone(),
        context_limit,
        thresholds,
        metrics,
    ));
    let mut subs = Vec::new();
    let mut infos = Vec::new();
    let mut text = None;
    for (idx, (m, path, lm)) in loaded.into_iter().enumerate() {
        let runner = lm.runner;
        let ctx = PolicyContext {
            model: idx,
            model_names: names.clone(),
            token_text: token_text.clone(),
            vocab_size: runner.config().vocab_size,
            sample_limit: shared_vocab.sample_limit,
            config_file: config.file.clone(),
            embed: Some(runner.model().embedder()),
            device: runner.model().device().clone(),
        };
        let class = m
            .section
            .scheduler_class
            .clone()
            .unwrap_or_else(|| "slm_only".into());
        let policy = registry.build(&class, &m.section.scheduler_kwargs, &ctx)?;
        infos.push(ModelInfo {
            name: m.name.clone(),
            source: path.display().to_string(),
            context_length: runner.max_len(),
        });
        if idx == 0 {
            text = Some(Arc::new(lm.text));
        }
        subs.push(SubServer::new(
            idx,
            runner,
            policy,
            shared_vocab.sample_limit,
            config.system.max_batch_size,
            shared.clone(),
        ));
    }
    let text = text.ok_or_else(|| EngineError::Start("no models".into()))?;
    Ok(Loaded {
        subs,
        text,
        infos,
        shared,
    })
}

/// Async mode: one thread per sub-server, stepping at its own pace.
fn run_subserver(
    mut sub: SubServer,
    inbox: mpsc::Receiver<Inbound>,
    exchange: mpsc::Sender<ToExchange>,
) {
    let mut out = Vec::new();
    loop {
        if !sub.has_work() {
            match inbox.recv() {
                Ok(m) => sub.accept(m),
                Err(_) => return,
            }
        }
        loop {
            match inbox.try_recv() {
                Ok(m) => sub.accept(m),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        if sub.should_wait() {
            // Delayed batching: wake on the next arrival (or re-check shortly: requests
            // elsewhere may finish, which lowers what we can wait for).
            match inbox.recv_timeout(Duration::from_millis(2)) {
                Ok(m) => sub.accept(m),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            continue;
        }
        sub.step(&mut out);
        for o in out.drain(..) {
            if exchange.send(ToExchange::Out(sub.idx, o)).is_err() {
                return;
            }
        }
    }
}

fn run_exchange(rx: mpsc::Receiver<ToExchange>, inboxes: Vec<mpsc::Sender<Inbound>>) {
    let mut ex = Exchange::default();
    while let Ok(msg) = rx.recv() {
        if matches!(msg, ToExchange::Shutdown) {
            return;
        }
        ex.handle(msg, &mut |m, inbound| {
            let _ = inboxes[m].send(inbound);
        });
    }
}

/// Sync mode: one thread steps every model in turn; hand-offs land between ticks.
fn run_lockstep(mut subs: Vec<SubServer>, rx: mpsc::Receiver<ToExchange>) {
    let mut ex = Exchange::default();
    let mut out = Vec::new();
    loop {
        let busy = subs.iter().any(|s| s.has_work());
        let first = if busy {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return,
            }
        };
        let mut pending: Vec<ToExchange> = first.into_iter().chain(rx.try_iter()).collect();
        if pending.iter().any(|m| matches!(m, ToExchange::Shutdown)) {
            return;
        }
        for msg in pending.drain(..) {
            ex.handle(msg, &mut |m, inbound| subs[m].accept(inbound));
        }
        // One lockstep tick: every model with work steps once.
        for i in 0..subs.len() {
            subs[i].step(&mut out);
            let idx = subs[i].idx;
            for o in out.drain(..) {
                ex.handle(ToExchange::Out(idx, o), &mut |m, inbound| {
                    subs[m].accept(inbound)
                });
            }
        }
    }
}

impl Engine {
    /// Start loading in the background; `is_ready` turns true when every model is loaded.
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let metrics =
            Arc::new(EngineMetrics::new().map_err(|e| EngineError::Start(e.to_string()))?);
        let inner = Arc::new(Inner {
            config,
            metrics,
            ready: AtomicBool::new(false),
            alive: Arc::new(AtomicBool::new(true)),
            load_error: Mutex::new(None),
            text: OnceLock::new(),
            infos: OnceLock::new(),
            shared: OnceLock::new(),
            to_exchange: Mutex::new(None),
            next_rid: AtomicU64::new(1),
            tuner_stop: Arc::new(AtomicBool::new(false)),
        });
        let engine = Engine { inner };
        let e2 = engine.clone();
        std::thread::Builder::new()
            .name("tokenrouter-load".into())
            .spawn(move || {
                if let Err(err) = e2.load_and_run() {
                    tracing::error!(error = %err, "engine failed to start");
                    if let Ok(mut slot) = e2.inner.load_error.lock() {
                        *slot = Some(err.to_string());
                    }
                }
            })
            .map_err(|e| EngineError::Start(e.to_string()))?;
        Ok(engine)
    }

    /// Load a config file and wait until the engine is ready.
    pub fn from_config(path: &Path) -> Result<Engine, EngineError> {
        let cfg = EngineConfig::from_file(path)?;
        let e = Engine::start(cfg)?;
        e.wait_ready(Duration::from_secs(3600))?;
        Ok(e)
    }

    /// Block until loaded, failed, or timed out.
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), EngineError> {
        let start = std::time::Instant::now();
        loop {
            if self.inner.ready.load(Ordering::SeqCst) {
                return Ok(());
            }
            if let Some(e) = self.load_error() {
                return Err(EngineError::Start(e));
            }
            if start.elapsed() > timeout {
                return Err(EngineError::Start(
                    "timed out waiting for the models to load".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn load_error(&self) -> Option<String> {
        self.inner.load_error.lock().ok().and_then(|e| e.clone())
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Shared engine state (metrics, thresholds, counters) once running.
    pub fn shared(&self) -> Option<Arc<Shared>> {
        self.inner.shared.get().cloned()
    }

    fn load_and_run(&self) -> Result<(), EngineError> {
        let registry = Registry::default();
        let mut loaded = load(&self.inner.config, self.inner.metrics.clone(), &registry)?;
        let any_auto = self.inner.config.models()?.iter().any(|m| {
            matches!(
                m.section.delayed_batching_threshold,
                crate::config::Threshold::Auto(_)
            )
        });
        let tune = any_auto && self.inner.config.system.execution == Execution::Async;
        // Before serving, each model times its own decode steps by batch size (and all of them
        // their contention) so the tuner plans from measured latencies from the first request.
        let profile = if tune {
            crate::profile::profile_models(&mut loaded.subs)
        } else {
            crate::profile::Profile::default()
        };
        let (tx, rx) = mpsc::channel::<ToExchange>();
        let alive = self.inner.alive.clone();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| -> Result<(), EngineError> {
            let alive = alive.clone();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    f();
                    alive.store(false, Ordering::SeqCst);
                })
                .map(|_| ())
                .map_err(|e| EngineError::Start(e.to_string()))
        };
        match self.inner.config.system.execution {
            Execution::Async => {
                let mut inboxes = Vec::new();
                for sub in loaded.subs {
                    let (itx, irx) = mpsc::channel();
                    inboxes.push(itx);
                    let etx = tx.clone();
                    let name = format!("tokenrouter-model-{}", sub.idx);
                    spawn(name, Box::new(move || run_subserver(sub, irx, etx)))?;
                }
                spawn(
                    "tokenrouter-exchange".into(),
                    Box::new(move || run_exchange(rx, inboxes)),
                )?;
            }
            Execution::Sync => {
                let subs = loaded.subs;
                spawn(
                    "tokenrouter-lockstep".into(),
                    Box::new(move || run_lockstep(subs, rx)),
                )?;
            }
        }
        let _ = self.inner.text.set(loaded.text);
        let _ = self.inner.infos.set(loaded.infos);
        let _ = self.inner.shared.set(loaded.shared.clone());
        if let Ok(mut slot) = self.inner.to_exchange.lock() {
            *slot = Some(tx);
        }
        let gpu = self
            .inner
            .config
            .models()?
            .iter()
            .any(|m| m.section.device.starts_with("cuda"));
        if self.inner.config.system.warmup.unwrap_or(gpu) {
            crate::warmup::warm_up(self, &loaded.shared)?;
        }
        if tune {
            let shared = loaded.shared.clone();
            let stop = self.inner.tuner_stop.clone();
            std::thread::Builder::new()
                .name("tokenrouter-tuner".into())
                .spawn(move || {
                    crate::tuner::run_tuner(shared, profile, stop, Duration::from_millis(1000))
                })
                .map_err(|e| EngineError::Start(e.to_string()))?;
        }
        self.inner.ready.store(true, Ordering::SeqCst);
        tracing::info!("engine ready");
        Ok(())
    }

    /// Stop the loops (in-flight requests are dropped; their clients see the stream end).
    pub fn shutdown(&self) {
        self.inner.ready.store(false, Ordering::SeqCst);
        self.inner.tuner_stop.store(true, Ordering::SeqCst);
        if let Ok(mut slot) = self.inner.to_exchange.lock() {
            if let Some(tx) = slot.take() {
                let _ = tx.send(ToExchange::Shutdown);
            }
        }
    }

    pub fn text(&self) -> Option<Arc<TextModel>> {
        self.inner.text.get().cloned()
    }

    /// Generate a whole completion for a raw prompt (library API).
    pub async fn generate(
        &self,
        prompt: &str,
        params: GenerateParams,
    ) -> Result<Generation, EngineError> {
        let mut stream = self.generate_stream(prompt, params)?;
        let mut g = Generation::default();
        while let Some(ev) = stream.events.recv().await {
            match ev {
                GenerateEvent::Token(t) => {
                    g.token_ids.push(t.id);
                    g.sources.push(t.source);
                }
                GenerateEvent::Finished { reason } => {
                    g.finish_reason = Some(reason);
                    break;
                }
                GenerateEvent::Error(e) => return Err(EngineError::Request(e)),
            }
        }
        if let Some(text) = self.text() {
            g.text = text
                .decode(&g.token_ids, true)
                .map_err(|e| EngineError::Request(e.to_string()))?;
        }
        Ok(g)
    }

    /// Stream tokens of a raw prompt (library API). Dropping the stream aborts the request.
    pub fn generate_stream(
        &self,
        prompt: &str,
        params: GenerateParams,
    ) -> Result<GenerateStream, EngineError> {
        let text = self
            .text()
            .ok_or_else(|| SubmitError::NotReady("loading".into()))?;
        let prompt_ids = text
            .encode(prompt)
            .map_err(|e| EngineError::Request(e.to_string()))?;
        Ok(self.submit(params.into_request(prompt_ids))?)
    }
}

/// Library-level parameters of `Engine::generate`.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: tokenrouter_api::SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub pinned_model: Option<usize>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: tokenrouter_api::SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            pinned_model: None,
        }
    }
}

impl GenerateParams {
    pub fn into_request(self, prompt_ids: Vec<u32>) -> GenerateRequest {
        GenerateRequest {
            prompt_ids,
            sampling: self.sampling,
            max_tokens: self.max_tokens,
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            pinned_model: self.pinned_model,
            top_logprobs: 0,
        }
    }
}

/// A finished generation.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Which model wrote each token.
    pub sources: Vec<usize>,
    pub finish_reason: Option<FinishReason>,
}

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
