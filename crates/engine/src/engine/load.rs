//! Loading a config's models: device and dtype specs, model paths (relative to the config
//! file, shape files for random weights), every model loaded and checked to share one
//! tokenizer, each model's policy built, and one sub-server per model (or, for an entry
//! with `address:`, a connection to the sub-server in another process).

use super::{EngineError, Loaded, Slot};
use crate::config::{EngineConfig, NamedModel, SchedulingPolicy};
use crate::metrics::EngineMetrics;
use crate::policy::{PolicyContext, Registry, Tunable};
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

/// Load one model of a config (`idx` is its index there: random weights are seeded by it,
/// so a process that loads only this model builds the same weights).
pub(crate) fn load_one(
    config: &EngineConfig,
    m: &NamedModel,
    idx: usize,
) -> Result<ConfigModel, EngineError> {
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
    let mut lm = if m.section.random_weights {
        // `model_path` is a config.json giving the shape; every model gets its own seed.
        load_random_model(&path, &opts, 1 + idx as u64)
    } else {
        load_model(&path, &opts)
    }
    .map_err(|e| err(e.to_string()))?;
    if m.section.prefix_cache {
        lm.runner.enable_prefix_cache();
    }
    Ok(ConfigModel {
        name: m.name.clone(),
        path,
        model: lm,
    })
}

