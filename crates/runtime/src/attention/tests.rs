use super::*;

#[test]
fn dot_f16_sums_in_ggml_order() {
    let a: Vec<f32> = (0..70).map(|i| i as f32 * 0.5 - 9.0).collect();
    let b: Vec<f32> = (0..70).map(|i| 1.0 - i as f32 * 0.03).collect();
    let naive: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
    assert!((f64::from(dot_f16(&bits(&a), &b)) - naive).abs() < 1e-3);
    // Lane l of accumulator j holds values 32i + 8j + l; a value placed elsewhere in a
    // 32-value step lands in another lane, which only the order of the final sums sees.
    let mut one = vec![0f32; 64];
    one[9] = 3.0;
    assert_eq!(dot_f16(&bits(&one), &vec![2.0; 64]), 6.0);
}

#[test]
fn dot_f16_lanes_match_the_portable_order() {
    let a: Vec<f32> = (0..128).map(|i| f16r((i as f32 * 0.731).sin())).collect();
    let b: Vec<f32> = (0..128).map(|i| f16r((i as f32 * 0.377).cos())).collect();
    let mut acc = [[0f32; 8]; 4];
    for i in (0..128).step_by(32) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (l, s) in accj.iter_mut().enumerate() {
                *s = a[i + 8 * j + l].mul_add(b[i + 8 * j + l], *s);
            }
        }
    }
    let x: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let t: [f32; 4] = std::array::from_fn(|l| x[l] + x[l + 4]);
    assert_eq!(dot_f16(&bits(&a), &b), (t[0] + t[1]) + (t[2] + t[3]));
}

#[test]
fn dot4_sums_each_row_as_dot_alone() {
    let b: Vec<f32> = (0..128).map(|i| f16r((i as f32 * 0.377).cos())).collect();
    let rows: Vec<Vec<u16>> = (0..4)
        .map(|r| {
            let a: Vec<f32> = (0..128)
                .map(|i| f16r((i as f32 * 0.731 + r as f32).sin() * 3.0))
                .collect();
            bits(&a)
        })
        .collect();
    let Some(four) = f16_lanes::dot4(std::array::from_fn(|r| &rows[r][..]), &b) else {
        return; // the portable build has no four-key step (`attend_group` takes one key)
    };
    for (r, d) in four.into_iter().enumerate() {
        assert_eq!(d.to_bits(), dot_f16(&rows[r], &b).to_bits(), "row {r}");
    }
    // Lengths it does not take: one key at a time instead.
    assert!(f16_lanes::dot4(std::array::from_fn(|r| &rows[r][..96]), &b[..96]).is_some());
    assert!(f16_lanes::dot4(std::array::from_fn(|r| &rows[r][..80]), &b[..80]).is_none());
}

