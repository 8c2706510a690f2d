//! The AVX2 Q4_K kernel for four activation rows at once (prompt prefill and batches), with
//! its innermost loop written out in `asm!`.
//!
//! Why by hand: AVX2 has no u8 x i8 -> i32 dot, so every 32 products cost a `vpmaddubsw`
//! and a `vpaddw`; a Zen 4 core retires about 1.5 such pairs a cycle (measured with a
//! register-only loop), and the compiler's schedule of the intrinsics kernel (`x86.rs`) for
//! four rows reached 0.56: it hoisted the activation broadcasts of one half tile into stack
//! slots for the other and reloaded them, a third of its instructions spills. Here one
//! sub-block of one half tile (eight weight rows x 32 values) against the four rows is a
//! straight run of loads, nibble masks, broadcasts, `vpmaddubsw` and `vpaddw` on registers
//! only (1.2 pairs a cycle alone); the scales, mins and f32 steps around it stay intrinsics,
//! with each step's `d * d_y` formed once per block. (Both half tiles in one run, sharing
//! the broadcasts, needs all 16 registers and measured slower.) The arithmetic is unchanged,
//! llama.cpp's (see `dot_scalar`): the same i16 sums per sub-block, the same integers (a
//! pair of sub-blocks' mins in one `vpmaddwd`), the same f32 operations in the same order.

use super::{Tile, MT, PREFETCH_TILES, Q8K_BSUMS, Q8K_BYTES, TILE_BYTES, TILE_N};
use std::arch::asm;
use std::arch::x86_64::*;

/// One group of eight values (`$w` bytes into the half tile's sub-block, `$y` into each
/// activation row's sub-block): the low nibbles meet activations `$y..$y+4`, the high ones
/// `$y+4..$y+8`, and each row's products add to its i16 sums.
macro_rules! group {
    ($w:literal, $y:literal, $y4:literal) => {
        concat!(
            "vmovdqu {w}, ymmword ptr [{qs} + ",
            $w,
            "]\n",
            "vpsrlw {hi}, {w}, 4\n",
            "vpand {w}, {w}, {mask}\n",
            "vpand {hi}, {hi}, {mask}\n",
            "vpbroadcastd {t0}, dword ptr [{y0} + ",
            $y,
            "]\n",
            "vpbroadcastd {t1}, dword ptr [{y0} + ",
            $y4,
            "]\n",
            "vpmaddubsw {t0}, {w}, {t0}\n",
            "vpmaddubsw {t1}, {hi}, {t1}\n",
            "vpaddw {s0}, {s0}, {t0}\n",
            "vpaddw {s0}, {s0}, {t1}\n",
            "vpbroadcastd {t2}, dword ptr [{y1} + ",
            $y,
            "]\n",
            "vpbroadcastd {t3}, dword ptr [{y1} + ",
            $y4,
            "]\n",
            "vpmaddubsw {t2}, {w}, {t2}\n",
            "vpmaddubsw {t3}, {hi}, {t3}\n",
            "vpaddw {s1}, {s1}, {t2}\n",
            "vpaddw {s1}, {s1}, {t3}\n",
            "vpbroadcastd {t0}, dword ptr [{y2} + ",
            $y,
            "]\n",
            "vpbroadcastd {t1}, dword ptr [{y2} + ",
            $y4,
            "]\n",
            "vpmaddubsw {t0}, {w}, {t0}\n",
            "vpmaddubsw {t1}, {hi}, {t1}\n",
            "vpaddw {s2}, {s2}, {t0}\n",
            "vpaddw {s2}, {s2}, {t1}\n",
            "vpbroadcastd {t2}, dword ptr [{y3} + ",
            $y,
            "]\n",
            "vpbroadcastd {t3}, dword ptr [{y3} + ",
            $y4,
            "]\n",
            "vpmaddubsw {t2}, {w}, {t2}\n",
            "vpmaddubsw {t3}, {hi}, {t3}\n",
            "vpaddw {s3}, {s3}, {t2}\n",
            "vpaddw {s3}, {s3}, {t3}\n",
        )
    };
}

/// The i16 sums (pairs of products side by side per row's 4-byte lane, as `vpmaddubsw` leaves
/// them) of one sub-block of one half tile against four activation rows. `qs` points at the
/// half tile's first group of the sub-block (groups 64 bytes apart), `y[i]` at row i's 32
/// activations of the sub-block.
///
/// # Safety
/// AVX2; `qs` readable for 4 x 64 bytes (32 used of each), each `y[i]` for 32 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sub_block(qs: *const u8, y: [*const u8; 4], mask: __m256i) -> [__m256i; 4] {
    let zero = _mm256_setzero_si256();
    let (mut s0, mut s1, mut s2, mut s3) = (zero, zero, zero, zero);
    // SAFETY: the caller's bounds; the block reads memory and touches only its operands.
    asm!(
        group!(0, 0, 4),
        group!(64, 8, 12),
        group!(128, 16, 20),
        group!(192, 24, 28),
        qs = in(reg) qs,
        y0 = in(reg) y[0],
        y1 = in(reg) y[1],
        y2 = in(reg) y[2],
        y3 = in(reg) y[3],
        mask = in(ymm_reg) mask,
        s0 = inout(ymm_reg) s0,
        s1 = inout(ymm_reg) s1,
        s2 = inout(ymm_reg) s2,
        s3 = inout(ymm_reg) s3,
        w = out(ymm_reg) _,
        hi = out(ymm_reg) _,
        t0 = out(ymm_reg) _,
        t1 = out(ymm_reg) _,
        t2 = out(ymm_reg) _,
        t3 = out(ymm_reg) _,
        options(nostack, readonly, preserves_flags),
    );
    [s0, s1, s2, s3]
}

