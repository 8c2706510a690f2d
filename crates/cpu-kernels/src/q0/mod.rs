//! CPU matmul for Q5_0 and Q8_0 weights (ggml's "type-0" blocks of 32 values and a scale).
//!
//! Small models whose hidden size is not a multiple of 256 (Qwen2.5-0.5B: 896) cannot use
//! k-quants, so their GGUF files store most matrices as Q5_0. candle 0.11 has no SIMD dot
//! product for Q5_0 x Q8_0 (`BlockQ5_0::vec_dot` is the scalar reference loop), which made
//! it half of a decode profile and left prefill at a quarter of llama.cpp's speed.
//!
//! This module computes what llama.cpp's x86 build computes for such weights, bit for bit
//! (its `ggml_vec_dot_q5_0_q8_0`, and its tinyBLAS for batches, which rounds the same way):
//! activations quantized per row as llama.cpp does (`act_quant`); per 32-value block eight
//! i32 lanes of the dot product (lane l: values 4l..4l+4), `acc = fma(d_w * d_x, lanes,
//! acc)` over the blocks in order, and its horizontal sum at the end. Matching its rounding
//! matters: the model quantizes activations again at every layer, so even last-bit
//! differences grow into visibly different logits.
//!
//! Kernels: 256-bit x86 ones (AVX2 + FMA + F16C, optionally AVX-VNNI or AVX512-VNNI for the
//! integer part) when the CPU has them, checked at run time, and a portable scalar loop
//! otherwise. The SIMD kernels take a group of eight weight rows at a time, against a tile of
//! eight activation rows (prefill and batches: Q5_0 block by block over all 64 pairs, Q8_0 one
//! weight row at a time) or against one activation row (decode). Q5_0
//! weights are regrouped at load so that the decode kernel unpacks them in fewer steps
//! (module `layout`); the activations are laid out per kernel (module `lhs`). Work is
//! split over weight rows and activation tiles on candle's own barrier pool, the pool CPU
//! attention already uses.

use candle_core::quantized::k_quants::BlockQ8_0;
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::{par_chunks, par_guided, Bands, Unfilled};
use crate::weight_memory::{WeightBytes, WeightMemory, WeightVec};
use crate::CpuKernel;
use layout::Rows;
use lhs::QuantizedLhs;

mod layout;
mod lhs;

/// Values per block (Q5_0 and Q8_0 alike).
const QK: usize = 32;
/// Bytes of one Q5_0 block: f16 scale, 32 high bits, 16 bytes of low nibbles.
const Q5_BYTES: usize = 22;

/// The weight blocks multiplied here: 32 values and an f16 scale each, against Q8_0
/// activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Q5_0,
    Q8_0,
}

impl Format {
    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q5_0 => Q5_BYTES,
            Format::Q8_0 => Q8_BYTES,
        }
    }

    fn dtype(self) -> GgmlDType {
        match self {
            Format::Q5_0 => GgmlDType::Q5_0,
            Format::Q8_0 => GgmlDType::Q8_0,
        }
    }

    /// Weight `v` (0..32) of GGUF block `wb`.
    #[cfg(test)]
    fn value(self, wb: &[u8], v: usize) -> i32 {
        match self {
            Format::Q8_0 => wb[2 + v] as i8 as i32,
            Format::Q5_0 => {
                let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
                let nib = if v < QK / 2 {
                    wb[6 + v] & 0x0f
                } else {
                    wb[6 + v - QK / 2] >> 4
                };
                (nib as i32 | ((((qh >> v) & 1) as i32) << 4)) - 16
            }
        }
    }
}
/// Bytes of one Q8_0 block: f16 scale, 32 signed bytes.
const Q8_BYTES: usize = 34;
/// Rows computed together: activation rows per prefill tile, weight rows per work item.
const TILE: usize = 8;

// The activation blocks are read as bytes: `BlockQ8_0` is `#[repr(C)] { d: f16, qs: [i8; 32] }`,
// the ggml layout, with no padding.
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == Q8_BYTES);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() <= 2);

