//! Loading a config's models: device and dtype specs, model paths (relative to the config
//! file, shape files for random weights), every model loaded and checked to share one
//! tokenizer, each model's policy built, and one sub-server per model.

use super::{EngineError, Loaded};
use crate::config::{EngineConfig, NamedModel};
use crate::metrics::EngineMetrics;
use crate::policy::{PolicyContext, Registry};
use crate::subserver::{Shared, SubServer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenrouter_api::ModelInfo;
use tokenrouter_runtime::{
    check_shared_vocab, load_model, load_random_model, KvBudget, LoadOptions, LoadedModel,
    SharedVocab, TextModel,
};

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
    resolve_elsewhere(spec)
}

#[cfg(feature = "fetch")]
fn resolve_elsewhere(spec: &str) -> Result<PathBuf, String> {
    tokenrouter_fetch::resolve_model(spec)
        .map(|l| l.path().to_path_buf())
        .map_err(|e| e.to_string())
}

/// Without the `fetch` feature (a library build without the download stack) a model is a
/// path on disk.
#[cfg(not(feature = "fetch"))]
fn resolve_elsewhere(spec: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(spec);
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "`{spec}` is not a file or directory (model ids, the Hugging Face cache and built-in \
             names need tokenrouter-engine's `fetch` feature)"
        ))
    }
}

/// A model of a config, loaded: its name, the path it came from and its runner and text.
pub struct ConfigModel {
    pub name: String,
    pub path: PathBuf,
    pub model: LoadedModel,
}

/// Load every model of a config (devices, dtypes and paths resolved as the engine does)
/// and check that they share one tokenizer. Used by the engine and by tools that need
/// the runners themselves (router training).
pub fn load_config_models(
    config: &EngineConfig,
) -> Result<(Vec<ConfigModel>, SharedVocab), EngineError> {
    let models: Vec<NamedModel> = config.models()?;
    let mut loaded = Vec::new();
    for m in &models {
        let err = |message: String| EngineError::Model {
            model: m.name.clone(),
            path: m.section.model_path.clone(),
            message,
        };
        // The device first: a CPU-only build must not download a GPU model before failing.
        let device = m.device.open().map_err(err)?;
        let path = if m.section.random_weights {
            shape_path(&m.section.model_path, &config.file).map_err(err)?
        } else {
            resolve_path(&m.section.model_path, &config.file).map_err(err)?
        };
        let opts = LoadOptions {
            device,
            kv: KvBudget::Tokens(m.section.kv_cache_tokens.unwrap_or(32_768)),
            dtype: m.dtype,
            kernels: m.section.runtime,
        };
        tracing::info!(model = %m.name, path = %path.display(), "loading");
        let lm = if m.section.random_weights {
            // `model_path` is a config.json giving the shape; every model gets its own seed.
            load_random_model(&path, &opts, 1 + loaded.len() as u64)
        } else {
            load_model(&path, &opts)
        }
        .map_err(|e| err(e.to_string()))?;
        loaded.push(ConfigModel {
            name: m.name.clone(),
            path,
            model: lm,
        });
    }
    let pairs: Vec<(&str, &TextModel, usize)> = loaded
        .iter()
        .map(|c| {
            (
                c.name.as_str(),
                &c.model.text,
                c.model.runner.config().vocab_size,
            )
        })
        .collect();
    let shared_vocab = check_shared_vocab(&pairs)
        .map_err(|e| EngineError::Start(format!("{}: {e}", config.file.display())))?;
    Ok((loaded, shared_vocab))
}

pub(super) fn load(
    config: &EngineConfig,
    metrics: Arc<EngineMetrics>,
    registry: &Registry,
) -> Result<Loaded, EngineError> {
    let models: Vec<NamedModel> = config.models()?;
    let (loaded, shared_vocab) = load_config_models(config)?;
    let loaded: Vec<(&NamedModel, PathBuf, LoadedModel)> = models
        .iter()
        .zip(loaded)
        .map(|(m, c)| (m, c.path, c.model))
        .collect();
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
        shared_vocab.sample_limit,
        thresholds,
        metrics,
        std::time::Duration::from_secs_f64(config.system.step_watchdog_s.clamp(0.001, 1e9)),
    ));
    let mut subs = Vec::new();
    let mut tunables = Vec::new();
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
        let policy = registry.build(
            m.section.scheduler_class(),
            &m.section.scheduler_kwargs,
            &ctx,
        )?;
        tunables.extend(policy.tunables());
        infos.push(ModelInfo {
            name: m.name.clone(),
            source: path.display().to_string(),
            context_length: runner.max_len(),
        });
        if idx == 0 {
            text = Some(Arc::new(lm.text));
        }
        subs.push(
            SubServer::new(
                idx,
                runner,
                policy,
                shared_vocab.sample_limit,
                config.system.max_batch_size,
                shared.clone(),
            )
            .with_faults(crate::subserver::InjectedFaults::for_model(
                &config.system.fault_injection,
                &m.name,
            )),
        );
    }
    let text = text.ok_or_else(|| EngineError::Start("no models".into()))?;
    let tunables =
        crate::routing_knob::Tunables::new(tunables, &config.system.request_routing, &config.file)?;
    let _ = shared.tunables.set(tunables);
    Ok(Loaded {
        subs,
        text,
        infos,
        shared,
    })
}
