//! `bench --report DIR…`: reads finished runs' `requests.csv` back and compares them in one
//! table, one row per run — the research system's report step (one CSV per method or
//! concurrency, then a summary across them), over this command's own CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::args::BenchError;
use crate::client::RequestRecord;
use crate::report::{summarize, RunInfo, Summary, CSV_COLUMNS};

/// The rows of a `requests.csv` written by `tokenrouter bench`. Per-request inter-token gaps
/// are stored only as mean and max, so the records come back without `itl_ms`.
pub fn read_requests_csv(path: &Path) -> Result<Vec<RequestRecord>, BenchError> {
    let bad = |reason: String| BenchError::Dataset {
        path: path.to_path_buf(),
        reason,
    };
    let mut reader = csv::Reader::from_path(path).map_err(|e| match e.into_kind() {
        csv::ErrorKind::Io(source) => BenchError::DatasetIo {
            path: path.to_path_buf(),
            source,
        },
        other => bad(format!("{other:?}")),
    })?;
    let headers = reader.headers().map_err(|e| bad(e.to_string()))?.clone();
    let column = |name: &str| headers.iter().position(|h| h == name);
    let mut at = BTreeMap::new();
    for name in CSV_COLUMNS {
        let i = column(name).ok_or_else(|| {
            bad(format!(
                "no `{name}` column: not a requests.csv of `tokenrouter bench`"
            ))
        })?;
        at.insert(name, i);
    }
    let mut records = Vec::new();
    for (row, result) in reader.records().enumerate() {
        let line = row + 2;
        let rec = result.map_err(|e| bad(format!("line {line}: {e}")))?;
        let get = |name: &str| rec.get(at[name]).unwrap_or("").trim();
        fn parse<T: std::str::FromStr>(v: &str, name: &str, line: usize) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("line {line}: `{name}` = {v:?} is not a valid value"))
        }
        let req = |name: &str| parse::<f64>(get(name), name, line).map_err(&bad);
        let opt = |name: &str| -> Result<Option<f64>, BenchError> {
            let v = get(name);
            if v.is_empty() {
                Ok(None)
            } else {
                parse(v, name, line).map(Some).map_err(&bad)
            }
        };
        let by_model = match get("tokens_by_model") {
            "" => None,
            v => Some(serde_json::from_str(v).map_err(|e| {
                bad(format!(
                    "line {line}: `tokens_by_model` is not a JSON object: {e}"
                ))
            })?),
        };
        records.push(RequestRecord {
            index: req("index")? as usize,
            prompt_index: req("prompt_index")? as usize,
            repeat: req("repeat")? as usize,
            start_ms: req("start_ms")?,
            success: get("success") == "true",
            error: Some(get("error").to_string()).filter(|e| !e.is_empty()),
            http_status: opt("http_status")?.map(|s| s as u16),
            prompt_tokens: opt("prompt_tokens")?.map(|n| n as u64),
            output_tokens: req("output_tokens")? as u64,
            usage_reported: get("usage_reported") == "true",
            ttft_ms: opt("ttft_ms")?,
            tpot_ms: opt("tpot_ms")?,
            e2e_ms: req("e2e_ms")?,
            itl_ms: Vec::new(),
            chunks: req("chunks")? as u64,
            finish_reason: Some(get("finish_reason").to_string()).filter(|f| !f.is_empty()),
            tokens_by_model: by_model,
            switches: opt("switches")?.map(|n| n as u64),
        });
    }
    Ok(records)
}

