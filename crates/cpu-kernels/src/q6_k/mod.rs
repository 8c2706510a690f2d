//! CPU matrix-vector product for Q6_K weights (single-row decode steps).
//!
//! For one activation row candle 0.11 multiplies Q6_K weights with its AVX2 `vec_dot_q6k_q8k`,
//! one weight row at a time: in a decode profile of Qwen2.5-1.5B Q4_K_M (Q6_K output matrix
//! and half of the `ffn_down` / `attn_v` matrices) that was half of the time. Ours takes eight
//! weight rows at a time, each read front to back (512-bit integer steps, or candle's own
//! 256-bit ones on AVX2-only CPUs and for one or two rows; up to eight activation rows share
//! each unpacked weight block), with the arithmetic of llama.cpp's AVX2
//! `ggml_vec_dot_q6_K_q8_K` exactly: per row, eight i32 lanes (lane `l` sums positions
//! `4l..4l + 4` of every 32-value chunk, scaled: `sc * q * y` with the stored `q = w + 32`,
//! minus `32 * sc * bsum` of the 16-value groups `2l, 2l + 1`), then per block `acc =
//! fma(d_x * d_w, lanes, acc)`, and the horizontal sum `((a4 + a0) + (a6 + a2)) + ((a5 +
//! a1) + (a7 + a3))` at the end.
//!
//! Several activation rows go through the same kernel one row at a time, so every row gets
//! the arithmetic it gets alone (candle's repacked tiles for several rows round otherwise).
//! Rows of sequences of eight and more round like llama.cpp's tiled kernel (one exact integer
//! sum per block); when a call has at least `tiled::MIN_ROWS` of them they go through
//! weights unpacked once into 16-row tiles (`tiled.rs`), three times faster in a prefill.

use candle_core::quantized::k_quants::BlockQ8K;
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::{par_chunks, par_guided, Unfilled};
use crate::weight_memory::{WeightBytes, WeightMemory};
use crate::CpuKernel;

/// Values per super-block.
const QK_K: usize = 256;
/// Bytes of one Q6_K block: 128 of low nibbles, 64 of high bit pairs, 16 i8 scales, f16 d.
const Q6K_BYTES: usize = 210;
const Q6K_QH: usize = 128;
const Q6K_SCALES: usize = 192;
const Q6K_D: usize = 208;
/// Bytes of one Q8_K block: f32 d, 256 i8, 16 i16 sums.
const Q8K_BYTES: usize = 292;
/// Offset of the 16-value sums (i16) in a Q8_K block.
const Q8K_BSUMS: usize = 260;
/// Weight rows per work item.
const ROWS: usize = 8;

const _: () = assert!(std::mem::size_of::<BlockQ8K>() == Q8K_BYTES);

/// Which kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable loop with llama.cpp's arithmetic.
    Scalar,
    /// 256-bit kernel (AVX2 + FMA + F16C).
    Avx2,
    /// 512-bit kernel (AVX512F + BW + VNNI).
    Avx512Vnni,
}

impl Kernel {
    pub fn detect() -> Self {
        [Kernel::Avx512Vnni, Kernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Scalar)
    }

    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("fma")
                    // Few rows run on the 256-bit kernel.
                    && Kernel::Avx2.available()
            }
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2 | Kernel::Avx512Vnni => false,
        }
    }
}

/// A Q6_K weight `[n, k]` on the CPU; single activation rows run on our kernels.
#[derive(Clone)]
pub struct Q6kMatmul {
    /// The GGUF blocks, `n` rows of `k / 256`.
    w: WeightBytes,
    n: usize,
    k: usize,
    kernel: Kernel,
    memory: WeightMemory,
}

impl std::fmt::Debug for Q6kMatmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q6kMatmul([{}, {}], {:?})", self.n, self.k, self.kernel)
    }
}

impl Q6kMatmul {
    /// Takes over `w` when it is a Q6_K matrix on the CPU; `None` leaves it to candle.
    /// `choice` (`KernelOptions::cpu_qk`) may turn this path off or force a kernel. Without
    /// a SIMD kernel for this CPU candle keeps the weight.
    pub fn new(w: &QMatMul, choice: CpuKernel, memory: WeightMemory) -> Option<Self> {
        let kernel = choice.pick(Kernel::Scalar, Kernel::Avx2, Kernel::detect(), false)?;
        Self::with_kernel_in(w, kernel, memory)
    }

