//! `tokenrouter subserver`: one model of a config served to a front end in another process
//! (the front end's config gives that model `address:`). Beside the peer port, a small HTTP
//! port answers `/health` and `/metrics` for this process.

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokenrouter_engine::remote::{start_subserver, HostOptions, SubserverHost};

#[derive(clap::Args)]
pub struct SubserverArgs {
    /// The same YAML config the front end uses.
    #[arg(long, env = "TOKENROUTER_CONFIG")]
    config: PathBuf,
    /// Change one value of the config (as `serve --set`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The model of the config this process serves.
    #[arg(long)]
    model: String,
    /// Where front ends connect: `tcp://host:port` (port 0: any) or `ipc:///path`.
    /// Default: the model's `address:` in the config.
    #[arg(long)]
    listen: Option<String>,
    /// Host and port of `/health` and `/metrics`.
    #[arg(long, default_value = "127.0.0.1:0")]
    http: String,
}

type Host = Arc<Mutex<SubserverHost>>;

pub fn run(a: SubserverArgs) -> Result<()> {
    let cfg = crate::engine_config_with(Some(&a.config), &a.set)?;
    let listen = match a.listen.as_deref() {
        Some(l) => l.to_string(),
        None => cfg
            .models
            .iter()
            .find(|m| m.name == a.model)
            .and_then(|m| m.section.address.clone())
            .with_context(|| {
                format!(
                    "model `{}` has no `address:` in {}: give --listen",
                    a.model,
                    a.config.display()
                )
            })?,
    };
    let listen = listen.parse()?;
    let host = start_subserver(cfg, &a.model, HostOptions { listen })?;
    println!("listening on {}", host.local_addr());
    let host: Host = Arc::new(Mutex::new(host));
    let rt = tokio::runtime::Runtime::new()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.http)
            .await
            .with_context(|| format!("cannot listen on {}", a.http))?;
        println!("http on {}", listener.local_addr()?);
        let app = axum::Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .with_state(host.clone());
        axum::serve(listener, app)
            .with_graceful_shutdown(crate::shutdown_signal())
            .await
            .context("http server")
    });
    if let Ok(mut h) = host.lock() {
        h.shutdown();
    }
    tracing::info!("stopped");
    served
}

async fn health(State(host): State<Host>) -> Response {
    let Ok(h) = host.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let front = if h.front_connected() {
        "connected"
    } else {
        "waiting"
    };
    match h.unhealthy() {
        None => Json(serde_json::json!({"status": "ok", "model": h.model_name(), "front": front}))
            .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({
                "status": "unhealthy",
                "models": {h.model_name(): format!("down: {reason}")},
            })),
        )
            .into_response(),
    }
}

async fn metrics(State(host): State<Host>) -> Response {
    match host.lock() {
        Ok(h) => h.metrics_text().into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
