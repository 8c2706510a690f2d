//! Every YAML file under `config/` parses, names only registered scheduler classes, and
//! builds its policies (so every `scheduler_kwargs` is valid) — without loading any model:
//! policies are built from a `PolicyContext` made of the config alone. Methods that need
//! trained router weights (r2r, citer, collm) must get past kwargs parsing and stop only
//! at the missing weights file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenrouter_engine::policy::{PolicyContext, Registry};
use tokenrouter_engine::EngineConfig;

/// Every method the project ships a config for.
const METHODS: &[&str] = &[
    "r2r",
    "citer",
    "collm",
    "rstitch",
    "glimprouter",
    "random",
    "query",
    "me",
    "slm_only",
    "llm_only",
];

/// Methods whose small-model policy needs trained weights.
const NEEDS_WEIGHTS: &[&str] = &["r2r", "citer", "collm"];

const GPU_PAIR: &str = "Qwen3-0.6B_Qwen3-32B.yaml";
const CPU_PAIR: &str = "qwen2.5-coder-0.5b_1.5b_cpu.yaml";

fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config")
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read config dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
    out.sort();
}

fn all_configs() -> Vec<PathBuf> {
    let mut files = Vec::new();
    yaml_files(&config_dir(), &mut files);
    assert!(!files.is_empty(), "no YAML files under config/");
    files
}

/// A token table good enough for text-aware policies (GlimpRouter looks for "\n\n").
fn token_text() -> Arc<Vec<String>> {
    let mut t: Vec<String> = (0..64).map(|i| format!("t{i}")).collect();
    t.push("\n\n".into());
    t.push("\n".into());
    Arc::new(t)
}

/// Build every model's policy of `cfg`; returns one result per model.
fn build_policies(cfg: &EngineConfig) -> Vec<(String, Result<(), String>)> {
    let registry = Registry::default();
    let models = cfg.models().expect("models");
    let names: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
    let text = token_text();
    models
        .iter()
        .enumerate()
        .map(|(idx, m)| {
            let ctx = PolicyContext {
                model: idx,
                model_names: names.clone(),
                token_text: text.clone(),
                vocab_size: text.len(),
                sample_limit: text.len(),
                config_file: cfg.file.clone(),
                embed: None,
                device: candle_core::Device::Cpu,
            };
            let class = m
                .section
                .scheduler_class
                .clone()
                .unwrap_or_else(|| "slm_only".into());
            let r = registry
                .build(&class, &m.section.scheduler_kwargs, &ctx)
                .map(|_| ())
                .map_err(|e| e.to_string());
            (m.name.clone(), r)
        })
        .collect()
}

