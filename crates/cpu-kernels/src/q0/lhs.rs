//! The activation side of a `q0` matmul: the input rows quantised to Q8_0 as llama.cpp
//! does, laid out the way each kernel reads them (row blocks and scales for the scalar and
//! single-row kernels, cache-line tiles for the 256-bit batch kernels, row pairs for the
//! 512-bit one).

use candle_core::quantized::k_quants::BlockQ8_0;
use candle_core::quantized::GgmlType;

use super::super::{par_chunks, SharedMut};
use super::{f16_at, pairs_kernel_available, Kernel, Q8_BYTES, QK, TILE};

/// Activations quantized to Q8_0, plus what the kernels want per block.
pub(super) struct QuantizedLhs {
    pub(super) blocks: Vec<BlockQ8_0>,
    /// `[m, kb]` block scales as f32.
    scales: Vec<f32>,
    /// `scales` as `[m.div_ceil(TILE), kb, TILE]` (zero past row `m`), so a tile kernel
    /// finds one block's eight values side by side.
    tiled_scales: Vec<f32>,
    /// `[kb, 8]` for the last row when it is a tile of its own (the x86 single-row kernel's
    /// input, see [`lane_sums16`]).
    last_sums16: Vec<i32>,
    /// The tiles' row pairs for the 512-bit kernel (several rows on a CPU that runs it).
    pairs: Option<RowPairs>,
    /// The tiles as the 256-bit tile kernel reads them (several rows, no row pairs; see
    /// the note below).
    lines: Option<Vec<[u8; 64]>>,
    pub(super) kb: usize,
}

/// 16 times the sums of a block's values 4l..4l+4 (`qs`: its 32 values). The x86 kernels
/// multiply Q5_0 weights as unsigned `x + 16` and subtract these to get the lanes of the
/// products with `x`.
fn lane_sums16(qs: &[u8]) -> impl Iterator<Item = i32> + '_ {
    qs.chunks_exact(4)
        .map(|q| 16 * q.iter().map(|&v| v as i8 as i32).sum::<i32>())
}

// The 256-bit x86 kernels read a tile of activations as cache lines (`QuantizedLhs::lines`),
// each block's eight rows side by side (rows past `m` repeat the tile's first row): tile t's
// block b at `(t * kb + b) * 8` lines, row i's line holding its 32 values and then its
// eight `lane_sums16`. One pointer then reaches all eight rows, where eight rows apart took
// sixteen pointers and the loop reloaded them from the stack (`q0 speed` AVX2, 512 rows,
// three alternating runs: [4864x896] 30.7 -> 29.8 ms, [896x4864] 34.7 -> 32.0). Tried and
// slower in that row-by-row kernel: the scale products `d_w * d_x` made for a whole weight
// row first and broadcast from memory (36.5); the blocks-outer Q5_0 kernel makes them per
// block for its 64 pairs instead.

/// Activation tiles as the 512-bit kernel reads them: for tile t, block b and row pair p
/// (rows 2p, 2p+1 of the tile, padded with its first row) at index `(t * kb + b) * 4 + p`,
/// the two rows' 32 values plus 128 as u8 (64 bytes), and their two scales, each eight
/// times (16 f32).
struct RowPairs {
    ybias: Vec<u8>,
    dpair: Vec<f32>,
}

