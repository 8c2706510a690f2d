//! Router training end to end on a tiny synthetic pair: labels against a brute-force
//! recomputation, resumption (and a larger `--limit`), bad inputs, a planted signal learnt to AUC >= 0.95,
//! reproducibility by seed, and the written router loaded by the `r2r` method with the
//! trainer's probabilities, then served.

use candle_core::Device;
use half::f16;
use rand::{Rng, SeedableRng};
use std::path::Path;
use tokenrouter_engine::methods::r2r::R2rNet;
use tokenrouter_engine::methods::router_net::{Site, Weights};
use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::{load_model, Arch, Row, StepOptions};
use tokenrouter_train::fit::{self, FitArgs};
use tokenrouter_train::label::{self, LabelArgs};
use tokenrouter_train::prompts::{encode, read_prompts};
use tokenrouter_train::shard::{self, Features};

mod common;
use common::*;

fn close(a: f16, b: f32) -> bool {
    (a.to_f32() - b).abs() <= 2e-3 * (1.0 + b.abs())
}

#[test]
fn labels_equal_a_brute_force_recomputation_and_resume() {
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let prompts = write_prompts(p.dir.path(), 5);
    let out = p.dir.path().join("labels");
    let a = label_args(cfg, prompts.clone(), out.clone());
    let stats = label::run(&a).unwrap();
    println!("{}", stats.summary());
    assert_eq!(stats.prompts, 5);
    assert!(stats.mismatches > 0 && stats.mismatches < stats.positions);
    assert_eq!(stats.shards_resumed, 0);
    let f = fit::load_dir(&out).unwrap();
    assert_eq!(f.len(), stats.positions);
    assert_eq!(f.positives(), stats.mismatches);

    // Brute force: one sequence at a time, every prefix from scratch.
    let mut small = load_model(&p.small, &opts()).unwrap();
    let mut large = load_model(&p.large, &opts()).unwrap();
    let limit = small.text.vocab_len();
    let eos = small.text.eos_ids().to_vec();
    let mut row = 0;
    let mut seq = 1000;
    for (i, prompt) in read_prompts(&prompts, true).unwrap().iter().enumerate() {
        let ids = encode(prompt, &small.text).unwrap();
        // The large model's greedy answer, one token per step.
        let mut answer = Vec::new();
        seq += 1;
        let mut feed = ids.clone();
        while answer.len() < 10 {
            let o = large
                .runner
                .step(&[Row::new(seq, feed)], StepOptions::default())
                .unwrap();
            let t = o.greedy_rows(limit).unwrap()[0].0;
            answer.push(t);
            if eos.contains(&t) {
                break;
            }
            feed = vec![t];
        }
        large.runner.free(seq);
        for (j, &want_large) in answer.iter().enumerate() {
            seq += 1;
            let mut prefix = ids.clone();
            prefix.extend_from_slice(&answer[..j]);
            let o = small
                .runner
                .step(
                    &[Row::new(seq, prefix)],
                    StepOptions {
                        want_hidden: true,
                        all_logits: false,
                    },
                )
                .unwrap();
            small.runner.free(seq);
            let tok = o.greedy_rows(limit).unwrap()[0].0;
            let top = &o.top_logits_rows(limit, 8).unwrap()[0];
            let h = o.hidden.unwrap().to_vec2::<f32>().unwrap().remove(0);
            let e = small
                .runner
                .model()
                .embed_tokens(&[tok])
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0);
            assert_eq!(f.prompt[row], i as u32);
            assert_eq!(f.position[row], j as u32);
            assert_eq!(f.large_token[row], want_large, "prompt {i} position {j}");
            assert_eq!(f.small_token[row], tok, "prompt {i} position {j}");
            assert_eq!(f.label[row], (tok != want_large) as u8);
            let hs = &f.hidden[row * f.hidden_size..(row + 1) * f.hidden_size];
            assert!(
                hs.iter().zip(&h).all(|(a, b)| close(*a, *b)),
                "hidden at {i}/{j}"
            );
            let es = &f.embed[row * f.embed_size..(row + 1) * f.embed_size];
            assert!(
                es.iter().zip(&e).all(|(a, b)| close(*a, *b)),
                "embedding at {i}/{j}"
            );
            let ts = &f.top[row * 8..(row + 1) * 8];
            assert!(
                ts.iter().zip(top).all(|(a, b)| close(*a, *b)),
                "top logits at {i}/{j}"
            );
            row += 1;
        }
    }
    assert_eq!(row, f.len(), "every position and no other");

    // Resuming finds every shard; a deleted shard is rebuilt identically.
    let again = label::run(&a).unwrap();
    assert_eq!(
        (again.shards_resumed, again.positions),
        (3, stats.positions)
    );
    let s1 = shard::shard_path(&out, 1);
    let bytes = std::fs::read(&s1).unwrap();
    std::fs::remove_file(&s1).unwrap();
    let third = label::run(&a).unwrap();
    assert_eq!(third.shards_resumed, 2);
    assert_eq!(std::fs::read(&s1).unwrap(), bytes);
    // Other inputs in the same directory are refused.
    let other = LabelArgs {
        max_tokens: 11,
        ..a.clone()
    };
    assert!(label::run(&other)
        .unwrap_err()
        .to_string()
        .contains("other inputs"));
    // A missing shard stops `fit` with the command that resumes.
    std::fs::remove_file(&s1).unwrap();
    let e = fit::load_dir(&out).unwrap_err().to_string();
    assert!(e.contains("resume"), "{e}");
    // A corrupt shard is a clear error.
    std::fs::write(&s1, b"not safetensors").unwrap();
    assert!(fit::load_dir(&out)
        .unwrap_err()
        .to_string()
        .contains("not a label shard"));
}

