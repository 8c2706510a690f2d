//! Baselines and training-free methods: `slm_only`, `llm_only`, `query` (request-level
//! pinning only), `random` (route with probability p, seeded per request and position)
//! and `rstitch` (R-Stitch: normalised entropy above a threshold goes to the large model,
//! which keeps writing while its own normalised entropy stays above it).

use super::unit_hash;
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::{
    Decision, ModelSite, Needs, Policy, PolicyContext, Registry, SendMode, StepView, Tunable,
};
use serde::Deserialize;
use tokenrouter_api::ModelIndex;
use tokenrouter_runtime::sampling::entropy;

/// Never routes: every request stays where it is (SLM-only, and the `query` method where
/// only the request's `model` field chooses a model).
struct Stay;

impl Policy for Stay {
    fn needs(&self) -> Needs {
        Needs::TOKENS_ONLY
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        vec![Decision::STAY; step.rows.len()]
    }
}

/// Sends every request to `to` at its first step and never brings it back.
struct Always {
    to: ModelIndex,
}

impl Policy for Always {
    fn needs(&self) -> Needs {
        Needs::TOKENS_ONLY
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        vec![Decision::go(self.to, None); step.rows.len()]
    }
}

/// The large-model side of one-token methods (R2R, CITER, Co-LLM, random): write one
/// token, keep it, go back to the entry model.
pub struct ReturnAfterOne;

impl Policy for ReturnAfterOne {
    fn needs(&self) -> Needs {
        Needs::TOKENS_ONLY
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        vec![Decision::go(0, None); step.rows.len()]
    }

    fn send(&self, _rid: u64, _to: ModelIndex) -> SendMode {
        SendMode::KeepLast
    }
}

fn target(ctx: &ModelSite, to: &Option<String>, key: &str) -> Result<ModelIndex, ConfigError> {
    let me = ctx.name();
    match to {
        None => {
            if ctx.model_names.len() < 2 {
                return Err(ConfigError::Invalid {
                    file: ctx.config_file.clone(),
                    message: format!("model.{me}: routing needs a second model"),
                });
            }
            Ok(if ctx.model == 0 { 1 } else { 0 })
        }
        Some(name) => ctx
            .model_names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| ConfigError::Invalid {
                file: ctx.config_file.clone(),
                message: format!("model.{me}.scheduler_kwargs.{key}: no model named `{name}`"),
            }),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NoKwargs {}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ToKwargs {
    to: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RandomKwargs {
    /// Probability that an entry-model step is routed.
    p: f64,
    #[serde(default)]
    seed: u64,
    /// Target model name (default: the other model).
    to: Option<String>,
}

impl Default for RandomKwargs {
    fn default() -> Self {
        Self {
            p: 0.3,
            seed: 0,
            to: None,
        }
    }
}

pub struct Random {
    p: f64,
    seed: u64,
    to: ModelIndex,
}

impl Policy for Random {
    fn needs(&self) -> Needs {
        Needs::TOKENS_ONLY
    }

    fn tunables(&self) -> Vec<Tunable> {
        vec![Tunable::unit("p")]
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                let u = unit_hash(self.seed, r.seed, r.output.len() as u64);
                if u < r.routing.get("p").unwrap_or(self.p) {
                    Decision::go(self.to, Some(u as f32))
                } else {
                    Decision::stay(Some(u as f32))
                }
            })
            .collect()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RStitchKwargs {
    /// τ on the normalised entropy H / ln V.
    threshold: f32,
    to: Option<String>,
}

impl Default for RStitchKwargs {
    fn default() -> Self {
        Self {
            threshold: 0.3,
            to: None,
        }
    }
}

/// Normalised entropy of a row: H / ln(V), in [0, 1].
pub fn normalised_entropy(logits: &[f32]) -> f32 {
    entropy(logits) / (logits.len().max(2) as f32).ln()
}

struct RStitchSlm {
    threshold: f32,
    to: ModelIndex,
}

impl Policy for RStitchSlm {
    fn needs(&self) -> Needs {
        Needs::ENTROPY_ONLY
    }

    fn tunables(&self) -> Vec<Tunable> {
        vec![Tunable::unit("threshold")]
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                let h = r.normalised_entropy();
                if h > r.kwarg("threshold", self.threshold) {
                    Decision::go(self.to, Some(h))
                } else {
                    Decision::stay(Some(h))
                }
            })
            .collect()
    }
}

