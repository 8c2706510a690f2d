//! The YAML configuration, in TokenRouter's shape (`model.<name>.{model_path,
//! scheduler_class, scheduler_kwargs, delayed_batching_threshold, ...}`, `system.{...}`).
//! Unknown or mistyped keys fail with the file, the key and a hint instead of being ignored.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenrouter_runtime::{DeviceSpec, KernelOptions};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Invalid { file: PathBuf, message: String },
}

/// How long a model waits to batch requests (TokenRouter's delayed batching).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Threshold {
    /// The same threshold at every concurrency.
    Fixed(usize),
    /// Entry i applies when i+1 requests are active (the last entry beyond the list).
    PerConcurrency(Vec<usize>),
    /// `auto`: tuned online from measured latencies and routing rates.
    Auto(AutoKeyword),
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoKeyword {
    Auto,
}

impl Default for Threshold {
    fn default() -> Self {
        Threshold::Fixed(1)
    }
}

impl Threshold {
    /// The threshold for `active` concurrent requests (`auto` behaves as 1 until tuned).
    pub fn at(&self, active: usize) -> usize {
        match self {
            Threshold::Fixed(b) => (*b).max(1),
            Threshold::PerConcurrency(list) => {
                let i = active.max(1) - 1;
                list.get(i).or(list.last()).copied().unwrap_or(1).max(1)
            }
            Threshold::Auto(_) => 1,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A GGUF file, a Hugging Face directory, a model id in the HF cache, or a built-in
    /// default name (see `tokenrouter fetch`).
    pub model_path: String,
    /// Routing policy of this model (e.g. `rstitch`, `r2r_slm`, `r2r_llm`, `random`).
    #[serde(default)]
    pub scheduler_class: Option<String>,
    #[serde(default)]
    pub scheduler_kwargs: serde_yaml::Value,
    #[serde(default)]
    pub delayed_batching_threshold: Threshold,
    /// `cpu`, `cuda`, `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Compute dtype for dense weights: `f32`, `bf16`, `f16`.
    #[serde(default)]
    pub dtype: Option<String>,
    /// KV cache size in tokens.
    #[serde(default)]
    pub kv_cache_tokens: Option<usize>,
    /// Keep the KV of finished requests and reuse it for requests that start with the same
    /// tokens (automatic prefix caching, as vLLM and SGLang do by default).
    #[serde(default = "default_true")]
    pub prefix_cache: bool,
    /// Accepted for compatibility with TokenRouter configs; ignored (single device).
    #[serde(default)]
    pub tp_size: Option<usize>,
    /// Accepted for compatibility with TokenRouter configs; ignored (one HTTP port).
    #[serde(default)]
    pub port: Option<u16>,
    /// Build a model of the configured shape with random weights (benchmarks only).
    #[serde(default)]
    pub random_weights: bool,
    /// Kernel switches of this model (`{cpu_qk: scalar, cuda_graphs: false, ...}`); the
    /// defaults are the fast paths.
    #[serde(default)]
    pub runtime: KernelOptions,
    /// Served by `tokenrouter subserver` at this address (`tcp://host:port`, `ipc:///path`)
    /// instead of in this process; the other keys must match that process's config.
    #[serde(default)]
    pub address: Option<String>,
}

impl ModelSection {
    /// The routing method, `slm_only` (never route) when the config names none.
    pub fn scheduler_class(&self) -> &str {
        self.scheduler_class.as_deref().unwrap_or("slm_only")
    }
}

fn default_device() -> String {
    "cpu".into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Execution {
    /// Each model steps at its own pace (the TokenRouter design).
    #[default]
    Async,
    /// Lockstep across models (the naive design, for comparison).
    Sync,
}

/// Which waiting request a model serves next (vLLM's `--scheduling-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    /// First come, first served; a request's `priority` must be 0.
    #[default]
    Fcfs,
    /// Lowest `priority` first, then first come; preemption frees the highest first.
    Priority,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SystemSection {
    /// The model that starts every request (the small one).
    pub entry_model: String,
    #[serde(default)]
    pub execution: Execution,
    /// Requests waiting beyond this are refused at once (HTTP 429).
    #[serde(default = "default_max_queued")]
    pub max_queued_requests: usize,
    /// Prompt tokens of all requests inside the engine beyond this are refused at once
    /// (HTTP 429): back-pressure on long prompts before the request count bound is hit.
    #[serde(default = "default_max_queued_prompt_tokens")]
    pub max_queued_prompt_tokens: usize,
    /// Largest number of requests a model steps in one batch.
    #[serde(default = "default_max_batch")]
    pub max_batch_size: usize,
    /// `fcfs` or `priority` (requests' `priority` field; vLLM's `--scheduling-policy`).
    #[serde(default)]
    pub scheduling_policy: SchedulingPolicy,
    /// Accepted for compatibility with TokenRouter configs; ignored on CPU.
    #[serde(default)]
    pub mem_fraction_static: Option<f64>,
    /// Serve a few short requests through every model before reporting ready, so first-use
    /// costs (the driver compiling GPU kernels, lazily loaded libraries) are not paid by the
    /// first clients. Default: on when a model runs on a GPU.
    #[serde(default)]
    pub warmup: Option<bool>,
    /// Per-request routing overrides (`"routing": {...}` in a request).
    #[serde(default)]
    pub request_routing: RequestRouting,
    /// A step running longer than this is reported (logs, metrics, `/health` while it runs).
    #[serde(default = "default_watchdog")]
    pub step_watchdog_s: f64,
    /// Faults to inject (tests): `[{model: reference, step: 3, kind: panic}]`.
    #[serde(default)]
    pub fault_injection: Vec<FaultSpec>,
    /// The routed model's name in the API (`/v1/models`, a request's `model`); None: the
    /// server's default (`tokenrouter`).
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// More names meaning the routed model; the research system's clients send `default`.
    #[serde(default = "default_model_aliases")]
    pub served_model_aliases: Vec<String>,
    /// Sub-servers in several processes on one CPU host take turns through this file
    /// (give every process the same path), as CPU models of one process do.
    #[serde(default)]
    pub cpu_turn_file: Option<PathBuf>,
    /// Connections to sub-servers in other processes (models with `address:`).
    #[serde(default)]
    pub remote: RemoteSettings,
}

/// `system.remote`: how patient the front end is with remote sub-servers.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteSettings {
    /// How long `serve` keeps trying to reach a remote at start (it may still be loading).
    pub connect_timeout_s: f64,
    /// A remote that has not answered for this long is down: its requests fail.
    pub timeout_s: f64,
    /// Longest wait between reconnection attempts.
    pub reconnect_max_backoff_ms: u64,
}

impl Default for RemoteSettings {
    fn default() -> Self {
        Self {
            connect_timeout_s: 120.0,
            timeout_s: 10.0,
            reconnect_max_backoff_ms: 2000,
        }
    }
}

fn default_model_aliases() -> Vec<String> {
    vec!["default".to_string()]
}

fn default_watchdog() -> f64 {
    60.0
}

/// What an injected fault does at its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The step panics (the sub-server goes down).
    Panic,
    /// The step returns an error (its batch fails, the model stays up).
    Fail,
    /// The step sleeps `stall_ms` first (the watchdog reports it).
    Stall,
    /// The first row's logits are NaN (only that request fails).
    NanRow,
}

/// One injected fault: `kind` at the `step`-th step (1-based) of `model`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub model: String,
    pub step: u64,
    pub kind: FaultKind,
    #[serde(default)]
    pub stall_ms: u64,
}

