//! Building and running the engine from a config: load every model (`load.rs`: shared
//! tokenizer, each model's policy), then start one thread per sub-server plus the
//! inter-model loop (async), or one lockstep driver (sync). `Engine` implements the server's
//! `Backend` trait (`backend.rs`) and offers a small library API (`generate`,
//! `generate_stream`).

use crate::config::{ConfigError, EngineConfig, Execution};
use crate::exchange::{Exchange, ToExchange};
use crate::metrics::EngineMetrics;
use crate::policy::Registry;
use crate::subserver::{Inbound, Shared, SubServer};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokenrouter_api::{
    Backend, FinishReason, GenerateEvent, GenerateRequest, GenerateStream, ModelInfo, SubmitError,
};
use tokenrouter_grammar::LazyCompiler;
use tokenrouter_runtime::TextModel;

mod backend;
pub(crate) mod load;

use load::load;
pub use load::{load_config_models, ConfigModel};

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

/// A model of the pair: a sub-server in this process, or a connection to one elsewhere.
// Built once per model at start: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Slot {
    Local(SubServer),
    Remote(Box<crate::remote::dial::Connected>),
}

/// Where the inter-model loop delivers a model's messages.
enum Inbox {
    Local(mpsc::Sender<Inbound>),
    Remote(tokio::sync::mpsc::UnboundedSender<Inbound>),
}

impl Inbox {
    fn send(&self, m: Inbound) {
        let _ = match self {
            Inbox::Local(tx) => tx.send(m).map_err(|_| ()),
            Inbox::Remote(tx) => tx.send(m).map_err(|_| ()),
        };
    }
}

/// The runtime the proxies of remote models run on; stopped without blocking when the
/// engine goes (it may be dropped inside another runtime).
struct RemoteRuntime(Option<tokio::runtime::Runtime>);

impl Drop for RemoteRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// What `load` produces before threads start.
struct Loaded {
    subs: Vec<Slot>,
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
    remote_rt: Mutex<Option<RemoteRuntime>>,
    remote_stats: Arc<crate::remote::ProxyStats>,
    /// Structured output's token table (from the entry model's tokenizer, once loaded).
    grammar: OnceLock<Arc<LazyCompiler>>,
    /// DRY's sequence breakers as token sequences, by the texts requests gave.
    dry: crate::dry_breakers::DryTables,
}

/// The running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Async mode: one thread per sub-server, stepping at its own pace; `emit` takes what it
/// produces (false: nobody listens any more, stop).
pub(crate) fn run_subserver(
    mut sub: SubServer,
    inbox: mpsc::Receiver<Inbound>,
    mut emit: impl FnMut(tokenrouter_api::ModelIndex, crate::subserver::Outbound) -> bool,
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
        sub.step_guarded(&mut out);
        for o in out.drain(..) {
            if !emit(sub.idx, o) {
                return;
            }
        }
    }
}

fn run_exchange(rx: mpsc::Receiver<ToExchange>, inboxes: Vec<Inbox>) {
    let mut ex = Exchange::new(inboxes.len());
    while let Ok(msg) = rx.recv() {
        if matches!(msg, ToExchange::Shutdown) {
            return;
        }
        ex.handle(msg, &mut |m, inbound| inboxes[m].send(inbound));
    }
}

