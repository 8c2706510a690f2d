//! CPU matmul for Q5_0 weights.
//!
//! Small models whose hidden size is not a multiple of 256 (Qwen2.5-0.5B: 896) cannot use
//! k-quants, so their GGUF files store most matrices as Q5_0. candle 0.11 has no SIMD dot
//! product for Q5_0 x Q8_0 (`BlockQ5_0::vec_dot` is the scalar reference loop), which made
//! it half of a decode profile and left prefill at a quarter of llama.cpp's speed. This
//! module computes the same thing as candle's `QMatMul::forward` for such weights:
//! activations are quantized per row with candle's own `BlockQ8_0::from_float`, each
//! 32-value block pair gives an exact integer dot product, which is scaled by the two f16
//! block scales and accumulated in f32. Only the summation order differs from candle's.
//!
//! Kernels: AVX2 (+FMA, F16C) when the CPU has it (checked at run time), and a portable
//! scalar loop otherwise. Work is split over output rows (and tiles of activation rows) on
//! candle's own barrier pool, the pool attention already uses. For prefill each weight block
//! is decoded once and multiplied with [`TILE`] activation rows.

use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::Arc;

/// Values per block (Q5_0 and Q8_0 alike).
const QK: usize = 32;
/// Bytes of one Q5_0 block: f16 scale, 32 high bits, 16 bytes of low nibbles.
const Q5_BYTES: usize = 22;
/// Bytes of one Q8_0 block: f16 scale, 32 signed bytes.
const Q8_BYTES: usize = 34;
/// Activation rows multiplied with one decoded weight block in prefill.
pub const TILE: usize = 8;
/// Activation rows whose block scales are stored side by side.
const QUAD: usize = 4;
/// Weight rows per work item.
const ROWS_PER_ITEM: usize = 8;
/// Below this many block products the pool's hand-off costs more than it saves.
const MIN_PARALLEL_BLOCKS: usize = 4096;

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

/// A Q5_0 weight `[n, k]` on the CPU, multiplied by our kernels.
#[derive(Clone)]
pub struct Q5Matmul {
    w: Arc<QTensor>,
    n: usize,
    k: usize,
    kernel: Kernel,
}

impl std::fmt::Debug for Q5Matmul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q5Matmul([{}, {}], {:?})", self.n, self.k, self.kernel)
    }
}

impl Q5Matmul {
    /// Takes over `w` when it is a Q5_0 matrix on the CPU; `None` leaves it to candle.
    /// `TOKENROUTER_CPU_Q5=candle` turns this path off, `=scalar` / `=avx2` force a kernel
    /// (for A/B measurements).
    pub fn new(w: &QMatMul) -> Option<Self> {
        let kernel = match std::env::var("TOKENROUTER_CPU_Q5").as_deref() {
            Ok("candle") => return None,
            Ok("scalar") => Kernel::Scalar,
            Ok("avx2") => Kernel::Avx2,
            _ => Kernel::detect(),
        };
        Self::with_kernel(w, kernel)
    }

    /// As [`Q5Matmul::new`] with a chosen kernel (`None` if this CPU cannot run it).
    pub fn with_kernel(w: &QMatMul, kernel: Kernel) -> Option<Self> {
        let QMatMul::QTensor(t) = w else {
            return None;
        };
        if t.dtype() != GgmlDType::Q5_0 || !t.device().is_cpu() || !kernel.available() {
            return None;
        }
        let (n, k) = t.shape().dims2().ok()?;
        if k == 0 || !k.is_multiple_of(QK) || t.storage_size_in_bytes() != n * k / QK * Q5_BYTES {
            return None;
        }
        Some(Self {
            w: t.clone(),
            n,
            k,
            kernel,
        })
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// `x @ w^T` for `x` of shape `[.., k]`: `[.., n]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.dtype() != DType::F32 || !x.device().is_cpu() {
            return x.apply_op1_no_bwd(self.w.as_ref());
        }
        x.contiguous()?.apply_op1_no_bwd(self)
    }
}

