//! `random_weights: true` serves a model of a given shape (its config.json alone) with
//! random weights and the synthetic tokenizer: what the GPU benchmark uses for Qwen3-32B,
//! checked here on the CPU with tiny shapes.

mod common;

use common::{assert_all_free, greedy_request, prompt, run, start};
use std::time::Duration;
use tokenrouter_engine::EngineConfig;
use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::Arch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_weight_pair_serves_and_routes() {
    let dir = tempfile::tempdir().unwrap();
    let small = write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 1), &dir.path().join("s")).unwrap();
    let mut l = SynthSpec::tiny(Arch::Qwen3, 2);
    l.num_layers = 3;
    let large = write_hf_dir(&l, &dir.path().join("l")).unwrap();
    // Only the shapes are kept: the weights and tokenizer files are not read.
    let yaml = format!(
        "model:\n  quick:\n    model_path: {}\n    random_weights: true\n    scheduler_class: random_slm\n    scheduler_kwargs: {{p: 0.5, seed: 3}}\n    kv_cache_tokens: 4096\n  reference:\n    model_path: {}\n    random_weights: true\n    scheduler_class: random_llm\n    kv_cache_tokens: 4096\n    delayed_batching_threshold: 2\nsystem:\n  entry_model: quick\n",
        small.join("config.json").display(),
        large.join("config.json").display()
    );
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, yaml).unwrap();
    let e = start(EngineConfig::from_file(&file).unwrap());
    let text = e.text().expect("text model");
    assert!(text.encode("hello world").unwrap().len() >= 2);
    let mut handles = Vec::new();
    for i in 0..4 {
        let e = e.clone();
        handles.push(tokio::spawn(async move {
            run(&e, greedy_request(prompt(5 + i, i as u32), 24)).await
        }));
    }
    let mut sources = Vec::new();
    for h in handles {
        let (ids, src) = h.await.unwrap();
        assert_eq!(ids.len(), 24);
        sources.extend(src);
    }
    assert!(sources.contains(&0) && sources.contains(&1), "{sources:?}");
    assert_all_free(&e, Duration::from_secs(5));
    e.shutdown();
}
