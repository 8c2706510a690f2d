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
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        b[..2].copy_from_slice(&half::f16::from_f32(amax / 127.0).to_le_bytes());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in b[2..].iter_mut().zip(xs) {
            *q = (v * id).round_ties_even() as i8 as u8;
        }
    }
}

/// `x`, `m` rows of `k` values (a multiple of 256), into Q8_K blocks row by row
/// ([`quantize_q8k`]), the rows of a batch spread over the pool (a 512-token prompt's
/// 8960-wide rows on one thread left the other core idle for milliseconds a layer).
pub fn quantize_rows_q8k(x: &[f32], k: usize) -> Vec<BlockQ8K> {
    let (m, kb) = (x.len() / k, k / QK_K);
    let mut blocks = vec![BlockQ8K::zeros(); m * kb];
    let bp = crate::SharedMut(blocks.as_mut_ptr());
    crate::par_chunks(m, if m > 1 { m * kb * 8 } else { 0 }, |rows| {
        for r in rows {
            // SAFETY: row r owns blocks r*kb..(r+1)*kb; `blocks` outlives the call.
            let dst = unsafe { std::slice::from_raw_parts_mut(bp.get().add(r * kb), kb) };
            quantize_q8k(&x[r * k..(r + 1) * k], dst);
        }
    });
    blocks
}

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
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let (d, rest) = b.split_at_mut(4);
        let (qs, sums) = rest.split_at_mut(QK_K);
        if amax == 0.0 {
            d.fill(0);
            qs.fill(0);
            sums.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, v) in qs.iter_mut().zip(xs) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8 as u8;
        }
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
