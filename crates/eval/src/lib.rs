//! `tokenrouter eval`: does routing pay, and at which threshold? Runs a dataset (HumanEval,
//! or its single-line infilling tasks, scored by execution, or the user's JSONL) against any OpenAI-compatible server as
//! several variants — the small model alone, the large model alone, token-level routing at
//! each point of a threshold sweep (tokenrouter's per-request `routing` knob), random
//! routing at the same LLM shares — and derives the request-level baselines from the
//! per-problem results. Writes `summary.json`, `problems.jsonl`, `request_level.json`,
//! `tokens.csv` and `pareto.svg`, prints the table, and picks the threshold a target calls
//! for.

pub mod calibrate;
pub mod client;
pub mod dataset;
pub mod exec;
pub mod plot;
pub mod report;
pub mod run;
pub mod score;
pub mod settings;
pub mod stats;
pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

use calibrate::Target;
use client::Client;
use dataset::DatasetSpec;
use report::VariantSummary;
use run::{Role, RunContext, Variant, VariantRun};
use tokens::TokenStats;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("dataset: {0}")]
    Dataset(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid argument: {0}")]
    Args(String),
    #[error("server: {0}")]
    Server(String),
    #[error("{0}")]
    Other(String),
}

impl EvalError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        EvalError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The stop string HumanEval answers end at (the closing fence of the code block).
pub const HUMANEVAL_STOP: &str = "\n```\n";

#[derive(Parser, Debug, Clone)]
#[command(about = "Evaluate routing quality against an OpenAI-compatible server")]
pub struct EvalArgs {
    /// Server root (with or without /v1).
    #[arg(long, default_value = "http://127.0.0.1:30000")]
    pub url: String,
    /// `humaneval`, `humaneval-infill` (each line of each solution filled in the middle, via
    /// `/v1/completions` with `suffix`) or a JSONL file (prompt|messages, answer, scorer:
    /// exact|boxed|test).
    #[arg(long, default_value = "humaneval")]
    pub dataset: String,
    /// Model name of the routed variant (default: the server's routed model, else its first).
    #[arg(long)]
    pub model: Option<String>,
    /// The small model's name (default: the first non-routed id of /v1/models).
    #[arg(long)]
    pub small: Option<String>,
    /// The large model's name (default: the second non-routed id of /v1/models).
    #[arg(long)]
    pub large: Option<String>,
    /// A threshold sweep through the per-request routing knob: `threshold=0.05,0.1,0.2`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// A server running the `random` method: random routing at each measured LLM share.
    #[arg(long)]
    pub random_url: Option<String>,
    /// The LLM shares to run random routing at (default: the share each routed variant of
    /// this run measured). For controls matched to routed points of an earlier run.
    #[arg(long, value_delimiter = ',')]
    pub random_shares: Option<Vec<f64>>,
    /// Model name on the random server (default: as `--model`).
    #[arg(long)]
    pub random_model: Option<String>,
    /// Variants to run (comma list of small, large, routed, random; default: all possible).
    #[arg(long, value_delimiter = ',')]
    pub variants: Option<Vec<String>>,
    /// Requests in flight (closed loop).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling top_p (default: the server's, 1); human-eval's pass@k runs used 0.95.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Keep the server's prefix cache between variants. By default it is emptied before each
    /// (`/flush_cache`, or vLLM's `/reset_prefix_cache`), so a variant's wall time never
    /// includes prompts an earlier variant computed.
    #[arg(long)]
    pub keep_prefix_cache: bool,
    /// Answers a problem (human-eval's `num_samples_per_task`); more than one needs
    /// `--temperature` > 0. Each has its own seed; a later run with more adds only the new.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Base of every request's seed (a problem's samples and problems get seeds derived
    /// from it): another value draws other samples. 0 keeps the seeds runs always had.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The k of pass@k to report (those up to `--samples`).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pub pass_at: Vec<usize>,
    /// Stop strings (default for HumanEval: the closing code fence; none otherwise).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Only the first K problems.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Results, summary, plot; re-running with the same directory resumes.
    #[arg(long)]
    pub out_dir: PathBuf,
    /// Parameters per model for average parameters per token: `quick=0.49e9,reference=1.54e9`.
    #[arg(long, value_delimiter = ',')]
    pub params: Vec<String>,
    /// Pick a threshold from the sweep: `pass>=0.9*large`, `pass>=0.6` or `share<=0.2`.
    #[arg(long)]
    pub target: Option<String>,
    /// Per-problem test timeout (seconds).
    #[arg(long, default_value_t = 10.0)]
    pub timeout: f64,
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
    /// Tokens of the small model's answer the difficulty score reads.
    #[arg(long, default_value_t = 16)]
    pub difficulty_tokens: usize,
    /// Dataset cache (default: $TOKENROUTER_CACHE or ~/.cache/tokenrouter).
    #[arg(long, env = "TOKENROUTER_CACHE")]
    pub cache_dir: Option<PathBuf>,
    #[arg(long, env = "TOKENROUTER_API_KEY")]
    pub api_key: Option<String>,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = 1800)]
    pub request_timeout: u64,
    #[arg(long)]
    pub no_progress: bool,
}

