//! R2R router against PyTorch: `tests/fixtures/r2r_router_tiny.pt` is a reduced-size router
//! in the official checkpoint format written by `scripts/make_r2r_fixture.py`, with the
//! inputs and PyTorch's probabilities in `r2r_router_tiny.json`.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenrouter_engine::policy::{PolicyContext, Registry, RowView, SendMode, StepView};

/// No per-request routing overrides.
static NO_ROUTING: tokenrouter_api::RoutingOverrides =
    tokenrouter_api::RoutingOverrides(std::collections::BTreeMap::new());

type EmbedFn = Arc<dyn Fn(&[u32]) -> candle_core::Result<Tensor> + Send + Sync>;

struct Fixture {
    hidden: usize,
    vocab: usize,
    threshold: f32,
    embedding: Vec<f32>,
    rows_hidden: Vec<f32>,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    probs: Vec<f32>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn load_fixture() -> Fixture {
    let text =
        std::fs::read_to_string(fixtures().join("r2r_router_tiny.json")).expect("fixture json");
    let j: serde_json::Value = serde_json::from_str(&text).expect("valid json");
    let rows = j["rows"].as_array().expect("rows");
    Fixture {
        hidden: j["hidden"].as_u64().expect("hidden") as usize,
        vocab: j["vocab"].as_u64().expect("vocab") as usize,
        threshold: j["threshold"].as_f64().expect("threshold") as f32,
        embedding: j["embedding"]
            .as_array()
            .expect("embedding")
            .iter()
            .flat_map(floats)
            .collect(),
        rows_hidden: rows.iter().flat_map(|r| floats(&r["hidden"])).collect(),
        tokens: rows
            .iter()
            .map(|r| r["token"].as_u64().expect("token") as u32)
            .collect(),
        logits: rows.iter().map(|r| floats(&r["logits"])).collect(),
        probs: floats(&j["probabilities"]),
    }
}

fn ctx(f: &Fixture, model: usize, embed_width: Option<usize>) -> PolicyContext {
    let embed: Option<EmbedFn> = embed_width.map(|w| {
        let table = if w == f.hidden {
            Tensor::from_vec(f.embedding.clone(), (f.vocab, w), &Device::Cpu)
        } else {
            Tensor::zeros((f.vocab, w), candle_core::DType::F32, &Device::Cpu)
        }
        .expect("embedding table");
        let g: EmbedFn =
            Arc::new(move |ids: &[u32]| table.index_select(&Tensor::new(ids, &Device::Cpu)?, 0));
        g
    });
    PolicyContext {
        model,
        model_names: vec!["quick".into(), "reference".into()],
        token_text: Arc::new(Vec::new()),
        vocab_size: f.vocab,
        sample_limit: f.vocab,
        config_file: fixtures().join("router_test.yaml"),
        embed,
        device: Device::Cpu,
    }
}

fn kwargs(y: &str) -> serde_yaml::Value {
    serde_yaml::from_str(y).expect("yaml")
}

/// Run one step over all fixture rows; returns (scores, routed-to).
fn run(
    policy: &mut dyn tokenrouter_engine::policy::Policy,
    f: &Fixture,
) -> (Vec<f32>, Vec<Option<usize>>) {
    run_with(policy, f, None)
}

/// `run`, optionally with the step's top logits instead of the full logits (as a GPU step
/// delivers them: `Needs::top_logits`).
fn run_with(
    policy: &mut dyn tokenrouter_engine::policy::Policy,
    f: &Fixture,
    top: Option<&[Vec<f32>]>,
) -> (Vec<f32>, Vec<Option<usize>>) {
    let hidden = Tensor::from_vec(
        f.rows_hidden.clone(),
        (f.tokens.len(), f.hidden),
        &Device::Cpu,
    )
    .expect("hidden");
    let rows: Vec<RowView> = (0..f.tokens.len())
        .map(|i| RowView {
            rid: i as u64,
            logits: if top.is_some() { &[] } else { &f.logits[i] },
            token: f.tokens[i],
            prompt: &[],
            output: &[],
            sources: &[],
            visit_tokens: 0,
            seed: i as u64,
            entropy: None,
            top_logits: top.map(|t| &t[i][..]),
            routing: &NO_ROUTING,
            allowed: None,
        })
        .collect();
    assert!(policy.needs().hidden, "r2r must ask for hidden states");
    let d = policy.route(&StepView {
        model: 0,
        rows: &rows,
        hidden: Some(&hidden),
    });
    assert_eq!(d.len(), rows.len());
    (
        d.iter()
            .map(|d| d.score.expect("r2r scores every row"))
            .collect(),
        d.iter().map(|d| d.to).collect(),
    )
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn probabilities_match_pytorch_and_threshold_comes_from_checkpoint() {
    let f = load_fixture();
    let reg = Registry::default();
    let mut p = reg
        .build(
            "r2r_slm",
            &kwargs("{model_path: r2r_router_tiny.pt, switching_strategy: neural}"),
            &ctx(&f, 0, Some(f.hidden)),
        )
        .expect("build r2r_slm");
    let (scores, to) = run(p.as_mut(), &f);
    let diff = max_diff(&scores, &f.probs);
    println!("r2r max |p_rust - p_torch| = {diff:e}");
    assert!(
        diff <= 1e-5,
        "max abs diff {diff} vs PyTorch; ours {scores:?}, torch {:?}",
        f.probs
    );
    // No YAML threshold: the checkpoint's common_args.threshold applies (not 0.5).
    let want: Vec<Option<usize>> = f
        .probs
        .iter()
        .map(|&q| (q >= f.threshold).then_some(1))
        .collect();
    assert_eq!(to, want);
    assert!(want.iter().any(Option::is_some) && want.iter().any(Option::is_none));
    assert_eq!(p.send(0, 1), SendMode::DropLast);
}

#[test]
fn yaml_threshold_wins() {
    let f = load_fixture();
    let reg = Registry::default();
    for (t, all) in [(0.0, true), (1.0, false)] {
        let k = kwargs(&format!(
            "{{model_path: r2r_router_tiny.pt, threshold: {t}}}"
        ));
        let mut p = reg
            .build("r2r", &k, &ctx(&f, 0, Some(f.hidden)))
            .expect("build");
        let (_, to) = run(p.as_mut(), &f);
        assert!(
            to.iter().all(|d| d.is_some() == all),
            "threshold {t}: {to:?}"
        );
    }
}

#[test]
fn safetensors_with_sidecar_and_embedding_table() {
    let f = load_fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tensors: HashMap<String, Tensor> = candle_core::pickle::read_all_with_key(
        fixtures().join("r2r_router_tiny.pt"),
        Some("state_dict"),
    )
    .expect("read pt")
    .into_iter()
    .collect();
    assert_eq!(tensors.len(), 22, "all official keys, no token_embeddings");
    tensors.insert(
        "token_embeddings.weight".into(),
        Tensor::from_vec(f.embedding.clone(), (f.vocab, f.hidden), &Device::Cpu).expect("table"),
    );
    let st = dir.path().join("router.safetensors");
    candle_core::safetensors::save(&tensors, &st).expect("save");
    std::fs::write(
        dir.path().join("router.json"),
        r#"{"common_args": {"threshold": 0.9}}"#,
    )
    .expect("sidecar");
    // No engine embedding: the checkpoint's token_embeddings.weight is used.
    let k = kwargs(&format!("{{model_path: {}}}", st.display()));
    let mut p = Registry::default()
        .build("r2r_slm", &k, &ctx(&f, 0, None))
        .expect("build from safetensors");
    let (scores, to) = run(p.as_mut(), &f);
    assert!(max_diff(&scores, &f.probs) <= 1e-5);
    let want: Vec<Option<usize>> = f.probs.iter().map(|&q| (q >= 0.9).then_some(1)).collect();
    assert_eq!(to, want, "sidecar threshold 0.9");

    // A missing tensor is named, with the model, the key and the file.
    tensors.remove("backbone.output_layer.1.weight");
    let broken = dir.path().join("broken.safetensors");
    candle_core::safetensors::save(&tensors, &broken).expect("save");
    let k = kwargs(&format!("{{model_path: {}}}", broken.display()));
    let e = Registry::default()
        .build("r2r_slm", &k, &ctx(&f, 0, None))
        .err()
        .expect("must fail")
        .to_string();
    for part in [
        "model.quick.scheduler_kwargs.model_path",
        "broken.safetensors",
        "backbone.output_layer.1.weight",
    ] {
        assert!(e.contains(part), "{e}");
    }
}

#[test]
fn config_errors_name_model_key_and_file() {
    let f = load_fixture();
    let reg = Registry::default();
    let err = |k: &str, c: &PolicyContext| {
        reg.build("r2r_slm", &kwargs(k), c)
            .err()
            .expect("must fail")
            .to_string()
    };
    let good = ctx(&f, 0, Some(f.hidden));
    let e = err("{model_path: r2r_router_tiny.pt, thresold: 0.3}", &good);
    assert!(
        e.contains("router_test.yaml")
            && e.contains("model.quick.scheduler_kwargs")
            && e.contains("thresold"),
        "{e}"
    );
    let e = err("{model_path: nowhere.pt}", &good);
    assert!(
        e.contains("model.quick.scheduler_kwargs.model_path") && e.contains("nowhere.pt"),
        "{e}"
    );
    let e = err("{threshold: 0.3}", &good);
    assert!(e.contains("model_path") && e.contains("required"), "{e}");
    let e = err("{model_path: r2r_router_tiny.pt, threshold: 1.5}", &good);
    assert!(e.contains("scheduler_kwargs.threshold"), "{e}");
    let e = err(
        "{model_path: r2r_router_tiny.pt, switching_strategy: entropy}",
        &good,
    );
    assert!(e.contains("switching_strategy"), "{e}");
    // The small model's hidden size differs from the router's.
    let e = err("{model_path: r2r_router_tiny.pt}", &ctx(&f, 0, Some(32)));
    assert!(
        e.contains("hidden size 64") && e.contains("32") && e.contains("r2r_router_tiny.pt"),
        "{e}"
    );
    // No embedding from the engine and none in the file.
    let e = err("{model_path: r2r_router_tiny.pt}", &ctx(&f, 0, None));
    assert!(
        e.contains("token_embeddings") && e.contains("model.quick"),
        "{e}"
    );
    // A vocabulary smaller than the router's top-k.
    let mut small = ctx(&f, 0, Some(f.hidden));
    small.sample_limit = 4;
    let e = err("{model_path: r2r_router_tiny.pt}", &small);
    assert!(e.contains("top 8"), "{e}");
    // A file that is not a checkpoint.
    let e = err("{model_path: r2r_router_tiny.json}", &good);
    assert!(
        e.contains("r2r_router_tiny.json") && e.contains("model_path"),
        "{e}"
    );
}

/// A row of a request visiting the large model (its second token there).
fn large_model_row<'a>(
    logits: &'a [f32],
    entropy: Option<f32>,
    routing: &'a tokenrouter_api::RoutingOverrides,
) -> RowView<'a> {
    RowView {
        rid: 9,
        logits,
        token: 3,
        prompt: &[],
        output: &[1, 2],
        sources: &[0, 0],
        visit_tokens: 1,
        seed: 0,
        entropy,
        top_logits: None,
        routing,
        allowed: None,
    }
}

