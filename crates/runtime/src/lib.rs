//! tokenrouter's model runtime: a ragged-batch transformer forward for Qwen3 / Qwen2 /
//! Llama over a paged KV cache, loaded from GGUF or Hugging Face safetensors, plus the
//! tokenizer / chat-template side and per-request sampling. The engine only talks to
//! [`Runner::step`], which is backend-neutral.

mod attention;
mod attention_device;
mod config;
/// The CUDA host side: our kernels' launchers, their checks and the op profiler.
#[cfg(feature = "cuda")]
pub mod cuda;
mod device_spec;
mod error;
mod ggml_ops;
mod gguf_tensor;
mod host_memory;
mod kernel_options;
mod kv;
mod load;
pub mod model;
mod prefix_cache;
pub mod runner;
pub mod sampling;
/// Synthetic test models written as HF directories or GGUF files (feature `synth`).
#[cfg(feature = "synth")]
pub mod synth;
mod synth_vocab;
mod template_json;
mod text;
mod weights;

pub use config::{Arch, ModelConfig};
pub use device_spec::DeviceSpec;
pub use error::{Result, RuntimeError};
pub use kernel_options::{CpuKernel, KernelOptions, Sampling, WeightMemory};
pub use kv::{KvCapacity, KvUsage, SeqId};
pub use load::{
    inspect, load_model, load_random, load_random_model, load_runner, KvBudget, LoadOptions,
    LoadedModel,
};
pub use runner::{Row, Runner, StepOptions, StepOutput};
pub use sampling::{RowDraw, Sampled, Sampler, SamplingParams};
pub use text::{check_shared_vocab, Message, SharedVocab, TextModel};
/// The CPU quantised matmuls (their own crate: they depend on nothing else here).
pub use tokenrouter_cpu_kernels as cpu_quant;
