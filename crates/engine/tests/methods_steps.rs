//! GlimpRouter (step-level, "\n\n" boundaries, top-20 glimpse entropy) and ME (three-model
//! entropy escalation) on hand-made steps whose entropies are known.

use candle_core::Device;
use std::path::PathBuf;
use std::sync::Arc;
use tokenrouter_engine::policy::{
    AllowedTokens, Decision, Policy, PolicyContext, Registry, RowView, SendMode, StepView,
};

/// No per-request routing overrides.
static NO_ROUTING: tokenrouter_api::RoutingOverrides =
    tokenrouter_api::RoutingOverrides(std::collections::BTreeMap::new());

const V: usize = 30;
const NL2: u32 = 5; // "\n\n"
const NL: u32 = 6; // "\n"
const DOT_NL2: u32 = 7; // ".\n\n"

fn ctx(model: usize, models: usize) -> PolicyContext {
    let mut texts: Vec<String> = (0..V).map(|i| format!("w{i} ")).collect();
    texts[NL2 as usize] = "\n\n".into();
    texts[NL as usize] = "\n".into();
    texts[DOT_NL2 as usize] = ".\n\n".into();
    PolicyContext {
        model,
        model_names: ["small", "mid", "large", "huge"][..models]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        token_text: Arc::new(texts),
        vocab_size: V,
        sample_limit: V,
        config_file: PathBuf::from("cfg/steps.yaml"),
        embed: None,
        device: Device::Cpu,
    }
}

fn build(name: &str, kwargs: &str, model: usize, models: usize) -> Result<Box<dyn Policy>, String> {
    let k: serde_yaml::Value = serde_yaml::from_str(kwargs).expect("yaml");
    Registry::default()
        .build(name, &k, &ctx(model, models))
        .map_err(|e| e.to_string())
}

/// Logits with `n` equally likely tokens and the rest negligible: entropy ln n.
fn flat(n: usize) -> Vec<f32> {
    (0..V).map(|i| if i < n { 0.0 } else { -1e4 }).collect()
}

fn row<'a>(rid: u64, logits: &'a [f32], token: u32, output: &'a [u32]) -> RowView<'a> {
    RowView {
        rid,
        logits,
        token,
        prompt: &[],
        output,
        sources: &[],
        visit_tokens: 0,
        seed: 0,
        entropy: None,
        top_logits: None,
        routing: &NO_ROUTING,
        allowed: None,
    }
}

