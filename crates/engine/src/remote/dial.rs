//! Reaching a remote sub-server: connect, greet (protocol version, tokenizer), send the
//! pair's limits and read back what a request may override in its policy. The engine does
//! this once at start (waiting while the sub-server loads); the proxy again after every
//! reconnect.

use crate::config::EngineConfig;
use crate::engine::EngineError;
use crate::policy::Tunable;
use std::time::{Duration, Instant};
use tokenrouter_api::ModelIndex;
use tokenrouter_wire::{connect, pb, source_chain, ConnectOptions, PeerAddress, PROTOCOL_VERSION};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

pub(super) type FrontTx = UnboundedSender<pb::FrontMsg>;

pub(super) fn send(tx: &FrontTx, m: pb::front_msg::M) -> bool {
    tx.send(pb::FrontMsg { m: Some(m) }).is_ok()
}

/// An open session with a remote sub-server, after Hello / Welcome.
pub(crate) struct Session {
    pub welcome: pb::Welcome,
    pub(super) tx: FrontTx,
    pub(super) rx: tonic::Streaming<pb::RemoteMsg>,
}

/// What the proxy needs to (re)open a session.
#[derive(Clone)]
pub(crate) struct Dial {
    pub idx: ModelIndex,
    pub name: String,
    pub addr: PeerAddress,
    pub hello: pb::Hello,
    pub opts: ConnectOptions,
}

impl Dial {
    /// Connect and greet: a session whose Welcome passed the version and vocabulary checks.
    pub(crate) async fn open(&self) -> Result<Session, String> {
        let mut client = connect(&self.addr, &self.opts)
            .await
            .map_err(|e| e.to_string())?;
        let (tx, rx) = unbounded_channel();
        send(&tx, pb::front_msg::M::Hello(self.hello.clone()));
        let not_ours = |e: &dyn std::error::Error| {
            format!(
                "{}: not a tokenrouter sub-server ({})",
                self.addr,
                source_chain(e)
            )
        };
        let response = tokio::time::timeout(
            self.opts.connect_timeout,
            client.session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)),
        )
        .await
        .map_err(|_| format!("{}: no answer to the session request", self.addr))?
        .map_err(|e| not_ours(&e))?;
        let mut stream = response.into_inner();
        let first = tokio::time::timeout(self.opts.connect_timeout, stream.message())
            .await
            .map_err(|_| format!("{}: no answer to Hello", self.addr))?
            .map_err(|e| not_ours(&e))?;
        let welcome = match first.and_then(|m| m.m) {
            Some(pb::remote_msg::M::Welcome(w)) => w,
            Some(pb::remote_msg::M::Refuse(r)) => {
                return Err(if r.protocol_version != PROTOCOL_VERSION {
                    format!(
                        "protocol version {PROTOCOL_VERSION} (front end) vs {} (sub-server at {}): {}",
                        r.protocol_version, self.addr, r.reason
                    )
                } else {
                    format!("the sub-server at {} refused: {}", self.addr, r.reason)
                })
            }
            _ => {
                return Err(format!(
                    "{}: not a tokenrouter sub-server (no Welcome)",
                    self.addr
                ))
            }
        };
        if welcome.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "protocol version {PROTOCOL_VERSION} (front end) vs {} (sub-server at {})",
                welcome.protocol_version, self.addr
            ));
        }
        if welcome.vocab_sha256 != self.hello.vocab_sha256 {
            return Err(format!(
                "the sub-server at {} serves a model with another tokenizer than `{}`'s",
                self.addr, self.hello.model_names[0]
            ));
        }
        Ok(Session {
            welcome,
            tx,
            rx: stream,
        })
    }
}

impl Session {
    /// Send the pair's limits and wait for the remote to be ready to serve.
    pub(crate) async fn configure(
        &mut self,
        c: pb::Configure,
        wait: Duration,
    ) -> Result<Vec<pb::Tunable>, String> {
        send(&self.tx, pb::front_msg::M::Configure(c));
        loop {
            let m = tokio::time::timeout(wait, self.rx.message())
                .await
                .map_err(|_| "no answer to Configure".to_string())?
                .map_err(|e| source_chain(&e))?;
            match m.and_then(|m| m.m) {
                Some(pb::remote_msg::M::Ready(r)) => return Ok(r.tunables),
                Some(pb::remote_msg::M::Refuse(r)) => return Err(r.reason),
                Some(_) => continue,
                None => return Err("the sub-server closed the session".into()),
            }
        }
    }
}

