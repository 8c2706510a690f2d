//! `bench-model --random-weights CONFIG --device cuda:0`: step latencies of a model of real
//! shape with random weights made on the device (decode steps at batch 1..32 over a cached
//! context, one long extend), next to ceilings measured in the same process (device copy
//! bandwidth, bf16 GEMM) and the weight-read floor of a decode step. And `--check-logits
//! DIR`: run a fixed mixed extend/decode script on a safetensors checkpoint and write all
//! logits to a file, for comparison with Hugging Face transformers (scripts/gpu_check_hf.py).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::io::Write;
use std::path::Path;
use std::time::Instant;
use tokenrouter_runtime::{
    load_random, load_runner, KvBudget, LoadOptions, ModelConfig, Row, Runner, StepOptions,
};

/// The device a `--device` flag names and the compute dtype (`--dtype`, else the device's
/// default), from one parse of the spec.
pub fn open_device(device: &str, dtype: Option<&str>) -> Result<(Device, DType)> {
    let spec: tokenrouter_runtime::DeviceSpec = device.parse().map_err(anyhow::Error::msg)?;
    let dtype = spec.dtype(dtype).map_err(anyhow::Error::msg)?;
    Ok((spec.open().map_err(anyhow::Error::msg)?, dtype))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Device copy bandwidth (bytes read + written per second / 1e9) between preallocated
/// buffers; None on the CPU.
#[cfg(feature = "cuda")]
fn device_copy_gbs(dev: &Device) -> Result<Option<f64>> {
    let Device::Cuda(cd) = dev else {
        return Ok(None);
    };
    let n = 1usize << 30; // bf16-sized elements: 2 GiB per buffer
    let src = cd.alloc_zeros::<u16>(n)?;
    let mut dst = cd.alloc_zeros::<u16>(n)?;
    let stream = cd.cuda_stream();
    let mut t = Vec::new();
    for i in 0..12 {
        dev.synchronize()?;
        let s = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        dev.synchronize()?;
        if i >= 2 {
            t.push(s.elapsed().as_secs_f64());
        }
    }
    Ok(Some(2.0 * 2.0 * n as f64 / median(t) / 1e9))
}

#[cfg(not(feature = "cuda"))]
fn device_copy_gbs(_dev: &Device) -> Result<Option<f64>> {
    Ok(None)
}

/// Measured ceilings: device copy (bytes read + written per second) and bf16 GEMM.
pub struct Ceilings {
    pub copy_gbs: f64,
    pub gemm_tflops: f64,
}

pub fn ceilings(dev: &Device) -> Result<Ceilings> {
    let (elems, n) = if dev.is_cpu() {
        (1usize << 22, 256usize)
    } else {
        (1usize << 30, 8192usize)
    };
    // On GPUs a device-to-device memcpy between two preallocated buffers (candle's `copy`
    // allocates fresh memory each time and measured only 1.0-1.4 TB/s on the H200, against
    // 4.2 TB/s for torch's in-place copy); elsewhere candle's `copy`.
    let copy_gbs = match device_copy_gbs(dev)? {
        Some(g) => g,
        None => {
            let a = Tensor::zeros(elems, DType::BF16, dev)?;
            let mut t = Vec::new();
            for i in 0..12 {
                dev.synchronize()?;
                let s = Instant::now();
                let _b = a.copy()?;
                dev.synchronize()?;
                if i >= 2 {
                    t.push(s.elapsed().as_secs_f64());
                }
            }
            2.0 * 2.0 * elems as f64 / median(t) / 1e9
        }
    };
    let x = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(DType::BF16)?;
    let y = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(DType::BF16)?;
    let mut t = Vec::new();
    for i in 0..12 {
        dev.synchronize()?;
        let s = Instant::now();
        let _z = x.matmul(&y)?;
        dev.synchronize()?;
        if i >= 2 {
            t.push(s.elapsed().as_secs_f64());
        }
    }
    let gemm_tflops = 2.0 * (n as f64).powi(3) / median(t) / 1e12;
    Ok(Ceilings {
        copy_gbs,
        gemm_tflops,
    })
}

/// Bytes of weights a decode step reads (every matrix once; the embedding only when it is
/// also the lm_head).
pub fn weight_read_bytes(cfg: &ModelConfig, dtype: DType) -> f64 {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (qd, kvd) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let layer = h * (qd + 2 * kvd) + qd * h + 3 * h * i;
    ((cfg.num_layers * layer + cfg.vocab_size * h) * dtype.size_in_bytes()) as f64
}

fn tokens(n: usize, salt: u64, vocab: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((1000 + (i * 7919 + salt * 104_729) % 30_000) % vocab) as u32)
        .collect()
}