#[test]
fn large_model_writes_one_token_and_returns() {
    let f = load_fixture();
    let mut p = Registry::default()
        .build("r2r_llm", &serde_yaml::Value::Null, &ctx(&f, 1, None))
        .expect("build");
    let logits = vec![0.0; 8];
    let rows = [large_model_row(&logits, None, &NO_ROUTING)];
    let d = p.route(&StepView {
        model: 1,
        rows: &rows,
        hidden: None,
    });
    assert_eq!(d[0].to, Some(0));
    assert_eq!(p.send(9, 0), SendMode::KeepLast);
}

/// With `stay_entropy` the large model keeps writing while its own normalised entropy is
/// above it (R-Stitch's rule), read per request under that key; the key belongs to the
/// large model only.
#[test]
fn with_stay_entropy_the_large_model_writes_while_unsure() {
    let f = load_fixture();
    let reg = Registry::default();
    let mut p = reg
        .build("r2r_llm", &kwargs("{stay_entropy: 0.5}"), &ctx(&f, 1, None))
        .expect("build");
    assert!(p.needs().entropy);
    let eager = tokenrouter_api::RoutingOverrides([("stay_entropy".to_string(), 0.95)].into());
    let row = |entropy, routing| large_model_row(&[], Some(entropy), routing);
    let rows = [
        row(0.9, &NO_ROUTING),
        row(0.1, &NO_ROUTING),
        row(0.9, &eager),
    ];
    let d = p.route(&StepView {
        model: 1,
        rows: &rows,
        hidden: None,
    });
    let to: Vec<_> = d.iter().map(|d| d.to).collect();
    assert_eq!(to, [None, Some(0), Some(0)]);
    assert_eq!(p.send(9, 0), SendMode::KeepLast);
    assert_eq!(p.tunables()[0].key, "stay_entropy");
    for (k, at, want) in [
        ("{stay_entropy: 1.5}", 1, "scheduler_kwargs.stay_entropy"),
        (
            "{model_path: r2r_router_tiny.pt, stay_entropy: 0.2}",
            0,
            "large model",
        ),
    ] {
        let e = reg
            .build(
                if at == 0 { "r2r_slm" } else { "r2r_llm" },
                &kwargs(k),
                &ctx(&f, at, Some(f.hidden)),
            )
            .err()
            .expect("must fail")
            .to_string();
        assert!(e.contains(want), "{k}: {e}");
    }
}

