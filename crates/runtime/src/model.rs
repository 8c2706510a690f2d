//! The decoder-only transformer shared by Qwen3, Qwen2 and Llama, run over a ragged batch:
//! all rows' tokens are flattened so every linear layer runs once per step, while
//! attention (see `attention.rs`) keeps each row on its own paged KV cache.

use crate::attention::{paged_attention, HeadDims, RopeTable, RowSpan};
use crate::attention_device::{self, DeviceRope, StepPlan};
use crate::config::ModelConfig;
use crate::cpu_quant::{CpuMatmul, SeqRows};
use crate::error::Result;
use crate::kernel_options::{KernelOptions, WeightMemory};
use crate::kv::{BlockTable, KvStore};
use crate::weights::{Part, Role, WeightSource};
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};

use std::sync::OnceLock;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_graph;

/// Input embeddings of token ids, `[n, hidden]`, shareable across threads (routers use it).
pub type Embedder = std::sync::Arc<dyn Fn(&[u32]) -> candle_core::Result<Tensor> + Send + Sync>;

/// `x W^T`: decode-sized bf16 inputs on a GPU use our skinny kernel, the rest candle.
pub(crate) fn matmul_t(x: &Tensor, w: &QMatMul) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let QMatMul::Tensor(wt) = w {
        if crate::cuda::gemv::gemv_applies(x, wt) {
            return x.apply_op2_no_bwd(wt, &crate::cuda::gemv::Gemv);
        }
    }
    w.forward(x)
}

/// A matmul with an optional bias.
pub struct Linear {
    w: Weight,
    b: Option<Tensor>,
}

/// Who multiplies by a weight. Q5_0 / Q8_0 / Q4_K / Q6_K weights on the CPU run on our SIMD
/// kernels, with llama.cpp's arithmetic (see the `tokenrouter-cpu-kernels` crate); candle
/// keeps the rest. Only one of the two holds the weight: our Q4_K kernel multiplies a
/// repacked copy, and keeping candle's original beside it cost its size again in memory.
enum Weight {
    Candle(QMatMul),
    Ours(CpuMatmul),
}

impl Weight {
    /// Ours where one of our kernels takes `w` (its copy in `memory`), else candle's.
    fn choose(w: QMatMul, kernels: &KernelOptions, memory: WeightMemory) -> Self {
        match CpuMatmul::new(&w, kernels.cpu_q5, kernels.cpu_qk, memory) {
            Some(ours) => Self::Ours(ours),
            None => Self::Candle(w),
        }
    }

    /// `x @ w^T`, `x`'s rows grouped into sequences by `seqs` (our kernels round per sequence).
    fn forward(&self, x: &Tensor, seqs: SeqRows) -> candle_core::Result<Tensor> {
        match self {
            Self::Ours(q) => q.forward(x, seqs),
            Self::Candle(w) => matmul_t(x, w),
        }
    }
}

impl Linear {
    fn load(
        src: &mut WeightSource,
        role: Role,
        layer: usize,
        out: usize,
        inp: usize,
        bias: bool,
        kernels: &KernelOptions,
    ) -> Result<Self> {
        let w = src.qmatmul(role, layer, (out, inp))?;
        let b = if bias {
            Some(src.dense(role, layer, Part::Bias, &[out])?)
        } else {
            None
        };
        let w = Weight::choose(w, kernels, kernels.cpu_weight_memory());
        Ok(Self { w, b })
    }

