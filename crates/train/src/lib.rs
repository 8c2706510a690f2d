//! Router training inside the engine, for any pair of models that share a tokenizer: the
//! pair labels its own disagreements (R2R's steps 0-1: the large model answers, the small
//! model is teacher-forced on those answers), and R2R's classifier is fitted on the
//! small model's features with candle's autograd. The result is a `.safetensors` + JSON
//! pair that the `r2r` method loads unchanged.
//!
//! `label` writes resumable shards to a directory; `diverge` continues each disagreement
//! and judges whether it matters (R2R's steps 2-3); `fit` reads them. `prompts` builds an
//! offline prompt set from the documented functions of the local Python standard library
//! (never from an evaluation set).

pub mod diverge;
pub mod fit;
pub mod judge;
pub mod label;
pub mod metrics;
pub mod net;
pub mod prompts;
pub mod shard;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Input(String),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("loading the pair: {0}")]
    Engine(#[from] tokenrouter_engine::EngineError),
    #[error("config: {0}")]
    Config(#[from] tokenrouter_engine::config::ConfigError),
    #[error("model: {0}")]
    Runtime(#[from] tokenrouter_runtime::RuntimeError),
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl TrainError {
    pub fn file(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        TrainError::File {
            path: path.into(),
            message: message.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, TrainError>;

/// `tokenrouter train-router ...`
#[derive(clap::Subcommand)]
pub enum TrainCommand {
    /// Label a prompt set with the pair (large answers, small teacher-forced features).
    Label(label::LabelArgs),
    /// Continue every disagreement with the large model and judge which ones matter (R2R's
    /// steps 2-3); `fit --labels divergent` then routes only those.
    Diverge(diverge::DivergeArgs),
    /// Fit R2R's classifier on labelled features and write router.safetensors + router.json.
    Fit(fit::FitArgs),
    /// Write a prompt set from the documented functions of the local Python stdlib.
    Prompts(prompts::PromptsArgs),
}

/// Run one `train-router` subcommand; prints a summary on stdout.
pub fn run(cmd: TrainCommand) -> Result<()> {
    match cmd {
        TrainCommand::Label(a) => {
            let stats = label::run(&a)?;
            println!("{}", stats.summary());
        }
        TrainCommand::Diverge(a) => {
            let stats = diverge::run(&a)?;
            println!("{}", stats.summary(a.judge));
        }
        TrainCommand::Fit(a) => {
            let report = fit::run(&a)?;
            println!("{}", report.summary());
        }
        TrainCommand::Prompts(a) => {
            let n = prompts::write_stdlib_prompts(&a)?;
            println!("wrote {n} prompts to {}", a.out.display());
        }
    }
    Ok(())
}