/// The eight u8 at `p` as i16 lanes, each twice: the pairs `vpmaddwd` multiplies.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dup_i16(p: *const u8) -> __m256i {
    let x = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, x))
}

/// `tiles` (16 weight rows) against the four activation rows `acts`; the same results as
/// the intrinsics kernel bit for bit.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `acts` holds four rows of `tiles.len()` Q8_K
/// blocks (`dot_tiles` checks).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::q4_k) unsafe fn dot(
    tiles: &[Tile],
    acts: &[&[u8]],
    gemm: [bool; MT],
) -> [[f32; TILE_N]; MT] {
    const M: usize = 4;
    debug_assert!(acts.len() == M);
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut acc_min = [[_mm256_setzero_ps(); 2]; M];
    for (b, tile) in tiles.iter().enumerate() {
        // Into L2, not L1 (`speed_cold_step`, eight decode rows, alternating runs: 72-75 ms a
        // step with T0, 60 with T1; `q4_k speed` 512 rows no slower): 37 lines a tile asked
        // into L1 at once crowd out the lines this tile is reading; L2 holds them until then.
        let ahead = (tile as *const Tile as *const u8).wrapping_add(PREFETCH_TILES * TILE_BYTES);
        for line in 0..TILE_BYTES / 64 {
            _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * line) as *const i8);
        }
        let q: [*const u8; M] = std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
        // Each row's eight sub-block sums (two i16 sums of 16 each, added: |sum| <= 4064),
        // as i16 pairs: entry p holds sub-blocks 2p and 2p + 1.
        let mut bsum_pairs = [[0i32; 4]; M];
        for (i, pairs) in bsum_pairs.iter_mut().enumerate() {
            let s = _mm256_loadu_si256(q[i].add(Q8K_BSUMS) as *const __m256i);
            let sums = _mm_hadd_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            _mm_storeu_si128(pairs.as_mut_ptr() as *mut __m128i, sums);
        }
        let dall: [__m256; M] =
            std::array::from_fn(|i| _mm256_set1_ps(std::ptr::read_unaligned(q[i] as *const f32)));
        for h in 0..2 {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(tile.d.as_ptr().add(8 * h) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(
                tile.dmin.as_ptr().add(8 * h) as *const __m128i
            ));
            // The products llama.cpp forms at every step (the same floats each time).
            let d_all: [__m256; M] = std::array::from_fn(|i| _mm256_mul_ps(d, dall[i]));
            let dmin_all: [__m256; M] = std::array::from_fn(|i| _mm256_mul_ps(dmin, dall[i]));
            let mut iblk = [_mm256_setzero_si256(); M];
            let mut imin = [_mm256_setzero_si256(); M];
            for p in 0..4 {
                for sub in [2 * p, 2 * p + 1] {
                    let y = std::array::from_fn(|i| q[i].add(4 + 32 * sub));
                    let isum =
                        sub_block(tile.qs.as_ptr().add(sub * 4 * TILE_N * 4 + 32 * h), y, mask);
                    let sc = dup_i16(tile.sc[sub].as_ptr().add(8 * h));
                    for i in 0..M {
                        iblk[i] = _mm256_add_epi32(iblk[i], _mm256_madd_epi16(isum[i], sc));
                    }
                }
                // The pair's mins per row as i16 pairs (m_2p, m_2p+1): one `vpmaddwd` with
                // the pair's activation sums is m_2p * s_2p + m_2p+1 * s_2p+1, the integer
                // the sub-block steps add.
                let mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(
                    _mm_loadl_epi64(tile.mn[2 * p].as_ptr().add(8 * h) as *const __m128i),
                    _mm_loadl_epi64(tile.mn[2 * p + 1].as_ptr().add(8 * h) as *const __m128i),
                ));
                for (imin, pairs) in imin.iter_mut().zip(&bsum_pairs) {
                    let s = _mm256_set1_epi32(pairs[p]);
                    *imin = _mm256_add_epi32(*imin, _mm256_madd_epi16(mn, s));
                }
                // llama.cpp's gemm rows add every 64 values, its gemv rows every block.
                for i in 0..M {
                    if !gemm[i] && p != 3 {
                        continue;
                    }
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iblk[i]), d_all[i], acc[i][h]);
                    acc_min[i][h] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[i]), dmin_all[i], acc_min[i][h]);
                    iblk[i] = _mm256_setzero_si256();
                    imin[i] = _mm256_setzero_si256();
                }
            }
        }
    }
    let mut out = [[0f32; TILE_N]; MT];
    for i in 0..M {
        for h in 0..2 {
            _mm256_storeu_ps(
                out[i].as_mut_ptr().add(8 * h),
                _mm256_sub_ps(acc[i][h], acc_min[i][h]),
            );
        }
    }
    out
}
