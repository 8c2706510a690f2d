//! Bad configuration fails at start with a message naming the model, the key and the file.

mod common;

use common::*;
use std::time::Duration;
use tokenrouter_engine::Engine;

/// The error of a config refused when it is read: methods and kwargs are checked before any
/// weights load.
fn read_err(file: std::path::PathBuf) -> String {
    match tokenrouter_engine::EngineConfig::from_file(&file) {
        Ok(_) => panic!("expected the config to be refused when read"),
        Err(err) => err.to_string(),
    }
}

fn start_err(cfg: tokenrouter_engine::EngineConfig) -> String {
    let e = Engine::start(cfg).unwrap();
    match e.wait_ready(Duration::from_secs(60)) {
        Ok(()) => panic!("expected a start-up error"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn unknown_scheduler_class_names_model_key_and_file() {
    let p = pair();
    let msg = read_err(config_file(&p, "r3r", "{}", "random", "", "async"));
    assert!(
        msg.contains("model.quick.scheduler_class")
            && msg.contains("r3r")
            && msg.contains("config.yaml"),
        "{msg}"
    );
    assert!(msg.contains("rstitch"), "lists the known names: {msg}");
}

#[test]
fn wrong_kwargs_name_model_key_and_file() {
    let p = pair();
    let msg = read_err(config_file(
        &p,
        "random",
        "{p: 0.3, sead: 1}",
        "random",
        "",
        "async",
    ));
    assert!(
        msg.contains("model.quick.scheduler_kwargs")
            && msg.contains("sead")
            && msg.contains("config.yaml"),
        "{msg}"
    );
    let msg = read_err(config_file(&p, "random", "{p: 1.5}", "random", "", "async"));
    assert!(
        msg.contains("scheduler_kwargs.p") && msg.contains("1.5"),
        "{msg}"
    );
}

#[test]
fn models_whose_tokenizers_differ_are_refused() {
    let p = pair();
    let tok = p.large.join("tokenizer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["A"].clone(), vocab["B"].clone());
    vocab.insert("A".into(), b);
    vocab.insert("B".into(), a);
    std::fs::write(&tok, v.to_string()).unwrap();
    let msg = start_err(config(&p, "random", "{p: 0.3}", "random", "", "async"));
    assert!(
        msg.contains("do not share a tokenizer")
            && msg.contains("`reference`")
            && msg.contains("config.yaml"),
        "{msg}"
    );
}

#[test]
fn missing_model_file_names_the_model() {
    let p = pair();
    std::fs::remove_file(p.small.join("model.safetensors")).unwrap();
    let msg = start_err(config(&p, "random", "{p: 0.3}", "random", "", "async"));
    assert!(msg.contains("model `quick`"), "{msg}");
}
