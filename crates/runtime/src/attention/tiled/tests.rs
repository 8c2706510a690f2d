use super::*;

/// f16-exact cached values, `(i * mul) % modulus` scaled into -0.5..0.5, as f16 bits.
fn cache(len: usize, mul: usize, modulus: usize) -> Vec<u16> {
    (0..len)
        .map(|i| {
            let x = ((i * mul) % modulus) as f32 / modulus as f32 - 0.5;
            half::f16::from_f32(x).to_bits()
        })
        .collect()
}

fn f32_of(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// llama.cpp's tiled loop for one query row at `pos`, written out step by step: per tile of
/// 64 keys, scores as one fused multiply-add chain each, the online softmax, and each value
/// lane's chain over all 64 keys of the tile (zero weight and zero value past the last key).
fn reference_row(q: &[f32], pos: usize, kc: &[u16], vc: &[u16], scale: f32) -> Vec<f32> {
    let hd = q.len();
    let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
    let mut acc = vec![0f32; hd];
    for start in (0..=pos).step_by(64) {
        let mut w: Vec<f32> = (0..64)
            .map(|tk| {
                let j = start + tk;
                if j > pos {
                    return f32::NEG_INFINITY;
                }
                let k = &kc[j * hd..(j + 1) * hd];
                let dot = (0..hd).fold(0f32, |a, d| q[d].mul_add(f32_of(k[d]), a));
                dot * scale
            })
            .collect();
        let tile_max = w.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let new = m.max(tile_max);
        if new > m {
            let ms = (m - new).exp();
            acc.iter_mut().for_each(|a| *a *= ms);
            s *= ms;
        }
        m = new;
        let mut sum = 0f64;
        for v in w.chunks_exact_mut(8) {
            v.iter_mut()
                .for_each(|x| *x = crate::ggml_ops::v_expf(*x - new));
            let t: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
            sum += f64::from((t[0] + t[2]) + (t[1] + t[3]));
        }
        s = (f64::from(s) + sum) as f32;
        for (d, a) in acc.iter_mut().enumerate() {
            for (tk, &wk) in w.iter().enumerate() {
                let j = start + tk;
                let v = if j <= pos {
                    f32_of(vc[j * hd + d])
                } else {
                    0.0
                };
                *a = wk.mul_add(v, *a);
            }
        }
    }
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    acc.iter().map(|a| a * inv).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gemm_lanes_equal_one_chain_per_output() {
    for (m, kd, n) in [
        (7, 64, 64),
        (13, 5, 72),
        (6, 3, 13),
        (1, 128, 8),
        (12, 64, 128),
    ] {
        let a: Vec<f32> = (0..m * kd)
            .map(|i| ((i * 37) % 23) as f32 / 7.0 - 1.3)
            .collect();
        let b: Vec<f32> = (0..kd * n)
            .map(|i| ((i * 91) % 31) as f32 / 11.0 - 1.1)
            .collect();
        let c0: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 * 0.25).collect();
        let mut c = c0.clone();
        gemm(&mut c, &a, &b, m, kd, n);
        let want: Vec<f32> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                (0..kd).fold(c0[e], |acc, x| a[i * kd + x].mul_add(b[x * n + j], acc))
            })
            .collect();
        assert_eq!(bits(&c), bits(&want), "{m}x{kd}x{n}");
    }
}

#[test]
fn soft_max_sums_eights_in_ggml_order() {
    let row: Vec<f32> = (0..64).map(|i| ((i * 13) % 29) as f32 * -0.7).collect();
    let mut got = row.clone();
    let sum = soft_max(&mut got, 0.5);
    let mut want = 0f64;
    for (v, g) in row.chunks_exact(8).zip(got.chunks_exact(8)) {
        let e: Vec<f32> = v.iter().map(|x| crate::ggml_ops::v_expf(x - 0.5)).collect();
        assert_eq!(bits(g), bits(&e));
        let t: [f32; 4] = std::array::from_fn(|l| e[l] + e[l + 4]);
        want += f64::from((t[0] + t[2]) + (t[1] + t[3]));
    }
    assert_eq!(sum.to_bits(), want.to_bits());
    // ggml's range handling (underflow, overflow, the scaled paths past |n| > 126), lane
    // for lane.
    let mut wide = vec![-200.0, -103.0, -87.5, -0.0, 10.0, 88.0, 88.9, 100.0];
    let lanes = wide.clone();
    soft_max(&mut wide, 0.0);
    let each: Vec<f32> = lanes.iter().map(|x| crate::ggml_ops::v_expf(*x)).collect();
    assert_eq!(bits(&wide), bits(&each));
    // Masked keys weigh nothing.
    let mut masked = vec![f32::NEG_INFINITY; 8];
    masked[3] = 0.0;
    assert_eq!(soft_max(&mut masked, 0.0), 1.0);
    assert_eq!(masked.iter().filter(|x| **x == 0.0).count(), 7);
}

