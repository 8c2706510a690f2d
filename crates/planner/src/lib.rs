//! Delayed-batching planner for token-level routing: an exact discrete-time Markov model of M models
//! serving N requests in a closed loop (see `METHODS.md`, "Delayed batching"), a Monte-Carlo
//! cross-check, the threshold search, and the `plan-batching` command-line front end.
//!
//! Optionally the models share one processor (`PlanInput::sharing`, e.g. two models on the same CPU
//! cores): while k models are busy each progresses at 1/(1 + sharing·(k−1)) of its solo speed.
//!
//! The tick rules live in one place (`rules`) and are used by both the exact solver (`chain` +
//! `solve`, jumping between step-completion epochs) and the simulator (`sim`, tick by tick).

// The model state is a struct of per-model arrays (q, b, r); index loops over models read best.
#![allow(clippy::needless_range_loop)]

mod chain;
mod cli;
mod input;
mod optimize;
mod rules;
mod sim;
mod solve;

pub use cli::{run, PlanArgs};
pub use input::{Latency, PlanError, PlanInput, Result, MAX_CONCURRENCY, MAX_MODELS};
pub use optimize::{
    optimize, optimize_pinned, optimize_up_to, optimize_up_to_pinned, throughput, Plan,
};
pub use sim::simulate;