#[test]
fn a_larger_limit_extends_labels_that_end_on_a_shard_boundary() {
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let prompts = write_prompts(p.dir.path(), 5);
    let whole = p.dir.path().join("whole");
    let all = label::run(&label_args(cfg.clone(), prompts.clone(), whole.clone())).unwrap();
    // Four prompts (two whole shards of two), then all five: the two shards are kept.
    let grown = p.dir.path().join("grown");
    let first = LabelArgs {
        limit: Some(4),
        ..label_args(cfg.clone(), prompts.clone(), grown.clone())
    };
    assert_eq!(label::run(&first).unwrap().prompts, 4);
    let more = label::run(&label_args(cfg.clone(), prompts.clone(), grown.clone())).unwrap();
    assert_eq!(
        (
            more.prompts,
            more.shards_resumed,
            more.positions,
            more.mismatches
        ),
        (5, 2, all.positions, all.mismatches)
    );
    for s in 0..3 {
        assert_eq!(
            std::fs::read(shard::shard_path(&grown, s)).unwrap(),
            std::fs::read(shard::shard_path(&whole, s)).unwrap(),
            "shard {s}"
        );
    }
    // A smaller limit afterwards is other inputs, not a silent truncation.
    let e = label::run(&first).unwrap_err().to_string();
    assert!(e.contains("other inputs"), "{e}");
    // Three prompts end inside the second shard: growing them would mix prompts in it.
    let partial = p.dir.path().join("partial");
    label::run(&LabelArgs {
        limit: Some(3),
        ..label_args(cfg.clone(), prompts.clone(), partial.clone())
    })
    .unwrap();
    let e = label::run(&label_args(cfg, prompts, partial))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("first 3 prompts") && e.contains("shard boundary"),
        "{e}"
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let empty = p.dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let e = label::run(&label_args(cfg.clone(), empty, p.dir.path().join("o1")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds no prompts"), "{e}");
    // A large model whose token table differs from the small one's.
    let c_dir = p.dir.path().join("other");
    write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 33), &c_dir).unwrap();
    let tok_path = c_dir.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (a_id, b_id) = (vocab["A"].clone(), vocab["B"].clone());
    vocab.insert("A".into(), b_id);
    vocab.insert("B".into(), a_id);
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    let bad = pair_config(&p, &c_dir, "    dtype: f32\n");
    let prompts = write_prompts(p.dir.path(), 2);
    let e = label::run(&label_args(bad, prompts, p.dir.path().join("o2")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("reference"), "{e}");
    // Not a label directory.
    let e = fit::run(&FitArgs::new(
        p.dir.path().join("nothing"),
        p.dir.path().join("r"),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("not a label directory"), "{e}");
}

/// Labelled features whose label is a known function of the inputs.
fn planted(dir: &Path, prompts: usize, per_prompt: usize, hidden: usize, k: usize) -> Features {
    planted_with(dir, prompts, per_prompt, hidden, k, true)
}

/// As `planted`; without `use_embedding` the label depends on the hidden state alone (what
/// CITER and Co-LLM read).
fn planted_with(
    dir: &Path,
    prompts: usize,
    per_prompt: usize,
    hidden: usize,
    k: usize,
    use_embedding: bool,
) -> Features {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut f = Features::new(hidden, hidden, k);
    for pi in 0..prompts {
        for j in 0..per_prompt {
            let h: Vec<f32> = (0..hidden).map(|_| rng.random_range(-1.0..1.0)).collect();
            let e: Vec<f32> = (0..hidden).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut top: Vec<f32> = (0..k).map(|_| rng.random_range(0.0..10.0)).collect();
            top.sort_by(|a, b| b.total_cmp(a));
            // Routed when the hidden state leans one way and the embedding the other.
            let y = h[0] + h[1] - if use_embedding { e[2] } else { 0.0 } > 0.9;
            f.hidden.extend(h.iter().map(|&v| f16::from_f32(v)));
            f.embed.extend(e.iter().map(|&v| f16::from_f32(v)));
            f.top.extend(top.iter().map(|&v| f16::from_f32(v)));
            f.small_token.push(j as u32);
            f.large_token.push(if y { j as u32 + 1 } else { j as u32 });
            f.label.push(y as u8);
            f.prompt.push(pi as u32);
            f.position.push(j as u32);
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    shard::write(&shard::shard_path(dir, 0), &f).unwrap();
    let meta = serde_json::json!({"prompts": prompts, "shard_size": prompts});
    std::fs::write(dir.join(label::META_FILE), meta.to_string()).unwrap();
    f
}

fn small_fit(data: &Path, out: &Path, epochs: usize, seed: u64) -> FitArgs {
    FitArgs {
        width: 32,
        blocks: 2,
        epochs,
        patience: 4,
        batch: 64,
        seed,
        target_share: Some(0.2),
        ..FitArgs::new(data, out)
    }
}

#[test]
fn planted_signal_is_learnt_reproducibly_and_loads_through_r2r() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("planted");
    let f = planted(&data, 120, 25, 16, 6);
    let a = small_fit(&data, &dir.path().join("r1"), 25, 3);
    let report = fit::run(&a).unwrap();
    assert!(
        report.heldout_auc >= 0.95,
        "held-out AUC {}",
        report.heldout_auc
    );
    assert!(
        (report.at_threshold.share - 0.2).abs() < 0.02,
        "{:?}",
        report.at_threshold
    );
    // The held-out operating points: each near its share, recall growing with it.
    assert_eq!(report.curve.len(), fit::CURVE_SHARES.len());
    for (p, want) in report.curve.iter().zip(fit::CURVE_SHARES) {
        assert!((p.share - want).abs() < 0.02, "{want}: {p:?}");
    }
    assert!(report
        .curve
        .windows(2)
        .all(|w| w[0].recall <= w[1].recall && w[0].threshold >= w[1].threshold));
    assert!(report.summary().contains("held-out: threshold"));

    // Same seed, identical weights; another seed, other weights.
    let (n1, _) = fit::fit(&small_fit(&data, dir.path().join("x").as_path(), 2, 5), &f).unwrap();
    let (n2, _) = fit::fit(&small_fit(&data, dir.path().join("x").as_path(), 2, 5), &f).unwrap();
    let (n3, _) = fit::fit(&small_fit(&data, dir.path().join("x").as_path(), 2, 6), &f).unwrap();
    assert_eq!(n1.weight_bytes().unwrap(), n2.weight_bytes().unwrap());
    assert_ne!(n1.weight_bytes().unwrap(), n3.weight_bytes().unwrap());

    // The written file through the r2r method's loader: same probabilities.
    let path = a.out.join("router.safetensors");
    let site = Site {
        model: "quick".into(),
        config_file: dir.path().join("c.yaml"),
    };
    let w = Weights::load(&path, &Device::Cpu, &site, "model_path").unwrap();
    let net = R2rNet::from_weights(&w).unwrap();
    let rows: Vec<usize> = (0..300).collect();
    let (h, e, t, _) = fit::batch(&f, &rows).unwrap();
    let served = net.forward(&h, &e, &t).unwrap();
    let (trained, _) = fit::fit(&a, &f).unwrap();
    let ours = fit::predict(&trained, &f, &rows).unwrap();
    let worst = served
        .iter()
        .zip(&ours)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "largest difference {worst}");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.out.join("router.json")).unwrap()).unwrap();
    assert_eq!(
        meta["model_type"],
        "HiddenStatesTokenLMHeadLogitsClassifier"
    );
    let written = meta["common_args"]["threshold"].as_f64().unwrap();
    assert!((written - report.at_threshold.threshold).abs() < 1e-12);
    let curve = meta["training"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), report.curve.len());
}

