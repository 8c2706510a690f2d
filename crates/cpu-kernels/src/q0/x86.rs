//! The x86 kernels of `q0`: 256-bit (AVX2, optionally AVX-VNNI or AVX512-VNNI for the
//! integer part), one module per instruction set from one macro.

use super::{Format, WeightRows, TILE};
use std::arch::x86_64::*;

/// The 32 weights of one Q5_0 block plus 16, as unsigned bytes in 0..=31, from its 16
/// nibble bytes at `qs` and its fifth bits at `qh` as the grouped layout keeps them.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn decode(qh: *const u8, qs: *const u8) -> __m256i {
    // Low nibbles are values 0..16 (low half), high nibbles values 16..32 (high half).
    let qs = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
    let nib = _mm256_and_si256(
        _mm256_srlv_epi32(qs, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
        _mm256_set1_epi8(0x0f),
    );
    // Byte j sees byte j % 4 of the permuted bits; bit j / 4 there is value j's fifth bit.
    let qh = _mm256_set1_epi32(std::ptr::read_unaligned(qh as *const i32));
    let bit = _mm256_setr_epi32(
        0x0101_0101,
        0x0202_0202,
        0x0404_0404,
        0x0808_0808,
        0x1010_1010,
        0x2020_2020,
        0x4040_4040,
        0x8080_8080u32 as i32,
    );
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
    _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// Row `i`'s block `b`: its scale, fifth bits and values (see `layout::Rows`).
///
/// # Safety
/// `rows` must have passed `Rows::check` for `w`'s stored weight and `b` be below its
/// block count.
#[inline]
unsafe fn block_at(w: *const u8, rows: &super::Rows, i: usize, b: usize) -> [*const u8; 3] {
    let at = b * rows.stride;
    [rows.scale[i], rows.qh[i], rows.qs[i]].map(|o| w.add(o + at))
}

/// A Q5_0 group's eight block-`b` scales as f32 (row i in lane i): the grouped layout keeps
/// them side by side (`Rows::check` asserts it).
///
/// # Safety
/// As [`block_at`], for a Q5_0 group.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn group_scales(w: *const u8, rows: &super::Rows, b: usize) -> __m256 {
    let at = w.add(rows.scale[0] + b * rows.stride);
    _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
}

/// Ask for block `b` of the group after this one (`rows`: this group; `wrows`: the weight
/// rows whose block to ask for), at the pace the group is read. The hardware prefetchers
/// alone leave a weight read from DRAM slower than the batch kernels compute (`q0
/// speed_batches`, AVX2, eight activation rows: the 0.5B's Q8_0 output matrix 14.7 -> 12.0
/// ms, a Q5_0 [65536x896] 4.89 -> 4.66 ms).
#[inline]
fn prefetch_next_group(
    w: *const u8,
    rows: &super::Rows,
    format: Format,
    kb: usize,
    b: usize,
    wrows: std::ops::Range<usize>,
) {
    let ask = |at: usize| {
        // SAFETY: a prefetch hint does not fault, even past the weight's end (the last group).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(at) as *const i8) }
    };
    match format {
        // A row's blocks lie side by side, its next group's counterpart eight rows on.
        Format::Q8_0 => wrows.for_each(|i| ask(rows.scale[i] + (TILE * kb + b) * rows.stride)),
        // The group's rows share each block's bytes; the next group follows this one.
        Format::Q5_0 => {
            let at = rows.scale[0] + (kb + b) * rows.stride;
            (0..rows.stride.div_ceil(64)).for_each(|line| ask(at + 64 * line));
        }
    }
}

/// llama.cpp's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum8(v: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
}

