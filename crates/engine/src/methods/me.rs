//! ME: entropy-based escalation over three models (0 small, 1 mid, 2 large; two models
//! also work, the second being the large one). No public specification exists beyond the
//! three-model setup; this design lets every model move a request to any other:
//!
//! - model 0: H > τ2 -> large, H > τ1 -> mid, else stay;
//! - model 1 (mid): H > τ2 -> large, H <= τ1 -> back to 0, else stay;
//! - large: write one token and return to 0.
//!
//! H is the normalised entropy H/ln V of the full softmax (as R-Stitch). Escalating drops
//! the token just written (the bigger model rewrites that position); going back down keeps
//! it, since it came from the more capable model.

use super::router_net::Site;
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::Needs;
use crate::policy::{Decision, ModelSite, Policy, PolicyContext, Registry, SendMode, StepView};
use serde::Deserialize;
use tokenrouter_api::ModelIndex;

/// One model's ME role.
pub struct Me {
    me: ModelIndex,
    /// `None` with two models.
    mid: Option<ModelIndex>,
    large: ModelIndex,
    tau1: f32,
    tau2: f32,
}

impl Policy for Me {
    fn needs(&self) -> Needs {
        Needs::ENTROPY_ONLY
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                if self.me == self.large {
                    return Decision::go(0, None);
                }
                let h = r.normalised_entropy();
                let to = if h > self.tau2 {
                    Some(self.large)
                } else if self.me == 0 && h > self.tau1 {
                    Some(self.mid.unwrap_or(self.large))
                } else if self.me != 0 && h <= self.tau1 {
                    Some(0)
                } else {
                    None
                };
                Decision { to, score: Some(h) }
            })
            .collect()
    }

    /// Escalating drops the token just written; going down keeps it.
    fn send(&self, _rid: u64, to: ModelIndex) -> SendMode {
        if to > self.me {
            SendMode::DropLast
        } else {
            SendMode::KeepLast
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MeKwargs {
    /// `[τ1, τ2]` on the normalised entropy, 0 <= τ1 <= τ2 <= 1 (not needed by the
    /// large model).
    thresholds: Option<Vec<f64>>,
}

/// The kwargs, validated (no weights needed): the two thresholds.
fn settings(k: &serde_yaml::Value, at: &ModelSite) -> Result<(f32, f32), ConfigError> {
    let site = Site::at(at);
    let kw: MeKwargs = parse_kwargs(k, &site.model, &at.config_file)?;
    let n = at.model_names.len();
    if !(2..=3).contains(&n) {
        return Err(site.model_err(format!(
            "me routes between 2 or 3 models, the config has {n}"
        )));
    }
    let large = n - 1;
    let (tau1, tau2) = match kw.thresholds.as_deref() {
        Some(&[a, b]) if (0.0..=1.0).contains(&a) && (0.0..=1.0).contains(&b) && a <= b => {
            (a as f32, b as f32)
        }
        Some(t) => {
            return Err(site.err(
                "thresholds",
                format!("{t:?}: expected [τ1, τ2] with 0 <= τ1 <= τ2 <= 1"),
            ));
        }
        None if at.model == large => (1.0, 1.0),
        None => return Err(site.err("thresholds", "required: [τ1, τ2] on the normalised entropy")),
    };
    Ok((tau1, tau2))
}

pub fn register(r: &mut Registry) {
    fn check(k: &serde_yaml::Value, at: &ModelSite) -> Result<(), ConfigError> {
        settings(k, at).map(drop)
    }
    fn build(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        let (tau1, tau2) = settings(k, &ctx.site())?;
        let n = ctx.model_names.len();
        let large = n - 1;
        Ok(Box::new(Me {
            me: ctx.model,
            mid: (n == 3).then_some(1),
            large,
            tau1,
            tau2,
        }))
    }
    for n in ["me", "me_slm", "me_llm"] {
        r.register(n, check, build);
    }
}
