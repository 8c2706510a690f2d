//! The remote side: one model of a config served to a front end over the peer protocol
//! (`tokenrouter subserver`). It runs the same `SubServer` loop as in one process, over
//! copies of the requests it serves. A copy is *here* while the sub-server holds it and
//! *away* (kept, with its KV) after it was handed back; each hand-off patches it by the
//! delta. Events and hand-backs leave through one queue, so a request's tokens always
//! precede its hand-back.

use crate::config::EngineConfig;
use crate::engine::load::{build_subserver, load_one, new_shared, token_text};
use crate::engine::{run_subserver, EngineError};
use crate::metrics::EngineMetrics;
use crate::policy::Registry;
use crate::request::PeerOut;
use crate::subserver::{Inbound, Shared};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tokenrouter_api::ModelIndex;
use tokenrouter_grammar::LazyCompiler;
use tokenrouter_runtime::LoadedModel;
use tokenrouter_wire::{pb, Listener, PeerAddress, WireError, PROTOCOL_VERSION};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio_stream::StreamExt;

/// How the sub-server listens.
#[derive(Clone, Debug)]
pub struct HostOptions {
    pub listen: PeerAddress,
}

/// The model before the first front end configured it, then the running sub-server.
enum Stage {
    Loaded(Box<LoadedModel>),
    Running {
        limits: (u32, u32),
        inbox: mpsc::Sender<Inbound>,
        shared: Arc<Shared>,
        tunables: Vec<pb::Tunable>,
    },
    Failed(String),
}

pub(super) struct HostState {
    pub(super) idx: ModelIndex,
    pub(super) name: String,
    pub(super) config: EngineConfig,
    pub(super) identity: pb::Identity,
    pub(super) welcome: pb::Welcome,
    pub(super) metrics: Arc<EngineMetrics>,
    stage: Mutex<Stage>,
    /// The sub-server's single output queue (taken by the live session).
    pub(super) out_rx: tokio::sync::Mutex<UnboundedReceiver<PeerOut>>,
    pub(super) out_tx: UnboundedSender<PeerOut>,
    /// The front end being served, if any.
    pub(super) front: Mutex<Option<u64>>,
    /// Bumped to end the live session (its front end reconnected).
    pub(super) kick: tokio::sync::watch::Sender<u64>,
    /// Structured output's token table (built in the background at start).
    pub(super) grammar: Arc<LazyCompiler>,
    /// DRY's sequence breakers as token sequences, by the texts requests gave.
    pub(super) dry: crate::dry_breakers::DryTables,
}

