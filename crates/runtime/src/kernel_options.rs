//! Which kernels a model runs on: one typed set of switches per model, given to the loader
//! (`LoadOptions::kernels`), set from YAML (`runtime:` of a model) or, at the binary's edge,
//! from the `TOKENROUTER_*` variables (parsed there with one rule, see the README's table).
//! The library never reads the environment.
//!
//! The CPU choices are made once per weight at load. The CUDA choices are read inside
//! candle custom ops that only get tensors (the skinny matmul, the launch attribute, the
//! attention kernel), so a model makes its options current for the thread while it runs a
//! step ([`Scope`]); each sub-server steps its model on its own thread.

use serde::Deserialize;
use std::cell::Cell;
pub use tokenrouter_cpu_kernels::{CpuKernel, WeightMemory};

/// The kernel switches of one model. Every default is the fast path; the switches exist to
/// compare against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KernelOptions {
    /// Q5_0 / Q8_0 weights on the CPU.
    pub cpu_q5: CpuKernel,
    /// Q4_K / Q6_K weights on the CPU.
    pub cpu_qk: CpuKernel,
    /// Stack q/k/v and gate/up into one CPU matmul each where their types agree (off by
    /// default: three alternating rounds had prefill 4-8% slower with it, decode and
    /// batches mixed; docs/benchmarks.md, session 27).
    pub cpu_fuse: bool,
    /// Our CPU kernels' weights of 2 MiB and more on transparent huge pages (off: the heap;
    /// see `tokenrouter_cpu_kernels::WeightMemory`).
    pub cpu_huge_pages: bool,
    /// The fused CUDA forward (off: candle ops only).
    pub fused_kernels: bool,
    /// CUDA graphs for decode steps.
    pub cuda_graphs: bool,
    /// Our skinny matmul for decode-sized bf16 inputs (off: cuBLAS).
    pub gemv: bool,
    /// Its variants with the norm / activation / residual folded in (needs `gemv`).
    pub fused_gemv: bool,
    /// Programmatic dependent launch (compute capability 9.0+).
    pub pdl: bool,
    /// Grouped-query attention on tensor cores where the kernel exists for the heads.
    pub attention_mma: bool,
    /// Score tiles instead of the split kernel for 1-2 token steps.
    pub attention_tiles: bool,
    /// Combine attention splits in the split kernel's last block (measured slower).
    pub attention_combine_in_kernel: bool,
    /// Greedy rows with structured output pick on the device under an uploaded token mask
    /// (off: such a step's logits all come to the host and are sampled there).
    pub device_masks: bool,
    /// Where rows are sampled when not every row is plain greedy (see [`Sampling`]).
    pub sampling: Sampling,
}

/// Where a step's sampled rows draw their tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sampling {
    /// `device` on a GPU, `host` on a CPU.
    #[default]
    Auto,
    /// Each request's sampler on the host, over all the step's logits copied there; on a
    /// GPU an all-greedy batch is picked by candle's argmax ops there.
    Host,
    /// Every row that can (at most `race::TOP_MAX` top logprobs, a token mask only with
    /// `device_masks`) draws where the logits are (`sampling::race`, penalties and bias as
    /// sparse adjustments: a few numbers per row reach the host); the others on the host.
    /// An all-greedy batch too. On a CPU: the GPU's algorithm, to compare with it.
    Device,
}

impl Sampling {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "host" => Some(Self::Host),
            "device" => Some(Self::Device),
            _ => None,
        }
    }

    /// Whether rows draw where the logits are, for logits on a GPU (`gpu`) or the CPU.
    pub fn on_device(self, gpu: bool) -> bool {
        match self {
            Self::Auto => gpu,
            Self::Host => false,
            Self::Device => true,
        }
    }
}

impl KernelOptions {
    /// Where our CPU kernels keep their weights.
    pub fn cpu_weight_memory(&self) -> WeightMemory {
        if self.cpu_huge_pages {
            WeightMemory::HugePages
        } else {
            WeightMemory::Heap
        }
    }
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            cpu_q5: CpuKernel::Auto,
            cpu_qk: CpuKernel::Auto,
            cpu_fuse: false,
            cpu_huge_pages: true,
            fused_kernels: true,
            cuda_graphs: true,
            gemv: true,
            fused_gemv: true,
            pdl: true,
            attention_mma: true,
            attention_tiles: false,
            attention_combine_in_kernel: false,
            device_masks: true,
            sampling: Sampling::Auto,
        }
    }
}

thread_local! {
    static CURRENT: Cell<KernelOptions> = Cell::new(KernelOptions::default());
}

impl KernelOptions {
    /// The options of the model stepping on this thread (defaults outside a step).
    pub fn current() -> Self {
        CURRENT.with(Cell::get)
    }

    /// Make these the current options of this thread until the scope ends.
    pub fn enter(self) -> Scope {
        Scope(CURRENT.with(|c| c.replace(self)))
    }
}

/// Restores the thread's previous options when dropped.
#[must_use = "the options apply while the scope lives"]
pub struct Scope(KernelOptions);

impl Drop for Scope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(KernelOptions::current(), KernelOptions::default());
        let off = KernelOptions {
            gemv: false,
            ..KernelOptions::default()
        };
        {
            let _a = off.enter();
            assert!(!KernelOptions::current().gemv);
            {
                let _b = KernelOptions::default().enter();
                assert!(KernelOptions::current().gemv);
            }
            assert!(!KernelOptions::current().gemv);
        }
        assert_eq!(KernelOptions::current(), KernelOptions::default());
    }

    #[test]
    fn yaml_names_every_switch_and_refuses_unknown_ones() {
        let o: KernelOptions =
            serde_yaml::from_str("{cpu_qk: scalar, cuda_graphs: false, attention_mma: false}")
                .unwrap();
        assert_eq!(o.cpu_qk, CpuKernel::Scalar);
        assert!(!o.cuda_graphs && !o.attention_mma && o.gemv);
        assert!(serde_yaml::from_str::<KernelOptions>("{cuda_graph: false}").is_err());
        assert!(serde_yaml::from_str::<KernelOptions>("{cpu_q5: fast}").is_err());
    }
}
