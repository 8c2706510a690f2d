//! Ragged batching must not change results: batched rows equal rows run alone, extend by k
//! equals k decodes, a paused sequence resumes identically, GGUF equals safetensors.

use candle_core::quantized::GgmlDType;
use tokenrouter_runtime::synth::{write_gguf, write_hf_dir, SynthSpec};
use tokenrouter_runtime::{load_model, Arch, KvBudget, LoadOptions, Row, Runner, StepOptions};

fn opts() -> LoadOptions {
    LoadOptions {
        kv: KvBudget::Tokens(2048),
        ..LoadOptions::default()
    }
}

fn hf(arch: Arch, dir: &std::path::Path) -> Runner {
    let p = write_hf_dir(&SynthSpec::tiny(arch, 7), &dir.join("hf")).unwrap();
    load_model(&p, &opts()).unwrap().runner
}

fn step_last(r: &mut Runner, rows: Vec<Row>) -> Vec<Vec<f32>> {
    r.step(&rows, StepOptions::default())
        .unwrap()
        .logits_rows()
        .unwrap()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_within(a, b, 1e-4, what);
}

fn assert_within(a: &[f32], b: &[f32], tolerance: f32, what: &str) {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(err <= tolerance, "{what}: relative error {err}");
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 31 + salt * 17 + 5) % 250)
        .collect()
}

#[test]
fn batch_equals_alone_for_every_arch() {
    for arch in [Arch::Qwen3, Arch::Qwen2, Arch::Llama] {
        let dir = tempfile::tempdir().unwrap();
        let mut r = hf(arch, dir.path());
        // 70 tokens: a prompt row of a tile and more (tiled attention) beside short rows.
        let lens = [5usize, 1, 17, 3, 70];
        let alone: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let out = step_last(&mut r, vec![Row::new(100 + i as u64, prompt(n, i as u32))]);
                r.free(100 + i as u64);
                out.into_iter().next().unwrap()
            })
            .collect();
        let rows = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Row::new(i as u64, prompt(n, i as u32)))
            .collect();
        let batched = step_last(&mut r, rows);
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_close(a, b, &format!("{arch:?} row {i}"));
        }
        // Mixed step: row 0 decodes one token while a new row prefills.
        let mixed = step_last(
            &mut r,
            vec![Row::new(0, vec![9]), Row::new(50, prompt(6, 9))],
        );
        let mut r2 = hf(arch, dir.path());
        let mut p0 = prompt(5, 0);
        p0.push(9);
        let a0 = step_last(&mut r2, vec![Row::new(1, p0)]);
        assert_close(&a0[0], &mixed[0], &format!("{arch:?} mixed decode row"));
        for s in [0, 1, 2, 3, 4, 50] {
            r.free(s);
        }
        assert_eq!(r.usage().used_blocks, 0);
    }
}

#[test]
fn extend_by_k_equals_k_decodes_and_pause_resume() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = hf(Arch::Qwen3, dir.path());
    // One extend of all 100 tokens (the tiled attention of prompts) against a 10-token
    // prefill and 90 decodes (one key at a time).
    let p = prompt(100, 3);
    let whole = step_last(&mut r, vec![Row::new(1, p.clone())]);
    // 10-token prefill then 30 decodes, with another sequence stepping in between.
    let mut last = Vec::new();
    step_last(&mut r, vec![Row::new(2, p[..10].to_vec())]);
    for (i, &t) in p[10..].iter().enumerate() {
        if i % 7 == 3 {
            step_last(&mut r, vec![Row::new(3, prompt(2, i as u32))]);
        }
        last = step_last(&mut r, vec![Row::new(2, vec![t])]);
    }
    // Two arithmetics, as in llama.cpp: the prompt's attention keeps f32 queries and sums,
    // a decode's rounds them to f16 (1.1e-4 apart here).
    assert_within(&whole[0], &last[0], 5e-4, "extend vs decodes");
    assert_eq!(r.seq_len(2), Some(100));
    for s in 1..=3 {
        assert!(r.free(s));
    }
    assert_eq!(r.usage().used_blocks, 0);
}

