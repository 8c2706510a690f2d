//! The x86 Q4_K kernels: 512-bit (AVX512-VNNI) and 256-bit (AVX-VNNI, AVX2), each with
//! llama.cpp's per-lane arithmetic (see `dot_scalar`).

use super::{Tile, MT, PREFETCH_TILES, Q8K_BSUMS, Q8K_BYTES, TILE_BYTES, TILE_N};

pub(super) mod avx512 {
    use super::{Tile, MT, PREFETCH_TILES, Q8K_BSUMS, Q8K_BYTES, TILE_BYTES, TILE_N};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn bcast4(q: *const u8, off: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(q.add(off) as *const i32))
    }

    #[inline(always)]
    unsafe fn wide_i32(p: &[u8; TILE_N]) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.as_ptr() as *const __m128i))
    }

    #[inline(always)]
    unsafe fn bsum(q: *const u8, sub: usize) -> i32 {
        let p = q.add(Q8K_BSUMS + 4 * sub) as *const i16;
        std::ptr::read_unaligned(p) as i32 + std::ptr::read_unaligned(p.add(1)) as i32
    }

    /// `tiles` (16 weight rows) against the `M` activation rows `acts` (Q8_K blocks).
    ///
    /// # Safety
    /// The CPU must support AVX512F, AVX512BW and AVX512-VNNI; `acts` holds `M` rows of
    /// `tiles.len()` Q8_K blocks (`dot_tiles` checks).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(in crate::q4_k) unsafe fn dot<const M: usize>(
        tiles: &[Tile],
        acts: &[&[u8]],
        gemm: [bool; MT],
    ) -> [[f32; TILE_N]; MT] {
        debug_assert!(acts.len() == M && M <= MT);
        let mask = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); M];
        let mut acc_min = [_mm512_setzero_ps(); M];
        for (b, tile) in tiles.iter().enumerate() {
            let mut iblk = [_mm512_setzero_si512(); M];
            let mut imin = [_mm512_setzero_si512(); M];
            let ahead =
                (tile as *const Tile as *const u8).wrapping_add(PREFETCH_TILES * TILE_BYTES);
            let q: [*const u8; M] = std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tile.dmin.as_ptr() as *const __m256i));
            let qs = tile.qs.as_ptr();
            // Sub-blocks in pairs, with independent integer sums (as candle).
            for sub2 in 0..4 {
                for line in sub2 * 10..(sub2 * 10 + 10).min(TILE_BYTES / 64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
                }
                let (sa, sb) = (2 * sub2, 2 * sub2 + 1);
                let mut isum_a = [_mm512_setzero_si512(); M];
                let mut isum_b = [_mm512_setzero_si512(); M];
                for g4 in 0..4 {
                    let (ga, gb) = (sa * 4 + g4, sb * 4 + g4);
                    let wa = _mm512_loadu_si512(qs.add(ga * TILE_N * 4) as *const _);
                    let wb = _mm512_loadu_si512(qs.add(gb * TILE_N * 4) as *const _);
                    let lo_a = _mm512_and_si512(wa, mask);
                    let hi_a = _mm512_and_si512(_mm512_srli_epi16(wa, 4), mask);
                    let lo_b = _mm512_and_si512(wb, mask);
                    let hi_b = _mm512_and_si512(_mm512_srli_epi16(wb, 4), mask);
                    for i in 0..M {
                        let y = q[i].add(4);
                        isum_a[i] = _mm512_dpbusd_epi32(isum_a[i], lo_a, bcast4(y, ga * 8));
                        isum_a[i] = _mm512_dpbusd_epi32(isum_a[i], hi_a, bcast4(y, ga * 8 + 4));
                        isum_b[i] = _mm512_dpbusd_epi32(isum_b[i], lo_b, bcast4(y, gb * 8));
                        isum_b[i] = _mm512_dpbusd_epi32(isum_b[i], hi_b, bcast4(y, gb * 8 + 4));
                    }
                }
                for (sub, isum) in [(sa, &isum_a), (sb, &isum_b)] {
                    let (sc, mn) = (wide_i32(&tile.sc[sub]), wide_i32(&tile.mn[sub]));
                    for i in 0..M {
                        iblk[i] = _mm512_add_epi32(iblk[i], _mm512_mullo_epi32(isum[i], sc));
                        let s = _mm512_set1_epi32(bsum(q[i], sub));
                        imin[i] = _mm512_add_epi32(imin[i], _mm512_mullo_epi32(mn, s));
                    }
                }
                // llama.cpp's gemm rows add every 64 values, its gemv rows every block.
                for i in 0..M {
                    if gemm[i] || sub2 == 3 {
                        let dall = _mm512_set1_ps(std::ptr::read_unaligned(q[i] as *const f32));
                        let (f, fm) = (_mm512_cvtepi32_ps(iblk[i]), _mm512_cvtepi32_ps(imin[i]));
                        acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dall), acc[i]);
                        acc_min[i] = _mm512_fmadd_ps(fm, _mm512_mul_ps(dmin, dall), acc_min[i]);
                        iblk[i] = _mm512_setzero_si512();
                        imin[i] = _mm512_setzero_si512();
                    }
                }
            }
        }
        let mut out = [[0f32; TILE_N]; MT];
        for i in 0..M {
            _mm512_storeu_ps(out[i].as_mut_ptr(), _mm512_sub_ps(acc[i], acc_min[i]));
        }
        out
    }
}