/// R-Stitch's large-model side: keep writing while the own normalised entropy is above
/// the threshold (read per request under `key`), then hand back to the entry model. R2R's
/// large model uses it too when given `stay_entropy`.
pub(crate) struct RStitchLlm {
    pub threshold: f32,
    pub key: &'static str,
}

impl Policy for RStitchLlm {
    fn needs(&self) -> Needs {
        Needs::ENTROPY_ONLY
    }

    fn tunables(&self) -> Vec<Tunable> {
        vec![Tunable::unit(self.key)]
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                let h = r.normalised_entropy();
                if h <= r.kwarg(self.key, self.threshold) {
                    Decision::go(0, Some(h))
                } else {
                    Decision::stay(Some(h))
                }
            })
            .collect()
    }

    fn send(&self, _rid: u64, _to: ModelIndex) -> SendMode {
        SendMode::KeepLast
    }
}

/// The validated settings of each method here: the kwargs parsed into their typed struct,
/// ranges checked, the target model resolved (entry model only). Both the config check and
/// the factories start here.
fn no_kwargs(k: &serde_yaml::Value, site: &ModelSite) -> Result<(), ConfigError> {
    parse_kwargs::<NoKwargs>(k, site.name(), &site.config_file).map(drop)
}

/// `llm_only`: the target of the entry model (None for the others).
fn llm_only_settings(
    k: &serde_yaml::Value,
    site: &ModelSite,
) -> Result<Option<ModelIndex>, ConfigError> {
    let kw: ToKwargs = parse_kwargs(k, site.name(), &site.config_file)?;
    (site.model == 0)
        .then(|| target(site, &kw.to, "to"))
        .transpose()
}

fn random_settings(
    k: &serde_yaml::Value,
    site: &ModelSite,
) -> Result<(RandomKwargs, Option<ModelIndex>), ConfigError> {
    let kw: RandomKwargs = parse_kwargs(k, site.name(), &site.config_file)?;
    if !(0.0..=1.0).contains(&kw.p) {
        return Err(ConfigError::Invalid {
            file: site.config_file.clone(),
            message: format!(
                "model.{}.scheduler_kwargs.p: {} is not a probability",
                site.name(),
                kw.p
            ),
        });
    }
    let to = (site.model == 0)
        .then(|| target(site, &kw.to, "to"))
        .transpose()?;
    Ok((kw, to))
}

fn rstitch_settings(
    k: &serde_yaml::Value,
    site: &ModelSite,
) -> Result<(RStitchKwargs, Option<ModelIndex>), ConfigError> {
    let kw: RStitchKwargs = parse_kwargs(k, site.name(), &site.config_file)?;
    let to = (site.model == 0)
        .then(|| target(site, &kw.to, "to"))
        .transpose()?;
    Ok((kw, to))
}

