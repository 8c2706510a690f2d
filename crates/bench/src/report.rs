//! Aggregation of request records into a [`Summary`], the printed table (in the style of vLLM's
//! `bench serve`), and the output files.
//!
//! `requests.csv` has one row per request, in request order, with these columns:
//!
//! | column | meaning |
//! |---|---|
//! | `index` | position in the request list (0-based) |
//! | `prompt_index` | index of the prompt in the dataset |
//! | `repeat` | repetition of that prompt (0-based) |
//! | `start_ms` | send time, ms since the benchmark started |
//! | `success` | `true` when the stream ended with `[DONE]` after a 2xx status |
//! | `http_status` | HTTP status (empty when no response arrived) |
//! | `error` | why the request failed (empty on success) |
//! | `prompt_tokens` | from the usage chunk (empty when not reported) |
//! | `output_tokens` | `completion_tokens` of the usage chunk, else the number of content chunks |
//! | `usage_reported` | whether `output_tokens` came from the server's usage |
//! | `ttft_ms` | time to the first non-empty content |
//! | `tpot_ms` | (e2e − ttft) / (output_tokens − 1) |
//! | `itl_mean_ms`, `itl_max_ms` | mean and max gap between content chunks |
//! | `e2e_ms` | time to `[DONE]` (or to the failure) |
//! | `chunks` | content chunks received |
//! | `finish_reason` | last `finish_reason` seen |
//! | `tokens_by_model` | tokenrouter provenance as a JSON object, e.g. `{"quick":120,"reference":30}` |
//! | `switches` | tokenrouter model switches in the request |
//! | `model` | model name sent in the request |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::args::BenchError;
use crate::client::RequestRecord;

/// Column names of `requests.csv` (documented in the module docs and the crate README).
pub const CSV_COLUMNS: [&str; 20] = [
    "index",
    "prompt_index",
    "repeat",
    "start_ms",
    "success",
    "http_status",
    "error",
    "prompt_tokens",
    "output_tokens",
    "usage_reported",
    "ttft_ms",
    "tpot_ms",
    "itl_mean_ms",
    "itl_max_ms",
    "e2e_ms",
    "chunks",
    "finish_reason",
    "tokens_by_model",
    "switches",
    "model",
];