    /// One matmul for several projections of the same input (rows stacked): dense tensors
    /// of one dtype on a GPU (fewer launches, better GEMM shapes), or quantised CPU weights
    /// of one type on our kernels (one parallel pass and one quantised input instead of two
    /// or three; the same results). None otherwise (quantised weights may differ in type).
    fn fuse(
        parts: &[&Linear],
        device: &Device,
        kernels: &KernelOptions,
    ) -> candle_core::Result<Option<Linear>> {
        let w = if device.is_cpu() {
            if !kernels.cpu_fuse {
                return Ok(None);
            }
            let ours: Option<Vec<&CpuMatmul>> = parts
                .iter()
                .map(|p| match &p.w {
                    Weight::Ours(q) => Some(q),
                    Weight::Candle(_) => None,
                })
                .collect();
            match ours.as_deref().and_then(CpuMatmul::fuse) {
                Some(f) => Weight::Ours(f),
                None => return Ok(None),
            }
        } else {
            let mut ws = Vec::with_capacity(parts.len());
            for p in parts {
                match &p.w {
                    Weight::Candle(QMatMul::Tensor(w)) => ws.push(w.clone()),
                    _ => return Ok(None),
                }
            }
            if ws.windows(2).any(|w| w[0].dtype() != w[1].dtype()) {
                return Ok(None);
            }
            Weight::Candle(QMatMul::Tensor(Tensor::cat(&ws, 0)?))
        };
        let b = match parts
            .iter()
            .map(|p| p.b.clone())
            .collect::<Option<Vec<_>>>()
        {
            Some(bs) => Some(Tensor::cat(&bs, 0)?),
            None if parts.iter().all(|p| p.b.is_none()) => None,
            None => return Ok(None),
        };
        Ok(Some(Linear { w, b }))
    }