/// What the run produced (also written to `out_dir`).
pub struct EvalOutcome {
    pub summaries: Vec<VariantSummary>,
    pub table: String,
    pub calibration: Option<String>,
}

fn parse_sweep(s: &str) -> Result<(String, Vec<f64>), EvalError> {
    let (key, values) = s
        .split_once('=')
        .ok_or_else(|| EvalError::Args(format!("--sweep {s}: expected KEY=v1,v2,...")))?;
    let values = values
        .split(',')
        .map(|v| {
            v.trim()
                .parse::<f64>()
                .map_err(|_| EvalError::Args(format!("--sweep {s}: `{v}` is not a number")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if key.trim().is_empty() || values.is_empty() {
        return Err(EvalError::Args(format!(
            "--sweep {s}: expected KEY=v1,v2,..."
        )));
    }
    Ok((key.trim().to_string(), values))
}

fn parse_params(list: &[String]) -> Result<BTreeMap<String, f64>, EvalError> {
    list.iter()
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| EvalError::Args(format!("--params {p}: expected NAME=COUNT")))?;
            let v: f64 = v
                .trim()
                .parse()
                .map_err(|_| EvalError::Args(format!("--params {p}: `{v}` is not a number")))?;
            Ok((k.trim().to_string(), v))
        })
        .collect()
}

/// Run the evaluation described by `args`.
pub async fn run(args: EvalArgs) -> Result<EvalOutcome, EvalError> {
    let started = Instant::now();
    settings::check_sampling(&args)?;
    let sweep = args.sweep.as_deref().map(parse_sweep).transpose()?;
    let params = parse_params(&args.params)?;
    let target = args
        .target
        .as_deref()
        .map(Target::parse)
        .transpose()
        .map_err(EvalError::Args)?;
    let wanted = |v: &str| {
        args.variants
            .as_ref()
            .is_none_or(|l| l.iter().any(|x| x == v))
    };
    let spec = DatasetSpec::parse(&args.dataset);
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(tokenrouter_fetch::default_cache_dir);
    let mut problems = spec.load(&cache)?;
    if let Some(k) = args.limit {
        problems.truncate(k);
    }
    std::fs::create_dir_all(&args.out_dir).map_err(|e| EvalError::io(&args.out_dir, e))?;
    let client = Client::new(
        Duration::from_secs(args.request_timeout),
        args.api_key.clone(),
    )
    .map_err(EvalError::Server)?;
    let ids = client.models(&args.url).await.map_err(EvalError::Server)?;
    let routed_name = args.model.clone().or_else(|| {
        ids.iter()
            .find(|(_, r)| *r == Some(true))
            .or(ids.first())
            .map(|(id, _)| id.clone())
    });
    let pinned: Vec<&String> = ids
        .iter()
        .filter(|(_, r)| *r == Some(false))
        .map(|(id, _)| id)
        .collect();
    let small = args
        .small
        .clone()
        .or_else(|| pinned.first().map(|s| s.to_string()));
    let large = args
        .large
        .clone()
        .or_else(|| pinned.get(1).map(|s| s.to_string()));

    let mut variants = Vec::new();
    if let (true, Some(m)) = (wanted("small"), &small) {
        variants.push(pinned_variant("small", Role::Small, &args.url, m));
    }
    if let (true, Some(m)) = (wanted("large"), &large) {
        variants.push(pinned_variant("large", Role::Large, &args.url, m));
    }
    if let (true, Some(m)) = (wanted("routed"), &routed_name) {
        match &sweep {
            None => variants.push(pinned_variant("routed", Role::Routed, &args.url, m)),
            Some((key, values)) => {
                for v in values {
                    variants.push(Variant {
                        name: format!("routed {key}={v}"),
                        role: Role::Routed,
                        url: args.url.clone(),
                        model: m.clone(),
                        routing: [(key.clone(), *v)].into(),
                    });
                }
            }
        }
    }
    let random_planned = wanted("random") && args.random_url.is_some();
    if variants.is_empty() && !random_planned {
        return Err(EvalError::Args("nothing to run: no variant applies".into()));
    }
    let ctx = RunContext {
        client,
        out_dir: args.out_dir.clone(),
        concurrency: args.concurrency,
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        samples: args.samples,
        seed: args.seed,
        flush_prefix_cache: !args.keep_prefix_cache,
        stop: if !args.stop.is_empty() {
            args.stop.clone()
        } else if spec == DatasetSpec::HumanEval {
            vec![HUMANEVAL_STOP.to_string()]
        } else if spec == DatasetSpec::HumanEvalInfill {
            // One line is missing: the answer ends with it.
            vec!["\n".to_string()]
        } else {
            Vec::new()
        },
        limits: exec::ExecLimits {
            python: args.python.clone(),
            timeout: Duration::from_secs_f64(args.timeout.max(0.1)),
            ..exec::ExecLimits::default()
        },
        difficulty_tokens: args.difficulty_tokens,
        progress: !args.no_progress,
        exec_slots: Arc::new(tokio::sync::Semaphore::new(2)),
    };
    settings::check_or_record(
        &args.out_dir,
        &settings::GenerationSettings {
            dataset: args.dataset.clone(),
            max_tokens: ctx.max_tokens,
            temperature: ctx.temperature,
            top_p: ctx.top_p,
            stop: ctx.stop.clone(),
            seed: ctx.seed,
        },
    )?;
    eprintln!(
        "evaluating {} problems{} x {} variants against {} (small {:?}, large {:?}, routed {:?})",
        problems.len(),
        match args.samples {
            1 => String::new(),
            k => format!(" x {k} samples"),
        },
        variants.len(),
        args.url,
        small,
        large,
        routed_name
    );
    let mut log = RunLog {
        runs: Vec::new(),
        summaries: Vec::new(),
        large: large.clone(),
        params,
        pass_at: args.pass_at.clone(),
        out_dir: args.out_dir.clone(),
    };
    for v in variants {
        log.run(&ctx, v, &problems).await?;
    }
    if let (true, Some(url)) = (wanted("random"), &args.random_url) {
        let model = args
            .random_model
            .clone()
            .or_else(|| routed_name.clone())
            .ok_or_else(|| EvalError::Args("--random-model is needed".into()))?;
        for p in random_shares(args.random_shares.as_deref(), &log.summaries)? {
            let v = Variant {
                name: format!("random p={p}"),
                role: Role::Random,
                url: url.clone(),
                model: model.clone(),
                routing: [("p".to_string(), p)].into(),
            };
            log.run(&ctx, v, &problems).await?;
        }
    }
    // Infill answers are code without fences.
    let infill: BTreeSet<String> = problems
        .iter()
        .filter(|p| matches!(p.input, dataset::Input::Infill { .. }))
        .map(|p| p.id.clone())
        .collect();
    let outcome = finish(
        &args,
        &log.runs,
        log.summaries,
        target.as_ref(),
        &infill,
        started,
    )?;
    Ok(outcome)
}

/// Where random routing runs: the shares asked for, else each routed variant's measured
/// share (rounded to 0.1%, which is all a 164-problem run can tell apart).
fn random_shares(
    asked: Option<&[f64]>,
    summaries: &[VariantSummary],
) -> Result<Vec<f64>, EvalError> {
    if let Some(list) = asked {
        if let Some(bad) = list.iter().find(|p| !(0.0..=1.0).contains(*p)) {
            return Err(EvalError::Args(format!(
                "--random-shares: {bad} is not a share in [0, 1]"
            )));
        }
        return Ok(list.to_vec());
    }
    Ok(summaries
        .iter()
        .filter(|s| s.role == Role::Routed)
        .filter_map(|s| s.llm_share)
        .map(|s| (s * 1000.0).round() / 1000.0)
        .collect())
}

fn pinned_variant(name: &str, role: Role, url: &str, model: &str) -> Variant {
    Variant {
        name: name.to_string(),
        role,
        url: url.to_string(),
        model: model.to_string(),
        routing: BTreeMap::new(),
    }
}

/// The variants run so far, their summaries (rewritten to `summary.json` after each) and
/// what summarising needs.
struct RunLog {
    runs: Vec<(Variant, VariantRun)>,
    summaries: Vec<VariantSummary>,
    large: Option<String>,
    params: BTreeMap<String, f64>,
    pass_at: Vec<usize>,
    out_dir: PathBuf,
}

impl RunLog {
    /// Run one variant, record it, rewrite `summary.json`, print a one-line report.
    async fn run(
        &mut self,
        ctx: &RunContext,
        v: Variant,
        problems: &[dataset::Problem],
    ) -> Result<(), EvalError> {
        let r = run::run_variant(ctx, &v, problems).await?;
        for (id, e) in r.errors.iter().take(3) {
            eprintln!("  {}: request for {id} failed: {e}", v.name);
        }
        let s = report::summarise(&v, &r, self.large.as_deref(), &self.params, &self.pass_at);
        let more: String = s
            .pass_at_k
            .iter()
            .filter(|(&k, _)| k > 1)
            .map(|(k, p)| format!(", pass@{k} {:.1}%", 100.0 * p))
            .collect();
        eprintln!(
            "{}: pass@1 {:.1}% ({}/{}){more}, LLM share {}, {:.0} s, {:.1} tok/s{}",
            s.variant,
            100.0 * s.pass_at_1,
            s.passed,
            s.n,
            s.llm_share
                .map_or("unknown".into(), |x| format!("{:.1}%", 100.0 * x)),
            s.wall_s,
            s.output_tok_s,
            if s.errors > 0 {
                format!(", {} failed requests", s.errors)
            } else {
                String::new()
            }
        );
        self.summaries.push(s);
        report::relate_to_large(&mut self.summaries);
        write_json(&self.out_dir.join("summary.json"), &self.summaries)?;
        self.runs.push((v, r));
        Ok(())
    }
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), EvalError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| EvalError::Other(e.to_string()))?;
    run::write_atomic(path, &bytes)
}

