//! Test inputs shared by the kernels' tests: deterministic values and quantized weights, the
//! relative difference they compare outputs by, and the timing of the ignored speed tests.

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

/// CPU time of the calling thread in ms (`/proc/thread-self/schedstat`), 0 if unknown.
fn thread_cpu_ms() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e6)
}

/// One `[m, k]` input per `(n, k)` weight shape (the cold-step measurements' activations).
pub fn inputs_for(shapes: &[(usize, usize)], m: usize, seed: u64) -> Vec<candle_core::Tensor> {
    shapes
        .iter()
        .map(|&(_, k)| {
            let x = values(m * k, seed);
            candle_core::Tensor::from_vec(x, (m, k), &candle_core::Device::Cpu).unwrap()
        })
        .collect()
}

/// The clock the kernel microbenchmarks turn time into cycles with: `CPU_GHZ`, else 3.2.
pub fn cpu_ghz() -> f64 {
    std::env::var("CPU_GHZ")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3.2)
}

/// `f` run once to warm up, then `reps` times: the fastest wall time in ms (the machine may
/// be shared) and the mean CPU time of this thread.
pub fn time_ms<T>(reps: usize, f: &dyn Fn() -> T) -> (f64, f64) {
    f();
    let cpu = thread_cpu_ms();
    let wall = (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min);
    (wall, (thread_cpu_ms() - cpu) / reps as f64)
}