fn route(p: &mut dyn Policy, model: usize, rows: &[RowView<'_>]) -> Vec<Decision> {
    p.route(&StepView {
        model,
        rows,
        hidden: None,
    })
}

#[test]
fn glimpse_entropy_over_top20_decides_at_step_starts_only() {
    let mut p = build("glimprouter_slm", "{threshold: 0.95}", 0, 2).expect("build");
    let (uniform, two, peaked) = (vec![0.0f32; V], flat(2), flat(1));
    let rows = [
        row(0, &uniform, 1, &[]),          // step start (empty output), H = ln 20
        row(1, &two, 1, &[]),              // step start, H = ln 2 < 0.95
        row(2, &uniform, 1, &[1, 2]),      // mid-step: no glimpse
        row(3, &uniform, 1, &[1, NL, NL]), // "\n" + "\n" ends a step
        row(4, &uniform, 1, &[1, DOT_NL2]),
        row(5, &peaked, 1, &[2, NL2]),
        row(6, &uniform, 1, &[NL2, 3]), // a break earlier, not at the end
    ];
    let d = route(p.as_mut(), 0, &rows);
    let to: Vec<_> = d.iter().map(|d| d.to).collect();
    assert_eq!(to, vec![Some(1), None, None, Some(1), Some(1), None, None]);
    // Renormalised over the top 20 of 30 equal logits: ln 20, not ln 30.
    assert!((d[0].score.expect("score") - 20f32.ln()).abs() < 1e-5);
    assert!((d[1].score.expect("score") - 2f32.ln()).abs() < 1e-5);
    assert!(d[5].score.expect("score") < 1e-3);
    assert_eq!(d[2].score, None, "no glimpse mid-step");
    assert_eq!(
        p.send(0, 1),
        SendMode::DropLast,
        "the routed glimpse is discarded"
    );
    // 10 logits at 0 and 20 at -1: the top-20 renormalised entropy is ≈ 2.885 (stays at
    // 2.95), the full-vocabulary one ≈ 3.278 (would route).
    let mixed: Vec<f32> = (0..V).map(|i| if i < 10 { 0.0 } else { -1.0 }).collect();
    let (a, b) = (1.0f64, (-1.0f64).exp());
    let z = 10.0 * (a + b);
    let want = -10.0 * ((a / z) * (a / z).ln() + (b / z) * (b / z).ln());
    let mut p = build("glimprouter", "{threshold: 2.95}", 0, 2).expect("build");
    let d = route(p.as_mut(), 0, &[row(0, &mixed, 1, &[])]);
    assert!(
        (f64::from(d[0].score.expect("score")) - want).abs() < 1e-5,
        "{d:?} vs {want}"
    );
    assert_eq!(d[0].to, None);
    let mut p = build("glimprouter", "{threshold: 0.6}", 0, 2).expect("build");
    assert_eq!(route(p.as_mut(), 0, &rows[1..2])[0].to, Some(1));
}

/// Two tokens allowed of the 20 equal ones: the glimpse is over those two (ln 2, stays
/// at 0.95), a forced token's is 0.
#[test]
fn a_constrained_glimpse_reads_the_allowed_tokens() {
    struct Only(Vec<u32>);
    impl AllowedTokens for Only {
        fn allows(&self, id: u32) -> bool {
            self.0.contains(&id)
        }
    }
    let mut p = build("glimprouter_slm", "{threshold: 0.95}", 0, 2).expect("build");
    let uniform = vec![0.0f32; V];
    let (two, one) = (Only(vec![3, 7]), Only(vec![5]));
    let mut rows = [
        row(0, &uniform, 3, &[]),
        row(1, &uniform, 5, &[]),
        row(2, &uniform, 1, &[]),
    ];
    rows[0].allowed = Some(&two);
    rows[1].allowed = Some(&one);
    let d = route(p.as_mut(), 0, &rows);
    assert!(
        (d[0].score.expect("score") - 2f32.ln()).abs() < 1e-5,
        "{d:?}"
    );
    assert_eq!(d[1].score, Some(0.0));
    let to: Vec<_> = d.iter().map(|d| d.to).collect();
    assert_eq!(to, vec![None, None, Some(1)], "only the free row is routed");
}

#[test]
fn large_model_writes_the_step_until_a_break() {
    let mut p = build("glimprouter_llm", "{threshold: 0.95}", 1, 2).expect("build");
    let l = flat(3);
    let prior = [1u32, NL2]; // the request arrives right after a step break
    assert_eq!(p.receive(7, 0, &prior), 2);
    // The first token "\n" must not count the break already in the output.
    for (tok, back) in [(NL, false), (3, false), (NL, false), (NL, true)] {
        let d = route(p.as_mut(), 1, &[row(7, &l, tok, &prior)]);
        assert_eq!(d[0].to, back.then_some(0), "token {tok}");
    }
    assert_eq!(p.send(7, 0), SendMode::KeepLast);
    // A token carrying the whole break ends the step too.
    p.receive(8, 0, &prior);
    assert_eq!(route(p.as_mut(), 1, &[row(8, &l, 2, &prior)])[0].to, None);
    assert_eq!(
        route(p.as_mut(), 1, &[row(8, &l, DOT_NL2, &prior)])[0].to,
        Some(0)
    );
    // A new visit (receive) or forget clears a half-written break.
    for reset in [true, false] {
        route(p.as_mut(), 1, &[row(9, &l, NL, &prior)]);
        if reset {
            p.receive(9, 0, &prior);
        } else {
            p.forget(9);
        }
        assert_eq!(route(p.as_mut(), 1, &[row(9, &l, NL, &prior)])[0].to, None);
        p.forget(9);
    }
}

#[test]
fn glimprouter_kwargs_errors() {
    let e = build("glimprouter", "{threshold: 0.9, top_k: 20}", 0, 2)
        .err()
        .expect("fail");
    assert!(
        e.contains("cfg/steps.yaml")
            && e.contains("model.small.scheduler_kwargs")
            && e.contains("top_k"),
        "{e}"
    );
    let e = build("glimprouter", "{threshold: 4.0}", 0, 2)
        .err()
        .expect("fail");
    assert!(e.contains("scheduler_kwargs.threshold"), "{e}");
    let e = build("glimprouter", "{to: nobody}", 0, 2)
        .err()
        .expect("fail");
    assert!(
        e.contains("scheduler_kwargs.to") && e.contains("nobody"),
        "{e}"
    );
}

/// Normalised entropies (H / ln 30): 0 for one token, 0.5 for √30 ≈ 5.48 tokens
/// (use 5: ln5/ln30 ≈ 0.473), 1 for all 30.
fn levels() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (flat(1), flat(5), vec![0.0; V])
}

