//! Skinny bf16 matmuls for decode steps of 1-2 rows (a few up to 8 for the plain one), where
//! weights are read once at close to full bandwidth and the step is bound by the number of
//! kernels: the plain `Gemv` (`x W^T`), and variants with the neighbouring small ops folded
//! in — RMSNorm of the residual stream as the input and silu*mul or the bias as the output
//! (`GemvFolded`: qkv, gate_up) and the residual add as the output (`GemvResidual`: o and
//! down projections). Kernels in kernels/gemv.cuh (`gemv_*`).

use crate::cuda::kernels::{alloc_bf16, cuda_only_op2, err, input_ptr, launch, ptr};
use crate::kernel_options::KernelOptions;
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Shape, Tensor};

/// Whether the stepping model's options (`KernelOptions::gemv`) leave the kernel on.
fn gemv_enabled() -> bool {
    KernelOptions::current().gemv
}

/// Whether the fused variants are on (`KernelOptions::fused_gemv`; off for comparison; they
/// need the plain kernel on as well).
pub fn fused_gemv_enabled() -> bool {
    let k = KernelOptions::current();
    k.gemv && k.fused_gemv
}

/// Rows the fused variants take (their kernels exist for 1 and 2).
pub const FUSED_GEMV_MAX_ROWS: usize = 2;
/// Largest input width of the folded norm (its normalised rows live in 48 KiB of shared memory).
pub const GEMV_NORM_MAX_K: usize = 12_000;

/// `x W^T` for decode-sized `x` (1..=8 rows) with dense bf16 `W` `[out, in]`: a
/// bandwidth-bound kernel instead of cuBLAS's GEMM/GEMV choice for skinny shapes.
pub struct Gemv;

/// Whether `Gemv` handles `x` (`[m, k]`) times `w^T` (`w`: `[n, k]`).
pub fn gemv_applies(x: &Tensor, w: &Tensor) -> bool {
    gemv_enabled()
        && x.device().is_cuda()
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && x.rank() == 2
        && w.rank() == 2
        // cuBLAS wins from 3-4 rows on (H200, 2026-11-30: 32B step 30.0 vs 21.7 ms at 4).
        && matches!(x.dim(0), Ok(1..=2))
        && x.dim(1).ok() == w.dim(1).ok()
        && x.dim(1).is_ok_and(|k| k.is_multiple_of(8))
        && x.is_contiguous()
        && w.is_contiguous()
}

cuda_only_op2!(Gemv, "gemv");

impl Gemv {
    fn cuda2(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, k2) = wl.shape().dims2()?;
        if k != k2 || !(1..=8).contains(&m) || !k.is_multiple_of(8) {
            return Err(err(format!("gemv shapes [{m}, {k}] x [{n}, {k2}]^T")));
        }
        let (x_p, w_p) = (input_ptr(x, xl, "x")?, input_ptr(w, wl, "weight")?);
        let dev = &x.device;
        let (out, out_p) = alloc_bf16(dev, m * n)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, k_i) = (n as i32, k as i32);
        let name = format!("gemv_bf16_m{m}");
        launch!(dev, name.as_str(), cfg, &x_p, &w_p, &out_p, &n_i, &k_i);
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((m, n)),
        ))
    }
}

/// What `GemvFolded` does after the matmul.
#[derive(Clone, Copy, Debug)]
pub enum NormOutput {
    /// `[m, n]` projections, plus the bias at device address `bias` (0: none, else `[n]`).
    Bias(u64),
    /// `W` is a fused `[gate | up]` `[2 i, k]`; the output is `silu(gate) * up` `[m, i]`.
    SiluMul,
}

/// `x W^T` then [`NormOutput`], where with `norm` the input is `RMSNorm(x) * norm` computed
/// by every block of the kernel instead of by a kernel of its own (`x`: the residual
/// stream). Operands: `x` `[m, k]` (1-2 rows) and `W`. Without `norm` only `SiluMul` applies.
pub struct GemvFolded {
    /// Device address of the input norm's weight `[k]` (bf16).
    pub norm: Option<u64>,
    pub eps: f32,
    pub output: NormOutput,
}

/// Blocks of 256 threads resident per SM that a column-striding kernel is given.
const BLOCKS_PER_SM: usize = 4;

cuda_only_op2!(GemvFolded, "gemv_folded");

