//! Test inputs shared by the kernels' tests: deterministic values and quantized weights, and
//! the relative difference they compare outputs by.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// Deterministic pseudo-random values in about -1..1 (xorshift).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// An `[n, k]` weight of `values(n * k, seed)` quantized to `dtype`.
pub fn quantized(n: usize, k: usize, seed: u64, dtype: GgmlDType) -> QMatMul {
    let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    QMatMul::from_arc(Arc::new(q)).unwrap()
}

/// max |a - b| over max |b|.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |s, v| s.max(v.abs()));
    a.iter().zip(b).fold(0f32, |s, (x, y)| s.max((x - y).abs())) / scale
}