    /// The dense weight `[out, in]` and bias, when the weight is not quantised.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn dense(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        match &self.w {
            Weight::Candle(QMatMul::Tensor(w)) => Some((w, self.b.as_ref())),
            _ => None,
        }
    }

    /// `x W^T (+ b)`, `x`'s rows grouped into sequences (`cpu_quant::SeqRows`; `None`:
    /// each row on its own).
    fn forward(&self, x: &Tensor, seqs: SeqRows) -> candle_core::Result<Tensor> {
        let y = self.w.forward(x, seqs)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// The q, k, v projections: separate, fused into one `[q | k | v]` matmul, or `[q | k]`
/// and v (GGUF mixes often store v in another type than q and k).
enum Qkv {
    Split(Linear, Linear, Linear),
    Fused(Linear),
    FusedQk(Linear, Linear),
}

/// The MLP's gate and up projections: separate, or fused into one `[gate | up]` matmul.
enum GateUp {
    Split(Linear, Linear),
    Fused(Linear),
}

struct Layer {
    attn_norm: Tensor,
    qkv: Qkv,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp_norm: Tensor,
    gate_up: GateUp,
    down: Linear,
}

/// Loaded weights of one model plus its rotary table.
pub struct Transformer {
    pub cfg: ModelConfig,
    embed: QMatMul,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Weight,
    rope: RopeTable,
    /// The rotary table as tensors, made on first use by the tensor-KV path.
    rope_dev: OnceLock<DeviceRope>,
    /// f32 rotary table for the fused CUDA kernels, made on first use.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rope_f32: OnceLock<(Tensor, Tensor)>,
    /// Zeroed counters for the attention kernel's in-kernel combine, made on first use.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    attn_counters: OnceLock<Tensor>,
    /// Kernel switches: the fused CUDA kernels (`model/cuda.rs`) and CUDA graphs
    /// (`model/cuda_graph.rs`) when they apply, and the choices read inside custom ops
    /// (current for the thread while `forward` runs).
    kernels: KernelOptions,
    #[cfg(feature = "cuda")]
    graphs: std::sync::Mutex<Option<cuda_graph::DecodeGraphs>>,
    /// Buffers of the 1-2 token steps' layers, made on first use (`model/cuda.rs`).
    #[cfg(feature = "cuda")]
    gemv_scratch: std::sync::Mutex<Option<cuda::GemvScratch>>,
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
    pub fn load(
        cfg: ModelConfig,
        src: &mut WeightSource,
        device: &Device,
        kernels: &KernelOptions,
    ) -> Result<Self> {
        src.check_config(&cfg)?;
        let h = cfg.hidden_size;
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let embed = src.qmatmul(Role::Embed, 0, (cfg.vocab_size, h))?;
        // The output matrix before the layers: our kernels copy it (onto huge pages), and
        // while little else is loaded the moment it exists twice does not set the peak. A
        // tied one stays shared with the embedding (a copy would be held beside it).
        let lm_head = if cfg.tie_embeddings || !src.has(Role::LmHead, 0, Part::Weight) {
            Weight::choose(embed.clone(), kernels, WeightMemory::Heap)
        } else {
            let w = src.qmatmul(Role::LmHead, 0, (cfg.vocab_size, h))?;
            Weight::choose(w, kernels, kernels.cpu_weight_memory())
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let qk_norm = |src: &mut WeightSource, role| -> Result<Option<Tensor>> {
                if cfg.qk_norm {
                    Ok(Some(src.dense(role, i, Part::Weight, &[cfg.head_dim])?))
                } else {
                    Ok(None)
                }
            };
            let q = Linear::load(src, Role::Q, i, qd, h, cfg.qkv_bias, kernels)?;
            let k = Linear::load(src, Role::K, i, kvd, h, cfg.qkv_bias, kernels)?;
            let v = Linear::load(src, Role::V, i, kvd, h, cfg.qkv_bias, kernels)?;
            let qkv = match Linear::fuse(&[&q, &k, &v], device, kernels)? {
                Some(f) => Qkv::Fused(f),
                // On the CPU q and k may still share a type when v does not.
                None if device.is_cpu() => match Linear::fuse(&[&q, &k], device, kernels)? {
                    Some(qk) => Qkv::FusedQk(qk, v),
                    None => Qkv::Split(q, k, v),
                },
                None => Qkv::Split(q, k, v),
            };
            let gate = Linear::load(src, Role::Gate, i, cfg.intermediate_size, h, false, kernels)?;
            let up = Linear::load(src, Role::Up, i, cfg.intermediate_size, h, false, kernels)?;
            let gate_up = match Linear::fuse(&[&gate, &up], device, kernels)? {
                Some(f) => GateUp::Fused(f),
                None => GateUp::Split(gate, up),
            };
            layers.push(Layer {
                attn_norm: src.dense(Role::AttnNorm, i, Part::Weight, &[h])?,
                qkv,
                o: Linear::load(src, Role::O, i, h, qd, false, kernels)?,
                q_norm: qk_norm(src, Role::QNorm)?,
                k_norm: qk_norm(src, Role::KNorm)?,
                mlp_norm: src.dense(Role::MlpNorm, i, Part::Weight, &[h])?,
                gate_up,
                down: Linear::load(src, Role::Down, i, h, cfg.intermediate_size, false, kernels)?,
            });
            crate::host_memory::return_freed_pages();
        }
        let norm = src.dense(Role::FinalNorm, 0, Part::Weight, &[h])?;
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
            rope_f32: OnceLock::new(),
            attn_counters: OnceLock::new(),
            kernels: *kernels,
            #[cfg(feature = "cuda")]
            graphs: std::sync::Mutex::new(None),
            #[cfg(feature = "cuda")]
            gemv_scratch: std::sync::Mutex::new(None),
            device: device.clone(),
        })
    }

    /// Whether steps use the fused CUDA kernels (CUDA builds, bf16 weights on a GPU).
    pub fn fused_kernels(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.kernels.fused_kernels && self.fused_path_supported()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Turn the fused CUDA kernels on or off (they stay off where unsupported).
    pub fn set_fused_kernels(&mut self, on: bool) {
        self.kernels.fused_kernels = on;
    }

    /// Turn CUDA graphs for decode steps on or off (they need the fused kernels).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.kernels.cuda_graphs = on;
    }

    /// The kernel switches this model was loaded with.
    pub fn kernels(&self) -> &KernelOptions {
        &self.kernels
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
        let _kernels = self.kernels.enter();
        #[cfg(feature = "cuda")]
        if let (true, KvStore::Device(caches)) = (self.fused_kernels(), &*kv) {
            if self.graph_applies(rows, all_logits) {
                if let Some(out) =
                    self.forward_graph(ids, rows, tables, block_size, caches, want_hidden)?
                {
                    return Ok(out);
                }
            }
            return Ok(self.forward_fused(
                ids,
                rows,
                tables,
                block_size,
                caches,
                want_hidden,
                all_logits,
            )?);
        }
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
        let lens: Vec<usize> = rows.iter().map(|r| r.len).collect();
        let seqs = Some(&lens[..]);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, eps)?;
            let (qd, kvd) = (
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            );
            let (mut q, mut k, v) = match &layer.qkv {
                Qkv::Split(q, k, v) => (
                    q.forward(&h, seqs)?,
                    k.forward(&h, seqs)?,
                    v.forward(&h, seqs)?,
                ),
                Qkv::Fused(f) => {
                    let y = f.forward(&h, seqs)?;
                    (
                        y.narrow(1, 0, qd)?.contiguous()?,
                        y.narrow(1, qd, kvd)?.contiguous()?,
                        y.narrow(1, qd + kvd, kvd)?.contiguous()?,
                    )
                }
                Qkv::FusedQk(qk, v) => {
                    let y = qk.forward(&h, seqs)?;
                    (
                        y.narrow(1, 0, qd)?.contiguous()?,
                        y.narrow(1, qd, kvd)?.contiguous()?,
                        v.forward(&h, seqs)?,
                    )
                }
            };
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
            x = (x + layer.o.forward(&attn, seqs)?)?;
            let h = rms_norm(&x, &layer.mlp_norm, eps)?;
            let (g, u) = match &layer.gate_up {
                GateUp::Split(g, u) => (g.forward(&h, seqs)?, u.forward(&h, seqs)?),
                GateUp::Fused(f) => {
                    let y = f.forward(&h, seqs)?;
                    let i = cfg.intermediate_size;
                    (y.narrow(1, 0, i)?, y.narrow(1, i, i)?)
                }
            };
            let m = swiglu(&g, &u)?;
            x = (x + layer.down.forward(&m, seqs)?)?;
        }
        let x = if all_logits {
            x
        } else {
            let last: Vec<u32> = rows.iter().map(|r| (r.start + r.len - 1) as u32).collect();
            x.index_select(&Tensor::new(last, &self.device)?, 0)?
        };
        Ok(self.head(&rms_norm(&x, &self.norm, eps)?, want_hidden)?)
    }

    /// Logits (and, when wanted, the hidden state) of final-norm hidden states `hn`.
    /// Sampling and routers read f32: convert on the device (a no-op on f32).
    fn head(&self, hn: &Tensor, want_hidden: bool) -> candle_core::Result<ForwardOutput> {
        let logits = self.lm_head.forward(hn, None)?;
        Ok(ForwardOutput {
            logits: logits.to_dtype(DType::F32)?,
            hidden: if want_hidden {
                Some(hn.to_dtype(DType::F32)?)
            } else {
                None
            },
        })
    }
}

/// RMSNorm of each row of `x` times `w`: llama.cpp's arithmetic on the CPU (`ggml_ops`),
/// candle's elsewhere.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return candle_nn::ops::rms_norm(x, w, eps);
    }
    let y = cpu_values(x, |xs| {
        cpu_values(w, |ws| crate::ggml_ops::rms_norm(xs, ws, eps))
    })??;
    Tensor::from_vec(y, x.shape(), x.device())
}

/// `silu(g) * u`: llama.cpp's arithmetic on the CPU (`ggml_ops`), candle's elsewhere.
fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    if !g.device().is_cpu() || g.dtype() != DType::F32 {
        return candle_nn::ops::silu(g)? * u;
    }
    let y = cpu_values(g, |gs| cpu_values(u, |us| crate::ggml_ops::swiglu(gs, us)))??;
    Tensor::from_vec(y, g.shape(), g.device())
}

/// `f` of an f32 CPU tensor's values in order: read in place when they lie contiguous in
/// its storage, copied out otherwise (in place saves copying a prompt's activations,
/// megabytes a layer).
fn cpu_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
        (&*storage, layout.contiguous_offsets())
    {
        return Ok(f(&v[a..b]));
    }
    drop(storage);
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}
