//! Reads tensors by their logical role from either a GGUF file (quantised, kept quantised)
//! or a Hugging Face safetensors directory (dense), so the transformer has one loader; or
//! creates random weights of a config's shapes on the device (benchmarks of real shapes
//! without downloading checkpoints).

use crate::config::ModelConfig;
use crate::error::{Result, RuntimeError};
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Logical tensor roles shared by the supported architectures.
#[derive(Clone, Copy, Debug)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    MlpNorm,
    Gate,
    Up,
    Down,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Weight,
    Bias,
}

fn gguf_name(role: Role, layer: usize, part: Part) -> String {
    let suffix = match part {
        Part::Weight => "weight",
        Part::Bias => "bias",
    };
    let base = match role {
        Role::Embed => return "token_embd.weight".into(),
        Role::FinalNorm => return "output_norm.weight".into(),
        Role::LmHead => return "output.weight".into(),
        Role::AttnNorm => "attn_norm",
        Role::Q => "attn_q",
        Role::K => "attn_k",
        Role::V => "attn_v",
        Role::O => "attn_output",
        Role::QNorm => "attn_q_norm",
        Role::KNorm => "attn_k_norm",
        Role::MlpNorm => "ffn_norm",
        Role::Gate => "ffn_gate",
        Role::Up => "ffn_up",
        Role::Down => "ffn_down",
    };
    format!("blk.{layer}.{base}.{suffix}")
}

fn hf_name(role: Role, layer: usize, part: Part) -> String {
    let suffix = match part {
        Part::Weight => "weight",
        Part::Bias => "bias",
    };
    let base = match role {
        Role::Embed => return "model.embed_tokens.weight".into(),
        Role::FinalNorm => return "model.norm.weight".into(),
        Role::LmHead => return "lm_head.weight".into(),
        Role::AttnNorm => "input_layernorm",
        Role::Q => "self_attn.q_proj",
        Role::K => "self_attn.k_proj",
        Role::V => "self_attn.v_proj",
        Role::O => "self_attn.o_proj",
        Role::QNorm => "self_attn.q_norm",
        Role::KNorm => "self_attn.k_norm",
        Role::MlpNorm => "post_attention_layernorm",
        Role::Gate => "mlp.gate_proj",
        Role::Up => "mlp.up_proj",
        Role::Down => "mlp.down_proj",
    };
    format!("model.layers.{layer}.{base}.{suffix}")
}

enum Source {
    Gguf {
        content: gguf_file::Content,
        file: File,
    },
    Safetensors(candle_core::safetensors::MmapedSafetensors),
    /// Normal(0, std) matrices and biases, unit norm weights, made on the device.
    Random {
        cfg: ModelConfig,
        std: f64,
    },
}

fn qdtype_of(dtype: DType) -> candle_core::quantized::GgmlDType {
    match dtype {
        DType::F16 => candle_core::quantized::GgmlDType::F16,
        DType::BF16 => candle_core::quantized::GgmlDType::BF16,
        _ => candle_core::quantized::GgmlDType::F32,
    }
}

/// An open weight source plus the file it came from (for error messages).
pub struct WeightSource {
    source: Source,
    path: PathBuf,
    device: Device,
    dtype: DType,
}

impl WeightSource {
    pub fn gguf(content: gguf_file::Content, file: File, path: &Path, device: &Device) -> Self {
        Self {
            source: Source::Gguf { content, file },
            path: path.to_path_buf(),
            device: device.clone(),
            dtype: DType::F32,
        }
    }

    pub fn safetensors(
        files: &[PathBuf],
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we rely
        // on them not being truncated while the model is loaded.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }
            .map_err(|e| RuntimeError::bad_file(dir, format!("cannot open safetensors: {e}")))?;
        Ok(Self {
            source: Source::Safetensors(st),
            path: dir.to_path_buf(),
            device: device.clone(),
            dtype,
        })
    }

    /// Random weights of `cfg`'s shapes, created directly on `device` in `dtype`
    /// (seed them with `device.set_seed`).
    pub fn random(cfg: &ModelConfig, path: &Path, device: &Device, dtype: DType, std: f64) -> Self {
        Self {
            source: Source::Random {
                cfg: cfg.clone(),
                std,
            },
            path: path.to_path_buf(),
            device: device.clone(),
            dtype,
        }
    }

