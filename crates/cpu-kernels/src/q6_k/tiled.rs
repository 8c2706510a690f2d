//! Q6_K products for the activation rows that round like llama.cpp's tiled kernel (rows of
//! a sequence of eight and more: prefills and long extends).
//!
//! For those rows only each 256-value block's exact integer sum matters (`tacc = fma(d_w *
//! isum, d_x, tacc)`), not the eight lanes of the vec_dot arithmetic, so the products may be
//! summed in any order. The row-at-a-time kernels of `x86.rs` scale every 64 (AVX-512) or 32
//! (AVX2) products with a multiply and unpack each weight block for at most eight activation
//! rows; at 512 rows that made Q6_K three times slower per product than candle's repacked
//! path. Here the weights of 16 rows are unpacked once into tiles laid out like the Q4_K
//! ones (`[4 values][16 rows][4 bytes]`: one broadcast of four activations meets 16 rows),
//! kept in a worker's scratch and reused by every activation row, and a 16-value scale group
//! is scaled once: `isum = sum_j sc_j * (sum_{v in j} q_v y_v - 32 * bsum_j)` (the stored
//! values are the weights plus 32).

use super::{Kernel, Q6K_BYTES, Q6K_QH, Q6K_SCALES, Q8K_BSUMS, Q8K_BYTES, QK_K};
use crate::SharedMut;

/// Weight rows per tile.
const TILE_N: usize = 16;
/// Activation rows per pass over a group's tiles.
const MT: usize = 4;
/// Tiled activation rows from which unpacking pays (below, the row kernels run).
pub(super) const MIN_ROWS: usize = 32;

/// 16 weight rows by one block, unpacked.
#[derive(Clone)]
#[repr(C, align(64))]
struct Tile {
    /// `[group of 4 values (64)][row (16)][4]`: the stored values (weight + 32, 0..64).
    qs: [u8; QK_K * TILE_N],
    /// `[16-value group (16)][row (16)]` scales.
    sc: [[i8; TILE_N]; 16],
    /// Each row's `d` as f32.
    d: [f32; TILE_N],
}

const EMPTY: Tile = Tile {
    qs: [0; QK_K * TILE_N],
    sc: [[0; TILE_N]; 16],
    d: [0.0; TILE_N],
};

/// The 256 stored values of a Q6_K block, in order.
fn block_values(blk: &[u8]) -> [u8; QK_K] {
    let mut v = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh) = (&blk[half * 64..], &blk[Q6K_QH + half * 32..]);
        for c in 0..4 {
            for j in 0..32 {
                let lo = (ql[(c % 2) * 32 + j] >> (4 * (c / 2))) & 0x0f;
                v[half * 128 + c * 32 + j] = lo | (((qh[j] >> (2 * c)) & 3) << 4);
            }
        }
    }
    v
}

/// Unpack rows `r0..r0 + 16` (the last row repeated past `n`) into `tiles` (one per block).
fn unpack(w: &[u8], n: usize, kb: usize, r0: usize, tiles: &mut [Tile]) {
    for r in 0..TILE_N {
        let row = (r0 + r).min(n - 1);
        for (b, tile) in tiles.iter_mut().enumerate() {
            let at = (row * kb + b) * Q6K_BYTES;
            let blk = &w[at..at + Q6K_BYTES];
            let v = block_values(blk);
            for g in 0..QK_K / 4 {
                tile.qs[(g * TILE_N + r) * 4..][..4].copy_from_slice(&v[4 * g..4 * g + 4]);
            }
            for j in 0..16 {
                tile.sc[j][r] = blk[Q6K_SCALES + j] as i8;
            }
            tile.d[r] = super::block_d(blk);
        }
    }
}