#[test]
fn citer_and_collm_heads_learn_and_load_through_their_methods() {
    use tokenrouter_engine::methods::citer::CiterNet;
    use tokenrouter_train::net::Head;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("planted");
    let f = planted_with(&data, 120, 25, 16, 6, false);
    let site = Site {
        model: "quick".into(),
        config_file: dir.path().join("c.yaml"),
    };
    let rows: Vec<usize> = (0..300).collect();
    for head in [Head::Citer, Head::Collm] {
        let out = dir.path().join(format!("{head:?}"));
        let a = FitArgs {
            head,
            ..small_fit(&data, &out, 25, 3)
        };
        let report = fit::run(&a).unwrap();
        assert!(
            report.heldout_auc >= 0.95,
            "{head:?}: held-out AUC {}",
            report.heldout_auc
        );
        let (trained, _) = fit::fit(&a, &f).unwrap();
        let ours = fit::predict(&trained, &f, &rows).unwrap();
        let w = Weights::load(
            &out.join("router.safetensors"),
            &Device::Cpu,
            &site,
            "model_path",
        )
        .unwrap();
        let (h, _, _, _) = fit::batch(&f, &rows).unwrap();
        let served: Vec<f32> = match head {
            Head::Citer => CiterNet::from_weights(&w).unwrap().forward(&h).unwrap(),
            _ => {
                // Co-LLM: sigmoid(g·h + b) with the file's g and b.
                let g = w.get("deferral.weight", &[Some(1), Some(16)]).unwrap();
                let b = w.get("deferral.bias", &[Some(1)]).unwrap();
                let z = h
                    .matmul(&g.t().unwrap())
                    .unwrap()
                    .broadcast_add(&b)
                    .unwrap();
                candle_nn::ops::sigmoid(&z.flatten_all().unwrap())
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            }
        };
        let worst = served
            .iter()
            .zip(&ours)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{head:?}: largest difference {worst}");
        // CITER routes below its threshold: the written one routes the chosen share.
        let routed = served
            .iter()
            .filter(|&&p| match head {
                Head::Citer => (p as f64) < report.method_threshold,
                _ => p as f64 >= report.method_threshold,
            })
            .count();
        assert!(routed > 0 && routed < rows.len());
        // The curve's thresholds are read as the method reads them: more share, more routed.
        let routed_at: Vec<usize> = report
            .curve
            .iter()
            .map(|c| {
                served
                    .iter()
                    .filter(|&&p| match head {
                        Head::Citer => (p as f64) < c.threshold,
                        _ => p as f64 >= c.threshold,
                    })
                    .count()
            })
            .collect();
        assert!(
            routed_at.windows(2).all(|w| w[0] <= w[1]) && routed_at[0] < routed_at[6],
            "{head:?}: {routed_at:?}"
        );
    }
}

