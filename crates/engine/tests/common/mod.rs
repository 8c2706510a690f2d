//! Shared helpers for engine tests: a tiny synthetic model pair on disk, a config writer,
//! reference greedy decoding with the runtime alone, and request helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokenrouter_api::{Backend, GenerateEvent, GenerateRequest, SamplingParams};
use tokenrouter_engine::{Engine, EngineConfig};
use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::{load_model, Arch, LoadOptions, Row, Sampler, StepOptions};

pub struct Pair {
    pub dir: tempfile::TempDir,
    pub small: PathBuf,
    pub large: PathBuf,
}

pub fn pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let mut s = SynthSpec::tiny(Arch::Qwen2, 21);
    s.scale = 0.4;
    let mut l = SynthSpec::tiny(Arch::Qwen3, 22);
    l.scale = 0.4;
    l.num_layers = 3;
    let small = write_hf_dir(&s, &dir.path().join("small")).unwrap();
    let large = write_hf_dir(&l, &dir.path().join("large")).unwrap();
    Pair { dir, small, large }
}

pub fn config(
    p: &Pair,
    slm_class: &str,
    slm_kwargs: &str,
    llm_class: &str,
    extra_llm: &str,
    execution: &str,
) -> EngineConfig {
    let file = config_file(p, slm_class, slm_kwargs, llm_class, extra_llm, execution);
    EngineConfig::from_file(&file).unwrap()
}

/// Writes the config `config` parses (for tests of configs refused when read).
pub fn config_file(
    p: &Pair,
    slm_class: &str,
    slm_kwargs: &str,
    llm_class: &str,
    extra_llm: &str,
    execution: &str,
) -> std::path::PathBuf {
    let yaml = format!(
        "model:\n  quick:\n    model_path: {}\n    scheduler_class: {slm_class}\n    scheduler_kwargs: {slm_kwargs}\n    kv_cache_tokens: 8192\n  reference:\n    model_path: {}\n    scheduler_class: {llm_class}\n    kv_cache_tokens: 8192\n{extra_llm}system:\n  entry_model: quick\n  execution: {execution}\n",
        p.small.display(),
        p.large.display()
    );
    let file = p.dir.path().join("config.yaml");
    std::fs::write(&file, &yaml).unwrap();
    file
}

/// The tiny pair routing at random (p = 0.5): both models write most answers.
pub fn routed_pair() -> (Pair, Engine) {
    let p = pair();
    let e = start(config(
        &p,
        "random",
        "{p: 0.5, seed: 3}",
        "random",
        "",
        "async",
    ));
    (p, e)
}

pub fn start(cfg: EngineConfig) -> Engine {
    let e = Engine::start(cfg).unwrap();
    e.wait_ready(Duration::from_secs(60)).unwrap();
    e
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 3) % 250)
        .collect()
}

pub fn greedy_request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            seed: Some(1),
            ..Default::default()
        },
        max_tokens: Some(max_tokens),
        stop_token_ids: vec![],
        ignore_eos: true,
        pinned_model: None,
        top_logprobs: 0,
        routing: Default::default(),
        prompt_logprobs: None,
        constraint: None,
        priority: 0,
        cache_salt: None,
    }
}

/// Run a request to completion: (token ids, sources).
pub async fn run(e: &Engine, req: GenerateRequest) -> (Vec<u32>, Vec<usize>) {
    let mut s = e.submit(req).unwrap();
    let mut ids = Vec::new();
    let mut src = Vec::new();
    while let Some(ev) = s.events.recv().await {
        match ev {
            GenerateEvent::Token(t) => {
                ids.push(t.id);
                src.push(t.source);
            }
            GenerateEvent::Finished { .. } => break,
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
            GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
        }
    }
    (ids, src)
}

/// Greedy decoding with the runtime alone (the reference the engine must reproduce).
pub fn greedy_alone(model: &Path, prompt: &[u32], n: usize, limit: usize) -> Vec<u32> {
    let mut m = load_model(model, &LoadOptions::default()).unwrap();
    let mut s = Sampler::new(SamplingParams::greedy(), 0, prompt);
    let mut out = Vec::new();
    let mut next = prompt.to_vec();
    for _ in 0..n {
        let l = m
            .runner
            .step(&[Row::new(1, next.clone())], StepOptions::default())
            .unwrap()
            .logits_rows()
            .unwrap();
        let t = s.sample(&l[0], limit, 0).token;
        out.push(t);
        next = vec![t];
    }
    out
}

/// Wait until every model's KV is free and no request is active.
pub fn assert_all_free(e: &Engine, within: Duration) {
    let shared = e.shared().unwrap();
    let start = Instant::now();
    loop {
        let used: usize = shared
            .kv_used
            .iter()
            .map(|u| u.load(Ordering::SeqCst))
            .sum();
        let active = shared.active.load(Ordering::SeqCst);
        if used == 0 && active == 0 {
            return;
        }
        if start.elapsed() > within {
            panic!("KV not freed: {used} blocks in use, {active} active requests");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