/// The first `count` weight rows of a group against a tile of eight activation rows given as
/// [`super::RowPairs`] (`ybias`: per block and row pair the two rows' values plus 128 as
/// u8, `dpair`: their scales, each eight times). `dots[i][wi]` gets activation row i's
/// product with weight row wi, the same lanes, steps and sums as `dot_acts`: 512-bit integer dot products
/// compute two activation rows at once, `(y + 128) . x` starting from `-128 * sum(x)`.
///
/// Blocks outer, four weight rows at a time (16 accumulators): a block's activations are
/// loaded once for four rows, and the group's blocks (176 bytes apart in the grouped
/// layout) are walked twice rather than once per row. The rows past `count` (the zero
/// padding of a short Q5_0 group, or the last row repeated for Q8_0) are computed too and
/// dropped. `ahead`: ask for the next group's weights meanwhile (see `dot_acts`).
///
/// # Safety
/// The CPU must support AVX512F, AVX512BW, AVX512-VNNI, AVX2, FMA and F16C.
pub(super) unsafe fn dot_acts_pairs(
    format: Format,
    ws: WeightRows,
    ahead: bool,
    ybias: &[u8],
    dpair: &[f32],
    dots: &mut [[f32; TILE]; TILE],
) {
    // The prefetches as a constant, as in the 256-bit `dot_acts`.
    match ahead {
        true => pairs::<true>(format, ws, ybias, dpair, dots),
        false => pairs::<false>(format, ws, ybias, dpair, dots),
    }
}

/// `dot_acts_pairs`, asking for the next group's weights if `AHEAD`.
///
/// # Safety
/// As `dot_acts_pairs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn pairs<const AHEAD: bool>(
    format: Format,
    (w, rows, count): WeightRows,
    ybias: &[u8],
    dpair: &[f32],
    dots: &mut [[f32; TILE]; TILE],
) {
    /// Weight rows per pass.
    const PASS: usize = 4;
    let kb = dpair.len() / (TILE * TILE);
    // Real checks: the loops read kb blocks of every row through raw pointers.
    assert!(ybias.len() == kb * 4 * 64 && dpair.len() == kb * 4 * 16 && count <= TILE);
    rows.check(format, w.len(), kb);
    let ones = _mm512_set1_epi8(1);
    let zero = _mm512_setzero_si512();
    for first in (0..count).step_by(PASS) {
        let mut acc = [[_mm512_setzero_ps(); 4]; PASS];
        for b in 0..kb {
            // Q5_0's group shares each block's bytes: asked for on the first pass only.
            if AHEAD && (format == Format::Q8_0 || first == 0) {
                prefetch_next_group(w.as_ptr(), rows, format, kb, b, first..first + PASS);
            }
            let y: [__m512i; 4] = std::array::from_fn(|p| {
                _mm512_loadu_si512(ybias.as_ptr().add((b * 4 + p) * 64) as *const _)
            });
            for (j, acc) in acc.iter_mut().enumerate() {
                let [scale, qh, qs] = block_at(w.as_ptr(), rows, first + j, b);
                let x = _mm512_broadcast_i64x4(match format {
                    Format::Q5_0 => _mm256_sub_epi8(decode(qh, qs), _mm256_set1_epi8(16)),
                    Format::Q8_0 => _mm256_loadu_si256(qs as *const __m256i),
                });
                // -128 times each lane's weight sum: (y + 128) . x - 128 * sum(x) = y . x.
                let start = _mm512_sub_epi32(
                    zero,
                    _mm512_slli_epi32::<7>(_mm512_dpbusd_epi32(zero, ones, x)),
                );
                let dw = _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(
                    std::ptr::read_unaligned(scale as *const i16),
                ))));
                for (p, acc) in acc.iter_mut().enumerate() {
                    let lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, y[p], x));
                    let dp = _mm512_loadu_ps(dpair.as_ptr().add((b * 4 + p) * 16));
                    *acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, dp), lanes, *acc);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate().take(count - first) {
            for (p, acc) in acc.iter().enumerate() {
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*acc)));
                dots[2 * p][first + j] = hsum8(_mm512_castps512_ps256(*acc));
                dots[2 * p + 1][first + j] = hsum8(hi);
            }
        }
    }
}

