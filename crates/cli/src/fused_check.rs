//! `bench-model --check-fused CONFIG --device cuda:0` (GPU machine): (1) the paged-attention
//! kernel against a dense f32 reference for random context lengths 1..4096 in mixed
//! decode/extend batches; (2) a random-weight model of CONFIG's shape run through the same
//! mixed script (prefills of 1..4096 tokens, then steps mixing decodes, extends, paused
//! sequences and a newcomer, then decode-only steps that CUDA graphs replay) with the fused
//! kernels and with plain candle ops: logits must agree to bf16 noise.

use anyhow::{bail, Result};
use std::path::Path;

#[cfg(not(feature = "cuda"))]
pub fn check_fused(_config: &Path, _device: &str) -> Result<()> {
    bail!("--check-fused needs a build with the cuda feature (scripts/build_cuda.sh)")
}

#[cfg(feature = "cuda")]
pub fn check_fused(config: &Path, device: &str) -> Result<()> {
    use tokenrouter_runtime::cuda::check::check_paged_attention;
    // Kernels run here outside a model's step: the environment's switches apply to them.
    let _kernels = crate::kernel_env::from_env()?.enter();
    let (dev, _) = crate::device_bench::open_device(device, None)?;
    let mut worst = 0f32;
    let mut kernel_worst = std::collections::BTreeMap::new();
    println!("| heads (q/kv x dim) | rows | tokens | max ctx | max abs err | mean abs err | max abs ref |");
    println!("|---|---|---|---|---|---|---|");
    for c in check_paged_attention(&dev, 7, 4)? {
        println!(
            "| {}/{} x {} | {} | {} | {} | {:.2e} | {:.2e} | {:.2} |",
            c.heads.num_heads,
            c.heads.num_kv_heads,
            c.heads.head_dim,
            c.rows,
            c.tokens,
            c.max_context,
            c.max_abs_err,
            c.mean_abs_err,
            c.max_abs_ref
        );
        worst = worst.max(c.max_abs_err);
        for (k, e) in &c.per_kernel {
            let w = kernel_worst.entry(k.clone()).or_insert(0f32);
            *w = w.max(*e);
        }
    }
    for (k, e) in &kernel_worst {
        println!("CHECK attention_kernel {k} max_abs_err {e:.3e}");
    }
    println!("CHECK paged_attention max_abs_err {worst:.3e} (bf16 output rounding ~4e-3 of |ref|)");
    let mut gemv_worst = 0f32;
    for (m, n, k, e) in tokenrouter_runtime::cuda::check::check_gemv(&dev)? {
        println!("gemv [{m}, {k}] x [{n}, {k}]^T: max rel err {e:.2e}");
        gemv_worst = gemv_worst.max(e);
    }
    println!("CHECK gemv max_rel_err {gemv_worst:.3e} (bf16 output rounding ~4e-3)");
    let (ent_err, top_mismatch) = tokenrouter_runtime::cuda::check::check_router_inputs(&dev)?;
    println!(
        "CHECK router_inputs entropy_max_abs_err {ent_err:.2e} top100_mismatches {top_mismatch} (8 rows of 151936 logits vs host)"
    );
    let (wrong, lp_err) = tokenrouter_runtime::cuda::check::check_masked_greedy(&dev)?;
    println!(
        "CHECK masked_greedy wrong_picks {wrong} logprob_max_abs_err {lp_err:.2e} (8 rows of 151936 logits, token masks, vs host)"
    );
    sample_check(&dev)?;
    let (mut folded_worst, mut norm_worst) = (0f32, 0f32);
    for (what, m, e) in tokenrouter_runtime::cuda::check::check_fused_gemv(&dev)? {
        if what.starts_with("rms_norm") {
            println!("{what}, {m} rows: max rel err {e:.2e}");
            norm_worst = norm_worst.max(e);
        } else {
            println!("folded gemv {what}, {m} rows: max rel err vs separate kernels {e:.2e}");
            folded_worst = folded_worst.max(e);
        }
    }
    println!("CHECK rms_norm max_rel_err {norm_worst:.3e} (bf16 output rounding ~4e-3)");
    println!(
        "CHECK folded_gemv max_rel_err {folded_worst:.3e} (same arithmetic: <= one bf16 step)"
    );
    let (fused, plain) = (
        run_script(config, &dev, true)?,
        run_script(config, &dev, false)?,
    );
    let (mut max_abs, mut min_cos, mut top1) = (0f32, 1f32, 0usize);
    for (a, b) in fused.iter().zip(&plain) {
        let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            max_abs = max_abs.max((x - y).abs());
            dot += (*x as f64) * (*y as f64);
            na += (*x as f64).powi(2);
            nb += (*y as f64).powi(2);
        }
        min_cos = min_cos.min((dot / (na.sqrt() * nb.sqrt()).max(1e-30)) as f32);
        top1 += (argmax(a) == argmax(b)) as usize;
    }
    println!(
        "CHECK fused_vs_candle rows {} max_abs {max_abs:.4} min_cosine {min_cos:.6} top1 {top1}/{}",
        fused.len(),
        fused.len()
    );
    if worst > 0.05 || gemv_worst > 0.01 || ent_err > 1e-4 || top_mismatch > 0 || min_cos < 0.999 {
        bail!("fused kernels disagree with the reference");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

/// Logits of every row of a fixed mixed script, with the fused kernels on or off.
#[cfg(feature = "cuda")]
fn run_script(config: &Path, dev: &candle_core::Device, fused: bool) -> Result<Vec<Vec<f32>>> {
    use tokenrouter_runtime::{load_random, KvBudget, LoadOptions, Row, StepOptions};
    let opts = LoadOptions {
        device: dev.clone(),
        kv: KvBudget::Tokens(16_384),
        dtype: candle_core::DType::BF16,
        kernels: crate::kernel_env::from_env()?,
    };
    let mut r = load_random(config, &opts, 42)?;
    r.set_fused_kernels(fused);
    if r.model().fused_kernels() != fused {
        bail!("fused kernels unavailable for this model");
    }
    let vocab = r.config().vocab_size as u64;
    let tok = |seq: u64, i: usize| ((seq * 7919 + i as u64 * 104_729 + 13) % vocab) as u32;
    let lens = [1usize, 5, 64, 65, 700, 2048, 4096];
    let mut len = vec![0usize; lens.len() + 1];
    let mut out = Vec::new();
    for (s, &n) in lens.iter().enumerate() {
        let ids = (0..n).map(|i| tok(s as u64, i)).collect();
        out.extend(
            r.step(&[Row::new(s as u64, ids)], StepOptions::default())?
                .logits_rows()?,
        );
        len[s] = n;
    }
    for step in 0..4usize {
        let mut rows = Vec::new();
        for s in 0..lens.len() {
            let n = match (s + step) % 3 {
                0 => 1,
                1 => 2 + (step * 5 + s) % 14,
                _ => 0, // paused: away at the other model
            };
            if n > 0 {
                rows.push(Row::new(
                    s as u64,
                    (0..n).map(|i| tok(s as u64, len[s] + i)).collect(),
                ));
                len[s] += n;
            }
        }
        if step == 2 {
            let s = lens.len();
            rows.push(Row::new(
                s as u64,
                (0..40).map(|i| tok(s as u64, i)).collect(),
            ));
        }
        out.extend(r.step(&rows, StepOptions::default())?.logits_rows()?);
    }
    // Decode-only steps (CUDA graphs when on): all sequences, three (padded bucket), one,
    // two (the last two take the folded skinny-matmul layers).
    for step in 0..8usize {
        let seqs: Vec<usize> = match step % 4 {
            0 => (0..len.len()).collect(),
            1 => vec![1, 4, 6],
            2 => vec![5],
            _ => vec![0, 3],
        };
        let rows: Vec<Row> = seqs
            .iter()
            .map(|&s| Row::new(s as u64, vec![tok(s as u64, len[s])]))
            .collect();
        for &s in &seqs {
            len[s] += 1;
        }
        out.extend(r.step(&rows, StepOptions::default())?.logits_rows()?);
    }
    Ok(out)
}

/// `bench-model --random-weights CONFIG --op-profile`: GPU time per kernel of one eager
/// decode step of each batch size (CUDA graphs off, so every launch can be timed; the device
/// is kept busy by a large matmul while the step is enqueued, so host launch gaps do not
/// count). Sequences `seqs` must hold a cached context.
#[cfg(feature = "cuda")]
pub fn op_profile(
    r: &mut tokenrouter_runtime::Runner,
    dev: &candle_core::Device,
    seqs: &[u64],
    batches: &[usize],
) -> Result<()> {
    use tokenrouter_runtime::{cuda::profile as cuda_profile, Row, StepOptions};
    let cuda = dev.as_cuda_device()?;
    let busy = candle_core::Tensor::ones((8192, 8192), candle_core::DType::BF16, dev)?;
    r.set_cuda_graphs(false);
    for &bs in batches.iter().filter(|&&b| b <= seqs.len()) {
        let rows = |step: u32| -> Vec<Row> {
            seqs[..bs]
                .iter()
                .map(|&s| Row::new(s, vec![1000 + step + s as u32]))
                .collect()
        };
        r.step(&rows(0), StepOptions::default())?;
        for _ in 0..4 {
            busy.matmul(&busy)?;
        }
        cuda_profile::start()?;
        r.step(&rows(1), StepOptions::default())?;
        let (ops, total) = cuda_profile::finish(cuda)?;
        println!(
            "| op (batch {bs}, eager) | launches | total us | us per launch |\n|---|---|---|---|"
        );
        for k in &ops {
            let us = k.ms * 1e3;
            println!(
                "| {} | {} | {us:.1} | {:.2} |",
                k.name,
                k.launches,
                us / k.launches as f64
            );
        }
        println!(
            "| all (GPU time, first launch to end) | - | {:.1} | - |",
            total * 1e3
        );
        for &s in &seqs[..bs] {
            let len = r.seq_len(s).unwrap_or(2);
            r.truncate(s, len.saturating_sub(2));
        }
    }
    r.set_cuda_graphs(true);
    Ok(())
}

/// The row sampler (kernels/sample.cuh) against its host reference, with its time a step
/// against the host path's.
#[cfg(feature = "cuda")]
fn sample_check(dev: &candle_core::Device) -> Result<()> {
    println!("| draw | rows | wrong picks | logprob max err | device ms | host path ms | host / device |");
    println!("|---|---|---|---|---|---|---|");
    let (mut wrong, mut rows, mut lp_worst) = (0usize, 0usize, 0f32);
    for c in tokenrouter_runtime::cuda::sample::check_sample_rows(dev)? {
        println!(
            "| {} | {} | {} | {:.2e} | {:.3} | {:.2} | {:.1}x |",
            c.what,
            c.rows,
            c.wrong_picks,
            c.max_logprob_err,
            c.device_ms,
            c.host_ms,
            c.host_ms / c.device_ms
        );
        wrong += c.wrong_picks;
        rows += c.rows;
        lp_worst = lp_worst.max(c.max_logprob_err);
    }
    println!(
        "CHECK sample_rows wrong_picks {wrong} of {rows} logprob_max_abs_err {lp_worst:.2e} (kernel vs sampling::race on the host, same keys)"
    );
    Ok(())
}
