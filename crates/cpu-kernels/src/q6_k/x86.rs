//! The x86 Q6_K kernels: 512-bit (AVX512-VNNI, several activation rows per unpacked weight
//! block) and 256-bit (AVX2), both with several activation rows per unpacked weight block and llama.cpp's per-lane arithmetic (see `dot_scalar`).

use super::ROWS;
use std::arch::x86_64::*;

/// One Q6_K block's eight i32 `lanes` (lane l: positions 4l..4l+4 of every chunk, scaled) for
/// one (weight row, activation row) pair, added to that pair's accumulator: the weights are
/// stored plus 32, so lane l first takes off 32 times the scaled sums of activations
/// 32l..32l+32 (llama.cpp's `q8sclsub`); then llama.cpp's tiled step (`tacc`) or its vec_dot
/// step (`acc`). `y` is the activation row's Q8_K block, `sc16` the weight block's scales.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `y` must point at a whole Q8_K block.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_block<const TILED: bool>(
    lanes: __m256i,
    y: *const u8,
    sc16: __m256i,
    dw: f32,
    tacc: &mut f32,
    acc: &mut __m256,
) {
    let bsums = _mm256_loadu_si256(y.add(super::Q8K_BSUMS) as *const __m256i);
    let s8 = _mm256_sub_epi32(
        lanes,
        _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, sc16)),
    );
    let dy = std::ptr::read_unaligned(y as *const f32);
    if TILED {
        let s = super::hsum_i32(std::mem::transmute::<__m256i, [i32; 8]>(s8));
        *tacc = (dw * s as f32).mul_add(dy, *tacc);
    } else {
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * dw), _mm256_cvtepi32_ps(s8), *acc);
    }
}

/// A Q6_K block's scale `d` (f16) as f32.
///
/// # Safety
/// The CPU must support F16C; `blk` must point at a whole Q6_K block.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn dw(blk: *const u8) -> f32 {
    let bits = std::ptr::read_unaligned(blk.add(super::Q6K_D) as *const i16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits)))
}

/// Every (activation row, weight row) pair's eight f32 lanes summed in llama.cpp's order,
/// `((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))` (`hsum8`), four weight rows at a time:
/// `hadd` of the halves' sums reordered `[r0, r2, r1, r3]` gives `r0 + r2` and `r1 + r3`,
/// a second `hadd` their sum (the same additions; 6% of the eight-row kernel on a short row
/// was the scalar sums).
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsums<const A: usize>(acc: &[[__m256; ROWS]; A]) -> [[f32; ROWS]; A] {
    let mut out = [[0f32; ROWS]; A];
    for (out, acc) in out.iter_mut().zip(acc) {
        let pairs: [__m128; ROWS] = std::array::from_fn(|r| {
            let v = acc[r];
            let h = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
            _mm_shuffle_ps::<0b11_01_10_00>(h, h)
        });
        for q in 0..ROWS / 4 {
            let p = &pairs[4 * q..4 * q + 4];
            let sums = _mm_hadd_ps(_mm_hadd_ps(p[0], p[1]), _mm_hadd_ps(p[2], p[3]));
            _mm_storeu_ps(out.as_mut_ptr().add(4 * q), sums);
        }
    }
    out
}

/// How far ahead of the block being read the eight-decode-row AVX2 kernel asks for the
/// weights (32 blocks, 6.7 KB: its rows lie one after another, so this is one stream), a
/// block's worth of lines a block. `speed_cold_step` (the 1.5B's Q6_K matrices, eight rows,
/// four alternating rounds, medians): layers 20.2 -> 14.9 ms, output 24.1 -> 19.0 (16 blocks
/// ahead 15.8 / 19.9, 64 blocks 16.5 / 20.9).
const PREFETCH_BYTES: usize = 32 * super::Q6K_BYTES;

pub(super) mod avx512 {
    use super::super::{Q6K_BYTES, Q6K_QH, Q6K_SCALES, Q8K_BYTES, ROWS};
    use std::arch::x86_64::*;