fn method_of(path: &Path) -> String {
    path.parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn every_config_parses_and_names_registered_classes() {
    let known: BTreeSet<&str> = Registry::default().names().into_iter().collect();
    for file in all_configs() {
        let cfg = EngineConfig::from_file(&file)
            .unwrap_or_else(|e| panic!("{}: does not parse: {e}", file.display()));
        let models = cfg
            .models()
            .unwrap_or_else(|e| panic!("{}: bad model section: {e}", file.display()));
        assert!(
            models.len() >= 2,
            "{}: fewer than two models",
            file.display()
        );
        for m in &models {
            let class = m.section.scheduler_class.as_deref().unwrap_or("slm_only");
            assert!(
                known.contains(class),
                "{}: model.{}.scheduler_class `{class}` is not registered (known: {known:?})",
                file.display(),
                m.name
            );
            let method = method_of(&file);
            assert!(
                class == method || class.starts_with(&format!("{method}_")),
                "{}: model.{} uses `{class}`, not a role of the directory's method `{method}`",
                file.display(),
                m.name
            );
        }
    }
}

#[test]
fn every_method_has_its_configs() {
    let dir = config_dir();
    for method in METHODS {
        let gpu = dir.join(method).join(GPU_PAIR);
        assert!(gpu.is_file(), "missing {}", gpu.display());
        let cfg = EngineConfig::from_file(&gpu).unwrap();
        for m in cfg.models().unwrap() {
            assert!(
                m.section.device.starts_with("cuda"),
                "{}: model.{} should run on cuda",
                gpu.display(),
                m.name
            );
            assert_eq!(
                m.section.dtype.as_deref(),
                Some("bf16"),
                "{}",
                gpu.display()
            );
        }
        if !NEEDS_WEIGHTS.contains(method) {
            let cpu = dir.join(method).join(CPU_PAIR);
            assert!(cpu.is_file(), "missing {}", cpu.display());
        }
    }
    let me3 = dir.join("me/Qwen3-0.6B_Qwen3-8B_Qwen3-32B.yaml");
    let cfg = EngineConfig::from_file(&me3).unwrap();
    let names: Vec<String> = cfg.models().unwrap().into_iter().map(|m| m.name).collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

#[test]
fn r2r_config_matches_the_reference_setup() {
    use tokenrouter_engine::Threshold;
    let cfg = EngineConfig::from_file(&config_dir().join("r2r").join(GPU_PAIR)).unwrap();
    let models = cfg.models().unwrap();
    assert_eq!(models[0].section.model_path, "Qwen/Qwen3-0.6B");
    assert_eq!(models[1].section.model_path, "Qwen/Qwen3-32B");
    let kw = &models[0].section.scheduler_kwargs;
    assert_eq!(
        kw.get("model_path").and_then(|v| v.as_str()),
        Some("routers/Qwen3-0.6B+Qwen3-32B/default_router.pt")
    );
    assert_eq!(kw.get("threshold").and_then(|v| v.as_f64()), Some(0.3565));
    assert_eq!(
        models[1].section.delayed_batching_threshold,
        Threshold::PerConcurrency(vec![1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 10, 11, 12, 13])
    );
}

#[test]
fn every_config_builds_its_policies() {
    for file in all_configs() {
        let cfg = EngineConfig::from_file(&file).unwrap();
        let method = method_of(&file);
        for (model, result) in build_policies(&cfg) {
            match result {
                Ok(()) => {}
                // Weighted methods: kwargs parsed; only the (untracked) weights are missing —
                // or, where a router was trained into the cache, present but in need of the
                // model's embeddings, which a context without models cannot give.
                Err(e) if NEEDS_WEIGHTS.contains(&method.as_str()) => {
                    let missing =
                        e.contains("cannot read router weights") && e.contains("model_path");
                    // A context without models has a toy vocabulary and no embeddings: a real
                    // router in the cache gets past reading and stops at those checks.
                    let cached = tokenrouter_fetch::default_cache_dir()
                        .join("routers/qwen2.5-coder-0.5b_1.5b/router.safetensors");
                    let trained = cached.is_file()
                        && e.contains(&cached.display().to_string())
                        && !e.contains("cannot read router weights");
                    assert!(missing || trained, "{}: model.{model}: {e}", file.display());
                    // A router that lives in the cache names the commands that make it.
                    if missing && e.contains("routers/qwen2.5-coder") {
                        assert!(e.contains("tokenrouter train-router label"), "{e}");
                    }
                }
                Err(e) => panic!("{}: model.{model}: {e}", file.display()),
            }
        }
    }
}

#[test]
fn cpu_configs_use_the_built_in_pair() {
    for file in all_configs() {
        if !file.ends_with(CPU_PAIR) {
            continue;
        }
        let cfg = EngineConfig::from_file(&file).unwrap();
        let paths: Vec<String> = cfg
            .models()
            .unwrap()
            .into_iter()
            .map(|m| {
                assert_eq!(m.section.device, "cpu", "{}", file.display());
                m.section.model_path
            })
            .collect();
        for p in &paths {
            assert!(
                tokenrouter_fetch::DEFAULT_MODELS
                    .iter()
                    .any(|d| d.name == p),
                "{}: `{p}` is not a built-in model name",
                file.display()
            );
        }
    }
}

#[test]
fn mistyped_kwargs_are_caught_without_loading_models() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string(config_dir().join("random").join(CPU_PAIR))
        .unwrap()
        .replace("{p: 0.3, seed: 0}", "{probability: 0.3}");
    std::fs::write(&file, text).unwrap();
    // Reading the file parses every method's kwargs into its typed settings: the typo is
    // reported before any policy is built or any model loaded.
    let err = EngineConfig::from_file(&file).unwrap_err().to_string();
    assert!(
        err.contains("probability") && err.contains("model.quick"),
        "{err}"
    );
}
