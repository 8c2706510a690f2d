//! Sampling: greedy and seeded choices, penalties, bias, log-probabilities and top-k.
use super::*;

fn cfg() -> SamplingParams {
    SamplingParams::greedy()
}

#[test]
fn argmax_is_the_first_index_of_the_largest_value() {
    // The compare-and-keep loop it replaces: the first strictly larger value wins.
    let scalar = |values: &[f32]| {
        let mut best = (0u32, f32::NEG_INFINITY);
        for (i, &v) in values.iter().enumerate() {
            if v > best.1 {
                best = (i as u32, v);
            }
        }
        best
    };
    let row: Vec<f32> = (0..1003)
        .map(|i| ((i * 7919) % 1000) as f32 * 0.01)
        .collect();
    let mut rows = vec![row.clone(), vec![], vec![f32::NEG_INFINITY; 20]];
    // Ties (first index wins), NaNs (never win), a lone NaN ahead of -inf, a tail.
    let mut tied = row.clone();
    tied[5] = 99.0;
    tied[900] = 99.0;
    tied[1001] = 99.0;
    rows.push(tied);
    let mut nan = row.clone();
    nan[3] = f32::NAN;
    nan[700] = f32::NAN;
    rows.push(nan);
    let mut lone = vec![f32::NEG_INFINITY; 17];
    lone[0] = f32::NAN;
    rows.push(lone);
    let mut tail = row.clone();
    tail[1002] = 1e9;
    rows.push(tail);
    // Signed zeros tying for largest, in lanes out of index order.
    let mut zeros = vec![-1.0f32; 24];
    zeros[9] = 0.0;
    zeros[2] = -0.0;
    rows.push(zeros);
    for r in &rows {
        let (a, b) = (argmax(r), scalar(r));
        assert_eq!(
            (a.0, a.1.to_bits()),
            (b.0, b.1.to_bits()),
            "{:?}",
            &r[..r.len().min(4)]
        );
    }
}

#[test]
fn greedy_picks_argmax_and_respects_limit() {
    let mut s = Sampler::new(cfg(), 0, &[]);
    let out = s.sample(&[0.1, 2.0, 0.5, 9.0], 3, 2);
    assert_eq!(out.token, 1);
    assert_eq!(out.top.len(), 2);
    assert_eq!(out.top[0].0, 1);
    let total: f64 = log_softmax(&[0.1, 2.0, 0.5])
        .iter()
        .map(|&x| (x as f64).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6);
}

#[test]
fn masked_tokens_are_no_alternatives() {
    // Two tokens left by an output constraint; five alternatives asked for.
    let inf = f32::NEG_INFINITY;
    let out = Sampler::new(cfg(), 0, &[]).sample(&[inf, 1.0, inf, 0.5, inf], 5, 5);
    assert_eq!(out.token, 1);
    let ids: Vec<u32> = out.top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, vec![1, 3]);
    assert!(out.top.iter().all(|&(_, lp)| lp.is_finite()) && out.logprob.is_finite());
}

#[test]
fn a_constrained_choice_reports_the_models_own_logprobs() {
    let inf = f32::NEG_INFINITY;
    let logits = [3.0, 1.0, 2.0, 0.5];
    let masked = [inf, 1.0, inf, 0.5];
    let out = Sampler::new(cfg(), 0, &[]).sample_constrained(&logits, &masked, 4, 2);
    let lp = log_softmax(&logits);
    assert_eq!(out.token, 1);
    assert_eq!(out.logprob, lp[1]);
    assert_eq!(out.top, vec![(0, lp[0]), (2, lp[2])]);
}

#[test]
fn penalties_and_bias_change_choice() {
    let mut c = cfg();
    c.frequency_penalty = 5.0;
    let mut s = Sampler::new(c, 0, &[]);
    s.observe(1);
    assert_eq!(s.sample(&[0.0, 3.0, 1.0], 3, 0).token, 2);
    let mut c = cfg();
    c.logit_bias = vec![(0, 100.0)];
    assert_eq!(
        Sampler::new(c, 0, &[]).sample(&[0.0, 3.0, 1.0], 3, 0).token,
        0
    );
    let mut c = cfg();
    c.repetition_penalty = 10.0;
    assert_eq!(
        Sampler::new(c, 0, &[1])
            .sample(&[0.0, 3.0, 1.0], 3, 0)
            .token,
        2
    );
}

