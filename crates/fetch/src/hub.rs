//! Downloads from the Hugging Face Hub through the `hf-hub` crate (sync API, indicatif progress)
//! into the standard hub cache, after a short TCP probe: `hf-hub` itself has no connect
//! timeout, and the Hub is often unreachable from build machines.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder};
use hf_hub::{Repo, RepoType};

use crate::error::{FetchError, Result};
use crate::hf_cache::ModelId;
use crate::options::FetchOptions;

/// Files fetched for a safetensors repo, besides the weights themselves.
const HF_DIR_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "model.safetensors.index.json",
];

/// A connected `hf-hub` client plus the endpoint, for messages.
pub(crate) struct Hub {
    api: Api,
    endpoint: String,
}

impl Hub {
    /// Probes the endpoint and builds the client. `model` and `looked` only go into the error
    /// returned when the Hub cannot be reached (`None` endpoint = Hub disabled).
    pub(crate) fn connect(opts: &FetchOptions, model: &str, looked: &str) -> Result<Hub> {
        let Some(endpoint) = opts.hub_endpoint.clone() else {
            return Err(FetchError::NotCached {
                model: model.to_string(),
                looked: looked.to_string(),
                hint: "; the Hub is disabled (HF_HUB_OFFLINE)".into(),
            });
        };
        crate::net::probe(&endpoint, opts.connect_timeout).map_err(|reason| {
            FetchError::HubUnreachable {
                model: model.to_string(),
                looked: looked.to_string(),
                endpoint: endpoint.clone(),
                reason,
            }
        })?;
        let api = ApiBuilder::new()
            .with_cache_dir(opts.hf_cache_dir.clone())
            .with_endpoint(endpoint.clone())
            .with_token(opts.hf_token.clone())
            .with_progress(opts.progress)
            .with_retries(2)
            .build()
            .map_err(|e| FetchError::Hub {
                model: model.to_string(),
                endpoint: endpoint.clone(),
                reason: e.to_string(),
            })?;
        Ok(Hub { api, endpoint })
    }

    fn err(&self, model: &str, reason: impl std::fmt::Display) -> FetchError {
        FetchError::Hub {
            model: model.to_string(),
            endpoint: self.endpoint.clone(),
            reason: reason.to_string(),
        }
    }

    fn repo(&self, id: &ModelId) -> hf_hub::api::sync::ApiRepo {
        self.api.repo(Repo::with_revision(
            id.repo.clone(),
            RepoType::Model,
            id.revision_or_main().to_string(),
        ))
    }

    /// Downloads one file of a repo; returns its path in the snapshot directory.
    pub(crate) fn get_file(&self, id: &ModelId, file: &str) -> Result<PathBuf> {
        self.repo(id)
            .get(file)
            .map_err(|e| self.err(&format!("{}:{file}", id.repo), e))
    }

    /// Downloads what `id` names: the given GGUF, else the safetensors model files, else the
    /// repo's only GGUF.
    pub(crate) fn download(&self, id: &ModelId) -> Result<()> {
        if let Some(file) = &id.file {
            return self.get_file(id, file).map(|_| ());
        }
        let info = self.repo(id).info().map_err(|e| self.err(&id.repo, e))?;
        let names: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        let wanted = files_to_fetch(&names).map_err(|reason| match reason {
            Pick::Ambiguous(candidates) => FetchError::AmbiguousGguf {
                spec: id.repo.clone(),
                candidates,
            },
            Pick::Nothing => self.err(
                &id.repo,
                "the repo has neither *.safetensors nor *.gguf files",
            ),
        })?;
        for file in wanted {
            self.get_file(id, file)?;
        }
        Ok(())
    }
}

/// Why no file list could be chosen.
#[derive(Debug, PartialEq)]
enum Pick {
    Ambiguous(Vec<String>),
    Nothing,
}

/// The files to fetch for a repo without an explicit file, from its file list.
fn files_to_fetch<'a>(names: &[&'a str]) -> std::result::Result<Vec<&'a str>, Pick> {
    let is_top = |n: &&str| !n.contains('/');
    let safetensors: Vec<&str> = names
        .iter()
        .copied()
        .filter(is_top)
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    if !safetensors.is_empty() && names.contains(&"config.json") {
        let mut files: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| HF_DIR_FILES.contains(n))
            .collect();
        files.extend(safetensors);
        return Ok(files);
    }
    let ggufs: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    match ggufs.as_slice() {
        [] => Err(Pick::Nothing),
        [one] => Ok(vec![*one]),
        many => Err(Pick::Ambiguous(
            many.iter().map(|s| s.to_string()).collect(),
        )),
    }
}

/// The blob behind a snapshot path (snapshot entries are symlinks into `blobs/`).
pub(crate) fn blob_of(snapshot_file: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(snapshot_file)
        .map_err(|e| FetchError::io(format!("resolving {}", snapshot_file.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_safetensors_model_files() {
        let names = [
            "README.md",
            "config.json",
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "onnx/model.safetensors",
        ];
        let got = files_to_fetch(&names).expect("pick");
        assert_eq!(
            got,
            [
                "config.json",
                "tokenizer.json",
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
    }

    #[test]
    fn picks_single_gguf_or_complains() {
        assert_eq!(
            files_to_fetch(&["README.md", "m-q4.gguf"]),
            Ok(vec!["m-q4.gguf"])
        );
        assert_eq!(
            files_to_fetch(&["a.gguf", "b.gguf"]),
            Err(Pick::Ambiguous(vec!["a.gguf".into(), "b.gguf".into()]))
        );
        assert_eq!(files_to_fetch(&["README.md"]), Err(Pick::Nothing));
    }

    #[test]
    fn disabled_hub_is_not_cached_error() {
        let mut opts = FetchOptions::from_env_with(|_| None, false);
        opts.hub_endpoint = None;
        let err = Hub::connect(&opts, "org/x", "/c/models--org--x")
            .err()
            .expect("disabled");
        assert!(err.to_string().contains("HF_HUB_OFFLINE"), "{err}");
    }
}
