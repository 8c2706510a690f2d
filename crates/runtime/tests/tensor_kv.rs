//! The tensor-KV attention path (what CUDA runs) must match the CPU paged attention on the
//! same weights: mixed decode / extend batches, extends after a cached past, rows out of
//! order, freed and reused blocks; half-split (Qwen3) and interleaved (GGUF Llama) rope.
//! Also: random-weight models build from a config.json alone.

use candle_core::quantized::GgmlDType;
use tokenrouter_runtime::synth::{write_gguf, write_hf_dir, SynthSpec};
use tokenrouter_runtime::{
    load_model, load_random, Arch, KvBudget, LoadOptions, Row, Runner, StepOptions,
};

fn opts() -> LoadOptions {
    LoadOptions {
        kv: KvBudget::Tokens(1024),
        ..LoadOptions::default()
    }
}

fn pair(path: &std::path::Path) -> (Runner, Runner) {
    let host = load_model(path, &opts()).unwrap().runner;
    let mut dev = load_model(path, &opts()).unwrap().runner;
    dev.use_tensor_kv().unwrap();
    (host, dev)
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 5 + (i * 31 + salt * 17) % 250)
        .collect()
}

fn compare(host: &mut Runner, dev: &mut Runner, rows: &[Row], what: &str) {
    let o = StepOptions {
        all_logits: true,
        want_hidden: false,
    };
    let a = host.step(rows, o).unwrap().logits_rows().unwrap();
    let b = dev.step(rows, o).unwrap().logits_rows().unwrap();
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let err = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
        // The CPU path rounds KV to f16 (like llama.cpp); the tensor path keeps f32 here.
        assert!(err < 5e-3, "{what}: token {i}: relative error {err}");
    }
}

fn run_script(host: &mut Runner, dev: &mut Runner) {
    // Two extends in one step (prefill), out-of-order sequence ids.
    compare(
        host,
        dev,
        &[Row::new(2, toks(9, 1)), Row::new(1, toks(17, 2))],
        "prefill",
    );
    // Mixed: decode rows around an extend-after-past row and a new row.
    compare(
        host,
        dev,
        &[
            Row::new(1, vec![7]),
            Row::new(2, toks(3, 3)),
            Row::new(3, toks(5, 4)),
        ],
        "mixed",
    );
    // Decode rows of different lengths (padded group), in scrambled order.
    for s in 0..4 {
        compare(
            host,
            dev,
            &[
                Row::new(3, vec![11 + s]),
                Row::new(1, vec![20 + s]),
                Row::new(2, vec![30 + s]),
            ],
            "decode",
        );
    }
    // Free one sequence; a new one reuses its blocks (stale KV must not leak).
    assert!(host.free(1) && dev.free(1));
    compare(
        host,
        dev,
        &[Row::new(4, toks(21, 5)), Row::new(2, vec![9])],
        "reuse",
    );
}

#[test]
fn tensor_kv_matches_cpu_attention_halfsplit() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 3), &dir.path().join("hf")).unwrap();
    let (mut host, mut dev) = pair(&p);
    run_script(&mut host, &mut dev);
}

#[test]
fn tensor_kv_matches_cpu_attention_interleaved() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_gguf(
        &SynthSpec::tiny(Arch::Llama, 5),
        &dir.path().join("m.gguf"),
        GgmlDType::F32,
    )
    .unwrap();
    let (mut host, mut dev) = pair(&p);
    run_script(&mut host, &mut dev);
}

#[test]
fn random_weights_from_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type":"qwen3","vocab_size":300,"hidden_size":64,"intermediate_size":96,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
            "rope_theta":1000000.0,"rms_norm_eps":1e-6,"max_position_embeddings":256,
            "tie_word_embeddings":false}"#,
    )
    .unwrap();
    let mut r = load_random(&cfg, &opts(), 1).unwrap();
    let out = r
        .step(&[Row::new(1, toks(6, 1))], StepOptions::default())
        .unwrap();
    let l = out.logits_rows().unwrap();
    assert_eq!((l.len(), l[0].len()), (1, 300));
    assert!(l[0].iter().all(|x| x.is_finite()));
    assert!(l[0].iter().any(|x| *x != 0.0));
}