/// A remote model, connected and greeted, before the engine starts its proxy.
pub(crate) struct Connected {
    pub dial: Dial,
    pub session: Session,
    pub configure: pb::Configure,
    pub timings: ProxyTimings,
}

/// Connect to model `idx`'s sub-server (blocking, at most `remote.connect_timeout_s`).
pub(crate) fn connect_remote(
    rt: &tokio::runtime::Runtime,
    config: &EngineConfig,
    idx: ModelIndex,
    addr: &PeerAddress,
    vocab_sha256: &[u8],
) -> Result<Connected, EngineError> {
    let m = &config.models[idx];
    let settings = &config.system.remote;
    let connect_timeout = Duration::from_secs_f64(settings.connect_timeout_s);
    let dial = Dial {
        idx,
        name: m.name.clone(),
        addr: addr.clone(),
        hello: pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            front_instance: rand::random(),
            model_name: m.name.clone(),
            model_index: idx as u32,
            model_names: config.models.iter().map(|m| m.name.clone()).collect(),
            expect: Some(super::identity(m)),
            vocab_sha256: vocab_sha256.to_vec(),
        },
        opts: ConnectOptions {
            connect_timeout: Duration::from_secs(5).min(connect_timeout),
            keepalive: Duration::from_secs_f64((settings.timeout_s / 3.0).max(0.05)),
        },
    };
    let err = |message: String| EngineError::Model {
        model: m.name.clone(),
        path: addr.to_string(),
        message,
    };
    // Retry until the deadline: the sub-server may still be loading its weights.
    let deadline = Instant::now() + connect_timeout;
    let session = rt
        .block_on(async {
            loop {
                match dial.open().await {
                    Ok(s) => return Ok(s),
                    Err(e)
                        if e.contains("not a tokenrouter")
                            || e.contains("protocol version")
                            || e.contains("refused:")
                            || e.contains("tokenizer") =>
                    {
                        return Err(e)
                    }
                    Err(e) if Instant::now() >= deadline => {
                        return Err(format!(
                            "cannot reach the sub-server within {:.0} s: {e}",
                            connect_timeout.as_secs_f64()
                        ))
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        })
        .map_err(err)?;
    Ok(Connected {
        dial,
        session,
        configure: pb::Configure::default(),
        timings: ProxyTimings {
            timeout: Duration::from_secs_f64(settings.timeout_s),
            max_backoff: Duration::from_millis(settings.reconnect_max_backoff_ms.max(1)),
        },
    })
}

impl Connected {
    /// Send the pair's limits; the remote builds its sub-server and says what a request
    /// may override in its policy.
    pub(crate) fn configure(
        &mut self,
        rt: &tokio::runtime::Runtime,
        context_limit: usize,
        sample_limit: usize,
    ) -> Result<Vec<Tunable>, EngineError> {
        self.configure = pb::Configure {
            sample_limit: sample_limit as u32,
            context_limit: context_limit as u32,
        };
        let wait = self.dial.opts.connect_timeout.max(Duration::from_secs(60));
        let tunables = rt
            .block_on(self.session.configure(self.configure, wait))
            .map_err(|message| EngineError::Model {
                model: self.dial.name.clone(),
                path: self.dial.addr.to_string(),
                message,
            })?;
        Ok(tunables
            .into_iter()
            .map(|t| Tunable {
                // Keys are static in the policies; a remote's live as long as the process.
                key: Box::leak(t.key.into_boxed_str()),
                min: t.min,
                max: t.max,
            })
            .collect())
    }
}

/// Settings of the proxies (`system.remote`).
#[derive(Clone, Copy)]
pub(crate) struct ProxyTimings {
    pub timeout: Duration,
    pub max_backoff: Duration,
}
