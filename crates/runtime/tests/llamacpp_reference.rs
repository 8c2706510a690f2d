//! Agreement with llama.cpp on the real Qwen2.5-Coder GGUFs, using the reference data in
//! `scripts/reference/` (made by `scripts/llamacpp_reference.py` with xllamacpp). The models
//! come from `tokenrouter fetch` (CI runs it first); without them the test says so and
//! passes only when `TOKENROUTER_NO_SKIP` is unset (scripts/test.sh sets it).

mod fetched;

use fetched::fetched_model;
use std::path::PathBuf;
use tokenrouter_runtime::{
    load_model, KvBudget, LoadOptions, Row, Sampler, SamplingParams, StepOptions,
};

fn reference(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/reference")
        .join(format!("llamacpp_{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(name: &str, file: &str) {
    let Some(path) = fetched_model(file) else {
        return;
    };
    let r = reference(name);
    let mut m = load_model(
        &path,
        &LoadOptions {
            kv: KvBudget::Tokens(4096),
            ..Default::default()
        },
    )
    .unwrap();
    let limit = m.text.real_vocab_len();
    // Tokenization identical to llama.cpp's.
    for t in r["tokenization"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        assert_eq!(
            m.text.encode(text).unwrap(),
            ids(&t["ids"]),
            "tokenization of {text:?}"
        );
    }
    // Teacher-forced top-1 agreement.
    let (mut agree, mut total) = (0usize, 0usize);
    // How far our log-probability of llama.cpp's pick is from llama.cpp's own (a drift of the
    // numerics shows here long before it flips a pick).
    let (mut drift_sum, mut drift_max) = (0f64, 0f64);
    for (i, t) in r["teacher_forced"].as_array().unwrap().iter().enumerate() {
        let toks = ids(&t["ids"]);
        // One token per step, as the reference was made (llama.cpp's server extending its
        // cached prefix by one token): llama.cpp rounds a row differently inside a group of
        // four rows of a batch, and so do we.
        let logits: Vec<Vec<f32>> = toks
            .iter()
            .map(|&tok| {
                m.runner
                    .step(&[Row::new(i as u64, vec![tok])], StepOptions::default())
                    .unwrap()
                    .logits_rows()
                    .unwrap()
                    .remove(0)
            })
            .collect();
        m.runner.free(i as u64);
        for (k, want) in t["argmax"].as_array().unwrap().iter().enumerate() {
            let Some(want) = want.as_u64() else { continue };
            let row = &logits[k][..limit];
            let got = row
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (j, &x)| if x > b.1 { (j, x) } else { b })
                .0;
            total += 1;
            agree += usize::from(got as u64 == want);
            if let Some(theirs) = t["top_logprobs"][k][0].as_f64() {
                let ours =
                    f64::from(tokenrouter_runtime::sampling::log_softmax(row)[want as usize]);
                drift_sum += (ours - theirs).abs();
                drift_max = drift_max.max((ours - theirs).abs());
            }
            if got as u64 != want {
                let lp = tokenrouter_runtime::sampling::log_softmax(row);
                // A mismatch is only acceptable on a near-tie in llama.cpp's own numbers.
                let top: Vec<f64> = t["top_logprobs"][k]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                    .unwrap_or_default();
                if top.len() >= 2 {
                    assert!(
                        top[0] - top[1] < 0.15,
                        "{name}: text {i} pos {k}: mismatch where llama.cpp is decisive: {top:?}"
                    );
                }
                eprintln!(
                    "  mismatch text {i} pos {k}: llama.cpp top {:?} {:?}; ours {got} ({:.3}) vs llama's pick ({:.3})",
                    t["top_ids"][k], t["top_logprobs"][k], lp[got], lp[want as usize]
                );
            }
        }
    }
    let rate = agree as f64 / total as f64;
    eprintln!(
        "{name}: teacher-forced top-1 agreement {agree}/{total} = {:.2}%; |our - llama.cpp's \
         log-prob of its pick|: mean {:.4}, max {:.4}",
        rate * 100.0,
        drift_sum / total as f64,
        drift_max
    );
    // Our CPU arithmetic is llama.cpp's (x86 build), so the agreement is 100% on both
    // models, as the README claims, and our log-probabilities are llama.cpp's up to the 4
    // decimals the reference keeps (and its normalisation over the padded vocabulary, < 1e-3).
    assert!(
        total >= 512 && agree == total,
        "{name}: agreement {agree}/{total}"
    );
    assert!(drift_max < 0.005, "{name}: log-prob drift {drift_max}");
    // The same texts each processed as one prompt (a batch of 89-194 tokens: the tiled
    // attention path and the batched matmuls). llama.cpp's reference went a token at a time,
    // and its own batch arithmetic differs from that (other rounding in the grouped-row
    // matmuls and the tiled attention), so this is a guard against a broken batch path, not
    // a bit-for-bit check: session 29 saw 708/720 (0.5B) and 703-705/720 (1.5B), drifts up
    // to 0.38 at a few positions, with the one-key-at-a-time attention as well.
    let (mut agree, mut total, mut drift_max) = (0usize, 0usize, 0f64);
    for (i, t) in r["teacher_forced"].as_array().unwrap().iter().enumerate() {
        let toks = ids(&t["ids"]);
        let seq = 500 + i as u64;
        let opts = StepOptions {
            all_logits: true,
            ..Default::default()
        };
        let logits = m
            .runner
            .step(&[Row::new(seq, toks.clone())], opts)
            .unwrap()
            .logits_rows()
            .unwrap();
        m.runner.free(seq);
        for (k, want) in t["argmax"].as_array().unwrap().iter().enumerate() {
            let Some(want) = want.as_u64() else { continue };
            let row = &logits[k][..limit];
            let lp = tokenrouter_runtime::sampling::log_softmax(row);
            let got = (0..limit).fold(0, |b, j| if row[j] > row[b] { j } else { b });
            total += 1;
            agree += usize::from(got as u64 == want);
            let top: Vec<f64> = t["top_logprobs"][k]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                .unwrap_or_default();
            if let Some(&theirs) = top.first() {
                drift_max = drift_max.max((f64::from(lp[want as usize]) - theirs).abs());
            }
        }
    }
    eprintln!(
        "{name}: texts as one prompt: top-1 agreement {agree}/{total}; max log-prob drift {drift_max:.4}"
    );
    assert!(
        agree * 100 >= total * 97 && drift_max < 1.0,
        "{name}: texts as one prompt: agreement {agree}/{total}, drift {drift_max}"
    );
    // Greedy continuations: identical for the first 32 tokens (the prompt processed as one
    // batch, as llama.cpp does).
    let mut identical = 0;
    let n_prompts = r["greedy"].as_array().unwrap().len();
    for (i, g) in r["greedy"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&g["prompt_ids"]);
        let want = ids(&g["ids"]);
        let mut s = Sampler::new(SamplingParams::greedy(), 0, &prompt);
        let seq = 1000 + i as u64;
        let mut next = prompt;
        let mut got = Vec::new();
        while got.len() < want.len() {
            let l = m
                .runner
                .step(&[Row::new(seq, next)], StepOptions::default())
                .unwrap()
                .logits_rows()
                .unwrap();
            let t = s.sample(&l[0], limit, 0).token;
            got.push(t);
            next = vec![t];
        }
        m.runner.free(seq);
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{name}: greedy prompt {i}: first {same}/{} tokens identical",
            want.len()
        );
        identical += usize::from(same == want.len());
        assert!(
            same >= 2,
            "{name}: greedy prompt {i} diverges at once: {got:?} vs {want:?}"
        );
    }
    eprintln!("{name}: {identical}/{n_prompts} greedy continuations identical for 32 tokens");
    assert!(
        identical == n_prompts,
        "{name}: only {identical}/{n_prompts} identical"
    );
}

#[test]
fn qwen_coder_0_5b_matches_llamacpp() {
    check(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
}

#[test]
fn qwen_coder_1_5b_matches_llamacpp() {
    check(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    );
}
