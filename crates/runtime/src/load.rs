//! Opening a model from disk: a single GGUF file or a Hugging Face directory, giving the
//! runner (weights + paged KV cache) and the text side (tokenizer, chat template, EOS ids).

use crate::config::ModelConfig;
use crate::error::{Result, RuntimeError};
use crate::kernel_options::KernelOptions;
use crate::kv::KvCapacity;
use crate::model::Transformer;
use crate::runner::Runner;
use crate::text::TextModel;
use crate::weights::WeightSource;
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};

/// How much KV cache to allocate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    Tokens(usize),
    Bytes(usize),
}

#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub device: Device,
    pub kv: KvBudget,
    /// Compute dtype for dense (safetensors) weights; GGUF weights stay quantised.
    pub dtype: DType,
    /// Which kernels the model runs on.
    pub kernels: KernelOptions,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            kv: KvBudget::Tokens(16_384),
            dtype: DType::F32,
            kernels: KernelOptions::default(),
        }
    }
}

pub struct LoadedModel {
    pub runner: Runner,
    pub text: TextModel,
    pub path: PathBuf,
}

fn capacity(cfg: &ModelConfig, opts: &LoadOptions) -> KvCapacity {
    // The CPU cache stores f16 (`kv::LayerKv`); device caches are sized as f32, an upper
    // bound for the model dtypes they hold.
    let value_bytes = if opts.device.is_cpu() { 2 } else { 4 };
    match opts.kv {
        KvBudget::Tokens(n) => KvCapacity::tokens(n),
        KvBudget::Bytes(b) => KvCapacity::memory(b, cfg.kv_bytes_per_token(value_bytes)),
    }
}

/// Read only the configuration and text side of a model (cheap: no weights).
pub fn inspect(path: &Path) -> Result<(ModelConfig, TextModel)> {
    if path.is_dir() {
        Ok((
            ModelConfig::from_hf_json(&path.join("config.json"))?,
            TextModel::from_hf_dir(path)?,
        ))
    } else {
        let (content, _) = open_gguf(path)?;
        Ok((
            ModelConfig::from_gguf(&content, path)?,
            TextModel::from_gguf(&content, path)?,
        ))
    }
}

fn open_gguf(path: &Path) -> Result<(gguf_file::Content, std::fs::File)> {
    let file = std::fs::File::open(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // Buffered: the header is ~300k short strings (vocabulary and merges), two reads each
    // unbuffered (760k system calls, most of a 0.5B model's load time).
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| RuntimeError::bad_file(path, format!("cannot parse GGUF: {e}")))?;
    Ok((content, reader.into_inner()))
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|source| RuntimeError::Io {
        path: index.clone(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| RuntimeError::bad_file(&index, format!("invalid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| RuntimeError::bad_file(&index, "no weight_map"))?;
    let mut files: Vec<PathBuf> = map
        .values()
        .filter_map(|f| f.as_str())
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Load only the weights of a Hugging Face directory (`config.json` + safetensors, no
/// tokenizer needed), e.g. a checkpoint written by `transformers` for a logits check.
pub fn load_runner(dir: &Path, opts: &LoadOptions) -> Result<Runner> {
    let cfg = ModelConfig::from_hf_json(&dir.join("config.json"))?;
    let files = safetensors_files(dir)?;
    let mut src = WeightSource::safetensors(&files, dir, &opts.device, opts.dtype)?;
    let cap = capacity(&cfg, opts);
    Runner::new(
        Transformer::load(cfg, &mut src, &opts.device, &opts.kernels)?,
        cap,
    )
}

/// A model of real shape from a `config.json` alone: Normal(0, 0.02) matrices (unit norm
/// weights) created on `opts.device` in `opts.dtype`, seeded on GPUs. For benchmarks of shapes
/// whose checkpoints are not at hand (e.g. Qwen3-32B, 65 GB in bf16).
pub fn load_random(config_json: &Path, opts: &LoadOptions, seed: u64) -> Result<Runner> {
    let cfg = ModelConfig::from_hf_json(config_json)?;
    if !opts.device.is_cpu() {
        // candle cannot seed its CPU generator; there the weights differ per run.
        opts.device.set_seed(seed)?;
    }
    let mut src = WeightSource::random(&cfg, config_json, &opts.device, opts.dtype, 0.02);
    let cap = capacity(&cfg, opts);
    Runner::new(
        Transformer::load(cfg, &mut src, &opts.device, &opts.kernels)?,
        cap,
    )
}

/// `load_random` plus the synthetic tokenizer (`TextModel::synthetic`): a servable model of
/// real shape without a checkpoint, for end-to-end benchmarks (engine `random_weights`).
pub fn load_random_model(config_json: &Path, opts: &LoadOptions, seed: u64) -> Result<LoadedModel> {
    let runner = load_random(config_json, opts, seed)?;
    let vocab = runner.config().vocab_size;
    Ok(LoadedModel {
        runner,
        text: TextModel::synthetic(vocab)?,
        path: config_json.to_path_buf(),
    })
}

/// Load a GGUF file or a Hugging Face directory.
pub fn load_model(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let (runner, text) = if path.is_dir() {
        let cfg = ModelConfig::from_hf_json(&path.join("config.json"))?;
        let text = TextModel::from_hf_dir(path)?;
        let files = safetensors_files(path)?;
        let mut src = WeightSource::safetensors(&files, path, &opts.device, opts.dtype)?;
        let cap = capacity(&cfg, opts);
        (
            Runner::new(
                Transformer::load(cfg, &mut src, &opts.device, &opts.kernels)?,
                cap,
            )?,
            text,
        )
    } else {
        let (content, file) = open_gguf(path)?;
        let cfg = ModelConfig::from_gguf(&content, path)?;
        let text = TextModel::from_gguf(&content, path)?;
        let mut src = WeightSource::gguf(content, file, path, &opts.device);
        let cap = capacity(&cfg, opts);
        (
            Runner::new(
                Transformer::load(cfg, &mut src, &opts.device, &opts.kernels)?,
                cap,
            )?,
            text,
        )
    };
    if opts.device.is_cpu() {
        // Loading is done trimming; the forward's activations reuse freed pages from here.
        crate::host_memory::retain_freed_pages();
    }
    Ok(LoadedModel {
        runner,
        text,
        path: path.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, RopeStyle};

    #[test]
    fn a_cpu_kv_budget_in_bytes_counts_f16_values() {
        // The 0.5B's cache shape: 24 layers x 2 KV heads x 64 values, K and V.
        let cfg = ModelConfig {
            arch: Arch::Qwen2,
            vocab_size: 151_936,
            hidden_size: 896,
            intermediate_size: 4864,
            num_layers: 24,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            max_position: 32_768,
            tie_embeddings: true,
            qkv_bias: true,
            qk_norm: false,
            rope_style: RopeStyle::HalfSplit,
        };
        let opts = LoadOptions {
            kv: KvBudget::Bytes(24 * 2 * 64 * 2 * 2 * 1024),
            ..LoadOptions::default()
        };
        assert_eq!(capacity(&cfg, &opts).total_tokens(), 1024);
    }
}
