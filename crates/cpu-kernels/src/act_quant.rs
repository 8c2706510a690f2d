//! Activation quantization with llama.cpp's rounding. Our CPU matmuls multiply quantized
//! weights with activations quantized per block (Q8_0 for Q5_0 / Q8_0 weights, Q8_K for
//! K-quants); llama.cpp's x86 build rounds to the nearest integer with ties to even and
//! scales Q8_0 blocks by `127 / amax`, where candle rounds ties away from zero and scales by
//! `1 / (amax / 127)`. The differences are rare (an exact tie, or a product one ulp apart)
//! but each moves an activation by a whole quantisation step.

use candle_core::quantized::k_quants::{BlockQ8K, BlockQ8_0, GgmlType};

/// Values per Q8_0 block.
const QK8_0: usize = 32;
/// Values per Q8_K block.
const QK_K: usize = 256;

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 2 + QK8_0);
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 4 + QK_K + QK_K / 16 * 2);

/// The activation blocks written here, as the bytes they are made of.
trait PlainBlock {}
// `BlockQ8_0` is `repr(C)` { f16 d, [i8; 32] qs } and `BlockQ8K` `repr(C)` { f32 d, [i8; 256]
// qs, [i16; 16] bsums }, both without padding (asserted above): every byte pattern is a
// valid block.
impl PlainBlock for BlockQ8_0 {}
impl PlainBlock for BlockQ8K {}

fn bytes_mut<T: PlainBlock>(blocks: &mut [T]) -> &mut [u8] {
    // SAFETY: see `PlainBlock`: no padding, any bytes valid; the slice covers the blocks.
    unsafe {
        std::slice::from_raw_parts_mut(
            blocks.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(blocks),
        )
    }
}

/// `x` (a multiple of 32 values) into Q8_0 blocks as llama.cpp's AVX2 `quantize_row_q8_0`:
/// `d = amax / 127` (stored as f16), `q = round_ties_even(x * (127 / amax))`.
pub fn quantize_q8_0(x: &[f32], blocks: &mut [BlockQ8_0]) {
    assert_eq!(x.len(), blocks.len() * QK8_0, "q8_0: length mismatch");
    let bytes = bytes_mut(blocks);
    for (xs, b) in x.chunks_exact(QK8_0).zip(bytes.chunks_exact_mut(2 + QK8_0)) {
        let amax = abs_max(xs);
        b[..2].copy_from_slice(&half::f16::from_f32(amax / 127.0).to_le_bytes());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        round_scaled(xs, id, &mut b[2..]);
    }
}

/// `q = round_ties_even(v * scale)` saturated to i8, NaN to 0: the quantisation step both
/// formats share (their scales keep `|v * scale|` within 127 and a rounding error, so
/// only the clamp at 127 is ever reached). Rust's saturating float-to-int casts kept the loop scalar; the
/// AVX2 path (what the x86-64-v3 build compiles) rounds, clamps and packs 32 values at a
/// time (llama.cpp's `quantize_row_q8_0` packs the same way).
fn round_scaled(xs: &[f32], scale: f32, qs: &mut [u8]) {
    let one = |v: f32| ((v * scale).round_ties_even() as i32).clamp(-128, 127) as i8 as u8;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        use std::arch::x86_64::*;
        let chunks = xs.chunks_exact(32);
        let done = xs.len() - chunks.remainder().len();
        for (c, q) in chunks.zip(qs.chunks_exact_mut(32)) {
            // SAFETY: AVX2 is enabled at compile time (cfg above); `c` holds 32 values and
            // `q` 32 bytes, read and written unaligned.
            unsafe {
                let sv = _mm256_set1_ps(scale);
                let lanes: [__m256i; 4] = std::array::from_fn(|i| {
                    let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), sv);
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                    let r = _mm256_min_ps(r, _mm256_set1_ps(127.0));
                    // NaN (unordered) lanes become 0, as the cast makes them.
                    let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                    _mm256_cvtps_epi32(r)
                });
                let w = _mm256_packs_epi16(
                    _mm256_packs_epi32(lanes[0], lanes[1]),
                    _mm256_packs_epi32(lanes[2], lanes[3]),
                );
                let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
            }
        }
        for (q, &v) in qs[done..].iter_mut().zip(&xs[done..]) {
            *q = one(v);
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    for (q, &v) in qs.iter_mut().zip(xs) {
        *q = one(v);
    }
}

/// The largest `|v|` of `xs` (0 when empty; NaNs skipped), in eight lanes the compiler
/// turns into vector maxima (a fold through `f32::max` stays scalar).
fn abs_max(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m })
}

/// `x`, `m` rows of `k` values (a multiple of 256), into Q8_K blocks row by row
/// ([`quantize_q8k`]), the rows of a batch spread over the pool (a 512-token prompt's
/// 8960-wide rows on one thread left the other core idle for milliseconds a layer; a
/// decode batch's rows, quantized on the calling thread, took 1% of the 1.5B's step).
pub fn quantize_rows_q8k(x: &[f32], k: usize) -> Vec<BlockQ8K> {
    let (m, kb) = (x.len() / k, k / QK_K);
    let mut blocks = vec![BlockQ8K::zeros(); m * kb];
    let bp = crate::SharedMut(blocks.as_mut_ptr());
    crate::par_chunks(m, if m > 1 { m * kb * Q8K_COST } else { 0 }, |rows| {
        for r in rows {
            // SAFETY: row r owns blocks r*kb..(r+1)*kb; `blocks` outlives the call.
            let dst = unsafe { std::slice::from_raw_parts_mut(bp.get().add(r * kb), kb) };
            quantize_q8k(&x[r * k..(r + 1) * k], dst);
        }
    });
    blocks
}

