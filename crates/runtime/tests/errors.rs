//! Bad input gives a clear typed error, never a panic.

use candle_core::quantized::GgmlDType;
use tokenrouter_runtime::synth::{write_gguf, write_hf_dir, SynthSpec};
use tokenrouter_runtime::{
    check_shared_vocab, load_model, Arch, KvBudget, LoadOptions, Row, RuntimeError, StepOptions,
};

fn opts(tokens: usize) -> LoadOptions {
    LoadOptions {
        kv: KvBudget::Tokens(tokens),
        ..LoadOptions::default()
    }
}

fn err_of<T>(r: Result<T, RuntimeError>) -> RuntimeError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn missing_corrupt_and_truncated_files() {
    let dir = tempfile::tempdir().unwrap();
    let e = err_of(load_model(&dir.path().join("nope.gguf"), &opts(64)));
    assert!(matches!(e, RuntimeError::Io { .. }), "{e}");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a gguf file at all").unwrap();
    let e = err_of(load_model(&junk, &opts(64)));
    assert!(e.to_string().contains("junk.gguf"), "{e}");
    let good = write_gguf(
        &SynthSpec::tiny(Arch::Qwen2, 1),
        &dir.path().join("g.gguf"),
        GgmlDType::Q8_0,
    )
    .unwrap();
    let bytes = std::fs::read(&good).unwrap();
    for cut in [bytes.len() / 2, bytes.len() - 10, 100] {
        let t = dir.path().join(format!("t{cut}.gguf"));
        std::fs::write(&t, &bytes[..cut]).unwrap();
        let e = err_of(load_model(&t, &opts(64)));
        assert!(e.to_string().contains(&format!("t{cut}.gguf")), "{e}");
    }
}

#[test]
fn unknown_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_hf_dir(&SynthSpec::tiny(Arch::Llama, 1), &dir.path().join("m")).unwrap();
    let cfg_path = p.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(&cfg_path, text).unwrap();
    let e = err_of(load_model(&p, &opts(64)));
    assert!(
        matches!(&e, RuntimeError::UnknownArchitecture { arch, .. } if arch == "gpt_neox"),
        "{e}"
    );
}

#[test]
fn too_long_and_out_of_blocks_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 1), &dir.path().join("m")).unwrap();
    let mut m = load_model(&p, &opts(64)).unwrap();
    let e = err_of(
        m.runner
            .step(&[Row::new(1, vec![1; 600])], StepOptions::default()),
    );
    assert!(
        matches!(e, RuntimeError::ContextOverflow { max: 512, .. }),
        "{e}"
    );
    m.runner
        .step(&[Row::new(1, vec![1; 60])], StepOptions::default())
        .unwrap();
    let e = err_of(
        m.runner
            .step(&[Row::new(2, vec![1; 10])], StepOptions::default()),
    );
    assert!(matches!(e, RuntimeError::OutOfBlocks { .. }), "{e}");
    assert_eq!(m.runner.seq_len(2), None, "failed step leaves no trace");
    let e = err_of(
        m.runner
            .step(&[Row::new(1, vec![100_000])], StepOptions::default()),
    );
    assert!(matches!(e, RuntimeError::InvalidStep(_)), "{e}");
    m.runner.free(1);
    assert_eq!(m.runner.usage().used_blocks, 0);
}

#[test]
fn tokenizer_pair_check() {
    let dir = tempfile::tempdir().unwrap();
    let a = load_model(
        &write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 1), &dir.path().join("a")).unwrap(),
        &opts(64),
    )
    .unwrap();
    let b = load_model(
        &write_hf_dir(&SynthSpec::tiny(Arch::Qwen2, 2), &dir.path().join("b")).unwrap(),
        &opts(64),
    )
    .unwrap();
    let shared = check_shared_vocab(&[("a", &a.text, 288), ("b", &b.text, 288)]).unwrap();
    assert_eq!(shared.sample_limit, a.text.vocab_len());
    assert!(shared.sample_limit < 288, "padding ids are masked");
    // A tokenizer whose table differs is refused, naming both models.
    let c_dir = dir.path().join("c");
    write_hf_dir(&SynthSpec::tiny(Arch::Qwen2, 3), &c_dir).unwrap();
    // Swap the ids of two tokens: same strings, different table.
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c_dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (a_id, b_id) = (vocab["A"].clone(), vocab["B"].clone());
    vocab.insert("A".into(), b_id);
    vocab.insert("B".into(), a_id);
    std::fs::write(c_dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let c = load_model(&c_dir, &opts(64)).unwrap();
    let e = err_of(check_shared_vocab(&[
        ("a", &a.text, 288),
        ("c", &c.text, 288),
    ]));
    assert!(
        matches!(e, RuntimeError::TokenizerMismatch(_)) && e.to_string().contains("`c`"),
        "{e}"
    );
}

#[test]
fn chat_template_renders_with_extra_kwargs() {
    let dir = tempfile::tempdir().unwrap();
    let m = load_model(
        &write_hf_dir(&SynthSpec::tiny(Arch::Qwen3, 1), &dir.path().join("a")).unwrap(),
        &opts(64),
    )
    .unwrap();
    let msgs = vec![tokenrouter_runtime::Message::new("user", "hi")];
    let s = m
        .text
        .apply_chat_template(&msgs, true, &serde_json::json!({"enable_thinking": false}))
        .unwrap();
    assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    let ids = m.text.encode(&s).unwrap();
    assert!(ids.contains(&tokenrouter_runtime::synth::eos_id()));
    assert!(m
        .text
        .eos_ids()
        .contains(&tokenrouter_runtime::synth::eos_id()));
}
