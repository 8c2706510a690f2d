//! On-device checks of the fused CUDA kernels, run by `tokenrouter bench-model --check-fused`
//! on the GPU machine (CI has no GPU): the paged-attention kernel against a dense f32
//! reference for random context lengths 1..4096 in mixed decode/extend batches over
//! shuffled cache blocks.

use crate::attention::{HeadDims, RowSpan};
use crate::attention_device::{CachedRow, TensorKv};
use crate::cuda::kernels::{ptr, AttentionKernel, PagedAttention, ATTN_COUNTERS};
use crate::kv::BlockTable;
use candle_core::{DType, Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Outcome of one attention check batch.
#[derive(Debug)]
pub struct AttentionCheck {
    pub heads: HeadDims,
    pub rows: usize,
    pub tokens: usize,
    pub max_context: usize,
    /// Largest |kernel - reference| over all outputs, and the largest |reference|.
    pub max_abs_err: f32,
    pub mean_abs_err: f32,
    pub max_abs_ref: f32,
    /// (first-pass kernel as resolved for these heads, max |diff|).
    pub per_kernel: Vec<(String, f32)>,
}

/// Run `batches` random batches for each head layout; rows have contexts drawn from
/// 1..=4096 and are decode rows (1 query) or extend rows (2..=64 queries).
pub fn check_paged_attention(
    device: &Device,
    seed: u64,
    batches: usize,
) -> Result<Vec<AttentionCheck>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let layouts = [
        HeadDims {
            num_heads: 16,
            num_kv_heads: 8,
            head_dim: 128,
        },
        HeadDims {
            num_heads: 64,
            num_kv_heads: 8,
            head_dim: 128,
        },
        HeadDims {
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
        },
    ];
    let block_size = 16;
    let mut out = Vec::new();
    for dims in layouts {
        for _ in 0..batches {
            out.push(one_batch(device, &mut rng, dims, block_size)?);
        }
    }
    Ok(out)
}