/// The router gives the same probabilities from the step's top logits (computed on the
/// model's device, no host logits) as from the full logits.
#[test]
fn probabilities_from_the_steps_top_logits_equal_those_from_full_logits() {
    let f = load_fixture();
    let reg = Registry::default();
    let build = || {
        reg.build(
            "r2r_slm",
            &kwargs("{model_path: r2r_router_tiny.pt, switching_strategy: neural}"),
            &ctx(&f, 0, Some(f.hidden)),
        )
        .expect("build r2r_slm")
    };
    let mut p = build();
    let k = p.needs().top_logits;
    assert!(k > 0 && p.needs().no_logits && p.needs().hidden);
    let logits = Tensor::from_vec(
        f.logits.concat(),
        (f.logits.len(), f.logits[0].len()),
        &Device::Cpu,
    )
    .expect("logits");
    let step = tokenrouter_runtime::runner::StepOutput {
        logits,
        hidden: None,
    };
    let top = step
        .top_logits_rows(f.logits[0].len(), k)
        .expect("top logits");
    let (want, want_to) = run(p.as_mut(), &f);
    let mut p = build();
    let (got, got_to) = run_with(p.as_mut(), &f, Some(&top));
    assert_eq!(got, want);
    assert_eq!(got_to, want_to);
}