impl CustomOp1 for Q5Matmul {
    fn name(&self) -> &'static str {
        "q5_0-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("q5_0 matmul: input is not contiguous {layout:?}");
        };
        let x = &storage.as_slice::<f32>()?[start..end];
        let mut dims = layout.dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == self.k => *last = self.n,
            _ => candle_core::bail!("q5_0 matmul: input {dims:?} does not end in {}", self.k),
        }
        let data = self.w.data()?;
        let m = x.len() / self.k;
        let mut out = vec![0f32; m * self.n];
        matmul(self.kernel, &data, self.n, self.k, x, &mut out)?;
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// Output pointer shared by pool workers that write disjoint elements.
struct SharedMut<T>(*mut T);
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}
// SAFETY: every user writes only elements no other work item writes (see the callers).
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// Run `f` over `0..n` in chunks, on the pool when `cost` is worth the hand-off.
fn par_chunks(n: usize, cost: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if cost < MIN_PARALLEL_BLOCKS {
        f(0..n);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, f);
    }
}

/// Activations quantized to Q8_0, with each block's scale as f32 twice: row-major, and
/// interleaved by groups of [`QUAD`] rows so a tile kernel loads a block's four scales at once.
struct QuantizedLhs {
    blocks: Vec<BlockQ8_0>,
    /// `[m, kb]`.
    scales: Vec<f32>,
    /// `[m.div_ceil(QUAD), kb, QUAD]`, zero past row `m`.
    quads: Vec<f32>,
    /// `[m, kb]`: -16 times the sum of the block's values. The x86 kernels multiply the
    /// weights as unsigned `x + 16` and add this to get the dot product with `x`.
    corr: Vec<i32>,
    kb: usize,
}

impl QuantizedLhs {
    fn new(x: &[f32], m: usize, k: usize) -> Self {
        let kb = k / QK;
        let mut blocks = vec![BlockQ8_0::zeros(); m * kb];
        let mut scales = vec![0f32; m * kb];
        let (bp, sp) = (
            SharedMut(blocks.as_mut_ptr()),
            SharedMut(scales.as_mut_ptr()),
        );
        par_chunks(m, m * kb, |rows| {
            for r in rows {
                // SAFETY: row r owns blocks and scales r*kb..(r+1)*kb; both vectors outlive
                // the call.
                let (b, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(bp.get().add(r * kb), kb),
                        std::slice::from_raw_parts_mut(sp.get().add(r * kb), kb),
                    )
                };
                BlockQ8_0::from_float(&x[r * k..(r + 1) * k], b);
                for (s, blk) in s.iter_mut().zip(as_bytes(b).chunks_exact(Q8_BYTES)) {
                    *s = f16_at(blk, 0);
                }
            }
        });
        let corr = as_bytes(&blocks)
            .chunks_exact(Q8_BYTES)
            .map(|b| -16 * b[2..].iter().map(|&v| v as i8 as i32).sum::<i32>())
            .collect();
        let mut quads = vec![0f32; m.div_ceil(QUAD) * kb * QUAD];
        for (r, row) in scales.chunks_exact(kb).enumerate() {
            let base = (r / QUAD) * kb * QUAD + r % QUAD;
            for (b, &s) in row.iter().enumerate() {
                quads[base + b * QUAD] = s;
            }
        }
        Self {
            blocks,
            scales,
            quads,
            corr,
            kb,
        }
    }

    /// Row `r`'s blocks as bytes.
    fn row(&self, r: usize) -> &[u8] {
        let len = self.kb * Q8_BYTES;
        &as_bytes(&self.blocks)[r * len..(r + 1) * len]
    }

    fn row_scales(&self, r: usize) -> &[f32] {
        &self.scales[r * self.kb..(r + 1) * self.kb]
    }

    fn row_corr(&self, r: usize) -> &[i32] {
        &self.corr[r * self.kb..(r + 1) * self.kb]
    }

    /// Interleaved scales of the `width / QUAD` row groups from row `start` (a multiple of 4).
    fn quad_scales(&self, start: usize, width: usize) -> &[f32] {
        let g = start / QUAD;
        &self.quads[g * self.kb * QUAD..(g + width / QUAD) * self.kb * QUAD]
    }
}

