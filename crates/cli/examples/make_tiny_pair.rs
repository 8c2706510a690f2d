//! Writes a tiny synthetic model pair (random weights, the synthetic byte-level tokenizer
//! and ChatML template) and a `tokenrouter serve` config routing between them, for
//! end-to-end tests that need the real engine without downloading anything (the web view's
//! browser test, `crates/server/tests/browser/run.sh`):
//!
//!     cargo run --release -p tokenrouter --example make_tiny_pair -- <dir> [method]
//!     tokenrouter serve --config <dir>/config.yaml --port 30123
//!
//! `method`: `random` (default: 30% of the small model's steps go to the large model, the
//! decision seeded per request, so a request with a `seed` routes the same way every time)
//! or `rstitch` (entropy threshold). Same arguments, same files.

use std::path::PathBuf;

use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::Arch;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: make_tiny_pair <dir> [random|rstitch]")?,
    );
    let method = args.next().unwrap_or_else(|| "random".into());
    let (kwargs, llm_kwargs) = match method.as_str() {
        "random" => ("{p: 0.3, seed: 7}", "{p: 0.3, seed: 7}"),
        "rstitch" => ("{threshold: 0.9}", "{threshold: 0.9}"),
        other => return Err(format!("unknown method {other:?} (random or rstitch)").into()),
    };
    let mut small = SynthSpec::tiny(Arch::Qwen2, 21);
    small.scale = 0.4;
    let mut large = SynthSpec::tiny(Arch::Qwen3, 22);
    large.scale = 0.4;
    large.num_layers = 3;
    let small_dir = write_hf_dir(&small, &dir.join("small"))?;
    let large_dir = write_hf_dir(&large, &dir.join("large"))?;
    let config = format!(
        "# Tiny synthetic pair for tests (written by make_tiny_pair).\n\
         model:\n  \
           small:\n    \
             model_path: {}\n    \
             scheduler_class: {method}_slm\n    \
             scheduler_kwargs: {kwargs}\n    \
             kv_cache_tokens: 8192\n  \
           large:\n    \
             model_path: {}\n    \
             scheduler_class: {method}_llm\n    \
             scheduler_kwargs: {llm_kwargs}\n    \
             kv_cache_tokens: 8192\n    \
             delayed_batching_threshold: [1, 2, 2, 3]\n\
         system:\n  \
           entry_model: small\n  \
           execution: async\n",
        small_dir.display(),
        large_dir.display()
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, config)?;
    println!("{}", path.display());
    Ok(())
}
