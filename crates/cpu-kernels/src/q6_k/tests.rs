use super::*;
use candle_core::quantized::QTensor;
use candle_core::{Device, Module};
use std::sync::Arc;

use crate::test_util::{quantized, rel_diff, time_ms, values};
use crate::SharedMut;

fn q6k_weight(n: usize, k: usize, seed: u64) -> QMatMul {
    quantized(n, k, seed, GgmlDType::Q6K)
}

fn kernels() -> Vec<Kernel> {
    [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni]
        .into_iter()
        .filter(|k| k.available())
        .collect()
}

/// The GGUF bytes of a quantized weight.
fn weight_bytes(w: &QMatMul) -> std::borrow::Cow<'_, [u8]> {
    match w {
        QMatMul::QTensor(t) => t.data().unwrap(),
        _ => unreachable!("quantized"),
    }
}

fn flat(t: Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn simd_matches_scalar_and_is_close_to_candle() {
    for (n, k) in [
        (1536, 1536),
        (256, 1536),
        (1536, 8960),
        (8960, 1536),
        (12, 512),
        (6, 256),
    ] {
        let w = q6k_weight(n, k, (n * 17 + k) as u64);
        // One row, a few (the vec_dot arithmetic), eight and more (the tiled one), enough
        // for the unpacked tiles.
        for m in [1, 3, 8, 9, 40] {
            let x = Tensor::from_vec(values(m * k, n as u64), (m, k), &Device::Cpu).unwrap();
            let seqs = Some(&[m][..]);
            let scalar = Q6kMatmul::with_kernel(&w, Kernel::Scalar).unwrap();
            // Every row a sequence of its own too (a batch of decode rows: runs of eight,
            // four, two and one rows share the unpacked weights).
            let alone = flat(scalar.forward(&x, None).unwrap());
            let scalar = flat(scalar.forward(&x, seqs).unwrap());
            for kernel in kernels().into_iter().skip(1) {
                let q = Q6kMatmul::with_kernel(&w, kernel).unwrap();
                let got = flat(q.forward(&x, seqs).unwrap());
                assert!(got == scalar, "{kernel:?} [{m}x{k}] x [{n}x{k}]^T differs");
                let got = flat(q.forward(&x, None).unwrap());
                assert!(got == alone, "{kernel:?} [{m}x{k}] rows alone differ");
            }
            let d = rel_diff(&scalar, &flat(w.forward(&x).unwrap()));
            assert!(
                d <= 1e-3,
                "[{m}x{k}] x [{n}x{k}]^T: rel diff {d} from candle"
            );
        }
    }
}

/// The unpacked-tile path (every kernel, its scalar loop included) gives the row kernels'
/// tiled results bit for bit: a row count that is not a multiple of 16 (the last tile
/// repeats a row), a sequence long enough for tiles beside short ones in the same call.
#[test]
fn unpacked_tiles_equal_the_row_kernels() {
    let (n, k) = (40, 768);
    let w = q6k_weight(n, k, 11);
    let data = weight_bytes(&w);
    let m = 37;
    let x = values(m * k, 7);
    let want = matvec(Kernel::Scalar, &data, n, k, &x, &[true; 37]).unwrap();
    let kb = k / QK_K;
    let lhs = crate::act_quant::quantize_rows_q8k(&x, k);
    let rows: Vec<usize> = (0..m).collect();
    for kernel in kernels() {
        let mut got = vec![0f32; m * n];
        let out = SharedMut(got.as_mut_ptr());
        tiled::matmul(kernel, &data, n, kb, as_bytes(&lhs), &rows, out);
        assert!(got == want, "{kernel:?}");
    }
    // 33 rows of one sequence (tiles) and 4 of others (rows), in one call.
    let xt = Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap();
    let seqs = [2, 33, 1, 1];
    let scalar = Q6kMatmul::with_kernel(&w, Kernel::Scalar).unwrap();
    let want = flat(scalar.forward(&xt, Some(&seqs)).unwrap());
    for kernel in kernels().into_iter().skip(1) {
        let q = Q6kMatmul::with_kernel(&w, kernel).unwrap();
        assert!(
            flat(q.forward(&xt, Some(&seqs)).unwrap()) == want,
            "{kernel:?}"
        );
    }
}

#[test]
fn batches_of_eight_rows_round_like_llamacpp_tiles() {
    let (n, k) = (16, 512);
    let w = q6k_weight(n, k, 3);
    let data = weight_bytes(&w);
    let x = values(8 * k, 5);
    let q = Q6kMatmul::with_kernel(&w, Kernel::Scalar).unwrap();
    let xt = Tensor::from_vec(x.clone(), (8, k), &Device::Cpu).unwrap();
    let batch = flat(q.forward(&xt, Some(&[8])).unwrap());
    // The same rows as eight sequences of one row: each rounds like a row alone.
    let alone = flat(q.forward(&xt, Some(&[1; 8])).unwrap());
    assert!(alone == flat(q.forward(&xt, None).unwrap()));
    for kernel in kernels() {
        for (r, want) in batch.chunks(n).enumerate() {
            let xr = &x[r * k..(r + 1) * k];
            let tiled = matvec(kernel, &data, n, k, xr, &[true]).unwrap();
            let one = matvec(kernel, &data, n, k, xr, &[false]).unwrap();
            assert!(tiled == want, "{kernel:?} row {r}");
            assert!(one == alone[r * n..(r + 1) * n], "{kernel:?} row {r}");
            assert!(rel_diff(&one, &tiled) <= 1e-5);
        }
    }
}

#[test]
fn extreme_values() {
    let (n, k) = (20, 512);
    let wv: Vec<f32> = (0..n * k)
        .map(|i| match i % 4 {
            0 => -1.0,
            1 => 1.0,
            2 => 0.0,
            _ => (i % 9) as f32 * -0.1,
        })
        .collect();
    let w = Tensor::from_vec(wv, (n, k), &Device::Cpu).unwrap();
    let w = QMatMul::from_arc(Arc::new(QTensor::quantize(&w, GgmlDType::Q6K).unwrap())).unwrap();
    let xv: Vec<f32> = (0..k)
        .map(|i| if i % 3 == 0 { 50.0 } else { -1.0 })
        .collect();
    let x = Tensor::from_vec(xv, (1, 1, k), &Device::Cpu).unwrap();
    let want = flat(w.forward(&x).unwrap());
    let scalar = Q6kMatmul::with_kernel(&w, Kernel::Scalar).unwrap();
    let scalar = flat(scalar.forward(&x, None).unwrap());
    assert!(rel_diff(&scalar, &want) <= 1e-5);
    for kernel in kernels() {
        let got = Q6kMatmul::with_kernel(&w, kernel).unwrap();
        let got = got.forward(&x, None).unwrap();
        assert_eq!(got.dims(), &[1, 1, n]);
        assert!(flat(got) == scalar, "{kernel:?}");
    }
}

/// `cargo test --release -p tokenrouter-cpu-kernels q6_k::tests::speed -- --ignored --nocapture`
#[test]
#[ignore]
fn speed() {
    for (n, k) in [(1536, 8960), (8960, 1536), (151936, 1536)] {
        let w = q6k_weight(n, k, 1);
        for m in [1, 2, 4, 8, 32, 64, 512] {
            if n * m > 1 << 24 {
                continue;
            }
            let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
            let reps = (2048 / m).max(4);
            let time = |f: &dyn Fn() -> Tensor| time_ms(reps, f);
            let (c, cc) = time(&|| w.forward(&x).unwrap());
            let mut line = format!("m={m:4} [{n}x{k}]: candle {c:.3} ms (cpu {cc:.3})");
            for kernel in kernels().into_iter().skip(1) {
                let ours = Q6kMatmul::with_kernel(&w, kernel).unwrap();
                let (o, oc) = time(&|| ours.forward(&x, Some(&[m])).unwrap());
                line += &format!(", {kernel:?} {o:.3} (cpu {oc:.3})");
                if (2..=8).contains(&m) {
                    // m decode rows of m sequences (a batched decode step).
                    let (o, _) = time(&|| ours.forward(&x, None).unwrap());
                    line += &format!(" decode rows {o:.3}");
                }
            }
            println!("{line}");
        }
    }
}

/// The Q6_K matrices of a 1.5B decode step one after another (half of its 28 layers keep
/// v and down in Q6_K, and the output matrix: about 350 MB, cold from DRAM as in a real step),
/// one activation row and eight decode rows (a batched step).
/// `cargo test --release -p tokenrouter-cpu-kernels --lib q6_k::tests::speed_cold_step -- --exact --ignored --nocapture`
#[test]
#[ignore]
fn speed_cold_step() {
    let shapes = [(256, 1536), (1536, 8960)];
    let output = q6k_weight(151936, 1536, 9);
    for kernel in kernels().into_iter().skip(1) {
        let layers: Vec<Vec<Q6kMatmul>> = (0..14)
            .map(|l| {
                shapes
                    .iter()
                    .map(|&(n, k)| Q6kMatmul::with_kernel(&q6k_weight(n, k, l), kernel).unwrap())
                    .collect()
            })
            .collect();
        let output = Q6kMatmul::with_kernel(&output, kernel).unwrap();
        for m in [1, 8] {
            let inputs = crate::test_util::inputs_for(&shapes, m, 3);
            let last = Tensor::from_vec(values(m * 1536, 4), (m, 1536), &Device::Cpu).unwrap();
            let (layers_ms, _) = time_ms(5, &|| {
                for layer in &layers {
                    for (w, x) in layer.iter().zip(&inputs) {
                        w.forward(x, None).unwrap();
                    }
                }
            });
            let (out_ms, _) = time_ms(5, &|| output.forward(&last, None).unwrap());
            println!("{kernel:?}, {m} rows: layers {layers_ms:.2} ms, output {out_ms:.2} ms");
        }
    }
}

/// The AVX2 eight-decode-row kernel alone on eight weight rows that stay in L1 (k = 1536:
/// 8 x 1260 bytes) against eight activation rows: cycles per (activation row, 32-value
/// chunk), one `vpmaddubsw` and one `vpmaddwd` each, at `CPU_GHZ` (default 3.2).
/// `cargo test --release -p tokenrouter-cpu-kernels --lib q6_k::tests::speed_tile_kernel -- --exact --ignored --nocapture`
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn speed_tile_kernel() {
    if !Kernel::Avx2.available() {
        return;
    }
    let ghz = crate::test_util::cpu_ghz();
    let k = 1536;
    let kb = k / QK_K;
    let w = q6k_weight(ROWS, k, 1);
    let w = weight_bytes(&w);
    let ws: [&[u8]; ROWS] =
        std::array::from_fn(|r| &w[r * kb * Q6K_BYTES..(r + 1) * kb * Q6K_BYTES]);
    let lhs = crate::act_quant::quantize_rows_q8k(&values(8 * k, 2), k);
    let lhs = as_bytes(&lhs);
    let qs: [&[u8]; 8] =
        std::array::from_fn(|a| &lhs[a * kb * Q8K_BYTES..(a + 1) * kb * Q8K_BYTES]);
    let reps = 100_000 / kb;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            // SAFETY: the CPU runs AVX2 (checked above).
            let out = unsafe { x86::avx2::dot::<false, 8>(&ws, qs) };
            std::hint::black_box(out);
        }
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    let steps = (ROWS * 8 * kb * 8) as f64;
    println!("{:.3} cycles per (row, chunk)", best * ghz * 1e9 / steps);
}