    fn randn(&self, shape: &[usize], std: f64) -> Result<Tensor> {
        // curand fills f32; the bf16 copy is made on the device too.
        let t = Tensor::randn(0f32, std as f32, shape, &self.device)?;
        Ok(t.to_dtype(self.dtype)?)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn name(&self, role: Role, layer: usize, part: Part) -> String {
        match self.source {
            Source::Gguf { .. } => gguf_name(role, layer, part),
            Source::Safetensors(_) | Source::Random { .. } => hf_name(role, layer, part),
        }
    }

    pub fn has(&self, role: Role, layer: usize, part: Part) -> bool {
        let name = self.name(role, layer, part);
        match &self.source {
            Source::Gguf { content, .. } => content.tensor_infos.contains_key(&name),
            Source::Safetensors(st) => st.get(&name).is_ok(),
            Source::Random { cfg, .. } => match (role, part) {
                (Role::Q | Role::K | Role::V, Part::Bias) => cfg.qkv_bias,
                (_, Part::Bias) => false,
                (Role::LmHead, _) => !cfg.tie_embeddings,
                (Role::QNorm | Role::KNorm, _) => cfg.qk_norm,
                _ => true,
            },
        }
    }

    fn bad(&self, name: &str, reason: impl Into<String>) -> RuntimeError {
        RuntimeError::BadTensor {
            path: self.path.clone(),
            name: name.to_string(),
            reason: reason.into(),
        }
    }

    fn check_shape(&self, name: &str, got: &[usize], want: &[usize]) -> Result<()> {
        if got != want {
            return Err(self.bad(name, format!("shape {got:?}, expected {want:?}")));
        }
        Ok(())
    }

    /// A matrix for matmuls, `[out, in]`, kept quantised when it is.
    pub fn matrix(
        &mut self,
        role: Role,
        layer: usize,
        shape: (usize, usize),
    ) -> Result<Arc<QTensor>> {
        let name = self.name(role, layer, Part::Weight);
        let want = [shape.0, shape.1];
        match &mut self.source {
            Source::Gguf { content, file } => {
                let qt = crate::gguf_tensor::read_tensor(content, file, &name, &self.device)
                    .map_err(|e| RuntimeError::BadTensor {
                        path: self.path.clone(),
                        name: name.clone(),
                        reason: e.to_string(),
                    })?;
                let dims = qt.shape().dims().to_vec();
                self.check_shape(&name, &dims, &want)?;
                Ok(Arc::new(qt))
            }
            Source::Safetensors(_) => {
                let t = self.dense_by_name(&name)?;
                self.check_shape(&name, t.dims(), &want)?;
                // Dense weights are wrapped as an F32/F16/BF16 QTensor so both formats share
                // the QMatMul code path; QMatMul dequantises them once at construction.
                Ok(Arc::new(QTensor::quantize(&t, qdtype_of(t.dtype()))?))
            }
            Source::Random { std, .. } => {
                let std = *std;
                let t = self.randn(&want, std)?;
                Ok(Arc::new(QTensor::quantize(&t, qdtype_of(t.dtype()))?))
            }
        }
    }

    fn dense_by_name(&mut self, name: &str) -> Result<Tensor> {
        let t = match &mut self.source {
            Source::Gguf { content, file } => {
                crate::gguf_tensor::read_tensor(content, file, name, &self.device)
                    .and_then(|q| q.dequantize(&self.device))
                    .map_err(|e| self.bad(name, e.to_string()))?
            }
            Source::Safetensors(st) => st
                .load(name, &self.device)
                .map_err(|e| self.bad(name, e.to_string()))?,
            Source::Random { .. } => return Err(self.bad(name, "random source has no names")),
        };
        Ok(t.to_dtype(self.dtype)?)
    }

    /// A dense vector or matrix (norm weights, biases), converted to the compute dtype.
    pub fn dense(
        &mut self,
        role: Role,
        layer: usize,
        part: Part,
        shape: &[usize],
    ) -> Result<Tensor> {
        let name = self.name(role, layer, part);
        if let Source::Random { std, .. } = &self.source {
            return match part {
                Part::Bias => self.randn(shape, *std),
                Part::Weight => Ok(Tensor::ones(shape, self.dtype, &self.device)?),
            };
        }
        let t = self.dense_by_name(&name)?;
        self.check_shape(&name, t.dims(), shape)?;
        Ok(t)
    }

    /// A matrix ready for matmuls. On the CPU dense weights go through `QTensor` (as
    /// always); on a GPU they stay plain tensors in the compute dtype (bf16 cuBLAS
    /// matmuls; `QMatMul::from_arc` would dequantise a BF16 `QTensor` to f32 there).
    pub fn qmatmul(&mut self, role: Role, layer: usize, shape: (usize, usize)) -> Result<QMatMul> {
        if !self.device.is_cpu() {
            match &self.source {
                Source::Safetensors(_) => {
                    let name = self.name(role, layer, Part::Weight);
                    let t = self.dense_by_name(&name)?;
                    self.check_shape(&name, t.dims(), &[shape.0, shape.1])?;
                    return Ok(QMatMul::Tensor(t));
                }
                Source::Random { std, .. } => {
                    return Ok(QMatMul::Tensor(self.randn(&[shape.0, shape.1], *std)?));
                }
                Source::Gguf { .. } => {}
            }
        }
        Ok(QMatMul::from_arc(self.matrix(role, layer, shape)?)?)
    }

    /// Checks that a config and the tensors agree before the long load starts.
    pub fn check_config(&self, cfg: &ModelConfig) -> Result<()> {
        if let Source::Random { .. } = self.source {
            return Ok(());
        }
        if !self.has(Role::Embed, 0, Part::Weight) {
            return Err(self.bad(&self.name(Role::Embed, 0, Part::Weight), "missing"));
        }
        let last = cfg.num_layers - 1;
        if !self.has(Role::Down, last, Part::Weight) {
            return Err(self.bad(&self.name(Role::Down, last, Part::Weight), "missing"));
        }
        Ok(())
    }
}