fn one_batch(
    device: &Device,
    rng: &mut StdRng,
    dims: HeadDims,
    block_size: usize,
) -> Result<AttentionCheck> {
    let n_rows = rng.random_range(1..=8usize);
    // (context incl. new tokens, new tokens)
    let mut shape = Vec::new();
    for i in 0..n_rows {
        let ctx = if i == 0 {
            4096
        } else {
            rng.random_range(1..=4096usize)
        };
        let q_len = if rng.random_bool(0.5) {
            1
        } else {
            rng.random_range(2..=64usize).min(ctx)
        };
        shape.push((ctx, q_len));
    }
    let total_blocks: usize = shape.iter().map(|(c, _)| c.div_ceil(block_size)).sum();
    let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
    ids.shuffle(rng);
    let mut tables = Vec::new();
    let mut rows = Vec::new();
    let mut start = 0;
    let mut next = 0;
    for &(ctx, q_len) in &shape {
        let nb = ctx.div_ceil(block_size);
        let mut table = BlockTable::default();
        table.blocks = ids[next..next + nb].to_vec();
        table.len = ctx;
        tables.push(table);
        next += nb;
        rows.push(RowSpan {
            start,
            len: q_len,
            past: ctx - q_len,
        });
        start += q_len;
    }
    let tokens = start;
    let row_w = dims.num_kv_heads * dims.head_dim;
    let slots = total_blocks * block_size;
    let k = Tensor::randn(0f32, 1.0, (slots, row_w), device)?.to_dtype(DType::BF16)?;
    let v = Tensor::randn(0f32, 1.0, (slots, row_w), device)?.to_dtype(DType::BF16)?;
    let q = Tensor::randn(0f32, 1.0, (tokens, dims.num_heads * dims.head_dim), device)?
        .to_dtype(DType::BF16)?;
    let max_blocks = tables.iter().map(|t| t.blocks.len()).max().unwrap_or(1);
    let mut meta = vec![0u32; 2 * tokens + n_rows * max_blocks];
    for (i, r) in rows.iter().enumerate() {
        for j in 0..r.len {
            meta[r.start + j] = (r.past + j) as u32;
            meta[tokens + r.start + j] = i as u32;
        }
        let at = 2 * tokens + i * max_blocks;
        meta[at..at + tables[i].blocks.len()].copy_from_slice(&tables[i].blocks);
    }
    let meta = Tensor::from_vec(meta, 2 * tokens + n_rows * max_blocks, device)?;
    let base = ptr(Some(&meta))?;
    // Every first-pass kernel, the split one with and without its in-kernel combine.
    let counters = Tensor::zeros(ATTN_COUNTERS, DType::U32, device)?;
    let mut got = Vec::new();
    let mut kernels = Vec::new();
    for (kernel, counters) in [
        (AttentionKernel::Split, ptr(Some(&counters))?),
        (AttentionKernel::Split, 0),
        (AttentionKernel::Tiles, 0),
        (AttentionKernel::Mma, 0),
    ] {
        let grid_heads = kernel.grid_heads(dims.num_heads, dims.num_kv_heads, dims.head_dim);
        let resolved = kernel.resolve(dims.num_heads, dims.num_kv_heads, dims.head_dim);
        kernels.push(format!(
            "{resolved:?}{}",
            if counters != 0 { "+combine" } else { "" }
        ));
        got.push(q.apply_op1_no_bwd(&PagedAttention {
            num_heads: dims.num_heads,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
            block_size,
            max_blocks,
            splits: crate::cuda::kernels::attention_splits(tokens, grid_heads, Some(4096)),
            k_cache: ptr(Some(&k))?,
            v_cache: ptr(Some(&v))?,
            block_tables: base + (8 * tokens) as u64,
            tok_row: base + (4 * tokens) as u64,
            pos: base,
            counters,
            kernel,
        })?);
    }
    // Reference: the matmul path in f32 over the same (bf16-valued) inputs.
    let cache = TensorKv {
        k: k.to_dtype(DType::F32)?,
        v: v.to_dtype(DType::F32)?,
    };
    let qf = q.to_dtype(DType::F32)?;
    let mut want = Vec::new();
    for (r, t) in rows.iter().zip(&tables) {
        want.push(CachedRow::new(r, t, block_size, device)?.attend(&qf, &cache, dims)?);
    }
    let want = Tensor::cat(&want, 0)?;
    let mut diffs = Vec::new();
    let mut per_kernel = Vec::new();
    for (g, name) in got.iter().zip(kernels) {
        let d = (g.to_dtype(DType::F32)? - &want)?.abs()?;
        per_kernel.push((name, d.max_all()?.to_scalar::<f32>()?));
        diffs.push(d);
    }
    let diff = Tensor::stack(&diffs, 0)?;
    Ok(AttentionCheck {
        heads: dims,
        rows: n_rows,
        tokens,
        max_context: shape.iter().map(|s| s.0).max().unwrap_or(0),
        max_abs_err: diff.max_all()?.to_scalar::<f32>()?,
        mean_abs_err: diff.mean_all()?.to_scalar::<f32>()?,
        max_abs_ref: want.abs()?.max_all()?.to_scalar::<f32>()?,
        per_kernel,
    })
}

/// The skinny matmul kernel against candle's matmul in f32, for decode-sized inputs:
/// `(rows, out, in, max |diff| / max |reference|)`.
pub fn check_gemv(device: &Device) -> Result<Vec<(usize, usize, usize, f32)>> {
    use crate::cuda::gemv::Gemv;
    let mut out = Vec::new();
    let rel_err = |got: Tensor, x: &Tensor, w: &Tensor| -> Result<f32> {
        let want = x
            .to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?)?;
        let err = (got.to_dtype(DType::F32)? - &want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(err / scale.max(1e-6))
    };
    for (n, k) in [(9216, 5120), (1024, 3072), (151_936, 1024)] {
        let w = Tensor::randn(0f32, 0.02, (n, k), device)?.to_dtype(DType::BF16)?;
        for m in [1usize, 3, 8] {
            let x = Tensor::randn(0f32, 1.0, (m, k), device)?.to_dtype(DType::BF16)?;
            let got = x.apply_op2_no_bwd(&w, &Gemv)?;
            out.push((m, n, k, rel_err(got, &x, &w)?));
        }
    }
    Ok(out)
}