/// Which dot-product kernel runs. The x86 kernels share one code path and differ only in
/// the instruction that forms the per-block integer dot product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable loop, the same arithmetic as candle's reference `vec_dot`.
    Scalar,
    /// 256-bit integer kernel (AVX2, FMA, F16C): `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// As [`Kernel::Avx2`] with the VEX `vpdpbusd` of AVX-VNNI.
    AvxVnni,
    /// As [`Kernel::Avx2`] with the 256-bit EVEX `vpdpbusd` of AVX512-VNNI (+VL).
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        if pairs_kernel_available() {
            // Its batches run on the 512-bit two-rows-at-once kernel.
            return Kernel::Avx512Vnni;
        }
        [Kernel::AvxVnni, Kernel::Avx512Vnni, Kernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Scalar)
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let base = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Kernel::Scalar => true,
                Kernel::Avx2 => base,
                Kernel::AvxVnni => base && is_x86_feature_detected!("avxvnni"),
                Kernel::Avx512Vnni => {
                    base && is_x86_feature_detected!("avx512vnni")
                        && is_x86_feature_detected!("avx512vl")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Kernel::Scalar
        }
    }
}

/// A Q5_0 or Q8_0 weight `[n, k]` on the CPU, multiplied by our kernels.
#[derive(Clone)]
pub struct Q0Matmul {
    /// The weight's bytes as the kernels read them: Q8_0 rows as in the file, Q5_0 rows
    /// regrouped ([`layout::pack_q5_0`]).
    w: WeightBytes,
    memory: WeightMemory,
    n: usize,
    k: usize,
    kernel: Kernel,
    format: Format,
}

impl std::fmt::Debug for Q0Matmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Q0Matmul({:?} [{}, {}], {:?})",
            self.format, self.n, self.k, self.kernel
        )
    }
}

impl Q0Matmul {
    /// Takes over `w` when it is a Q5_0 or Q8_0 matrix on the CPU; `None` leaves it to candle.
    /// `choice` (`KernelOptions::cpu_q5`) may turn this path off or force a kernel (for A/B
    /// measurements).
    pub fn new(w: &QMatMul, choice: CpuKernel, memory: WeightMemory) -> Option<Self> {
        let kernel = choice.pick(Kernel::Scalar, Kernel::Avx2, Kernel::detect(), true)?;
        Self::with_kernel_in(w, kernel, memory)
    }

    /// As [`Q0Matmul::new`] with a chosen kernel (`None` if this CPU cannot run it).
    pub fn with_kernel(w: &QMatMul, kernel: Kernel) -> Option<Self> {
        Self::with_kernel_in(w, kernel, WeightMemory::default())
    }

    fn with_kernel_in(w: &QMatMul, kernel: Kernel, memory: WeightMemory) -> Option<Self> {
        let (format, (t, n, k)) = [Format::Q5_0, Format::Q8_0]
            .into_iter()
            .find_map(|f| Some((f, super::cpu_matrix(w, f.dtype(), QK, f.block_bytes())?)))?;
        if !kernel.available() {
            return None;
        }
        let w = match format {
            Format::Q8_0 => WeightBytes::new(t, memory)?,
            Format::Q5_0 => WeightBytes::own(WeightVec::from_slice(
                &layout::pack_q5_0(&t.data().ok()?, n, k / QK),
                memory,
            )),
        };
        Some(Self {
            w,
            memory,
            n,
            k,
            kernel,
            format,
        })
    }

