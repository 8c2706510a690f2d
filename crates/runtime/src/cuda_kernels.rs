//! Launchers for our fused bf16 CUDA kernels (kernels/fused.cu with attention.cuh and
//! gemv.cuh, compiled to PTX by build.rs).
//! Each kernel is a candle custom op, so its output is an ordinary tensor on candle's stream
//! and allocator; tensors a kernel reads besides its inputs (KV cache, step metadata, norm
//! weights) are passed as raw device pointers taken from tensors the caller keeps alive.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, DevicePtr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
pub(crate) const MODULE: &str = "tokenrouter_fused";
/// Must match ATTN_TILE / ATTN_THREADS in attention.cuh.
const ATTN_TILE: usize = 512;
const ATTN_THREADS: u32 = 128;

pub(crate) fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("fused CUDA kernel: {msg}"))
}

pub(crate) fn cpu_unsupported(name: &str) -> Result<(CpuStorage, Shape)> {
    Err(err(format!("{name} runs on CUDA only")))
}

/// The device address of a contiguous CUDA tensor's first element (0 for `None`).
pub fn ptr(t: Option<&Tensor>) -> Result<u64> {
    let Some(t) = t else { return Ok(0) };
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        return Err(err("expected a contiguous tensor"));
    }
    let Storage::Cuda(cs) = &*storage else {
        return Err(err("expected a CUDA tensor"));
    };
    slice_ptr(cs, layout)
}

fn slice_ptr(cs: &CudaStorage, layout: &Layout) -> Result<u64> {
    let stream = cs.device.cuda_stream();
    let base = match cs.dtype() {
        DType::BF16 => cs.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        d => return Err(err(format!("unsupported dtype {d:?}"))),
    };
    Ok(base + (layout.start_offset() * cs.dtype().size_in_bytes()) as u64)
}

pub(crate) fn input_ptr(cs: &CudaStorage, layout: &Layout, what: &str) -> Result<u64> {
    if !layout.is_contiguous() || cs.dtype() != DType::BF16 {
        return Err(err(format!("{what} must be contiguous bf16")));
    }
    slice_ptr(cs, layout)
}

pub(crate) fn alloc_bf16(
    dev: &CudaDevice,
    n: usize,
) -> Result<(
    candle_core::cuda_backend::cudarc::driver::CudaSlice<bf16>,
    u64,
)> {
    // SAFETY: every element is written by the kernel that follows.
    let out = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    let p = out.device_ptr(&dev.cuda_stream()).0;
    Ok((out, p))
}

/// Whether our kernels are launched with programmatic dependent launch: compute capability
/// 9.0 and later (where kernels/fused.cu's `pdl_begin` exists), unless `TOKENROUTER_PDL=0`.
/// Each kernel then starts while the previous one finishes (its blocks wait inside for the
/// previous kernel's writes), so the launch gap and a matmul's weight prefetch overlap the
/// previous kernel instead of following it.
pub fn pdl_enabled(dev: &CudaDevice) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TOKENROUTER_PDL").map_or(true, |v| v != "0")
            && dev
                .cuda_stream()
                .context()
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .is_ok_and(|major| major >= 9)
    })
}

/// Launch kernel `name` of our module on the device's stream; `args` point at the kernel's
/// arguments in order (see `launch!`).
pub(crate) fn launch_kernel(
    dev: &CudaDevice,
    name: &str,
    cfg: LaunchConfig,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    crate::cuda_profile::mark(dev, name)?;
    let stream = dev.cuda_stream();
    let fail =
        |e: candle_core::cuda_backend::cudarc::driver::DriverError| err(format!("{name}: {e}"));
    stream.context().bind_to_thread().map_err(fail)?;
    // SAFETY: a zeroed attribute value is valid (plain integers); the field set is the one
    // the attribute id selects.
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: unsafe { std::mem::zeroed() },
    };
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl_enabled(dev)),
    };
    // SAFETY: `args` match the kernel signature in kernels/ (the `launch!` callers); pointers
    // they carry come from live tensors of the sizes the kernels index (checked by the
    // callers); `config` and `attr` outlive the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(fail)
}

/// Launch kernel `$name` of our module on the device's stream with the given arguments
/// (references; they must match the kernel signature in kernels/).
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let mut args: Vec<*mut std::ffi::c_void> =
            vec![$( ($arg) as *const _ as *mut std::ffi::c_void ),*];
        $crate::cuda_kernels::launch_kernel($dev, $name, $cfg, &mut args)?;
    }};
}
pub(crate) use launch;