#[test]
fn greedy_rows_match_the_host_sampler() {
    use tokenrouter_runtime::{Sampler, SamplingParams};
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 9), &dir.path().join("m")).unwrap();
    let mut m = load_model(&path, &opts()).unwrap().runner;
    let rows = [
        Row::new(1, toks(7, 1)),
        Row::new(2, toks(3, 2)),
        Row::new(3, vec![9]),
    ];
    let out = m.step(&rows, StepOptions::default()).unwrap();
    for limit in [288, 200] {
        let picks = out.greedy_rows(limit).unwrap();
        let logits = out.logits_rows().unwrap();
        for (p, l) in picks.iter().zip(&logits) {
            let s = Sampler::new(SamplingParams::greedy(), 0, &[]).sample(l, limit, 0);
            assert_eq!(p.0, s.token);
            assert!((p.1 - s.logprob).abs() < 1e-4, "{} vs {}", p.1, s.logprob);
        }
    }
}

/// Greedy picks under token masks (structured output's device path) equal the host's:
/// the best allowed id, with the model's own log-probability over the whole row.
#[test]
fn masked_greedy_rows_pick_the_best_allowed_id() {
    use candle_core::{Device, Tensor};
    use tokenrouter_runtime::runner::StepOutput;
    use tokenrouter_runtime::{Sampler, SamplingParams};
    let (vocab, limit, rows) = (300usize, 288usize, 3usize);
    let logits = Tensor::randn(0f32, 3.0, (rows, vocab), &Device::Cpu).unwrap();
    let out = StepOutput {
        logits,
        hidden: None,
    };
    let keep = |r: usize, t: usize| match r {
        0 => t.is_multiple_of(3),
        1 => t == 17,
        _ => true,
    };
    let flags: Vec<u8> = (0..rows * limit)
        .map(|i| keep(i / limit, i % limit) as u8)
        .collect();
    let allowed = Tensor::from_vec(flags, (rows, limit), &Device::Cpu).unwrap();
    let picks = out.greedy_rows_allowed(limit, Some(&allowed)).unwrap();
    for (r, (row, (token, logprob))) in out.logits_rows().unwrap().iter().zip(picks).enumerate() {
        let mut masked = row.clone();
        for (t, x) in masked.iter_mut().enumerate() {
            if t >= limit || !keep(r, t) {
                *x = f32::NEG_INFINITY;
            }
        }
        let want = Sampler::new(SamplingParams::greedy(), 0, &[])
            .sample_constrained(row, &masked, limit, 0);
        assert_eq!(token, want.token, "row {r}");
        assert!(
            (logprob - want.logprob).abs() < 1e-4,
            "{logprob} vs {}",
            want.logprob
        );
    }
    let wrong_shape = Tensor::zeros((1, limit), candle_core::DType::U8, &Device::Cpu).unwrap();
    assert!(
        out.greedy_rows_allowed(limit, Some(&wrong_shape)).is_err(),
        "a mask of the wrong shape is refused"
    );
}

/// Mask bits (id i: bit i % 8 of byte i / 8) unpack to one flag an id, cut to the width.
#[test]
fn mask_bits_unpack_to_flags() {
    use candle_core::{Device, Tensor};
    use tokenrouter_runtime::runner::unpack_bits;
    let (rows, width) = (3usize, 21usize);
    let bytes: Vec<u8> = (0..rows * 3)
        .map(|i| (i as u8).wrapping_mul(97) ^ 0x5A)
        .collect();
    let t = Tensor::from_vec(bytes.clone(), (rows, 3), &Device::Cpu).unwrap();
    let flags = unpack_bits(&t, width).unwrap().to_vec2::<u8>().unwrap();
    for (r, row) in flags.iter().enumerate() {
        assert_eq!(row.len(), width);
        for (i, &f) in row.iter().enumerate() {
            assert_eq!(f, bytes[r * 3 + i / 8] >> (i % 8) & 1, "row {r} id {i}");
        }
    }
    assert!(unpack_bits(&t, 25).is_err(), "fewer bits than ids");
}

