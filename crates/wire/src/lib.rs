//! The peer protocol between a front end and a sub-server in another process: the protobuf
//! schema (`proto/peer.proto`, compiled at build time), its version, peer addresses
//! (`tcp://host:port`, `ipc:///path`) and the gRPC transport (tonic) to connect and serve.
//! It knows nothing of the engine; `tokenrouter-engine` converts its requests to and from
//! these messages.

use std::future::Future;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Server};

/// Bumped on any change of meaning; both ends must be equal (v2: prompt scores, which a
/// v1 remote would drop silently; v3: output constraints, which a v2 remote would ignore;
/// v4: token restrictions, `min_tokens` / `allowed_token_ids` / `bad_words`, likewise; v5:
/// the prompt tokens a remote's prefix cache gave, which a v4 front would not understand,
/// and `FlushCache`, which a v4 remote would not, and a request's `priority` and
/// `cache_salt`, which it would ignore; v6: llama.cpp's penalty window, which a v5 remote
/// would ignore, and penalties rebuilt from the tokens instead of sent counts; v7:
/// llama.cpp's sampler chain, which a v6 remote would ignore).
pub const PROTOCOL_VERSION: u32 = 7;

/// Largest message either side decodes (a first contact carries the whole prompt).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("tokenrouter.peer");
}

pub use pb::peer_client::PeerClient;
pub use pb::peer_server::{Peer, PeerServer};

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("`{0}` is not a peer address (expected tcp://host:port or ipc:///path)")]
    Address(String),
    #[error("cannot reach {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("cannot listen on {addr}: {message}")]
    Listen { addr: String, message: String },
    #[error("{0}")]
    Transport(String),
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Where a sub-server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAddress {
    /// `host:port` (port 0 when listening: the system picks one).
    Tcp(String),
    /// A Unix socket path.
    Ipc(PathBuf),
}

impl FromStr for PeerAddress {
    type Err = WireError;

    fn from_str(s: &str) -> Result<Self, WireError> {
        let bad = || WireError::Address(s.to_string());
        if let Some(rest) = s.strip_prefix("tcp://") {
            let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().is_err() || rest.contains('/') {
                return Err(bad());
            }
            Ok(PeerAddress::Tcp(rest.to_string()))
        } else if let Some(rest) = s.strip_prefix("ipc://") {
            if rest.is_empty() {
                return Err(bad());
            }
            Ok(PeerAddress::Ipc(PathBuf::from(rest)))
        } else {
            Err(bad())
        }
    }
}

impl std::fmt::Display for PeerAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerAddress::Tcp(hp) => write!(f, "tcp://{hp}"),
            PeerAddress::Ipc(p) => write!(f, "ipc://{}", p.display()),
        }
    }
}

/// How patient a connection is.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    pub connect_timeout: Duration,
    /// HTTP/2 keep-alive ping interval; a peer that does not answer within it is gone.
    pub keepalive: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            keepalive: Duration::from_secs(3),
        }
    }
}

/// Open a channel to a sub-server (no RPC yet: `PeerClient::session` opens the stream).
pub async fn connect(
    addr: &PeerAddress,
    opts: &ConnectOptions,
) -> Result<PeerClient<Channel>, WireError> {
    let err = |e: &dyn std::fmt::Display| WireError::Connect {
        addr: addr.to_string(),
        message: e.to_string(),
    };
    let uri = match addr {
        PeerAddress::Tcp(hp) => format!("http://{hp}"),
        PeerAddress::Ipc(_) => "http://ipc.invalid".to_string(),
    };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| err(&e))?
        .tcp_nodelay(true)
        .connect_timeout(opts.connect_timeout)
        .timeout(Duration::from_secs(60 * 60 * 24 * 365))
        .http2_keep_alive_interval(opts.keepalive)
        .keep_alive_timeout(opts.keepalive)
        .keep_alive_while_idle(true);
    let channel = match addr {
        PeerAddress::Tcp(_) => endpoint
            .connect()
            .await
            .map_err(|e| err(&source_chain(&e)))?,
        PeerAddress::Ipc(path) => {
            let path = path.clone();
            endpoint
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                    }
                }))
                .await
                .map_err(|e| err(&source_chain(&e)))?
        }
    };
    Ok(PeerClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

/// An error with its causes, for messages that name the real problem ("connection refused").
pub fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// A bound listener, before serving: its address is known (port 0 resolved).
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Ipc(tokio::net::UnixListener, PathBuf),
}

impl Listener {
    pub async fn bind(addr: &PeerAddress) -> Result<Listener, WireError> {
        let err = |e: std::io::Error| WireError::Listen {
            addr: addr.to_string(),
            message: e.to_string(),
        };
        match addr {
            PeerAddress::Tcp(hp) => Ok(Listener::Tcp(
                tokio::net::TcpListener::bind(hp).await.map_err(err)?,
            )),
            PeerAddress::Ipc(path) => {
                // A socket file left by an earlier process would make bind fail.
                if std::fs::symlink_metadata(path)
                    .map(|m| {
                        use std::os::unix::fs::FileTypeExt;
                        m.file_type().is_socket()
                    })
                    .unwrap_or(false)
                {
                    let _ = std::fs::remove_file(path);
                }
                Ok(Listener::Ipc(
                    tokio::net::UnixListener::bind(path).map_err(err)?,
                    path.clone(),
                ))
            }
        }
    }

    /// The address a client connects to.
    pub fn local_addr(&self) -> Result<PeerAddress, WireError> {
        match self {
            Listener::Tcp(l) => l
                .local_addr()
                .map(|a| PeerAddress::Tcp(a.to_string()))
                .map_err(|e| WireError::Transport(e.to_string())),
            Listener::Ipc(_, p) => Ok(PeerAddress::Ipc(p.clone())),
        }
    }

    /// Serve `svc` until `shutdown` completes.
    pub async fn serve<S: Peer>(
        self,
        svc: S,
        keepalive: Duration,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), WireError> {
        let svc = PeerServer::new(svc)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let router = Server::builder()
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(keepalive))
            .http2_keepalive_timeout(Some(keepalive))
            .add_service(svc);
        let result = match self {
            Listener::Tcp(l) => {
                let incoming =
                    tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
                router
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
            Listener::Ipc(l, _) => {
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(l);
                router
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
        };
        result.map_err(|e| WireError::Transport(source_chain(&e)))
    }
}

/// A sampler RNG position as it travels (16 bytes, little-endian).
pub fn rng_pos_bytes(pos: u128) -> Vec<u8> {
    pos.to_le_bytes().to_vec()
}

pub fn rng_pos_from(bytes: &[u8]) -> Result<u128, WireError> {
    let arr: [u8; 16] = bytes.try_into().map_err(|_| {
        WireError::Malformed(format!("rng position of {} bytes, not 16", bytes.len()))
    })?;
    Ok(u128::from_le_bytes(arr))
}

/// Nanoseconds since the Unix epoch (send stamps; the clocks of one host agree).
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