impl GemvFolded {
    fn cuda2(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, k2) = wl.shape().dims2()?;
        if k != k2 {
            return Err(err(format!(
                "gemv_folded shapes [{m}, {k}] x [{n}, {k2}]^T"
            )));
        }
        let (x_p, w_p) = (input_ptr(x, xl, "x")?, input_ptr(w, wl, "weight")?);
        let dev = &x.device;
        let cols = self.cols(n);
        let (out, out_p) = alloc_bf16(dev, m * cols)?;
        self.launch_into(dev, x_p, w_p, out_p, (m, n, k))?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((m, cols)),
        ))
    }

    /// Output columns for a weight of `n` rows.
    pub fn cols(&self, n: usize) -> usize {
        match self.output {
            NormOutput::Bias(_) => n,
            NormOutput::SiluMul => n / 2,
        }
    }

    /// The kernel on `x` at `x_p` (`[m, k]`) and `W` at `w_p` (`[n, k]`), writing `[m,
    /// cols(n)]` to `out_p`.
    pub(crate) fn launch_into(
        &self,
        dev: &CudaDevice,
        x_p: u64,
        w_p: u64,
        out_p: u64,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        let cols = self.cols(n);
        if !(1..=FUSED_GEMV_MAX_ROWS).contains(&m)
            || !k.is_multiple_of(8)
            || (self.norm.is_some() && k > GEMV_NORM_MAX_K)
            || (self.norm.is_none() && !matches!(self.output, NormOutput::SiluMul))
            || (matches!(self.output, NormOutput::SiluMul) && !n.is_multiple_of(2))
        {
            return Err(err(format!("gemv_folded shapes [{m}, {k}] x [{n}, {k}]^T")));
        }
        let mut blocks = cols.div_ceil(8);
        if self.norm.is_some() {
            let sms = dev
                .cuda_stream()
                .context()
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(|e| err(format!("SM count: {e}")))?;
            blocks = blocks.min(BLOCKS_PER_SM * sms.max(1) as usize);
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: if self.norm.is_some() {
                (32 * 4 + m * k * 2) as u32
            } else {
                0
            },
        };
        let (bias, kernel) = match (self.norm, self.output) {
            (Some(_), NormOutput::Bias(b)) => (b, "gemv_norm_bf16"),
            (Some(_), NormOutput::SiluMul) => (0, "gemv_norm_silu_bf16"),
            (None, _) => (0, "gemv_silu_bf16"),
        };
        let norm = self.norm.unwrap_or(0);
        let (cols_i, k_i) = (cols as i32, k as i32);
        let name = format!("{kernel}_m{m}");
        launch!(
            dev,
            name.as_str(),
            cfg,
            &x_p,
            &norm,
            &self.eps,
            &w_p,
            &bias,
            &out_p,
            &cols_i,
            &k_i
        );
        Ok(())
    }
}

/// `resid += x W^T` in place (the o and down projections with the residual add folded in).
/// Destination: the residual stream `[m, n]` (1-2 rows); source: `x` `[m, k]`.
pub struct GemvResidual<'a> {
    /// `[n, k]` bf16.
    pub weight: &'a Tensor,
}

impl InplaceOp2 for GemvResidual<'_> {
    fn name(&self) -> &'static str {
        "gemv_residual"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        Err(err("gemv_residual runs on CUDA only"))
    }

    fn cuda_fwd(
        &self,
        resid: &mut CudaStorage,
        rl: &Layout,
        x: &CudaStorage,
        xl: &Layout,
    ) -> Result<()> {
        let (m, n) = rl.shape().dims2()?;
        let (m2, k) = xl.shape().dims2()?;
        let wdims = self.weight.dims();
        if m != m2 || wdims != [n, k] || self.weight.dtype() != DType::BF16 {
            return Err(err(format!(
                "gemv_residual shapes [{m}, {n}] += [{m2}, {k}] x {wdims:?}^T"
            )));
        }
        let (r_p, x_p, w_p) = (
            input_ptr(resid, rl, "residual")?,
            input_ptr(x, xl, "x")?,
            ptr(Some(self.weight))?,
        );
        gemv_residual(&x.device, r_p, x_p, w_p, (m, n, k))
    }
}

/// `resid += x W^T` on device addresses: `resid` `[m, n]`, `x` `[m, k]`, `W` `[n, k]`.
pub(crate) fn gemv_residual(
    dev: &CudaDevice,
    r_p: u64,
    x_p: u64,
    w_p: u64,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    if !(1..=FUSED_GEMV_MAX_ROWS).contains(&m) || !k.is_multiple_of(8) {
        return Err(err(format!(
            "gemv_residual shapes [{m}, {n}] += [{m}, {k}] x [{n}, {k}]^T"
        )));
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (null, eps, n_i, k_i) = (0u64, 0f32, n as i32, k as i32);
    let name = format!("gemv_resid_bf16_m{m}");
    launch!(
        dev,
        name.as_str(),
        cfg,
        &x_p,
        &null,
        &eps,
        &w_p,
        &null,
        &r_p,
        &n_i,
        &k_i
    );
    Ok(())
}
