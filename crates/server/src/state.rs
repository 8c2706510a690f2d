//! Shared state of all handlers: the backend, the config, metrics and the shutdown
//! lifecycle, plus the resolution of the request's `model` field (routed vs pinned).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokenrouter_api::{Backend, ModelIndex, ModelInfo, SubmitError};
use tokio::sync::watch;

use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::fim::FimTokens;
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct AppState {
    pub backend: Arc<dyn Backend>,
    pub config: Arc<ServerConfig>,
    pub metrics: Arc<Metrics>,
    pub lifecycle: Arc<Lifecycle>,
    /// Running `/generate` requests by rid (SGLang's `/abort_request`).
    pub aborts: Arc<crate::aborts::Aborts>,
    /// Finished Responses API answers (`store`).
    pub responses: Arc<crate::response_store::ResponseStore>,
    /// Responses running in the background, and ended streamed ones kept for reading.
    pub jobs: Arc<crate::background::Jobs>,
    /// The tokenizer's fill-in-the-middle tokens, looked up once the models are loaded.
    pub fim: Arc<OnceLock<Option<FimTokens>>>,
}

/// Shutdown phases: draining (new generation requests get 503, health is 503) and then
/// aborting (in-flight generations stop and drop their engine streams).
pub struct Lifecycle {
    draining: AtomicBool,
    abort: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            abort: watch::channel(false).0,
        }
    }
}

impl Lifecycle {
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Tells every in-flight generation to stop now.
    pub fn abort_all(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.abort.send_replace(true);
    }

    /// Resolves once [`Lifecycle::abort_all`] has been called.
    pub fn abort_signal(&self) -> watch::Receiver<bool> {
        self.abort.subscribe()
    }
}

/// The model a request asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelChoice {
    /// Name echoed in responses and used as the metrics label.
    pub name: String,
    /// `None` = token-level routing across all models.
    pub pinned: Option<ModelIndex>,
    /// Context length that bounds prompt + output.
    pub context_length: usize,
}

impl AppState {
    /// `None` or the served (routed) name → routing; a configured model's name → pinned to
    /// it; anything else → 404.
    pub fn resolve_model(&self, requested: Option<&str>) -> Result<ModelChoice, ApiError> {
        let models = self.backend.models();
        let routed_name = self.config.served_model_name.as_str();
        match requested {
            None => routed(routed_name, &models),
            Some(name) if name == routed_name => routed(routed_name, &models),
            Some(name)
                if self.config.served_model_aliases.iter().any(|a| a == name)
                    && !models.iter().any(|m| m.name == name) =>
            {
                routed(routed_name, &models)
            }
            Some(name) => match models.iter().position(|m| m.name == name) {
                Some(index) => Ok(ModelChoice {
                    name: name.to_string(),
                    pinned: Some(index),
                    context_length: models[index].context_length,
                }),
                None => Err(ApiError::ModelNotFound(crate::error::truncate_for_echo(
                    name,
                ))),
            },
        }
    }

    /// Rejects work while shutting down (503) or while the models are loading (503).
    pub fn check_ready(&self) -> Result<(), ApiError> {
        self.check_accepting()?;
        if self.backend.is_ready() {
            Ok(())
        } else {
            Err(SubmitError::NotReady("the models are still loading".into()).into())
        }
    }

    /// Tokenize prompt text for `model`, refusing text that could never fit before any work,
    /// and off the async executor (a large prompt never stalls `/health` or other requests).
    pub async fn encode_prompt(
        &self,
        text: String,
        context_length: usize,
    ) -> Result<Vec<u32>, ApiError> {
        self.check_prompt_size(text.len(), context_length)?;
        let backend = self.backend.clone();
        tokio::task::spawn_blocking(move || backend.encode(&text))
            .await
            .map_err(|e| ApiError::Engine(format!("tokenizer task: {e}")))?
            .map_err(ApiError::from)
    }

    /// The cheap size check of `encode_prompt`, for callers that render text first.
    pub fn check_prompt_size(&self, bytes: usize, context_length: usize) -> Result<(), ApiError> {
        let limit = context_length
            .max(1)
            .saturating_mul(self.config.max_prompt_bytes_per_token);
        if bytes > limit {
            return Err(ApiError::PromptTooLong {
                bytes,
                limit,
                context_length,
            });
        }
        Ok(())
    }

    /// The served tokenizer's fill-in-the-middle tokens (`None`: it has none). Call once
    /// the models are ready (the answer is kept).
    pub fn fim_tokens(&self) -> Option<FimTokens> {
        self.fim
            .get_or_init(|| FimTokens::find(self.backend.as_ref()))
            .clone()
    }

    /// Rejects new work while shutting down.
    pub fn check_accepting(&self) -> Result<(), ApiError> {
        if self.lifecycle.is_draining() {
            Err(ApiError::ShuttingDown)
        } else {
            Ok(())
        }
    }
}

fn routed(name: &str, models: &[ModelInfo]) -> Result<ModelChoice, ApiError> {
    let context_length = models
        .iter()
        .map(|m| m.context_length)
        .min()
        .ok_or_else(|| SubmitError::NotReady("no model is configured".into()))?;
    Ok(ModelChoice {
        name: name.to_string(),
        pinned: None,
        context_length,
    })
}