/// The step's normalised entropy (computed where the logits are) equals the host's
/// definition over the same first `limit` logits.
#[test]
fn entropy_rows_match_the_host_definition() {
    use tokenrouter_runtime::sampling::entropy;
    let dir = tempfile::tempdir().unwrap();
    let path = write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 10), &dir.path().join("m")).unwrap();
    let mut m = load_model(&path, &opts()).unwrap().runner;
    let rows = [Row::new(1, toks(6, 4)), Row::new(2, vec![11])];
    let out = m.step(&rows, StepOptions::default()).unwrap();
    for limit in [288, 200] {
        let got = out.entropy_rows(limit).unwrap();
        for (h, l) in got.iter().zip(out.logits_rows().unwrap()) {
            let want = entropy(&l[..limit]) / (limit as f32).ln();
            assert!((h - want).abs() < 1e-5, "{h} vs {want}");
            assert!(*h > 0.0 && *h <= 1.0 + 1e-6);
        }
    }
}

/// Over a mask: the entropy of the softmax of the allowed logits alone (host definition),
/// still normalised by ln(limit); one allowed id gives 0; a free row its plain entropy.
#[test]
fn entropy_rows_allowed_is_the_entropy_over_the_allowed_ids() {
    use candle_core::{Device, Tensor};
    use tokenrouter_runtime::runner::StepOutput;
    use tokenrouter_runtime::sampling::entropy;
    let (vocab, limit) = (300usize, 290usize);
    let logits = Tensor::randn(0f32, 3.0, (3, vocab), &Device::Cpu).unwrap();
    let out = StepOutput {
        logits,
        hidden: None,
    };
    let allowed_ids: [Vec<usize>; 3] = [
        (0..limit).step_by(7).collect(),
        vec![42],
        (0..limit).collect(),
    ];
    let mut flags = vec![0u8; 3 * limit];
    for (r, ids) in allowed_ids.iter().enumerate() {
        for &i in ids {
            flags[r * limit + i] = 1;
        }
    }
    let mask = Tensor::from_vec(flags, (3, limit), &Device::Cpu).unwrap();
    let got = out.entropy_rows_allowed(limit, &mask).unwrap();
    for ((h, row), ids) in got.iter().zip(out.logits_rows().unwrap()).zip(&allowed_ids) {
        let kept: Vec<f32> = ids.iter().map(|&i| row[i]).collect();
        let want = entropy(&kept) / (limit as f32).ln();
        assert!((h - want).abs() < 1e-5, "{h} vs {want}");
    }
    assert_eq!(got[1], 0.0);
    let plain = out.entropy_rows(limit).unwrap();
    assert!((got[2] - plain[2]).abs() < 1e-6);
}

/// The step's top logits (two sorts on large rows, one on small) equal the host's top-k
/// over the same first `limit` logits, in the same descending order.
#[test]
fn top_logits_rows_match_the_host_top_k() {
    use candle_core::{Device, Tensor};
    use tokenrouter_runtime::runner::StepOutput;
    use tokenrouter_runtime::sampling::top_k_indices;
    for (vocab, limit, k) in [
        (151_936usize, 151_665usize, 100usize),
        (288, 265, 100),
        (5000, 4999, 20),
    ] {
        let logits = Tensor::randn(0f32, 3.0, (3, vocab), &Device::Cpu).unwrap();
        let out = StepOutput {
            logits,
            hidden: None,
        };
        let got = out.top_logits_rows(limit, k).unwrap();
        for (g, row) in got.iter().zip(out.logits_rows().unwrap()) {
            let want: Vec<f32> = top_k_indices(&row[..limit], k)
                .into_iter()
                .map(|i| row[i as usize])
                .collect();
            assert_eq!(g, &want, "vocab {vocab}, limit {limit}, k {k}");
        }
    }
}
