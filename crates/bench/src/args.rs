//! Command-line flags of `tokenrouter bench` and the error type of the benchmark as a whole
//! (per-request failures are not errors: they are recorded and counted).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use thiserror::Error;

/// Errors that stop a benchmark before or after it runs (bad flags, dataset, output files).
#[derive(Debug, Error)]
pub enum BenchError {
    #[error("invalid argument: {0}")]
    Argument(String),
    #[error("cannot read dataset {path}: {source}")]
    DatasetIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("dataset {path}: {reason}")]
    Dataset { path: PathBuf, reason: String },
    #[error("the dataset has no prompts")]
    EmptyDataset,
    #[error("cannot build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("cannot write {path}: {source}")]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write CSV {path}: {source}")]
    Csv {
        path: PathBuf,
        #[source]
        source: csv::Error,
    },
    #[error("cannot serialise the summary: {0}")]
    Json(#[source] serde_json::Error),
}

/// Which OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `/v1/chat/completions` with `messages`.
    Chat,
    /// `/v1/completions` with `prompt`.
    Completions,
}

/// Flags of `tokenrouter bench`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "bench",
    about = "Load generator for OpenAI-compatible servers (closed or open loop, streaming)"
)]
pub struct BenchArgs {
    /// Server base URL (with or without a trailing /v1).
    #[arg(long = "base-url", default_value = "http://127.0.0.1:30000")]
    pub base_url: String,
    /// Endpoint to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// Model name sent in the request (default: the first id listed by GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token for the Authorization header.
    #[arg(long = "api-key", env = "TOKENROUTER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Closed loop: number of requests kept in flight (default 1 when no --request-rate).
    #[arg(long, conflicts_with = "request_rate")]
    pub concurrency: Option<usize>,
    /// Open loop: Poisson arrivals at this many requests per second (`inf` sends all at once).
    #[arg(long = "request-rate")]
    pub request_rate: Option<f64>,
    /// Open loop: at most this many requests in flight (arrivals wait for a slot).
    #[arg(long = "max-concurrency", requires = "request_rate")]
    pub max_concurrency: Option<usize>,
    /// Number of distinct prompts taken from the dataset (cycling when it has fewer; default: all).
    #[arg(long = "num-prompts")]
    pub num_prompts: Option<usize>,
    /// Send every prompt this many times.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// `max_tokens` of every request.
    #[arg(long = "max-tokens", default_value_t = 256)]
    pub max_tokens: u32,
    /// Ask the server not to stop at end-of-sequence (the vLLM extension field `ignore_eos`).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Sampling temperature (server default when absent).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// A JSON object merged into every request body, its keys over the benchmark's (e.g.
    /// `'{"response_format": {"type": "json_object"}}'`; SGLang's `--extra-request-body`).
    #[arg(long = "extra-body", alias = "extra-request-body", value_name = "JSON", value_parser = json_object)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    /// Seed: request i is sent sampling `seed` + i (reproducible across runs, distinct per
    /// request); also seeds the Poisson arrivals.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Prompts: a built-in set (`math`, `code`, `long`) or a JSON array / JSONL file of objects
    /// with `prompt` (string) or `messages` (chat messages).
    #[arg(long, default_value = "math")]
    pub dataset: String,
    /// Directory for `requests.csv` and `summary.json`.
    #[arg(long = "out-dir")]
    pub out_dir: Option<PathBuf>,
    /// Give up on a request after this many seconds (it counts as failed).
    #[arg(long = "request-timeout", default_value_t = 1800.0)]
    pub request_timeout: f64,
    /// Do not draw the progress bar.
    #[arg(long = "no-progress")]
    pub no_progress: bool,
    /// Do not print the result table (the summary is still returned and written).
    #[arg(long)]
    pub quiet: bool,
    /// Print one table comparing finished runs (each DIR holds a `requests.csv` of this
    /// command, e.g. one per method or concurrency) instead of running a benchmark.
    #[arg(long, value_name = "DIR", num_args = 1..)]
    pub report: Vec<PathBuf>,
    /// The research system's positional form, kept for its scripts: CONCURRENCY PORT
    /// NUM_PROMPTS REPEATS MAX_TOKENS OUT_DIR DATASET (a prefix may be given; the rest keep
    /// their defaults). PORT means http://127.0.0.1:PORT.
    #[arg(
        value_name = "POSITIONAL",
        num_args = 0..=7,
        conflicts_with_all = ["concurrency", "request_rate", "base_url", "num_prompts", "repeats", "max_tokens", "out_dir", "dataset"]
    )]
    pub positional: Vec<String>,
}

