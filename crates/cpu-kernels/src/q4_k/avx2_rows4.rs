//! The AVX2 Q4_K kernel for four activation rows at once (prompt prefill and batches), with
//! its innermost loop written out in `asm!`.
//!
//! Why by hand: AVX2 has no u8 x i8 -> i32 dot, so every 32 products cost a `vpmaddubsw`
//! and a `vpaddw`, and the compiler's schedule of the intrinsics kernel (`x86.rs`) for four
//! rows spilled a third of its instructions (it hoisted one half tile's activation
//! broadcasts into stack slots for the other and reloaded them). Here one sub-block of both
//! half tiles (16 weight rows x 32 values) against the four rows is a straight run on the 16
//! vector registers: loads, nibble masks, each activation broadcast once for the 16 rows,
//! `vpmaddubsw` and `vpaddw` into eight i16 sums, then each sum times its sub-block scales
//! (`vpmaddwd`) added to the row's i32 sums in memory. The mins and f32 steps around it stay
//! intrinsics. (On Zen 4 an earlier both-halves run without the scales measured slower than
//! one half a pass; on Zen 3 this one is faster: `speed_cold_step`, both with the spread
//! prefetch, five alternating runs, medians: four rows 41.0 -> 37.0 ms, eight 77.5 -> 70.2.
//! `speed_tile_kernel` moves with code and data placement between builds, 1.19 -> 1.04 one
//! time, 1.12 -> 1.17 another, so it is no judge between two builds.) The arithmetic is
//! unchanged, llama.cpp's (see `dot_scalar`): the same integers (exact, whatever order they
//! are added in; a pair of sub-blocks' mins in one `vpmaddwd`), the same f32 operations in
//! the same order.

use super::{Tile, MT, PREFETCH_TILES, Q8K_BSUMS, Q8K_BYTES, TILE_BYTES, TILE_N};
use std::arch::asm;
use std::arch::x86_64::*;

/// `$s` = (first group of the sub-block) or += (the others) the products of `$w` and `$b`.
macro_rules! products {
    (first, $s:literal, $w:literal, $b:literal) => {
        concat!("vpmaddubsw {", $s, "}, {", $w, "}, {", $b, "}\n")
    };
    (add, $s:literal, $w:literal, $b:literal) => {
        concat!(
            "vpmaddubsw {p}, {",
            $w,
            "}, {",
            $b,
            "}\n",
            "vpaddw {",
            $s,
            "}, {",
            $s,
            "}, {p}\n",
        )
    };
}

/// One activation row's products with one group of eight values of both half tiles: the
/// row's four low-nibble activations (`$y` bytes into its sub-block) broadcast once for the
/// two halves' low nibbles, its four high ones (`$y + 4`) for their high nibbles.
macro_rules! row {
    ($yi:literal, $y:literal, $y4:literal, $s0:literal, $s1:literal, $how:ident) => {
        concat!(
            "vpbroadcastd {bl}, dword ptr [{",
            $yi,
            "} + ",
            $y,
            "]\n",
            "vpbroadcastd {bh}, dword ptr [{",
            $yi,
            "} + ",
            $y4,
            "]\n",
            products!($how, $s0, "l0", "bl"),
            products!(add, $s0, "h0", "bh"),
            products!($how, $s1, "l1", "bl"),
            products!(add, $s1, "h1", "bh"),
        )
    };
}

/// One group of eight values (`$w` bytes into the sub-block's weights: 16 rows x 4 bytes,
/// the first half tile's eight rows, then the second's; `$y` into each activation row's
/// sub-block): both halves unpacked to nibbles, then the four activation rows' products.
macro_rules! group {
    ($w:literal, $w32:literal, $y:literal, $y4:literal, $how:ident) => {
        concat!(
            "vmovdqu {l0}, ymmword ptr [{qs} + ",
            $w,
            "]\n",
            "vmovdqu {l1}, ymmword ptr [{qs} + ",
            $w32,
            "]\n",
            "vpsrlw {h0}, {l0}, 4\n",
            "vpsrlw {h1}, {l1}, 4\n",
            "vpand {l0}, {l0}, {mask}\n",
            "vpand {l1}, {l1}, {mask}\n",
            "vpand {h0}, {h0}, {mask}\n",
            "vpand {h1}, {h1}, {mask}\n",
            row!("y0", $y, $y4, "s00", "s01", $how),
            row!("y1", $y, $y4, "s10", "s11", $how),
            row!("y2", $y, $y4, "s20", "s21", $how),
            row!("y3", $y, $y4, "s30", "s31", $how),
        )
    };
}

