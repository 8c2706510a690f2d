//! Turns whatever the user typed as a model (a path, a built-in name, a Hugging Face id) into a
//! local GGUF file or Hugging Face directory, downloading only when the model is not cached.

use std::path::{Path, PathBuf};

use crate::defaults::{self, DefaultModel};
use crate::error::{FetchError, Result};
use crate::hf_cache::{self, CacheLookup, ModelId};
use crate::hub::Hub;
use crate::layout::{self, ModelLocation};
use crate::options::{default_cache_dir, FetchOptions};

/// How [`resolve_model_with`] may find and fetch models.
#[derive(Debug, Clone)]
pub struct ResolveOptions {
    /// Download sources and timeouts (also names the Hugging Face cache).
    pub fetch: FetchOptions,
    /// The tokenrouter cache (built-in models go to `<cache_dir>/models/`).
    pub cache_dir: PathBuf,
    /// Allow network downloads when a model is not cached.
    pub download: bool,
}

impl ResolveOptions {
    /// From the environment; downloads are allowed unless `TOKENROUTER_OFFLINE` is set.
    pub fn from_env(progress: bool) -> Self {
        let offline = std::env::var("TOKENROUTER_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0");
        ResolveOptions {
            fetch: FetchOptions::from_env(progress),
            cache_dir: default_cache_dir(),
            download: !offline,
        }
    }
}

/// Resolves `spec` with options from the environment (progress bars on, downloads allowed).
///
/// `spec` is a path to a `.gguf` file or a Hugging Face model directory, a built-in name
/// (`qwen2.5-coder-0.5b-instruct-q4_k_m`, `qwen2.5-coder-1.5b-instruct-q4_k_m`), or a model id
/// `org/name`, `org/name:file.gguf`, `org/name/file.gguf`, optionally with `@revision`.
pub fn resolve_model(spec: &str) -> Result<ModelLocation> {
    resolve_model_with(spec, &ResolveOptions::from_env(true))
}

/// True for specs that can only be meant as file-system paths.
fn looks_like_path(spec: &str) -> bool {
    spec.starts_with('/')
        || spec.starts_with("./")
        || spec.starts_with("../")
        || spec.starts_with('~')
        || spec == "."
        || spec == ".."
        || spec.contains('\\')
}

fn expand_home(spec: &str) -> PathBuf {
    match spec.strip_prefix("~/") {
        Some(rest) => match std::env::var_os("HOME") {
            Some(home) => Path::new(&home).join(rest),
            None => PathBuf::from(spec),
        },
        None => PathBuf::from(spec),
    }
}

/// [`resolve_model`] with explicit options.
pub fn resolve_model_with(spec: &str, opts: &ResolveOptions) -> Result<ModelLocation> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(FetchError::InvalidSpec {
            spec: spec.to_string(),
            reason: "empty".into(),
        });
    }
    let path = expand_home(spec);
    if path.exists() {
        return layout::classify_path(&path, spec);
    }
    if let Some(model) = DefaultModel::by_name(spec) {
        return resolve_default(model, opts);
    }
    if looks_like_path(spec) {
        return Err(FetchError::PathNotFound(path));
    }
    let id = ModelId::parse(spec).map_err(|e| match e {
        FetchError::InvalidSpec { reason, .. } => FetchError::InvalidSpec {
            spec: spec.to_string(),
            reason: format!(
                "not an existing path, not a built-in model ({}), and not a model id: {reason}",
                defaults::DEFAULT_MODELS.map(|m| m.name).join(", ")
            ),
        },
        other => other,
    })?;
    resolve_model_id(&id, opts)
}

fn resolve_default(model: &DefaultModel, opts: &ResolveOptions) -> Result<ModelLocation> {
    if let Some(path) = defaults::cached_default_model(model, &opts.cache_dir)? {
        return Ok(ModelLocation::Gguf(path));
    }
    if !opts.download {
        return Err(FetchError::NotCached {
            model: model.name.to_string(),
            looked: model.path_in(&opts.cache_dir).display().to_string(),
            hint: "; allow downloads or run the fetch command first".into(),
        });
    }
    defaults::fetch_default_model(model, &opts.cache_dir, &opts.fetch).map(ModelLocation::Gguf)
}

/// Looks `id` up in the Hugging Face cache, downloading it with `hf-hub` if missing.
pub fn resolve_model_id(id: &ModelId, opts: &ResolveOptions) -> Result<ModelLocation> {
    let root = &opts.fetch.hf_cache_dir;
    let looked = match hf_cache::lookup(root, id)? {
        CacheLookup::Found(loc) => return Ok(loc),
        CacheLookup::Missing(looked) => looked,
    };
    if !opts.download {
        return Err(FetchError::NotCached {
            model: id.display_name(),
            looked,
            hint: String::new(),
        });
    }
    let hub = Hub::connect(&opts.fetch, &id.display_name(), &looked)?;
    hub.download(id)?;
    match hf_cache::lookup(root, id)? {
        CacheLookup::Found(loc) => Ok(loc),
        CacheLookup::Missing(what) => Err(FetchError::NotAModel {
            path: id.repo_dir(root),
            reason: format!("downloaded, but still incomplete: {what}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offline(dir: &Path) -> ResolveOptions {
        let mut fetch = FetchOptions::from_env_with(|_| None, false);
        fetch.hf_cache_dir = dir.join("hf");
        fetch.hub_endpoint = None;
        fetch.pypi_index = None;
        ResolveOptions {
            fetch,
            cache_dir: dir.join("tr"),
            download: false,
        }
    }

    #[test]
    fn path_like_specs_are_not_ids() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = offline(dir.path());
        let err = resolve_model_with("./nope/model.gguf", &opts).expect_err("missing path");
        assert!(matches!(err, FetchError::PathNotFound(_)), "{err}");
        let err = resolve_model_with("", &opts).expect_err("empty");
        assert!(matches!(err, FetchError::InvalidSpec { .. }), "{err}");
        let err = resolve_model_with("no-slash-name", &opts).expect_err("bad id");
        assert!(
            err.to_string()
                .contains("qwen2.5-coder-0.5b-instruct-q4_k_m"),
            "{err}"
        );
    }

    #[test]
    fn default_name_offline_names_the_cache_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = offline(dir.path());
        let err = resolve_model_with("qwen2.5-coder-0.5b-instruct-q4_k_m", &opts)
            .expect_err("not cached");
        let text = err.to_string();
        assert!(
            text.contains("tr/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            "{text}"
        );
    }

    #[test]
    fn missing_id_offline_is_not_cached() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = offline(dir.path());
        let err = resolve_model_with("org/absent", &opts).expect_err("not cached");
        assert!(matches!(err, FetchError::NotCached { .. }), "{err}");
        assert!(err.to_string().contains("models--org--absent"), "{err}");
    }
}
