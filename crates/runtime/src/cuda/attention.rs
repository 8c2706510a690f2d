//! Paged attention on CUDA: the launcher of the first passes (tensor-core, split and tiled
//! kernels in kernels/attention.cuh) and of the split combine, the choice between them, and
//! the context splits.

use crate::cuda::kernels::{alloc_bf16, cuda_only_op1, err, input_ptr, launch};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{Layout, Result, Shape};

/// Must match ATTN_TILE / ATTN_THREADS in attention.cuh.
const ATTN_TILE: usize = 512;
const ATTN_THREADS: u32 = 128;

/// Attention of every token whose `tok_row` is >= 0 over its row's paged cache, split
/// over the context into `splits` chunks (more blocks in flight for small batches).
pub struct PagedAttention {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    pub splits: usize,
    pub k_cache: u64,
    pub v_cache: u64,
    pub block_tables: u64,
    pub tok_row: u64,
    pub pos: u64,
    /// Device address of [`ATTN_COUNTERS`] zeroed u32 counters: the split kernel's last block
    /// per (token, head) then combines the splits itself (0: a combine kernel does).
    pub counters: u64,
    pub kernel: AttentionKernel,
}

/// Counters a [`PagedAttention::counters`] buffer holds (tokens x heads it covers).
pub const ATTN_COUNTERS: usize = 65_536;

/// Which first pass of attention runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The tensor-core kernel where it exists for the heads (`KernelOptions::attention_mma`
    /// off turns it off); otherwise the split kernel for steps of 1-2 tokens (H200: 0.6B
    /// step 1.26 vs 1.40 ms) and tiles from 4 on (the split kernel holds more registers,
    /// fewer blocks resident). `KernelOptions::attention_tiles`: tiles instead of split.
    Auto,
    /// Per-group online softmax with all of a short chunk's K/V loads in flight, one block
    /// per query head.
    Split,
    /// Score tiles with block-wide reductions, one block per query head.
    Tiles,
    /// Grouped-query attention on tensor cores: one block per KV head computes the query
    /// heads that share it (H200, Qwen3-32B step at 32 tokens: 24.1 vs 35.6 ms).
    Mma,
}

/// Steps of up to this many tokens take the split kernel under `AttentionKernel::Auto`.
const SPLIT_KERNEL_MAX_TOKENS: usize = 2;
/// Warps of the tensor-core kernel's block (ATTN_THREADS / 32), merged at its end.
const MMA_WARPS: usize = 4;

/// (query heads per KV head, head size) the tensor-core kernel exists for
/// (kernels/attention.cuh `ATTN_MMA`).
fn mma_kernel_exists(group: usize, hd: usize) -> bool {
    (2..=8).contains(&group) && matches!(hd, 64 | 128)
}

impl AttentionKernel {
    fn split(self, tokens: usize) -> bool {
        match self {
            Self::Split => true,
            Self::Tiles | Self::Mma => false,
            Self::Auto => {
                tokens <= SPLIT_KERNEL_MAX_TOKENS
                    && !crate::kernel_options::KernelOptions::current().attention_tiles
            }
        }
    }

    /// The kernel that runs for these heads: `Auto` becomes `Mma` where that exists (unless
    /// `KernelOptions::attention_mma` is off), and `Mma` falls back to `Auto`'s per-head kernels where it
    /// does not.
    pub fn resolve(self, nh: usize, nkv: usize, hd: usize) -> Self {
        let g = if nkv > 0 && nh.is_multiple_of(nkv) {
            nh / nkv
        } else {
            1
        };
        let mma = mma_kernel_exists(g, hd);
        match self {
            Self::Auto if mma && crate::kernel_options::KernelOptions::current().attention_mma => {
                Self::Mma
            }
            Self::Mma if !mma => Self::Auto,
            k => k,
        }
    }

    /// Query heads one block computes: the group size for the tensor-core kernel, else 1.
    pub fn group(self, nh: usize, nkv: usize, hd: usize) -> usize {
        match self.resolve(nh, nkv, hd) {
            Self::Mma => nh / nkv,
            _ => 1,
        }
    }

    /// Blocks per token and split of the first pass (query heads / group).
    pub fn grid_heads(self, nh: usize, nkv: usize, hd: usize) -> usize {
        nh / self.group(nh, nkv, hd)
    }
}

/// Whether the attention kernels handle this head size (16-byte loads, lanes per key row a
/// power of two within a warp).
pub fn head_dim_supported(hd: usize) -> bool {
    hd.is_multiple_of(8) && (hd / 8).is_power_of_two() && hd / 8 <= 32
}

/// Context splits for `tokens` query tokens of `heads` heads whose longest context is
/// `max_ctx` (None: unknown, as in a CUDA graph): aim at ~2048 blocks, at most 16 splits,
/// no split shorter than the kernel's minimum chunk.
pub fn attention_splits(tokens: usize, heads: usize, max_ctx: Option<usize>) -> usize {
    let want = 2048usize
        .div_ceil((tokens * heads).max(1))
        .clamp(1, MAX_ATTENTION_SPLITS);
    match max_ctx {
        Some(n) => want.min(n.div_ceil(ATTN_CHUNK_MIN)).max(1),
        None => want,
    }
}

