use super::*;

/// Logits with distinct values, spread over ~12 nats.
fn row(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u = uniform(seed, i as u32);
            12.0 * u - 3.0 + i as f32 * 1e-4
        })
        .collect()
}

fn scaled(row: &[f32], t: f32) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    row.iter().map(|&v| (v - max) / t).collect()
}

fn kept(scaled: &[f32], draw: &RowDraw) -> usize {
    let t = threshold(scaled, draw);
    scaled.iter().filter(|&&s| s >= t).count()
}

/// The host sampler's kept count: sort, cut by top-k or the floor, min-p, then the
/// smallest prefix reaching top_p (in f64, as `Sampler` does).
fn host_kept(scaled: &[f32], draw: &RowDraw) -> usize {
    let mut s: Vec<f32> = scaled.to_vec();
    s.sort_by(|a, b| b.partial_cmp(a).unwrap());
    if draw.top_k > 0 {
        s.truncate(draw.top_k as usize);
    } else {
        s.retain(|&v| v >= FLOOR);
    }
    let p: Vec<f64> = s.iter().map(|&v| (v as f64).exp()).collect();
    let z: f64 = p.iter().sum();
    let mut keep = p
        .iter()
        .take_while(|&&q| q >= draw.min_p as f64)
        .count()
        .max(1);
    if draw.top_p < 1.0 {
        let mut acc = 0.0;
        let mut n = 0;
        for q in &p[..keep] {
            acc += q / z;
            n += 1;
            if acc >= draw.top_p as f64 {
                break;
            }
        }
        keep = n;
    }
    keep
}

fn draw(temperature: f32, top_k: u32, top_p: f32, min_p: f32) -> RowDraw {
    RowDraw {
        key: 7,
        ..RowDraw::sampled(temperature, top_k, top_p, min_p)
    }
}

#[test]
fn uniforms_lie_inside_the_unit_interval_and_spread_evenly() {
    let n = 100_000;
    let (mut sum, mut lo, mut hi) = (0f64, 1f32, 0f32);
    for i in 0..n {
        let u = uniform(0xDEAD_BEEF, i);
        assert!(u > 0.0 && u < 1.0, "{u}");
        assert!(gumbel(0xDEAD_BEEF, i).is_finite());
        sum += u as f64;
        lo = lo.min(u);
        hi = hi.max(u);
    }
    assert!(
        (sum / n as f64 - 0.5).abs() < 0.005,
        "mean {}",
        sum / n as f64
    );
    assert!(lo < 1e-3 && hi > 0.999);
    // Another key, other uniforms.
    assert_ne!(uniform(1, 5), uniform(2, 5));
}

#[test]
fn the_kept_set_is_the_host_samplers() {
    for seed in 0..20 {
        let r = row(3000, seed);
        for (t, k, p, m) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.0, 40, 1.0, 0.0),
            (1.0, 1, 1.0, 0.0),
            (0.5, 50, 0.8, 0.0),
            (1.3, 0, 0.95, 0.05),
            (1.0, 0, 1.0, 0.2),
            (2.0, 2999, 0.5, 0.0),
        ] {
            let d = draw(t, k, p, m);
            let s = scaled(&r, t);
            assert_eq!(kept(&s, &d), host_kept(&s, &d), "seed {seed} {d:?}");
        }
    }
}

#[test]
fn top_k_beyond_the_row_keeps_everything_above_the_lowest() {
    let r = row(100, 3);
    let s = scaled(&r, 1.0);
    assert_eq!(kept(&s, &draw(1.0, 1000, 1.0, 0.0)), 100);
}

#[test]
fn greedy_is_the_argmax_among_the_allowed_with_the_raw_logprob() {
    let r = row(500, 11);
    let lse = {
        let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        m + r.iter().map(|&v| (v - m).exp()).sum::<f32>().ln()
    };
    let best = (0..r.len())
        .max_by(|&a, &b| r[a].partial_cmp(&r[b]).unwrap())
        .unwrap();
    let (tok, lp) = pick(&r, &[], None, &RowDraw::GREEDY);
    assert_eq!(tok as usize, best);
    assert!((lp - (r[best] - lse)).abs() < 1e-5);
    // Masked: the best of the allowed, the logprob still over the whole row.
    let mut allowed = vec![1u8; r.len()];
    allowed[best] = 0;
    let second = (0..r.len())
        .filter(|&i| i != best)
        .max_by(|&a, &b| r[a].partial_cmp(&r[b]).unwrap())
        .unwrap();
    let (tok, lp) = pick(&r, &[], Some(&allowed), &RowDraw::GREEDY);
    assert_eq!(tok as usize, second);
    assert!((lp - (r[second] - lse)).abs() < 1e-5);
}

