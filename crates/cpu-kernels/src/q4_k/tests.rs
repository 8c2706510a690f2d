use super::*;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Module};

use crate::test_util::{quantized, rel_diff, time_ms, values};

fn q4k_weight(n: usize, k: usize, seed: u64) -> QMatMul {
    quantized(n, k, seed, GgmlDType::Q4K)
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

/// `x`'s rows as one sequence (a prompt, as llama.cpp multiplies it).
fn run(w: &QMatMul, kernel: Kernel, x: &Tensor) -> Vec<f32> {
    run_seqs(w, kernel, x, &[x.dim(0).unwrap()])
}

fn run_seqs(w: &QMatMul, kernel: Kernel, x: &Tensor, seqs: &[usize]) -> Vec<f32> {
    let q = Q4kMatmul::with_kernel(w, kernel).unwrap();
    let y = q.forward(x, Some(seqs)).unwrap();
    y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn candle(w: &QMatMul, x: &Tensor) -> Vec<f32> {
    let y = w.forward(x).unwrap();
    y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn simd_matches_scalar_and_is_close_to_candle() {
    // The 1.5B's shapes, and a small one; row counts around the groups of four.
    for (n, k) in [
        (1536, 1536),
        (8960, 1536),
        (1536, 8960),
        (256, 1536),
        (32, 512),
    ] {
        let w = q4k_weight(n, k, (n * 31 + k) as u64);
        for m in [1, 3, 4, 5, 8, 16, 17, 64] {
            let x = Tensor::from_vec(values(m * k, m as u64 + 7), (m, k), &Device::Cpu).unwrap();
            let scalar = run(&w, Kernel::Scalar, &x);
            for kernel in kernels().into_iter().skip(1) {
                // Bit for bit: the same integer sums and f32 steps.
                let got = run(&w, kernel, &x);
                assert!(got == scalar, "{kernel:?} [{m}x{k}] x [{n}x{k}]^T differs");
            }
            // candle: the same products, other rounding.
            let d = rel_diff(&scalar, &candle(&w, &x));
            assert!(
                d <= 1e-3,
                "[{m}x{k}] x [{n}x{k}]^T: rel diff {d} from candle"
            );
        }
    }
}

#[test]
fn rows_round_by_their_sequence_group_of_four() {
    // llama.cpp multiplies a sequence's rows up to its last multiple of four with its gemm
    // and the rest with its gemv: the fifth row of five rounds like a row alone, the first
    // four like a sequence of four; and a row's result depends only on its own sequence.
    let (n, k) = (32, 512);
    let w = q4k_weight(n, k, 5);
    let x = Tensor::from_vec(values(9 * k, 3), (9, k), &Device::Cpu).unwrap();
    let part = |from: usize, m: usize| x.narrow(0, from, m).unwrap();
    for kernel in kernels() {
        let five = run(&w, kernel, &part(0, 5));
        assert!(five[..4 * n] == run(&w, kernel, &part(0, 4))[..]);
        assert!(five[4 * n..] == run(&w, kernel, &part(4, 1))[..]);
        // Sequences of 5, 1 and 3 rows in one step: each as if alone.
        let mixed = run_seqs(&w, kernel, &x, &[5, 1, 3]);
        assert!(mixed[..5 * n] == five[..]);
        assert!(mixed[5 * n..6 * n] == run(&w, kernel, &part(5, 1))[..]);
        assert!(mixed[6 * n..] == run(&w, kernel, &part(6, 3))[..]);
        // Sequences of 1, 4 and 4: the first group of four holds a row of each rounding.
        let mixed = run_seqs(&w, kernel, &x, &[1, 4, 4]);
        assert!(mixed[..n] == run(&w, kernel, &part(0, 1))[..]);
        assert!(mixed[n..5 * n] == run(&w, kernel, &part(1, 4))[..]);
        assert!(mixed[5 * n..] == run(&w, kernel, &part(5, 4))[..]);
        // Rows on their own (no grouping given) all round like a single row.
        let q = Q4kMatmul::with_kernel(&w, kernel).unwrap();
        let alone = q.forward(&part(0, 4), None).unwrap();
        let alone = alone.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(alone[..n] == run(&w, kernel, &part(0, 1))[..]);
    }
}

#[test]
fn batched_decode_rows_match_scalar_and_each_row_alone() {
    // Batches of decode rows (each its own sequence) of 2..=16 rows, through one to four
    // groups of up to four (each tile row through all of them at once): every kernel gives
    // the scalar order's results, and each row the result it gets alone.
    let (n, k) = (48, 768);
    let w = q4k_weight(n, k, 11);
    let x = Tensor::from_vec(values(16 * k, 5), (16, k), &Device::Cpu).unwrap();
    let decode = |kernel: Kernel, m: usize| {
        let q = Q4kMatmul::with_kernel(&w, kernel).unwrap();
        let y = q.forward(&x.narrow(0, 0, m).unwrap(), None).unwrap();
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let scalar = decode(Kernel::Scalar, 16);
    for kernel in kernels() {
        let alone: Vec<f32> = (0..16)
            .flat_map(|r| run(&w, kernel, &x.narrow(0, r, 1).unwrap()))
            .collect();
        assert!(
            alone == scalar,
            "{kernel:?}: rows alone differ from the scalar order"
        );
        for m in [2, 5, 7, 8, 9, 12, 13, 16] {
            let got = decode(kernel, m);
            assert!(
                got[..] == scalar[..m * n],
                "{kernel:?}: {m} decode rows differ"
            );
        }
    }
}

#[test]
fn extreme_values() {
    // Weights at the quantizer's ends and large activations of both signs.
    let (n, k, m) = (16, 512, 5);
    let wv: Vec<f32> = (0..n * k)
        .map(|i| match i % 5 {
            0 => -1.0,
            1 => 1.0,
            2 => 0.0,
            _ => (i % 7) as f32 * 0.1,
        })
        .collect();
    let w = Tensor::from_vec(wv, (n, k), &Device::Cpu).unwrap();
    let w = QMatMul::from_arc(Arc::new(QTensor::quantize(&w, GgmlDType::Q4K).unwrap())).unwrap();
    // Mixed signs; and every activation equal, which quantizes to -128 everywhere, so the
    // sub-block sums reach their bound (|32 * 15 * 128|): no integer step may overflow.
    let mixed: Vec<f32> = (0..m * k)
        .map(|i| if i % 3 == 0 { 100.0 } else { -1.0 })
        .collect();
    for (xv, tol) in [(mixed, 1e-5), (vec![50.0; m * k], 1e-2)] {
        let x = Tensor::from_vec(xv, (m, k), &Device::Cpu).unwrap();
        let scalar = run(&w, Kernel::Scalar, &x);
        assert!(rel_diff(&scalar, &candle(&w, &x)) <= tol);
        for kernel in kernels() {
            assert!(run(&w, kernel, &x) == scalar, "{kernel:?}");
        }
    }
}

#[test]
fn batched_input_and_fallbacks() {
    let w = q4k_weight(32, 256, 9);
    let ours = Q4kMatmul::with_kernel(&w, Kernel::Scalar).unwrap();
    let x = Tensor::from_vec(values(2 * 3 * 256, 1), (2, 3, 256), &Device::Cpu).unwrap();
    let got = ours.forward(&x, None).unwrap();
    assert_eq!(got.dims(), &[2, 3, 32]);
    let want = w.forward(&x).unwrap();
    assert!(
        rel_diff(
            &got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            &want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        ) <= 1e-3
    );
    // A transposed (non-contiguous) input is made contiguous first.
    let xt = Tensor::from_vec(values(256 * 3, 2), (256, 3), &Device::Cpu)
        .unwrap()
        .t()
        .unwrap();
    assert_eq!(ours.forward(&xt, None).unwrap().dims(), &[3, 32]);
    // Wrong inner size is an error, not a panic.
    let bad = Tensor::zeros((2, 255), DType::F32, &Device::Cpu).unwrap();
    assert!(ours.forward(&bad, None).is_err());
    // The tiles are all it needs: with the original weight gone it multiplies the same, and
    // a bf16 input goes through f32 (its result rounded back to bf16).
    let x2 = Tensor::from_vec(values(4 * 256, 5), (4, 256), &Device::Cpu).unwrap();
    let before = ours.forward(&x2, None).unwrap();
    let ours = Q4kMatmul::with_kernel(&q4k_weight(32, 256, 9), Kernel::Scalar).unwrap();
    let after = ours.forward(&x2, None).unwrap();
    assert!(before.to_vec2::<f32>().unwrap() == after.to_vec2::<f32>().unwrap());
    let half = ours
        .forward(&x2.to_dtype(DType::BF16).unwrap(), None)
        .unwrap();
    assert_eq!(half.dtype(), DType::BF16);
    let via_f32 = ours
        .forward(
            &x2.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
            None,
        )
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let bits = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
    assert!(bits(half) == bits(via_f32));
    // Other types, and row counts that are not whole tiles, stay with candle.
    let q8 = Tensor::from_vec(values(32 * 256, 4), (32, 256), &Device::Cpu).unwrap();
    let q8 = QMatMul::from_arc(Arc::new(QTensor::quantize(&q8, GgmlDType::Q8_0).unwrap())).unwrap();
    assert!(Q4kMatmul::with_kernel(&q8, Kernel::Scalar).is_none());
    assert!(Q4kMatmul::with_kernel(&q4k_weight(24, 256, 3), Kernel::Scalar).is_none());
}

/// `cargo test --release -p tokenrouter-runtime cpu_quant::q4_k::tests::speed -- --ignored --nocapture`
#[test]
#[ignore]
fn speed() {
    // The last shape (131 MB) streams from DRAM, as a decode step's weights do.
    for (n, k) in [(8960, 1536), (1536, 8960), (151936, 1536)] {
        let w = q4k_weight(n, k, 1);
        for m in [1, 4, 8, 64, 512].into_iter().filter(|&m| n * m <= 1 << 24) {
            let x = Tensor::from_vec(values(m * k, 2), (m, k), &Device::Cpu).unwrap();
            let reps = (2048 / m).max(8);
            let time = |f: &dyn Fn() -> Tensor| time_ms(reps, f);
            let (c, cc) = time(&|| w.forward(&x).unwrap());
            let mut line = format!("m={m:4} [{n}x{k}]: candle {c:.3} ms (cpu {cc:.3})");
            for kernel in kernels().into_iter().skip(1) {
                let ours = Q4kMatmul::with_kernel(&w, kernel).unwrap();
                let (o, oc) = time(&|| ours.forward(&x, Some(&[m])).unwrap());
                line += &format!(", {kernel:?} {o:.3} (cpu {oc:.3})");
                if m == 8 {
                    // Eight decode rows of eight sequences (a batched decode step).
                    let (o, _) = time(&|| ours.forward(&x, None).unwrap());
                    line += &format!(" decode rows {o:.3}");
                }
            }
            println!("{line}");
        }
    }
}

/// One layer of the 1.5B's Q4_K matrices (q, k, v, o, gate, up, down as `[n, k]`), random
/// weights of those shapes, and the bytes of their tiles.
fn cold_step_weights() -> ([(usize, usize); 7], Vec<QMatMul>, usize) {
    let shapes = [
        (1536, 1536),
        (256, 1536),
        (256, 1536),
        (1536, 1536),
        (8960, 1536),
        (8960, 1536),
        (1536, 8960),
    ];
    let sources: Vec<QMatMul> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, k))| q4k_weight(n, k, i as u64))
        .collect();
    let bytes = shapes
        .iter()
        .map(|&(n, k)| n / 16 * k / 256 * TILE_BYTES)
        .sum();
    (shapes, sources, bytes)
}

/// The Q4_K matrices of a 1.5B decode step one after another (28 layers of q, k, v, o, gate,
/// up, down: 730 MB, each cold from DRAM as in a real step, unlike `speed`'s one matrix read
/// again and again), one activation row, four (one group: the kernel's own pace against the
/// stream) and eight decode rows (a batched step): the rate a step streams its weights at.
#[test]
#[ignore]
fn speed_cold_step() {
    let (shapes, sources, bytes) = cold_step_weights();
    for kernel in kernels().into_iter().skip(1) {
        let layers: Vec<Vec<Q4kMatmul>> = (0..28)
            .map(|_| {
                sources
                    .iter()
                    .map(|w| Q4kMatmul::with_kernel(w, kernel).unwrap())
                    .collect()
            })
            .collect();
        for m in [1, 4, 8] {
            let inputs = crate::test_util::inputs_for(&shapes, m, 3);
            let (ms, _) = time_ms(5, &|| {
                for layer in &layers {
                    for (w, x) in layer.iter().zip(&inputs) {
                        w.forward(x, None).unwrap();
                    }
                }
            });
            let gb_s = 28.0 * bytes as f64 / ms / 1e6;
            println!("{kernel:?}, {m} rows: {ms:.2} ms a step, {gb_s:.1} GB/s");
        }
    }
}

/// The AVX2 four-row kernel alone on one tile row that stays in L1 (16 weight rows x k
/// against four activation rows; k = 1536: 21 KiB): cycles per `vpmaddubsw` (32 products)
/// at `CPU_GHZ` (default 3.2), to tell the kernel's own pace from the memory's.
/// `cargo test --release -p tokenrouter-cpu-kernels --lib q4_k::tests::speed_tile_kernel -- --exact --ignored --nocapture`
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn speed_tile_kernel() {
    if !Kernel::Avx2.available() {
        return;
    }
    let ghz = crate::test_util::cpu_ghz();
    for k in [256, 1536] {
        let kb = k / QK_K;
        let ours = Q4kMatmul::with_kernel(&q4k_weight(16, k, 1), Kernel::Avx2).unwrap();
        let lhs = crate::act_quant::quantize_rows_q8k(&values(4 * k, 2), k);
        let lhs = as_bytes(&lhs);
        let acts: [&[u8]; MT] =
            std::array::from_fn(|i| &lhs[i * kb * Q8K_BYTES..(i + 1) * kb * Q8K_BYTES]);
        // Prompt rows (llama.cpp's gemm) and batched decode rows (its gemv).
        for (name, gemm) in [("gemm", true), ("gemv", false)] {
            let reps = 200_000 / kb;
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    // SAFETY: the CPU runs AVX2 (checked above); four rows of `kb` blocks.
                    let out = unsafe { avx2_rows4::dot(&ours.tiles, &acts, [gemm; MT]) };
                    std::hint::black_box(out);
                }
                best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "k={k} {name}: {:.3} cycles per vpmaddubsw",
                best * ghz * 1e9 / (512 * kb) as f64
            );
        }
    }
}