    /// Eight weight rows against the Q8_K blocks of `A` activation rows `qs` (each weight
    /// block unpacked once for all of them; every (weight row, activation row) pair sums in
    /// the same order as alone).
    ///
    /// # Safety
    /// The CPU must support AVX512F, AVX512BW, AVX512-VNNI and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub(in crate::q6_k) unsafe fn dot<const TILED: bool, const A: usize>(
        ws: &[&[u8]; ROWS],
        qs: [&[u8]; A],
    ) -> [[f32; ROWS]; A] {
        let kb = qs[0].len() / Q8K_BYTES;
        let mut tacc = [[0f32; ROWS]; A];
        // Real checks: the loops read kb blocks of every row through raw pointers.
        for q in qs {
            assert!(q.len() == kb * Q8K_BYTES);
        }
        for w in ws {
            assert!(w.len() == kb * Q6K_BYTES);
        }
        let wp = ws.map(|w| w.as_ptr());
        let m4 = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        // Bit pairs 0-1 / 2-3 of qh (chunks 4j, 4j+1) to bits 4-5: shift left by 4 / 2;
        // pairs 4-5 / 6-7 (chunks 4j+2, 4j+3): right by 0 / 2. (16-bit shifts; the mask
        // drops what crosses bytes.)
        let shl = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
        let shr = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
        let mut acc = [[_mm256_setzero_ps(); ROWS]; A];
        // Row by row, each read front to back: the eight rows lie one after another, so the
        // matrix is one sequential stream for the hardware prefetcher (block by block across
        // the rows streamed 2.5x slower). Every (weight row, activation row) pair still adds
        // its blocks in order.
        for r in 0..ROWS {
            for b in 0..kb {
                let ys: [*const u8; A] = std::array::from_fn(|a| qs[a].as_ptr().add(b * Q8K_BYTES));
                let blk = wp[r].add(b * Q6K_BYTES);
                let scales = _mm_loadu_si128(blk.add(Q6K_SCALES) as *const __m128i);
                // Chunk pair p (values 64p..64p+64): the stored values (weights plus 32) and
                // their scales, lanes 4i..4i+4 taking scale 4p + i.
                let mut qv = [_mm512_setzero_si512(); 4];
                for j in 0..2 {
                    let ql = _mm512_loadu_si512(blk.add(64 * j) as *const _);
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        blk.add(Q6K_QH + 32 * j) as *const __m256i
                    ));
                    let h_lo = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30);
                    let h_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30);
                    qv[2 * j] = _mm512_or_si512(_mm512_and_si512(ql, m4), h_lo);
                    qv[2 * j + 1] =
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h_hi);
                }
                let sc: [__m512i; 4] = std::array::from_fn(|p| {
                    _mm512_cvtepi8_epi32(_mm_shuffle_epi8(
                        scales,
                        _mm_add_epi8(
                            _mm_set1_epi8(4 * p as i8),
                            _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                        ),
                    ))
                });
                let sc16 = _mm256_cvtepi8_epi16(scales);
                let dw = super::dw(blk);
                for a in 0..A {
                    let y = ys[a];
                    let mut sumi = _mm512_setzero_si512();
                    for p in 0..4 {
                        let yv = _mm512_loadu_si512(y.add(4 + 64 * p) as *const _);
                        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qv[p], yv);
                        sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(dot, sc[p]));
                    }
                    // Lane l of the two 256-bit halves: positions 4l.. of even / odd chunks.
                    let lanes = _mm256_add_epi32(
                        _mm512_castsi512_si256(sumi),
                        _mm512_extracti64x4_epi64::<1>(sumi),
                    );
                    super::add_block::<TILED>(lanes, y, sc16, dw, &mut tacc[a][r], &mut acc[a][r]);
                }
            }
        }
        if TILED {
            return tacc;
        }
        super::hsums(&acc)
    }
}

pub(super) mod avx2 {
    use super::super::{Q6K_BYTES, Q6K_QH, Q6K_SCALES, Q8K_BYTES, ROWS};
    use super::PREFETCH_BYTES;
    use std::arch::x86_64::*;