    #[cfg(test)]
    pub(crate) fn weight_is_mapped(&self) -> bool {
        self.w.is_mapped()
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// `parts` stacked into one weight (see `CpuMatmul::fuse`): one format and kernel.
    pub fn fuse(parts: &[&Q0Matmul]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.kernel != first.kernel || p.format != first.format || p.k != first.k)
        {
            return None;
        }
        let (kb, n) = (first.k / QK, parts.iter().map(|p| p.n).sum());
        let memory = first.memory;
        let ws: Vec<&WeightBytes> = parts.iter().map(|p| &p.w).collect();
        let w = match first.format {
            // Rows as in the file, and parts of whole groups (q/k/v, gate/up), concatenate
            // as they are.
            Format::Q8_0 => WeightBytes::concat(&ws, memory)?,
            Format::Q5_0 if parts[..parts.len() - 1].iter().all(|p| p.n % TILE == 0) => {
                WeightBytes::concat(&ws, memory)?
            }
            // Otherwise a part's short last group would sit inside: back to the file's
            // rows, stacked, grouped again.
            Format::Q5_0 => {
                let mut rows = Vec::new();
                for p in parts {
                    rows.extend(layout::unpack_q5_0(&p.w.bytes().ok()?, p.n, kb));
                }
                WeightBytes::own(WeightVec::from_slice(
                    &layout::pack_q5_0(&rows, n, kb),
                    memory,
                ))
            }
        };
        Some(Self {
            w,
            memory,
            n,
            k: first.k,
            kernel: first.kernel,
            format: first.format,
        })
    }

    /// `x @ w^T` for `x` of shape `[.., k]`: `[.., n]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        super::on_cpu_f32("q5_0 matmul", x, |x| x.contiguous()?.apply_op1_no_bwd(self))
    }
}

impl CustomOp1 for Q0Matmul {
    fn name(&self) -> &'static str {
        "q5_0-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, shape) = super::matmul_io("q5_0 matmul", storage, layout, self.k, self.n)?;
        let out = matmul(
            self.kernel,
            self.format,
            &self.w.bytes()?,
            self.n,
            self.k,
            x,
        )?;
        Ok((CpuStorage::F32(out), shape))
    }
}

/// Whether this CPU runs the 512-bit two-rows-at-once kernel (`x86::dot_acts_pairs`), which
/// the `Avx512Vnni` kernel uses for batches.
fn pairs_kernel_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
                && Kernel::Avx2.available()
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Activation rows `start..start + rows` (at most [`TILE`]; `start` a multiple of it).
/// A tile of several rows runs one weight row at a time against all of them, padded to
/// eight; a tile of one row runs eight weight rows at a time against it instead.
#[derive(Clone, Copy, Debug)]
struct Tile {
    start: usize,
    rows: usize,
}

fn tiles(m: usize) -> Vec<Tile> {
    (0..m.div_ceil(TILE))
        .map(|t| Tile {
            start: t * TILE,
            rows: TILE.min(m - t * TILE),
        })
        .collect()
}

