//! The `TOKENROUTER_*` kernel switches, read here at the binary's edge and nowhere else:
//! one parsing rule for every switch (on: `1 true on yes`, off: `0 false off no`, anything
//! else is an error naming the variable), applied over each model's YAML `runtime:`
//! options. The README's table lists them.

use anyhow::{bail, Result};
use tokenrouter_runtime::{CpuKernel, KernelOptions, Sampling};

/// A variable and the field of the options it sets.
type Switch<T> = (&'static str, fn(&mut KernelOptions) -> &mut T);

/// The boolean switches.
const FLAGS: &[Switch<bool>] = &[
    ("TOKENROUTER_CPU_FUSE", |k| &mut k.cpu_fuse),
    ("TOKENROUTER_CPU_HUGE_PAGES", |k| &mut k.cpu_huge_pages),
    ("TOKENROUTER_FUSED_KERNELS", |k| &mut k.fused_kernels),
    ("TOKENROUTER_CUDA_GRAPHS", |k| &mut k.cuda_graphs),
    ("TOKENROUTER_GEMV", |k| &mut k.gemv),
    ("TOKENROUTER_FUSED_GEMV", |k| &mut k.fused_gemv),
    ("TOKENROUTER_PDL", |k| &mut k.pdl),
    ("TOKENROUTER_ATTN_MMA", |k| &mut k.attention_mma),
    ("TOKENROUTER_ATTN_TILES", |k| &mut k.attention_tiles),
    ("TOKENROUTER_ATTN_COMBINE_IN_KERNEL", |k| {
        &mut k.attention_combine_in_kernel
    }),
    ("TOKENROUTER_DEVICE_MASKS", |k| &mut k.device_masks),
];

/// The CPU kernel choices.
const CHOICES: &[Switch<CpuKernel>] = &[
    ("TOKENROUTER_CPU_Q5", |k| &mut k.cpu_q5),
    ("TOKENROUTER_CPU_QK", |k| &mut k.cpu_qk),
];

fn parse_flag(var: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => bail!("{var}={value:?}: expected 1/true/on/yes or 0/false/off/no"),
    }
}

/// Set over `opts` every switch that `get` (the environment, or a test's map) names.
pub fn apply_with(opts: &mut KernelOptions, get: impl Fn(&str) -> Option<String>) -> Result<()> {
    for (var, field) in FLAGS {
        if let Some(v) = get(var) {
            *field(opts) = parse_flag(var, &v)?;
        }
    }
    for (var, field) in CHOICES {
        if let Some(v) = get(var) {
            *field(opts) = CpuKernel::parse(v.trim()).ok_or_else(|| {
                anyhow::anyhow!("{var}={v:?}: expected auto, candle, scalar or avx2")
            })?;
        }
    }
    if let Some(v) = get(SAMPLING) {
        opts.sampling = Sampling::parse(v.trim())
            .ok_or_else(|| anyhow::anyhow!("{SAMPLING}={v:?}: expected auto, host or device"))?;
    }
    Ok(())
}

/// Where sampled rows draw (`runtime.sampling`).
const SAMPLING: &str = "TOKENROUTER_SAMPLING";

/// [`apply_with`] from the process environment.
pub fn apply(opts: &mut KernelOptions) -> Result<()> {
    apply_with(opts, |var| std::env::var(var).ok())
}

/// The defaults with the environment's switches over them.
pub fn from_env() -> Result<KernelOptions> {
    let mut k = KernelOptions::default();
    apply(&mut k)?;
    Ok(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<KernelOptions> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut k = KernelOptions::default();
        apply_with(&mut k, |var| map.get(var).cloned())?;
        Ok(k)
    }

    #[test]
    fn one_rule_for_every_switch() {
        // `true` means on for every switch (it used to turn tensor-core attention off).
        let k = with(&[("TOKENROUTER_ATTN_MMA", "true"), ("TOKENROUTER_PDL", "0")]).unwrap();
        assert!(k.attention_mma && !k.pdl);
        let k = with(&[
            ("TOKENROUTER_ATTN_TILES", "on"),
            ("TOKENROUTER_GEMV", "OFF"),
        ])
        .unwrap();
        assert!(k.attention_tiles && !k.gemv);
        let k = with(&[("TOKENROUTER_CPU_QK", "scalar")]).unwrap();
        assert_eq!(k.cpu_qk, CpuKernel::Scalar);
        let k = with(&[("TOKENROUTER_CPU_HUGE_PAGES", "no")]).unwrap();
        assert_eq!(
            k.cpu_weight_memory(),
            tokenrouter_runtime::WeightMemory::Heap
        );
        assert_eq!(
            KernelOptions::default().cpu_weight_memory(),
            tokenrouter_runtime::WeightMemory::HugePages
        );
        assert_eq!(with(&[]).unwrap(), KernelOptions::default());
        let e = with(&[("TOKENROUTER_CUDA_GRAPHS", "nope")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("TOKENROUTER_CUDA_GRAPHS"), "{e}");
        let k = with(&[("TOKENROUTER_SAMPLING", "host")]).unwrap();
        assert_eq!(k.sampling, Sampling::Host);
        let e = with(&[("TOKENROUTER_SAMPLING", "gpu")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TOKENROUTER_SAMPLING") && e.contains("device"),
            "{e}"
        );
        let e = with(&[("TOKENROUTER_CPU_Q5", "fast")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TOKENROUTER_CPU_Q5") && e.contains("scalar"),
            "{e}"
        );
    }

    #[test]
    fn switches_apply_over_yaml_options() {
        let mut k = KernelOptions {
            cuda_graphs: false,
            cpu_q5: CpuKernel::Candle,
            ..KernelOptions::default()
        };
        apply_with(&mut k, |v| {
            (v == "TOKENROUTER_CPU_Q5").then(|| "avx2".into())
        })
        .unwrap();
        assert_eq!(k.cpu_q5, CpuKernel::Avx2);
        assert!(
            !k.cuda_graphs,
            "a switch the environment does not name stays as configured"
        );
    }
}
