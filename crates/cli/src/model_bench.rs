//! `tokenrouter bench-model`: the runtime's own speed on one model, printed as a table —
//! prefill tok/s for a long prompt, single-stream greedy decode tok/s after a short and a
//! long prompt, batched decode throughput (B sequences stepping together) and peak memory,
//! so it can be set next to llama.cpp's numbers in the same run (`scripts/bench_cpu.sh`).
//! With `--random-weights CONFIG` (any device) or `--check-logits DIR` it runs the GPU
//! benchmark / correctness check of `device_bench.rs` instead.

use anyhow::Result;
use std::time::Instant;
use tokenrouter_runtime::{load_model, KvBudget, LoadOptions, Row, Runner, StepOptions};

#[derive(clap::Args)]
pub struct ModelBenchArgs {
    /// A GGUF file, a Hugging Face directory, a model id in the HF cache, or a default name.
    #[arg(long, required_unless_present_any = ["random_weights", "check_logits", "check_fused", "matmul_bench"])]
    model: Option<String>,
    /// Benchmark a model of this config.json's shape with random weights made on the device
    /// (decode step latency at each of --batches, an extend of --prefill-tokens, ceilings).
    #[arg(long)]
    random_weights: Option<std::path::PathBuf>,
    /// Run a fixed mixed extend/decode script on this safetensors directory and write all
    /// logits to --logits-out (needs --ids-file).
    #[arg(long)]
    check_logits: Option<std::path::PathBuf>,
    #[arg(long)]
    ids_file: Option<std::path::PathBuf>,
    /// Check the fused CUDA kernels on a random-weight model of this config.json's shape:
    /// paged attention vs a dense reference, fused vs plain logits (CUDA builds).
    #[arg(long)]
    check_fused: Option<std::path::PathBuf>,
    #[arg(long)]
    logits_out: Option<std::path::PathBuf>,
    /// Time the skinny matmuls of this config.json's shape at 1-64 rows: cuBLAS vs our
    /// kernels (CUDA builds).
    #[arg(long)]
    matmul_bench: Option<std::path::PathBuf>,
    /// cpu, cuda or cuda:N (with --random-weights / --check-logits).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16 (default: bf16 on GPUs, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// Batch sizes of the decode-step latencies (with --random-weights).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    batches: Vec<usize>,
    /// Cached context of each sequence during the decode steps (with --random-weights).
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Also measure copy bandwidth and bf16 GEMM ceilings (with --random-weights).
    #[arg(long)]
    ceilings: bool,
    /// GPU time per kernel of an eager decode step at each of --batches (with --random-weights,
    /// CUDA builds).
    #[arg(long)]
    op_profile: bool,
    /// Prompt length for the decode runs.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Greedy decode steps.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Batch size for the batched decode throughput.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Also decode --long-decode-tokens single-stream steps after a prompt this long (like
    /// `llama-bench -d 1024 -n 64`); 0 skips it.
    #[arg(long, default_value_t = 1024)]
    long_context: usize,
    /// Greedy decode steps after the --long-context prompt.
    #[arg(long, default_value_t = 64)]
    long_decode_tokens: usize,
    /// Repeats (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (i * 7919 + salt * 104_729) % 30_000)
        .collect()
}

