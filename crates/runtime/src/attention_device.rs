//! Attention over a paged KV cache kept as tensors on the model's device (the CUDA path;
//! also runs on the CPU, which the tests use to check it against `attention.rs`).
//!
//! Per layer the cache is `[slots, kv_heads * head_dim]` in the compute dtype (bf16 on
//! CUDA). A step's new keys/values are written into their slots with one `scatter_set`;
//! RoPE uses candle's fused kernels with cos/sin rows gathered by position once per step.
//! Rows are attended in groups: all decode rows (one query each) together, padded to the
//! longest context, and each extend row alone. A group gathers its rows' slots
//! (`index_select`), and runs grouped-query attention as batched matmuls with the query
//! heads of one KV head stacked (`[kv_heads, group * q_len, head_dim]`, K/V never
//! repeated), an additive mask (causal and padding) and an f32 softmax.
//! Everything that depends only on the batch layout is built once per step (`StepPlan`).

use crate::attention::{HeadDims, RopeTable, RowSpan};
use crate::config::RopeStyle;
use crate::kv::BlockTable;
use candle_core::{DType, Device, Result, Tensor};

/// One layer's keys and values as tensors `[slots, kv_heads * head_dim]`.
#[derive(Debug)]
pub struct TensorKv {
    pub k: Tensor,
    pub v: Tensor,
}

impl TensorKv {
    pub fn new(slots: usize, row: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            k: Tensor::zeros((slots, row), dtype, device)?,
            v: Tensor::zeros((slots, row), dtype, device)?,
        })
    }

    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }
}

/// The rotary table as device tensors `[max_pos, head_dim / 2]`.
pub struct DeviceRope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl DeviceRope {
    pub fn new(table: &RopeTable, dtype: DType, device: &Device) -> Result<Self> {
        let (cos, sin, half, style) = table.parts();
        let n = cos.len() / half.max(1);
        Ok(Self {
            cos: Tensor::from_slice(cos, (n, half), device)?.to_dtype(dtype)?,
            sin: Tensor::from_slice(sin, (n, half), device)?.to_dtype(dtype)?,
            style,
        })
    }
}

/// Rows attended together.
struct Group {
    rows: usize,
    q_len: usize,
    kv_len: usize,
    /// Where the group's queries sit in the step: a contiguous span, or token indices.
    queries: Queries,
    /// `[rows * kv_len]` cache slots to read (padding repeats a valid slot).
    gather: Tensor,
    /// `[rows, 1, 1, q_len, kv_len]` additive f32 mask; None when nothing is masked.
    mask: Option<Tensor>,
}

enum Queries {
    Span(usize, usize),
    Index(Tensor),
}

/// What a step's layout gives every layer: rope rows, slots to write, attention groups.
pub struct StepPlan {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
    /// `[tokens, kv_heads * head_dim]` slot of each token, for `scatter_set`.
    write: Tensor,
    groups: Vec<Group>,
    /// Reorders the concatenated group outputs into token order; None when already so.
    unperm: Option<Tensor>,
    tokens: usize,
}

