//! The host's sampled draw from a whole row (no top-k) without sorting it. OpenAI's
//! defaults (temperature 1, top-p 1) leave most of a ~150k vocabulary within the 30-nat
//! floor, and sorting those candidates by logit cost ~19 ms a token on the CPU (0.5B model:
//! decode at 29 tok/s sampled against 64 greedy). The kept set is the same as the sorted
//! walk's — the 30-nat floor, min-p against the best, top-p's smallest prefix of the
//! descending order (ties: lower id first) — found with one histogram of the candidates'
//! logits, sorting only the bucket where top-p's mass is crossed; the token is then drawn
//! from the kept weights in id order: the same distribution, other draws for a seed.

use super::fast_exp;

/// Histogram buckets over the 30 nats a candidate may trail the best by.
const BUCKETS: usize = 512;

/// A token drawn from `logits` at `temperature` (> 0) under `min_p` and `top_p`, by `u`
/// (uniform in [0, 1)). With no finite logit, the argmax.
pub fn draw(logits: &[f32], temperature: f32, min_p: f32, top_p: f32, u: f64) -> u32 {
    let (best, max) = super::argmax(logits);
    if !max.is_finite() {
        return best;
    }
    let weights = weigh(logits, best, max, temperature, min_p, top_p);
    // The kept weights' mass, then the walk in id order: block by block to the block
    // where it ends, then id by id.
    let blocks: Vec<f64> = weights.chunks(BLOCK).map(sum).collect();
    let mut r = u * blocks.iter().sum::<f64>();
    let mut last = best;
    for (b, (block, &mass)) in weights.chunks(BLOCK).zip(&blocks).enumerate() {
        if r - mass > 0.0 {
            r -= mass;
            if let Some(i) = block.iter().rposition(|&w| w > 0.0) {
                last = (b * BLOCK + i) as u32;
            }
            continue;
        }
        for (i, &w) in block.iter().enumerate() {
            if w > 0.0 {
                r -= w as f64;
                last = (b * BLOCK + i) as u32;
                if r <= 0.0 {
                    return last;
                }
            }
        }
    }
    last
}

/// Ids a block of the walk and of the sums.
const BLOCK: usize = 1024;

/// Each id's weight relative to the best (`best`, its logit `max`, finite), 0 where it
/// is not kept.
fn weigh(
    logits: &[f32],
    best: u32,
    max: f32,
    temperature: f32,
    min_p: f32,
    top_p: f32,
) -> Vec<f32> {
    let span = 30.0 * temperature;
    let floor = max - span;
    let inv_t = 1.0 / temperature;
    // 0 below the floor (and for NaN); computed for every id, then selected, so the loop
    // vectorises.
    let mut weights: Vec<f32> = logits
        .iter()
        .map(|&x| {
            let e = fast_exp((x - max) * inv_t);
            if x >= floor {
                e
            } else {
                0.0
            }
        })
        .collect();
    let total = sum(&weights);
    if min_p > 1.0 {
        // Nothing reaches min_p times the best but the best.
        weights.iter_mut().for_each(|w| *w = 0.0);
        weights[best as usize] = 1.0;
        return weights;
    }
    if min_p > 0.0 {
        // p_i >= min_p * p_best, the best's weight being 1.
        weights.iter_mut().for_each(|w| {
            if *w < min_p {
                *w = 0.0
            }
        });
    }
    if top_p < 1.0 {
        cut_to_top_p(logits, &mut weights, max, span, total * top_p as f64);
    }
    weights
}

/// Sum in f64 across blocks of f32 lanes (vectorised, accurate).
fn sum(values: &[f32]) -> f64 {
    values
        .chunks(BLOCK)
        .map(|block| {
            let mut lanes = [0f32; 8];
            let chunks = block.chunks_exact(8);
            let rest: f32 = chunks.remainder().iter().sum();
            for c in chunks {
                for i in 0..8 {
                    lanes[i] += c[i];
                }
            }
            lanes.iter().map(|&x| x as f64).sum::<f64>() + rest as f64
        })
        .sum()
}

