//! Model ids (`org/name`, `org/name:file.gguf`, `org/name/file.gguf`, each optionally with
//! `@revision`) and their lookup in the standard Hugging Face hub cache
//! (`models--org--name/refs/<rev>` → commit, files under `snapshots/<commit>/`), so models that
//! other tools already downloaded are used without touching the network.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{FetchError, Result};
use crate::layout::{self, ModelLocation};

/// A parsed Hugging Face model id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelId {
    /// `org/name`.
    pub repo: String,
    /// A file inside the repo (a GGUF), if one was named.
    pub file: Option<String>,
    /// Branch, tag or commit; `None` means `main`.
    pub revision: Option<String>,
}

fn valid_repo_part(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl ModelId {
    /// Parses `org/name[@rev][:file.gguf]`, `org/name[@rev]/file.gguf` or a trailing `@rev`.
    pub fn parse(spec: &str) -> Result<ModelId> {
        let invalid = |reason: &str| FetchError::InvalidSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        // Cut out `@rev`: it runs from '@' to the next ':' or '/' (or the end).
        let (main, revision) = match spec.split_once('@') {
            None => (spec.to_string(), None),
            Some((before, after)) => {
                let end = after.find([':', '/']).unwrap_or(after.len());
                let rev = &after[..end];
                if rev.is_empty() || rev.contains('@') || after[end..].contains('@') {
                    return Err(invalid("empty or repeated @revision"));
                }
                (format!("{before}{}", &after[end..]), Some(rev.to_string()))
            }
        };
        let (repo_part, file) = match main.split_once(':') {
            Some((repo, file)) => (repo.to_string(), Some(file.to_string())),
            None => {
                let mut parts = main.splitn(3, '/');
                let org = parts.next().unwrap_or_default();
                let name = parts.next().ok_or_else(|| invalid("expected `org/name`"))?;
                (format!("{org}/{name}"), parts.next().map(str::to_string))
            }
        };
        let (org, name) = repo_part
            .split_once('/')
            .ok_or_else(|| invalid("expected `org/name`"))?;
        if !valid_repo_part(org) || !valid_repo_part(name) {
            return Err(invalid(
                "`org` and `name` may only hold letters, digits, '-', '_' and '.'",
            ));
        }
        if let Some(f) = &file {
            let bad_component = f.split('/').any(|c| c.is_empty() || c == "." || c == "..");
            if bad_component || f.contains('\\') {
                return Err(invalid("bad file name inside the repo"));
            }
            if !f.to_ascii_lowercase().ends_with(".gguf") {
                return Err(invalid("a file inside a repo must be a .gguf file"));
            }
        }
        Ok(ModelId {
            repo: repo_part,
            file,
            revision,
        })
    }

    /// The revision, defaulting to `main`.
    pub fn revision_or_main(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// The directory of this repo inside a hub cache root.
    pub fn repo_dir(&self, cache_root: &Path) -> PathBuf {
        cache_root.join(format!("models--{}", self.repo.replace('/', "--")))
    }

    /// `org/name` plus `:file` when one was named, for messages.
    pub fn display_name(&self) -> String {
        match &self.file {
            Some(f) => format!("{}:{f}", self.repo),
            None => self.repo.clone(),
        }
    }
}

/// The hub cache root from an environment: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (`HUGGINGFACE_HUB_CACHE` is honoured as the legacy spelling).
pub(crate) fn hub_cache_dir_from(get: impl Fn(&str) -> Option<String>) -> PathBuf {
    let set = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(dir) = set("HF_HUB_CACHE").or_else(|| set("HUGGINGFACE_HUB_CACHE")) {
        return PathBuf::from(dir);
    }
    if let Some(home) = set("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let base = set("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| set("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| std::env::temp_dir().join("cache"));
    base.join("huggingface").join("hub")
}

/// The hub cache root from the process environment (see [`hub_cache_dir_from`]).
pub fn hub_cache_dir() -> PathBuf {
    hub_cache_dir_from(|k| std::env::var(k).ok())
}

/// Result of looking a model id up in the cache.
#[derive(Debug)]
pub(crate) enum CacheLookup {
    /// Found and usable.
    Found(ModelLocation),
    /// Not (completely) there; the text says what was missing, for error messages.
    Missing(String),
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// Looks `id` up under `cache_root` without any network access.
pub(crate) fn lookup(cache_root: &Path, id: &ModelId) -> Result<CacheLookup> {
    let repo_dir = id.repo_dir(cache_root);
    let rev = id.revision_or_main();
    let commit = if is_commit_hash(rev) && repo_dir.join("snapshots").join(rev).is_dir() {
        rev.to_string()
    } else {
        let ref_path = repo_dir.join("refs").join(rev);
        match fs::read_to_string(&ref_path) {
            Ok(text) => text.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(CacheLookup::Missing(format!(
                    "{} (missing)",
                    ref_path.display()
                )));
            }
            Err(e) => return Err(FetchError::io(format!("reading {}", ref_path.display()), e)),
        }
    };
    if commit.is_empty() || commit.contains(['/', '\\']) || commit.starts_with('.') {
        return Ok(CacheLookup::Missing(format!(
            "{} (holds no commit hash)",
            repo_dir.join("refs").join(rev).display()
        )));
    }
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Ok(CacheLookup::Missing(format!(
            "{} (missing)",
            snapshot.display()
        )));
    }
    match &id.file {
        Some(file) => {
            let path = snapshot.join(file);
            if path.is_file() {
                layout::check_gguf_magic(&path)?;
                Ok(CacheLookup::Found(ModelLocation::Gguf(path)))
            } else {
                Ok(CacheLookup::Missing(format!(
                    "{} (missing)",
                    path.display()
                )))
            }
        }
        None => match layout::classify_dir(&snapshot, &id.repo) {
            Ok(loc) => Ok(CacheLookup::Found(loc)),
            Err(FetchError::NotAModel { reason, .. }) => Ok(CacheLookup::Missing(format!(
                "{} ({reason})",
                snapshot.display()
            ))),
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(repo: &str, file: Option<&str>, rev: Option<&str>) -> ModelId {
        ModelId {
            repo: repo.into(),
            file: file.map(Into::into),
            revision: rev.map(Into::into),
        }
    }

    #[test]
    fn parses_all_spellings() {
        let cases = [
            ("Qwen/Qwen3-0.6B", id("Qwen/Qwen3-0.6B", None, None)),
            (
                "Qwen/Qwen3-0.6B@v1.0",
                id("Qwen/Qwen3-0.6B", None, Some("v1.0")),
            ),
            (
                "org/repo:file.gguf",
                id("org/repo", Some("file.gguf"), None),
            ),
            (
                "org/repo/file.gguf",
                id("org/repo", Some("file.gguf"), None),
            ),
            (
                "org/repo/sub/file.GGUF",
                id("org/repo", Some("sub/file.GGUF"), None),
            ),
            (
                "org/repo@abc:file.gguf",
                id("org/repo", Some("file.gguf"), Some("abc")),
            ),
            (
                "org/repo@abc/file.gguf",
                id("org/repo", Some("file.gguf"), Some("abc")),
            ),
            (
                "org/repo:file.gguf@abc",
                id("org/repo", Some("file.gguf"), Some("abc")),
            ),
            (
                "org/repo/file.gguf@abc",
                id("org/repo", Some("file.gguf"), Some("abc")),
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(ModelId::parse(spec).expect(spec), want, "{spec}");
        }
    }

    #[test]
    fn rejects_bad_specs() {
        for spec in [
            "justname",
            "org/",
            "/name",
            "org/na me",
            "org/repo:file.bin",
            "org/repo:../x.gguf",
            "org/repo@",
            "org/repo@a@b",
            "../repo",
        ] {
            let err = ModelId::parse(spec).expect_err(spec);
            assert!(
                matches!(err, FetchError::InvalidSpec { .. }),
                "{spec}: {err}"
            );
        }
    }

    #[test]
    fn cache_root_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            hub_cache_dir_from(env(&[
                ("HF_HUB_CACHE", "/a"),
                ("HF_HOME", "/b"),
                ("HOME", "/h")
            ])),
            PathBuf::from("/a")
        );
        assert_eq!(
            hub_cache_dir_from(env(&[
                ("HF_HUB_CACHE", ""),
                ("HF_HOME", "/b"),
                ("HOME", "/h")
            ])),
            PathBuf::from("/b/hub")
        );
        assert_eq!(
            hub_cache_dir_from(env(&[("HOME", "/h")])),
            PathBuf::from("/h/.cache/huggingface/hub")
        );
    }

    #[test]
    fn missing_ref_is_reported_with_its_path() {
        let root = tempfile::tempdir().expect("tempdir");
        let model = ModelId::parse("org/absent").expect("id");
        match lookup(root.path(), &model).expect("lookup") {
            CacheLookup::Missing(what) => {
                assert!(what.contains("models--org--absent/refs/main"), "{what}")
            }
            CacheLookup::Found(loc) => panic!("unexpected {loc:?}"),
        }
    }
}
