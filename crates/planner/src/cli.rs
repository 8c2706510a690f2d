//! Command-line front end (`tokenrouter plan-batching`), flag-compatible with TokenRouter's
//! `calculate_delayed_batching.py` (`--M --N --latencies --P --C --delta`), plus `--max-concurrency`
//! which prints the thresholds for N = 1..K as YAML ready to paste under `model:` in the config.
//!
//! The text output is itself valid YAML: the human-readable table is made of `#` comment lines.

use std::fmt::Write as _;

use clap::Parser;
use serde::Serialize;

use crate::input::{Latency, PlanError, PlanInput, Result};
use crate::optimize::{optimize_pinned, optimize_up_to_pinned, throughput, Plan};
use crate::sim::simulate;

/// Flags of `plan-batching`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "plan-batching",
    about = "Delayed-batching thresholds from the discrete-time Markov model of token routing"
)]
pub struct PlanArgs {
    /// Number of models M (defaults to the number of latencies given).
    #[arg(long = "M", value_name = "M")]
    pub models: Option<usize>,
    /// Concurrency N (requests in the closed loop).
    #[arg(long = "N", value_name = "N", default_value_t = 4)]
    pub concurrency: usize,
    /// Step latency of each model in ms, e.g. `--latencies 6.0 27.9`.
    #[arg(long, num_args = 1.., value_name = "MS")]
    pub latencies: Vec<f64>,
    /// Step latency by batch size, JSON list per model: `[[6.0,6.1,6.3],[27.9,28.3]]` (entry b-1 is
    /// the latency of a batch of b; the last entry extends to larger batches). Replaces --latencies.
    #[arg(long = "latency-table", value_name = "JSON")]
    pub latency_table: Option<String>,
    /// Routing matrix P as JSON; row m is where a request goes after a step at model m.
    #[arg(long = "P", value_name = "JSON")]
    pub routing: String,
    /// Credit matrix C as JSON: tokens credited when a request moves m→j (default: all ones).
    #[arg(long = "C", value_name = "JSON")]
    pub credits: Option<String>,
    /// Time quantum δ in ms.
    #[arg(long, default_value_t = 0.1, value_name = "MS")]
    pub delta: f64,
    /// Contention of models sharing one processor: with k models in a step each runs at
    /// 1/(1 + sharing·(k−1)) of its solo speed (0 = independent devices, 1 = processor sharing;
    /// the latencies are then solo latencies).
    #[arg(long, default_value_t = 0.0, value_name = "ALPHA")]
    pub sharing: f64,
    /// Plan every concurrency 1..=K and print per-model threshold lists as YAML.
    #[arg(long = "max-concurrency", value_name = "K")]
    pub max_concurrency: Option<usize>,
    /// Evaluate these thresholds (one per model) instead of searching.
    #[arg(long, num_args = 1.., value_name = "B")]
    pub thresholds: Vec<usize>,
    /// Keep a model's threshold fixed during the search: `--fix 0=1` or `--fix quick=1` (repeatable).
    #[arg(long = "fix", value_name = "MODEL=B")]
    pub fix: Vec<String>,
    /// Model names used in the YAML output (default model0, model1, ...).
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub names: Vec<String>,
    /// Also run a Monte-Carlo simulation of this many ticks as a cross-check.
    #[arg(long = "simulate-ticks", value_name = "TICKS")]
    pub simulate_ticks: Option<u64>,
    /// Print JSON instead of the table and YAML.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    models: &'a [String],
    delta_ms: f64,
    plans: &'a [Plan],
    #[serde(skip_serializing_if = "Option::is_none")]
    simulated_tokens_per_s: Option<Vec<f64>>,
}

fn parse_matrix(what: &'static str, text: &str) -> Result<Vec<Vec<f64>>> {
    serde_json::from_str(text).map_err(|source| PlanError::Json { what, source })
}

impl PlanArgs {
    /// Builds the model input (for `--N`) from the flags.
    pub fn to_input(&self) -> Result<PlanInput> {
        let routing = parse_matrix("--P", &self.routing)?;
        let latencies: Vec<Latency> = match &self.latency_table {
            Some(text) => {
                if !self.latencies.is_empty() {
                    return Err(PlanError::Argument(
                        "give either --latencies or --latency-table, not both".into(),
                    ));
                }
                parse_matrix("--latency-table", text)?
                    .into_iter()
                    .map(Latency::ByBatch)
                    .collect()
            }
            None => self
                .latencies
                .iter()
                .map(|&l| Latency::Constant(l))
                .collect(),
        };
        if latencies.is_empty() {
            return Err(PlanError::Argument(
                "--latencies or --latency-table is required".into(),
            ));
        }
        let m = self.models.unwrap_or(latencies.len());
        if latencies.len() != m {
            return Err(PlanError::Dimension {
                what: "latencies",
                got: latencies.len(),
                expected: m,
            });
        }
        let credits = match &self.credits {
            Some(text) => parse_matrix("--C", text)?,
            None => vec![vec![1.0; m]; m],
        };
        let input = PlanInput {
            latencies,
            routing,
            credits,
            delta_ms: self.delta,
            concurrency: self.concurrency,
            sharing: self.sharing,
        };
        input.validate()?;
        Ok(input)
    }