fn as_bytes(b: &[BlockQ8_0]) -> &[u8] {
    // SAFETY: `BlockQ8_0` is `repr(C)`, 34 bytes without padding (asserted above), and every
    // block was initialised (zeroed, then written by `from_float`).
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// A run of activation rows that one kernel call multiplies with a weight row: `rows` real
/// rows from `start`, computed `width` (1, 4 or 8) at a time; rows past `rows` are padding.
#[derive(Clone, Copy, Debug)]
struct Tile {
    start: usize,
    rows: usize,
    width: usize,
}

/// Cover `0..m` with 8-wide tiles, then at most one 4-wide tile and one 4-wide (padded) or
/// single-row tile. Tile starts are multiples of 4, as the interleaved scales need.
fn tiles(m: usize) -> Vec<Tile> {
    let mut out: Vec<Tile> = (0..m / TILE)
        .map(|t| Tile {
            start: t * TILE,
            rows: TILE,
            width: TILE,
        })
        .collect();
    let mut start = m / TILE * TILE;
    while start < m {
        let rows = (m - start).min(QUAD);
        let width = if rows == 1 { 1 } else { QUAD };
        out.push(Tile { start, rows, width });
        start += rows;
    }
    out
}

/// `out[m, n] = x[m, k] @ w^T` for Q5_0 weight bytes `w` (`n` rows of `k / 32` blocks).
pub fn matmul(
    kernel: Kernel,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    out: &mut [f32],
) -> candle_core::Result<()> {
    if k == 0 || !k.is_multiple_of(QK) {
        candle_core::bail!("q5_0 matmul: k = {k} is not a positive multiple of {QK}");
    }
    let kb = k / QK;
    let m = x.len() / k;
    if w.len() != n * kb * Q5_BYTES || x.len() != m * k || out.len() != m * n {
        candle_core::bail!(
            "q5_0 matmul: sizes do not match: w {} bytes for [{n}, {k}], x {}, out {}",
            w.len(),
            x.len(),
            out.len()
        );
    }
    if !kernel.available() {
        candle_core::bail!("q5_0 matmul: this CPU cannot run the {kernel:?} kernel");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let lhs = QuantizedLhs::new(x, m, k);
    let tiles = tiles(m);
    let nt = tiles.len();
    let groups = n.div_ceil(ROWS_PER_ITEM);
    let out_ptr = SharedMut(out.as_mut_ptr());
    // Items are weight-row-group major: a worker walking a range keeps one group of weight
    // rows in L1 while the (small) quantized activations stream from L2.
    par_chunks(groups * nt, m * n * kb, |items| {
        for item in items {
            let (g, tile) = (item / nt, tiles[item % nt]);
            for wr in g * ROWS_PER_ITEM..n.min((g + 1) * ROWS_PER_ITEM) {
                let wrow = &w[wr * kb * Q5_BYTES..(wr + 1) * kb * Q5_BYTES];
                let dots = dot_tile(kernel, wrow, &lhs, tile);
                for (i, d) in dots.iter().take(tile.rows).enumerate() {
                    // SAFETY: element (row, wr) belongs to this item alone (items partition
                    // the (weight group, tile) grid) and `out` outlives the pool call.
                    unsafe { *out_ptr.get().add((tile.start + i) * n + wr) = *d };
                }
            }
        }
    });
    Ok(())
}

/// Runs one x86 kernel module's tile kernels for `dot_tile`.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_tile {
    ($module:ident, $w:expr, $lhs:expr, $tile:expr, $dots:expr) => {{
        let (w, lhs, tile): (&[u8], &QuantizedLhs, Tile) = ($w, $lhs, $tile);
        let row = |i: usize| tile.start + if i < tile.rows { i } else { 0 };
        let acts: [(&[u8], &[i32]); TILE] =
            std::array::from_fn(|i| (lhs.row(row(i)), lhs.row_corr(row(i))));
        // SAFETY: `matmul` checked that the CPU runs this kernel; the kernels check the
        // slice lengths against the weight row's block count.
        unsafe {
            match tile.width {
                1 => {
                    let (q, c) = acts[0];
                    $dots[0] = $module::dot1(w, q, c, lhs.row_scales(tile.start));
                }
                QUAD => {
                    let q = lhs.quad_scales(tile.start, QUAD);
                    $module::dot_quads::<1>(w, &acts[..QUAD], q, &mut $dots)
                }
                _ => {
                    let q = lhs.quad_scales(tile.start, TILE);
                    $module::dot_quads::<2>(w, &acts, q, &mut $dots)
                }
            }
        }
    }};
}

/// Dot products of one weight row with the rows of a tile (padding rows give garbage).
fn dot_tile(kernel: Kernel, w: &[u8], lhs: &QuantizedLhs, tile: Tile) -> [f32; TILE] {
    let mut dots = [0f32; TILE];
    match kernel {
        Kernel::Scalar => {
            for (i, d) in dots.iter_mut().take(tile.rows).enumerate() {
                let r = tile.start + i;
                *d = dot_scalar(w, lhs.row(r), lhs.row_scales(r));
            }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => x86_tile!(avx2, w, lhs, tile, dots),
        #[cfg(target_arch = "x86_64")]
        Kernel::AvxVnni => x86_tile!(avx_vnni, w, lhs, tile, dots),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Vnni => x86_tile!(avx512_vnni, w, lhs, tile, dots),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar kernel is available off x86_64"),
    }
    dots
}

/// One weight row against one activation row, block by block like candle's reference loop:
/// `sum += (sumi as f32) * d_w * d_x`.
fn dot_scalar(w: &[u8], q: &[u8], scales: &[f32]) -> f32 {
    let mut sum = 0f32;
    for ((wb, qb), &dy) in w
        .chunks_exact(Q5_BYTES)
        .zip(q.chunks_exact(Q8_BYTES))
        .zip(scales)
    {
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        let qs = &wb[6..22];
        let y = &qb[2..34];
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let hi0 = ((qh >> j) & 1) as i32;
            let hi1 = ((qh >> (j + 16)) & 1) as i32;
            let x0 = ((qs[j] & 0x0f) as i32 | (hi0 << 4)) - 16;
            let x1 = ((qs[j] >> 4) as i32 | (hi1 << 4)) - 16;
            sumi += x0 * (y[j] as i8) as i32 + x1 * (y[j + QK / 2] as i8) as i32;
        }
        sum += sumi as f32 * f16_at(wb, 0) * dy;
    }
    sum
}

/// The x86 kernels, instantiated once per instruction set: `$features` are the target
/// features, `$dot(acc, xu, y)` adds the dot products of each 4 unsigned bytes of `xu` with
/// the signed bytes of `y` to the i32 lanes of `acc`.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_kernels {
    ($module:ident, $features:literal, $dot:expr) => {
        mod $module {
            use super::{Q5_BYTES, Q8_BYTES, QUAD, TILE};
            use std::arch::x86_64::*;

            /// The 32 weights of one Q5_0 block plus 16, as unsigned bytes in 0..=31.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(p: *const u8) -> __m256i {
                // Low nibbles are values 0..16, high nibbles values 16..32.
                let qs = _mm_loadu_si128(p.add(6) as *const __m128i);
                let m4 = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(qs, m4);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
                let nib = _mm256_set_m128i(hi, lo);
                // Bit i of qh is the fifth bit of value i: spread it to a 0x00 / 0xff byte.
                let qh = std::ptr::read_unaligned(p.add(2) as *const i32);
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(qh),
                    _mm256_setr_epi8(
                        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                    ),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
            }

            /// A block's f16 scale in all eight lanes. (Converting a broadcast keeps every
            /// lane in use; a one-lane convert lets the compiler merge into an unrelated
            /// register, which put the accumulator on the critical path.)
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_splat(p: *const u8) -> __m256 {
                let bits = std::ptr::read_unaligned(p as *const i16);
                _mm256_cvtph_ps(_mm_set1_epi16(bits))
            }

            /// Eight i32 lanes summing to the exact dot product of the block's weights
            /// (`xu - 16`) with the 32 i8 at `y`; `corr` is -16 times the sum of those i8.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn block_dot(xu: __m256i, y: *const u8, corr: i32) -> __m256i {
                let y = _mm256_loadu_si256(y as *const __m256i);
                let acc = _mm256_zextsi128_si256(_mm_cvtsi32_si128(corr));
                #[allow(clippy::redundant_closure_call)]
                ($dot)(acc, xu, y)
            }

            /// One weight row against one activation row.
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn dot1(w: &[u8], q: &[u8], corr: &[i32], scales: &[f32]) -> f32 {
                let kb = w.len() / Q5_BYTES;
                // Real checks: the loop reads kb blocks through raw pointers.
                assert!(q.len() == kb * Q8_BYTES && corr.len() == kb && scales.len() == kb);
                // (sum * d_y) * d_x of block b.
                let term = |b: usize| {
                    let wb = w.as_ptr().add(b * Q5_BYTES);
                    let p = block_dot(
                        decode(wb),
                        q.as_ptr().add(b * Q8_BYTES + 2),
                        *corr.get_unchecked(b),
                    );
                    let dy = _mm256_set1_ps(*scales.get_unchecked(b));
                    (_mm256_mul_ps(_mm256_cvtepi32_ps(p), dy), f16_splat(wb))
                };
                // Two accumulators (even and odd blocks) halve the fma latency chain.
                let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for b in (0..kb & !1).step_by(2) {
                    let (t, d) = term(b);
                    even = _mm256_fmadd_ps(t, d, even);
                    let (t, d) = term(b + 1);
                    odd = _mm256_fmadd_ps(t, d, odd);
                }
                if kb & 1 == 1 {
                    let (t, d) = term(kb - 1);
                    even = _mm256_fmadd_ps(t, d, even);
                }
                let acc = _mm256_add_ps(even, odd);
                let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
            }

            /// One weight row against `4 * G` activation rows (`acts`: blocks and
            /// corrections), with the rows' block scales interleaved by four (`quads`:
            /// `[G, kb, 4]`). Each decoded weight block serves all rows; the four rows of a
            /// quad share one convert / scale / accumulate after their integer lanes are
            /// folded together with horizontal adds.
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn dot_quads<const G: usize>(
                w: &[u8],
                acts: &[(&[u8], &[i32])],
                quads: &[f32],
                dots: &mut [f32; TILE],
            ) {
                let kb = w.len() / Q5_BYTES;
                // Real checks: the loop reads kb blocks of every row through raw pointers.
                assert!(4 * G <= TILE && acts.len() == 4 * G && quads.len() == G * kb * QUAD);
                let mut qp = [std::ptr::null::<u8>(); TILE];
                let mut cp = [std::ptr::null::<i32>(); TILE];
                for ((q, c), (aq, ac)) in qp.iter_mut().zip(cp.iter_mut()).zip(acts) {
                    assert!(aq.len() == kb * Q8_BYTES && ac.len() == kb);
                    *q = aq.as_ptr().add(2);
                    *c = ac.as_ptr();
                }
                let mut acc = [_mm256_setzero_ps(); G];
                for b in 0..kb {
                    let wb = w.as_ptr().add(b * Q5_BYTES);
                    let xu = decode(wb);
                    let dx = f16_splat(wb);
                    for (g, acc) in acc.iter_mut().enumerate() {
                        let r = 4 * g;
                        let off = b * Q8_BYTES;
                        let p0 = block_dot(xu, qp[r].add(off), *cp[r].add(b));
                        let p1 = block_dot(xu, qp[r + 1].add(off), *cp[r + 1].add(b));
                        let p2 = block_dot(xu, qp[r + 2].add(off), *cp[r + 2].add(b));
                        let p3 = block_dot(xu, qp[r + 3].add(off), *cp[r + 3].add(b));
                        // Lanes [r0, r1, r2, r3] of each 128-bit half: half of each row's sum.
                        let h =
                            _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
                        let dy = _mm256_broadcast_ps(
                            &*(quads.as_ptr().add((g * kb + b) * QUAD) as *const __m128),
                        );
                        // (sum * d_y) * d_x.
                        let t = _mm256_mul_ps(_mm256_cvtepi32_ps(h), dy);
                        *acc = _mm256_fmadd_ps(t, dx, *acc);
                    }
                }
                for (g, acc) in acc.iter().enumerate() {
                    let s =
                        _mm_add_ps(_mm256_castps256_ps128(*acc), _mm256_extractf128_ps(*acc, 1));
                    _mm_storeu_ps(dots.as_mut_ptr().add(4 * g), s);
                }
            }
        }
    };
}