/// `out[a * n + c]` for every activation row `a` of `rows` and every weight row `c`, with
/// `lhs` the Q8_K blocks of all activation rows (`kb` per row).
pub(super) fn matmul(
    kernel: Kernel,
    w: &[u8],
    n: usize,
    kb: usize,
    lhs: &[u8],
    rows: &[usize],
    out: SharedMut<f32>,
) {
    let groups = n.div_ceil(TILE_N);
    super::par_chunks(groups, usize::MAX, |range| {
        let mut tiles = vec![EMPTY; kb];
        for g in range {
            unpack(w, n, kb, g * TILE_N, &mut tiles);
            let cols = TILE_N.min(n - g * TILE_N);
            for chunk in rows.chunks(MT) {
                let acts: [&[u8]; MT] = std::array::from_fn(|i| {
                    let a = chunk[i.min(chunk.len() - 1)];
                    &lhs[a * kb * Q8K_BYTES..(a + 1) * kb * Q8K_BYTES]
                });
                let res = dot(kernel, &tiles, &acts[..chunk.len()]);
                for (a, res) in chunk.iter().zip(&res) {
                    for (c, v) in res.iter().take(cols).enumerate() {
                        // SAFETY: group g alone writes columns g*16..g*16+16; `out` holds
                        // every row of `rows` and outlives the call.
                        unsafe { *out.get().add(a * n + g * TILE_N + c) = *v };
                    }
                }
            }
        }
    });
}

fn dot(kernel: Kernel, tiles: &[Tile], acts: &[&[u8]]) -> [[f32; TILE_N]; MT] {
    // Real checks: the SIMD loops read every tile's block of every row through raw pointers.
    assert!(!acts.is_empty() && acts.len() <= MT);
    for a in acts {
        assert!(a.len() == tiles.len() * Q8K_BYTES);
    }
    macro_rules! by_rows {
        ($f:ident) => {
            match acts.len() {
                1 => $f::<1>(tiles, acts),
                2 => $f::<2>(tiles, acts),
                3 => $f::<3>(tiles, acts),
                _ => $f::<4>(tiles, acts),
            }
        };
    }
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU runs the kernel; the lengths are checked
        // above.
        Kernel::Avx512Vnni => unsafe { by_rows!(dot512) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { by_rows!(dot256) },
        _ => by_rows!(dot_scalar),
    }
}