/// A running `tokenrouter subserver`.
pub struct SubserverHost {
    state: Arc<HostState>,
    addr: PeerAddress,
    rt: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Load model `model` of `config` and listen for a front end. Returns once listening.
pub fn start_subserver(
    config: EngineConfig,
    model: &str,
    opts: HostOptions,
) -> Result<SubserverHost, EngineError> {
    let idx = config
        .models
        .iter()
        .position(|m| m.name == model)
        .ok_or_else(|| {
            EngineError::Start(format!(
                "{}: no model `{model}` (the config has {})",
                config.file.display(),
                config
                    .models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    let m = config.models[idx].clone();
    let loaded = load_one(&config, &m, idx)?;
    let runner = &loaded.model.runner;
    let welcome = pb::Welcome {
        protocol_version: PROTOCOL_VERSION,
        remote_instance: rand::random(),
        model_name: m.name.clone(),
        identity: Some(super::identity(&m)),
        vocab_sha256: super::vocab_fingerprint(&loaded.model.text),
        real_vocab_len: loaded.model.text.real_vocab_len() as u32,
        logits_width: runner.config().vocab_size as u32,
        context_length: runner.max_len() as u32,
        source: loaded.path.display().to_string(),
        device: m.section.device.clone(),
        kv_total_blocks: runner.usage().total_blocks as u64,
    };
    let metrics = Arc::new(EngineMetrics::new().map_err(|e| EngineError::Start(e.to_string()))?);
    let (out_tx, out_rx) = unbounded_channel();
    let text = &loaded.model.text;
    let grammar = Arc::new(LazyCompiler::new(
        text.tokenizer().clone(),
        text.vocab_len(),
        text.eos_ids().to_vec(),
    ));
    grammar.build_in_background();
    let state = Arc::new(HostState {
        idx,
        name: m.name.clone(),
        identity: super::identity(&m),
        config,
        welcome,
        metrics,
        stage: Mutex::new(Stage::Loaded(Box::new(loaded.model))),
        out_rx: tokio::sync::Mutex::new(out_rx),
        out_tx,
        front: Mutex::new(None),
        kick: tokio::sync::watch::channel(0).0,
        grammar,
        dry: Default::default(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tokenrouter-peer")
        .enable_all()
        .build()
        .map_err(|e| EngineError::Start(e.to_string()))?;
    let listener = rt
        .block_on(Listener::bind(&opts.listen))
        .map_err(|e| EngineError::Start(e.to_string()))?;
    let addr = listener
        .local_addr()
        .map_err(|e| EngineError::Start(e.to_string()))?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let svc = PeerService {
        state: state.clone(),
    };
    let keepalive = Duration::from_secs_f64((state.config.system.remote.timeout_s / 3.0).max(0.05));
    rt.spawn(async move {
        let shutdown = async {
            let _ = stop_rx.await;
        };
        if let Err(e) = listener.serve(svc, keepalive, shutdown).await {
            tracing::error!(error = %e, "the peer listener stopped");
        }
    });
    tracing::info!(model = %state.name, %addr, "sub-server listening");
    Ok(SubserverHost {
        state,
        addr,
        rt: Some(rt),
        stop: Some(stop_tx),
    })
}

impl SubserverHost {
    /// Where front ends connect (port 0 resolved).
    pub fn local_addr(&self) -> &PeerAddress {
        &self.addr
    }

    pub fn model_name(&self) -> &str {
        &self.state.name
    }

    /// Whether a front end is connected.
    pub fn front_connected(&self) -> bool {
        self.state
            .front
            .lock()
            .map(|f| f.is_some())
            .unwrap_or(false)
    }

    /// Why the model cannot serve, if it cannot.
    pub fn unhealthy(&self) -> Option<String> {
        match &*self.state.stage.lock().ok()? {
            Stage::Running { shared, .. } => shared.down_reason(self.state.idx),
            Stage::Failed(e) => Some(e.clone()),
            Stage::Loaded(_) => None,
        }
    }

    /// KV blocks in use (0 before the first front end).
    pub fn kv_used_blocks(&self) -> usize {
        match self.state.stage.lock().as_deref() {
            Ok(Stage::Running { shared, .. }) => {
                shared.kv_used[self.state.idx].load(Ordering::SeqCst)
            }
            _ => 0,
        }
    }

    pub fn metrics_text(&self) -> String {
        self.state.metrics.text()
    }

    /// Stop listening (the live session ends; the front end sees the model go down).
    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.state.kick.send_modify(|g| *g += 1);
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl Drop for SubserverHost {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

struct PeerService {
    state: Arc<HostState>,
}

type RemoteStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::RemoteMsg, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl tokenrouter_wire::Peer for PeerService {
    type SessionStream = RemoteStream;

    async fn session(
        &self,
        request: tonic::Request<tonic::Streaming<pb::FrontMsg>>,
    ) -> Result<tonic::Response<RemoteStream>, tonic::Status> {
        let inbound = request.into_inner();
        let (tx, rx) = unbounded_channel();
        tokio::spawn(run_session(self.state.clone(), inbound, tx));
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(Ok);
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

pub(super) type RemoteTx = UnboundedSender<pb::RemoteMsg>;

pub(super) fn send(tx: &RemoteTx, m: pb::remote_msg::M) -> bool {
    tx.send(pb::RemoteMsg { m: Some(m) }).is_ok()
}

fn refuse(tx: &RemoteTx, reason: String) {
    tracing::warn!(%reason, "refused a front end");
    send(
        tx,
        pb::remote_msg::M::Refuse(pb::Refuse {
            protocol_version: PROTOCOL_VERSION,
            reason,
        }),
    );
}

async fn next_msg(
    inbound: &mut tonic::Streaming<pb::FrontMsg>,
    wait: Duration,
) -> Option<pb::front_msg::M> {
    match tokio::time::timeout(wait, inbound.message()).await {
        Ok(Ok(Some(m))) => m.m,
        _ => None,
    }
}

/// Check a front end's greeting against what this process serves.
fn check_hello(state: &HostState, h: &pb::Hello) -> Result<(), String> {
    if h.protocol_version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} (front end) vs {PROTOCOL_VERSION} (sub-server `{}`)",
            h.protocol_version, state.name
        ));
    }
    if h.model_name != state.name || h.model_index as usize != state.idx {
        return Err(format!(
            "this sub-server serves `{}` (model {} of its config), not `{}` (model {})",
            state.name, state.idx, h.model_name, h.model_index
        ));
    }
    let names: Vec<&str> = state
        .config
        .models
        .iter()
        .map(|m| m.name.as_str())
        .collect();
    if h.model_names
        .iter()
        .map(String::as_str)
        .ne(names.iter().copied())
    {
        return Err(format!(
            "the configs name other models: [{}] (front end) vs [{}] (sub-server)",
            h.model_names.join(", "),
            names.join(", ")
        ));
    }
    let expect = h.expect.clone().unwrap_or_default();
    let diff = super::identity_differences(&expect, &state.identity);
    if !diff.is_empty() {
        return Err(format!(
            "model `{}` is configured differently: {}",
            state.name,
            diff.join("; ")
        ));
    }
    if h.vocab_sha256 != state.welcome.vocab_sha256 {
        return Err(format!(
            "model `{}` has another tokenizer than the front end's models",
            state.name
        ));
    }
    Ok(())
}

/// Build the sub-server at the first Configure (it needs the pair's limits); a later one
/// must bring the same limits.
fn configure(state: &HostState, c: &pb::Configure) -> Result<Vec<pb::Tunable>, String> {
    let mut stage = state.stage.lock().map_err(|_| "poisoned".to_string())?;
    let limits = (c.sample_limit, c.context_limit);
    match &*stage {
        Stage::Running {
            limits: have,
            tunables,
            ..
        } => {
            return if *have == limits {
                Ok(tunables.clone())
            } else {
                Err(format!(
                    "this sub-server runs with sample limit {} and context limit {}; the front \
                     end asks for {} and {}: restart the sub-server",
                    have.0, have.1, limits.0, limits.1
                ))
            }
        }
        Stage::Failed(e) => return Err(e.clone()),
        Stage::Loaded(_) => {}
    }
    let Stage::Loaded(model) = std::mem::replace(&mut *stage, Stage::Failed("building".into()))
    else {
        return Err("unreachable".into());
    };
    let shared = match new_shared(
        &state.config,
        c.context_limit as usize,
        c.sample_limit as usize,
        state.metrics.clone(),
    ) {
        Ok(s) => s,
        Err(e) => {
            *stage = Stage::Failed(e.to_string());
            return Err(e.to_string());
        }
    };
    let text = token_text(&model.text, c.sample_limit as usize);
    let built = build_subserver(
        &state.config,
        &Registry::default(),
        state.idx,
        model.runner,
        text,
        &shared,
    );
    let (sub, declared) = match built {
        Ok(b) => b,
        Err(e) => {
            *stage = Stage::Failed(e.to_string());
            return Err(e.to_string());
        }
    };
    if let Ok(t) = crate::routing_knob::Tunables::new(
        declared.clone(),
        &state.config.system.request_routing,
        &state.config.file,
    ) {
        let _ = shared.tunables.set(t);
    }
    let (itx, irx) = mpsc::channel();
    let out = state.out_tx.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("tokenrouter-model-{}", state.idx))
        .spawn(move || run_subserver(sub, irx, |_, o| out.send(PeerOut::Out(o)).is_ok()));
    if let Err(e) = spawned {
        *stage = Stage::Failed(e.to_string());
        return Err(e.to_string());
    }
    let tunables: Vec<pb::Tunable> = declared
        .iter()
        .map(|t| pb::Tunable {
            key: t.key.to_string(),
            min: t.min,
            max: t.max,
        })
        .collect();
    *stage = Stage::Running {
        limits,
        inbox: itx,
        shared,
        tunables: tunables.clone(),
    };
    Ok(tunables)
}

/// One front end's session: handshake, then requests until the stream ends.
async fn run_session(
    state: Arc<HostState>,
    mut inbound: tonic::Streaming<pb::FrontMsg>,
    tx: RemoteTx,
) {
    let wait = Duration::from_secs(30);
    let Some(pb::front_msg::M::Hello(hello)) = next_msg(&mut inbound, wait).await else {
        refuse(&tx, "expected Hello".into());
        return;
    };
    if let Err(reason) = check_hello(&state, &hello) {
        refuse(&tx, reason);
        return;
    }
    {
        let Ok(mut front) = state.front.lock() else {
            return;
        };
        match *front {
            Some(f) if f != hello.front_instance => {
                refuse(
                    &tx,
                    format!(
                        "sub-server `{}` already serves another front end",
                        state.name
                    ),
                );
                return;
            }
            Some(_) => state.kick.send_modify(|g| *g += 1),
            None => {}
        }
        *front = Some(hello.front_instance);
    }
    send(&tx, pb::remote_msg::M::Welcome(state.welcome.clone()));
    let served = serve_configured(&state, &mut inbound, &tx, wait).await;
    if let Err(reason) = served {
        refuse(&tx, reason);
    }
    if let Ok(mut front) = state.front.lock() {
        if *front == Some(hello.front_instance) {
            *front = None;
        }
    }
}

async fn serve_configured(
    state: &Arc<HostState>,
    inbound: &mut tonic::Streaming<pb::FrontMsg>,
    tx: &RemoteTx,
    wait: Duration,
) -> Result<(), String> {
    let Some(pb::front_msg::M::Configure(c)) = next_msg(inbound, wait).await else {
        return Err("expected Configure".into());
    };
    let st = state.clone();
    let tunables = tokio::task::spawn_blocking(move || configure(&st, &c))
        .await
        .map_err(|e| e.to_string())??;
    let (inbox, shared) = match &*state.stage.lock().map_err(|_| "poisoned".to_string())? {
        Stage::Running { inbox, shared, .. } => (inbox.clone(), shared.clone()),
        _ => return Err("the sub-server is not running".into()),
    };
    // Wait for an earlier session of this front end to hand over the output queue.
    let mut kick = state.kick.subscribe();
    kick.mark_unchanged();
    let mut out_rx = state.out_rx.lock().await;
    send(tx, pb::remote_msg::M::Ready(pb::Ready { tunables }));
    let mut s = super::host_session::HostSession {
        state: state.clone(),
        inbox,
        shared,
        tx: tx.clone(),
        copies: HashMap::new(),
        last_load: None,
    };
    let mut load_tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(pb::FrontMsg { m: Some(m) })) => s.on_front(m),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            },
            o = out_rx.recv() => match o {
                Some(o) => s.on_out(o),
                None => break,
            },
            _ = load_tick.tick() => s.send_load(),
            _ = kick.changed() => break,
        }
    }
    s.end();
    Ok(())
}

impl From<WireError> for EngineError {
    fn from(e: WireError) -> Self {
        EngineError::Start(e.to_string())
    }
}
