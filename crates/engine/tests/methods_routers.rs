//! CITER and Co-LLM against hand computations on synthetic weights, and the registry
//! names and kwargs errors of the learned routers.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use tokenrouter_engine::policy::{
    Decision, Policy, PolicyContext, Registry, RowView, SendMode, StepView,
};

/// No per-request routing overrides.
static NO_ROUTING: tokenrouter_api::RoutingOverrides =
    tokenrouter_api::RoutingOverrides(std::collections::BTreeMap::new());

type EmbedFn = Arc<dyn Fn(&[u32]) -> candle_core::Result<Tensor> + Send + Sync>;

const H: usize = 4;

fn ctx(model: usize, config: &Path, hidden: usize) -> PolicyContext {
    let embed: EmbedFn = Arc::new(move |ids: &[u32]| {
        Tensor::zeros((ids.len(), hidden), candle_core::DType::F32, &Device::Cpu)
    });
    PolicyContext {
        model,
        model_names: vec!["small".into(), "big".into()],
        token_text: Arc::new(Vec::new()),
        vocab_size: 8,
        sample_limit: 8,
        config_file: config.to_path_buf(),
        embed: Some(embed),
        device: Device::Cpu,
    }
}

/// Deterministic pseudo-random numbers in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).expect("tensor")
}

fn save(dir: &Path, name: &str, t: &HashMap<String, Tensor>) -> std::path::PathBuf {
    let p = dir.join(name);
    candle_core::safetensors::save(t, &p).expect("save");
    p
}

fn step_rows<'a>(logits: &'a [f32], n: usize) -> Vec<RowView<'a>> {
    (0..n)
        .map(|i| RowView {
            rid: i as u64,
            logits,
            token: 1,
            prompt: &[],
            output: &[],
            sources: &[],
            visit_tokens: 0,
            seed: 0,
            entropy: None,
            top_logits: None,
            routing: &NO_ROUTING,
            allowed: None,
        })
        .collect()
}

