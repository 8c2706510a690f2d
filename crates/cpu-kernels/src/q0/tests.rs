use super::*;
use crate::WeightMemory;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Module};
use std::sync::Arc;

use crate::test_util::{quantized, rel_diff, time_ms, values};

fn q5_weight(n: usize, k: usize, seed: u64) -> QMatMul {
    quantized(n, k, seed, GgmlDType::Q5_0)
}

fn kernels() -> Vec<Kernel> {
    [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::AvxVnni,
        Kernel::Avx512Vnni,
    ]
    .into_iter()
    .filter(|k| k.available())
    .collect()
}

fn run(w: &QMatMul, kernel: Kernel, x: &Tensor) -> Vec<f32> {
    let q = Q0Matmul::with_kernel(w, kernel).unwrap();
    let y = q.forward(x).unwrap();
    y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn candle(w: &QMatMul, x: &Tensor) -> Vec<f32> {
    let y = w.forward(x).unwrap();
    y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `x @ dequant(w)^T` in f64: the product both roundings approximate.
fn exact(w: &QMatMul, x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let QMatMul::QTensor(t) = w else {
        unreachable!("quantized")
    };
    let wd = t
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let mut out = Vec::with_capacity(m * wd.len());
    for r in 0..m {
        for row in &wd {
            let dot: f64 = row
                .iter()
                .zip(&x[r * k..(r + 1) * k])
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            out.push(dot as f32);
        }
    }
    out
}

#[test]
fn as_accurate_as_candle() {
    // Same products; llama.cpp's activation rounding (ties to even, `127 / amax`) and its
    // f32 order instead of candle's: as far from the exact product as candle is.
    for dtype in [GgmlDType::Q5_0, GgmlDType::Q8_0] {
        for (n, k) in [(896, 896), (4864, 896), (896, 4864), (40, 64)] {
            let w = quantized(n, k, (n * 31 + k) as u64, dtype);
            for m in [1, 3, 17] {
                let xv = values(m * k, m as u64 + 7);
                let x = Tensor::from_vec(xv.clone(), (m, k), &Device::Cpu).unwrap();
                let want = exact(&w, &xv, m, k);
                let theirs = rel_diff(&candle(&w, &x), &want);
                for kernel in kernels() {
                    let d = rel_diff(&run(&w, kernel, &x), &want);
                    assert!(
                        d <= 2.0 * theirs + 1e-4,
                        "{dtype:?} {kernel:?} [{m}x{k}] x [{n}x{k}]^T: {d} vs candle {theirs}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_matches_scalar() {
    // Row counts cover every tile shape (full, padded, single row) and weight row counts
    // that are not multiples of the eight-row group.
    for (n, k, m) in [
        (896, 896, 1),
        (130, 4864, 7),
        (896, 96, 64),
        (8, 32, 2),
        (33, 128, 13),
        (17, 64, 9),
        (3, 64, 1),
    ] {
        for dtype in [GgmlDType::Q5_0, GgmlDType::Q8_0] {
            let w = quantized(n, k, 5 + n as u64, dtype);
            let x = Tensor::from_vec(values(m * k, 13), (m, k), &Device::Cpu).unwrap();
            let scalar = run(&w, Kernel::Scalar, &x);
            for kernel in kernels().into_iter().skip(1) {
                // Bit for bit: the same lanes, the same f32 steps.
                let got = run(&w, kernel, &x);
                assert!(
                    got == scalar,
                    "{dtype:?} {kernel:?} [{m}x{k}] x [{n}x{k}]^T differs"
                );
            }
        }
    }
}

#[test]
fn extreme_values_decode_exactly() {
    // Blocks at the quantizers' ends (weights -16 and 15, activations +-127): the
    // integer dots must not saturate anywhere.
    let (n, k, m) = (9, 64, 3);
    let wv: Vec<f32> = (0..n * k)
        .map(|i| if i % 3 == 0 { -1.0 } else { 0.93 })
        .collect();
    let w = Tensor::from_vec(wv, (n, k), &Device::Cpu).unwrap();
    let w = QTensor::quantize(&w, GgmlDType::Q5_0).unwrap();
    let w = QMatMul::from_arc(Arc::new(w)).unwrap();
    let xv: Vec<f32> = (0..m * k)
        .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let x = Tensor::from_vec(xv, (m, k), &Device::Cpu).unwrap();
    // Every activation is +-127 after quantisation: candle's rounding is the same here.
    let want = candle(&w, &x);
    for kernel in kernels() {
        let got = run(&w, kernel, &x);
        assert!(
            rel_diff(&got, &want) <= 1e-6,
            "{kernel:?}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn batched_input_and_other_dtypes() {
    let w = q5_weight(16, 64, 9);
    let ours = Q0Matmul::new(&w, crate::CpuKernel::Auto, WeightMemory::default()).unwrap();
    let x = Tensor::from_vec(values(2 * 3 * 64, 1), (2, 3, 64), &Device::Cpu).unwrap();
    let got = ours.forward(&x).unwrap();
    assert_eq!(got.dims(), &[2, 3, 16]);
    let want = w.forward(&x).unwrap();
    let d = rel_diff(
        &got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        &want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    assert!(d <= 1e-5);
    // A transposed (non-contiguous) input is made contiguous first.
    let xt = Tensor::from_vec(values(64 * 3, 2), (64, 3), &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    assert_eq!(ours.forward(&xt).unwrap().dims(), &[3, 16]);
    // Wrong inner size is an error, not a panic.
    let bad = Tensor::zeros((2, 63), DType::F32, &Device::Cpu).unwrap();
    assert!(ours.forward(&bad).is_err());
}

#[test]
fn only_q5_0_and_q8_0_cpu_weights_are_taken() {
    let w = Tensor::from_vec(values(32 * 64, 4), (32, 64), &Device::Cpu).unwrap();
    let q = |t| QMatMul::from_arc(Arc::new(QTensor::quantize(&w, t).unwrap())).unwrap();
    assert!(Q0Matmul::with_kernel(&q(GgmlDType::Q8_0), Kernel::Scalar).is_some());
    assert!(Q0Matmul::with_kernel(&q(GgmlDType::Q5_0), Kernel::Scalar).is_some());
    assert!(Q0Matmul::with_kernel(&q(GgmlDType::Q4_0), Kernel::Scalar).is_none());
    assert!(Q0Matmul::with_kernel(&QMatMul::Tensor(w), Kernel::Scalar).is_none());
}

#[test]
fn bad_sizes_are_errors() {
    let f = Format::Q5_0;
    // One Q5_0 row of one block is stored as a group of eight: 176 bytes.
    let w = [0u8; 176];
    let x = [0f32; 32];
    assert_eq!(matmul(Kernel::Scalar, f, &w, 1, 32, &x).unwrap(), [0.0]);
    assert!(matmul(Kernel::Scalar, f, &w, 1, 33, &[0f32; 33]).is_err());
    assert!(matmul(Kernel::Scalar, f, &w[..22], 1, 32, &x).is_err());
    assert!(matmul(Kernel::Scalar, f, &w, 1, 32, &x[..31]).is_err());
}

/// `cargo test --release -p tokenrouter-cpu-kernels q0::tests::speed -- --ignored --nocapture`
/// (with `RAYON_NUM_THREADS=1` the CPU-time column is the kernel's cost on one core,
/// whatever else runs on the machine).
#[test]
#[ignore]
fn speed() {
    // The 0.5B's up and down projections.
    for (n, k, m) in [
        (4864, 896, 1),
        (4864, 896, 8),
        (4864, 896, 16),
        (4864, 896, 128),
        (4864, 896, 512),
        (896, 4864, 512),
    ] {
        let w = q5_weight(n, k, 1);
        let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
        let reps = (4096 / m).max(8);
        let time = |f: &dyn Fn() -> Tensor| time_ms(reps, f);
        let (c, cc) = time(&|| w.forward(&x).unwrap());
        let mut line = format!("m={m:4} [{n}x{k}]: candle {c:.3} ms (cpu {cc:.3})");
        for kernel in kernels() {
            let ours = Q0Matmul::with_kernel(&w, kernel).unwrap();
            let (o, oc) = time(&|| ours.forward(&x).unwrap());
            line += &format!(", {kernel:?} {o:.3} (cpu {oc:.3})");
        }
        println!("{line}");
    }
}

/// The kernel this CPU picks, alone, on batches (quicker than `speed` for A/B runs of
/// builds on a noisy host: best of several repeats).
#[test]
#[ignore]
fn speed_batches() {
    // `Q0_KERNEL=avx2` times the AVX2 kernel on a CPU that would pick another.
    let kernel = match std::env::var("Q0_KERNEL").as_deref() {
        Ok("avx2") => Kernel::Avx2,
        _ => Kernel::detect(),
    };
    for (dtype, n, k, m) in [
        (GgmlDType::Q5_0, 4864, 896, 16),
        (GgmlDType::Q5_0, 4864, 896, 128),
        (GgmlDType::Q5_0, 4864, 896, 512),
        (GgmlDType::Q5_0, 896, 4864, 128),
        (GgmlDType::Q5_0, 896, 4864, 512),
        // The 0.5B's output matrix, a cache-resident slice and then all of it (a batched
        // decode step's eight rows).
        (GgmlDType::Q8_0, 16384, 896, 8),
        (GgmlDType::Q8_0, 16384, 896, 128),
        (GgmlDType::Q8_0, 151936, 896, 8),
        (GgmlDType::Q5_0, 65536, 896, 8),
    ] {
        let w = quantized(n, k, 1, dtype);
        let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
        let ours = Q0Matmul::with_kernel(&w, kernel).unwrap();
        let (ms, _) = time_ms((4096 / m).max(8), &|| ours.forward(&x).unwrap());
        println!("{kernel:?} {dtype:?} m={m:4} [{n}x{k}]: {ms:.3} ms");
    }
}

/// One decode step's Q5_0 matrices of the 0.5B (24 layers of q, k, v, o, gate, up), cold
/// from DRAM (the layers together are ~10x the last-level cache): the single-row kernel's
/// streaming rate, against what the machine can read.
#[test]
#[ignore]
fn speed_cold_step() {
    let shapes = [
        (896, 896),
        (128, 896),
        (128, 896),
        (896, 896),
        (4864, 896),
        (4864, 896),
    ];
    let sources: Vec<QMatMul> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| q5_weight(n, k, i as u64))
        .collect();
    let bytes: usize = shapes
        .iter()
        .map(|&(n, k)| n * k / 32 * Format::Q5_0.block_bytes())
        .sum();
    for kernel in kernels().into_iter().skip(1) {
        let layers: Vec<Vec<Q0Matmul>> = (0..24)
            .map(|_| {
                sources
                    .iter()
                    .map(|w| Q0Matmul::with_kernel(w, kernel).unwrap())
                    .collect()
            })
            .collect();
        // One row (a decode step), eight (a batched one).
        for m in [1, 8] {
            let inputs = crate::test_util::inputs_for(&shapes, m, 3);
            let (ms, _) = time_ms(5, &|| {
                for layer in &layers {
                    for (w, x) in layer.iter().zip(&inputs) {
                        w.forward(x).unwrap();
                    }
                }
            });
            let gb_s = layers.len() as f64 * bytes as f64 / ms / 1e6;
            println!("{kernel:?}, {m} rows: {ms:.2} ms a step, {gb_s:.1} GB/s");
        }
    }
}

/// The 256-bit batch kernel alone on one L1-resident group of eight weight rows and eight
/// activation rows, one thread: cycles per (weight row, block, activation row) at the
/// clock given in `CPU_GHZ` (default 3.2).
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn speed_tile_kernel() {
    if !Kernel::Avx2.available() {
        return;
    }
    let ghz = crate::test_util::cpu_ghz();
    let (n, k) = (8, 896);
    let kb = k / QK;
    let x = values(8 * k, 2);
    let lhs = QuantizedLhs::new(&x, 8, k, Kernel::Avx2);
    let lines = lhs.tile_lines(0).unwrap();
    let scales = lhs.tile_scales(0);
    for format in [Format::Q5_0, Format::Q8_0] {
        let w = quantized(n, k, 1, format.dtype());
        let ours = Q0Matmul::with_kernel(&w, Kernel::Avx2).unwrap();
        let bytes = ours.w.bytes().unwrap().to_vec();
        let rows = Rows::group(format, n, kb, 0);
        let mut dots = [[0f32; TILE]; TILE];
        let reps = 100_000;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                // SAFETY: the CPU runs AVX2 (this test runs only where it does).
                unsafe {
                    avx2::dot_acts(format, (&bytes, &rows, 8), false, lines, scales, &mut dots)
                };
                std::hint::black_box(&mut dots);
            }
            best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "{format:?}: {:.2} cycles per (row, block, row)",
            best * ghz * 1e9 / (64 * kb) as f64
        );
    }
}