/// The step's on-device entropy and top logits (`StepOutput::entropy_rows`,
/// `top_logits_rows`) against the host definitions on the same f32 logits (a Qwen-sized row
/// of 151936 logits, 151665 of them real): (max |entropy diff|, top-k mismatches).
pub fn check_router_inputs(device: &Device) -> Result<(f32, usize)> {
    use crate::runner::StepOutput;
    use crate::sampling::{entropy, top_k_indices};
    let (vocab, limit, k) = (151_936usize, 151_665usize, 100usize);
    let logits = Tensor::randn(0f32, 3.0, (8, vocab), device)?;
    let out = StepOutput {
        logits,
        hidden: None,
    };
    let msg = |e: crate::RuntimeError| candle_core::Error::Msg(e.to_string());
    let ent = out.entropy_rows(limit).map_err(msg)?;
    let top = out.top_logits_rows(limit, k).map_err(msg)?;
    let (mut worst, mut mismatches) = (0f32, 0usize);
    for ((h, t), row) in ent.iter().zip(&top).zip(out.logits_rows().map_err(msg)?) {
        let want = entropy(&row[..limit]) / (limit as f32).ln();
        worst = worst.max((h - want).abs());
        let want_top: Vec<f32> = top_k_indices(&row[..limit], k)
            .into_iter()
            .map(|i| row[i as usize])
            .collect();
        mismatches += t.iter().zip(&want_top).filter(|(a, b)| a != b).count()
            + want_top.len().abs_diff(t.len());
    }
    Ok((worst, mismatches))
}

/// Greedy picks under token masks on the device (bits unpacked by `runner::unpack_bits`,
/// then `StepOutput::greedy_rows_allowed`: the path of greedy structured output) against the host's argmax over the same allowed ids and
/// its log-probability over the whole row: (wrong picks, max |log-prob diff|).
pub fn check_masked_greedy(device: &Device) -> Result<(usize, f32)> {
    use crate::runner::StepOutput;
    let (vocab, limit) = (151_936usize, 151_665usize);
    let rows = 8;
    let logits = Tensor::randn(0f32, 3.0, (rows, vocab), device)?;
    // Row r allows every (r + 2)-th id (row 0: one id in two), the last row a single id.
    let flags: Vec<u8> = (0..rows * limit)
        .map(|i| {
            let (r, t) = (i / limit, i % limit);
            let keep = if r == rows - 1 {
                t == 4242
            } else {
                t % (r + 2) == 1
            };
            keep as u8
        })
        .collect();
    // Uploaded as bits and unpacked on the device, as the engine does.
    let row_bytes = limit.div_ceil(8);
    let mut bits = vec![0u8; rows * row_bytes];
    for (i, _) in flags.iter().enumerate().filter(|(_, &f)| f == 1) {
        let (r, t) = (i / limit, i % limit);
        bits[r * row_bytes + t / 8] |= 1 << (t % 8);
    }
    let bits = Tensor::from_vec(bits, (rows, row_bytes), device)?;
    let allowed = crate::runner::unpack_bits(&bits, limit)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let out = StepOutput {
        logits,
        hidden: None,
    };
    let msg = |e: crate::RuntimeError| candle_core::Error::Msg(e.to_string());
    let got = out
        .greedy_rows_allowed(limit, Some(&allowed))
        .map_err(msg)?;
    let (mut wrong, mut worst) = (0usize, 0f32);
    for (r, (row, (token, logprob))) in out.logits_rows().map_err(msg)?.iter().zip(got).enumerate()
    {
        let row = &row[..limit];
        let best = (0..limit)
            .filter(|&t| flags[r * limit + t] == 1)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap_or(0);
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
        wrong += (token as usize != best) as usize;
        worst = worst.max((logprob - (row[best] - lse)).abs());
    }
    Ok((wrong, worst))
}

/// The skinny matmuls with folded-in ops (`cuda::gemv`) against the separate kernels they
/// replace, same inputs: `(what, rows, max |diff| / max |reference|)`. The arithmetic is the
/// same, so differences are at most one bf16 rounding step. Also the RMSNorm kernel against
/// candle's f32 `rms_norm` (what starts with "rms_norm"; bf16 output rounding).
pub fn check_fused_gemv(device: &Device) -> Result<Vec<(String, usize, f32)>> {
    let mut out = Vec::new();
    // A narrow row (one 16-byte chunk per thread at most) and a wide one (several).
    for (hidden, inter) in [(1024usize, 3072usize), (5120, 8192)] {
        out.extend(check_fused_gemv_width(device, hidden, inter)?);
    }
    Ok(out)
}