    fn model_names(&self, m: usize) -> Result<Vec<String>> {
        if self.names.is_empty() {
            return Ok((0..m).map(|i| format!("model{i}")).collect());
        }
        if self.names.len() != m {
            return Err(PlanError::Dimension {
                what: "--names",
                got: self.names.len(),
                expected: m,
            });
        }
        Ok(self.names.clone())
    }
}

impl PlanArgs {
    /// Pinned thresholds from `--fix`, by model index or name.
    fn pinned(&self, names: &[String]) -> Result<Vec<Option<usize>>> {
        let mut pinned = vec![None; names.len()];
        for spec in &self.fix {
            let (model, b) = spec
                .split_once('=')
                .ok_or_else(|| PlanError::Argument(format!("--fix {spec}: expected MODEL=B")))?;
            let idx = names
                .iter()
                .position(|n| n == model)
                .or_else(|| model.parse::<usize>().ok().filter(|&i| i < names.len()))
                .ok_or_else(|| PlanError::Argument(format!("--fix {spec}: unknown model")))?;
            let b = b
                .parse::<usize>()
                .ok()
                .filter(|&b| b >= 1)
                .ok_or_else(|| PlanError::Argument(format!("--fix {spec}: B must be ≥ 1")))?;
            pinned[idx] = Some(b);
        }
        Ok(pinned)
    }
}

/// Runs the planner for the flags and returns the text to print.
pub fn run(args: &PlanArgs) -> Result<String> {
    let input = args.to_input()?;
    let m = input.models();
    let names = args.model_names(m)?;
    let pinned = args.pinned(&names)?;
    if !args.thresholds.is_empty() && args.max_concurrency.is_some() {
        return Err(PlanError::Argument(
            "--thresholds evaluates one concurrency; drop --max-concurrency".into(),
        ));
    }
    let plans: Vec<Plan> = if !args.thresholds.is_empty() {
        if args.thresholds.len() != m {
            return Err(PlanError::ThresholdCount {
                got: args.thresholds.len(),
                expected: m,
            });
        }
        vec![Plan {
            concurrency: input.concurrency,
            thresholds: args.thresholds.clone(),
            tokens_per_s: throughput(&input, &args.thresholds)?,
            baseline_tokens_per_s: throughput(&input, &vec![1; m])?,
        }]
    } else if let Some(k) = args.max_concurrency {
        if k == 0 {
            return Err(PlanError::Argument("--max-concurrency must be ≥ 1".into()));
        }
        optimize_up_to_pinned(&input, k, &pinned)?
    } else {
        vec![optimize_pinned(&input, &pinned)?]
    };
    let simulated = match args.simulate_ticks {
        Some(ticks) => Some(
            plans
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    simulate(
                        &input.with_concurrency(p.concurrency),
                        &p.thresholds,
                        ticks,
                        i as u64 + 1,
                    )
                })
                .collect::<Result<Vec<f64>>>()?,
        ),
        None => None,
    };
    if args.json {
        let report = Report {
            models: &names,
            delta_ms: input.delta_ms,
            plans: &plans,
            simulated_tokens_per_s: simulated,
        };
        let mut text = serde_json::to_string_pretty(&report).map_err(|source| PlanError::Json {
            what: "report",
            source,
        })?;
        text.push('\n');
        return Ok(text);
    }
    Ok(render_text(
        args,
        &input,
        &names,
        &plans,
        simulated.as_deref(),
    ))
}

fn list(values: &[usize]) -> String {
    let inner: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    format!("[{}]", inner.join(", "))
}