#[test]
fn a_row_with_nan_is_not_sampled() {
    let mut r = row(50, 1);
    r[17] = f32::NAN;
    let (tok, lp) = pick(&r, &[], None, &draw(1.0, 0, 1.0, 0.0));
    assert_eq!(tok, 0);
    assert!(lp.is_nan());
}

#[test]
fn draws_follow_the_tempered_softmax_of_the_kept_set() {
    // 6 tokens; top-p 0.9 at T = 0.8 leaves the best few, in proportion.
    let r = vec![2.0f32, 1.5, 1.0, 0.2, -1.0, -4.0];
    let mut d = draw(0.8, 0, 0.9, 0.0);
    let s = scaled(&r, d.temperature);
    let n_kept = host_kept(&s, &d);
    let z: f64 = s[..n_kept].iter().map(|&v| (v as f64).exp()).sum();
    let n = 40_000;
    let mut counts = [0usize; 6];
    for key in 0..n {
        d.key = key as u64 * 0x1234_5678_9ABC + 99;
        counts[pick(&r, &[], None, &d).0 as usize] += 1;
    }
    for (i, &c) in counts.iter().enumerate() {
        let want = if i < n_kept {
            (s[i] as f64).exp() / z
        } else {
            0.0
        };
        let got = c as f64 / n as f64;
        // 5 standard errors.
        let tol = 5.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-9;
        assert!((got - want).abs() <= tol, "token {i}: {got} vs {want}");
    }
}

#[test]
fn a_row_is_drawn_from_its_key_alone_and_never_outside_the_mask() {
    let r = row(2000, 5);
    let mut allowed = vec![0u8; r.len()];
    for i in (0..r.len()).step_by(3) {
        allowed[i] = 1;
    }
    let d = draw(1.0, 0, 0.95, 0.0);
    let first: Vec<u32> = (0..200)
        .map(|k| pick(&r, &[], Some(&allowed), &RowDraw { key: k, ..d }).0)
        .collect();
    let again: Vec<u32> = (0..200)
        .map(|k| pick(&r, &[], Some(&allowed), &RowDraw { key: k, ..d }).0)
        .collect();
    assert_eq!(first, again);
    assert!(first.iter().all(|&t| t % 3 == 0));
    let distinct: std::collections::HashSet<_> = first.iter().collect();
    assert!(distinct.len() > 10, "{} distinct picks", distinct.len());
}

#[test]
fn adjustments_change_the_choice_not_the_logprob() {
    let r = vec![3.0f32, 2.9, -1.0, 0.5];
    let lse = {
        let m = 3.0f32;
        m + r.iter().map(|&v| (v - m).exp()).sum::<f32>().ln()
    };
    // A repetition penalty on id 0 (positive: divided), a bias lifting id 2 past both.
    let adjust = [
        Adjust {
            id: 0,
            sub: 0.0,
            rep: 2.0,
            bias: 0.0,
        },
        Adjust {
            id: 2,
            sub: 0.5,
            rep: 1.0,
            bias: 5.0,
        },
    ];
    assert_eq!(adjust[0].apply(3.0), 1.5);
    assert_eq!(adjust[1].apply(-1.0), 3.5);
    let (tok, lp) = pick(&r, &adjust, None, &RowDraw::GREEDY);
    assert_eq!(tok, 2);
    assert!((lp - (r[2] - lse)).abs() < 1e-6);
    let (tok, _) = pick(&r, &adjust[..1], None, &RowDraw::GREEDY);
    assert_eq!(tok, 1);
    // Negative logits are multiplied.
    let neg = Adjust {
        id: 0,
        sub: 0.0,
        rep: 2.0,
        bias: 0.0,
    };
    assert_eq!(neg.apply(-1.5), -3.0);
}

#[test]
fn a_row_reports_the_hosts_top_alternatives() {
    let r = row(1000, 9);
    let mut allowed = vec![0u8; r.len()];
    allowed[17] = 1;
    let want = {
        let lse = crate::sampling::log_sum_exp(&r);
        crate::sampling::logprob_and_top(&r, lse, 17, 5)
    };
    let got = pick_row(
        &r,
        &DrawRow {
            draw: RowDraw::GREEDY,
            adjust: vec![],
            top: 5,
        },
        Some(&allowed),
    );
    assert_eq!(got.token, 17);
    assert_eq!(got.top, want.1);
    assert!((got.logprob - want.0).abs() < 1e-5);
}