impl StepPlan {
    pub fn new(
        rows: &[RowSpan],
        tables: &[&BlockTable],
        block_size: usize,
        rope: &DeviceRope,
        dims: HeadDims,
        device: &Device,
    ) -> Result<Self> {
        let row_width = dims.num_kv_heads * dims.head_dim;
        let tokens: usize = rows.iter().map(|r| r.len).sum();
        let mut pos = Vec::with_capacity(tokens);
        let mut slots = Vec::with_capacity(tokens);
        for (r, t) in rows.iter().zip(tables) {
            for i in 0..r.len {
                pos.push((r.past + i) as u32);
                slots.push(t.slot(r.past + i, block_size) as u32);
            }
        }
        let pos_t = Tensor::new(pos.as_slice(), device)?;
        let cos = rope.cos.index_select(&pos_t, 0)?;
        let sin = rope.sin.index_select(&pos_t, 0)?;
        let write = Tensor::new(slots.as_slice(), device)?
            .reshape((tokens, 1))?
            .broadcast_as((tokens, row_width))?
            .contiguous()?;

        let mut groups = Vec::new();
        let mut order: Vec<usize> = Vec::with_capacity(tokens);
        // Decode rows: one padded group.
        let decode: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].len == 1).collect();
        if !decode.is_empty() {
            let kv_len = decode.iter().map(|&i| rows[i].past + 1).max().unwrap_or(1);
            let mut gather = Vec::with_capacity(decode.len() * kv_len);
            let mut mask = Vec::with_capacity(decode.len() * kv_len);
            let mut padded = false;
            for &i in &decode {
                let n = rows[i].past + 1;
                for j in 0..kv_len {
                    gather.push(tables[i].slot(if j < n { j } else { 0 }, block_size) as u32);
                    mask.push(if j < n { 0f32 } else { f32::NEG_INFINITY });
                }
                padded |= n < kv_len;
            }
            let idx: Vec<u32> = decode.iter().map(|&i| rows[i].start as u32).collect();
            order.extend(decode.iter().map(|&i| rows[i].start));
            let contiguous = idx.windows(2).all(|w| w[1] == w[0] + 1);
            groups.push(Group {
                rows: decode.len(),
                q_len: 1,
                kv_len,
                queries: if contiguous {
                    Span(idx[0] as usize, idx.len())
                } else {
                    Queries::Index(Tensor::new(idx.as_slice(), device)?)
                },
                gather: Tensor::new(gather.as_slice(), device)?,
                mask: if padded {
                    Some(Tensor::from_vec(
                        mask,
                        (decode.len(), 1, 1, 1, kv_len),
                        device,
                    )?)
                } else {
                    None
                },
            });
        }
        // Extend rows: one group each, causal.
        for (i, r) in rows.iter().enumerate().filter(|(_, r)| r.len > 1) {
            order.extend(r.start..r.start + r.len);
            groups.push(extend_group(r, tables[i], block_size, device)?);
        }
        let unperm = if order.iter().enumerate().all(|(i, &t)| i == t) {
            None
        } else {
            let mut inv = vec![0u32; tokens];
            for (i, &t) in order.iter().enumerate() {
                inv[t] = i as u32;
            }
            Some(Tensor::new(inv.as_slice(), device)?)
        };
        Ok(Self {
            cos,
            sin,
            style: rope.style,
            write,
            groups,
            unperm,
            tokens,
        })
    }

    /// Rotate `x`: `[tokens, heads * head_dim]` -> same shape.
    fn rope(&self, x: &Tensor, heads: usize, hd: usize) -> Result<Tensor> {
        let t = self.tokens;
        let y = match self.style {
            RopeStyle::HalfSplit => {
                let x = x.reshape((1, t, heads, hd))?.contiguous()?;
                candle_nn::rotary_emb::rope_thd(&x, &self.cos, &self.sin)?
            }
            RopeStyle::Interleaved => {
                // One "batch" per token, so each token has its own cos/sin row.
                let x = x.reshape((t, heads, 1, hd))?.contiguous()?;
                let cos = self.cos.reshape((t, 1, hd / 2))?;
                let sin = self.sin.reshape((t, 1, hd / 2))?;
                candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
            }
        };
        y.reshape((t, heads * hd))
    }
}

use Queries::Span;

/// Rope q and k, store k/v in the cache, attend. `q`: `[T, heads * hd]`, `k`, `v`:
/// `[T, kv_heads * hd]` in the cache's dtype. Returns `[T, heads * hd]`.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    plan: &StepPlan,
    cache: &TensorKv,
    dims: HeadDims,
) -> Result<Tensor> {
    let HeadDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
    } = dims;
    let dtype = cache.dtype();
    let q = plan.rope(&q.to_dtype(dtype)?, nh, hd)?;
    let k = plan.rope(&k.to_dtype(dtype)?, nkv, hd)?;
    let v = v.to_dtype(dtype)?.contiguous()?;
    cache.k.scatter_set(&plan.write, &k, 0)?;
    cache.v.scatter_set(&plan.write, &v, 0)?;
    let mut outs = Vec::with_capacity(plan.groups.len());
    for g in &plan.groups {
        let qg = match &g.queries {
            Span(start, len) => q.narrow(0, *start, *len)?,
            Queries::Index(idx) => q.index_select(idx, 0)?,
        };
        outs.push(attend_group(&qg, g, cache, dims)?);
    }
    let out = if outs.len() == 1 {
        outs.pop().expect("one group")
    } else {
        Tensor::cat(&outs, 0)?
    };
    match &plan.unperm {
        Some(idx) => out.index_select(idx, 0),
        None => Ok(out),
    }
}

