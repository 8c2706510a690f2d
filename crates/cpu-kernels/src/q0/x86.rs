//! The x86 kernels of `q0`: 256-bit (AVX2, optionally AVX-VNNI or AVX512-VNNI for the
//! integer part), one module per instruction set from one macro.

use super::{Format, TILE};
use std::arch::x86_64::*;

/// The 32 weights of one Q5_0 block plus 16, as unsigned bytes in 0..=31.
#[inline]
#[target_feature(enable = "avx2")]
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

/// llama.cpp's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum8(v: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
}

/// Weight rows `ws` (at most eight) against a tile of eight activation rows given as
/// [`super::RowPairs`] (`ybias`: per block and row pair the two rows' values plus 128 as
/// u8, `dpair`: their scales, each eight times). `dots[i]` gets weight row i's eight
/// products, the same lanes, steps and sums as `dot_acts`: 512-bit integer dot products
/// compute two activation rows at once, `(y + 128) . x` starting from `-128 * sum(x)`.
///
/// # Safety
/// The CPU must support AVX512F, AVX512BW, AVX512-VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn dot_acts_pairs(
    format: Format,
    ws: &[&[u8]],
    ybias: &[u8],
    dpair: &[f32],
    dots: &mut [[f32; TILE]; TILE],
) {
    let kb = dpair.len() / (TILE * TILE);
    // Real checks: the loops read kb blocks of every row through raw pointers.
    assert!(ybias.len() == kb * 4 * 64 && dpair.len() == kb * 4 * 16 && ws.len() <= TILE);
    let wbytes = format.block_bytes();
    let ones = _mm512_set1_epi8(1);
    let zero = _mm512_setzero_si512();
    for (w, dots) in ws.iter().zip(dots.iter_mut()) {
        assert!(w.len() == kb * wbytes);
        let mut acc = [_mm512_setzero_ps(); 4];
        for b in 0..kb {
            let wb = w.as_ptr().add(b * wbytes);
            let x = _mm512_broadcast_i64x4(match format {
                Format::Q5_0 => _mm256_sub_epi8(decode(wb), _mm256_set1_epi8(16)),
                Format::Q8_0 => _mm256_loadu_si256(wb.add(2) as *const __m256i),
            });
            // -128 times each lane's weight sum: (y + 128) . x - 128 * sum(x) = y . x.
            let start = _mm512_sub_epi32(
                zero,
                _mm512_slli_epi32::<7>(_mm512_dpbusd_epi32(zero, ones, x)),
            );
            let dw = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(
                std::ptr::read_unaligned(wb as *const i16),
            ))));
            for (p, acc) in acc.iter_mut().enumerate() {
                let at = b * 4 + p;
                let y = _mm512_loadu_si512(ybias.as_ptr().add(at * 64) as *const _);
                let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, y, x));
                let d = _mm512_mul_ps(dw, _mm512_loadu_ps(dpair.as_ptr().add(at * 16)));
                *acc = _mm512_fmadd_ps(d, lanes, *acc);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*acc)));
            dots[2 * p] = hsum8(_mm512_castps512_ps256(*acc));
            dots[2 * p + 1] = hsum8(hi);
        }
    }
}