/// One half tile's i16 sums against one activation row (`$s`) times the half's scales
/// (register `$sc`), written to (`first`) or added to (`add`) the row's i32 sums for the half
/// (`$at` bytes into `iblk`).
macro_rules! scale {
    ($how:ident, $s:literal, $sc:literal, $at:literal) => {
        concat!(
            "vpmaddwd {",
            $s,
            "}, {",
            $s,
            "}, {",
            $sc,
            "}\n",
            add_sums!($how, $s, $at),
            "vmovdqu ymmword ptr [{iblk} + ",
            $at,
            "], {",
            $s,
            "}\n",
        )
    };
}

/// For `add`: the row's i32 sums so far (`$at` bytes into `iblk`) added to `$s`.
macro_rules! add_sums {
    (first, $s:literal, $at:literal) => {
        ""
    };
    (add, $s:literal, $at:literal) => {
        concat!(
            "vpaddd {",
            $s,
            "}, {",
            $s,
            "}, ymmword ptr [{iblk} + ",
            $at,
            "]\n"
        )
    };
}

/// One sub-block in one `asm!`: `$how` is `first` (write `iblk`) or `add` (add to it).
macro_rules! sub_block_asm {
    ($how:ident, $qs:expr, $y:expr, $sc:expr, $iblk:expr) => {
        asm!(
            group!(0, 32, 0, 4, first),
            group!(64, 96, 8, 12, add),
            group!(128, 160, 16, 20, add),
            group!(192, 224, 24, 28, add),
            // The 16 rows' scales as i16 pairs (s_r, s_r), the first half tile's eight rows
            // in `l1`, the second's in `h0`: both 128-bit lanes hold the 16 bytes, and each
            // lane's shuffle picks its four rows.
            "vbroadcasti128 {l0}, xmmword ptr [{sc}]",
            "vpshufb {l1}, {l0}, ymmword ptr [{dup}]",
            "vpshufb {h0}, {l0}, ymmword ptr [{dup} + 32]",
            scale!($how, "s00", "l1", 0),
            scale!($how, "s01", "h0", 32),
            scale!($how, "s10", "l1", 64),
            scale!($how, "s11", "h0", 96),
            scale!($how, "s20", "l1", 128),
            scale!($how, "s21", "h0", 160),
            scale!($how, "s30", "l1", 192),
            scale!($how, "s31", "h0", 224),
            qs = in(reg) $qs,
            y0 = in(reg) $y[0],
            y1 = in(reg) $y[1],
            y2 = in(reg) $y[2],
            y3 = in(reg) $y[3],
            sc = in(reg) $sc,
            dup = in(reg) DUP_SCALES.0.as_ptr(),
            iblk = in(reg) $iblk,
            mask = in(ymm_reg) _mm256_set1_epi8(0x0f),
            s00 = out(ymm_reg) _,
            s01 = out(ymm_reg) _,
            s10 = out(ymm_reg) _,
            s11 = out(ymm_reg) _,
            s20 = out(ymm_reg) _,
            s21 = out(ymm_reg) _,
            s30 = out(ymm_reg) _,
            s31 = out(ymm_reg) _,
            l0 = out(ymm_reg) _,
            l1 = out(ymm_reg) _,
            h0 = out(ymm_reg) _,
            h1 = out(ymm_reg) _,
            bl = out(ymm_reg) _,
            bh = out(ymm_reg) _,
            p = out(ymm_reg) _,
            options(nostack, preserves_flags),
        )
    };
}