/// Load every model of a config that runs in this process (entries with `address:` are
/// served elsewhere; devices, dtypes and paths resolved as the engine does) and check that
/// they share one tokenizer. Used by the engine and by tools that need the runners
/// themselves (router training).
pub fn load_config_models(
    config: &EngineConfig,
) -> Result<(Vec<ConfigModel>, SharedVocab), EngineError> {
    let models: Vec<NamedModel> = config.models()?;
    let mut loaded = Vec::new();
    for (idx, m) in models.iter().enumerate() {
        if m.address.is_none() {
            loaded.push(load_one(config, m, idx)?);
        }
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

/// Token id -> its text, for text-aware policies.
pub(crate) fn token_text(text: &TextModel, sample_limit: usize) -> Arc<Vec<String>> {
    Arc::new(
        (0..sample_limit as u32)
            .map(|id| text.decode(&[id], false).unwrap_or_default())
            .collect(),
    )
}

/// Build model `idx`'s policy and sub-server over its runner.
pub(crate) fn build_subserver(
    config: &EngineConfig,
    registry: &Registry,
    idx: usize,
    runner: tokenrouter_runtime::Runner,
    token_text: Arc<Vec<String>>,
    shared: &Arc<Shared>,
) -> Result<(SubServer, Vec<Tunable>), EngineError> {
    let m = &config.models[idx];
    let ctx = PolicyContext {
        model: idx,
        model_names: shared.names.clone(),
        token_text,
        vocab_size: runner.config().vocab_size,
        sample_limit: shared.sample_limit,
        config_file: config.file.clone(),
        embed: Some(runner.model().embedder()),
        device: runner.model().device().clone(),
    };
    let policy = registry.build(
        m.section.scheduler_class(),
        &m.section.scheduler_kwargs,
        &ctx,
    )?;
    let tunables = policy.tunables();
    let sub = SubServer::new(
        idx,
        runner,
        policy,
        shared.sample_limit,
        config.system.max_batch_size,
        shared.clone(),
    )
    .with_faults(crate::subserver::InjectedFaults::for_model(
        &config.system.fault_injection,
        &m.name,
    ));
    Ok((sub, tunables))
}

/// The engine's shared state for a pair with these limits.
pub(crate) fn new_shared(
    config: &EngineConfig,
    context_limit: usize,
    sample_limit: usize,
    metrics: Arc<EngineMetrics>,
) -> Result<Arc<Shared>, EngineError> {
    let names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let thresholds = config
        .models
        .iter()
        .map(|m| m.section.delayed_batching_threshold.clone())
        .collect();
    let mut shared = Shared::new(
        names,
        context_limit,
        sample_limit,
        thresholds,
        metrics,
        std::time::Duration::from_secs_f64(config.system.step_watchdog_s.clamp(0.001, 1e9)),
    );
    shared.priority_scheduling = config.system.scheduling_policy == SchedulingPolicy::Priority;
    if let Some(path) = &config.system.cpu_turn_file {
        shared.cpu_turn = crate::turn::TurnLock::with_file(path).map_err(|e| {
            EngineError::Start(format!(
                "system.cpu_turn_file: cannot use {}: {e}",
                path.display()
            ))
        })?;
    }
    Ok(Arc::new(shared))
}

pub(super) fn load(
    config: &EngineConfig,
    metrics: Arc<EngineMetrics>,
    registry: &Registry,
    remote_rt: Option<&tokio::runtime::Runtime>,
) -> Result<Loaded, EngineError> {
    let models: Vec<NamedModel> = config.models()?;
    let (local, shared_vocab) = load_config_models(config)?;
    let entry_text = &local
        .first()
        .ok_or_else(|| EngineError::Start("no models".into()))?
        .model
        .text;
    // Remote models: connect and greet; their limits join the pair's.
    let mut remotes = Vec::new();
    let mut context_limit = local
        .iter()
        .map(|c| c.model.runner.max_len())
        .min()
        .unwrap_or(0);
    let mut sample_limit = shared_vocab.sample_limit;
    if models.iter().any(|m| m.address.is_some()) {
        let rt =
            remote_rt.ok_or_else(|| EngineError::Start("no runtime for remote models".into()))?;
        let fingerprint = crate::remote::vocab_fingerprint(entry_text);
        for (idx, m) in models.iter().enumerate() {
            if let Some(addr) = &m.address {
                let r = crate::remote::dial::connect_remote(rt, config, idx, addr, &fingerprint)?;
                context_limit = context_limit.min(r.session.welcome.context_length as usize);
                sample_limit = sample_limit
                    .min(r.session.welcome.real_vocab_len as usize)
                    .min(r.session.welcome.logits_width as usize);
                remotes.push(r);
            }
        }
    }
    let shared = new_shared(config, context_limit, sample_limit, metrics)?;
    let token_text = token_text(entry_text, sample_limit);
    let mut tunables = Vec::new();
    let mut infos = Vec::new();
    let mut text = None;
    let mut subs = Vec::new();
    let mut local = local.into_iter();
    let mut remotes = remotes.into_iter();
    for (idx, m) in models.iter().enumerate() {
        if m.address.is_some() {
            let Some(mut r) = remotes.next() else {
                return Err(EngineError::Start("remote models out of order".into()));
            };
            let declared = r.configure(rt_of(remote_rt)?, context_limit, sample_limit)?;
            tunables.extend(declared);
            infos.push(ModelInfo {
                name: m.name.clone(),
                source: format!("{} ({})", r.dial.addr, r.session.welcome.source),
                context_length: r.session.welcome.context_length as usize,
            });
            subs.push(Slot::Remote(Box::new(r)));
            continue;
        }
        let Some(c) = local.next() else {
            return Err(EngineError::Start("local models out of order".into()));
        };
        let (sub, declared) = build_subserver(
            config,
            registry,
            idx,
            c.model.runner,
            token_text.clone(),
            &shared,
        )?;
        tunables.extend(declared);
        infos.push(ModelInfo {
            name: m.name.clone(),
            source: c.path.display().to_string(),
            context_length: sub.max_len(),
        });
        if idx == 0 {
            text = Some(Arc::new(c.model.text));
        }
        subs.push(Slot::Local(sub));
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

fn rt_of(rt: Option<&tokio::runtime::Runtime>) -> Result<&tokio::runtime::Runtime, EngineError> {
    rt.ok_or_else(|| EngineError::Start("no runtime for remote models".into()))
}