/// Sync mode: one thread steps every model in turn; hand-offs land between ticks.
fn run_lockstep(mut subs: Vec<SubServer>, rx: mpsc::Receiver<ToExchange>) {
    let mut ex = Exchange::new(subs.len());
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
            subs[i].step_guarded(&mut out);
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
            remote_rt: Mutex::new(None),
            remote_stats: Default::default(),
            grammar: OnceLock::new(),
            dry: Default::default(),
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
        let config = &self.inner.config;
        let remote_rt = if config.models.iter().any(|m| m.address.is_some()) {
            Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("tokenrouter-remote")
                    .enable_all()
                    .build()
                    .map_err(|e| EngineError::Start(e.to_string()))?,
            )
        } else {
            None
        };
        let loaded = load(
            config,
            self.inner.metrics.clone(),
            &registry,
            remote_rt.as_ref(),
        );
        let remote_rt = RemoteRuntime(remote_rt);
        let mut loaded = loaded?;
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
            // `auto` thresholds are refused with remote models (config check), so all are here.
            let mut subs: Vec<SubServer> = Vec::new();
            for slot in loaded.subs.drain(..) {
                if let Slot::Local(s) = slot {
                    subs.push(s);
                }
            }
            let p = crate::profile::profile_models(&mut subs);
            loaded.subs = subs.into_iter().map(Slot::Local).collect();
            p
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
                for slot in loaded.subs {
                    match slot {
                        Slot::Local(sub) => {
                            let (itx, irx) = mpsc::channel();
                            inboxes.push(Inbox::Local(itx));
                            let etx = tx.clone();
                            let name = format!("tokenrouter-model-{}", sub.idx);
                            let emit = move |idx, o| etx.send(ToExchange::Out(idx, o)).is_ok();
                            spawn(name, Box::new(move || run_subserver(sub, irx, emit)))?;
                        }
                        Slot::Remote(c) => {
                            let Some(rt) = remote_rt.0.as_ref() else {
                                return Err(EngineError::Start(
                                    "no runtime for remote models".into(),
                                ));
                            };
                            inboxes.push(Inbox::Remote(crate::remote::proxy::spawn_proxy(
                                rt.handle(),
                                *c,
                                loaded.shared.clone(),
                                tx.clone(),
                                self.inner.remote_stats.clone(),
                            )));
                        }
                    }
                }
                spawn(
                    "tokenrouter-exchange".into(),
                    Box::new(move || run_exchange(rx, inboxes)),
                )?;
            }
            Execution::Sync => {
                // `execution: sync` is refused with remote models (config check).
                let subs: Vec<SubServer> = loaded
                    .subs
                    .into_iter()
                    .filter_map(|s| match s {
                        Slot::Local(s) => Some(s),
                        Slot::Remote(_) => None,
                    })
                    .collect();
                spawn(
                    "tokenrouter-lockstep".into(),
                    Box::new(move || run_lockstep(subs, rx)),
                )?;
            }
        }
        if let Ok(mut slot) = self.inner.remote_rt.lock() {
            *slot = Some(remote_rt);
        }
        let _ = self.inner.grammar.set(Arc::new(LazyCompiler::new(
            loaded.text.tokenizer().clone(),
            loaded.text.vocab_len(),
            loaded.text.eos_ids().to_vec(),
        )));
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
            .any(|m| m.device.is_cuda());
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
        // Structured output's token table, built now rather than inside the first
        // constrained request's submission.
        if let Some(grammar) = self.inner.grammar.get() {
            grammar.build_in_background();
        }
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

    /// Reconnects and first-contact re-sends of the remote models' proxies.
    pub fn remote_stats(&self) -> Arc<crate::remote::ProxyStats> {
        self.inner.remote_stats.clone()
    }

    pub fn text(&self) -> Option<Arc<TextModel>> {
        self.inner.text.get().cloned()
    }

    /// Generate a whole completion for a raw prompt (library API).
    pub async fn generate(
        &self,
        prompt: &str,
        params: GenerateParams,
    ) -> Result<FinishedGeneration, EngineError> {
        let mut stream = self.generate_stream(prompt, params)?;
        let mut g = FinishedGeneration::default();
        while let Some(ev) = stream.events.recv().await {
            match ev {
                GenerateEvent::Token(t) => {
                    g.token_ids.push(t.id);
                    g.sources.push(t.source);
                }
                // The library API does not ask for prompt scores.
                GenerateEvent::Prompt(_) => {}
                GenerateEvent::PromptCached(n) => g.cached_prompt_tokens = n,
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
            max_tokens: Some(self.max_tokens),
            stop_token_ids: self.stop_token_ids,
            ignore_eos: self.ignore_eos,
            pinned_model: self.pinned_model,
            top_logprobs: 0,
            routing: Default::default(),
            prompt_logprobs: None,
            constraint: None,
            priority: 0,
            cache_salt: None,
        }
    }
}

/// A finished generation.
#[derive(Clone, Debug, Default)]
pub struct FinishedGeneration {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Which model wrote each token.
    pub sources: Vec<usize>,
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens the first model took from its prefix cache.
    pub cached_prompt_tokens: usize,
}