/// Distribution of one latency metric in ms (NaN, serialised as null, when there are no samples).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Stats {
    /// Mean and linearly interpolated percentiles (numpy's default) of `values`.
    pub fn of(values: &[f64]) -> Stats {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        Stats {
            count: v.len(),
            mean,
            median: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Result of a benchmark run (also written as `summary.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub base_url: String,
    pub endpoint: String,
    pub model: String,
    /// `closed` (fixed concurrency) or `open` (Poisson arrivals).
    pub mode: String,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub max_tokens: u32,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_throughput: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2e_ms: Stats,
    /// tokenrouter provenance summed over completed requests (empty for other servers).
    pub tokens_by_model: BTreeMap<String, u64>,
    /// Share of each model in `tokens_by_model`.
    pub share_by_model: BTreeMap<String, f64>,
    /// Mean switches per completed request that reported them.
    pub switches_per_request: Option<f64>,
    /// Failure messages and how often each occurred.
    pub errors: BTreeMap<String, usize>,
}

/// Run parameters echoed into the summary.
pub(crate) struct RunInfo {
    pub base_url: String,
    pub endpoint: String,
    pub model: String,
    pub concurrency: Option<usize>,
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub max_tokens: u32,
}

/// Aggregates the records of a run that lasted `duration_s`.
pub(crate) fn summarize(info: RunInfo, records: &[RequestRecord], duration_s: f64) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let failed = records.len() - ok.len();
    let total_output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let total_input_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let mut tokens_by_model: BTreeMap<String, u64> = BTreeMap::new();
    for by in ok.iter().filter_map(|r| r.tokens_by_model.as_ref()) {
        for (m, n) in by {
            *tokens_by_model.entry(m.clone()).or_insert(0) += n;
        }
    }
    let tracked: u64 = tokens_by_model.values().sum();
    let share_by_model = tokens_by_model
        .iter()
        .map(|(m, &n)| {
            (
                m.clone(),
                if tracked > 0 {
                    n as f64 / tracked as f64
                } else {
                    0.0
                },
            )
        })
        .collect();
    let switches: Vec<u64> = ok.iter().filter_map(|r| r.switches).collect();
    let switches_per_request =
        (!switches.is_empty()).then(|| switches.iter().sum::<u64>() as f64 / switches.len() as f64);
    let mut errors = BTreeMap::new();
    for e in records.iter().filter_map(|r| r.error.as_ref()) {
        *errors.entry(e.clone()).or_insert(0) += 1;
    }
    let per_s = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    let pick = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        ok.iter().filter_map(|r| f(r)).collect()
    };
    Summary {
        mode: if info.request_rate.is_some() {
            "open"
        } else {
            "closed"
        }
        .to_string(),
        base_url: info.base_url,
        endpoint: info.endpoint,
        model: info.model,
        concurrency: info.concurrency,
        request_rate: info.request_rate,
        max_concurrency: info.max_concurrency,
        max_tokens: info.max_tokens,
        completed: ok.len(),
        failed,
        duration_s,
        total_input_tokens,
        total_output_tokens,
        request_throughput: per_s(ok.len() as f64),
        output_throughput: per_s(total_output_tokens as f64),
        ttft_ms: Stats::of(&pick(|r| r.ttft_ms)),
        tpot_ms: Stats::of(&pick(|r| r.tpot_ms)),
        itl_ms: Stats::of(&itl),
        e2e_ms: Stats::of(&pick(|r| Some(r.e2e_ms))),
        tokens_by_model,
        share_by_model,
        switches_per_request,
        errors,
    }
}

fn line(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40}{value:>10}");
}

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "n/a".into()
    }
}

fn section(out: &mut String, title: &str) {
    let _ = writeln!(out, "{:-^50}", title);
}

impl Summary {
    /// The result table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{:=^50}", " Serving Benchmark Result ");
        line(&mut out, "Successful requests:", self.completed);
        line(&mut out, "Failed requests:", self.failed);
        match (self.concurrency, self.request_rate) {
            (_, Some(rate)) => {
                line(&mut out, "Request rate (req/s):", num(rate));
                if let Some(mc) = self.max_concurrency {
                    line(&mut out, "Maximum concurrency:", mc);
                }
            }
            (Some(c), None) => line(&mut out, "Concurrency (closed loop):", c),
            (None, None) => {}
        }
        line(&mut out, "Benchmark duration (s):", num(self.duration_s));
        line(&mut out, "Total input tokens:", self.total_input_tokens);
        line(
            &mut out,
            "Total generated tokens:",
            self.total_output_tokens,
        );
        line(
            &mut out,
            "Request throughput (req/s):",
            num(self.request_throughput),
        );
        line(
            &mut out,
            "Output token throughput (tok/s):",
            num(self.output_throughput),
        );
        for (title, short, s) in [
            ("Time to First Token", "TTFT", &self.ttft_ms),
            (
                "Time per Output Token (excl. 1st token)",
                "TPOT",
                &self.tpot_ms,
            ),
            ("Inter-token Latency", "ITL", &self.itl_ms),
            ("End-to-end Latency", "E2E", &self.e2e_ms),
        ] {
            section(&mut out, title);
            line(&mut out, &format!("Mean {short} (ms):"), num(s.mean));
            line(&mut out, &format!("Median {short} (ms):"), num(s.median));
            line(&mut out, &format!("P90 {short} (ms):"), num(s.p90));
            line(&mut out, &format!("P99 {short} (ms):"), num(s.p99));
        }
        if !self.tokens_by_model.is_empty() || self.switches_per_request.is_some() {
            section(&mut out, "Token provenance (tokenrouter)");
            for (model, n) in &self.tokens_by_model {
                let share = self.share_by_model.get(model).copied().unwrap_or(0.0) * 100.0;
                line(
                    &mut out,
                    &format!("Tokens by {model}:"),
                    format!("{n} ({share:.1}%)"),
                );
            }
            if let Some(s) = self.switches_per_request {
                line(&mut out, "Switches per request:", num(s));
            }
        }
        if !self.errors.is_empty() {
            section(&mut out, "Errors");
            for (e, n) in &self.errors {
                let _ = writeln!(out, "{n:>6} × {e}");
            }
        }
        let _ = writeln!(out, "{}", "=".repeat(50));
        out
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// Writes `requests.csv` and `summary.json` into `dir` (created if missing).
pub(crate) fn write_outputs(
    dir: &Path,
    records: &[RequestRecord],
    summary: &Summary,
) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir).map_err(|source| BenchError::Output {
        path: dir.to_path_buf(),
        source,
    })?;
    let csv_path = dir.join("requests.csv");
    let csv_err = |source| BenchError::Csv {
        path: csv_path.clone(),
        source,
    };
    let mut w = csv::Writer::from_path(&csv_path).map_err(csv_err)?;
    w.write_record(CSV_COLUMNS).map_err(csv_err)?;
    for r in records {
        let itl = Stats::of(&r.itl_ms);
        let itl_max = r
            .itl_ms
            .iter()
            .copied()
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
        let by_model = r
            .tokens_by_model
            .as_ref()
            .and_then(|m| serde_json::to_string(m).ok());
        w.write_record([
            r.index.to_string(),
            r.prompt_index.to_string(),
            r.repeat.to_string(),
            format!("{:.3}", r.start_ms),
            r.success.to_string(),
            opt(r.http_status),
            r.error.clone().unwrap_or_default(),
            opt(r.prompt_tokens),
            r.output_tokens.to_string(),
            r.usage_reported.to_string(),
            opt(r.ttft_ms.map(|x| format!("{x:.3}"))),
            opt(r.tpot_ms.map(|x| format!("{x:.3}"))),
            opt((itl.count > 0).then(|| format!("{:.3}", itl.mean))),
            opt(itl_max.map(|x| format!("{x:.3}"))),
            format!("{:.3}", r.e2e_ms),
            r.chunks.to_string(),
            r.finish_reason.clone().unwrap_or_default(),
            by_model.unwrap_or_default(),
            opt(r.switches),
            summary.model.clone(),
        ])
        .map_err(csv_err)?;
    }
    w.flush().map_err(|source| BenchError::Output {
        path: csv_path.clone(),
        source,
    })?;
    let json_path = dir.join("summary.json");
    let text = serde_json::to_string_pretty(summary).map_err(BenchError::Json)?;
    std::fs::write(&json_path, text + "\n").map_err(|source| BenchError::Output {
        path: json_path,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = Stats::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(s.count, 4);
        assert_eq!(s.mean, 2.5);
        assert_eq!(s.median, 2.5);
        assert!((s.p90 - 3.7).abs() < 1e-12);
        assert!((s.p99 - 3.97).abs() < 1e-12);
        let empty = Stats::of(&[]);
        assert!(empty.mean.is_nan() && empty.p99.is_nan());
    }

    fn rec(success: bool, tokens: u64, by: &[(&str, u64)], switches: Option<u64>) -> RequestRecord {
        RequestRecord {
            success,
            output_tokens: tokens,
            error: (!success).then(|| "HTTP 500: boom".to_string()),
            ttft_ms: Some(10.0),
            e2e_ms: 100.0,
            tokens_by_model: (!by.is_empty())
                .then(|| by.iter().map(|(m, n)| (m.to_string(), *n)).collect()),
            switches,
            ..RequestRecord::default()
        }
    }

    #[test]
    fn summary_counts_only_completed_requests() {
        let info = RunInfo {
            base_url: "u".into(),
            endpoint: "chat".into(),
            model: "m".into(),
            concurrency: Some(2),
            request_rate: None,
            max_concurrency: None,
            max_tokens: 8,
        };
        let records = vec![
            rec(true, 10, &[("quick", 8), ("reference", 2)], Some(2)),
            rec(true, 6, &[("quick", 4), ("reference", 2)], Some(1)),
            rec(false, 3, &[("quick", 3)], Some(9)),
        ];
        let s = summarize(info, &records, 2.0);
        assert_eq!((s.completed, s.failed), (2, 1));
        assert_eq!(s.total_output_tokens, 16);
        assert_eq!(s.output_throughput, 8.0);
        assert_eq!(s.tokens_by_model["quick"], 12);
        assert!((s.share_by_model["reference"] - 0.25).abs() < 1e-12);
        assert_eq!(s.switches_per_request, Some(1.5));
        assert_eq!(s.errors["HTTP 500: boom"], 1);
        let table = s.table();
        assert!(table.contains("Tokens by quick:"), "{table}");
        assert!(table.contains("75.0%"), "{table}");
    }
}