/// The x86 kernels, instantiated once per instruction set: `$features` are the target
/// features, `$dot(xu, y)` gives the i32 lanes of dot products of each 4 unsigned bytes of
/// `xu` with the signed bytes of `y`.
macro_rules! x86_kernels {
    ($module:ident, $features:literal, $dot:expr) => {
        pub(super) mod $module {
            use super::super::{Format, Q8_BYTES, TILE};
            use std::arch::x86_64::*;

            /// The 32 weights of one Q5_0 block plus 16, as unsigned bytes in 0..=31.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(p: *const u8) -> __m256i {
                super::decode(p)
            }

            /// A block's weights as `lanes` wants them: Q5_0: (unused, `x + 16` as u8);
            /// Q8_0: (x, |x|).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn weights(format: Format, wb: *const u8) -> (__m256i, __m256i) {
                match format {
                    Format::Q5_0 => (_mm256_setzero_si256(), decode(wb)),
                    Format::Q8_0 => {
                        let x = _mm256_loadu_si256(wb.add(2) as *const __m256i);
                        (x, _mm256_sign_epi8(x, x))
                    }
                }
            }

            /// The eight i32 lanes (lane l: values 4l..4l+4) of a block's dot product with
            /// the 32 i8 at `y`, as f32, the integer sums exact like llama.cpp's
            /// `mul_sum_i8_pairs_float`. Q5_0: the unsigned weights `x + 16` (`w.1`) times
            /// y, minus 16 times y's sums (`sums16`); Q8_0: |x| (`w.1`) times y with x's
            /// signs.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn lanes(
                format: Format,
                w: (__m256i, __m256i),
                y: *const u8,
                sums16: *const i32,
            ) -> __m256 {
                let y = _mm256_loadu_si256(y as *const __m256i);
                #[allow(clippy::redundant_closure_call)]
                let lanes = match format {
                    Format::Q5_0 => _mm256_sub_epi32(
                        ($dot)(w.1, y),
                        _mm256_loadu_si256(sums16 as *const __m256i),
                    ),
                    Format::Q8_0 => ($dot)(w.1, _mm256_sign_epi8(y, w.0)),
                };
                _mm256_cvtepi32_ps(lanes)
            }

            /// llama.cpp's `hsum_float_8`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum(v: __m256) -> f32 {
                super::hsum8(v)
            }

            /// Weight rows `ws` (at most eight) against a tile of eight activation rows
            /// (`lines`, see `QuantizedLhs::lines`: their values and lane sums per block
            /// and row; `scales` their block scales, `[kb, 8]`). `dots[i]` gets weight
            /// row i's eight products.
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(in crate::q0) unsafe fn dot_acts(
                format: Format,
                ws: &[&[u8]],
                lines: &[[u8; 64]],
                scales: &[f32],
                dots: &mut [[f32; TILE]; TILE],
            ) {
                let kb = scales.len() / TILE;
                // Real checks: the loops read kb blocks of every row through raw pointers.
                assert!(scales.len() == kb * TILE && ws.len() <= TILE);
                assert!(lines.len() == kb * TILE);
                let wbytes = format.block_bytes();
                for (w, dots) in ws.iter().zip(dots.iter_mut()) {
                    assert!(w.len() == kb * wbytes);
                    let mut acc = [_mm256_setzero_ps(); TILE];
                    for b in 0..kb {
                        let wb = w.as_ptr().add(b * wbytes);
                        let wv = weights(format, wb);
                        let dw = f16_to_f32(wb);
                        let line = lines.as_ptr().add(b * TILE) as *const u8;
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let y = line.add(i * 64);
                            let d = _mm256_set1_ps(dw * *scales.get_unchecked(b * TILE + i));
                            let l = lanes(format, wv, y, y.add(32) as *const i32);
                            *acc = _mm256_fmadd_ps(d, l, *acc);
                        }
                    }
                    for (d, acc) in dots.iter_mut().zip(acc) {
                        *d = hsum(acc);
                    }
                }
            }

            /// Eight weight rows against one activation row (blocks `q`, scales `scales`).
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(in crate::q0) unsafe fn dot_weights(
                format: Format,
                ws: &[&[u8]; TILE],
                q: &[u8],
                sums16: &[i32],
                scales: &[f32],
            ) -> [f32; TILE] {
                let kb = scales.len();
                // Real checks: the loop reads kb blocks of every row through raw pointers.
                assert!(q.len() == kb * Q8_BYTES && sums16.len() == kb * 8);
                let wbytes = format.block_bytes();
                for w in ws {
                    assert!(w.len() == kb * wbytes);
                }
                let wp = ws.map(|w| w.as_ptr());
                // The eight rows are read side by side in short runs, which the hardware
                // prefetchers follow poorly: fetch the next eight rows (the next group, just
                // after these in memory) at the pace this group is read.
                let ahead = wp[0].wrapping_add(TILE * kb * wbytes);
                let mut acc = [_mm256_setzero_ps(); TILE];
                for b in 0..kb {
                    let next = ahead.wrapping_add(b * TILE * wbytes);
                    for line in 0..(TILE * wbytes).div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * line) as *const i8);
                    }
                    let y = q.as_ptr().add(b * Q8_BYTES + 2);
                    let dx = *scales.get_unchecked(b);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let wb = wp[i].add(b * wbytes);
                        let d = _mm256_set1_ps(f16_to_f32(wb) * dx);
                        let l = lanes(format, weights(format, wb), y, sums16.as_ptr().add(b * 8));
                        *acc = _mm256_fmadd_ps(d, l, *acc);
                    }
                }
                acc.map(|a| hsum(a))
            }

            #[inline]
            unsafe fn read_i16(p: *const u8) -> i16 {
                std::ptr::read_unaligned(p as *const i16)
            }

            /// A block's f16 scale. (Converting a broadcast keeps every lane in use; a
            /// one-lane convert let the compiler merge into an unrelated register and put
            /// the accumulator on the critical path.)
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_to_f32(p: *const u8) -> f32 {
                _mm256_cvtss_f32(_mm256_cvtph_ps(_mm_set1_epi16(read_i16(p))))
            }
        }
    };
}

// xu <= 31 and |y| <= 128 keep maddubs' pair sums (<= 7936) inside i16.
x86_kernels!(avx2, "avx2,fma,f16c", |xu, y| _mm256_madd_epi16(
    _mm256_maddubs_epi16(xu, y),
    _mm256_set1_epi16(1)
));
x86_kernels!(avx_vnni, "avx2,fma,f16c,avxvnni", |xu, y| {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), xu, y)
});
x86_kernels!(avx512_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", |xu, y| {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), xu, y)
});
