//! Recognises what a local path holds: a GGUF file, or a Hugging Face model directory
//! (`config.json` plus `*.safetensors`, possibly sharded with `model.safetensors.index.json`).
//! Used both for user-given paths and for snapshot directories of the Hugging Face cache.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{FetchError, Result};

/// Where a model's weights are on local disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    /// A single GGUF file (weights, tokenizer and chat template inside).
    Gguf(PathBuf),
    /// A Hugging Face model directory: `config.json`, tokenizer files and safetensors weights.
    HfDir(PathBuf),
}

impl ModelLocation {
    /// The file or directory path.
    pub fn path(&self) -> &Path {
        match self {
            ModelLocation::Gguf(p) | ModelLocation::HfDir(p) => p,
        }
    }
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// Classifies an existing path. `spec` is only used in error messages.
pub(crate) fn classify_path(path: &Path, spec: &str) -> Result<ModelLocation> {
    let meta =
        fs::metadata(path).map_err(|e| FetchError::io(format!("reading {}", path.display()), e))?;
    if meta.is_dir() {
        classify_dir(path, spec)
    } else {
        check_gguf_magic(path)?;
        Ok(ModelLocation::Gguf(path.to_path_buf()))
    }
}

/// Fails unless `path` starts with the GGUF magic bytes.
pub(crate) fn check_gguf_magic(path: &Path) -> Result<()> {
    let mut file = fs::File::open(path)
        .map_err(|e| FetchError::io(format!("opening {}", path.display()), e))?;
    let mut magic = [0u8; 4];
    match file.read_exact(&mut magic) {
        Ok(()) if &magic == GGUF_MAGIC => Ok(()),
        Ok(()) => Err(FetchError::NotAModel {
            path: path.to_path_buf(),
            reason: "not a GGUF file (bad magic bytes)".into(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(FetchError::NotAModel {
            path: path.to_path_buf(),
            reason: "file too short to be GGUF".into(),
        }),
        Err(e) => Err(FetchError::io(format!("reading {}", path.display()), e)),
    }
}

/// Names of regular files (following symlinks, skipping dangling ones) in `dir` ending in `ext`.
fn files_with_ext(dir: &Path, ext: &str) -> Result<Vec<String>> {
    let entries =
        fs::read_dir(dir).map_err(|e| FetchError::io(format!("listing {}", dir.display()), e))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FetchError::io(format!("listing {}", dir.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.to_ascii_lowercase().ends_with(ext) && entry.path().is_file() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Classifies a directory: HF layout first, else exactly one GGUF file inside.
pub(crate) fn classify_dir(dir: &Path, spec: &str) -> Result<ModelLocation> {
    let has_config = dir.join("config.json").is_file();
    let index = dir.join(SAFETENSORS_INDEX);
    let safetensors = files_with_ext(dir, ".safetensors")?;
    if has_config && index.is_file() {
        check_shards(dir, &index)?;
        return Ok(ModelLocation::HfDir(dir.to_path_buf()));
    }
    if has_config && !safetensors.is_empty() {
        return Ok(ModelLocation::HfDir(dir.to_path_buf()));
    }
    let ggufs = files_with_ext(dir, ".gguf")?;
    match ggufs.len() {
        1 => {
            let file = dir.join(&ggufs[0]);
            check_gguf_magic(&file)?;
            Ok(ModelLocation::Gguf(file))
        }
        0 => {
            let reason = match (has_config, safetensors.is_empty()) {
                (true, true) => "has config.json but no *.safetensors weights".to_string(),
                (false, false) => "has *.safetensors weights but no config.json".to_string(),
                _ => "neither config.json + *.safetensors nor a .gguf file".to_string(),
            };
            Err(FetchError::NotAModel {
                path: dir.to_path_buf(),
                reason,
            })
        }
        _ => Err(FetchError::AmbiguousGguf {
            spec: spec.to_string(),
            candidates: ggufs,
        }),
    }
}

/// Every shard named in the safetensors index must be present.
fn check_shards(dir: &Path, index: &Path) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = fs::read_to_string(index)
        .map_err(|e| FetchError::io(format!("reading {}", index.display()), e))?;
    let parsed: Index = serde_json::from_str(&text).map_err(|e| FetchError::NotAModel {
        path: index.to_path_buf(),
        reason: format!("malformed safetensors index: {e}"),
    })?;
    let shards: BTreeSet<&String> = parsed.weight_map.values().collect();
    let missing: Vec<&str> = shards
        .iter()
        .filter(|s| !dir.join(s.as_str()).is_file())
        .map(|s| s.as_str())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(FetchError::NotAModel {
            path: dir.to_path_buf(),
            reason: format!(
                "shards listed in {SAFETENSORS_INDEX} are missing: {}",
                missing.join(", ")
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        fs::write(path, bytes).expect("write test file");
    }

    #[test]
    fn gguf_file_is_recognised_by_magic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("m.bin");
        write(&good, b"GGUF\x03\x00\x00\x00rest");
        assert_eq!(
            classify_path(&good, "x").expect("gguf"),
            ModelLocation::Gguf(good.clone())
        );
        let bad = dir.path().join("bad.gguf");
        write(&bad, b"PK\x03\x04");
        let err = classify_path(&bad, "x").expect_err("bad magic");
        assert!(err.to_string().contains("bad magic"), "{err}");
        let short = dir.path().join("short.gguf");
        write(&short, b"GG");
        assert!(classify_path(&short, "x")
            .expect_err("short")
            .to_string()
            .contains("too short"));
    }

    #[test]
    fn hf_dir_needs_config_and_weights() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(&dir.path().join("config.json"), b"{}");
        let err = classify_path(dir.path(), "x").expect_err("no weights");
        assert!(err.to_string().contains("no *.safetensors"), "{err}");
        write(&dir.path().join("model.safetensors"), b"\0");
        assert_eq!(
            classify_path(dir.path(), "x").expect("hf dir"),
            ModelLocation::HfDir(dir.path().to_path_buf())
        );
    }

    #[test]
    fn sharded_hf_dir_checks_every_shard() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(&dir.path().join("config.json"), b"{}");
        let index = r#"{"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#;
        write(&dir.path().join(SAFETENSORS_INDEX), index.as_bytes());
        write(&dir.path().join("model-00001-of-00002.safetensors"), b"\0");
        let err = classify_path(dir.path(), "x").expect_err("missing shard");
        assert!(
            err.to_string().contains("model-00002-of-00002.safetensors"),
            "{err}"
        );
        write(&dir.path().join("model-00002-of-00002.safetensors"), b"\0");
        assert!(matches!(
            classify_path(dir.path(), "x"),
            Ok(ModelLocation::HfDir(_))
        ));
    }

    #[test]
    fn directory_with_ggufs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = classify_path(dir.path(), "x").expect_err("empty");
        assert!(err.to_string().contains("neither"), "{err}");
        write(&dir.path().join("a.gguf"), b"GGUF....");
        assert_eq!(
            classify_path(dir.path(), "x").expect("one gguf"),
            ModelLocation::Gguf(dir.path().join("a.gguf"))
        );
        write(&dir.path().join("b.gguf"), b"GGUF....");
        let err = classify_path(dir.path(), "org/repo").expect_err("two ggufs");
        assert!(err.to_string().contains("org/repo:a.gguf"), "{err}");
    }
}
