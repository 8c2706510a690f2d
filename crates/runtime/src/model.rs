//! The decoder-only transformer shared by Qwen3, Qwen2 and Llama, run over a ragged batch:
//! all rows' tokens are flattened so every linear layer runs once per step, while
//! attention (see `attention.rs`) keeps each row on its own paged KV cache.

use crate::attention::{paged_attention, HeadDims, RopeTable, RowSpan};
use crate::attention_device::{self, DeviceRope, StepPlan};
use crate::config::ModelConfig;
use crate::cpu_q5::Q5Matmul;
use crate::error::Result;
use crate::kv::{BlockTable, KvStore};
use crate::weights::{Part, Role, WeightSource};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::ops::rms_norm;
use std::sync::OnceLock;

/// Input embeddings of token ids, `[n, hidden]`, shareable across threads (routers use it).
pub type Embedder = std::sync::Arc<dyn Fn(&[u32]) -> candle_core::Result<Tensor> + Send + Sync>;

/// A matmul with an optional bias.
pub struct Linear {
    w: QMatMul,
    /// Q5_0 weights on the CPU run on our SIMD kernel instead (see `cpu_q5.rs`).
    q5: Option<Q5Matmul>,
    b: Option<Tensor>,
}

impl Linear {
    fn load(
        src: &mut WeightSource,
        role: Role,
        layer: usize,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let w = src.qmatmul(role, layer, (out, inp))?;
        let b = if bias {
            Some(src.dense(role, layer, Part::Bias, &[out])?)
        } else {
            None
        };
        let q5 = Q5Matmul::new(&w);
        Ok(Self { w, q5, b })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.q5 {
            Some(q5) => q5.forward(x)?,
            None => self.w.forward(x)?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Loaded weights of one model plus its rotary table.
pub struct Transformer {
    pub cfg: ModelConfig,
    embed: QMatMul,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: QMatMul,
    rope: RopeTable,
    /// The rotary table as tensors, made on first use by the tensor-KV path.
    rope_dev: OnceLock<DeviceRope>,
    device: Device,
}

/// What a forward pass returns.
pub struct ForwardOutput {
    /// `[rows, vocab]` logits of each row's last token, or `[tokens, vocab]` when all
    /// positions were requested.
    pub logits: Tensor,
    /// `[rows, hidden]` final-norm hidden state (the lm_head input) of each row's last token.
    pub hidden: Option<Tensor>,
}

impl Transformer {
    pub fn load(cfg: ModelConfig, src: &mut WeightSource, device: &Device) -> Result<Self> {
        src.check_config(&cfg)?;
        let h = cfg.hidden_size;
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let embed = src.qmatmul(Role::Embed, 0, (cfg.vocab_size, h))?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let qk_norm = |src: &mut WeightSource, role| -> Result<Option<Tensor>> {
                if cfg.qk_norm {
                    Ok(Some(src.dense(role, i, Part::Weight, &[cfg.head_dim])?))
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: src.dense(Role::AttnNorm, i, Part::Weight, &[h])?,
                q: Linear::load(src, Role::Q, i, qd, h, cfg.qkv_bias)?,
                k: Linear::load(src, Role::K, i, kvd, h, cfg.qkv_bias)?,
                v: Linear::load(src, Role::V, i, kvd, h, cfg.qkv_bias)?,
                o: Linear::load(src, Role::O, i, h, qd, false)?,
                q_norm: qk_norm(src, Role::QNorm)?,
                k_norm: qk_norm(src, Role::KNorm)?,
                mlp_norm: src.dense(Role::MlpNorm, i, Part::Weight, &[h])?,
                gate: Linear::load(src, Role::Gate, i, cfg.intermediate_size, h, false)?,
                up: Linear::load(src, Role::Up, i, cfg.intermediate_size, h, false)?,
                down: Linear::load(src, Role::Down, i, h, cfg.intermediate_size, false)?,
            });
        }
        let norm = src.dense(Role::FinalNorm, 0, Part::Weight, &[h])?;
        let lm_head = if cfg.tie_embeddings || !src.has(Role::LmHead, 0, Part::Weight) {
            embed.clone()
        } else {
            src.qmatmul(Role::LmHead, 0, (cfg.vocab_size, h))?
        };
        // The table grows with the context; cap it so a 1M-context config does not
        // allocate gigabytes up front (sequences beyond it are rejected as too long).
        let rope_len = cfg.max_position.min(1 << 17);
        let rope = RopeTable::new(cfg.head_dim, cfg.rope_theta, rope_len, cfg.rope_style);
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            rope_dev: OnceLock::new(),
            device: device.clone(),
        })
    }

