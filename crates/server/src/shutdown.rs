//! Serving on a listener with graceful shutdown: when the caller's shutdown future resolves
//! (the binary wires SIGTERM / ctrl-c), stop accepting connections, answer new generation
//! requests and `/health` with 503, let in-flight requests finish for `shutdown_grace`,
//! then abort the rest (their engine streams are dropped) and return.

use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;

use tokenrouter_api::Backend;
use tokio::net::TcpListener;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::state::Lifecycle;

/// How long aborted requests get to send their last bytes before `serve` returns anyway.
const AFTER_ABORT: Duration = Duration::from_secs(5);

pub async fn serve<F>(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    shutdown: F,
) -> Result<(), ServerError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let grace = cfg.shutdown_grace;
    let (app, lifecycle) = crate::build(backend, cfg)?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving the OpenAI-compatible API");
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = stop_rx.await;
        })
        .into_future();
    tokio::pin!(server);
    tokio::pin!(shutdown);
    tokio::select! {
        result = &mut server => return result.map_err(ServerError::Io),
        () = &mut shutdown => {}
    }
    drain(&lifecycle, stop_tx, server, grace).await
}

async fn drain<S>(
    lifecycle: &Arc<Lifecycle>,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    mut server: std::pin::Pin<&mut S>,
    grace: Duration,
) -> Result<(), ServerError>
where
    S: Future<Output = std::io::Result<()>>,
{
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "shutting down: draining in-flight requests"
    );
    lifecycle.start_draining();
    let _ = stop_tx.send(());
    if let Ok(result) = tokio::time::timeout(grace, server.as_mut()).await {
        return result.map_err(ServerError::Io);
    }
    tracing::warn!("shutdown grace period over: aborting in-flight requests");
    lifecycle.abort_all();
    match tokio::time::timeout(AFTER_ABORT, server.as_mut()).await {
        Ok(result) => result.map_err(ServerError::Io),
        Err(_) => {
            tracing::warn!("some connections did not close after the abort; exiting anyway");
            Ok(())
        }
    }
}