/// Most context splits `attention_splits` gives.
pub const MAX_ATTENTION_SPLITS: usize = 16;

/// Must match ATTN_CHUNK_MIN in attention.cuh.
const ATTN_CHUNK_MIN: usize = 64;

cuda_only_op1!(PagedAttention, "paged_attention");

impl PagedAttention {
    /// Input: roped q `[tokens, nh * hd]`; output: attention `[tokens, nh * hd]` (rows of
    /// skipped tokens are left unwritten).
    fn cuda(&self, q: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (nh, hd) = (self.num_heads, self.head_dim);
        let (t, width) = layout.shape().dims2()?;
        if width != nh * hd {
            return Err(err(format!("q width {width}, want {}", nh * hd)));
        }
        let q_p = input_ptr(q, layout, "q")?;
        let dev = &q.device;
        let (out, out_p) = alloc_bf16(dev, t * width)?;
        let parts = self.parts(t);
        // SAFETY: the partial kernel writes every (token, head, split) it is launched for;
        // the combine kernel reads only those of tokens the partial kernel did not skip.
        let part_ml = unsafe { dev.alloc::<f32>(2 * parts.max(1)) }?;
        let part_acc = unsafe { dev.alloc::<f32>((parts * hd).max(1)) }?;
        let stream = dev.cuda_stream();
        let parts_p = (
            part_ml.device_ptr(&stream).0,
            part_acc.device_ptr(&stream).0,
        );
        self.launch_into(dev, q_p, t, out_p, parts_p)?;
        drop((part_ml, part_acc));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((t, width)),
        ))
    }

    /// (token, head, split) partial results of a step of `tokens` tokens: `part_ml` holds 2
    /// and `part_acc` `head_dim` f32 per partial.
    pub(crate) fn parts(&self, tokens: usize) -> usize {
        tokens * self.num_heads * self.splits.max(1)
    }

    /// Both passes on roped q at `q_p` (`[t, nh * hd]`), writing the attention to `out_p`
    /// (same shape) through the partial buffers `(part_ml, part_acc)` (see `parts`).
    pub(crate) fn launch_into(
        &self,
        dev: &CudaDevice,
        q_p: u64,
        t: usize,
        out_p: u64,
        (ml_p, acc_p): (u64, u64),
    ) -> Result<()> {
        let (nh, nkv, hd, splits) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.splits.max(1),
        );
        if !head_dim_supported(hd) || nkv == 0 || !nh.is_multiple_of(nkv) {
            return Err(err(format!("unsupported heads {nh}/{nkv} x {hd}")));
        }
        let resolved = self.kernel.resolve(nh, nkv, hd);
        let key_groups = ATTN_THREADS as usize / (hd / 8);
        let split = resolved.split(t);
        let mma_name;
        let (kernel, smem_floats) = if resolved == AttentionKernel::Mma {
            let group = nh / nkv;
            mma_name = format!("paged_attention_mma_bf16_g{group}_d{hd}");
            (mma_name.as_str(), MMA_WARPS * group * (hd + 2))
        } else if split {
            ("paged_attention_split_bf16", key_groups * (hd + 2))
        } else {
            (
                "paged_attention_partial_bf16",
                2 * ATTN_TILE + 32 + key_groups * hd,
            )
        };
        // Combined in the split kernel when there are counters for every (token, head).
        let in_kernel_combine = split && self.counters != 0 && t * nh <= ATTN_COUNTERS;
        let (counters, combined_out) = if in_kernel_combine {
            (self.counters, out_p)
        } else {
            (0, 0)
        };
        let cfg = LaunchConfig {
            grid_dim: (
                t as u32,
                resolved.grid_heads(nh, nkv, hd) as u32,
                splits as u32,
            ),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: (smem_floats * 4) as u32,
        };
        let scale = 1.0f32 / (hd as f32).sqrt();
        let ints = [
            self.max_blocks as i32,
            nh as i32,
            nkv as i32,
            hd as i32,
            self.block_size as i32,
            splits as i32,
        ];
        launch!(
            dev,
            kernel,
            cfg,
            &q_p,
            &self.k_cache,
            &self.v_cache,
            &self.block_tables,
            &ints[0],
            &self.tok_row,
            &self.pos,
            &ml_p,
            &acc_p,
            &ints[1],
            &ints[2],
            &ints[3],
            &ints[4],
            &scale,
            &ints[5],
            &counters,
            &combined_out
        );
        if in_kernel_combine {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (t as u32, nh as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            "paged_attention_combine_bf16",
            cfg,
            &self.tok_row,
            &ml_p,
            &acc_p,
            &out_p,
            &ints[1],
            &ints[3],
            &ints[5]
        );
        Ok(())
    }
}