/// Median seconds of a step with `rows`, synchronised (the logits are on the device).
fn timed_step(r: &mut Runner, dev: &Device, rows: &[Row]) -> Result<f64> {
    dev.synchronize()?;
    let s = Instant::now();
    let _out = r.step(rows, StepOptions::default())?;
    dev.synchronize()?;
    Ok(s.elapsed().as_secs_f64())
}

pub struct RandomBench<'a> {
    pub config: &'a Path,
    pub device: &'a str,
    pub dtype: Option<&'a str>,
    pub batches: &'a [usize],
    pub context: usize,
    pub steps: usize,
    pub prefill: usize,
    pub ceilings: bool,
    /// GPU time per kernel of one eager decode step at each of `batches`.
    pub op_profile: bool,
}

pub fn run_random(b: RandomBench) -> Result<()> {
    let (dev, dtype) = open_device(b.device, b.dtype)?;
    let name = b
        .config
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().to_string());
    let cfg = ModelConfig::from_hf_json(b.config)?;
    let maxb = b.batches.iter().copied().max().unwrap_or(1);
    let vocab = cfg.vocab_size as u64;
    // Each sequence rounds up to whole blocks; leave room for the decode steps and the extend.
    let kv = maxb * (b.context + b.steps + 40) + b.prefill + 64;
    let t0 = Instant::now();
    let opts = LoadOptions {
        device: dev.clone(),
        kv: KvBudget::Tokens(kv),
        dtype,
        kernels: crate::kernel_env::from_env()?,
    };
    let mut r = load_random(b.config, &opts, 42)?;
    dev.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let bytes = weight_read_bytes(&cfg, dtype);
    println!("== {name}: {:.2} GB of weights read per step ({dtype:?}), built on {} in {load_s:.1}s, KV for {kv} tokens", bytes / 1e9, b.device);
    let ceil = if b.ceilings {
        Some(ceilings(&dev)?)
    } else {
        None
    };
    if let Some(c) = &ceil {
        println!(
            "ceilings: copy {:.0} GB/s (read+write), bf16 GEMM {:.0} TFLOP/s",
            c.copy_gbs, c.gemm_tflops
        );
    }
    let floor_ms = ceil.as_ref().map(|c| bytes / (c.copy_gbs * 1e9) * 1e3);
    // Extend (prefill) of one fresh sequence.
    let mut ext = Vec::new();
    for rep in 0..4u64 {
        let seq = 900_000 + rep;
        let t = timed_step(
            &mut r,
            &dev,
            &[Row::new(seq, tokens(b.prefill, rep, vocab))],
        )?;
        r.free(seq);
        if rep > 0 {
            ext.push(t);
        }
    }
    let ext_ms = median(ext) * 1e3;
    // Cached contexts for the decode steps, prefilled a few rows at a time.
    let seqs: Vec<u64> = (1..=maxb as u64).collect();
    for chunk in seqs.chunks(4) {
        let rows: Vec<Row> = chunk
            .iter()
            .map(|&s| Row::new(s, tokens(b.context, s, vocab)))
            .collect();
        r.step(&rows, StepOptions::default())?;
    }
    let mut res = Vec::new();
    for &bs in b.batches {
        let mut t = Vec::new();
        for step in 0..b.steps + 3 {
            let rows: Vec<Row> = seqs[..bs]
                .iter()
                .map(|&s| Row::new(s, vec![((1000 + step as u64 * 31 + s) % vocab) as u32]))
                .collect();
            let dt = timed_step(&mut r, &dev, &rows)?;
            if step >= 3 {
                t.push(dt);
            }
        }
        for &s in &seqs[..bs] {
            r.truncate(s, b.context);
        }
        res.push((bs, median(t) * 1e3));
    }
    if b.op_profile {
        #[cfg(feature = "cuda")]
        crate::fused_check::op_profile(&mut r, &dev, &seqs, b.batches)?;
        #[cfg(not(feature = "cuda"))]
        anyhow::bail!("--op-profile needs a build with the cuda feature");
    }
    println!("| {name} | step ms | tok/s | x floor |\n|---|---|---|---|");
    for (bs, ms) in &res {
        let x = floor_ms.map_or("-".into(), |f| format!("{:.2}", ms / f));
        println!(
            "| decode bs={bs} (ctx {}) | {ms:.2} | {:.0} | {x} |",
            b.context,
            *bs as f64 * 1e3 / ms
        );
    }
    println!(
        "| extend {} tokens | {ext_ms:.2} | {:.0} | - |",
        b.prefill,
        b.prefill as f64 * 1e3 / ext_ms
    );
    let json = serde_json::json!({
        "model": name, "device": b.device, "dtype": format!("{dtype:?}"), "weight_gb": bytes / 1e9,
        "copy_gbs": ceil.as_ref().map(|c| c.copy_gbs), "gemm_tflops": ceil.as_ref().map(|c| c.gemm_tflops),
        "floor_ms": floor_ms, "context": b.context, "load_s": load_s,
        "decode_ms": res.iter().map(|(bs, ms)| serde_json::json!({"batch": bs, "ms": ms})).collect::<Vec<_>>(),
        "extend_tokens": b.prefill, "extend_ms": ext_ms,
    });
    println!("RESULT {json}");
    Ok(())
}