fn finish(
    args: &EvalArgs,
    runs: &[(Variant, VariantRun)],
    summaries: Vec<VariantSummary>,
    target: Option<&Target>,
    infill: &BTreeSet<String>,
    started: Instant,
) -> Result<EvalOutcome, EvalError> {
    let out = &args.out_dir;
    let mut lines = Vec::new();
    for (_, r) in runs {
        for p in &r.results {
            lines.push(serde_json::to_string(p).map_err(|e| EvalError::Other(e.to_string()))?);
        }
    }
    run::write_atomic(
        &out.join("problems.jsonl"),
        (lines.join("\n") + "\n").as_bytes(),
    )?;
    let find = |role: Role| {
        runs.iter()
            .find(|(v, _)| v.role == role)
            .map(|(_, r)| &r.results)
    };
    let rl = match (find(Role::Small), find(Role::Large)) {
        (Some(s), Some(l)) => report::request_level_from(s, l),
        _ => None,
    };
    if let Some(rl) = &rl {
        write_json(&out.join("request_level.json"), rl)?;
    }
    let large_name = summaries
        .iter()
        .find(|s| s.role == Role::Large)
        .map(|s| s.model.clone());
    let stats: Vec<(String, TokenStats)> = runs
        .iter()
        .filter(|(v, _)| matches!(v.role, Role::Routed | Role::Random))
        .map(|(v, r)| {
            let mut st = TokenStats::default();
            for p in &r.results {
                st.add_answer(
                    &p.answer.tokens,
                    &|m| large_name.as_deref() == Some(m),
                    infill.contains(&p.task_id),
                );
            }
            (v.name.clone(), st)
        })
        .collect();
    let (csv, digest) = report::token_report(&stats, 15);
    run::write_atomic(&out.join("tokens.csv"), csv.as_bytes())?;
    let title = match DatasetSpec::parse(&args.dataset) {
        DatasetSpec::HumanEval => "HumanEval".to_string(),
        DatasetSpec::HumanEvalInfill => "HumanEval single-line infilling".to_string(),
        DatasetSpec::File(p) => p
            .file_name()
            .map_or("dataset".into(), |f| f.to_string_lossy().into_owned()),
    };
    plot::pareto_svg(&out.join("pareto.svg"), &summaries, rl.as_ref(), &title)?;
    let mut table = report::table(&summaries, rl.as_ref());
    table.push_str(&digest);
    let calibration = target.map(|t| match calibrate::calibrate(&summaries, t) {
        Ok(pick) => {
            let kwargs: Vec<String> = pick
                .routing
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect();
            format!(
                "target {}: {} (pass@1 {:.1}%, LLM share {:.1}%) -> scheduler_kwargs: {{{}}}",
                args.target.as_deref().unwrap_or(""),
                pick.variant,
                100.0 * pick.pass_at_1,
                100.0 * pick.llm_share.unwrap_or(0.0),
                kwargs.join(", ")
            )
        }
        Err(e) => format!("target {}: {e}", args.target.as_deref().unwrap_or("")),
    });
    let _ = writeln_time(&mut table, started);
    Ok(EvalOutcome {
        summaries,
        table,
        calibration,
    })
}

