//! The CUDA step with our fused kernels (`cuda/kernels.rs`): per layer one fused qkv matmul,
//! one norm+RoPE+KV-store kernel, one paged-attention kernel, the o projection, two
//! add+RMSNorm kernels, one fused gate_up matmul, one silu*mul kernel and the down
//! projection: 9 launches instead of ~32 candle ops. Steps of 1-2 tokens fold the norms,
//! silu*mul and residual adds into skinny matmuls (`cuda/gemv.rs`): 6 launches. Long extend
//! rows (first contact with a long prompt) are attended with batched matmuls instead, whose
//! cost does not grow with the square of the row length.

use super::{ForwardOutput, GateUp, Qkv, Transformer};
use crate::attention::{HeadDims, RowSpan};
use crate::attention_device::{CachedRow, TensorKv};
use crate::cuda::gemv::{
    fused_gemv_enabled, gemv_residual, GemvFolded, NormOutput, FUSED_GEMV_MAX_ROWS, GEMV_NORM_MAX_K,
};
use crate::cuda::kernels::{
    attention_splits, ptr, AddRmsNorm, AttentionKernel, EmbedGather, NormRopeStore, PagedAttention,
    SiluMul, ATTN_COUNTERS, MAX_ATTENTION_SPLITS,
};
use crate::kv::BlockTable;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Result, Tensor};

/// Combine attention's splits in the split kernel's last block instead of a kernel of its own
/// (`KernelOptions::attention_combine_in_kernel`). Off by default: one launch less, but measured
/// slower (H200, 0.6B step at 1 row: 1.30 vs 1.26 ms; the last block's fence, atomic and
/// serial combine lengthen the kernel's tail more than the graph node costs).
fn combine_in_kernel() -> bool {
    crate::kernel_options::KernelOptions::current().attention_combine_in_kernel
}

fn dense(l: &super::Linear) -> Result<(&Tensor, Option<&Tensor>)> {
    l.dense()
        .ok_or_else(|| candle_core::Error::Msg("fused path needs dense weights".into()))
}

/// Rows longer than this go through the matmul path.
const KERNEL_MAX_ROW: usize = 64;

/// Device addresses of a step's layout arrays (i32), as the kernels read them.
pub(super) struct MetaPtrs {
    pub tokens: usize,
    pub pos: u64,
    pub slots: u64,
    /// Row of each token in `tables`, or -1: not attended by the kernel.
    pub tok_row: u64,
    /// `[rows, max_blocks]` block ids.
    pub tables: u64,
    pub max_blocks: usize,
    pub block_size: usize,
    /// Context splits of the attention kernel.
    pub splits: usize,
}

/// What the kernels need to know about a step's layout, uploaded in one copy.
struct StepMeta {
    /// `[ids | pos | slots | tok_row | block tables]` as i32 on the device.
    buf: Tensor,
    tokens: usize,
    max_blocks: usize,
    /// Longest context of the rows the kernel attends.
    max_ctx: usize,
    long_rows: Vec<CachedRow>,
}