/// `vpshufb` controls turning a sub-block's 16 scale bytes (one per weight row, in both
/// 128-bit lanes) into i16 pairs (s_r, s_r), as `vpmaddwd` multiplies a row's two i16 sums:
/// rows 0-7 (0-3 from the low lane, 4-7 from the high), then rows 8-15.
#[repr(C, align(32))]
struct Shuffles([u8; 64]);
static DUP_SCALES: Shuffles = {
    let mut c = [0x80u8; 64];
    let mut i = 0;
    while i < 16 {
        // Control vector i / 8 (half tile), its 16-byte lane (i / 4) % 2, row i's four bytes.
        let at = (i / 8) * 32 + ((i / 4) % 2) * 16 + (i % 4) * 4;
        c[at] = i as u8;
        c[at + 2] = i as u8;
        i += 1;
    }
    Shuffles(c)
};

/// The i16 sums of one sub-block of both half tiles (16 weight rows x 32 values, at `qs`)
/// against four activation rows (`y[i]` at row i's 32 activations of the sub-block), times
/// the sub-block's scales (`sc`: its 16 bytes, one per weight row), written to (`FIRST`) or
/// added to `iblk` (i32 sums, `[row][half]`).
///
/// Why this shape: on Zen 3 one `vpmaddubsw` of the former kernel (one half tile a pass)
/// cost 1.19-1.33 cycles, about 0.5 of them outside the products (`speed_tile_kernel` with
/// the `asm!` emptied), and within the products the broadcasts and nibble masks were as many
/// instructions as the multiplies. Both halves in one pass use each broadcast twice; the 16
/// registers hold the eight sums, four unpacked weight vectors, two broadcasts, a product and
/// the mask.
///
/// # Safety
/// AVX2; `qs` readable for 4 x 64 bytes, each `y[i]` for 32 bytes, `sc` for 16.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sub_block<const FIRST: bool>(
    qs: *const u8,
    y: [*const u8; MT],
    sc: *const u8,
    iblk: &mut [[__m256i; 2]; MT],
) {
    let iblk = iblk.as_mut_ptr();
    // SAFETY: the caller's bounds; the block reads memory, writes `iblk` and touches only
    // its operands.
    if FIRST {
        sub_block_asm!(first, qs, y, sc, iblk);
    } else {
        sub_block_asm!(add, qs, y, sc, iblk);
    }
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
    if gemm.contains(&true) {
        blocks::<true>(tiles, acts, gemm)
    } else {
        blocks::<false>(tiles, acts, gemm)
    }
}