/// `system.request_routing`: whether a request may override the routing method's tunable
/// kwargs, and narrower bounds than the method's own (`bounds: {threshold: [0.05, 0.5]}`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestRouting {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default)]
    pub bounds: BTreeMap<String, [f64; 2]>,
    /// Overrides a fill-in-the-middle request (`/infill`, `suffix`) gets when it gives
    /// none of its own (`fim: {threshold: 0.03}`): an editor cannot send `routing`, and the
    /// knee of code completion's quality/cost curve lies elsewhere than a chat answer's.
    #[serde(default)]
    pub fim: BTreeMap<String, f64>,
}

impl Default for RequestRouting {
    fn default() -> Self {
        Self {
            enabled: true,
            bounds: BTreeMap::new(),
            fim: BTreeMap::new(),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_max_queued() -> usize {
    256
}

fn default_max_queued_prompt_tokens() -> usize {
    4 << 20
}

fn default_max_batch() -> usize {
    64
}

/// The file as written: model sections stay raw until [`EngineConfig::from_yaml`] parses
/// each with its name in the error.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    model: serde_yaml::Mapping,
    system: SystemSection,
}

/// The validated configuration: every model section parsed once, the entry model first.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// The entry model first, then the others in file order (model indices).
    pub models: Vec<NamedModel>,
    pub system: SystemSection,
    pub file: PathBuf,
}

/// A validated model entry: its section as written and the values resolved from it before
/// any weights load.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedModel {
    pub name: String,
    pub section: ModelSection,
    pub device: DeviceSpec,
    /// Compute dtype for dense weights (the section's, else the device's default).
    pub dtype: candle_core::DType,
    /// Where a sub-server in another process serves this model (None: in this process).
    pub address: Option<tokenrouter_wire::PeerAddress>,
}

