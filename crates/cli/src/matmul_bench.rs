//! `bench-model --matmul-bench CONFIG --device cuda:0` (GPU machine): the skinny matmuls of
//! CONFIG's shape (qkv, o, gate_up, down, lm_head) at 1-64 rows, timed for cuBLAS and our
//! 1-8-row `Gemv`, as effective weight-read GB/s: where the step's matmuls stand against the
//! copy bandwidth, and from how many rows cuBLAS wins (`gemv_applies`).

use anyhow::Result;
use std::path::Path;

#[cfg(not(feature = "cuda"))]
pub fn matmul_bench(_config: &Path, _device: &str) -> Result<()> {
    anyhow::bail!("--matmul-bench needs a build with the cuda feature (scripts/build_cuda.sh)")
}

#[cfg(feature = "cuda")]
pub fn matmul_bench(config: &Path, device: &str) -> Result<()> {
    use candle_core::{DType, Tensor};
    use std::time::Instant;
    use tokenrouter_runtime::cuda::gemv::Gemv;
    let _kernels = crate::kernel_env::from_env()?.enter();
    let (dev, _) = crate::device_bench::open_device(device, None)?;
    let c = tokenrouter_runtime::ModelConfig::from_hf_json(config)?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let shapes = [
        ("qkv", (c.num_heads + 2 * c.num_kv_heads) * hd, h),
        ("o", h, c.num_heads * hd),
        ("gate_up", 2 * c.intermediate_size, h),
        ("down", h, c.intermediate_size),
        ("lm_head", c.vocab_size, h),
    ];
    let rows = [1usize, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64];
    // Mean time of `reps` back-to-back launches (the device queue stays full).
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> Result<f64> {
        f()?;
        dev.synchronize()?;
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    println!("| matmul | rows | cuBLAS GB/s | gemv GB/s |\n|---|---|---|---|");
    for (name, n, k) in shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?.to_dtype(DType::BF16)?;
        let wt = w.t()?;
        let gb = (n * k * 2) as f64 / 1e9;
        for &m in &rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
            let mut line = format!(
                "| {name} [{n}, {k}] | {m} | {:.0}",
                gb / time(&|| x.matmul(&wt))?
            );
            line += &if m <= 8 {
                format!(" | {:.0}", gb / time(&|| x.apply_op2_no_bwd(&w, &Gemv))?)
            } else {
                " | -".into()
            };
            println!("{line} |");
        }
    }
    Ok(())
}
