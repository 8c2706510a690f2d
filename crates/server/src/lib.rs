//! tokenrouter's OpenAI-compatible HTTP server. It only knows the [`Backend`] trait of
//! `tokenrouter-api`, so it is tested with mock backends and runs unchanged over the real
//! routing engine.
//!
//! - [`router`] builds the axum app (testable with `tower::ServiceExt::oneshot`);
//! - [`serve`] runs it on a listener with graceful shutdown;
//! - [`batch::run_batch`] runs OpenAI's batch file format through it in-process.
//!
//! Extensions beside the standard OpenAI fields: a top-level `tokenrouter` object
//! (`tokens_by_model`, `switches`), per-choice `token_sources` / `token_details` when the
//! request sets `return_token_sources`, and a `source` on each logprob entry.

mod aborts;
mod answer_reader;
mod anthropic;
mod auth;
mod background;
pub mod batch;
mod choice;
mod config;
mod constraint;
mod cors;
mod detok;
mod echo;
mod error;
mod extract;
mod fim;
mod generation;
mod line_limits;
mod llama_samplers;
mod llamacpp;
mod metrics;
mod native;
mod openai;
mod params;
mod prompt_logprobs;
mod provenance;
mod reasoning;
mod render;
mod respond;
mod response_store;
mod responses;
mod routes;
pub mod sglang;
mod shutdown;
mod state;
mod stop;
mod streaming;
mod tools;
mod web;

use std::sync::Arc;

pub use config::{
    CorsPolicy, ReasoningParser, ServerConfig, ToolCallParser, DEFAULT_SERVED_MODEL_NAME,
};
pub use error::{ApiError, ServerError};
pub use shutdown::serve;
pub use tokenrouter_api::Backend;

/// Engine tokens to text, as the server releases it: incremental detokenization, stop
/// strings across tokens of different models, and which tokens each piece of text carries.
/// Public so in-process clients (the Python package) return exactly what HTTP returns.
pub mod text {
    pub use crate::choice::{ChoiceDecoder, Delta, OutToken, Step, StopMatch};
    pub use crate::stop::StopStrings;
}

use state::{AppState, Lifecycle};

/// The HTTP app over `backend`. Shutdown handling needs [`serve`]; a bare router never
/// drains.
pub fn router(backend: Arc<dyn Backend>, cfg: ServerConfig) -> axum::Router {
    match build(backend, cfg) {
        Ok((app, _)) => app,
        // Registering fixed, valid metric names in a fresh registry cannot fail.
        Err(e) => unreachable!("metrics registry: {e}"),
    }
}

fn build(
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
) -> Result<(axum::Router, Arc<Lifecycle>), ServerError> {
    let lifecycle = Arc::new(Lifecycle::default());
    let state = AppState {
        backend,
        responses: Arc::new(response_store::ResponseStore::new(cfg.max_stored_responses)),
        jobs: Arc::new(background::Jobs::new(cfg.max_stored_responses)),
        config: Arc::new(cfg),
        metrics: Arc::new(metrics::Metrics::new().map_err(ServerError::Metrics)?),
        lifecycle: lifecycle.clone(),
        aborts: Default::default(),
        fim: Default::default(),
    };
    Ok((routes::build(state), lifecycle))
}