#[test]
fn me_escalates_by_normalised_entropy_across_three_models() {
    let (low, mid, high) = levels();
    let rows = [
        row(0, &low, 1, &[]),
        row(1, &mid, 1, &[]),
        row(2, &high, 1, &[]),
    ];
    let k = "{thresholds: [0.3, 0.7]}";
    let mut m0 = build("me_slm", k, 0, 3).expect("m0");
    let d = route(m0.as_mut(), 0, &rows);
    assert_eq!(
        d.iter().map(|d| d.to).collect::<Vec<_>>(),
        vec![None, Some(1), Some(2)]
    );
    assert!((d[1].score.expect("score") - 5f32.ln() / 30f32.ln()).abs() < 1e-4);
    assert_eq!(
        (m0.send(0, 1), m0.send(0, 2)),
        (SendMode::DropLast, SendMode::DropLast)
    );
    let mut m1 = build("me_llm", k, 1, 3).expect("m1");
    let d = route(m1.as_mut(), 1, &rows);
    assert_eq!(
        d.iter().map(|d| d.to).collect::<Vec<_>>(),
        vec![Some(0), None, Some(2)]
    );
    assert_eq!(
        (m1.send(0, 2), m1.send(0, 0)),
        (SendMode::DropLast, SendMode::KeepLast)
    );
    // The large model needs no thresholds and always returns after one token.
    let mut m2 = build("me", "{}", 2, 3).expect("m2");
    let d = route(m2.as_mut(), 2, &rows);
    assert!(d.iter().all(|d| d.to == Some(0)));
    assert_eq!(m2.send(0, 0), SendMode::KeepLast);
}

#[test]
fn me_with_two_models_and_errors() {
    let (low, mid, high) = levels();
    let rows = [
        row(0, &low, 1, &[]),
        row(1, &mid, 1, &[]),
        row(2, &high, 1, &[]),
    ];
    let mut m0 = build("me", "{thresholds: [0.3, 0.7]}", 0, 2).expect("m0");
    let to: Vec<_> = route(m0.as_mut(), 0, &rows).iter().map(|d| d.to).collect();
    assert_eq!(to, vec![None, Some(1), Some(1)]);
    let mut m1 = build("me", "{thresholds: [0.3, 0.7]}", 1, 2).expect("m1");
    assert!(route(m1.as_mut(), 1, &rows).iter().all(|d| d.to == Some(0)));
    let e = build("me", "{thresholds: [0.7, 0.3]}", 0, 3)
        .err()
        .expect("fail");
    assert!(e.contains("model.small.scheduler_kwargs.thresholds"), "{e}");
    let e = build("me", "{thresholds: [0.3]}", 1, 3)
        .err()
        .expect("fail");
    assert!(e.contains("model.mid.scheduler_kwargs.thresholds"), "{e}");
    let e = build("me", "{}", 0, 3).err().expect("fail");
    assert!(e.contains("thresholds") && e.contains("required"), "{e}");
    let e = build("me", "{thresholds: [0.1, 0.2]}", 0, 4)
        .err()
        .expect("fail");
    assert!(e.contains("2 or 3 models"), "{e}");
    let e = build("me", "{thresholds: [0.1, 0.2], tau: 1}", 0, 3)
        .err()
        .expect("fail");
    assert!(e.contains("tau") && e.contains("cfg/steps.yaml"), "{e}");
}