fn writeln_time(s: &mut String, started: Instant) -> std::fmt::Result {
    use std::fmt::Write as _;
    writeln!(
        s,
        "\neval wall time: {:.0} s",
        started.elapsed().as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_and_params_parse() {
        assert_eq!(
            parse_sweep("threshold=0.05, 0.1").unwrap(),
            ("threshold".into(), vec![0.05, 0.1])
        );
        assert!(parse_sweep("threshold").is_err());
        assert!(parse_sweep("threshold=a").is_err());
        let p = parse_params(&["quick=0.5e9".into(), "reference=1.5e9".into()]).unwrap();
        assert_eq!(p["reference"], 1.5e9);
        assert!(parse_params(&["quick".into()]).is_err());
    }

    #[test]
    fn random_shares_default_to_the_routed_points_or_take_the_list() {
        let both = [
            report::test_row("small", Role::Small, 0.5, 0.0),
            report::test_row("routed threshold=0.05", Role::Routed, 0.6, 0.08712),
        ];
        assert_eq!(random_shares(None, &both).unwrap(), vec![0.087]);
        assert_eq!(
            random_shares(Some(&[0.131, 0.002]), &both).unwrap(),
            vec![0.131, 0.002]
        );
        let e = random_shares(Some(&[1.5]), &both).unwrap_err();
        assert!(e.to_string().contains("--random-shares"), "{e}");
    }
}