    /// As [`Q6kMatmul::new`] with a chosen kernel (`None` if this CPU cannot run it).
    pub fn with_kernel(w: &QMatMul, kernel: Kernel) -> Option<Self> {
        Self::with_kernel_in(w, kernel, WeightMemory::default())
    }

    fn with_kernel_in(w: &QMatMul, kernel: Kernel, memory: WeightMemory) -> Option<Self> {
        let (t, n, k) = super::cpu_matrix(w, GgmlDType::Q6K, QK_K, Q6K_BYTES)?;
        if !kernel.available() {
            return None;
        }
        Some(Self {
            w: WeightBytes::new(t, memory)?,
            n,
            k,
            kernel,
            memory,
        })
    }

    #[cfg(test)]
    pub(crate) fn weight_is_mapped(&self) -> bool {
        self.w.is_mapped()
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// `parts` stacked into one weight (see `CpuMatmul::fuse`): one kernel and width.
    pub fn fuse(parts: &[&Q6kMatmul]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.kernel != first.kernel || p.k != first.k)
        {
            return None;
        }
        // Whole rows of blocks: the parts' bytes one after the other are the stacked matrix.
        let ws: Vec<&WeightBytes> = parts.iter().map(|p| &p.w).collect();
        Some(Self {
            w: WeightBytes::concat(&ws, first.memory)?,
            n: parts.iter().map(|p| p.n).sum(),
            k: first.k,
            kernel: first.kernel,
            memory: first.memory,
        })
    }

    /// `x @ w^T` for `x` of shape `[.., k]`: `[.., n]`, one activation row at a time, its
    /// rows grouped into sequences by `seqs` (see [`super::SeqRows`]).
    pub fn forward(&self, x: &Tensor, seqs: super::SeqRows) -> candle_core::Result<Tensor> {
        super::on_cpu_f32("q6_k matmul", x, |x| {
            let m = x.elem_count() / self.k;
            let tiled = super::seq_positions(m, seqs)
                .into_iter()
                .map(|(_, len)| len >= TILED_MIN_ROWS)
                .collect();
            x.contiguous()?.apply_op1_no_bwd(&Call { mm: self, tiled })
        })
    }
}

/// One product: the weight, and per activation row whether it rounds like llama.cpp's tiled
/// kernel.
struct Call<'a> {
    mm: &'a Q6kMatmul,
    tiled: Vec<bool>,
}

impl CustomOp1 for Call<'_> {
    fn name(&self) -> &'static str {
        "q6_k-matvec"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let mm = self.mm;
        let (x, shape) = super::matmul_io("q6_k matvec", storage, layout, mm.k, mm.n)?;
        let out = matvec(mm.kernel, &mm.w.bytes()?, mm.n, mm.k, x, &self.tiled)?;
        Ok((CpuStorage::F32(out), shape))
    }
}

fn as_bytes(b: &[BlockQ8K]) -> &[u8] {
    // SAFETY: `BlockQ8K` is `repr(C)`, 292 bytes without padding (asserted above), and
    // every block was initialised (zeroed, then written by `from_float`).
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}