/// Run two sequences from `ids_file` (JSON `{"a": [20 ids], "b": [13 ids]}`) through a mixed
/// script (two extends; decode + extend-after-past; decodes) and write every position's
/// logits as little-endian f32, sequence a's rows first, to `out`.
pub fn check_logits(
    dir: &Path,
    ids_file: &Path,
    out: &Path,
    device: &str,
    dtype: Option<&str>,
) -> Result<()> {
    let (dev, dtype) = open_device(device, dtype)?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ids_file)?)?;
    let ids = |k: &str| -> Result<Vec<u32>> {
        Ok(serde_json::from_value(
            v.get(k).cloned().context("ids file needs a and b")?,
        )?)
    };
    let (a, b) = (ids("a")?, ids("b")?);
    if a.len() != 20 || b.len() != 13 {
        bail!("need 20 ids in a and 13 in b");
    }
    let opts = LoadOptions {
        device: dev.clone(),
        kv: KvBudget::Tokens(256),
        dtype,
        kernels: crate::kernel_env::from_env()?,
    };
    let mut r = load_runner(dir, &opts)?;
    // (a range, b range) per step
    let script: [(usize, usize, usize, usize); 5] = [
        (0, 16, 0, 9),
        (16, 17, 9, 11),
        (17, 18, 11, 12),
        (18, 19, 12, 13),
        (19, 20, 13, 13),
    ];
    let (mut la, mut lb): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (Vec::new(), Vec::new());
    let o = StepOptions {
        all_logits: true,
        want_hidden: false,
    };
    for (a0, a1, b0, b1) in script {
        let mut rows = vec![Row::new(1, a[a0..a1].to_vec())];
        if b1 > b0 {
            rows.push(Row::new(2, b[b0..b1].to_vec()));
        }
        let l = r.step(&rows, o)?.logits_rows()?;
        la.extend(l[..a1 - a0].iter().cloned());
        lb.extend(l[a1 - a0..].iter().cloned());
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(out)?);
    for row in la.iter().chain(&lb) {
        for x in row {
            f.write_all(&x.to_le_bytes())?;
        }
    }
    f.flush()?;
    println!(
        "wrote {} x {} logits to {}",
        la.len() + lb.len(),
        la[0].len(),
        out.display()
    );
    Ok(())
}