fn check_fused_gemv_width(
    device: &Device,
    hidden: usize,
    inter: usize,
) -> Result<Vec<(String, usize, f32)>> {
    use crate::cuda::gemv::{Gemv, GemvFolded, GemvResidual, NormOutput};
    use crate::cuda::kernels::{AddRmsNorm, SiluMul};
    let rel = |got: &Tensor, want: &Tensor| -> Result<f32> {
        let (got, want) = (got.to_dtype(DType::F32)?, want.to_dtype(DType::F32)?);
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok(err / scale.max(1e-6))
    };
    let bf16 = |t: Tensor| t.to_dtype(DType::BF16);
    let eps = 1e-6f32;
    let norm_w = bf16(Tensor::randn(1f32, 0.1, hidden, device)?)?;
    let w_qkv = bf16(Tensor::randn(0f32, 0.03, (4096, hidden), device)?)?;
    let b_qkv = bf16(Tensor::randn(0f32, 0.5, 4096, device)?)?;
    let w_gu = bf16(Tensor::randn(0f32, 0.03, (2 * inter, hidden), device)?)?;
    let w_down = bf16(Tensor::randn(0f32, 0.03, (hidden, inter), device)?)?;
    let mut out = Vec::new();
    for m in [1usize, 2] {
        let resid = bf16(Tensor::randn(0f32, 1.0, (m, hidden), device)?)?;
        let normed = resid.apply_op1_no_bwd(&AddRmsNorm {
            weight: ptr(Some(&norm_w))?,
            eps,
        })?;
        // The norm kernel itself against candle's f32 RMSNorm (bf16 rounding apart).
        let want = candle_nn::ops::rms_norm(
            &resid.to_dtype(DType::F32)?,
            &norm_w.to_dtype(DType::F32)?,
            eps,
        )?;
        out.push((
            format!("rms_norm vs candle f32, hidden {hidden}"),
            m,
            rel(&normed, &want)?,
        ));
        let want = normed
            .apply_op2_no_bwd(&w_qkv, &Gemv)?
            .broadcast_add(&b_qkv)?;
        let got = resid.apply_op2_no_bwd(
            &w_qkv,
            &GemvFolded {
                norm: Some(ptr(Some(&norm_w))?),
                eps,
                output: NormOutput::Bias(ptr(Some(&b_qkv))?),
            },
        )?;
        out.push((
            format!("norm + matmul + bias, hidden {hidden}"),
            m,
            rel(&got, &want)?,
        ));
        let want = normed
            .apply_op2_no_bwd(&w_gu, &Gemv)?
            .apply_op1_no_bwd(&SiluMul)?;
        let got = resid.apply_op2_no_bwd(
            &w_gu,
            &GemvFolded {
                norm: Some(ptr(Some(&norm_w))?),
                eps,
                output: NormOutput::SiluMul,
            },
        )?;
        out.push((
            format!("norm + gate_up + silu*mul, hidden {hidden}"),
            m,
            rel(&got, &want)?,
        ));
        let got = normed.apply_op2_no_bwd(
            &w_gu,
            &GemvFolded {
                norm: None,
                eps,
                output: NormOutput::SiluMul,
            },
        )?;
        out.push((
            format!("gate_up + silu*mul, hidden {hidden}"),
            m,
            rel(&got, &want)?,
        ));
        let act = bf16(Tensor::randn(0f32, 1.0, (m, inter), device)?)?;
        let want = (resid.to_dtype(DType::F32)?
            + act.apply_op2_no_bwd(&w_down, &Gemv)?.to_dtype(DType::F32)?)?;
        let got = resid.copy()?;
        got.inplace_op2(&act, &GemvResidual { weight: &w_down })?;
        out.push((
            format!("matmul + residual add, hidden {hidden}"),
            m,
            rel(&got, &bf16(want)?)?,
        ));
    }
    Ok(out)
}
