//! A tiny synthetic model pair and its config, written to a directory: random weights of
//! two architectures sharing one tokenizer, routed at random. What the end-to-end tests,
//! the Python package's tests and anyone trying the engine without a download run on.

use std::path::{Path, PathBuf};

use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::Arch;

use crate::EngineError;

/// Writes `small/` (Qwen2, 1 layer), `large/` (Qwen3, 3 layers) and `tiny.yaml` under `dir`:
/// `quick` routes each token to `reference` with probability `p` (seeded), the large model
/// delays batching up to 2. `system_extra` is appended to the `system:` section (indented
/// lines). Returns the config's path.
pub fn write_tiny_pair(
    dir: &Path,
    p: f64,
    seed: u64,
    system_extra: &str,
) -> Result<PathBuf, EngineError> {
    if !(0.0..=1.0).contains(&p) {
        return Err(EngineError::Start(format!(
            "the routing probability must be within [0, 1], got {p}"
        )));
    }
    // Untied embeddings: with tied ones a random model mostly repeats its last token.
    let mut small = SynthSpec::tiny(Arch::Qwen2, 1);
    small.max_position = 4096;
    small.tie_embeddings = false;
    let mut large = SynthSpec::tiny(Arch::Qwen3, 2);
    large.max_position = 4096;
    large.num_layers = 3;
    large.tie_embeddings = false;
    let write = |spec: &SynthSpec, name: &str| {
        write_hf_dir(spec, &dir.join(name)).map_err(|e| EngineError::Model {
            model: name.into(),
            path: dir.join(name).display().to_string(),
            message: e.to_string(),
        })
    };
    let small = write(&small, "small")?;
    let large = write(&large, "large")?;
    let yaml = format!(
        "model:
  quick:
    model_path: {}
    scheduler_class: random_slm
    scheduler_kwargs: {{p: {p}, seed: {seed}}}
    kv_cache_tokens: 16384
  reference:
    model_path: {}
    scheduler_class: random_llm
    kv_cache_tokens: 16384
    delayed_batching_threshold: [1, 2]
system:
  entry_model: quick
  execution: async
{system_extra}",
        small.display(),
        large.display()
    );
    let file = dir.join("tiny.yaml");
    std::fs::write(&file, yaml)
        .map_err(|e| EngineError::Start(format!("cannot write {}: {e}", file.display())))?;
    Ok(file)
}