/// The x86 kernels, instantiated once per instruction set: `$features` are the target
/// features, `$dot(xu, y)` gives the i32 lanes of dot products of each 4 unsigned bytes of
/// `xu` with the signed bytes of `y`.
macro_rules! x86_kernels {
    ($module:ident, $features:literal, $dot:expr) => {
        pub(super) mod $module {
            use super::super::{Format, Rows, WeightRows, Q8_BYTES, TILE};
            use super::{block_at, group_scales, prefetch_next_group};
            use std::arch::x86_64::*;

            /// The 32 weights of one Q5_0 block plus 16, as unsigned bytes in 0..=31.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(qh: *const u8, qs: *const u8) -> __m256i {
                super::decode(qh, qs)
            }

            /// A block's weights (fifth bits at `qh`, values at `qs`) as `lanes` wants
            /// them: Q5_0: (unused, `x + 16` as u8); Q8_0: (-1 where x < 0 else 0, |x|).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn weights(format: Format, qh: *const u8, qs: *const u8) -> (__m256i, __m256i) {
                match format {
                    Format::Q5_0 => (_mm256_setzero_si256(), decode(qh, qs)),
                    Format::Q8_0 => {
                        let x = _mm256_loadu_si256(qs as *const __m256i);
                        let negative = _mm256_cmpgt_epi8(_mm256_setzero_si256(), x);
                        (negative, _mm256_sign_epi8(x, x))
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
                    // y with x's signs as `(y ^ m) - m` (m = -1 where x < 0): `vpsignb`'s
                    // bytes wherever x != 0 (where x = 0, |x| = 0 zeroes the product), on
                    // the adder pipes instead of the multiply pipes `maddubs` needs.
                    Format::Q8_0 => ($dot)(w.1, _mm256_sub_epi8(_mm256_xor_si256(y, w.0), w.0)),
                };
                _mm256_cvtepi32_ps(lanes)
            }

            /// llama.cpp's `hsum_float_8`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum(v: __m256) -> f32 {
                super::hsum8(v)
            }

            /// The first `count` weight rows of a group against a tile of eight
            /// activation rows (`lines`, see `QuantizedLhs::lines`: their values and lane
            /// sums per block and row; `scales` their block scales, `[kb, 8]`).
            /// `dots[i][wi]` gets activation row i's product with weight row wi.
            ///
            /// Q5_0 goes blocks outer (see `q5_0_blocks`); Q8_0 row by row, each row read
            /// front to back: its rows lie in the file apart, and blocks outer read eight of
            /// them side by side, which the hardware prefetchers follow poorly (the 0.5B's
            /// output matrix, eight rows: 16.5-16.9 -> 20.0-20.6 ms that way).
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(in crate::q0) unsafe fn dot_acts(
                format: Format,
                (w, rows, count): WeightRows,
                ahead: bool,
                lines: &[[u8; 64]],
                scales: &[f32],
                dots: &mut [[f32; TILE]; TILE],
            ) {
                let kb = scales.len() / TILE;
                // Real checks: the loops read kb blocks of every row through raw pointers.
                assert!(scales.len() == kb * TILE && count <= TILE);
                assert!(lines.len() == kb * TILE);
                rows.check(format, w.len(), kb);
                let wp = w.as_ptr();
                // The prefetches as a constant: a flag tested in the loops cost ~5% where it
                // was false (`q0 speed_batches`, AVX2, Q8_0 128 rows).
                match (format, ahead) {
                    (Format::Q5_0, true) => {
                        q5_0_blocks::<true>(wp, rows, count, lines, scales, dots)
                    }
                    (Format::Q5_0, false) => {
                        q5_0_blocks::<false>(wp, rows, count, lines, scales, dots)
                    }
                    (Format::Q8_0, true) => q8_0_rows::<true>(wp, rows, count, lines, scales, dots),
                    (Format::Q8_0, false) => {
                        q8_0_rows::<false>(wp, rows, count, lines, scales, dots)
                    }
                }
            }

            /// `dot_acts` for a Q8_0 group, row by row (see there), asking for the next
            /// group's rows if `AHEAD`.
            ///
            /// # Safety
            /// As `dot_acts`, whose checks (`Rows::check`, lengths) it relies on.
            #[target_feature(enable = $features)]
            unsafe fn q8_0_rows<const AHEAD: bool>(
                wp: *const u8,
                rows: &Rows,
                count: usize,
                lines: &[[u8; 64]],
                scales: &[f32],
                dots: &mut [[f32; TILE]; TILE],
            ) {
                let (format, kb) = (Format::Q8_0, scales.len() / TILE);
                // `products[c * TILE + i]`: block `first + c`'s `d_w * d_x` for activation
                // row i, eight to a multiply, made for a chunk of blocks before its dot
                // products read them back as broadcasts.
                let mut products = [0f32; CHUNK_BLOCKS * TILE];
                for wi in 0..count {
                    let mut acc = [_mm256_setzero_ps(); TILE];
                    for first in (0..kb).step_by(CHUNK_BLOCKS) {
                        let blocks = first..kb.min(first + CHUNK_BLOCKS);
                        for b in blocks.clone() {
                            let [scale, _, _] = block_at(wp, rows, wi, b);
                            let dx = _mm256_loadu_ps(scales.as_ptr().add(b * TILE));
                            let d = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(scale)), dx);
                            let at = products.as_mut_ptr().add((b - first) * TILE);
                            _mm256_storeu_ps(at, d);
                        }
                        for b in blocks {
                            if AHEAD {
                                prefetch_next_group(wp, rows, format, kb, b, wi..wi + 1);
                            }
                            let [_, qh, qs] = block_at(wp, rows, wi, b);
                            let wv = weights(format, qh, qs);
                            let line = lines.as_ptr().add(b * TILE) as *const u8;
                            let at = products.as_ptr().add((b - first) * TILE);
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let y = line.add(i * 64);
                                let d = _mm256_broadcast_ss(&*at.add(i));
                                let l = lanes(format, wv, y, y.add(32) as *const i32);
                                *acc = _mm256_fmadd_ps(d, l, *acc);
                            }
                        }
                    }
                    for (dots, acc) in dots.iter_mut().zip(acc) {
                        dots[wi] = hsum(acc);
                    }
                }
            }

            /// Blocks whose scale products a Q8_0 row makes at a time in `dot_acts` (1 KiB:
            /// the first is read back long after it was stored; a product stored and at
            /// once reloaded as a broadcast waited on the store, and one formed by a scalar
            /// multiply and a register broadcast cost two vector-pipe operations a step).
            const CHUNK_BLOCKS: usize = 32;

            /// `dot_acts` for a Q5_0 group, blocks outer: per block the eight rows' weights
            /// are unpacked into registers, the 64 scale products `d_w * d_x` made eight to
            /// a multiply, and each activation row's values and sums loaded once for the
            /// eight rows; the 64 accumulators live in memory (a load and a store a step,
            /// which the load and store units take beside the vector pipes). Row by row,
            /// every row re-read the tile's activations (14 KiB for the 0.5B), more than this
            /// core's first-level cache kept: 2.9 -> 2.4 cycles a (weight row, block,
            /// activation row) step in `q0 speed_tile_kernel`. The group is one stream in
            /// memory either way; with `AHEAD` each block asks for the next group's.
            ///
            /// # Safety
            /// As `dot_acts`, whose checks (`Rows::check`, lengths) it relies on.
            #[target_feature(enable = $features)]
            unsafe fn q5_0_blocks<const AHEAD: bool>(
                wp: *const u8,
                rows: &Rows,
                count: usize,
                lines: &[[u8; 64]],
                scales: &[f32],
                dots: &mut [[f32; TILE]; TILE],
            ) {
                let kb = scales.len() / TILE;
                // `acc[i][wi]`: activation row i, weight row wi (all eight computed: rows
                // past `count` are a short group's zero padding, dropped below). Block 0
                // writes them from zero in registers, the later blocks add to them: zeroing
                // the 2 KiB first was a `memset` call per group (1.6% of the 0.5B's batch
                // step on Zen 4). `fma(d, l, +0)` is the first step from zeroed memory bit
                // for bit (a -0 product plus +0 is +0 either way).
                let mut acc = std::mem::MaybeUninit::<[[__m256; TILE]; TILE]>::uninit();
                let accp = acc.as_mut_ptr() as *mut __m256;
                // There is a block 0: `Rows::check` (in `dot_acts`) asserts kb > 0.
                q5_0_block::<true, AHEAD>(wp, rows, lines, scales, 0, accp);
                for b in 1..kb {
                    q5_0_block::<false, AHEAD>(wp, rows, lines, scales, b, accp);
                }
                // SAFETY: block 0 wrote every accumulator.
                let acc = acc.assume_init();
                for (dots, acc) in dots.iter_mut().zip(&acc) {
                    for (d, acc) in dots.iter_mut().zip(acc).take(count) {
                        *d = hsum(*acc);
                    }
                }
            }

            /// Block `b` of `q5_0_blocks` into the 64 accumulators at `accp` (`[activation
            /// row][weight row]`): read and added to, or, for the `FIRST` block, written.
            ///
            /// # Safety
            /// As `q5_0_blocks`; `accp` valid for 64 vectors (initialised unless `FIRST`).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q5_0_block<const FIRST: bool, const AHEAD: bool>(
                wp: *const u8,
                rows: &Rows,
                lines: &[[u8; 64]],
                scales: &[f32],
                b: usize,
                accp: *mut __m256,
            ) {
                if AHEAD {
                    let kb = scales.len() / TILE;
                    prefetch_next_group(wp, rows, Format::Q5_0, kb, b, 0..TILE);
                }
                let xu: [__m256i; TILE] = std::array::from_fn(|wi| {
                    let [_, qh, qs] = block_at(wp, rows, wi, b);
                    decode(qh, qs)
                });
                let dw = group_scales(wp, rows, b);
                // The block's `d_w * d_x`, `[activation row, weight row]`.
                let mut products = [0f32; TILE * TILE];
                for i in 0..TILE {
                    let dx = _mm256_set1_ps(*scales.get_unchecked(b * TILE + i));
                    let at = products.as_mut_ptr().add(i * TILE);
                    _mm256_storeu_ps(at, _mm256_mul_ps(dw, dx));
                }
                let line = lines.as_ptr().add(b * TILE) as *const u8;
                for i in 0..TILE {
                    let y = _mm256_loadu_si256(line.add(i * 64) as *const __m256i);
                    let sums16 = _mm256_loadu_si256(line.add(i * 64 + 32) as *const __m256i);
                    for (wi, xu) in xu.iter().enumerate() {
                        #[allow(clippy::redundant_closure_call)]
                        let l = _mm256_sub_epi32(($dot)(*xu, y), sums16);
                        let d = _mm256_broadcast_ss(products.get_unchecked(i * TILE + wi));
                        let acc = accp.add(i * TILE + wi);
                        let from = if FIRST {
                            _mm256_setzero_ps()
                        } else {
                            acc.read()
                        };
                        acc.write(_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), from));
                    }
                }
            }

            /// Eight weight rows against one activation row (blocks `q`, lane sums
            /// `sums16`, scales `scales`).
            ///
            /// # Safety
            /// The CPU must support `$features`.
            #[target_feature(enable = $features)]
            pub(in crate::q0) unsafe fn dot_weights(
                format: Format,
                w: &[u8],
                rows: &Rows,
                q: &[u8],
                sums16: &[i32],
                scales: &[f32],
            ) -> [f32; TILE] {
                let kb = scales.len();
                // Real checks: the loop reads kb blocks of every row through raw pointers.
                assert!(q.len() == kb * Q8_BYTES && sums16.len() == kb * 8);
                rows.check(format, w.len(), kb);
                let wp = w.as_ptr();
                let stride = rows.stride;
                // The next group (just after a Q5_0 group; after the eighth row for Q8_0),
                // fetched at the pace this one is read: the hardware prefetchers follow
                // eight Q8_0 rows read side by side poorly.
                let ahead = match format {
                    Format::Q5_0 => wp.wrapping_add(rows.scale[0] + kb * stride),
                    Format::Q8_0 => wp.wrapping_add(rows.scale[0] + TILE * kb * stride),
                };
                let step = match format {
                    Format::Q5_0 => stride,
                    Format::Q8_0 => TILE * stride,
                };
                let mut acc = [_mm256_setzero_ps(); TILE];
                for b in 0..kb {
                    let next = ahead.wrapping_add(b * step);
                    for line in 0..step.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * line) as *const i8);
                    }
                    let y = q.as_ptr().add(b * Q8_BYTES + 2);
                    let sums = sums16.as_ptr().add(b * 8);
                    let dx = *scales.get_unchecked(b);
                    match format {
                        // A group's eight scales side by side: all eight `d_w * d_x` at once
                        // (the same f32 products as one at a time).
                        Format::Q5_0 => {
                            let d = _mm256_mul_ps(group_scales(wp, rows, b), _mm256_set1_ps(dx));
                            let mut d8 = [0f32; TILE];
                            _mm256_storeu_ps(d8.as_mut_ptr(), d);
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let [_, qh, qs] = block_at(wp, rows, i, b);
                                let l = lanes(format, weights(format, qh, qs), y, sums);
                                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d8[i]), l, *acc);
                            }
                        }
                        Format::Q8_0 => {
                            for (i, acc) in acc.iter_mut().enumerate() {
                                let [scale, qh, qs] = block_at(wp, rows, i, b);
                                let d = _mm256_set1_ps(f16_to_f32(scale) * dx);
                                let l = lanes(format, weights(format, qh, qs), y, sums);
                                *acc = _mm256_fmadd_ps(d, l, *acc);
                            }
                        }
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
