//! Launchers for our fused bf16 CUDA kernels (kernels/fused.cu with attention.cuh and
//! gemv.cuh, compiled to PTX by build.rs).
//! Each kernel is a candle custom op, so its output is an ordinary tensor on candle's stream
//! and allocator; tensors a kernel reads besides its inputs (KV cache, step metadata, norm
//! weights) are passed as raw device pointers taken from tensors the caller keeps alive.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, DevicePtr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

pub use crate::cuda::attention::{
    attention_splits, head_dim_supported, AttentionKernel, PagedAttention, ATTN_COUNTERS,
    MAX_ATTENTION_SPLITS,
};

pub(crate) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
pub(crate) const MODULE: &str = "tokenrouter_fused";

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

pub(crate) fn slice_ptr(cs: &CudaStorage, layout: &Layout) -> Result<u64> {
    let stream = cs.device.cuda_stream();
    let base = match cs.dtype() {
        DType::BF16 => cs.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        DType::U8 => cs.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
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
/// 9.0 and later (where kernels/fused.cu's `pdl_begin` exists), unless the stepping model's
/// `KernelOptions::pdl` is off.
/// Each kernel then starts while the previous one finishes (its blocks wait inside for the
/// previous kernel's writes), so the launch gap and a matmul's weight prefetch overlap the
/// previous kernel instead of following it.
pub fn pdl_enabled(dev: &CudaDevice) -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::kernel_options::KernelOptions::current().pdl
        && *SUPPORTED.get_or_init(|| {
            dev.cuda_stream()
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
    crate::cuda::profile::mark(dev, name)?;
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
        $crate::cuda::kernels::launch_kernel($dev, $name, $cfg, &mut args)?;
    }};
}
pub(crate) use launch;

/// `CustomOp1` for an op that only runs on CUDA, done by its inherent `cuda` method.
macro_rules! cuda_only_op1 {
    ($ty:ty, $name:literal) => {
        impl candle_core::CustomOp1 for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                _: &candle_core::CpuStorage,
                _: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                $crate::cuda::kernels::cpu_unsupported($name)
            }

            fn cuda_fwd(
                &self,
                s: &candle_core::cuda_backend::CudaStorage,
                l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::cuda_backend::CudaStorage, candle_core::Shape)>
            {
                self.cuda(s, l)
            }
        }
    };
}

pub(crate) use cuda_only_op1;

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
                $crate::cuda::kernels::cpu_unsupported($name)
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
