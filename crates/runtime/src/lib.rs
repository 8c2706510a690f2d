//! tokenrouter's model runtime: a ragged-batch transformer forward for Qwen3 / Qwen2 /
//! Llama over a paged KV cache, loaded from GGUF or Hugging Face safetensors, plus the
//! tokenizer / chat-template side and per-request sampling. The engine only talks to
//! [`Runner::step`], which is backend-neutral.

pub mod attention;
pub mod attention_device;
pub mod config;
/// The CUDA host side: our kernels' launchers, their checks and the op profiler.
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device_spec;
pub mod error;
pub mod ggml_ops;
pub mod kernel_options;
pub mod kv;
pub mod load;
pub mod model;
pub mod runner;
pub mod sampling;
pub mod synth;
pub mod text;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use device_spec::DeviceSpec;
pub use error::{Result, RuntimeError};
pub use kernel_options::{CpuKernel, KernelOptions};
pub use kv::{KvCapacity, KvUsage, SeqId};
pub use load::{
    inspect, load_model, load_random, load_random_model, load_runner, KvBudget, LoadOptions,
    LoadedModel,
};
pub use runner::{Row, Runner, StepOptions, StepOutput};
pub use sampling::{Sampled, Sampler, SamplingParams};
pub use text::{check_shared_vocab, Message, SharedVocab, TextModel};
/// The CPU quantised matmuls (their own crate: they depend on nothing else here).
pub use tokenrouter_cpu_kernels as cpu_quant;