fn route(p: &mut dyn Policy, hidden: &[f32], width: usize) -> Vec<Decision> {
    let n = hidden.len() / width;
    let logits = vec![0.0f32; 8];
    let rows = step_rows(&logits, n);
    let h = tensor(hidden, &[n, width]);
    p.route(&StepView {
        model: 0,
        rows: &rows,
        hidden: Some(&h),
    })
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `W x + b` with W `[out, in]` row-major, in f64.
fn affine(w: &[f32], b: &[f32], x: &[f64]) -> Vec<f64> {
    let inp = x.len();
    (0..b.len())
        .map(|o| {
            f64::from(b[o])
                + (0..inp)
                    .map(|i| f64::from(w[o * inp + i]) * x[i])
                    .sum::<f64>()
        })
        .collect()
}

struct Citer {
    t: HashMap<String, Tensor>,
    v: HashMap<&'static str, Vec<f32>>,
}

fn citer_weights() -> Citer {
    let shapes: [(&'static str, Vec<usize>); 10] = [
        ("mlp.0.weight", vec![2 * H, H]),
        ("mlp.0.bias", vec![2 * H]),
        ("mlp.1.weight", vec![2 * H]),
        ("mlp.1.bias", vec![2 * H]),
        ("mlp.1.running_mean", vec![2 * H]),
        ("mlp.1.running_var", vec![2 * H]),
        ("mlp.4.weight", vec![H, 2 * H]),
        ("mlp.4.bias", vec![H]),
        ("linear.weight", vec![1, H]),
        ("linear.bias", vec![1]),
    ];
    let mut t = HashMap::new();
    let mut v = HashMap::new();
    for (i, (name, shape)) in shapes.into_iter().enumerate() {
        let mut x = values(i as u64 + 1, shape.iter().product());
        if name.ends_with("running_var") {
            x.iter_mut().for_each(|a| *a = a.abs() + 0.5);
        }
        t.insert(name.to_string(), tensor(&x, &shape));
        v.insert(name, x);
    }
    Citer { t, v }
}

fn citer_reference(w: &Citer, h: &[f32]) -> f64 {
    let x: Vec<f64> = h.iter().map(|&a| f64::from(a)).collect();
    let a = affine(&w.v["mlp.0.weight"], &w.v["mlp.0.bias"], &x);
    let bn: Vec<f64> = (0..2 * H)
        .map(|j| {
            let (g, b) = (
                f64::from(w.v["mlp.1.weight"][j]),
                f64::from(w.v["mlp.1.bias"][j]),
            );
            let (m, var) = (
                f64::from(w.v["mlp.1.running_mean"][j]),
                f64::from(w.v["mlp.1.running_var"][j]),
            );
            ((a[j] - m) / (var + 1e-5).sqrt() * g + b).max(0.0)
        })
        .collect();
    let c = affine(&w.v["mlp.4.weight"], &w.v["mlp.4.bias"], &bn);
    sigmoid(affine(&w.v["linear.weight"], &w.v["linear.bias"], &c)[0])
}

#[test]
fn citer_matches_hand_computation_and_routes_below_threshold() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("c.yaml");
    let w = citer_weights();
    save(dir.path(), "citer.safetensors", &w.t);
    let hidden: Vec<f32> = values(99, 5 * H).into_iter().map(|x| 3.0 * x).collect();
    let want: Vec<f64> = hidden.chunks(H).map(|h| citer_reference(&w, h)).collect();
    let mut sorted = want.clone();
    sorted.sort_by(f64::total_cmp);
    let tau = (sorted[2] + sorted[3]) / 2.0;
    let k: serde_yaml::Value = serde_yaml::from_str(&format!(
        "{{model_path: citer.safetensors, threshold: {tau}}}"
    ))
    .expect("yaml");
    let mut p = Registry::default()
        .build("citer_slm", &k, &ctx(0, &cfg, H))
        .expect("build citer");
    assert!(p.needs().hidden);
    let d = route(p.as_mut(), &hidden, H);
    for (d, &w) in d.iter().zip(&want) {
        let s = d.score.expect("score");
        assert!((f64::from(s) - w).abs() < 1e-5, "score {s} vs {w}");
        assert_eq!(d.to, (w < tau).then_some(1), "route iff score < threshold");
    }
    assert_eq!(p.send(0, 1), SendMode::DropLast);
    // Default threshold 0.95.
    let k: serde_yaml::Value =
        serde_yaml::from_str("{model_path: citer.safetensors}").expect("yaml");
    let mut p = Registry::default()
        .build("citer", &k, &ctx(0, &cfg, H))
        .expect("build");
    let d = route(p.as_mut(), &hidden, H);
    for (d, &w) in d.iter().zip(&want) {
        assert_eq!(d.to, (w < 0.95).then_some(1));
    }
    // Hidden states of the wrong width: the router fails, so every request stays.
    let d = route(p.as_mut(), &[0.0; 2 * H + 2], H + 1);
    assert!(d.iter().all(|d| d.to.is_none()));
    // The large model writes one token and returns.
    let mut llm = Registry::default()
        .build("citer_llm", &serde_yaml::Value::Null, &ctx(1, &cfg, H))
        .expect("llm");
    assert_eq!(route(llm.as_mut(), &[0.0; H], H)[0].to, Some(0));
    assert_eq!(llm.send(0, 0), SendMode::KeepLast);
}

#[test]
fn citer_weight_errors_name_tensor_model_key_and_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("c.yaml");
    let build = |file: &str, hidden: usize| {
        let k: serde_yaml::Value =
            serde_yaml::from_str(&format!("{{model_path: {file}}}")).expect("yaml");
        Registry::default()
            .build("citer_slm", &k, &ctx(0, &cfg, hidden))
            .err()
            .expect("must fail")
            .to_string()
    };
    let mut w = citer_weights();
    w.t.insert(
        "mlp.4.weight".into(),
        tensor(&values(1, H * (2 * H + 1)), &[H, 2 * H + 1]),
    );
    save(dir.path(), "shape.safetensors", &w.t);
    let e = build("shape.safetensors", H);
    for part in [
        "c.yaml",
        "model.small.scheduler_kwargs.model_path",
        "shape.safetensors",
        "mlp.4.weight",
        "[4, 9]",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    let mut w = citer_weights();
    w.t.remove("mlp.1.running_var");
    save(dir.path(), "missing.safetensors", &w.t);
    assert!(build("missing.safetensors", H).contains("missing tensor `mlp.1.running_var`"));
    save(dir.path(), "ok.safetensors", &citer_weights().t);
    let e = build("ok.safetensors", 2 * H);
    assert!(
        e.contains("hidden size 4") && e.contains("hidden size 8"),
        "{e}"
    );
    let e = build("absent.safetensors", H);
    assert!(
        e.contains("absent.safetensors") && e.contains("model_path"),
        "{e}"
    );
    let k: serde_yaml::Value =
        serde_yaml::from_str("{model_path: ok.safetensors, treshold: 0.9}").expect("yaml");
    let e = Registry::default()
        .build("citer", &k, &ctx(0, &cfg, H))
        .err()
        .expect("fail")
        .to_string();
    assert!(
        e.contains("model.small.scheduler_kwargs") && e.contains("treshold"),
        "{e}"
    );
}

fn collm_file(dir: &Path, name: &str, g: &[f32], shape: &[usize], bias: Option<f32>) {
    let mut t = HashMap::new();
    t.insert("deferral.weight".to_string(), tensor(g, shape));
    if let Some(b) = bias {
        t.insert("deferral.bias".to_string(), tensor(&[b], &[1]));
    }
    save(dir, name, &t);
}

#[test]
fn collm_defers_above_threshold_with_floor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("c.yaml");
    let g = [0.5f32, -1.0, 2.0, 0.0];
    collm_file(dir.path(), "g.safetensors", &g, &[H], Some(0.1));
    collm_file(dir.path(), "g_row.safetensors", &g, &[1, H], None);
    collm_file(
        dir.path(),
        "g_bad.safetensors",
        &[0.0; 2 * H],
        &[2, H],
        None,
    );
    // g·h + b = 0.1 + {1.0, -0.6, 0.1, -6.1}
    let hidden = [
        2.0f32, 0.0, 0.0, 5.0, 0.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.1, -1.5, 0.0,
    ];
    let logit = [1.1f64, -0.5, 0.1, -6.0];
    let build = |k: &str| {
        let k: serde_yaml::Value = serde_yaml::from_str(k).expect("yaml");
        Registry::default().build("collm_slm", &k, &ctx(0, &cfg, H))
    };
    let mut p = build("{model_path: g.safetensors}").expect("build");
    let d = route(p.as_mut(), &hidden, H);
    for (d, &l) in d.iter().zip(&logit) {
        let want = sigmoid(l);
        assert!((f64::from(d.score.expect("score")) - want).abs() < 1e-6);
        assert_eq!(d.to, (want > 0.5).then_some(1));
    }
    // η = 0 is floored at 0.01: p = sigmoid(-6) ≈ 0.0025 stays.
    let mut p = build("{model_path: g.safetensors, threshold: 0.0}").expect("build");
    let to: Vec<_> = route(p.as_mut(), &hidden, H).iter().map(|d| d.to).collect();
    assert_eq!(to, vec![Some(1), Some(1), Some(1), None]);
    // [1, H] without bias.
    let mut p = build("{model_path: g_row.safetensors, threshold: 0.52}").expect("build");
    let to: Vec<_> = route(p.as_mut(), &hidden, H).iter().map(|d| d.to).collect();
    assert_eq!(to, vec![Some(1), None, None, None]);
    let e = build("{model_path: g_bad.safetensors}")
        .err()
        .expect("fail")
        .to_string();
    assert!(
        e.contains("deferral.weight")
            && e.contains("g_bad.safetensors")
            && e.contains("model.small"),
        "{e}"
    );
    let e = build("{model_path: g.safetensors, threshold: 2}")
        .err()
        .expect("fail")
        .to_string();
    assert!(e.contains("scheduler_kwargs.threshold"), "{e}");
    save(
        dir.path(),
        "empty.safetensors",
        &HashMap::from([("other".to_string(), tensor(&[1.0], &[1]))]),
    );
    let e = build("{model_path: empty.safetensors}")
        .err()
        .expect("fail")
        .to_string();
    assert!(e.contains("missing tensor `deferral.weight`"), "{e}");
}