fn json_object(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// Names of the positional values, in order (for messages).
const POSITIONAL: [&str; 7] = [
    "CONCURRENCY",
    "PORT",
    "NUM_PROMPTS",
    "REPEATS",
    "MAX_TOKENS",
    "OUT_DIR",
    "DATASET",
];

impl BenchArgs {
    /// Parses flags for tests and embedding: `BenchArgs::from_flags(["--concurrency", "4"])`.
    pub fn from_flags<I, S>(flags: I) -> Result<BenchArgs, BenchError>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let argv = std::iter::once(std::ffi::OsString::from("bench"))
            .chain(flags.into_iter().map(Into::into));
        BenchArgs::try_parse_from(argv).map_err(|e| BenchError::Argument(e.to_string()))
    }

    /// Moves the research system's positional values onto the flags they stand for.
    pub fn resolve_positional(mut self) -> Result<BenchArgs, BenchError> {
        let values = std::mem::take(&mut self.positional);
        let number = |i: usize| -> Result<u64, BenchError> {
            values[i].parse::<u64>().map_err(|_| {
                BenchError::Argument(format!(
                    "{} (positional value {}) must be a whole number, got {:?}",
                    POSITIONAL[i],
                    i + 1,
                    values[i]
                ))
            })
        };
        for i in 0..values.len() {
            match i {
                0 => self.concurrency = Some(number(0)? as usize),
                1 => {
                    let port = u16::try_from(number(1)?).map_err(|_| {
                        BenchError::Argument(format!("PORT must be ≤ 65535, got {}", values[1]))
                    })?;
                    self.base_url = format!("http://127.0.0.1:{port}");
                }
                2 => self.num_prompts = Some(number(2)? as usize),
                3 => self.repeats = number(3)? as usize,
                4 => {
                    self.max_tokens = u32::try_from(number(4)?).map_err(|_| {
                        BenchError::Argument(format!("MAX_TOKENS is too large: {}", values[4]))
                    })?
                }
                5 => self.out_dir = Some(PathBuf::from(&values[5])),
                _ => self.dataset = values[6].clone(),
            }
        }
        Ok(self)
    }

    /// Checks values clap cannot check.
    pub fn validate(&self) -> Result<(), BenchError> {
        if self.concurrency == Some(0) || self.max_concurrency == Some(0) {
            return Err(BenchError::Argument("concurrency must be ≥ 1".into()));
        }
        if let Some(rate) = self.request_rate {
            if rate.is_nan() || rate <= 0.0 {
                return Err(BenchError::Argument(format!(
                    "--request-rate must be > 0, got {rate}"
                )));
            }
        }
        if self.repeats == 0 || self.num_prompts == Some(0) {
            return Err(BenchError::Argument(
                "--repeats and --num-prompts must be ≥ 1".into(),
            ));
        }
        if !(self.request_timeout.is_finite() && self.request_timeout > 0.0) {
            return Err(BenchError::Argument("--request-timeout must be > 0".into()));
        }
        Ok(())
    }

    /// URL of the chosen endpoint.
    pub fn endpoint_url(&self) -> String {
        let path = match self.endpoint {
            Endpoint::Chat => "chat/completions",
            Endpoint::Completions => "completions",
        };
        format!("{}/{path}", api_root(&self.base_url))
    }
}

/// `http://host:port` or `http://host:port/v1` → `http://host:port/v1`.
pub(crate) fn api_root(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1") {
        base.to_string()
    } else {
        format!("{base}/v1")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_accept_with_or_without_v1() {
        let mut a = BenchArgs::from_flags(["--base-url", "http://h:1/"]).expect("flags");
        assert_eq!(a.endpoint_url(), "http://h:1/v1/chat/completions");
        a.base_url = "http://h:1/v1".into();
        a.endpoint = Endpoint::Completions;
        assert_eq!(a.endpoint_url(), "http://h:1/v1/completions");
    }

    #[test]
    fn closed_and_open_loop_flags_conflict() {
        assert!(BenchArgs::from_flags(["--concurrency", "2", "--request-rate", "3"]).is_err());
        assert!(BenchArgs::from_flags(["--max-concurrency", "2"]).is_err());
        let a = BenchArgs::from_flags(["--request-rate", "inf", "--max-concurrency", "2"])
            .expect("flags");
        assert_eq!(a.request_rate, Some(f64::INFINITY));
        assert!(a.validate().is_ok());
    }

    #[test]
    fn the_research_systems_positional_form_maps_onto_the_flags() {
        let a = BenchArgs::from_flags(["4", "30001", "30", "2", "2048", "out/r2r", "aime.jsonl"])
            .expect("flags")
            .resolve_positional()
            .expect("positional");
        assert_eq!(a.concurrency, Some(4));
        assert_eq!(a.base_url, "http://127.0.0.1:30001");
        assert_eq!(
            (a.num_prompts, a.repeats, a.max_tokens),
            (Some(30), 2, 2048)
        );
        assert_eq!(a.out_dir, Some(PathBuf::from("out/r2r")));
        assert_eq!(a.dataset, "aime.jsonl");
        // A prefix keeps the other defaults.
        let b = BenchArgs::from_flags(["8"])
            .unwrap()
            .resolve_positional()
            .unwrap();
        assert_eq!(
            (b.concurrency, b.repeats, b.dataset.as_str()),
            (Some(8), 1, "math")
        );
        // Not both forms, and numbers must be numbers.
        assert!(BenchArgs::from_flags(["4", "--concurrency", "2"]).is_err());
        let bad = BenchArgs::from_flags(["four"])
            .unwrap()
            .resolve_positional();
        assert!(bad.unwrap_err().to_string().contains("CONCURRENCY"));
        let port = BenchArgs::from_flags(["1", "70000"])
            .unwrap()
            .resolve_positional();
        assert!(port.unwrap_err().to_string().contains("PORT"));
        assert!(BenchArgs::from_flags(["1", "2", "3", "4", "5", "6", "7", "8"]).is_err());
    }

    #[test]
    fn bad_values_are_rejected() {
        for flags in [
            &["--concurrency", "0"][..],
            &["--request-rate", "0"],
            &["--repeats", "0"],
            &["--request-timeout=-1"],
        ] {
            let a = BenchArgs::from_flags(flags.iter().copied()).expect("flags");
            assert!(a.validate().is_err(), "{flags:?}");
        }
    }
}