/// "did you mean ...?" for serde's `unknown field `x`, expected one of `a`, `b`, ...`: the
/// candidates are the ones serde lists, so the known keys come from the types themselves.
fn hint_for(message: &str) -> String {
    let Some(start) = message.find("unknown field `") else {
        return String::new();
    };
    let rest = &message[start + 15..];
    let Some(end) = rest.find('`') else {
        return String::new();
    };
    let bad = &rest[..end];
    let known: Vec<&str> = rest[end + 1..]
        .split('`')
        .skip(1)
        .step_by(2)
        .take_while(|k| !k.contains(['\n', ' ']))
        .collect();
    match known.iter().min_by_key(|k| edit_distance(bad, k)) {
        Some(best) if edit_distance(bad, best) <= 3 => format!(" (did you mean `{best}`?)"),
        _ => String::new(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

impl EngineConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&text, path)
    }

    pub fn from_yaml(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            message,
        };
        let raw: RawConfig = serde_yaml::from_str(text).map_err(|e| {
            let m = e.to_string();
            invalid(format!("{m}{}", hint_for(&m)))
        })?;
        let models = parse_models(&raw.model, &raw.system.entry_model, file)?;
        let cfg = EngineConfig {
            models,
            system: raw.system,
            file: file.to_path_buf(),
        };
        let models = &cfg.models;
        if !models.iter().any(|m| m.name == cfg.system.entry_model) {
            return Err(invalid(format!(
                "system.entry_model: `{}` is not one of the models ({})",
                cfg.system.entry_model,
                models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        check_remote(&cfg).map_err(invalid)?;
        // Every model's method and kwargs, parsed into their typed settings and checked,
        // before any weights load.
        let registry = crate::policy::Registry::default();
        let names: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
        for (i, m) in models.iter().enumerate() {
            let site = crate::policy::ModelSite {
                model: i,
                model_names: names.clone(),
                config_file: file.to_path_buf(),
            };
            registry.check(
                m.section.scheduler_class(),
                &m.section.scheduler_kwargs,
                &site,
            )?;
        }
        Ok(cfg)
    }

    /// Models with the entry model first, then the others in file order.
    pub fn models(&self) -> Result<Vec<NamedModel>, ConfigError> {
        Ok(self.models.clone())
    }
}

fn parse_models(
    raw: &serde_yaml::Mapping,
    entry_model: &str,
    file: &Path,
) -> Result<Vec<NamedModel>, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        file: file.to_path_buf(),
        message,
    };
    let mut out = Vec::new();
    for (k, v) in raw {
        let name = k
            .as_str()
            .ok_or_else(|| invalid(format!("model: key {k:?} must be a string")))?
            .to_string();
        let section: ModelSection = serde_yaml::from_value(v.clone()).map_err(|e| {
            let m = e.to_string();
            invalid(format!("model.{name}: {m}{}", hint_for(&m)))
        })?;
        let device: DeviceSpec = section
            .device
            .parse()
            .map_err(|e| invalid(format!("model.{name}.device: {e}")))?;
        let dtype = device
            .dtype(section.dtype.as_deref())
            .map_err(|e| invalid(format!("model.{name}.dtype: {e}")))?;
        let address = match &section.address {
            None => None,
            Some(a) => Some(
                a.parse()
                    .map_err(|e| invalid(format!("model.{name}.address: {e}")))?,
            ),
        };
        out.push(NamedModel {
            name,
            section,
            device,
            dtype,
            address,
        });
    }
    if out.is_empty() {
        return Err(invalid("model: at least one model is required".into()));
    }
    if let Some(pos) = out.iter().position(|m| m.name == entry_model) {
        let entry = out.remove(pos);
        out.insert(0, entry);
    }
    Ok(out)
}

/// What v1 of remote sub-servers supports: the entry model in this process (the front end
/// needs its tokenizer and starts every request there), asynchronous execution, fixed
/// delayed-batching thresholds (the online tuner measures one process).
fn check_remote(cfg: &EngineConfig) -> Result<(), String> {
    if !cfg.models.iter().any(|m| m.address.is_some()) {
        return Ok(());
    }
    if let Some(entry) = cfg.models.first().filter(|m| m.address.is_some()) {
        return Err(format!(
            "model.{}.address: the entry model must run in this process (it starts every \
             request and its tokenizer serves the API); give `address:` to another model",
            entry.name
        ));
    }
    if cfg.system.execution == Execution::Sync {
        return Err(
            "system.execution: `sync` (lockstep) cannot step a model in another process; use \
             `async` with remote models"
                .into(),
        );
    }
    if let Some(m) = cfg
        .models
        .iter()
        .find(|m| matches!(m.section.delayed_batching_threshold, Threshold::Auto(_)))
    {
        return Err(format!(
            "model.{}.delayed_batching_threshold: `auto` is not supported with remote models \
             (the tuner measures one process); give a number",
            m.name
        ));
    }
    let r = &cfg.system.remote;
    for (key, v) in [
        ("connect_timeout_s", r.connect_timeout_s),
        ("timeout_s", r.timeout_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!(
                "system.remote.{key}: must be a positive number of seconds, got {v}"
            ));
        }
    }
    Ok(())
}