#[test]
fn a_router_trained_on_the_tiny_pair_serves_through_r2r() {
    use std::time::Duration;
    use tokenrouter_api::{Backend, GenerateEvent, GenerateRequest, SamplingParams};
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let prompts = write_prompts(p.dir.path(), 24);
    let labels = p.dir.path().join("labels");
    let mut a = label_args(cfg, prompts, labels.clone());
    a.shard_size = 8;
    a.top_k = 100;
    label::run(&a).unwrap();
    let router = p.dir.path().join("router");
    let mut fa = small_fit(&labels, &router, 3, 1);
    fa.holdout = 0.3;
    let report = fit::run(&fa).unwrap();
    let served_cfg = pair_config(
        &p,
        &p.large,
        &format!(
            "    scheduler_class: r2r_slm\n    scheduler_kwargs: {{model_path: {}}}\n",
            router.join("router.safetensors").display()
        ),
    );
    let e = tokenrouter_engine::Engine::start(
        tokenrouter_engine::EngineConfig::from_file(&served_cfg).unwrap(),
    )
    .unwrap();
    e.wait_ready(Duration::from_secs(60)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ended = rt.block_on(async {
        let mut s = e
            .submit(GenerateRequest {
                prompt_ids: vec![5, 6, 7, 8],
                sampling: SamplingParams {
                    temperature: 0.0,
                    ..Default::default()
                },
                max_tokens: Some(12),
                stop_token_ids: vec![],
                ignore_eos: true,
                pinned_model: None,
                top_logprobs: 0,
                routing: tokenrouter_api::RoutingOverrides(
                    [("threshold".to_string(), report.at_threshold.threshold)].into(),
                ),
                prompt_logprobs: None,
                constraint: None,
                priority: 0,
                cache_salt: None,
            })
            .unwrap();
        let mut tokens = 0;
        while let Some(ev) = s.events.recv().await {
            match ev {
                GenerateEvent::Token(_) => tokens += 1,
                GenerateEvent::Finished { .. } => return tokens,
                GenerateEvent::PromptCached(_) => {}
                GenerateEvent::Error(err) => panic!("{err}"),
                GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
            }
        }
        panic!("no finish")
    });
    assert_eq!(ended, 12);
    e.shutdown();
    // The other heads from the same labels load through their methods too.
    for (head, class) in [
        (tokenrouter_train::net::Head::Citer, "citer_slm"),
        (tokenrouter_train::net::Head::Collm, "collm_slm"),
    ] {
        let out = p.dir.path().join(class);
        let fa = FitArgs {
            head,
            holdout: 0.3,
            ..small_fit(&labels, &out, 2, 1)
        };
        let r = fit::run(&fa).unwrap();
        let yaml = pair_config(
            &p,
            &p.large,
            &format!(
                "    scheduler_class: {class}\n    scheduler_kwargs: {{model_path: {}, threshold: {}}}\n",
                out.join("router.safetensors").display(),
                r.method_threshold.clamp(0.0, 1.0)
            ),
        );
        let e = tokenrouter_engine::Engine::start(
            tokenrouter_engine::EngineConfig::from_file(&yaml).unwrap(),
        )
        .unwrap();
        e.wait_ready(Duration::from_secs(60)).unwrap();
        e.shutdown();
    }
}