#[test]
fn a_reused_prefix_gives_the_logits_of_recomputing_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut fresh = hf(Arch::Qwen2, dir.path());
    let mut cached = hf(Arch::Qwen2, dir.path());
    cached.enable_prefix_cache();
    let p = prompt(45, 4);
    // An earlier request with the same 37-token start, finished.
    step_last(&mut cached, vec![Row::new(1, p[..37].to_vec())]);
    assert!(cached.free(1));
    // The new request: whole blocks of the shared start are reused, the rest computed.
    let hit = cached.attach_prefix(2, &p);
    assert_eq!(hit, 32, "two full 16-token blocks");
    let got = step_last(&mut cached, vec![Row::new(2, p[hit..].to_vec())]);
    let want = step_last(&mut fresh, vec![Row::new(2, p.clone())]);
    assert_close(&want[0], &got[0], "reused prefix vs recomputed");
    // Decoding on continues from the same state.
    let a = step_last(&mut cached, vec![Row::new(2, vec![7])]);
    let b = step_last(&mut fresh, vec![Row::new(2, vec![7])]);
    assert_close(&b[0], &a[0], "decode after a reused prefix");
    assert_eq!(cached.prefix_hits(), (45, 32));
}

#[test]
fn gguf_equals_safetensors_for_every_arch() {
    for arch in [Arch::Qwen3, Arch::Qwen2, Arch::Llama] {
        let dir = tempfile::tempdir().unwrap();
        let spec = SynthSpec::tiny(arch, 11);
        let hf_dir = write_hf_dir(&spec, &dir.path().join("hf")).unwrap();
        let gguf = write_gguf(&spec, &dir.path().join("m.gguf"), GgmlDType::F32).unwrap();
        let mut a = load_model(&hf_dir, &opts()).unwrap();
        let mut b = load_model(&gguf, &opts()).unwrap();
        let text = "the cat in the hat";
        let ids_a = a.text.encode(text).unwrap();
        let ids_b = b.text.encode(text).unwrap();
        assert_eq!(ids_a, ids_b, "{arch:?} tokenizers agree");
        let la = step_last(&mut a.runner, vec![Row::new(1, ids_a.clone())]);
        let lb = step_last(&mut b.runner, vec![Row::new(1, ids_b)]);
        assert_close(&la[0], &lb[0], &format!("{arch:?} gguf vs safetensors"));
        // Continue decoding a few tokens to exercise positions > 0 with both rope layouts.
        let la = step_last(&mut a.runner, vec![Row::new(1, vec![42])]);
        let lb = step_last(&mut b.runner, vec![Row::new(1, vec![42])]);
        assert_close(
            &la[0],
            &lb[0],
            &format!("{arch:?} gguf vs safetensors decode"),
        );
    }
}

#[test]
fn every_quant_type_loads_and_tracks_f32() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SynthSpec::tiny(Arch::Qwen2, 5);
    spec.hidden_size = 256;
    spec.intermediate_size = 256;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = 64;
    let ids = prompt(12, 1);
    let reference = {
        let p = write_gguf(&spec, &dir.path().join("f32.gguf"), GgmlDType::F32).unwrap();
        let mut m = load_model(&p, &opts()).unwrap();
        step_last(&mut m.runner, vec![Row::new(1, ids.clone())]).remove(0)
    };
    use GgmlDType::*;
    for (dt, min_cos) in [
        (F16, 0.999),
        (BF16, 0.99),
        (Q8_0, 0.99),
        (Q4_0, 0.9),
        (Q4_1, 0.9),
        (Q5_0, 0.9),
        (Q4K, 0.9),
        (Q5K, 0.9),
        (Q6K, 0.95),
    ] {
        let p = write_gguf(&spec, &dir.path().join(format!("{dt:?}.gguf")), dt).unwrap();
        let mut m = load_model(&p, &opts()).unwrap();
        let l = step_last(&mut m.runner, vec![Row::new(1, ids.clone())]).remove(0);
        let dotp: f32 = l.iter().zip(&reference).map(|(a, b)| a * b).sum();
        let na: f32 = l.iter().map(|a| a * a).sum::<f32>().sqrt();
        let nb: f32 = reference.iter().map(|a| a * a).sum::<f32>().sqrt();
        let cos = dotp / (na * nb);
        assert!(cos >= min_cos, "{dt:?}: cosine {cos} < {min_cos}");
    }
}