#[test]
fn seeded_sampling_is_reproducible_and_filters_apply() {
    let mut c = cfg();
    c.temperature = 1.0;
    let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
    let draw = |seed| {
        let mut s = Sampler::new(c.clone(), seed, &[]);
        (0..20)
            .map(|_| s.sample(&logits, 50, 0).token)
            .collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
    c.top_k = 1;
    let mut s = Sampler::new(c.clone(), 3, &[]);
    for _ in 0..10 {
        assert_eq!(s.sample(&[0.0, 1.0, 0.9], 3, 0).token, 1);
    }
    c.top_k = 0;
    c.min_p = 0.5;
    let mut s = Sampler::new(c.clone(), 3, &[]);
    for _ in 0..50 {
        assert_ne!(s.sample(&[5.0, 4.9, -5.0], 3, 0).token, 2);
    }
    c.min_p = 0.0;
    c.top_p = 0.1;
    let mut s = Sampler::new(c, 3, &[]);
    for _ in 0..20 {
        assert_eq!(s.sample(&[5.0, 4.0, 1.0], 3, 0).token, 0);
    }
}

#[test]
fn chacha12_stream_equals_stdrng() {
    // Seeded outputs from before the switch to the named generator stay the same.
    let mut a = rand::rngs::StdRng::seed_from_u64(42);
    let mut b = ChaCha12Rng::seed_from_u64(42);
    for _ in 0..100 {
        assert_eq!(a.random::<u64>(), b.random::<u64>());
    }
}

#[test]
fn restore_continues_the_same_stream() {
    for window in [None, Some(3)] {
        let mut c = cfg();
        c.temperature = 0.9;
        c.presence_penalty = 0.7;
        c.penalty_last_n = window;
        let logits: Vec<f32> = (0..64).map(|i| (i % 9) as f32 * 0.25).collect();
        let mut original = Sampler::new(c.clone(), 11, &[3, 4]);
        let mut output = Vec::new();
        for _ in 0..7 {
            let t = original.sample(&logits, 64, 0).token;
            original.observe(t);
            output.push(t);
        }
        let mut copy = Sampler::restore(c, 11, &[3, 4], &output, original.rng_position());
        assert!(original.rng_position() > 0);
        for _ in 0..20 {
            let (a, b) = (original.sample(&logits, 64, 0), copy.sample(&logits, 64, 0));
            assert_eq!(a, b, "window {window:?}");
            original.observe(a.token);
            copy.observe(b.token);
        }
        assert_eq!(original.counts(), copy.counts());
    }
}

#[test]
fn fast_exp_matches_libm() {
    for i in 0..2000 {
        let x = -80.0 + i as f32 * 0.0423;
        let (a, b) = (fast_exp(x), x.exp());
        // f32 rounding of x * log2(e) costs ~6e-8 relative per unit of |x|.
        assert!(
            (a - b).abs() <= 3e-7 * (1.0 + x.abs()) * b,
            "{x}: {a} vs {b}"
        );
    }
}

#[test]
fn fast_paths_agree_with_the_definitions() {
    let logits: Vec<f32> = (0..151_936)
        .map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 4.0)
        .collect();
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    assert!((log_sum_exp(&logits) as f64 - lse).abs() < 1e-5);
    let h: f64 = -logits
        .iter()
        .map(|&l| {
            let lp = l as f64 - lse;
            lp.exp() * lp
        })
        .sum::<f64>();
    assert!(
        (entropy(&logits) as f64 - h).abs() < 1e-4,
        "{} vs {h}",
        entropy(&logits)
    );
    let mut s = Sampler::new(cfg(), 0, &[]);
    let out = s.sample(&logits, logits.len(), 3);
    assert_eq!(out.token, top_k_indices(&logits, 1)[0]);
    assert!((out.logprob as f64 - (logits[out.token as usize] as f64 - lse)).abs() < 1e-5);
    assert_eq!(out.top.len(), 3);
}

#[test]
fn streamed_top_k_equals_sorting_the_row() {
    // Many ties (values repeat every 37 ids), signed zeros and infinities.
    let mut values: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 37) as f32 - 18.0).collect();
    values[10] = -0.0;
    values[11] = 0.0;
    values[4000] = f32::INFINITY;
    values[200] = f32::NEG_INFINITY;
    let sorted = |k: usize| {
        let mut idx: Vec<u32> = (0..values.len() as u32).collect();
        idx.sort_by(|a, b| {
            values[*b as usize]
                .partial_cmp(&values[*a as usize])
                .unwrap()
                .then(a.cmp(b))
        });
        idx.truncate(k);
        idx
    };
    for k in [1, 2, 5, 20, 64, 65, 300] {
        assert_eq!(top_k_indices(&values, k), sorted(k), "k = {k}");
    }
    assert_eq!(top_k_indices(&[1.0, 3.0], 5), vec![1, 0]);
}