/// Parse the `scheduler_kwargs` of one model into a policy's typed options, with an error
/// naming the model, the key and the file.
pub fn parse_kwargs<T: serde::de::DeserializeOwned + Default>(
    kwargs: &serde_yaml::Value,
    model: &str,
    file: &Path,
) -> Result<T, ConfigError> {
    if kwargs.is_null() {
        return Ok(T::default());
    }
    serde_yaml::from_value(kwargs.clone()).map_err(|e| ConfigError::Invalid {
        file: file.to_path_buf(),
        message: format!("model.{model}.scheduler_kwargs: {e}"),
    })
}

/// Keep model names stable in maps.
pub type ModelNames = BTreeMap<usize, String>;

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
model:
  reference: {model_path: big.gguf, scheduler_class: r2r_llm, delayed_batching_threshold: [1, 2, 2]}
  quick: {model_path: small.gguf, scheduler_class: r2r_slm, scheduler_kwargs: {model_path: router.pt, threshold: 0.3}}
system: {entry_model: quick, execution: sync}
"#;

    #[test]
    fn parses_and_puts_entry_first() {
        let cfg = EngineConfig::from_yaml(GOOD, Path::new("x.yaml")).unwrap();
        let models = cfg.models().unwrap();
        assert_eq!(models[0].name, "quick");
        assert_eq!(models[1].section.delayed_batching_threshold.at(2), 2);
        assert_eq!(models[1].section.delayed_batching_threshold.at(9), 2);
        assert_eq!(cfg.system.execution, Execution::Sync);
    }

    #[test]
    fn unknown_keys_fail_with_file_key_and_hint() {
        let bad = GOOD.replace("scheduler_kwargs", "scheduler_kwarg");
        let e = EngineConfig::from_yaml(&bad, Path::new("cfg/x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cfg/x.yaml") && e.contains("model.quick") && e.contains("scheduler_kwarg"),
            "{e}"
        );
        assert!(e.contains("did you mean `scheduler_kwargs`"), "{e}");
        let bad = GOOD.replace("entry_model: quick", "entry_model: fast");
        let e = EngineConfig::from_yaml(&bad, Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("entry_model") && e.contains("fast"), "{e}");
        let bad = GOOD.replace("execution: sync", "execution: lockstep");
        assert!(EngineConfig::from_yaml(&bad, Path::new("x.yaml")).is_err());
    }

    #[test]
    fn kernel_switches_parse_per_model_with_hints_from_the_types() {
        let with = GOOD.replace(
            "scheduler_kwargs: {model_path: router.pt, threshold: 0.3}}",
            "scheduler_kwargs: {model_path: router.pt, threshold: 0.3}, runtime: {cpu_qk: scalar, cuda_graphs: false}}",
        );
        let cfg = EngineConfig::from_yaml(&with, Path::new("x.yaml")).unwrap();
        let quick = &cfg.models[0].section.runtime;
        assert_eq!(quick.cpu_qk, tokenrouter_runtime::CpuKernel::Scalar);
        assert!(!quick.cuda_graphs && quick.gemv);
        assert_eq!(cfg.models[1].section.runtime, KernelOptions::default());
        let bad = with.replace("cuda_graphs", "cuda_graph");
        let e = EngineConfig::from_yaml(&bad, Path::new("cfg/x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cfg/x.yaml") && e.contains("model.quick"), "{e}");
        assert!(e.contains("did you mean `cuda_graphs`"), "{e}");
        // Keys of the system section get hints too (from the list serde gives).
        let bad = GOOD.replace("execution: sync", "executon: sync");
        let e = EngineConfig::from_yaml(&bad, Path::new("x.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `execution`"), "{e}");
    }

    #[test]
    fn thresholds_parse_in_all_forms() {
        let t: Threshold = serde_yaml::from_str("auto").unwrap();
        assert!(matches!(t, Threshold::Auto(_)));
        let t: Threshold = serde_yaml::from_str("3").unwrap();
        assert_eq!(t.at(1), 3);
        let t: Threshold = serde_yaml::from_str("[1, 2, 3]").unwrap();
        assert_eq!((t.at(1), t.at(3), t.at(10)), (1, 3, 3));
    }
}