    /// The dtype hidden states have (bf16 for dense bf16 weights, f32 otherwise).
    pub fn dtype(&self) -> DType {
        match &self.embed {
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dtype(),
            QMatMul::QTensor(_) => DType::F32,
        }
    }

    fn device_rope(&self, dtype: DType) -> candle_core::Result<&DeviceRope> {
        if let Some(r) = self.rope_dev.get() {
            return Ok(r);
        }
        let r = DeviceRope::new(&self.rope, dtype, &self.device)?;
        Ok(self.rope_dev.get_or_init(|| r))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Longest sequence this model accepts.
    pub fn max_len(&self) -> usize {
        self.rope.max_pos()
    }

    /// The input embedding of some tokens, `[n, hidden]` (used by routers such as R2R).
    pub fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, &self.device)?;
        Ok(self.embed.embedding(&ids)?)
    }

    /// A shareable function giving input embeddings of token ids (for routers).
    pub fn embedder(&self) -> Embedder {
        let embed = self.embed.clone();
        let device = self.device.clone();
        std::sync::Arc::new(move |ids: &[u32]| {
            let ids = Tensor::new(ids, &device)?;
            embed.embedding(&ids)
        })
    }

    /// Run one ragged batch. `tables[r]` must already have room for row r's new tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        ids: &[u32],
        rows: &[RowSpan],
        tables: &[&BlockTable],
        block_size: usize,
        kv: &mut KvStore,
        want_hidden: bool,
        all_logits: bool,
    ) -> Result<ForwardOutput> {
        let cfg = &self.cfg;
        let t = ids.len();
        let eps = cfg.rms_norm_eps as f32;
        let dims = HeadDims {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let ids_t = Tensor::new(ids, &self.device)?;
        let mut x = self.embed.embedding(&ids_t)?;
        let plan = match kv {
            KvStore::Device(c) => {
                let dt = c.first().map_or(x.dtype(), |c| c.dtype());
                let rope = self.device_rope(dt)?;
                Some(StepPlan::new(
                    rows,
                    tables,
                    block_size,
                    rope,
                    dims,
                    &self.device,
                )?)
            }
            KvStore::Host(_) => None,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, eps)?;
            let mut q = layer.q.forward(&h)?;
            let mut k = layer.k.forward(&h)?;
            let v = layer.v.forward(&h)?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                let hd = cfg.head_dim;
                q = rms_norm(&q.reshape((t * cfg.num_heads, hd))?, qn, eps)?;
                k = rms_norm(&k.reshape((t * cfg.num_kv_heads, hd))?, kn, eps)?;
            }
            let attn = match (&mut *kv, &plan) {
                (KvStore::Device(c), Some(plan)) => {
                    let q = q.reshape((t, cfg.num_heads * cfg.head_dim))?;
                    let k = k.reshape((t, cfg.num_kv_heads * cfg.head_dim))?;
                    attention_device::attend(&q, &k, &v, plan, &c[li], dims)?.to_dtype(x.dtype())?
                }
                (KvStore::Device(_), None) => unreachable!("a plan is made for tensor KV"),
                (KvStore::Host(c), _) => {
                    let mut qv = q.flatten_all()?.to_vec1::<f32>()?;
                    let mut kv_new = k.flatten_all()?.to_vec1::<f32>()?;
                    let vv = v.flatten_all()?.to_vec1::<f32>()?;
                    let attn = paged_attention(
                        &mut qv,
                        &mut kv_new,
                        &vv,
                        rows,
                        tables,
                        block_size,
                        &mut c[li],
                        dims,
                        &self.rope,
                    );
                    Tensor::from_vec(attn, (t, cfg.num_heads * cfg.head_dim), &self.device)?
                }
            };
            x = (x + layer.o.forward(&attn)?)?;
            let h = rms_norm(&x, &layer.mlp_norm, eps)?;
            let g = layer.gate.forward(&h)?;
            let u = layer.up.forward(&h)?;
            let m = (candle_nn::ops::silu(&g)? * u)?;
            x = (x + layer.down.forward(&m)?)?;
        }
        let x = if all_logits {
            x
        } else {
            let last: Vec<u32> = rows.iter().map(|r| (r.start + r.len - 1) as u32).collect();
            x.index_select(&Tensor::new(last, &self.device)?, 0)?
        };
        let hn = rms_norm(&x, &self.norm, eps)?;
        // Sampling and routers read f32 on the host: convert on the device (a no-op on f32).
        let logits = self.lm_head.forward(&hn)?.to_dtype(DType::F32)?;
        Ok(ForwardOutput {
            logits,
            hidden: if want_hidden {
                Some(hn.to_dtype(DType::F32)?)
            } else {
                None
            },
        })
    }
}