/// [`dot`], with `PAIRS` when some row rounds like llama.cpp's gemm (its f32 steps every 64
/// values); without, every row steps once a block (its gemv: batched decode rows), and the
/// mins and f32 work run once a block rather than after each pair of sub-blocks.
///
/// Why: with the sub-blocks' products at their pace, the per-pair work around them (the
/// mins, the f32 steps, a branch per row, vectors kept across the `asm!` in stack slots)
/// was a third of the kernel's instructions (`speed_tile_kernel`, k = 1536, gemv rows 1.07
/// -> 0.90 cycles a `vpmaddubsw`, gemm 1.20 -> 1.06).
///
/// # Safety
/// As [`dot`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks<const PAIRS: bool>(
    tiles: &[Tile],
    acts: &[&[u8]],
    gemm: [bool; MT],
) -> [[f32; TILE_N]; MT] {
    const M: usize = MT;
    debug_assert!(acts.len() == M);
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut acc_min = [[_mm256_setzero_ps(); 2]; M];
    let mut iblk = [[_mm256_setzero_si256(); 2]; M];
    for (b, tile) in tiles.iter().enumerate() {
        // Two tiles ahead, into L2, a fifth of the tile before each sub-block (the last
        // three asks reach past the tile, into the one after it). Asked for at once at the
        // tile's start, most of its 37 lines came as if not asked for (`speed_cold_step`,
        // six alternating runs, medians: four rows 49.6 -> 37.8 ms a step, eight rows 80.7
        // -> 73.0): a core tracks only so many misses at a time and drops the hints past
        // them. Into L2: asked for at once, lines into L1 crowded out the ones the tile was
        // reading.
        let ahead = (tile as *const Tile as *const u8).wrapping_add(PREFETCH_TILES * TILE_BYTES);
        let q: [*const u8; M] = std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
        // Each row's eight sub-block sums (two i16 sums of 16 each, added: |sum| <= 4064),
        // as i16 pairs: entry p holds sub-blocks 2p and 2p + 1.
        let mut bsum_pairs = [[0i32; 4]; M];
        for (q, pairs) in q.iter().zip(&mut bsum_pairs) {
            let s = _mm256_loadu_si256(q.add(Q8K_BSUMS) as *const __m256i);
            let s = _mm_hadd_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            _mm_storeu_si128(pairs.as_mut_ptr() as *mut __m128i, s);
        }
        // Under `PAIRS`, a gemv row's integer sums of the pairs before the last (exact in
        // any order) wait here for its one step a block.
        let mut carry = [[_mm256_setzero_si256(); 2]; M];
        let mut carry_min = [[_mm256_setzero_si256(); 2]; M];
        for p in 0..4 {
            for sub in [2 * p, 2 * p + 1] {
                for line in 0..5 {
                    let at = ahead.wrapping_add(320 * sub + 64 * line);
                    _mm_prefetch::<_MM_HINT_T1>(at as *const i8);
                }
                let qs = tile.qs.as_ptr().add(sub * 4 * TILE_N * 4);
                let sc = tile.sc[sub].as_ptr();
                let y: [*const u8; M] = std::array::from_fn(|i| q[i].add(4 + 32 * sub));
                if sub == 2 * p && (PAIRS || p == 0) {
                    sub_block::<true>(qs, y, sc, &mut iblk);
                } else {
                    sub_block::<false>(qs, y, sc, &mut iblk);
                }
            }
            if !PAIRS && p != 3 {
                continue;
            }
            // Each half tile's eight `d` and `dmin`, as f32.
            let half = |v: &[u16; TILE_N], h: usize| {
                _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(8 * h) as *const __m128i))
            };
            let (d, dmin) = (
                [half(&tile.d, 0), half(&tile.d, 1)],
                [half(&tile.dmin, 0), half(&tile.dmin, 1)],
            );
            // The pairs' mins as i16 pairs (m_2p, m_2p+1) per half tile: one `vpmaddwd`
            // with a row's pair of activation sums is m_2p * s_2p + m_2p+1 * s_2p+1, the
            // integer the sub-block steps add.
            let pairs = if PAIRS { p..p + 1 } else { 0..4 };
            let mut mins = [[_mm256_setzero_si256(); 2]; 4];
            for pair in pairs.clone() {
                for (h, mins) in mins[pair].iter_mut().enumerate() {
                    let at = |sub: usize| tile.mn[sub].as_ptr().add(8 * h) as *const __m128i;
                    *mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(
                        _mm_loadl_epi64(at(2 * pair)),
                        _mm_loadl_epi64(at(2 * pair + 1)),
                    ));
                }
            }
            for i in 0..M {
                let mut imin = [_mm256_setzero_si256(); 2];
                for pair in pairs.clone() {
                    let s = _mm256_set1_epi32(bsum_pairs[i][pair]);
                    for (imin, mins) in imin.iter_mut().zip(&mins[pair]) {
                        *imin = _mm256_add_epi32(*imin, _mm256_madd_epi16(*mins, s));
                    }
                }
                let mut isum = iblk[i];
                if PAIRS && !gemm[i] {
                    for h in 0..2 {
                        carry[i][h] = _mm256_add_epi32(carry[i][h], isum[h]);
                        carry_min[i][h] = _mm256_add_epi32(carry_min[i][h], imin[h]);
                    }
                    if p != 3 {
                        continue;
                    }
                    (isum, imin) = (carry[i], carry_min[i]);
                }
                let dall = _mm256_set1_ps(std::ptr::read_unaligned(q[i] as *const f32));
                for h in 0..2 {
                    // The products llama.cpp forms at every step (the same floats each time).
                    let (d, dmin) = (_mm256_mul_ps(d[h], dall), _mm256_mul_ps(dmin[h], dall));
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), d, acc[i][h]);
                    acc_min[i][h] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[h]), dmin, acc_min[i][h]);
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