    /// Eight weight rows against the Q8_K blocks of `A` activation rows `qs`, with
    /// llama.cpp's AVX2 integer steps (`maddubs` of the stored values, `madd` with the
    /// scales, minus `q8sclsub`). Each 32-value chunk of a weight block is unpacked once for
    /// all `A` rows (in a prefill the unpacking was as much work as the products); the
    /// integer lanes are exact, so every row gets the floats it gets alone.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::q6_k) unsafe fn dot<const TILED: bool, const A: usize>(
        ws: &[&[u8]; ROWS],
        qs: [&[u8]; A],
    ) -> [[f32; ROWS]; A] {
        let kb = qs[0].len() / Q8K_BYTES;
        let mut tacc = [[0f32; ROWS]; A];
        // Real checks: the loops read kb blocks of every row through raw pointers.
        for q in qs {
            assert!(q.len() == kb * Q8K_BYTES);
        }
        for w in ws {
            assert!(w.len() == kb * Q6K_BYTES);
        }
        let wp = ws.map(|w| w.as_ptr());
        let m4 = _mm256_set1_epi8(0x0f);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [[_mm256_setzero_ps(); ROWS]; A];
        // Row by row, as the 512-bit kernel. No burst of prefetches for the next rows (it
        // stalled the loads of these; the 1.5B's output matrix for one row took 5.0 ms with
        // it, 4.0 without); eight decode rows ask for a block's lines a block ahead
        // (`PREFETCH_BYTES`), where the work per block leaves the stream room.
        for r in 0..ROWS {
            for b in 0..kb {
                let ys: [*const u8; A] = std::array::from_fn(|a| qs[a].as_ptr().add(b * Q8K_BYTES));
                let blk = wp[r].add(b * Q6K_BYTES);
                if A == 8 && !TILED {
                    let ahead = blk.wrapping_add(PREFETCH_BYTES);
                    for line in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
                    }
                    // Eight decode rows: the same integers and floats from one spill-free
                    // `asm!` run (`avx2_rows8`). The tiled rounding's eight rows of one
                    // sequence stay below (through the integer run: 0.95 -> 1.13 ms in `q6_k
                    // speed`, slower).
                    let acc = (acc.as_mut_ptr() as *mut __m256).add(r);
                    const _: () = assert!(super::super::avx2_rows8::ROW_STRIDE == 32 * ROWS);
                    super::super::avx2_rows8::block_step(
                        blk,
                        std::array::from_fn(|a| ys[a]),
                        super::dw(blk),
                        acc,
                    );
                    continue;
                }
                let scales = _mm_loadu_si128(blk.add(Q6K_SCALES) as *const __m128i);
                let mut sumi = [_mm256_setzero_si256(); A];
                for j in 0..2 {
                    // Each chunk loads its bytes again (from L1): kept in registers across
                    // the chunks, the three loads and the A sums outgrow the 16 registers
                    // for eight rows and spill. (An `asm!` load, so they are not merged. The
                    // tiled rounding's scalar sums schedule better with one load each: `q6_k
                    // speed`, eight rows of one sequence, 1.11 ms against 1.28-1.38.)
                    let load = |at: usize| {
                        if TILED {
                            return _mm256_loadu_si256(blk.add(at) as *const __m256i);
                        }
                        let v: __m256i;
                        std::arch::asm!(
                            "vmovdqu {v}, ymmword ptr [{p}]",
                            v = out(ymm_reg) v,
                            p = in(reg) blk.add(at),
                            options(readonly, nostack, preserves_flags),
                        );
                        v
                    };
                    let (ql0, ql1, qh) = (64 * j, 64 * j + 32, Q6K_QH + 32 * j);
                    for i in 0..4 {
                        let (lo, hi) = match i {
                            0 => (load(ql0), _mm256_slli_epi16(load(qh), 4)),
                            1 => (load(ql1), _mm256_slli_epi16(load(qh), 2)),
                            2 => (_mm256_srli_epi16(load(ql0), 4), load(qh)),
                            _ => (
                                _mm256_srli_epi16(load(ql1), 4),
                                _mm256_srli_epi16(load(qh), 2),
                            ),
                        };
                        // Chunk c: values 32c..32c+32, the 16-value halves taking scales
                        // 2c and 2c + 1.
                        let c = 4 * j + i;
                        let v =
                            _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m30));
                        let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                            scales,
                            _mm_add_epi8(
                                _mm_set1_epi8(2 * c as i8),
                                _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                            ),
                        ));
                        for a in 0..A {
                            let y = _mm256_loadu_si256(ys[a].add(4 + 32 * c) as *const _);
                            let p = _mm256_madd_epi16(sc, _mm256_maddubs_epi16(v, y));
                            sumi[a] = _mm256_add_epi32(sumi[a], p);
                        }
                    }
                }
                let sc16 = _mm256_cvtepi8_epi16(scales);
                let dw = super::dw(blk);
                for a in 0..A {
                    let y = ys[a];
                    super::add_block::<TILED>(
                        sumi[a],
                        y,
                        sc16,
                        dw,
                        &mut tacc[a][r],
                        &mut acc[a][r],
                    );
                }
            }
        }
        if TILED {
            return tacc;
        }
        super::hsums(&acc)
    }
}