/// `x[m, k] @ w^T` (`[m, n]`) for a weight of `n` rows of `k / 32` blocks stored as
/// [`layout`] says (Q8_0: GGUF rows; Q5_0: grouped).
fn matmul(
    kernel: Kernel,
    format: Format,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
) -> candle_core::Result<Vec<f32>> {
    if k == 0 || !k.is_multiple_of(QK) {
        candle_core::bail!("q5_0 matmul: k = {k} is not a positive multiple of {QK}");
    }
    let kb = k / QK;
    let m = x.len() / k;
    if w.len() != layout::stored_len(format, n, kb) || x.len() != m * k {
        candle_core::bail!(
            "q5_0 matmul: sizes do not match: w {} bytes for [{n}, {k}], x {}",
            w.len(),
            x.len(),
        );
    }
    if !kernel.available() {
        candle_core::bail!("q5_0 matmul: this CPU cannot run the {kernel:?} kernel");
    }
    if m == 0 || n == 0 {
        return Ok(Vec::new());
    }
    let lhs = QuantizedLhs::new(x, m, k, kernel);
    let tiles = tiles(m);
    let nt = tiles.len();
    let groups = n.div_ceil(TILE);
    // Weight groups in bands that stay in L2 (`q0 speed`, 512 rows, best of three alternating
    // runs: [4864x896] AVX2 35.2 -> 32.2 ms, AVX-512 26.7 -> 24.6; [896x4864] 37.5 -> 34.7).
    let bands = Bands::new(groups, nt, TILE * kb * format.block_bytes());
    // One tile: each thread reads its run of groups once, front to back (`par_guided`), from
    // DRAM for a large weight. Several: the bands keep groups in L2 for every tile, and
    // asking for the group after one costs (`q0 speed_batches`, 128 and 512 rows: 1-7%).
    let read_once = nt == 1;
    let mut out = Unfilled::new(m * n);
    let out_ptr = out.ptr();
    let run = |items: std::ops::Range<usize>| {
        for item in items {
            let (g, tile) = bands.at(item);
            let tile = tiles[tile];
            let wrows = g * TILE..n.min((g + 1) * TILE);
            let rows = Rows::group(format, n, kb, g);
            // SAFETY (writes below): element (row, wr) belongs to this item alone (items
            // partition the (weight group, tile) grid) and `out` outlives the pool call.
            if tile.rows == 1 {
                let dots = dot_weights(kernel, format, w, &rows, &lhs, tile.start);
                for (wr, d) in wrows.zip(dots) {
                    unsafe { *out_ptr.get().add(tile.start * n + wr) = d };
                }
            } else {
                let mut dots = [[0f32; TILE]; TILE];
                let count = wrows.len();
                let ws = (w, &rows, count);
                dot_acts(kernel, format, ws, read_once, &lhs, tile, &mut dots);
                for (i, row) in dots.iter().take(tile.rows).enumerate() {
                    let at = (tile.start + i) * n + wrows.start;
                    // A whole group's eight outputs of a row in one 32-byte store: written
                    // one value at a time, the 64 stores of an item filled the store buffer
                    // while they waited on an output too large for the cache (the 0.5B's
                    // logits, 8 x 151936).
                    if count == TILE {
                        unsafe { std::ptr::write_unaligned(out_ptr.get().add(at).cast(), *row) };
                    } else {
                        for (wi, d) in row.iter().take(count).enumerate() {
                            unsafe { *out_ptr.get().add(at + wi) = *d };
                        }
                    }
                }
            }
        }
    };
    if nt == 1 && m > 1 {
        par_guided(groups, 1, m * n * kb, run);
    } else {
        par_chunks(groups * nt, m * n * kb, run);
    }
    // SAFETY: the items partition the (weight group, tile) grid, and each writes its tile's
    // rows' outputs for all its group's weight rows: every element.
    Ok(unsafe { out.filled() })
}

/// The first `count` of a group's weight rows: the stored weight, where the rows are.
type WeightRows<'a> = (&'a [u8], &'a Rows, usize);

/// An x86 `dot_acts`: weight rows, whether to ask for the next group's, eight activation
/// rows, their interleaved scales, and the outputs per weight row.
#[cfg(target_arch = "x86_64")]
type ActsKernel =
    unsafe fn(Format, WeightRows, bool, &[[u8; 64]], &[f32], &mut [[f32; TILE]; TILE]);
/// An x86 `dot_weights`: eight weight rows, then one row's blocks, lane sums and scales.
#[cfg(target_arch = "x86_64")]
type WeightsKernel = unsafe fn(Format, &[u8], &Rows, &[u8], &[i32], &[f32]) -> [f32; TILE];