#[test]
fn attend_tile_equals_llama_cpp_loop_row_by_row() {
    // Head sizes 64 and 128 and one off the vector width; tiles that start at, inside and
    // past key tile boundaries; two query heads per KV head, the cache paged backwards.
    for (hd, first_pos, rows) in [(64, 0, 64), (128, 37, 64), (64, 100, 30), (72, 5, 70)] {
        let n = first_pos + rows;
        let (kc, vc) = (cache(n * hd, 7919, 97), cache(n * hd, 104_729, 89));
        // Key j lives in slot n - 1 - j of the paged copies.
        let paged = |c: &[u16]| -> Vec<u16> {
            (0..n)
                .rev()
                .flat_map(|j| c[j * hd..(j + 1) * hd].to_vec())
                .collect()
        };
        let (kp, vp) = (paged(&kc), paged(&vc));
        let q: Vec<f32> = (0..rows * 2 * hd)
            .map(|i| ((i as f32) * 0.37).sin() * 2.0)
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![f32::NAN; rows * 2 * hd];
        attend_tile(
            rows,
            first_pos,
            2,
            hd,
            |t, h| &q[(t * 2 + h) * hd..][..hd],
            |j| (n - 1 - j) * hd,
            &kp,
            &vp,
            scale,
            |t, h, o| out[(t * 2 + h) * hd..][..hd].copy_from_slice(o),
        );
        for t in 0..rows {
            for h in 0..2 {
                let at = (t * 2 + h) * hd;
                let want = reference_row(&q[at..at + hd], first_pos + t, &kc, &vc, scale);
                assert_eq!(
                    bits(&out[at..at + hd]),
                    bits(&want),
                    "hd {hd}, first {first_pos}, row {t}, head {h}"
                );
            }
        }
    }
}

#[test]
fn attend_tile_is_the_softmax_average() {
    let (hd, rows) = (64, 70);
    let (kc, vc) = (cache(rows * hd, 7919, 97), cache(rows * hd, 104_729, 89));
    let q: Vec<f32> = (0..rows * hd).map(|i| ((i as f32) * 0.11).cos()).collect();
    let scale = 0.125;
    let mut out = vec![0f32; rows * hd];
    attend_tile(
        rows,
        0,
        1,
        hd,
        |t, _| &q[t * hd..][..hd],
        |j| j * hd,
        &kc,
        &vc,
        scale,
        |t, _, o| out[t * hd..][..hd].copy_from_slice(o),
    );
    for t in [0, 1, 63, 64, 69] {
        let qt = &q[t * hd..(t + 1) * hd];
        let s: Vec<f64> = (0..=t)
            .map(|j| {
                let k = &kc[j * hd..(j + 1) * hd];
                let dot: f64 = (0..hd).map(|d| f64::from(qt[d] * f32_of(k[d]))).sum();
                dot * f64::from(scale)
            })
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for d in 0..hd {
            let want: f64 = (0..=t)
                .map(|j| w[j] * f64::from(f32_of(vc[j * hd + d])))
                .sum::<f64>()
                / z;
            assert!(
                (f64::from(out[t * hd + d]) - want).abs() < 1e-5,
                "row {t} dim {d}"
            );
        }
    }
}

#[test]
#[ignore]
fn tile_speed() {
    // One 512-token prompt's attention for one layer of the 0.5B (2 KV heads of 7 query
    // heads, head size 64), the work of prefill.
    let (hd, n, g) = (64, 512, 7);
    let (kc, vc) = (cache(n * hd, 7919, 97), cache(n * hd, 104_729, 89));
    let q: Vec<f32> = (0..n * g * hd).map(|i| ((i as f32) * 0.37).sin()).collect();
    let mut out = vec![0f32; n * g * hd];
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for _kv_head in 0..2 {
            for tile in 0..n / Q_TILE {
                let first = tile * Q_TILE;
                attend_tile(
                    Q_TILE,
                    first,
                    g,
                    hd,
                    |t, h| &q[((first + t) * g + h) * hd..][..hd],
                    |j| j * hd,
                    &kc,
                    &vc,
                    0.125,
                    |t, h, o| out[((first + t) * g + h) * hd..][..hd].copy_from_slice(o),
                );
            }
        }
        let visits = (2 * g * n * (n + 1) / 2) as f64;
        println!(
            "tiled hd {hd} n {n}: {:.2} ns/head-key",
            t.elapsed().as_nanos() as f64 / visits
        );
    }
}