impl StepMeta {
    fn new(
        ids: &[u32],
        rows: &[RowSpan],
        tables: &[&BlockTable],
        block_size: usize,
        device: &Device,
    ) -> Result<Self> {
        let tokens: usize = rows.iter().map(|r| r.len).sum();
        let max_blocks = rows
            .iter()
            .filter(|r| r.len <= KERNEL_MAX_ROW)
            .map(|r| (r.past + r.len).div_ceil(block_size))
            .max()
            .unwrap_or(1)
            .max(1);
        let max_ctx = rows
            .iter()
            .filter(|r| r.len <= KERNEL_MAX_ROW)
            .map(|r| r.past + r.len)
            .max()
            .unwrap_or(1);
        let mut buf = vec![0u32; 4 * tokens + rows.len() * max_blocks];
        buf[..tokens].copy_from_slice(ids);
        let mut long_rows = Vec::new();
        for (i, (r, t)) in rows.iter().zip(tables).enumerate() {
            let short = r.len <= KERNEL_MAX_ROW;
            for j in 0..r.len {
                let p = r.past + j;
                buf[tokens + r.start + j] = p as u32;
                buf[2 * tokens + r.start + j] = t.slot(p, block_size) as u32;
                buf[3 * tokens + r.start + j] = if short { i as u32 } else { u32::MAX };
            }
            if short {
                let n = (r.past + r.len).div_ceil(block_size);
                let at = 4 * tokens + i * max_blocks;
                buf[at..at + n].copy_from_slice(&t.blocks[..n]);
            } else {
                long_rows.push(CachedRow::new(r, t, block_size, device)?);
            }
        }
        Ok(Self {
            buf: Tensor::from_vec(buf, 4 * tokens + rows.len() * max_blocks, device)?,
            tokens,
            max_blocks,
            max_ctx,
            long_rows,
        })
    }

    /// Device address of section `k` (0 ids, 1 pos, 2 slots, 3 tok_row, 4 block tables).
    fn section(&self, base: u64, k: usize) -> u64 {
        base + (k * self.tokens * 4) as u64
    }
}

impl Transformer {
    /// The fused path applies: CUDA, bf16 weights and cache, fused projections, shapes the
    /// kernels support.
    pub(super) fn fused_path_supported(&self) -> bool {
        let cfg = &self.cfg;
        !self.device.is_cpu()
            && self.dtype() == DType::BF16
            && crate::cuda::kernels::head_dim_supported(cfg.head_dim)
            && cfg.hidden_size <= crate::cuda::kernels::ADD_RMS_NORM_MAX_HIDDEN
            && self
                .layers
                .iter()
                .all(|l| matches!(l.qkv, Qkv::Fused(_)) && matches!(l.gate_up, GateUp::Fused(_)))
    }

    /// Context splits of the attention kernel for a step of `tokens` (longest context
    /// `max_ctx`, unknown for graphs), given the blocks per token of the kernel that runs.
    pub(super) fn attention_splits(&self, tokens: usize, max_ctx: Option<usize>) -> usize {
        let cfg = &self.cfg;
        let heads = AttentionKernel::Auto.grid_heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        attention_splits(tokens, heads, max_ctx)
    }

    fn rope_f32(&self) -> Result<&(Tensor, Tensor)> {
        if let Some(r) = self.rope_f32.get() {
            return Ok(r);
        }
        let (cos, sin, half, _) = self.rope.parts();
        let n = cos.len() / half.max(1);
        let r = (
            Tensor::from_slice(cos, (n, half), &self.device)?,
            Tensor::from_slice(sin, (n, half), &self.device)?,
        );
        Ok(self.rope_f32.get_or_init(|| r))
    }