/// The summary of a finished run, recomputed from its CSV (duration: first send to last
/// end). The concurrency comes from the run's `summary.json` when it is there.
fn summary_of(dir: &Path) -> Result<Summary, BenchError> {
    let records = read_requests_csv(&dir.join("requests.csv"))?;
    let start = records
        .iter()
        .map(|r| r.start_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records
        .iter()
        .map(|r| r.start_ms + r.e2e_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if records.is_empty() {
        0.0
    } else {
        (end - start) / 1000.0
    };
    let saved: Option<serde_json::Value> = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let field = |k: &str| {
        saved
            .as_ref()
            .and_then(|s| s.get(k))
            .and_then(|v| v.as_u64())
    };
    let info = RunInfo {
        base_url: String::new(),
        endpoint: String::new(),
        model: String::new(),
        concurrency: field("concurrency").map(|c| c as usize),
        request_rate: None,
        max_concurrency: None,
        max_tokens: field("max_tokens").unwrap_or(0) as u32,
    };
    Ok(summarize(info, &records, duration_s))
}

fn ms(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "n/a".into()
    }
}

/// One markdown table comparing the runs in `dirs` (each with a `requests.csv`).
pub fn compare_runs(dirs: &[PathBuf]) -> Result<String, BenchError> {
    let mut out = String::from(
        "| run | concurrency | ok | failed | duration s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 s | tokens by model | switches/req |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for dir in dirs {
        let s = summary_of(dir)?;
        let shares = s
            .share_by_model
            .iter()
            .map(|(m, f)| format!("{m} {:.1}%", f * 100.0))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} |",
            dir.display(),
            s.concurrency.map_or("?".into(), |c| c.to_string()),
            s.completed,
            s.failed,
            s.duration_s,
            s.output_throughput,
            ms(s.ttft_ms.median),
            ms(s.ttft_ms.p99),
            ms(s.tpot_ms.median),
            ms(s.e2e_ms.median / 1000.0),
            if shares.is_empty() {
                "n/a".into()
            } else {
                shares
            },
            s.switches_per_request
                .map_or("n/a".into(), |x| format!("{x:.1}")),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::write_outputs;

    fn record(i: usize, by: &[(&str, u64)]) -> RequestRecord {
        RequestRecord {
            index: i,
            prompt_index: i,
            start_ms: 100.0 * i as f64,
            success: true,
            http_status: Some(200),
            prompt_tokens: Some(5),
            output_tokens: by.iter().map(|(_, n)| n).sum(),
            usage_reported: true,
            ttft_ms: Some(10.0 + i as f64),
            tpot_ms: Some(2.0),
            e2e_ms: 1000.0,
            itl_ms: vec![2.0, 3.0],
            chunks: 4,
            finish_reason: Some("length".into()),
            tokens_by_model: Some(by.iter().map(|(m, n)| (m.to_string(), *n)).collect()),
            switches: Some(2),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn a_written_csv_reads_back_and_compares() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path().join("r2r-c4");
        std::fs::create_dir_all(&run).expect("mkdir");
        let records = vec![
            record(0, &[("quick", 30), ("reference", 10)]),
            record(1, &[("quick", 20), ("reference", 0)]),
        ];
        let info = RunInfo {
            base_url: "u".into(),
            endpoint: "chat".into(),
            model: "m".into(),
            concurrency: Some(4),
            request_rate: None,
            max_concurrency: None,
            max_tokens: 64,
        };
        let summary = summarize(info, &records, 1.1);
        write_outputs(&run, &records, &summary).expect("write");
        let back = read_requests_csv(&run.join("requests.csv")).expect("read");
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].tokens_by_model, records[0].tokens_by_model);
        assert_eq!(back[1].ttft_ms, Some(11.0));
        let table = compare_runs(std::slice::from_ref(&run)).expect("compare");
        // 60 tokens over 1.1 s (first send at 0 ms, last end at 1100 ms); 10 of 60 by the 1.5B.
        assert!(table.contains("| 4 | 2 | 0 | 1.1 | 54.5 |"), "{table}");
        assert!(table.contains("reference 16.7%"), "{table}");
        std::fs::write(run.join("requests.csv"), "index,foo\n1,2\n").expect("write");
        let err = compare_runs(&[run]).unwrap_err().to_string();
        assert!(err.contains("no `prompt_index` column"), "{err}");
    }
}