pub fn register(r: &mut Registry) {
    fn stay(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        no_kwargs(k, &ctx.site())?;
        Ok(Box::new(Stay))
    }
    fn llm_only(
        k: &serde_yaml::Value,
        ctx: &PolicyContext,
    ) -> Result<Box<dyn Policy>, ConfigError> {
        Ok(match llm_only_settings(k, &ctx.site())? {
            Some(to) => Box::new(Always { to }),
            None => Box::new(Stay),
        })
    }
    fn random(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        Ok(match random_settings(k, &ctx.site())? {
            (kw, Some(to)) => Box::new(Random {
                p: kw.p,
                seed: kw.seed,
                to,
            }),
            (_, None) => Box::new(ReturnAfterOne),
        })
    }
    fn rstitch(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        Ok(match rstitch_settings(k, &ctx.site())? {
            (kw, Some(to)) => Box::new(RStitchSlm {
                threshold: kw.threshold,
                to,
            }),
            (kw, None) => Box::new(RStitchLlm {
                threshold: kw.threshold,
                key: "threshold",
            }),
        })
    }
    fn check_llm_only(k: &serde_yaml::Value, site: &ModelSite) -> Result<(), ConfigError> {
        llm_only_settings(k, site).map(drop)
    }
    fn check_random(k: &serde_yaml::Value, site: &ModelSite) -> Result<(), ConfigError> {
        random_settings(k, site).map(drop)
    }
    fn check_rstitch(k: &serde_yaml::Value, site: &ModelSite) -> Result<(), ConfigError> {
        rstitch_settings(k, site).map(drop)
    }
    for n in [
        "slm_only",
        "slm_only_slm",
        "slm_only_llm",
        "query",
        "query_slm",
        "query_llm",
        "llm_only_llm",
    ] {
        r.register(n, no_kwargs, stay);
    }
    for n in ["llm_only", "llm_only_slm"] {
        r.register(n, check_llm_only, llm_only);
    }
    for n in ["random", "random_slm", "random_llm"] {
        r.register(n, check_random, random);
    }
    for n in ["rstitch", "rstitch_slm", "rstitch_llm"] {
        r.register(n, check_rstitch, rstitch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RowView;

    static NO_OVERRIDES: tokenrouter_api::RoutingOverrides =
        tokenrouter_api::RoutingOverrides(std::collections::BTreeMap::new());

    #[test]
    fn rstitch_reads_the_entropy_of_the_step() {
        let row = |entropy| RowView {
            rid: 1,
            logits: &[],
            token: 0,
            prompt: &[],
            output: &[],
            sources: &[],
            visit_tokens: 0,
            seed: 0,
            entropy: Some(entropy),
            top_logits: None,
            routing: &NO_OVERRIDES,
            allowed: None,
        };
        let rows = [row(0.9), row(0.1)];
        let step = StepView {
            model: 0,
            rows: &rows,
            hidden: None,
        };
        let mut slm = RStitchSlm {
            threshold: 0.5,
            to: 1,
        };
        let d = slm.route(&step);
        assert_eq!((d[0].to, d[1].to), (Some(1), None));
        assert_eq!(d[0].score, Some(0.9));
        let mut llm = RStitchLlm {
            threshold: 0.5,
            key: "threshold",
        };
        let d = llm.route(&step);
        assert_eq!((d[0].to, d[1].to), (None, Some(0)));
        assert_eq!(slm.needs(), Needs::ENTROPY_ONLY);
    }

    #[test]
    fn a_request_overrides_the_threshold_for_itself() {
        let strict = tokenrouter_api::RoutingOverrides([("threshold".to_string(), 0.95)].into());
        let eager = tokenrouter_api::RoutingOverrides([("threshold".to_string(), 0.05)].into());
        let row = |entropy, routing| RowView {
            rid: 1,
            logits: &[],
            token: 0,
            prompt: &[],
            output: &[],
            sources: &[],
            visit_tokens: 0,
            seed: 0,
            entropy: Some(entropy),
            top_logits: None,
            routing,
            allowed: None,
        };
        let rows = [row(0.9, &strict), row(0.1, &eager), row(0.9, &NO_OVERRIDES)];
        let step = StepView {
            model: 0,
            rows: &rows,
            hidden: None,
        };
        let mut slm = RStitchSlm {
            threshold: 0.5,
            to: 1,
        };
        let d: Vec<_> = slm.route(&step).iter().map(|d| d.to).collect();
        assert_eq!(d, vec![None, Some(1), Some(1)]);
        assert_eq!(slm.tunables(), vec![Tunable::unit("threshold")]);
        let mut random = Random {
            p: 0.0,
            seed: 0,
            to: 1,
        };
        let always = tokenrouter_api::RoutingOverrides([("p".to_string(), 1.0)].into());
        let rows = [row(0.0, &always), row(0.0, &NO_OVERRIDES)];
        let step = StepView {
            model: 0,
            rows: &rows,
            hidden: None,
        };
        let d: Vec<_> = random.route(&step).iter().map(|d| d.to).collect();
        assert_eq!(d, vec![Some(1), None]);
    }

    #[test]
    fn normalised_entropy_bounds() {
        assert!((normalised_entropy(&[0.0; 16]) - 1.0).abs() < 1e-5);
        let mut peaked = vec![-30.0; 16];
        peaked[3] = 30.0;
        assert!(normalised_entropy(&peaked) < 1e-3);
    }

    #[test]
    fn unit_hash_is_uniformish_and_deterministic() {
        let n = 20_000;
        let below = (0..n).filter(|&i| unit_hash(1, 2, i) < 0.3).count();
        assert!((below as f64 / n as f64 - 0.3).abs() < 0.02);
        assert_eq!(unit_hash(5, 6, 7), unit_hash(5, 6, 7));
    }
}