    /// The token embeddings of `tokens` ids at device address `ids`.
    pub(super) fn embed_ids(&self, ids: u64, tokens: usize) -> Result<Tensor> {
        match &self.embed {
            QMatMul::Tensor(w) => w.apply_op1_no_bwd(&EmbedGather { ids, tokens }),
            _ => Err(candle_core::Error::Msg(
                "fused path needs a dense embedding".into(),
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_fused(
        &self,
        ids: &[u32],
        rows: &[RowSpan],
        tables: &[&BlockTable],
        block_size: usize,
        caches: &[TensorKv],
        want_hidden: bool,
        all_logits: bool,
    ) -> Result<ForwardOutput> {
        let meta = StepMeta::new(ids, rows, tables, block_size, &self.device)?;
        let base = ptr(Some(&meta.buf))?;
        let x = self.embed_ids(meta.section(base, 0), meta.tokens)?;
        let layout = MetaPtrs {
            tokens: meta.tokens,
            pos: meta.section(base, 1),
            slots: meta.section(base, 2),
            tok_row: meta.section(base, 3),
            tables: meta.section(base, 4),
            max_blocks: meta.max_blocks,
            block_size,
            splits: self.attention_splits(meta.tokens, Some(meta.max_ctx)),
        };
        let h = self.layers_fused(x, &layout, &meta.long_rows, caches)?;
        let hn = if all_logits || meta.tokens == rows.len() {
            h
        } else {
            let last: Vec<u32> = rows.iter().map(|r| (r.start + r.len - 1) as u32).collect();
            h.index_select(&Tensor::new(last, &self.device)?, 0)?
        };
        self.head(&hn, want_hidden)
    }

    /// All decoder layers over embedded tokens `x` (updated in place as the residual
    /// stream); returns the final-norm hidden state of every token. Steps of 1-2 tokens take
    /// the skinny-matmul variants with the norms, silu*mul and residual adds folded in
    /// (6 kernels per layer instead of 10).
    pub(super) fn layers_fused(
        &self,
        x: Tensor,
        m: &MetaPtrs,
        long_rows: &[CachedRow],
        caches: &[TensorKv],
    ) -> Result<Tensor> {
        if long_rows.is_empty() && self.gemv_layers_apply(m.tokens) {
            return self.layers_gemv(x, m, caches);
        }
        let eps = self.cfg.rms_norm_eps as f32;
        let first_norm = self.layers.first().map_or(&self.norm, |l| &l.attn_norm);
        let mut h = x.apply_op1_no_bwd(&AddRmsNorm {
            weight: ptr(Some(first_norm))?,
            eps,
        })?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (Qkv::Fused(qkv_proj), GateUp::Fused(gate_up)) = (&layer.qkv, &layer.gate_up)
            else {
                return Err(candle_core::Error::Msg(
                    "fused path needs fused weights".into(),
                ));
            };
            let cache = &caches[li];
            let (q, attn) = self.attend(layer, &qkv_proj.forward(&h, None)?, m, cache)?;
            for long in long_rows {
                attn.slice_set(&long.attend(&q, cache, self.head_dims())?, 0, long.start)?;
            }
            let o = layer.o.forward(&attn, None)?;
            h = x.apply_op2_no_bwd(
                &o,
                &AddRmsNorm {
                    weight: ptr(Some(&layer.mlp_norm))?,
                    eps,
                },
            )?;
            let act = gate_up.forward(&h, None)?.apply_op1_no_bwd(&SiluMul)?;
            let d = layer.down.forward(&act, None)?;
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |l| &l.attn_norm);
            h = x.apply_op2_no_bwd(
                &d,
                &AddRmsNorm {
                    weight: ptr(Some(next_norm))?,
                    eps,
                },
            )?;
        }
        Ok(h)
    }

    /// The skinny-matmul layers apply: 1-2 tokens, kernels on, dense weights without o/down
    /// biases, hidden size within the norm kernel's shared memory.
    fn gemv_layers_apply(&self, tokens: usize) -> bool {
        (1..=FUSED_GEMV_MAX_ROWS).contains(&tokens)
            && fused_gemv_enabled()
            && self.cfg.hidden_size <= GEMV_NORM_MAX_K
            && self.cfg.hidden_size.is_multiple_of(8)
            && self.layers.iter().all(|l| {
                matches!((&l.qkv, &l.gate_up), (Qkv::Fused(q), GateUp::Fused(g))
                    if q.dense().is_some() && g.dense().is_some_and(|(_, b)| b.is_none()))
                    && l.o.dense().is_some_and(|(_, b)| b.is_none())
                    && l.down.dense().is_some_and(|(_, b)| b.is_none())
            })
    }

    /// `layers_fused` for 1-2 tokens: per layer qkv (input norm folded in), norm+RoPE+store,
    /// attention, o (residual add folded in), gate_up (input norm and silu*mul folded in),
    /// down (residual add folded in). The kernels write into the model's scratch buffers
    /// instead of new tensors: with no allocation between them they follow each other
    /// directly in the stream (and in a CUDA graph), which programmatic dependent launch
    /// needs to overlap them (`cuda::kernels::pdl_enabled`).
    fn layers_gemv(&self, x: Tensor, m: &MetaPtrs, caches: &[TensorKv]) -> Result<Tensor> {
        let cfg = &self.cfg;
        let dev = self.device.as_cuda_device()?;
        let eps = cfg.rms_norm_eps as f32;
        let mut guard = self
            .gemv_scratch
            .lock()
            .map_err(|_| candle_core::Error::Msg("gemv scratch poisoned".into()))?;
        if guard.is_none() {
            *guard = Some(GemvScratch::new(self)?);
        }
        let Some(scratch) = guard.as_ref() else {
            return Err(candle_core::Error::Msg("gemv scratch missing".into()));
        };
        let s = scratch.ptrs()?;
        let (t, hidden) = (m.tokens, cfg.hidden_size);
        let x_p = ptr(Some(&x))?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (Qkv::Fused(qkv_proj), GateUp::Fused(gate_up)) = (&layer.qkv, &layer.gate_up)
            else {
                return Err(candle_core::Error::Msg(
                    "fused path needs fused weights".into(),
                ));
            };
            let (w_qkv, b_qkv) = dense(qkv_proj)?;
            GemvFolded {
                norm: Some(ptr(Some(&layer.attn_norm))?),
                eps,
                output: NormOutput::Bias(ptr(b_qkv)?),
            }
            .launch_into(
                dev,
                x_p,
                ptr(Some(w_qkv))?,
                s.qkv,
                (t, w_qkv.dim(0)?, hidden),
            )?;
            self.norm_rope_store(layer, m, &caches[li])?
                .launch_into(dev, s.qkv, s.q)?;
            let attention = self.paged_attention(m, &caches[li])?;
            if attention.parts(t) > scratch.parts {
                return Err(candle_core::Error::Msg(format!(
                    "attention needs {} partials, scratch has {}",
                    attention.parts(t),
                    scratch.parts
                )));
            }
            attention.launch_into(dev, s.q, t, s.attn, (s.part_ml, s.part_acc))?;
            let w_o = dense(&layer.o)?.0;
            gemv_residual(dev, x_p, s.attn, ptr(Some(w_o))?, (t, hidden, w_o.dim(1)?))?;
            let w_gu = dense(gate_up)?.0;
            GemvFolded {
                norm: Some(ptr(Some(&layer.mlp_norm))?),
                eps,
                output: NormOutput::SiluMul,
            }
            .launch_into(
                dev,
                x_p,
                ptr(Some(w_gu))?,
                s.act,
                (t, w_gu.dim(0)?, hidden),
            )?;
            let w_down = dense(&layer.down)?.0;
            gemv_residual(
                dev,
                x_p,
                s.act,
                ptr(Some(w_down))?,
                (t, hidden, w_down.dim(1)?),
            )?;
        }
        x.apply_op1_no_bwd(&AddRmsNorm {
            weight: ptr(Some(&self.norm))?,
            eps,
        })
    }

    fn attn_counters(&self) -> Result<&Tensor> {
        if let Some(c) = self.attn_counters.get() {
            return Ok(c);
        }
        let c = Tensor::zeros(ATTN_COUNTERS, DType::U32, &self.device)?;
        Ok(self.attn_counters.get_or_init(|| c))
    }

    fn head_dims(&self) -> HeadDims {
        HeadDims {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// The q/k norm, RoPE and K/V store kernel of `layer` for the step `m`.
    fn norm_rope_store(
        &self,
        layer: &super::Layer,
        m: &MetaPtrs,
        cache: &TensorKv,
    ) -> Result<NormRopeStore> {
        let dims = self.head_dims();
        let (cos, sin) = self.rope_f32()?;
        Ok(NormRopeStore {
            tokens: m.tokens,
            num_heads: dims.num_heads,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
            q_norm: ptr(layer.q_norm.as_ref())?,
            k_norm: ptr(layer.k_norm.as_ref())?,
            eps: self.cfg.rms_norm_eps as f32,
            cos: ptr(Some(cos))?,
            sin: ptr(Some(sin))?,
            pos: m.pos,
            slots: m.slots,
            k_cache: ptr(Some(&cache.k))?,
            v_cache: ptr(Some(&cache.v))?,
            interleaved: self.rope.parts().3 == crate::config::RopeStyle::Interleaved,
        })
    }

    /// The paged-attention kernels for the step `m` over one layer's cache.
    fn paged_attention(&self, m: &MetaPtrs, cache: &TensorKv) -> Result<PagedAttention> {
        let dims = self.head_dims();
        Ok(PagedAttention {
            num_heads: dims.num_heads,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
            block_size: m.block_size,
            max_blocks: m.max_blocks,
            splits: m.splits,
            k_cache: ptr(Some(&cache.k))?,
            v_cache: ptr(Some(&cache.v))?,
            block_tables: m.tables,
            tok_row: m.tok_row,
            pos: m.pos,
            counters: if combine_in_kernel() {
                ptr(Some(self.attn_counters()?))?
            } else {
                0
            },
            kernel: AttentionKernel::Auto,
        })
    }

    /// q/k norm, RoPE and the K/V store of the fused `qkv` projection, then paged attention
    /// of the kernel-attended tokens: (roped q, attention output).
    fn attend(
        &self,
        layer: &super::Layer,
        qkv: &Tensor,
        m: &MetaPtrs,
        cache: &TensorKv,
    ) -> Result<(Tensor, Tensor)> {
        let q = qkv.apply_op1_no_bwd(&self.norm_rope_store(layer, m, cache)?)?;
        let attn = q.apply_op1_no_bwd(&self.paged_attention(m, cache)?)?;
        Ok((q, attn))
    }
}

/// Device buffers of `layers_gemv` for up to `FUSED_GEMV_MAX_ROWS` tokens, reused by every
/// layer and step of one model (its steps run one at a time on the model's stream; the
/// mutex around it keeps it so).
pub(super) struct GemvScratch {
    qkv: Tensor,
    q: Tensor,
    attn: Tensor,
    act: Tensor,
    part_ml: Tensor,
    part_acc: Tensor,
    /// Attention partials the buffers hold.
    parts: usize,
}

/// Device addresses of a [`GemvScratch`]'s buffers.
struct ScratchPtrs {
    qkv: u64,
    q: u64,
    attn: u64,
    act: u64,
    part_ml: u64,
    part_acc: u64,
}

impl GemvScratch {
    fn new(model: &Transformer) -> Result<Self> {
        let cfg = &model.cfg;
        let rows = FUSED_GEMV_MAX_ROWS;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let parts = rows * nh * MAX_ATTENTION_SPLITS;
        let dev = &model.device;
        let bf16 = |n: usize| Tensor::zeros(n, DType::BF16, dev);
        Ok(Self {
            qkv: bf16(rows * (nh + 2 * nkv) * hd)?,
            q: bf16(rows * nh * hd)?,
            attn: bf16(rows * nh * hd)?,
            act: bf16(rows * cfg.intermediate_size)?,
            part_ml: Tensor::zeros(2 * parts, DType::F32, dev)?,
            part_acc: Tensor::zeros(parts * hd, DType::F32, dev)?,
            parts,
        })
    }

    fn ptrs(&self) -> Result<ScratchPtrs> {
        Ok(ScratchPtrs {
            qkv: ptr(Some(&self.qkv))?,
            q: ptr(Some(&self.q))?,
            attn: ptr(Some(&self.attn))?,
            act: ptr(Some(&self.act))?,
            part_ml: ptr(Some(&self.part_ml))?,
            part_acc: ptr(Some(&self.part_acc))?,
        })
    }
}