/// Weight rows `ws` (at most eight) against the (padded) eight rows of a tile: `dots[i][wi]`
/// is activation row i's product with weight row wi. `read_once`: the weight streams by
/// once, group after group (see `matmul`), and the SIMD kernels ask for the next group
/// while they compute this one.
fn dot_acts(
    kernel: Kernel,
    format: Format,
    ws: WeightRows,
    read_once: bool,
    lhs: &QuantizedLhs,
    tile: Tile,
    dots: &mut [[f32; TILE]; TILE],
) {
    let row = |i: usize| tile.start + if i < tile.rows { i } else { 0 };
    #[cfg(target_arch = "x86_64")]
    let x86 = |f: ActsKernel, dots: &mut [[f32; TILE]; TILE]| {
        let Some(lines) = lhs.tile_lines(tile.start) else {
            unreachable!("QuantizedLhs makes the tiles for every SIMD batch without row pairs")
        };
        let scales = lhs.tile_scales(tile.start);
        // SAFETY: `matmul` checked that the CPU runs this kernel; the kernel checks the
        // slice lengths against the weight rows' block count.
        unsafe { f(format, ws, read_once, lines, scales, dots) }
    };
    #[cfg(target_arch = "x86_64")]
    if let (Some((ybias, dpair)), Kernel::Avx512Vnni) = (lhs.tile_pairs(tile.start), kernel) {
        // SAFETY: the pairs are made only when the CPU runs this kernel; it checks lengths.
        unsafe { x86::dot_acts_pairs(format, ws, read_once, ybias, dpair, dots) };
        return;
    }
    match kernel {
        Kernel::Scalar => {
            let (w, rows, count) = ws;
            for (i, dots) in dots.iter_mut().enumerate() {
                let r = row(i);
                for (wi, d) in dots.iter_mut().enumerate().take(count) {
                    *d = dot_scalar(format, (w, rows, wi), lhs.row(r), lhs.row_scales(r));
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86(avx2::dot_acts, dots),
        #[cfg(target_arch = "x86_64")]
        Kernel::AvxVnni => x86(avx_vnni::dot_acts, dots),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => x86(avx512_vnni::dot_acts, dots),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar kernel is available off x86_64"),
    }
}

/// Eight weight rows against activation row `r`.
fn dot_weights(
    kernel: Kernel,
    format: Format,
    w: &[u8],
    rows: &Rows,
    lhs: &QuantizedLhs,
    r: usize,
) -> [f32; TILE] {
    let (q, s) = (lhs.row(r), lhs.row_scales(r));
    // Only a batch's last row runs alone (its sums are the ones kept).
    debug_assert!(kernel == Kernel::Scalar || (r + 1) * lhs.kb == lhs.blocks.len());
    #[cfg(target_arch = "x86_64")]
    let x86 = |f: WeightsKernel| {
        // SAFETY: as in `dot_acts`.
        unsafe { f(format, w, rows, q, lhs.last_row_sums16(), s) }
    };
    match kernel {
        Kernel::Scalar => std::array::from_fn(|i| dot_scalar(format, (w, rows, i), q, s)),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86(avx2::dot_weights),
        #[cfg(target_arch = "x86_64")]
        Kernel::AvxVnni => x86(avx_vnni::dot_weights),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => x86(avx512_vnni::dot_weights),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar kernel is available off x86_64"),
    }
}

/// Weight row `i` of a group against one activation row as llama.cpp's AVX2
/// `ggml_vec_dot_q5_0_q8_0`: per block eight i32 lanes (lane l: values 4l..4l+4),
/// `acc = fma(d_w * d_x, lanes, acc)`, and `((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 +
/// a3))` at the end.
fn dot_scalar(format: Format, (w, rows, i): WeightRows, q: &[u8], scales: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, (qb, &dy)) in q.chunks_exact(Q8_BYTES).zip(scales).enumerate() {
        let y = &qb[2..34];
        let mut lanes = [0i32; 8];
        for (v, x) in rows.values(format, w, i, b).into_iter().enumerate() {
            lanes[v / 4] += x * (y[v] as i8) as i32;
        }
        let d = rows.scale(w, i, b) * dy;
        for (a, &l) in acc.iter_mut().zip(&lanes) {
            *a = d.mul_add(l as f32, *a);
        }
    }
    let r: [f32; 4] = std::array::from_fn(|i| acc[i + 4] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86::{avx2, avx512_vnni, avx_vnni};

#[cfg(test)]
mod tests;
