//! tokenrouter's engine: one sub-server per model, an inter-model loop moving requests
//! between them as messages (KV never moves), routing policies chosen in YAML, delayed
//! batching, and a lockstep mode for comparison.

pub mod config;
pub(crate) mod dry_breakers;
pub mod engine;
pub mod exchange;
pub mod methods;
pub mod metrics;
pub mod overrides;
pub mod policy;
pub mod profile;
pub mod remote;
pub mod request;
pub mod routing_knob;
pub mod subserver;
#[cfg(feature = "synth")]
pub mod synth_pair;
pub mod tuner;
pub mod turn;
pub(crate) mod warmup;

pub use config::{EngineConfig, Execution, SchedulingPolicy, Threshold};
pub use engine::{
    load_config_models, ConfigModel, Engine, EngineError, FinishedGeneration, GenerateParams,
};