/// q/k/v and gate/up stacked into one CPU matmul each (`cpu_fuse`, off by default) give the
/// logits of the separate matmuls bit for bit: a prompt, a batch of decode rows and a
/// second sequence's extend, for weight types of each of our CPU kernels.
#[test]
fn fused_projections_give_the_same_logits_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SynthSpec::tiny(Arch::Qwen2, 9);
    spec.hidden_size = 256;
    spec.intermediate_size = 512;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = 64;
    for dt in [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
    ] {
        let p = write_gguf(&spec, &dir.path().join(format!("{dt:?}.gguf")), dt).unwrap();
        let run = |fuse: bool| {
            let mut o = opts();
            o.kernels.cpu_fuse = fuse;
            let mut m = load_model(&p, &o).unwrap();
            let mut out = step_last(
                &mut m.runner,
                vec![Row::new(1, prompt(12, 1)), Row::new(2, prompt(9, 2))],
            );
            out.extend(step_last(
                &mut m.runner,
                vec![
                    Row::new(1, vec![7]),
                    Row::new(2, vec![8]),
                    Row::new(3, prompt(5, 3)),
                ],
            ));
            out
        };
        let (fused, split) = (run(true), run(false));
        for (a, b) in fused.iter().zip(&split) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{dt:?}: fused and separate projections differ");
        }
    }
}

/// A CPU step of more than `CPU_UBATCH` tokens runs as several forward passes; each row's
/// results are those of the row alone split the same way, bit for bit (last-token and
/// all-position logits, hidden states), and a row that fits one pass gets the results of
/// one pass.
#[test]
fn long_steps_run_in_passes_with_the_results_of_rows_alone() {
    use tokenrouter_runtime::runner::CPU_UBATCH;
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SynthSpec::tiny(Arch::Qwen2, 4);
    spec.hidden_size = 256;
    spec.intermediate_size = 512;
    spec.head_dim = 64;
    spec.max_position = 4096;
    // Three rows past a pass: alone in a pass they round like llama.cpp's vec_dot for Q6_K,
    // within one pass of 515 rows like its tiled kernel, so one pass would fail this.
    let (long, short) = (CPU_UBATCH + 3, 300);
    for dt in [GgmlDType::Q4K, GgmlDType::Q6K] {
        let p = write_gguf(&spec, &dir.path().join(format!("{dt:?}.gguf")), dt).unwrap();
        let o = LoadOptions {
            kv: KvBudget::Tokens(4096),
            ..LoadOptions::default()
        };
        let mut m = load_model(&p, &o).unwrap();
        let r = &mut m.runner;
        let bits = |t: &candle_core::Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        for all_logits in [false, true] {
            let opts = StepOptions {
                want_hidden: true,
                all_logits,
            };
            let (a, b) = (prompt(long, 1), prompt(short, 2));
            let both = r
                .step(&[Row::new(1, a.clone()), Row::new(2, b.clone())], opts)
                .unwrap();
            // Alone: the long row in the same two pieces, the short one in one step.
            let first = r
                .step(&[Row::new(3, a[..CPU_UBATCH].to_vec())], opts)
                .unwrap();
            let rest = r
                .step(&[Row::new(3, a[CPU_UBATCH..].to_vec())], opts)
                .unwrap();
            let alone_b = r.step(&[Row::new(4, b.clone())], opts).unwrap();
            let mut want_logits = Vec::new();
            if all_logits {
                want_logits.extend(bits(&first.logits));
            }
            want_logits.extend(bits(&rest.logits));
            want_logits.extend(bits(&alone_b.logits));
            let rows = if all_logits { long + short } else { 2 };
            assert_eq!(both.logits.dim(0).unwrap(), rows, "{dt:?}");
            assert!(
                bits(&both.logits) == want_logits,
                "{dt:?} all={all_logits}: logits"
            );
            let hidden = both.hidden.as_ref().unwrap();
            // With all_logits the hidden states are every position's too.
            let mut want_hidden = Vec::new();
            for (out, wanted) in [(&first, all_logits), (&rest, true), (&alone_b, true)] {
                if wanted {
                    want_hidden.extend(bits(out.hidden.as_ref().unwrap()));
                }
            }
            assert!(
                bits(hidden) == want_hidden,
                "{dt:?} all={all_logits}: hidden"
            );
            for s in 1..=4 {
                r.free(s);
            }
        }
    }
}