#[test]
fn all_method_names_are_registered() {
    let names = Registry::default().names();
    for m in ["r2r", "citer", "collm", "glimprouter", "me"] {
        for n in [m.to_string(), format!("{m}_slm"), format!("{m}_llm")] {
            assert!(names.contains(&n.as_str()), "{n} missing from {names:?}");
        }
    }
}

/// `tests/fixtures/citer_tiny.pt`: a bare PyTorch `state_dict()` (with BatchNorm's integer
/// `num_batches_tracked`) and PyTorch's eval-mode scores.
#[test]
fn citer_pt_matches_pytorch() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let text = std::fs::read_to_string(fixtures.join("citer_tiny.json")).expect("fixture");
    let j: serde_json::Value = serde_json::from_str(&text).expect("json");
    let width = j["hidden"].as_u64().expect("hidden") as usize;
    let num = |v: &serde_json::Value| v.as_f64().expect("number");
    let hidden: Vec<f32> = j["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r.as_array().expect("row").iter().map(|x| num(x) as f32))
        .collect();
    let want: Vec<f64> = j["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .map(num)
        .collect();
    let mut sorted = want.clone();
    sorted.sort_by(f64::total_cmp);
    let tau = (sorted[1] + sorted[2]) / 2.0;
    let k: serde_yaml::Value =
        serde_yaml::from_str(&format!("{{model_path: citer_tiny.pt, threshold: {tau}}}"))
            .expect("yaml");
    let cfg = fixtures.join("router_test.yaml");
    let mut p = Registry::default()
        .build("citer", &k, &ctx(0, &cfg, width))
        .expect("build from .pt");
    let d = route(p.as_mut(), &hidden, width);
    let mut max = 0.0f64;
    for (d, &w) in d.iter().zip(&want) {
        max = max.max((f64::from(d.score.expect("score")) - w).abs());
        assert_eq!(d.to, (w < tau).then_some(1));
    }
    assert!(max <= 1e-5, "max abs diff {max} vs PyTorch");
}