impl QuantizedLhs {
    /// `x` quantised, with what `kernel` reads besides: for a batch the 512-bit row pairs
    /// on `Avx512Vnni` (where the CPU runs them), the 256-bit kernels' lines otherwise, and
    /// the single-row kernel's sums for a last row alone in its tile. Each row fills its own
    /// slots (and a short last tile's padding) on the pool: made afterwards on one thread,
    /// a 512-token prompt's tiles left the other core idle.
    pub(super) fn new(x: &[f32], m: usize, k: usize, kernel: Kernel) -> Self {
        let kb = k / QK;
        let tiles = m.div_ceil(TILE);
        let use_pairs = m > 1 && kernel == Kernel::Avx512Vnni && pairs_kernel_available();
        let use_lines = m > 1 && !use_pairs && kernel != Kernel::Scalar;
        let mut blocks = vec![BlockQ8_0::zeros(); m * kb];
        let mut scales = vec![0f32; m * kb];
        let mut lines = vec![[0u8; 64]; if use_lines { tiles * kb * TILE } else { 0 }];
        let (mut ybias, mut dpair) = match use_pairs {
            true => (vec![0u8; tiles * kb * 4 * 64], vec![0f32; tiles * kb * 64]),
            false => (Vec::new(), Vec::new()),
        };
        let ptrs = (
            SharedMut(blocks.as_mut_ptr()),
            SharedMut(scales.as_mut_ptr()),
            SharedMut(lines.as_mut_ptr()),
            SharedMut(ybias.as_mut_ptr()),
            SharedMut(dpair.as_mut_ptr()),
        );
        par_chunks(m, m * kb, |rows| {
            let (bp, sp, lp, yp, dp) = ptrs;
            for r in rows {
                // SAFETY: row r owns elements r*kb..(r+1)*kb of both vectors, which outlive
                // the call.
                let (b, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(bp.get().add(r * kb), kb),
                        std::slice::from_raw_parts_mut(sp.get().add(r * kb), kb),
                    )
                };
                super::super::act_quant::quantize_q8_0(&x[r * k..(r + 1) * k], b);
                for (s, blk) in s.iter_mut().zip(as_bytes(b).chunks_exact(Q8_BYTES)) {
                    *s = f16_at(blk, 0);
                }
                if !use_lines && !use_pairs {
                    continue;
                }
                // The tile slots this row fills: its own, and a short last tile's padding
                // when it is that tile's first row.
                let (t, i) = (r / TILE, r % TILE);
                let pad = if i == 0 {
                    (m - r).min(TILE)..TILE
                } else {
                    0..0
                };
                for slot in std::iter::once(i).chain(pad) {
                    for (blk, (blk_i, &d)) in
                        as_bytes(b).chunks_exact(Q8_BYTES).zip(s.iter().enumerate())
                    {
                        let qs = &blk[2..];
                        let at = t * kb + blk_i;
                        // SAFETY (both): slot `slot` of tile t belongs to this row alone
                        // (rows partition the slots: own slots, and padding only from a
                        // tile's first row); the vectors outlive the call.
                        if use_lines {
                            let line = unsafe { &mut *lp.get().add(at * TILE + slot) };
                            line[..32].copy_from_slice(qs);
                            for (o, v) in line[32..].chunks_exact_mut(4).zip(lane_sums16(qs)) {
                                o.copy_from_slice(&v.to_ne_bytes());
                            }
                        } else {
                            let (p, h) = (at * 4 + slot / 2, slot % 2);
                            let (yb, dd) = unsafe {
                                (
                                    std::slice::from_raw_parts_mut(
                                        yp.get().add(p * 64 + 32 * h),
                                        32,
                                    ),
                                    std::slice::from_raw_parts_mut(dp.get().add(p * 16 + 8 * h), 8),
                                )
                            };
                            for (o, &v) in yb.iter_mut().zip(qs) {
                                *o = v ^ 0x80;
                            }
                            dd.fill(d);
                        }
                    }
                }
            }
        });
        // The x86 single-row kernel (`dot_weights`: decode, or a last tile of one row)
        // reads the row's `lane_sums16`.
        let last_sums16 = if kernel != Kernel::Scalar && m % TILE == 1 {
            let row = &as_bytes(&blocks)[(m - 1) * kb * Q8_BYTES..];
            row.chunks_exact(Q8_BYTES)
                .flat_map(|b| lane_sums16(&b[2..]))
                .collect()
        } else {
            Vec::new()
        };
        Self {
            tiled_scales: interleave(&scales, m, kb),
            blocks,
            scales,
            last_sums16,
            pairs: use_pairs.then_some(RowPairs { ybias, dpair }),
            lines: use_lines.then_some(lines),
            kb,
        }
    }

    /// Tile `start / TILE`'s row pairs (`ybias`, `dpair`), when made.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn tile_pairs(&self, start: usize) -> Option<(&[u8], &[f32])> {
        let p = self.pairs.as_ref()?;
        let (t, kb) = (start / TILE, self.kb);
        Some((
            &p.ybias[t * kb * 256..(t + 1) * kb * 256],
            &p.dpair[t * kb * 64..(t + 1) * kb * 64],
        ))
    }

    /// Tile `start / TILE`'s lines for the 256-bit kernels, when made.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn tile_lines(&self, start: usize) -> Option<&[[u8; 64]]> {
        let (lines, kb) = (self.lines.as_ref()?, self.kb);
        let t = start / TILE;
        Some(&lines[t * kb * TILE..(t + 1) * kb * TILE])
    }

    /// The last row's `lane_sums16`, when it is a tile of its own.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn last_row_sums16(&self) -> &[i32] {
        &self.last_sums16
    }

    /// Row `r`'s blocks as bytes.
    pub(super) fn row(&self, r: usize) -> &[u8] {
        let len = self.kb * Q8_BYTES;
        &as_bytes(&self.blocks)[r * len..(r + 1) * len]
    }

    pub(super) fn row_scales(&self, r: usize) -> &[f32] {
        &self.scales[r * self.kb..(r + 1) * self.kb]
    }

    /// Interleaved scales of the tile starting at row `start` (a multiple of [`TILE`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn tile_scales(&self, start: usize) -> &[f32] {
        &self.tiled_scales[start * self.kb..(start + TILE) * self.kb]
    }
}

/// `[m, kb]` values as `[m.div_ceil(TILE), kb, TILE]`, zero-padded.
fn interleave<T: Copy + Default>(v: &[T], m: usize, kb: usize) -> Vec<T> {
    let mut out = vec![T::default(); m.div_ceil(TILE) * kb * TILE];
    for (r, row) in v.chunks_exact(kb).enumerate() {
        let base = (r / TILE) * kb * TILE + r % TILE;
        for (b, &x) in row.iter().enumerate() {
            out[base + b * TILE] = x;
        }
    }
    out
}

fn as_bytes(b: &[BlockQ8_0]) -> &[u8] {
    // SAFETY: `BlockQ8_0` is `repr(C)`, 34 bytes without padding (asserted in `q0`), and every
    // block was initialised (zeroed, then written by `from_float`).
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}