/// Keeps the smallest prefix of the candidates in descending order (ties: lower id first)
/// whose weight reaches `target`, zeroing the others' weights; all of them when none does.
/// The prefix ends in one histogram bucket of logits: only that bucket is sorted.
fn cut_to_top_p(logits: &[f32], weights: &mut [f32], max: f32, span: f32, target: f64) {
    let scale = BUCKETS as f32 / span;
    // Each id's bucket, once (NaN and ids below the floor have weight 0 and are skipped).
    let buckets: Vec<u16> = logits
        .iter()
        .map(|&x| (((max - x) * scale) as u32).min(BUCKETS as u32 - 1) as u16)
        .collect();
    let mut mass = vec![0f64; BUCKETS];
    for (&b, &w) in buckets.iter().zip(weights.iter()) {
        if w > 0.0 {
            mass[b as usize] += w as f64;
        }
    }
    let mut before = 0.0;
    let Some(crossing) = mass.iter().position(|&m| {
        let reached = before + m >= target;
        if !reached {
            before += m;
        }
        reached
    }) else {
        return;
    };
    let crossing = crossing as u16;
    let mut inside: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| weights[i as usize] > 0.0 && buckets[i as usize] == crossing)
        .collect();
    inside.sort_by(|a, b| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    });
    let mut acc = before;
    let kept_inside = inside
        .iter()
        .position(|&i| {
            acc += weights[i as usize] as f64;
            acc >= target
        })
        .map_or(inside.len(), |at| at + 1);
    for &i in &inside[kept_inside..] {
        weights[i as usize] = 0.0;
    }
    for (&b, w) in buckets.iter().zip(weights.iter_mut()) {
        if b > crossing {
            *w = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// [`weigh`] of a row; `None` when no logit is finite.
    fn kept(l: &[f32], t: f32, min_p: f32, top_p: f32) -> Option<Vec<f32>> {
        let (best, max) = crate::sampling::argmax(l);
        max.is_finite()
            .then(|| weigh(l, best, max, t, min_p, top_p))
    }

    /// The sorted walk's kept ids: candidates within the floor in descending order (ties:
    /// lower id first), min-p against the best, top-p's smallest prefix of the whole
    /// candidates' mass.
    fn sorted_kept(l: &[f32], t: f32, min_p: f32, top_p: f32) -> Vec<u32> {
        let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut idx: Vec<u32> = (0..l.len() as u32)
            .filter(|&i| l[i as usize] >= max - 30.0 * t)
            .collect();
        idx.sort_by(|a, b| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b)));
        let p: Vec<f64> = idx
            .iter()
            .map(|&i| (((l[i as usize] - max) / t) as f64).exp())
            .collect();
        let total: f64 = p.iter().sum();
        let mut keep = p
            .iter()
            .take_while(|&&x| x >= min_p as f64 * p[0])
            .count()
            .max(1);
        if top_p < 1.0 {
            let mut acc = 0.0;
            let n = p[..keep]
                .iter()
                .position(|x| {
                    acc += x;
                    acc >= top_p as f64 * total
                })
                .map_or(keep, |at| at + 1);
            keep = n.max(1);
        }
        let mut kept = idx[..keep].to_vec();
        kept.sort_unstable();
        kept
    }

    fn ids(weights: &[f32]) -> Vec<u32> {
        (0..weights.len() as u32)
            .filter(|&i| weights[i as usize] > 0.0)
            .collect()
    }

    /// Rows of several shapes: flat, peaked, with ties (values on a coarse grid).
    fn row(rng: &mut rand::rngs::StdRng, n: usize, shape: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match shape {
                0 => rng.random_range(-3.0f32..3.0),
                1 => rng.random_range(-20.0f32..0.0) + if i % 97 == 0 { 15.0 } else { 0.0 },
                _ => (rng.random_range(0..12) as f32) * 0.5,
            })
            .collect()
    }

    #[test]
    fn the_kept_set_is_the_sorted_walks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let settings = [
            (1.0, 0.0, 1.0),
            (1.0, 0.0, 0.9),
            (0.7, 0.0, 0.95),
            (0.3, 0.0, 0.5),
            (1.0, 0.05, 1.0),
            (0.8, 0.1, 0.8),
            (2.0, 0.0, 0.01),
            (1.0, 1.5, 1.0),
        ];
        for case in 0..60 {
            let l = row(&mut rng, 5000, case % 3);
            for &(t, min_p, top_p) in &settings {
                let got = ids(&kept(&l, t, min_p, top_p).unwrap());
                let want = sorted_kept(&l, t, min_p, top_p);
                assert_eq!(got, want, "case {case} T {t} min_p {min_p} top_p {top_p}");
            }
        }
    }

    #[test]
    fn draws_follow_the_kept_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let l = row(&mut rng, 300, 1);
        let (t, top_p) = (0.8, 0.9);
        let w = kept(&l, t, 0.0, top_p).unwrap();
        let total = sum(&w);
        let n = 200_000;
        let mut counts = vec![0usize; l.len()];
        for k in 0..n {
            counts[draw(&l, t, 0.0, top_p, (k as f64 + 0.5) / n as f64) as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let expected = w[i] as f64 / total;
            assert!(
                (c as f64 / n as f64 - expected).abs() < 2.0 / n as f64 + 1e-9,
                "id {i}"
            );
        }
    }

    #[test]
    fn rows_without_a_finite_logit_give_the_argmax() {
        assert_eq!(draw(&[f32::NEG_INFINITY; 4], 1.0, 0.0, 1.0, 0.5), 0);
        let masked = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY];
        assert_eq!(draw(&masked, 1.0, 0.0, 0.5, 0.99), 1);
    }
}