/// The 256-bit kernels: each 16-row tile as two halves of eight rows. `$dot(acc, w, y)` adds
/// the products of the unsigned bytes of `w` with the signed bytes of `y` to `acc` (one
/// sub-block of 32 weights accumulates before it is scaled: 8 products per lane);
/// `$scaled(acc, $scales(p))` is the i32 sum of each row's 4-byte lanes times that row's scale
/// (the eight u8 at `p`).
macro_rules! kernels256 {
    ($module:ident, $features:literal, $dot:expr, $scales:expr, $scaled:expr) => {
        pub(super) mod $module {
            use super::{Tile, MT, PREFETCH_TILES, Q8K_BSUMS, Q8K_BYTES, TILE_BYTES, TILE_N};
            use std::arch::x86_64::*;

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn bcast4(q: *const u8, off: usize) -> __m256i {
                _mm256_set1_epi32(std::ptr::read_unaligned(q.add(off) as *const i32))
            }

            /// The eight u8 at `p` as i32 lanes (the VNNI kernel's scales).
            #[allow(dead_code)]
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn wide_i32(p: *const u8) -> __m256i {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
            }

            /// The eight u8 at `p` as i16 lanes, each twice: the pairs `madd` multiplies.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dup_i16(p: *const u8) -> __m256i {
                let x = _mm_loadl_epi64(p as *const __m128i);
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, x))
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dp(acc: __m256i, w: __m256i, y: __m256i) -> __m256i {
                #[allow(clippy::redundant_closure_call)]
                ($dot)(acc, w, y)
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scales(p: *const u8) -> __m256i {
                #[allow(clippy::redundant_closure_call)]
                ($scales)(p)
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scaled(acc: __m256i, scales: __m256i) -> __m256i {
                #[allow(clippy::redundant_closure_call)]
                ($scaled)(acc, scales)
            }

            /// `tiles` (16 weight rows) against the `M` activation rows `acts`.
            ///
            /// # Safety
            /// The CPU must support `$features`; `acts` holds `M` rows of `tiles.len()` Q8_K
            /// blocks (`dot_tiles` checks).
            #[target_feature(enable = $features)]
            pub(in crate::q4_k) unsafe fn dot<const M: usize>(
                tiles: &[Tile],
                acts: &[&[u8]],
                gemm: [bool; MT],
            ) -> [[f32; TILE_N]; MT] {
                debug_assert!(acts.len() == M && M <= MT);
                let mask = _mm256_set1_epi8(0x0f);
                let mut acc = [[_mm256_setzero_ps(); 2]; M];
                let mut acc_min = [[_mm256_setzero_ps(); 2]; M];
                for (b, tile) in tiles.iter().enumerate() {
                    let mut iblk = [[_mm256_setzero_si256(); 2]; M];
                    let mut imin = [[_mm256_setzero_si256(); 2]; M];
                    let ahead = (tile as *const Tile as *const u8)
                        .wrapping_add(PREFETCH_TILES * TILE_BYTES);
                    let q: [*const u8; M] =
                        std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
                    let qs = tile.qs.as_ptr();
                    for sub in 0..8 {
                        for line in (sub * 5..sub * 5 + 5).take_while(|l| *l < TILE_BYTES / 64) {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
                        }
                        // One half tile (eight rows) at a time: its M sums, the weights and
                        // a broadcast fit the 16 registers (both halves' sums at once were
                        // spilled, every add a store and a reload). Each sum sees the same
                        // products in the same order either way.
                        for h in 0..2 {
                            let mut isum = [_mm256_setzero_si256(); M];
                            for g4 in 0..4 {
                                let g = sub * 4 + g4;
                                let w = _mm256_loadu_si256(
                                    qs.add(g * TILE_N * 4 + h * 32) as *const __m256i
                                );
                                let lo = _mm256_and_si256(w, mask);
                                let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                                for i in 0..M {
                                    let y = q[i].add(4);
                                    isum[i] = dp(isum[i], lo, bcast4(y, g * 8));
                                    isum[i] = dp(isum[i], hi, bcast4(y, g * 8 + 4));
                                }
                            }
                            let sc = scales(tile.sc[sub].as_ptr().add(8 * h));
                            let mn = dup_i16(tile.mn[sub].as_ptr().add(8 * h));
                            for i in 0..M {
                                // The sub-block's two i16 sums side by side: `madd` with
                                // each row's min twice gives min * (sum + sum), exactly.
                                let bsums = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    q[i].add(Q8K_BSUMS + 4 * sub) as *const i32,
                                ));
                                iblk[i][h] = _mm256_add_epi32(iblk[i][h], scaled(isum[i], sc));
                                imin[i][h] =
                                    _mm256_add_epi32(imin[i][h], _mm256_madd_epi16(mn, bsums));
                            }
                        }
                        // llama.cpp's gemm rows add every 64 values, its gemv rows
                        // every block.
                        for h in 0..2 {
                            let d = _mm256_cvtph_ps(_mm_loadu_si128(
                                tile.d.as_ptr().add(8 * h) as *const __m128i
                            ));
                            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(
                                tile.dmin.as_ptr().add(8 * h) as *const __m128i,
                            ));
                            for i in 0..M {
                                if !(gemm[i] && sub % 2 == 1) && sub != 7 {
                                    continue;
                                }
                                let dall =
                                    _mm256_set1_ps(std::ptr::read_unaligned(q[i] as *const f32));
                                acc[i][h] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(iblk[i][h]),
                                    _mm256_mul_ps(d, dall),
                                    acc[i][h],
                                );
                                acc_min[i][h] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(imin[i][h]),
                                    _mm256_mul_ps(dmin, dall),
                                    acc_min[i][h],
                                );
                                iblk[i][h] = _mm256_setzero_si256();
                                imin[i][h] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                let mut out = [[0f32; TILE_N]; MT];
                for i in 0..M {
                    _mm256_storeu_ps(out[i].as_mut_ptr(), _mm256_sub_ps(acc[i][0], acc_min[i][0]));
                    _mm256_storeu_ps(
                        out[i].as_mut_ptr().add(8),
                        _mm256_sub_ps(acc[i][1], acc_min[i][1]),
                    );
                }
                out
            }
        }
    };
}

// AVX2 has no u8 x i8 -> i32 dot: maddubs gives i16 pairs (u4 x i8, |pair| <= 2 * 15 * 128 =
// 3840, so it never saturates), and a sub-block's 8 of them add up in i16 (<= 30720 < 32767);
// one madd with each row's scale twice then widens and scales them at once (|sum * scale| <=
// 2 * 30720 * 63 fits i32). The same integers as widening every product and multiplying in
// i32 (so the same floats: the scalar-order tests still hold bit for bit), at a quarter of
// the widening work and without the slow 32-bit multiplies.
kernels256!(
    avx2,
    "avx2,fma,f16c",
    |acc, w, y| _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, y)),
    |p| dup_i16(p),
    |acc, sc| _mm256_madd_epi16(acc, sc)
);
kernels256!(
    avx_vnni,
    "avx2,fma,f16c,avxvnni",
    |acc, w, y| { _mm256_dpbusd_avx_epi32(acc, w, y) },
    |p| wide_i32(p),
    |acc, sc| _mm256_mullo_epi32(acc, sc)
);