/// The tiled arithmetic, one output at a time (the reference the SIMD loops are tested
/// against; the row kernels' scalar loop computes the same values another way).
fn dot_scalar<const M: usize>(tiles: &[Tile], acts: &[&[u8]]) -> [[f32; TILE_N]; MT] {
    let mut out = [[0f32; TILE_N]; MT];
    for (act, out) in acts.iter().zip(&mut out) {
        for (r, o) in out.iter_mut().enumerate() {
            for (b, tile) in tiles.iter().enumerate() {
                let y = &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
                let mut isum = 0i32;
                for j in 0..16 {
                    let mut s = 0i32;
                    for v in 16 * j..16 * j + 16 {
                        let q = tile.qs[((v / 4) * TILE_N + r) * 4 + v % 4] as i32;
                        s += q * y[4 + v] as i8 as i32;
                    }
                    let at = Q8K_BSUMS + 2 * j;
                    let bsum = i16::from_le_bytes([y[at], y[at + 1]]) as i32;
                    isum += tile.sc[j][r] as i32 * (s - 32 * bsum);
                }
                let dy = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                *o = (tile.d[r] * isum as f32).mul_add(dy, *o);
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
use x86::{dot256, dot512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Tile, MT, Q8K_BSUMS, Q8K_BYTES, TILE_N};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn word(p: *const u8) -> i32 {
        std::ptr::read_unaligned(p as *const i32)
    }

    #[inline(always)]
    unsafe fn bsum(y: *const u8, j: usize) -> i32 {
        std::ptr::read_unaligned(y.add(Q8K_BSUMS + 2 * j) as *const i16) as i32
    }

    /// 16 weight rows against `M` activation rows, 512-bit: `vpdpbusd` over a 16-value
    /// group, then one scale multiply.
    ///
    /// # Safety
    /// The CPU must support AVX512F, AVX512BW, AVX512-VNNI and FMA; `acts` holds `M` rows of
    /// `tiles.len()` Q8_K blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub(super) unsafe fn dot512<const M: usize>(
        tiles: &[Tile],
        acts: &[&[u8]],
    ) -> [[f32; TILE_N]; MT] {
        let mut acc = [_mm512_setzero_ps(); M];
        for (b, tile) in tiles.iter().enumerate() {
            let y: [*const u8; M] = std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
            let mut isum = [_mm512_setzero_si512(); M];
            for j in 0..16 {
                let mut s = [_mm512_setzero_si512(); M];
                for g4 in 0..4 {
                    let g = 4 * j + g4;
                    let w = _mm512_load_si512(tile.qs.as_ptr().add(g * TILE_N * 4) as *const _);
                    for i in 0..M {
                        let v = _mm512_set1_epi32(word(y[i].add(4 + 4 * g)));
                        s[i] = _mm512_dpbusd_epi32(s[i], w, v);
                    }
                }
                let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(tile.sc[j].as_ptr() as *const _));
                for i in 0..M {
                    let t = _mm512_sub_epi32(s[i], _mm512_set1_epi32(32 * bsum(y[i], j)));
                    isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(t, sc));
                }
            }
            let d = _mm512_loadu_ps(tile.d.as_ptr());
            for i in 0..M {
                let dy = _mm512_set1_ps(std::ptr::read_unaligned(y[i] as *const f32));
                let dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[i]));
                acc[i] = _mm512_fmadd_ps(dw, dy, acc[i]);
            }
        }
        let mut out = [[0f32; TILE_N]; MT];
        for i in 0..M {
            _mm512_storeu_ps(out[i].as_mut_ptr(), acc[i]);
        }
        out
    }

    /// 16 weight rows against `M` activation rows, 256-bit, eight rows at a time:
    /// `maddubs` pairs (|pair| <= 2 * 63 * 128 = 16128, two of them fit i16), `madd` with
    /// each row's scale twice, and the `32 * bsum` term as `madd` of (scale, scale) with
    /// (bsum, 0).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `acts` holds `M` rows of `tiles.len()` Q8_K blocks.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot256<const M: usize>(
        tiles: &[Tile],
        acts: &[&[u8]],
    ) -> [[f32; TILE_N]; MT] {
        // Per half tile (eight rows), per activation row.
        let mut acc = [[_mm256_setzero_ps(); M]; 2];
        for (b, tile) in tiles.iter().enumerate() {
            let y: [*const u8; M] = std::array::from_fn(|i| acts[i].as_ptr().add(b * Q8K_BYTES));
            for (h, acc) in acc.iter_mut().enumerate() {
                let mut isum = [_mm256_setzero_si256(); M];
                let mut corr = [_mm256_setzero_si256(); M];
                for j in 0..16 {
                    // Each row's scale as an i16 pair.
                    let sc8 = _mm_loadl_epi64(tile.sc[j].as_ptr().add(8 * h) as *const _);
                    let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
                    let qs = tile.qs.as_ptr().add(h * 32);
                    let wv: [__m256i; 4] = std::array::from_fn(|g4| {
                        _mm256_load_si256(qs.add((4 * j + g4) * TILE_N * 4) as *const _)
                    });
                    for i in 0..M {
                        let yv = |g4: usize| _mm256_set1_epi32(word(y[i].add(4 + 16 * j + 4 * g4)));
                        let p01 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(wv[0], yv(0)),
                            _mm256_maddubs_epi16(wv[1], yv(1)),
                        );
                        let p23 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(wv[2], yv(2)),
                            _mm256_maddubs_epi16(wv[3], yv(3)),
                        );
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p01, sc));
                        isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(p23, sc));
                        let bs = _mm256_set1_epi32(bsum(y[i], j) & 0xffff);
                        corr[i] = _mm256_add_epi32(corr[i], _mm256_madd_epi16(sc, bs));
                    }
                }
                let d = _mm256_loadu_ps(tile.d.as_ptr().add(8 * h));
                for i in 0..M {
                    let t = _mm256_sub_epi32(isum[i], _mm256_slli_epi32::<5>(corr[i]));
                    let dy = _mm256_set1_ps(std::ptr::read_unaligned(y[i] as *const f32));
                    let dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(t));
                    acc[i] = _mm256_fmadd_ps(dw, dy, acc[i]);
                }
            }
        }
        let mut out = [[0f32; TILE_N]; MT];
        for i in 0..M {
            _mm256_storeu_ps(out[i].as_mut_ptr(), acc[0][i]);
            _mm256_storeu_ps(out[i].as_mut_ptr().add(8), acc[1][i]);
        }
        out
    }
}
