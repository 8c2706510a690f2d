//! Architecture hyper-parameters, read from a Hugging Face `config.json` or from GGUF
//! metadata, normalised into one struct so the forward pass has a single code path for
//! Qwen3 (q/k RMSNorm), Qwen2 (qkv bias) and Llama.

use crate::error::{Result, RuntimeError};
use candle_core::quantized::gguf_file;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Qwen3,
    Qwen2,
    Llama,
}

impl Arch {
    pub fn parse(name: &str, path: &Path) -> Result<Self> {
        match name {
            "qwen3" => Ok(Arch::Qwen3),
            "qwen2" => Ok(Arch::Qwen2),
            "llama" => Ok(Arch::Llama),
            other => Err(RuntimeError::UnknownArchitecture {
                path: path.to_path_buf(),
                arch: other.to_string(),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
        }
    }
}

/// How rotary embeddings pair up dimensions. HF checkpoints use the "neox" half split;
/// llama.cpp's converter permutes Llama q/k weights so GGUF Llama uses adjacent pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    HalfSplit,
    Interleaved,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub rope_style: RopeStyle,
}

impl ModelConfig {
    /// Parse a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| RuntimeError::bad_file(path, format!("invalid JSON: {e}")))?;
        let get_usize = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| RuntimeError::MissingKey {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                })
        };
        let model_type = v
            .get("model_type")
            .and_then(|x| x.as_str())
            .ok_or_else(|| RuntimeError::MissingKey {
                path: path.to_path_buf(),
                key: "model_type".into(),
            })?;
        let arch = Arch::parse(model_type, path)?;
        let hidden_size = get_usize("hidden_size")?;
        let num_heads = get_usize("num_attention_heads")?;
        let num_kv_heads = get_usize("num_key_value_heads").unwrap_or(num_heads);
        let head_dim = v
            .get("head_dim")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(hidden_size / num_heads.max(1));
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Qwen3 | Arch::Llama => v
                .get("attention_bias")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: get_usize("vocab_size")?,
            hidden_size,
            intermediate_size: get_usize("intermediate_size")?,
            num_layers: get_usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            // transformers 5 writes `rope_parameters: {rope_theta, rope_type}` instead.
            rope_theta: v
                .get("rope_theta")
                .or_else(|| v.get("rope_parameters").and_then(|r| r.get("rope_theta")))
                .and_then(|x| x.as_f64())
                .unwrap_or(10_000.0),
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-6),
            max_position: get_usize("max_position_embeddings").unwrap_or(4096),
            tie_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            qkv_bias,
            qk_norm: arch == Arch::Qwen3,
            rope_style: RopeStyle::HalfSplit,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Read the hyper-parameters from GGUF metadata (`<arch>.block_count`, ...).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let md = &content.metadata;
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| RuntimeError::MissingKey {
                path: path.to_path_buf(),
                key: "general.architecture".into(),
            })?
            .clone();
        let arch = Arch::parse(&arch_name, path)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_u = |k: &str| -> Result<usize> {
            let full = key(k);
            md.get(&full)
                .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
                .map(|x| x as usize)
                .ok_or(RuntimeError::MissingKey {
                    path: path.to_path_buf(),
                    key: full,
                })
        };
        let get_f = |k: &str| -> Option<f64> {
            md.get(&key(k))
                .and_then(|v| v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok()))
        };
        let hidden_size = get_u("embedding_length")?;
        let num_heads = get_u("attention.head_count")?;
        let num_kv_heads = get_u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = get_u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let has = |name: &str| content.tensor_infos.contains_key(name);
        let vocab_size = content
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .ok_or_else(|| RuntimeError::BadTensor {
                path: path.to_path_buf(),
                name: "token_embd.weight".into(),
                reason: "missing".into(),
            })?;
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_layers: get_u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            max_position: get_u("context_length").unwrap_or(4096),
            tie_embeddings: !has("output.weight"),
            qkv_bias: has("blk.0.attn_q.bias"),
            qk_norm: has("blk.0.attn_q_norm.weight"),
            rope_style: if arch == Arch::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::HalfSplit
            },
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |reason: String| Err(RuntimeError::bad_file(path, reason));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return bad("zero heads or layers".into());
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad(format!("head_dim {} must be even", self.head_dim));
        }
        Ok(())
    }

    /// Bytes of KV cache per token, `value_bytes` per stored value (2 for the CPU's f16
    /// cache).
    pub fn kv_bytes_per_token(&self, value_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * value_bytes
    }
}
