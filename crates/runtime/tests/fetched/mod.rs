//! The real models `tokenrouter fetch` puts in the cache, for the tests that need them.
//! Without them a test says so and passes only when `TOKENROUTER_NO_SKIP` is unset
//! (scripts/test.sh sets it, after fetching).

use std::path::PathBuf;

fn cache_models() -> PathBuf {
    if let Ok(c) = std::env::var("TOKENROUTER_CACHE") {
        return PathBuf::from(c).join("models");
    }
    let home = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache")
        });
    home.join("tokenrouter").join("models")
}

/// The fetched model `file`, or `None` (the caller skips) when it is absent and skipping
/// is allowed.
pub fn fetched_model(file: &str) -> Option<PathBuf> {
    let path = cache_models().join(file);
    if path.exists() {
        return Some(path);
    }
    assert!(
        !std::env::var("TOKENROUTER_NO_SKIP").is_ok_and(|v| !v.is_empty() && v != "0"),
        "{} missing: run `tokenrouter fetch`",
        path.display()
    );
    eprintln!(
        "skipping: {} not fetched (run `tokenrouter fetch`)",
        path.display()
    );
    None
}