/// llama.cpp's loop as written: one key at a time through score, softmax step and
/// value update (scalar, `f16r` after every update).
fn attend_stepwise(q: &[f32], kc: &[f32], vc: &[f32], scale: f32) -> Vec<f32> {
    let hd = q.len();
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    let mut o = vec![0f32; hd];
    for (k, v) in kc.chunks_exact(hd).zip(vc.chunks_exact(hd)) {
        let s = dot_f16(&bits(k), q) * scale + 0.0;
        let (mut ms, mut vs) = (1f32, 1f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            o.iter_mut().for_each(|x| *x = f16r(*x * ms));
        } else {
            vs = (s - m).exp();
        }
        for (x, v) in o.iter_mut().zip(v) {
            *x = f16r(v.mul_add(vs, *x));
        }
        sum = sum * ms + vs;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    o.iter().map(|x| x * inv).collect()
}

#[test]
fn attend_group_equals_the_stepwise_loop_bit_for_bit() {
    // Head sizes with and without a 64-lane remainder; keys whose scores rise now and
    // then (rescales mid-sequence) and repeat (equal scores).
    for (hd, n) in [(64, 1), (64, 37), (128, 300), (80, 19), (96, 64), (32, 9)] {
        let kc: Vec<f32> = (0..n * hd)
            .map(|i| f16r(((i * 7919) % 97) as f32 / 40.0 - 1.2 + (i / hd % 7) as f32 * 0.1))
            .collect();
        let vc = cache_values(n * hd, 104_729, 89, 0);
        let q: Vec<f32> = (0..hd)
            .map(|i| f16r((i as f32 * 0.37).sin() * 2.0))
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        // Three query heads over the same keys (a grouped-query group), as the second
        // head alone would see them.
        let q3: Vec<f32> = [q.clone(), q.iter().map(|x| -x).collect(), q.clone()].concat();
        let mut o = vec![f32::NAN; 3 * hd];
        attend_group(
            &q3,
            hd,
            n,
            |j| j * hd,
            &bits(&kc),
            &bits(&vc),
            scale,
            &mut o,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (h, oh) in o.chunks_exact(hd).enumerate() {
            let want = attend_stepwise(&q3[h * hd..(h + 1) * hd], &kc, &vc, scale);
            assert_eq!(bits(oh), bits(&want), "hd {hd}, n {n}, head {h}");
        }
    }
}

#[test]
fn attend_group_is_the_softmax_average_up_to_f16() {
    let (hd, n) = (64, 37);
    let kc = cache_values(n * hd, 7919, 97, 0);
    let vc = cache_values(n * hd, 104_729, 89, 0);
    let q: Vec<f32> = (0..hd).map(|i| f16r((i as f32 * 0.37).sin())).collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut o = vec![0f32; hd];
    attend_group(&q, hd, n, |j| j * hd, &bits(&kc), &bits(&vc), scale, &mut o);
    let s: Vec<f64> = (0..n)
        .map(|j| {
            let k = &kc[j * hd..(j + 1) * hd];
            k.iter().zip(&q).map(|(a, b)| f64::from(a * b)).sum::<f64>() * f64::from(scale)
        })
        .collect();
    let m = s.iter().cloned().fold(f64::MIN, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = w.iter().sum();
    for d in 0..hd {
        let want: f64 = (0..n)
            .map(|j| w[j] * f64::from(vc[j * hd + d]))
            .sum::<f64>()
            / z;
        assert!(
            (f64::from(o[d]) - want).abs() < 2e-3,
            "dim {d}: {} vs {want}",
            o[d]
        );
    }
}

#[test]
fn rope_styles_rotate_pairs() {
    let t = RopeTable::new(4, 10_000.0, 4, RopeStyle::HalfSplit);
    let mut x = [1.0, 0.0, 0.0, 0.0];
    t.apply(&mut x, 1);
    assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
    let t = RopeTable::new(4, 10_000.0, 4, RopeStyle::Interleaved);
    let mut x = [1.0, 0.0, 0.0, 0.0];
    t.apply(&mut x, 1);
    assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
}

/// f16-exact values as the cache holds them.
fn bits(x: &[f32]) -> Vec<u16> {
    let b: Vec<u16> = x
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .collect();
    assert!(
        b.iter().zip(x).all(|(b, x)| from_bits(*b) == *x),
        "not f16-exact"
    );
    b
}

/// `len` f16-exact cached values in -0.5..0.5: `(i + offset) * mul % modulus`, scaled.
fn cache_values(len: usize, mul: usize, modulus: usize, offset: usize) -> Vec<f32> {
    (0..len)
        .map(|i| f16r((((i + offset) * mul) % modulus) as f32 / modulus as f32 - 0.5))
        .collect()
}

#[test]
#[ignore]
fn attend_speed() {
    // The 1.5B at 1k context: 28 layers' caches of two KV heads (57 MB, past L3), six
    // query heads a group; the 0.5B batch-decoding: 24 layers at 256 context, seven.
    for (hd, n, layers, kv_heads, group) in [(128, 1024, 28, 2, 6), (64, 256, 24, 2, 7)] {
        let row = kv_heads * hd;
        let kc: Vec<Vec<u16>> = (0..layers)
            .map(|l| bits(&cache_values(n * row, 7919, 97, l)))
            .collect();
        let vc: Vec<Vec<u16>> = (0..layers)
            .map(|l| bits(&cache_values(n * row, 104_729, 89, l)))
            .collect();
        let q: Vec<f32> = (0..hd).map(|i| f16r((i as f32 * 0.37).sin())).collect();
        let qg = q.repeat(group);
        let mut o = vec![0f32; group * hd];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            for (kc, vc) in kc.iter().zip(&vc) {
                for kvh in 0..kv_heads {
                    attend_group(&qg, hd, n, |j| j * row + kvh * hd, kc, vc, 0.088, &mut o);
                }
            }
            let visits = (layers * kv_heads * group * n) as f64;
            println!(
                "attend hd {hd} n {n}: {:.1} ns per (head, key)",
                t.elapsed().as_nanos() as f64 / visits
            );
        }
    }
}