#[test]
fn entropy_of_uniform_is_ln_n() {
    assert!((entropy(&[1.0; 8]) - (8f32).ln()).abs() < 1e-5);
}

#[test]
fn the_repetition_penalty_applies_once_to_an_id_in_prompt_and_output() {
    // Once: 4 / 1.5 = 2.67 stays ahead of 2.5; twice (2 / 1.5 / 1.5 = 1.78) it would not.
    let mut c = cfg();
    c.repetition_penalty = 1.5;
    let mut s = Sampler::new(c, 0, &[0]);
    s.observe(0);
    assert_eq!(s.sample(&[4.0, 2.5], 2, 0).token, 0);
}

/// The sparse adjustments (kept up to date as tokens are observed, taken by the host's
/// sampling and by device draws alike) change each logit as the penalty rules say, written
/// out here on their own: presence and frequency from the output's counts, the repetition
/// penalty once over the prompt and the output, the bias summed per id. A sampler restored
/// from the tokens carries the same entries.
#[test]
fn adjustments_follow_the_penalty_rules() {
    use std::collections::{HashMap, HashSet};
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for case in 0..300 {
        let n = 40u32;
        let mut c = cfg();
        // (-0.4, 0.2): a token's change goes back to none at its second use.
        let (presence, frequency) = [(0.0, 0.0), (0.7, 0.4), (0.0, -0.3), (-0.4, 0.2)][case % 4];
        (c.presence_penalty, c.frequency_penalty) = (presence, frequency);
        c.repetition_penalty = [1.0, 1.3, 0.8][(case / 4) % 3];
        if case % 5 == 0 {
            c.logit_bias = vec![(3, 2.5), (7, -1.0), (3, 0.5)];
        }
        let prompt: Vec<u32> = (0..6).map(|_| rng.random_range(0..n)).collect();
        let mut s = Sampler::new(c.clone(), 0, &prompt);
        let mut counts: HashMap<u32, u32> = HashMap::new();
        let mut output = Vec::new();
        for _ in 0..rng.random_range(0..12) {
            let t = rng.random_range(0..n);
            s.observe(t);
            output.push(t);
            *counts.entry(t).or_default() += 1;
        }
        // vLLM's order: the bias, then the repetition penalty, then frequency and presence.
        let expected = |id: u32, x: f32| {
            let mut x = x + c
                .logit_bias
                .iter()
                .filter(|(t, _)| *t == id)
                .map(|(_, b)| b)
                .sum::<f32>();
            let seen = prompt.contains(&id) || counts.contains_key(&id);
            if seen && c.repetition_penalty != 1.0 {
                x = if x > 0.0 {
                    x / c.repetition_penalty
                } else {
                    x * c.repetition_penalty
                };
            }
            if let Some(&k) = counts.get(&id) {
                x -= presence + frequency * k as f32;
            }
            x
        };
        let entries = s.adjustments();
        let ids: HashSet<u32> = entries.iter().map(|a| a.id).collect();
        assert_eq!(ids.len(), entries.len(), "case {case}: one entry per id");
        for id in 0..n {
            let x = rng.random_range(-4.0f32..4.0);
            let got = entries
                .iter()
                .find(|a| a.id == id)
                .map_or(x, |a| a.apply(x));
            assert!(
                (got - expected(id, x)).abs() < 1e-5,
                "case {case} id {id}: {got} vs {}",
                expected(id, x)
            );
        }
        let restored = Sampler::restore(c, 0, &prompt, &output, 0);
        let key = |a: &crate::sampling::race::Adjust| {
            (a.id, a.sub.to_bits(), a.rep.to_bits(), a.bias.to_bits())
        };
        // Entries that change nothing (a count back to no change) may differ.
        let changes =
            |a: &&crate::sampling::race::Adjust| a.sub != 0.0 || a.rep != 1.0 || a.bias != 0.0;
        let mut a: Vec<_> = entries.iter().filter(changes).map(key).collect();
        let mut b: Vec<_> = restored
            .adjustments()
            .iter()
            .filter(changes)
            .map(key)
            .collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "case {case}: restored entries");
    }
}