/// `out[m, n] = x[m, k] @ w^T` for Q6_K weight bytes `w` (`n` rows of `k / 256` blocks), one
/// activation row at a time (`tiled[r]`: row r rounds like llama.cpp's tiled kernel for
/// batches of eight rows and more). Each group of eight weight rows meets every activation
/// row while it is cached.
fn matvec(
    kernel: Kernel,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    tiled: &[bool],
) -> candle_core::Result<Vec<f32>> {
    if k == 0 || !k.is_multiple_of(QK_K) {
        candle_core::bail!("q6_k matvec: k = {k} is not a positive multiple of {QK_K}");
    }
    let kb = k / QK_K;
    let m = x.len() / k;
    if w.len() != n * kb * Q6K_BYTES || x.len() != m * k || tiled.len() != m {
        candle_core::bail!("q6_k matvec: sizes do not match for [{n}, {k}]");
    }
    if !kernel.available() {
        candle_core::bail!("q6_k matvec: this CPU cannot run the {kernel:?} kernel");
    }
    if n == 0 || m == 0 {
        return Ok(Vec::new());
    }
    let lhs = super::act_quant::quantize_rows_q8k(x, k);
    let lhs = as_bytes(&lhs);
    let row_bytes = kb * Q6K_BYTES;
    // Enough rows of the tiled rounding: those through weights unpacked once for all.
    let tiled_rows: Vec<usize> = (0..m).filter(|&a| tiled[a]).collect();
    let via_tiles = kernel != Kernel::Scalar && tiled_rows.len() >= tiled::MIN_ROWS;
    let skip = |a: usize| via_tiles && tiled[a];
    let mut out = Unfilled::new(m * n);
    let out_ptr = out.ptr();
    if via_tiles {
        tiled::matmul(kernel, w, n, kb, lhs, &tiled_rows, out_ptr);
        if tiled_rows.len() == m {
            // SAFETY: `tiled::matmul` wrote all n columns of every row.
            return Ok(unsafe { out.filled() });
        }
    }
    let run = |groups: std::ops::Range<usize>| {
        for g in groups {
            let rows = g * ROWS..n.min((g + 1) * ROWS);
            // A short last group repeats its last row (results dropped).
            let ws: [&[u8]; ROWS] = std::array::from_fn(|i| {
                let r = (rows.start + i).min(rows.end - 1);
                &w[r * row_bytes..(r + 1) * row_bytes]
            });
            let q = |a: usize| &lhs[a * kb * Q8K_BYTES..(a + 1) * kb * Q8K_BYTES];
            // Activation rows a..a+N (the caller checked they exist).
            fn rows_at_n<'l, const N: usize>(
                q: &impl Fn(usize) -> &'l [u8],
                a: usize,
            ) -> [&'l [u8]; N] {
                std::array::from_fn(|i| q(a + i))
            }
            let mut a = 0;
            while a < m {
                if skip(a) {
                    a += 1;
                    continue;
                }
                // Up to eight consecutive activation rows of the same rounding at once.
                let t = tiled[a];
                let run = (a..m.min(a + 8))
                    .take_while(|&i| tiled[i] == t && !skip(i))
                    .count();
                // Eight, four, two or one rows through a SIMD kernel module's `dot` (a
                // batch of eight decode rows unpacks each weight block once).
                macro_rules! simd_rows {
                    ($m:ident) => {
                        match (t, run) {
                            (false, 8) => padded($m::dot::<false, 8>(&ws, rows_at_n(&q, a))),
                            (true, 8) => padded($m::dot::<true, 8>(&ws, rows_at_n(&q, a))),
                            (false, 4..) => padded($m::dot::<false, 4>(&ws, rows_at_n(&q, a))),
                            (true, 4..) => padded($m::dot::<true, 4>(&ws, rows_at_n(&q, a))),
                            (false, 2 | 3) => padded($m::dot::<false, 2>(&ws, rows_at_n(&q, a))),
                            (true, 2 | 3) => padded($m::dot::<true, 2>(&ws, rows_at_n(&q, a))),
                            (false, _) => padded($m::dot::<false, 1>(&ws, rows_at_n(&q, a))),
                            (true, _) => padded($m::dot::<true, 1>(&ws, rows_at_n(&q, a))),
                        }
                    };
                }
                let (dots, len) = match kernel {
                    // One or two rows: the 256-bit kernel streams the weights faster (the
                    // 1.5B's output matrix, one row: 4.0 ms against 4.8; two: 6.0 against
                    // 6.7), with the same integer lanes and float steps.
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the 512-bit kernel's CPUs run the 256-bit one (`available`);
                    // `matvec` checked lengths.
                    Kernel::Avx512Vnni if run < 4 => unsafe { simd_rows!(avx2) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `matvec` checked that the CPU runs the kernel; it checks lengths.
                    Kernel::Avx512Vnni => unsafe { simd_rows!(avx512) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Kernel::Avx2 => unsafe { simd_rows!(avx2) },
                    Kernel::Scalar => padded([ws.map(|w| dot_scalar(w, q(a), t))]),
                    #[cfg(not(target_arch = "x86_64"))]
                    Kernel::Avx2 | Kernel::Avx512Vnni => {
                        unreachable!("only the scalar kernel runs off x86_64")
                    }
                };
                for (i, dots) in dots.iter().take(len).enumerate() {
                    let at = (a + i) * n + rows.start;
                    // SAFETY (both): weight rows belong to one group each; `out` outlives
                    // the call. A whole group's eight outputs of a row go in one store.
                    if rows.len() == ROWS {
                        unsafe { std::ptr::write_unaligned(out_ptr.get().add(at).cast(), *dots) };
                    } else {
                        for (r, d) in dots.iter().take(rows.len()).enumerate() {
                            unsafe { *out_ptr.get().add(at + r) = *d };
                        }
                    }
                }
                a += len;
            }
        }
    };
    let cost = m * n * kb * 8;
    if m > 1 {
        // A decode batch (prompt rows take the tiles above).
        par_guided(n.div_ceil(ROWS), 1, cost, run);
    } else {
        par_chunks(n.div_ceil(ROWS), cost, run);
    }
    // SAFETY: the tiled rows are written by `tiled::matmul` (all n columns), the others by
    // the groups (all their weight rows, for every row not tiled).
    Ok(unsafe { out.filled() })
}

/// A kernel's `N` rows of outputs in an eight-row buffer (no allocation per group), with
/// how many there are.
fn padded<const N: usize>(dots: [[f32; ROWS]; N]) -> ([[f32; ROWS]; 8], usize) {
    let mut all = [[0f32; ROWS]; 8];
    all[..N].copy_from_slice(&dots);
    (all, N)
}

/// The integer sum of eight lanes (exact, any order).
fn hsum_i32(a: [i32; 8]) -> i32 {
    a.iter().sum()
}

/// Activation rows from which llama.cpp multiplies Q6_K weights with its tiled kernel
/// (`ggml-cpu/tiled`): per 256-value block the exact integer sum of the products, then
/// `acc = fma(d_w * isum, d_x, acc)`, instead of the eight-lane `vec_dot` below this.
const TILED_MIN_ROWS: usize = 8;

/// candle's `hsum_float_8`: `((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))`.
fn hsum8(a: [f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| a[i + 4] + a[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// A Q6_K block's scale `d` (f16) as f32.
fn block_d(blk: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([blk[Q6K_D], blk[Q6K_D + 1]])).to_f32()
}

/// Value `v` (0..256) of a Q6_K block, 0..64 (the weight is this minus 32).
fn q6_value(blk: &[u8], v: usize) -> i32 {
    let (half, c, j) = (v / 128, (v % 128) / 32, v % 32);
    let ql = blk[half * 64 + (c % 2) * 32 + j];
    let ql = if c < 2 { ql & 0x0f } else { ql >> 4 };
    let qh = (blk[Q6K_QH + half * 32 + j] >> (2 * c)) & 3;
    (ql | (qh << 4)) as i32
}

/// One weight row against the Q8_K blocks `q`, llama.cpp's lanes and order (`tiled`: its
/// tiled kernel's one step per block).
fn dot_scalar(w: &[u8], q: &[u8], tiled: bool) -> f32 {
    let mut tacc = 0f32;
    let mut acc = [0f32; 8];
    for (blk, y) in w.chunks_exact(Q6K_BYTES).zip(q.chunks_exact(Q8K_BYTES)) {
        let dw = block_d(blk);
        let dy = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let d = dy * dw;
        let mut lanes = [0i32; 8];
        for v in 0..QK_K {
            let sc = blk[Q6K_SCALES + v / 16] as i8 as i32;
            lanes[(v % 32) / 4] += sc * q6_value(blk, v) * (y[4 + v] as i8 as i32);
        }
        // The stored values are the weights plus 32: lane l takes 32 times the scaled sums
        // of the activations 32l..32l+32 off (llama.cpp's `q8sclsub`).
        for (l, lane) in lanes.iter_mut().enumerate() {
            for g in [2 * l, 2 * l + 1] {
                let at = Q8K_BSUMS + 2 * g;
                let bsum = i16::from_le_bytes([y[at], y[at + 1]]) as i32;
                *lane -= 32 * bsum * (blk[Q6K_SCALES + g] as i8 as i32);
            }
        }
        if tiled {
            tacc = (dw * lanes.iter().sum::<i32>() as f32).mul_add(dy, tacc);
            continue;
        }
        for (a, &s) in acc.iter_mut().zip(&lanes) {
            *a = d.mul_add(s as f32, *a);
        }
    }
    if tiled {
        return tacc;
    }
    hsum8(acc)
}

#[cfg(target_arch = "x86_64")]
mod avx2_rows8;
mod tiled;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86::{avx2, avx512};

#[cfg(test)]
mod tests;