fn render_text(
    args: &PlanArgs,
    input: &PlanInput,
    names: &[String],
    plans: &[Plan],
    simulated: Option<&[f64]>,
) -> String {
    let lat: Vec<String> = input
        .latencies
        .iter()
        .map(|l| match l {
            Latency::Constant(v) => format!("{v} ms"),
            Latency::ByBatch(t) => {
                format!("{} ms (b=1) .. {} ms (b={})", t[0], t[t.len() - 1], t.len())
            }
        })
        .collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# delayed-batching plan: {} models ({}), latencies {}, delta {} ms",
        names.len(),
        names.join(", "),
        lat.join(" / "),
        input.delta_ms
    );
    let _ = writeln!(
        out,
        "# routing P = {:?}, credits C = {:?}",
        input.routing, input.credits
    );
    if input.sharing > 0.0 {
        let _ = writeln!(
            out,
            "# shared processor: sharing {} (k busy models each run at 1/(1 + {}·(k-1)))",
            input.sharing, input.sharing
        );
    }
    let mut header = format!(
        "# {:>4}  {:<20} {:>12} {:>12} {:>8}",
        "N", "thresholds", "tok/s", "tok/s (B=1)", "gain"
    );
    if simulated.is_some() {
        let _ = write!(header, " {:>12}", "simulated");
    }
    let _ = writeln!(out, "{header}");
    for (i, p) in plans.iter().enumerate() {
        let gain = (p.tokens_per_s / p.baseline_tokens_per_s - 1.0) * 100.0;
        let _ = write!(
            out,
            "# {:>4}  {:<20} {:>12.2} {:>12.2} {:>7.2}%",
            p.concurrency,
            list(&p.thresholds),
            p.tokens_per_s,
            p.baseline_tokens_per_s,
            gain
        );
        if let Some(sim) = simulated {
            let _ = write!(out, " {:>12.2}", sim[i]);
        }
        out.push('\n');
    }
    if args.max_concurrency.is_some() {
        let _ = writeln!(out, "# paste under `model:` in the server config");
        let _ = writeln!(out, "model:");
        for (m, name) in names.iter().enumerate() {
            let per_n: Vec<usize> = plans.iter().map(|p| p.thresholds[m]).collect();
            let _ = writeln!(out, "  {name}:");
            let _ = writeln!(out, "    delayed_batching_threshold: {}", list(&per_n));
        }
    } else if let Some(p) = plans.first() {
        let _ = writeln!(out, "thresholds: {}", list(&p.thresholds));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> PlanArgs {
        let mut argv = vec![
            "plan-batching",
            "--M",
            "2",
            "--N",
            "3",
            "--latencies",
            "6.0",
            "27.9",
            "--P",
            "[[0.65,0.35],[1,0]]",
            "--C",
            "[[1,0],[1,0]]",
            "--delta",
            "0.1",
        ];
        argv.extend_from_slice(extra);
        PlanArgs::parse_from(argv)
    }

    #[test]
    fn script_flags_build_the_input() {
        let input = parse(&[]).to_input().expect("input");
        assert_eq!(input.models(), 2);
        assert_eq!(input.concurrency, 3);
        assert_eq!(input.latencies[1], Latency::Constant(27.9));
        assert_eq!(input.routing[0], vec![0.65, 0.35]);
    }

    #[test]
    fn latency_table_replaces_latencies() {
        let args = PlanArgs::parse_from([
            "plan-batching",
            "--latency-table",
            "[[6.0,6.2],[27.9,28.3,28.9]]",
            "--P",
            "[[0.65,0.35],[1,0]]",
        ]);
        let input = args.to_input().expect("input");
        assert_eq!(input.latencies[1], Latency::ByBatch(vec![27.9, 28.3, 28.9]));
        assert_eq!(input.credits, vec![vec![1.0; 2]; 2]);
    }

    #[test]
    fn mismatched_model_count_is_an_error() {
        let mut args = parse(&[]);
        args.models = Some(3);
        assert!(matches!(args.to_input(), Err(PlanError::Dimension { .. })));
        let mut args = parse(&[]);
        args.routing = "[[0.65,0.35],[1,0".into();
        assert!(matches!(args.to_input(), Err(PlanError::Json { .. })));
    }

    #[test]
    fn fix_pins_a_model_by_name_or_index() {
        let text = run(&parse(&[
            "--names",
            "quick",
            "reference",
            "--fix",
            "quick=2",
        ]))
        .expect("run");
        assert!(text.contains("thresholds: [2, "), "{text}");
        let text = run(&parse(&["--fix", "1=1"])).expect("run");
        assert!(text.contains(", 1]\n"), "{text}");
        assert!(run(&parse(&["--fix", "llm=1"])).is_err());
        assert!(run(&parse(&["--fix", "1"])).is_err());
    }

    #[test]
    fn evaluating_given_thresholds_prints_them() {
        let text = run(&parse(&["--thresholds", "1", "2"])).expect("run");
        assert!(text.contains("thresholds: [1, 2]"), "{text}");
        let json = run(&parse(&["--thresholds", "1", "2", "--json"])).expect("run");
        let v: serde_json::Value = serde_json::from_str(&json).expect("json");
        assert_eq!(v["plans"][0]["thresholds"], serde_json::json!([1, 2]));
    }
}