/// llama.cpp's `repeat_last_n`: all three penalties count the last n tokens of the prompt
/// and output, and a token that leaves the window is no longer penalised.
#[test]
fn a_penalty_window_counts_only_its_last_tokens() {
    use std::collections::HashMap;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for case in 0..200 {
        let vocab = 12u32;
        let mut c = cfg();
        let window = [0usize, 1, 3, 8][case % 4];
        c.penalty_last_n = Some(window);
        (c.presence_penalty, c.frequency_penalty) = [(0.5, 0.25), (0.0, -0.3)][(case / 4) % 2];
        c.repetition_penalty = [1.3, 1.0][(case / 8) % 2];
        if case % 3 == 0 {
            c.logit_bias = vec![(2, 1.5)];
        }
        let prompt: Vec<u32> = (0..rng.random_range(1..6))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let mut s = Sampler::new(c.clone(), 0, &prompt);
        let mut all = prompt.clone();
        for _ in 0..rng.random_range(0..15) {
            let t = rng.random_range(0..vocab);
            s.observe(t);
            all.push(t);
        }
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in &all[all.len().saturating_sub(window)..] {
            *counts.entry(t).or_default() += 1;
        }
        let mut want_counts: Vec<(u32, u32)> = counts.iter().map(|(&t, &k)| (t, k)).collect();
        want_counts.sort_unstable();
        assert_eq!(s.counts(), want_counts, "case {case}");
        let entries = s.adjustments();
        for id in 0..vocab {
            let x = rng.random_range(-4.0f32..4.0);
            let mut want = x + if id == 2 && case % 3 == 0 { 1.5 } else { 0.0 };
            if let Some(&k) = counts.get(&id) {
                if c.repetition_penalty != 1.0 {
                    want = if want > 0.0 {
                        want / c.repetition_penalty
                    } else {
                        want * c.repetition_penalty
                    };
                }
                want -= c.presence_penalty + c.frequency_penalty * k as f32;
            }
            let got = entries
                .iter()
                .find(|a| a.id == id)
                .map_or(x, |a| a.apply(x));
            assert!(
                (got - want).abs() < 1e-5,
                "case {case} id {id}: {got} vs {want}"
            );
        }
    }
}

/// Taking output tokens back (a model refused part of a hand-off) takes their penalties
/// back: the sampler equals one that never saw them, and its RNG stays where it was.
#[test]
fn rewind_forgets_tokens_taken_back() {
    for window in [None, Some(2)] {
        let mut c = cfg();
        c.temperature = 0.8;
        c.repetition_penalty = 1.4;
        c.frequency_penalty = 0.6;
        c.penalty_last_n = window;
        let logits: Vec<f32> = (0..16).map(|i| (i % 5) as f32 * 0.5).collect();
        let prompt = [1, 2, 3];
        let mut s = Sampler::new(c.clone(), 4, &prompt);
        for _ in 0..5 {
            let t = s.sample(&logits, 16, 0).token;
            s.observe(t);
        }
        let kept = [9, 9, 4];
        let mut never = Sampler::restore(c.clone(), 4, &prompt, &kept, s.rng_position());
        let mut taken_back = Sampler::restore(c, 4, &prompt, &kept, s.rng_position());
        taken_back.observe(7);
        taken_back.observe(9);
        taken_back.rewind(&prompt, &kept);
        assert_eq!(taken_back.counts(), never.counts(), "window {window:?}");
        for _ in 0..10 {
            let (a, b) = (
                taken_back.sample(&logits, 16, 0),
                never.sample(&logits, 16, 0),
            );
            assert_eq!(a, b, "window {window:?}");
            taken_back.observe(a.token);
            never.observe(b.token);
        }
    }
}

