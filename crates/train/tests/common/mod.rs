//! The tiny synthetic pair and the labelling arguments the training tests share.
#![allow(dead_code)]

use candle_core::Device;
use std::path::{Path, PathBuf};
use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::{Arch, KvBudget, LoadOptions};
use tokenrouter_train::label::LabelArgs;

pub struct Pair {
    pub dir: tempfile::TempDir,
    pub small: PathBuf,
    pub large: PathBuf,
}

pub fn pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let mut s = SynthSpec::tiny(Arch::Qwen2, 31);
    s.scale = 0.4;
    // The same network at another scale: the two agree on some tokens and not on others,
    // like a real pair.
    let mut l = SynthSpec::tiny(Arch::Qwen2, 31);
    l.scale = 0.5;
    let small = write_hf_dir(&s, &dir.path().join("small")).unwrap();
    let large = write_hf_dir(&l, &dir.path().join("large")).unwrap();
    Pair { dir, small, large }
}

pub fn pair_config(p: &Pair, large: &Path, extra_small: &str) -> PathBuf {
    let yaml = format!(
        "model:\n  quick:\n    model_path: {}\n    kv_cache_tokens: 4096\n{extra_small}  reference:\n    model_path: {}\n    kv_cache_tokens: 4096\nsystem:\n  entry_model: quick\n",
        p.small.display(),
        large.display()
    );
    let file = p
        .dir
        .path()
        .join(format!("pair-{}.yaml", extra_small.len()));
    std::fs::write(&file, yaml).unwrap();
    file
}

pub fn write_prompts(dir: &Path, n: usize) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({"prompt": format!("def f{i}(a, b):\n    return a + {i} * b")})
                .to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

pub fn label_args(config: PathBuf, prompts: PathBuf, out: PathBuf) -> LabelArgs {
    LabelArgs {
        config,
        prompts,
        out,
        raw: true,
        max_tokens: 10,
        max_prompt_tokens: 1024,
        batch: 3,
        shard_size: 2,
        top_k: 8,
        limit: None,
        no_progress: true,
    }
}

pub fn opts() -> LoadOptions {
    LoadOptions {
        device: Device::Cpu,
        kv: KvBudget::Tokens(4096),
        dtype: candle_core::DType::F32,
        kernels: Default::default(),
    }
}