/// One group's attention over K/V already in the cache. `qg`: the group's roped queries
/// `[rows * q_len, heads * hd]`; returns the same shape.
fn attend_group(qg: &Tensor, g: &Group, cache: &TensorKv, dims: HeadDims) -> Result<Tensor> {
    let HeadDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
    } = dims;
    let group = nh / nkv;
    let dtype = cache.dtype();
    let scale = 1.0 / (hd as f64).sqrt();
    let (b, l, n) = (g.rows, g.q_len, g.kv_len);
    // [b*l, nh*hd] -> [b, nkv, group*l, hd]
    let qg = qg
        .reshape((b, l, nkv, group, hd))?
        .permute((0, 2, 3, 1, 4))?
        .contiguous()?
        .reshape((b, nkv, group * l, hd))?;
    // [b*n, nkv*hd] -> K^T [b, nkv, hd, n], V [b, nkv, n, hd]
    let kg = cache
        .k
        .index_select(&g.gather, 0)?
        .reshape((b, n, nkv, hd))?
        .permute((0, 2, 3, 1))?
        .contiguous()?;
    let vg = cache
        .v
        .index_select(&g.gather, 0)?
        .reshape((b, n, nkv, hd))?
        .permute((0, 2, 1, 3))?
        .contiguous()?;
    let scores = (qg.matmul(&kg)?.to_dtype(DType::F32)? * scale)?;
    let scores = match &g.mask {
        Some(m) => scores
            .reshape((b, nkv, group, l, n))?
            .broadcast_add(m)?
            .reshape((b, nkv, group * l, n))?,
        None => scores,
    };
    let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
    // [b, nkv, group*l, hd] -> [b*l, nh*hd]
    p.matmul(&vg)?
        .reshape((b, nkv, group, l, hd))?
        .permute((0, 3, 1, 2, 4))?
        .contiguous()?
        .reshape((b * l, nh * hd))
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// A long extend row attended with batched matmuls (the fused kernel's cost grows with
/// the square of the row length): its K/V must already be in the cache.
pub(crate) struct CachedRow {
    pub start: usize,
    pub len: usize,
    group: Group,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl CachedRow {
    pub(crate) fn new(
        r: &RowSpan,
        table: &BlockTable,
        block_size: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            start: r.start,
            len: r.len,
            group: extend_group(r, table, block_size, device)?,
        })
    }

    /// `q`: all roped queries of the step; returns this row's attention `[len, heads * hd]`.
    pub(crate) fn attend(&self, q: &Tensor, cache: &TensorKv, dims: HeadDims) -> Result<Tensor> {
        attend_group(
            &q.narrow(0, self.start, self.len)?,
            &self.group,
            cache,
            dims,
        )
    }
}

fn extend_group(
    r: &RowSpan,
    table: &BlockTable,
    block_size: usize,
    device: &Device,
) -> Result<Group> {
    let n = r.past + r.len;
    let gather: Vec<u32> = (0..n).map(|j| table.slot(j, block_size) as u32).collect();
    let mut mask = Vec::with_capacity(r.len * n);
    for q in 0..r.len {
        for j in 0..n {
            mask.push(if j <= r.past + q {
                0f32
            } else {
                f32::NEG_INFINITY
            });
        }
    }
    Ok(Group {
        rows: 1,
        q_len: r.len,
        kv_len: n,
        queries: Span(r.start, r.len),
        gather: Tensor::new(gather.as_slice(), device)?,
        mask: Some(Tensor::from_vec(mask, (1, 1, 1, r.len, n), device)?),
    })
}
