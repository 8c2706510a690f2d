//! Typed errors of the model runtime. Everything a user can cause (bad files, unknown
//! architectures, too-long sequences, a full KV cache) is a variant with a clear message,
//! so the engine and the server can react (queue, 400, start-up failure) instead of panicking.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid model file: {reason}")]
    BadFile { path: PathBuf, reason: String },
    #[error("{path}: unsupported architecture `{arch}` (supported: qwen3, qwen2, llama)")]
    UnknownArchitecture { path: PathBuf, arch: String },
    #[error("{path}: tensor `{name}`: {reason}")]
    BadTensor {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{path}: missing config key `{key}`")]
    MissingKey { path: PathBuf, key: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("models do not share a tokenizer: {0}")]
    TokenizerMismatch(String),
    #[error("sequence {seq} would have {len} tokens, more than the context length {max}")]
    ContextOverflow { seq: u64, len: usize, max: usize },
    #[error("KV cache is full: {needed} more blocks needed, {free} free of {total}")]
    OutOfBlocks {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

impl RuntimeError {
    pub(crate) fn bad_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        RuntimeError::BadFile {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