/// `speed_cold_step`'s 1.5B step (one activation row, the best kernel) with the weights on
/// the heap and on huge pages, alternating step by step (a shared host's memory traffic
/// moves both alike), medians of 30 steps each.
/// `cargo test --release -p tokenrouter-cpu-kernels --lib q4_k::tests::speed_cold_step_pages -- --exact --ignored --nocapture`
#[test]
#[ignore]
fn speed_cold_step_pages() {
    use crate::WeightMemory;
    let (shapes, sources, bytes) = cold_step_weights();
    let layers = |memory| -> Vec<Vec<Q4kMatmul>> {
        (0..28)
            .map(|_| {
                sources
                    .iter()
                    .map(|w| Q4kMatmul::new(w, CpuKernel::Auto, memory).unwrap())
                    .collect()
            })
            .collect()
    };
    let arms = [
        ("heap", layers(WeightMemory::Heap)),
        ("huge pages", layers(WeightMemory::HugePages)),
    ];
    let inputs = crate::test_util::inputs_for(&shapes, 1, 3);
    let mut ms = [Vec::new(), Vec::new()];
    for _ in 0..30 {
        for (a, (_, layers)) in arms.iter().enumerate() {
            let t = std::time::Instant::now();
            for layer in layers {
                for (w, x) in layer.iter().zip(&inputs) {
                    w.forward(x, None).unwrap();
                }
            }
            ms[a].push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    for ((name, _), ms) in arms.iter().zip(&mut ms) {
        ms.sort_by(f64::total_cmp);
        let median = ms[ms.len() / 2];
        let gb_s = 28.0 * bytes as f64 / median / 1e6;
        println!(
            "{name}: {median:.2} ms a step (best {:.2}), {gb_s:.1} GB/s",
            ms[0]
        );
    }
}