/// What quantizing one 256-value block counts for in `par_chunks` units (32-value block
/// products): rows of eight blocks and more go to the pool in batches of eight (the
/// 1.5B's 8960-wide down-projection input); shorter ones stay on the calling thread (a
/// hand-off costs a few microseconds, what splitting eight 1536-wide rows would save).
const Q8K_COST: usize = 64;

/// `x` (a multiple of 256 values) into Q8_K blocks as llama.cpp's `quantize_row_q8_K_ref`:
/// the value of largest magnitude `max` maps to -127, `q = min(127, round_ties_even(x *
/// (-127 / max)))`, `d = 1 / (-127 / max)`, and the sums of each 16 quants.
pub fn quantize_q8k(x: &[f32], blocks: &mut [BlockQ8K]) {
    assert_eq!(x.len(), blocks.len() * QK_K, "q8_k: length mismatch");
    let bytes = bytes_mut(blocks);
    for (xs, b) in x
        .chunks_exact(QK_K)
        .zip(bytes.chunks_exact_mut(4 + QK_K + QK_K / 8))
    {
        // The first value of the largest magnitude (what a scan keeping strictly larger
        // ones finds), in two vectorisable passes.
        let amax = abs_max(xs);
        let max = xs.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
        let (d, rest) = b.split_at_mut(4);
        let (qs, sums) = rest.split_at_mut(QK_K);
        if amax == 0.0 {
            d.fill(0);
            qs.fill(0);
            sums.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        round_scaled(xs, iscale, qs);
        d.copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for (s, group) in sums.chunks_exact_mut(2).zip(qs.chunks_exact(16)) {
            let sum: i32 = group.iter().map(|&q| q as i8 as i32).sum();
            s.copy_from_slice(&(sum as i16).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abs_max_is_the_largest_magnitude() {
        let xs: Vec<f32> = (0..77).map(|i| ((i * 37) % 19) as f32 - 9.5).collect();
        assert_eq!(abs_max(&xs), 9.5);
        let mut ys = xs.clone();
        ys[76] = -30.0; // in the remainder
        ys[3] = f32::NAN;
        assert_eq!(abs_max(&ys), 30.0);
        assert_eq!(abs_max(&[]), 0.0);
        assert_eq!(abs_max(&[-0.0; 9]), 0.0);
        // Q8_K takes the first value of the largest magnitude (-4, not 4) to -127.
        let mut x = vec![0f32; 256];
        (x[5], x[200]) = (-4.0, 4.0);
        let mut b = vec![BlockQ8K::zeros(); 1];
        quantize_q8k(&x, &mut b);
        let bytes = bytes_mut(&mut b);
        let d = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        assert_eq!(
            (d, bytes[4 + 5] as i8, bytes[4 + 200] as i8),
            (4.0 / 127.0, -127, 127)
        );
    }

    #[test]
    fn round_scaled_equals_the_scalar_casts() {
        // Ties both ways, both ends, past 127 (clamped), below -128 (saturated), NaN, and a
        // remainder past the 32-value steps.
        let mut xs: Vec<f32> = (0..70).map(|i| (i as f32 - 35.0) * 0.5).collect();
        xs.extend([
            127.4,
            127.6,
            300.0,
            -127.5,
            -128.4,
            -400.0,
            f32::NAN,
            -0.0,
            0.49999997,
        ]);
        for scale in [1.0f32, 3.7, -1.0, 0.0] {
            let mut q = vec![0u8; xs.len()];
            round_scaled(&xs, scale, &mut q);
            for (&v, &q) in xs.iter().zip(&q) {
                let want = ((v * scale).round_ties_even() as i32).clamp(-128, 127) as i8;
                assert_eq!(q as i8, want, "{v} * {scale}");
            }
        }
    }

    #[test]
    fn q8_0_rounds_ties_to_even() {
        // 127 / amax = 1 exactly: x * id is x itself, so the halves are ties.
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut b = vec![BlockQ8_0::zeros(); 1];
        quantize_q8_0(&x, &mut b);
        let mut y = vec![0f32; 32];
        BlockQ8_0::to_float(&b, &mut y);
        assert_eq!(&y[..4], &[127.0, 2.0, -4.0, 0.0]);
    }

    #[test]
    fn q8k_rounds_ties_to_even_within_half_a_step() {
        let mut x = vec![0f32; 256];
        x[0] = -127.0; // max = -127: iscale = 1, so x * iscale = x
        x[1] = 4.5;
        x[2] = -5.5;
        x[3] = 126.5;
        let mut b = vec![BlockQ8K::zeros(); 1];
        quantize_q8k(&x, &mut b);
        let mut y = vec![0f32; 256];
        BlockQ8K::to_float(&b, &mut y);
        assert_eq!(&y[..4], &[-127.0, 4.0, -6.0, 126.0]);
        let x: Vec<f32> = (0..2048)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut b = vec![BlockQ8K::zeros(); 8];
        quantize_q8k(&x, &mut b);
        let mut y = vec![0f32; 2048];
        BlockQ8K::to_float(&b, &mut y);
        for (xs, ys) in x.chunks(256).zip(y.chunks(256)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in xs.iter().zip(ys) {
                assert!((a - b).abs() <= amax / 127.0 * 0.5001, "{a} vs {b}");
            }
        }
    }
}