/// `CustomOp1` for an op that only runs on CUDA, done by its inherent `cuda` method.
macro_rules! cuda_only_op1 {
    ($ty:ty, $name:literal) => {
        impl CustomOp1 for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
                cpu_unsupported($name)
            }

            fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
                self.cuda(s, l)
            }
        }
    };
}

/// `CustomOp2` for an op that only runs on CUDA, done by its inherent `cuda2` method.
macro_rules! cuda_only_op2 {
    ($ty:ty, $name:literal) => {
        impl candle_core::CustomOp2 for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                _: &candle_core::CpuStorage,
                _: &candle_core::Layout,
                _: &candle_core::CpuStorage,
                _: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                $crate::cuda_kernels::cpu_unsupported($name)
            }

            fn cuda_fwd(
                &self,
                a: &candle_core::cuda_backend::CudaStorage,
                al: &candle_core::Layout,
                b: &candle_core::cuda_backend::CudaStorage,
                bl: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, candle_core::Shape)>
            {
                self.cuda2(a, al, b, bl)
            }
        }
    };
}
pub(crate) use cuda_only_op2;

/// Token embeddings `weight[ids[t]]` for `tokens` ids read from device memory.
pub struct EmbedGather {
    pub ids: u64,
    pub tokens: usize,
}

cuda_only_op1!(EmbedGather, "embed_gather");

impl EmbedGather {
    /// Input: the embedding table `[vocab, hidden]`; output `[tokens, hidden]`.
    fn cuda(&self, w: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (_, hidden) = layout.shape().dims2()?;
        let w_p = input_ptr(w, layout, "embedding table")?;
        let dev = &w.device;
        let (out, out_p) = alloc_bf16(dev, self.tokens * hidden)?;
        let cfg = LaunchConfig {
            grid_dim: (self.tokens as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let h_i = hidden as i32;
        launch!(dev, "embed_gather_bf16", cfg, &w_p, &self.ids, &out_p, &h_i);
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((self.tokens, hidden)),
        ))
    }
}

/// Per-head q/k RMSNorm (optional), RoPE, and the K/V store into the paged cache.
pub struct NormRopeStore {
    pub tokens: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub q_norm: u64,
    pub k_norm: u64,
    pub eps: f32,
    pub cos: u64,
    pub sin: u64,
    pub pos: u64,
    pub slots: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub interleaved: bool,
}

cuda_only_op1!(NormRopeStore, "qk_norm_rope_store");

impl NormRopeStore {
    /// Input: the fused qkv projection `[tokens, (nh + 2 nkv) * hd]`; output: roped q.
    fn cuda(&self, qkv: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (nh, nkv, hd, t) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.tokens,
        );
        let width = (nh + 2 * nkv) * hd;
        if layout.shape().dims() != [t, width] {
            return Err(err(format!(
                "qkv shape {:?}, want [{t}, {width}]",
                layout.shape()
            )));
        }
        let base = input_ptr(qkv, layout, "qkv")?;
        let dev = &qkv.device;
        let (out, out_p) = alloc_bf16(dev, t * nh * hd)?;
        self.launch_into(dev, base, out_p)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((t, nh * hd)),
        ))
    }

    /// The kernel on the fused qkv projection at device address `base` (`[tokens, (nh + 2
    /// nkv) * hd]`), writing roped q (`[tokens, nh * hd]`) to `q_out`.
    pub(crate) fn launch_into(&self, dev: &CudaDevice, base: u64, q_out: u64) -> Result<()> {
        let (nh, nkv, hd, t) = (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.tokens,
        );
        let width = (nh + 2 * nkv) * hd;
        let (q, k, v) = (
            base,
            base + (nh * hd * 2) as u64,
            base + ((nh + nkv) * hd * 2) as u64,
        );
        let cfg = LaunchConfig {
            grid_dim: (t as u32, (nh + 2 * nkv) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: ((hd + 32) * 4) as u32,
        };
        let (stride, nh_i, nkv_i, hd_i, inter) = (
            width as i64,
            nh as i32,
            nkv as i32,
            hd as i32,
            self.interleaved as i32,
        );
        launch!(
            dev,
            "qk_norm_rope_store_bf16",
            cfg,
            &q,
            &k,
            &v,
            &stride,
            &self.q_norm,
            &self.k_norm,
            &self.eps,
            &self.cos,
            &self.sin,
            &self.pos,
            &self.slots,
            &q_out,
            &self.k_cache,
            &self.v_cache,
            &nh_i,
            &nkv_i,
            &hd_i,
            &inter
        );
        Ok(())
    }
}

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
    /// The tensor-core kernel where it exists for the heads (`TOKENROUTER_ATTN_MMA=0` turns
    /// it off); otherwise the split kernel for steps of 1-2 tokens (H200: 0.6B step 1.26 vs
    /// 1.40 ms) and tiles from 4 on (the split kernel holds more registers, fewer blocks
    /// resident). `TOKENROUTER_ATTN_TILES=1`: tiles instead of split.
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