// xu <= 31 and |y| <= 128 keep maddubs' pair sums (<= 7936) inside i16.
#[cfg(target_arch = "x86_64")]
x86_kernels!(avx2, "avx2,fma,f16c", |acc, xu, y| _mm256_add_epi32(
    acc,
    _mm256_madd_epi16(_mm256_maddubs_epi16(xu, y), _mm256_set1_epi16(1))
));
#[cfg(target_arch = "x86_64")]
x86_kernels!(avx_vnni, "avx2,fma,f16c,avxvnni", |acc, xu, y| {
    _mm256_dpbusd_avx_epi32(acc, xu, y)
});
#[cfg(target_arch = "x86_64")]
x86_kernels!(
    avx512_vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    |acc, xu, y| _mm256_dpbusd_epi32(acc, xu, y)
);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};

    /// Deterministic pseudo-random values in about -1..1 (xorshift).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn q5_weight(n: usize, k: usize, seed: u64) -> QMatMul {
        let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q5_0).unwrap();
        QMatMul::from_arc(Arc::new(q)).unwrap()
    }

    /// max |a - b| over max |b|.
    fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |s, v| s.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |s, (x, y)| s.max((x - y).abs()));
        diff / scale
    }

    fn kernels() -> Vec<Kernel> {
        [
            Kernel::Scalar,
            Kernel::Avx2,
            Kernel::AvxVnni,
            Kernel::Avx512Vnni,
        ]
        .into_iter()
        .filter(|k| k.available())
        .collect()
    }

    #[test]
    fn matches_candle_qmatmul() {
        for (n, k) in [(896, 896), (4864, 896), (896, 4864), (40, 64)] {
            let w = q5_weight(n, k, (n * 31 + k) as u64);
            for m in [1, 3, 17, 64] {
                let x =
                    Tensor::from_vec(values(m * k, m as u64 + 7), (m, k), &Device::Cpu).unwrap();
                let want = w.forward(&x).unwrap().flatten_all().unwrap();
                let want = want.to_vec1::<f32>().unwrap();
                for kernel in kernels() {
                    let ours = Q5Matmul::with_kernel(&w, kernel).unwrap();
                    let got = ours.forward(&x).unwrap();
                    assert_eq!(got.dims(), &[m, n]);
                    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let d = rel_diff(&got, &want);
                    assert!(
                        d <= 1e-5,
                        "{kernel:?} [{m}x{k}] x [{n}x{k}]^T: rel diff {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn scalar_kernel_is_candles_arithmetic() {
        // Same per-block products in the same order as candle's reference loop.
        let (n, k, m) = (64, 896, 5);
        let w = q5_weight(n, k, 3);
        let x = Tensor::from_vec(values(m * k, 11), (m, k), &Device::Cpu).unwrap();
        let want = w
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let ours = Q5Matmul::with_kernel(&w, Kernel::Scalar).unwrap();
        let got = ours
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn simd_matches_scalar() {
        // Row counts cover every tile shape: 8-wide, 4-wide, padded 4-wide and single rows.
        for (n, k, m) in [
            (896, 896, 1),
            (130, 4864, 7),
            (896, 96, 64),
            (8, 32, 2),
            (33, 128, 13),
            (17, 64, 6),
        ] {
            let w = q5_weight(n, k, 5 + n as u64);
            let x = Tensor::from_vec(values(m * k, 13), (m, k), &Device::Cpu).unwrap();
            let run = |kernel| {
                let q = Q5Matmul::with_kernel(&w, kernel).unwrap();
                q.forward(&x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            let scalar = run(Kernel::Scalar);
            for kernel in kernels().into_iter().skip(1) {
                let d = rel_diff(&run(kernel), &scalar);
                assert!(
                    d <= 1e-5,
                    "{kernel:?} [{m}x{k}] x [{n}x{k}]^T: rel diff {d}"
                );
            }
        }
    }

    #[test]
    fn extreme_values_decode_exactly() {
        // All-equal magnitudes hit the quantizers' ends (-16 and 15, +-127): integer dots
        // must not saturate anywhere.
        let (n, k, m) = (4, 64, 2);
        let wv: Vec<f32> = (0..n * k)
            .map(|i| if i % 3 == 0 { -1.0 } else { 0.93 })
            .collect();
        let w = Tensor::from_vec(wv, (n, k), &Device::Cpu).unwrap();
        let w =
            QMatMul::from_arc(Arc::new(QTensor::quantize(&w, GgmlDType::Q5_0).unwrap())).unwrap();
        let xv: Vec<f32> = (0..m * k)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let x = Tensor::from_vec(xv, (m, k), &Device::Cpu).unwrap();
        let want = w
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for kernel in kernels() {
            let q = Q5Matmul::with_kernel(&w, kernel).unwrap();
            let got = q
                .forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(
                rel_diff(&got, &want) <= 1e-6,
                "{kernel:?}: {got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn batched_input_and_other_dtypes() {
        let w = q5_weight(16, 64, 9);
        let ours = Q5Matmul::new(&w).unwrap();
        let x = Tensor::from_vec(values(2 * 3 * 64, 1), (2, 3, 64), &Device::Cpu).unwrap();
        let got = ours.forward(&x).unwrap();
        assert_eq!(got.dims(), &[2, 3, 16]);
        let want = w.forward(&x).unwrap();
        let d = rel_diff(
            &got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            &want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert!(d <= 1e-5);
        // A transposed (non-contiguous) input is made contiguous first.
        let xt = Tensor::from_vec(values(64 * 3, 2), (64, 3), &Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        assert_eq!(ours.forward(&xt).unwrap().dims(), &[3, 16]);
        // Wrong inner size is an error, not a panic.
        let bad = Tensor::zeros((2, 63), DType::F32, &Device::Cpu).unwrap();
        assert!(ours.forward(&bad).is_err());
    }

    #[test]
    fn only_q5_0_cpu_weights_are_taken() {
        let w = Tensor::from_vec(values(32 * 64, 4), (32, 64), &Device::Cpu).unwrap();
        let q8 =
            QMatMul::from_arc(Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap())).unwrap();
        assert!(Q5Matmul::with_kernel(&q8, Kernel::Scalar).is_none());
        assert!(Q5Matmul::with_kernel(&QMatMul::Tensor(w), Kernel::Scalar).is_none());
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut out = vec![0f32; 4];
        assert!(matmul(Kernel::Scalar, &[0u8; 22], 1, 33, &[0f32; 33], &mut out).is_err());
        assert!(matmul(
            Kernel::Scalar,
            &[0u8; 21],
            1,
            32,
            &[0f32; 32],
            &mut out[..1]
        )
        .is_err());
        assert!(matmul(Kernel::Scalar, &[0u8; 22], 1, 32, &[0f32; 32], &mut out).is_err());
    }

    /// CPU time of the calling thread in ms (`/proc/thread-self/schedstat`), 0 if unknown.
    fn thread_cpu_ms() -> f64 {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |ns| ns / 1e6)
    }

    /// `cargo test --release -p tokenrouter-runtime cpu_q5::tests::speed -- --ignored --nocapture`
    /// (with `RAYON_NUM_THREADS=1` the CPU-time column is the kernel's cost on one core,
    /// whatever else runs on the machine).
    #[test]
    #[ignore]
    fn speed() {
        let (n, k) = (4864, 896);
        let w = q5_weight(n, k, 1);
        for m in [1, 16, 128, 512] {
            let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
            let reps = (4096 / m).max(8);
            // Fastest wall time of several runs (the machine may be shared), and mean
            // CPU time of this thread.
            let time = |f: &dyn Fn() -> Tensor| {
                let cpu = thread_cpu_ms();
                let wall = (0..reps)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        f();
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .fold(f64::INFINITY, f64::min);
                (wall, (thread_cpu_ms() - cpu) / reps as f64)
            };
            let (c, cc) = time(&|| w.forward(&x).unwrap());
            let mut line = format!("m={m:4} [{n}x{k}]: candle {c:.3} ms (cpu {cc:.3})");
            for kernel in kernels() {
                let ours = Q5Matmul::with_kernel(&w, kernel).unwrap();
                let (o, oc) = time(&|| ours.forward(&x).unwrap());
                line += &format!(", {kernel:?} {o:.3} (cpu {oc:.3})");
            }
            println!("{line}");
        }
    }
}