/// llama.cpp's chain with DRY: the window holds the prompt's tail and every observed token
/// once (a penalty window alongside does not fill it twice), `rewind` rebuilds it and keeps
/// the breakers, and such a request is drawn on the host.
#[test]
fn dry_reads_prompt_and_output_and_follows_a_rewind() {
    use tokenrouter_api::{DryParams, LlamaChain};
    let chain = LlamaChain {
        dry: Some(DryParams {
            multiplier: 5.0,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: None,
            sequence_breakers: Vec::new(),
        }),
        ..LlamaChain::default()
    };
    let config = SamplingParams {
        temperature: 0.0,
        penalty_last_n: Some(64),
        llama: Some(chain),
        ..SamplingParams::default()
    };
    let row = |best: &[(usize, f32)]| {
        let mut l = vec![0.0f32; 16];
        for &(id, v) in best {
            l[id] = v;
        }
        l
    };
    let five_best = row(&[(5, 3.0), (9, 2.0)]);
    let nine_best = row(&[(9, 2.0), (3, 1.5)]);
    let prompt = [5, 6, 7, 8, 9];
    let mut s = Sampler::new(config, 1, &prompt);
    assert!(s.needs_host());
    // The prompt once: nothing repeats yet (twice, 5 would extend `5 6 7 8 9`).
    assert_eq!(s.sample(&five_best, 16, 0).token, 5);
    for t in [5, 6, 7, 8] {
        s.observe(t);
    }
    // 9 would repeat five tokens: 5 * 1.75^2 off its logit.
    assert_eq!(s.sample(&nine_best, 16, 0).token, 3);
    s.set_dry_breakers(Arc::new(DryBreakers::from_sequences(&[vec![8]])));
    // Token 8 now breaks sequences: nothing before it counts.
    assert_eq!(s.sample(&nine_best, 16, 0).token, 9);
    s.set_dry_breakers(Arc::default());
    s.rewind(&prompt, &[5, 6]);
    // `5 6` repeats: 7 would extend it, 9 not.
    assert_eq!(s.sample(&nine_best, 16, 0).token, 9);
    s.set_dry_breakers(Arc::new(DryBreakers::from_sequences(&[vec![6]])));
    s.rewind(&prompt, &[5, 6, 7, 8]);
    // The breakers survive the rewind: 6 cuts the repeat to `7 8`, 9 loses 5 * 1.75^0 only.
    assert_eq!(s.sample(&nine_best, 16, 0).token, 3);
    let plain = Sampler::new(SamplingParams::default(), 1, &prompt);
    assert!(!plain.needs_host());
}

/// What llama.cpp's chain costs a token on a Qwen-sized row (152k logits) against vLLM's
/// order, printed: `cargo test --release -p tokenrouter-runtime chain_speed -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn chain_speed() {
    use tokenrouter_api::{DryParams, LlamaChain};
    let vocab = 151_936;
    // A peaked row, as a model's usually is: p ~ 1 / (1 + rank)^2 over a fixed permutation
    // of the ids (top-p 0.95 keeps ~20 of them). A flat row that keeps 23k ids under top-p
    // 0.95 costs the chain ~6 ms a token (the sort), as llama.cpp's own.
    let row: Vec<f32> = (0..vocab as u64)
        .map(|i| -2.0 * (1.0 + ((i * 2_654_435_761) % vocab as u64) as f32).ln())
        .collect();
    let history: Vec<u32> = (0..2048).map(|i| (i * 37 % 500) as u32).collect();
    let llama = |chain: LlamaChain| Some(chain);
    let dry = LlamaChain {
        dry: Some(DryParams {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: None,
            sequence_breakers: Vec::new(),
        }),
        ..LlamaChain::default()
    };
    let xtc = LlamaChain {
        xtc_probability: 0.5,
        xtc_threshold: 0.1,
        ..LlamaChain::default()
    };
    let defaults = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        ..SamplingParams::default()
    };
    let cases = [
        ("vLLM order, llama.cpp's values", defaults.clone()),
        (
            "llama.cpp chain, its defaults",
            SamplingParams {
                llama: llama(LlamaChain::default()),
                ..defaults.clone()
            },
        ),
        (
            "chain + DRY, 2k-token window",
            SamplingParams {
                llama: llama(dry),
                ..defaults.clone()
            },
        ),
        (
            "chain + XTC",
            SamplingParams {
                llama: llama(xtc),
                ..defaults.clone()
            },
        ),
        (
            "vLLM order, top-k off, top-p 0.95",
            SamplingParams {
                top_k: 0,
                ..defaults.clone()
            },
        ),
        (
            "chain, top-k off, top-p 0.95",
            SamplingParams {
                top_k: 0,
                llama: llama(LlamaChain::default()),
                ..defaults.clone()
            },
        ),
    ];
    for (what, config) in cases {
        let mut s = Sampler::new(config, 1, &history);
        let reps = 50;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            std::hint::black_box(s.sample(&row, vocab, 0));
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
        println!("{what:40} {us:8.0} us a token");
    }
}