fn env_flag(name: &str, cell: &'static std::sync::OnceLock<bool>, default: bool) -> bool {
    *cell.get_or_init(|| std::env::var(name).map_or(default, |v| v == "1"))
}

impl AttentionKernel {
    fn split(self, tokens: usize) -> bool {
        static TILES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        match self {
            Self::Split => true,
            Self::Tiles | Self::Mma => false,
            Self::Auto => {
                tokens <= SPLIT_KERNEL_MAX_TOKENS
                    && !env_flag("TOKENROUTER_ATTN_TILES", &TILES, false)
            }
        }
    }

    /// The kernel that runs for these heads: `Auto` becomes `Mma` where that exists (unless
    /// `TOKENROUTER_ATTN_MMA=0`), and `Mma` falls back to `Auto`'s per-head kernels where it
    /// does not.
    pub fn resolve(self, nh: usize, nkv: usize, hd: usize) -> Self {
        static MMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let g = if nkv > 0 && nh.is_multiple_of(nkv) {
            nh / nkv
        } else {
            1
        };
        let mma = mma_kernel_exists(g, hd);
        match self {
            Self::Auto if mma && env_flag("TOKENROUTER_ATTN_MMA", &MMA, true) => Self::Mma,
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

/// `silu(gate) * up` from the fused `[tokens, 2 * inter]` projection.
pub struct SiluMul;

cuda_only_op1!(SiluMul, "silu_mul");

impl SiluMul {
    fn cuda(&self, gu: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (t, w2) = layout.shape().dims2()?;
        let inter = w2 / 2;
        let gu_p = input_ptr(gu, layout, "gate_up")?;
        let dev = &gu.device;
        let (out, out_p) = alloc_bf16(dev, t * inter)?;
        let total = (t * inter) as u32;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 65_535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t_i, inter_i) = (t as i64, inter as i64);
        launch!(dev, "silu_mul_bf16", cfg, &gu_p, &out_p, &t_i, &inter_i);
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((t, inter)),
        ))
    }
}

/// `x += y` in place (when `y` is given), then `RMSNorm(x) * weight`.
pub struct AddRmsNorm {
    pub weight: u64,
    pub eps: f32,
}

/// Largest hidden size whose row fits the kernel's shared memory (48 KiB).
pub const ADD_RMS_NORM_MAX_HIDDEN: usize = 12_000;

impl AddRmsNorm {
    fn run(&self, x: &CudaStorage, xl: &Layout, y: u64) -> Result<(CudaStorage, Shape)> {
        let (t, hidden) = xl.shape().dims2()?;
        if hidden > ADD_RMS_NORM_MAX_HIDDEN {
            return Err(err(format!("hidden size {hidden} too large")));
        }
        let x_p = input_ptr(x, xl, "x")?;
        let dev = &x.device;
        let (out, out_p) = alloc_bf16(dev, t * hidden)?;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((hidden + 32) * 4) as u32,
        };
        let h_i = hidden as i32;
        launch!(
            dev,
            "add_rms_norm_bf16",
            cfg,
            &x_p,
            &y,
            &self.weight,
            &out_p,
            &h_i,
            &self.eps
        );
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((t, hidden)),
        ))
    }
}

cuda_only_op1!(AddRmsNorm, "rms_norm");

impl AddRmsNorm {
    fn cuda(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        self.run(x, xl, 0)
    }
}

cuda_only_op2!(AddRmsNorm, "add_rms_norm");

impl AddRmsNorm {
    /// Writes `x + y` into `x` (the residual stream), returns the normalised sum.
    fn cuda2(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if xl.shape() != yl.shape() {
            return Err(err("add_rms_norm operands differ in shape"));
        }
        let y_p = input_ptr(y, yl, "y")?;
        self.run(x, xl, y_p)
    }
}
