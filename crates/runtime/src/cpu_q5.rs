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
/// Activation rows multiplied with one decoded weight block.
pub const TILE: usize = 4;
/// Weight rows per work item.
const ROWS_PER_ITEM: usize = 8;
/// Below this many block products the pool's hand-off costs more than it saves.
const MIN_PARALLEL_BLOCKS: usize = 4096;

// The activation blocks are read as bytes: `BlockQ8_0` is `#[repr(C)] { d: f16, qs: [i8; 32] }`,
// the ggml layout, with no padding.
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == Q8_BYTES);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() <= 2);

/// Which dot-product kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable loop, the same arithmetic as candle's reference `vec_dot`.
    Scalar,
    /// 256-bit integer kernel (AVX2, FMA, F16C).
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            Kernel::Avx2 => Kernel::detect() == Kernel::Avx2,
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
    /// `TOKENROUTER_CPU_Q5=candle` turns this path off, `=scalar` forces the portable kernel
    /// (both for A/B measurements).
    pub fn new(w: &QMatMul) -> Option<Self> {
        let kernel = match std::env::var("TOKENROUTER_CPU_Q5").as_deref() {
            Ok("candle") => return None,
            Ok("scalar") => Kernel::Scalar,
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

/// Activations quantized to Q8_0: the blocks as bytes plus each block's scale as f32.
struct QuantizedLhs {
    blocks: Vec<BlockQ8_0>,
    scales: Vec<f32>,
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
        Self { blocks, scales, kb }
    }

    fn row(&self, r: usize) -> (&[u8], &[f32]) {
        let kb = self.kb;
        (
            &as_bytes(&self.blocks)[r * kb * Q8_BYTES..(r + 1) * kb * Q8_BYTES],
            &self.scales[r * kb..(r + 1) * kb],
        )
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
    let tiles = m.div_ceil(TILE);
    let groups = n.div_ceil(ROWS_PER_ITEM);
    let out_ptr = SharedMut(out.as_mut_ptr());
    // Items are weight-row-group major: a worker walking a range keeps one group of weight
    // rows in L1 while the (small) quantized activations stream from L2.
    par_chunks(groups * tiles, m * n * kb, |items| {
        for item in items {
            let (g, t) = (item / tiles, item % tiles);
            let rows = t * TILE..m.min((t + 1) * TILE);
            for wr in g * ROWS_PER_ITEM..n.min((g + 1) * ROWS_PER_ITEM) {
                let wrow = &w[wr * kb * Q5_BYTES..(wr + 1) * kb * Q5_BYTES];
                let mut acts: [(&[u8], &[f32]); TILE] = [(&[], &[]); TILE];
                for (a, r) in acts.iter_mut().zip(rows.clone()) {
                    *a = lhs.row(r);
                }
                let mut dots = [0f32; TILE];
                dot_tile(kernel, wrow, &acts[..rows.len()], &mut dots);
                for (i, r) in rows.clone().enumerate() {
                    // SAFETY: element (r, wr) belongs to this item alone (items partition the
                    // (row tile, weight group) grid) and `out` outlives the pool call.
                    unsafe { *out_ptr.get().add(r * n + wr) = dots[i] };
                }
            }
        }
    });
    Ok(())
}

/// Dot products of one weight row with 1..=TILE activation rows.
fn dot_tile(kernel: Kernel, w: &[u8], acts: &[(&[u8], &[f32])], dots: &mut [f32; TILE]) {
    match kernel {
        Kernel::Scalar => {
            for (d, (q, s)) in dots.iter_mut().zip(acts) {
                *d = dot_scalar(w, q, s);
            }
        }
        Kernel::Avx2 => {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `matmul` checked that the CPU has AVX2, FMA and F16C; the slices hold
            // whole rows of the same block count (checked inside).
            unsafe {
                avx2::dot_tile(w, acts, dots)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("Kernel::Avx2 is never available off x86_64");
        }
    }
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q5_BYTES, Q8_BYTES, TILE};
    use std::arch::x86_64::*;

    /// One weight row against `acts.len()` (1..=TILE) activation rows.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_tile(w: &[u8], acts: &[(&[u8], &[f32])], dots: &mut [f32; TILE]) {
        match acts.len() {
            4 => dot_n::<4>(w, acts, dots),
            3 => dot_n::<3>(w, acts, dots),
            2 => dot_n::<2>(w, acts, dots),
            1 => dot_n::<1>(w, acts, dots),
            _ => {}
        }
    }

    /// The 32 weights of one Q5_0 block as signed bytes in -16..=15.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
        // value = (nib | hbit << 4) - 16: with the bit it is nib, without it nib | 0xf0 as i8.
        _mm256_or_si256(
            nib,
            _mm256_andnot_si256(set, _mm256_set1_epi8(0xf0u8 as i8)),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_to_f32(p: *const u8) -> f32 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_n<const C: usize>(w: &[u8], acts: &[(&[u8], &[f32])], dots: &mut [f32; TILE]) {
        let kb = w.len() / Q5_BYTES;
        assert!(acts.len() == C && C <= TILE);
        let mut qp = [std::ptr::null::<u8>(); C];
        let mut sp = [std::ptr::null::<f32>(); C];
        for c in 0..C {
            // Real checks: the loop below reads kb blocks of every row through raw pointers.
            assert!(acts[c].0.len() == kb * Q8_BYTES && acts[c].1.len() == kb);
            qp[c] = acts[c].0.as_ptr();
            sp[c] = acts[c].1.as_ptr();
        }
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); C];
        let wp = w.as_ptr();
        for b in 0..kb {
            let wb = wp.add(b * Q5_BYTES);
            let x = decode(wb);
            // maddubs wants unsigned x signed: |x| times y with x's sign moved onto y.
            let ax = _mm256_sign_epi8(x, x);
            let dx = _mm256_set1_ps(f16_to_f32(wb));
            for c in 0..C {
                let y = _mm256_loadu_si256(qp[c].add(b * Q8_BYTES + 2) as *const __m256i);
                let sy = _mm256_sign_epi8(y, x);
                // |x| <= 16, |y| <= 127: pair sums stay far inside i16.
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
                let d = _mm256_mul_ps(dx, _mm256_broadcast_ss(&*sp[c].add(b)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[c]);
            }
        }
        for c in 0..C {
            dots[c] = hsum(acc[c]);
        }
    }
}

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
        let mut k = vec![Kernel::Scalar];
        if Kernel::Avx2.available() {
            k.push(Kernel::Avx2);
        }
        k
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
        if !Kernel::Avx2.available() {
            return;
        }
        for (n, k, m) in [(896, 896, 1), (130, 4864, 7), (896, 96, 64), (8, 32, 2)] {
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
            let d = rel_diff(&run(Kernel::Avx2), &run(Kernel::Scalar));
            assert!(d <= 1e-5, "[{m}x{k}] x [{n}x{k}]^T: rel diff {d}");
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

    /// `cargo test --release -p tokenrouter-runtime cpu_q5::tests::speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed() {
        let (n, k) = (4864, 896);
        let w = q5_weight(n, k, 1);
        let ours = Q5Matmul::new(&w).unwrap();
        for m in [1, 16, 128] {
            let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
            let reps = 2048 / m;
            let time = |f: &dyn Fn() -> Tensor| {
                f();
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    f();
                }
                t.elapsed().as_secs_f64() / reps as f64 * 1e3
            };
            let c = time(&|| w.forward(&x).unwrap());
            let o = time(&|| ours.forward(&x).unwrap());
            println!(
                "m={m:4} [{n}x{k}]: candle {c:.3} ms, ours {o:.3} ms ({:.1}x)",
                c / o
            );
        }
    }
}