pub fn run(a: ModelBenchArgs) -> Result<()> {
    if let Some(cfg) = &a.random_weights {
        return crate::device_bench::run_random(crate::device_bench::RandomBench {
            config: cfg,
            device: &a.device,
            dtype: a.dtype.as_deref(),
            batches: &a.batches,
            context: a.context,
            steps: a.decode_tokens.min(20),
            prefill: a.prefill_tokens,
            ceilings: a.ceilings,
            op_profile: a.op_profile,
        });
    }
    if let Some(cfg) = &a.matmul_bench {
        return crate::matmul_bench::matmul_bench(cfg, &a.device);
    }
    if let Some(cfg) = &a.check_fused {
        return crate::fused_check::check_fused(cfg, &a.device);
    }
    if let Some(dir) = &a.check_logits {
        let (Some(ids), Some(out)) = (&a.ids_file, &a.logits_out) else {
            anyhow::bail!("--check-logits needs --ids-file and --logits-out");
        };
        return crate::device_bench::check_logits(dir, ids, out, &a.device, a.dtype.as_deref());
    }
    let loc = tokenrouter_fetch::resolve_model(a.model.as_deref().unwrap_or_default())?;
    // Sequences are freed between measurements: the cache holds the largest one at a time
    // (peak memory is reported, so no more than that), each sequence rounded up to blocks.
    let long = (a.long_context > 0).then_some(a.long_context + a.long_decode_tokens);
    let kv = [
        a.batch * (a.prompt_tokens + a.decode_tokens),
        a.prompt_tokens + a.decode_tokens,
        a.prefill_tokens,
        long.unwrap_or(0),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
        // Each sequence rounds up to whole KV blocks (at most 64 tokens of slack apiece).
        + 64 * a.batch.max(1);
    let mut m = load_model(
        loc.path(),
        &LoadOptions {
            kv: KvBudget::Tokens(kv),
            kernels: crate::kernel_env::from_env()?,
            ..Default::default()
        },
    )?;
    let opts = StepOptions::default();
    let (mut prefill, mut decode1, mut decode_b) = (Vec::new(), Vec::new(), Vec::new());
    let mut decode_long = Vec::new();
    let mut seq = 0u64;
    for rep in 0..a.repeats.max(1) {
        seq += 1;
        let t = Instant::now();
        m.runner
            .step(&[Row::new(seq, tokens(a.prefill_tokens, rep as u32))], opts)?;
        prefill.push(a.prefill_tokens as f64 / t.elapsed().as_secs_f64());
        m.runner.free(seq);
        // Single stream: prompt, then greedy steps (argmax, fed back).
        seq += 1;
        let prompt = tokens(a.prompt_tokens, rep as u32);
        decode1.push(greedy_decode(
            &mut m.runner,
            seq,
            prompt,
            a.decode_tokens,
            opts,
        )?);
        if long.is_some() {
            seq += 1;
            let prompt = tokens(a.long_context, rep as u32 + 3);
            let rate = greedy_decode(&mut m.runner, seq, prompt, a.long_decode_tokens, opts)?;
            decode_long.push(rate);
        }
        // Batched: B sequences decode together.
        let ids: Vec<u64> = (0..a.batch as u64)
            .map(|i| 10_000 + seq * 100 + i)
            .collect();
        let rows: Vec<Row> = ids
            .iter()
            .enumerate()
            .map(|(i, &s)| Row::new(s, tokens(a.prompt_tokens, i as u32 + 7)))
            .collect();
        let mut l = m.runner.step(&rows, opts)?.logits_rows()?;
        let t = Instant::now();
        for _ in 0..a.decode_tokens {
            let rows: Vec<Row> = ids
                .iter()
                .zip(&l)
                .map(|(&s, row)| Row::new(s, vec![argmax(row)]))
                .collect();
            l = m.runner.step(&rows, opts)?.logits_rows()?;
        }
        decode_b.push((a.batch * a.decode_tokens) as f64 / t.elapsed().as_secs_f64());
        for s in ids {
            m.runner.free(s);
        }
    }
    let (p, d1, db) = (median(prefill), median(decode1), median(decode_b));
    let dl = (!decode_long.is_empty()).then(|| median(decode_long));
    let rss = peak_rss_mb();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"engine": "tokenrouter", "model": loc.path().display().to_string(), "prefill_tokens": a.prefill_tokens, "prefill_tok_s": p, "decode_tokens": a.decode_tokens, "decode_tok_s": d1, "batch": a.batch, "batch_decode_tok_s": db, "long_context": a.long_context, "long_decode_tok_s": dl, "peak_rss_mb": rss})
        );
    } else {
        println!("model: {}", loc.path().display());
        println!("| measurement | tok/s |\n|---|---|");
        println!("| prefill ({} tokens) | {p:.1} |", a.prefill_tokens);
        println!(
            "| decode, batch 1 ({} after {} prompt tokens) | {d1:.1} |",
            a.decode_tokens, a.prompt_tokens
        );
        if let Some(dl) = dl {
            println!(
                "| decode, batch 1 ({} after {} prompt tokens) | {dl:.1} |",
                a.long_decode_tokens, a.long_context
            );
        }
        println!(
            "| decode, batch {} (total) | {db:.1} ({:.2}x batch 1) |",
            a.batch,
            db / d1
        );
        if let Some(rss) = rss {
            println!("| peak resident memory | {rss:.0} MB |");
        }
    }
    Ok(())
}

/// Prefill `prompt` as sequence `seq`, then `steps` greedy steps (argmax fed back); the
/// steps' tok/s. The sequence is freed after.
fn greedy_decode(
    runner: &mut Runner,
    seq: u64,
    prompt: Vec<u32>,
    steps: usize,
    opts: StepOptions,
) -> Result<f64> {
    let mut l = runner.step(&[Row::new(seq, prompt)], opts)?.logits_rows()?;
    let t = Instant::now();
    for _ in 0..steps {
        let next = argmax(&l[0]);
        l = runner
            .step(&[Row::new(seq, vec![next])], opts)?
            .logits_rows()?;
    }
    let rate = steps as f64 / t.elapsed().as_secs_f64();
    runner.free(seq);
    Ok(rate)
}

/// This process's peak resident memory in MB (`VmHWM`, Linux), if known.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The greedy token, as the engine's sampler picks it.
fn argmax(v: &[f32]) -> u32 {
    tokenrouter_runtime::sampling::argmax(v).0
}
