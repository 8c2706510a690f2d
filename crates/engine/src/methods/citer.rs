//! CITER (aiming-lab/CITER): a small MLP on the small model's final-norm hidden state
//! predicts the probability that the token it just sampled is fine. Below the threshold
//! the token is dropped and the large model writes that one position, then control
//! returns to the small model.
//!
//! Network (src/models/conf_model.py, eval mode): Linear(H->2H) -> BatchNorm1d (running
//! statistics, eps 1e-5) -> ReLU -> Dropout -> Linear(2H->H) -> Dropout -> Linear(H->1)
//! -> Sigmoid; state-dict keys `mlp.0.*`, `mlp.1.{weight,bias,running_mean,running_var}`,
//! `mlp.4.*`, `linear.*`. Sizes come from the weight shapes. No public Qwen3 weights exist.

use super::basic::ReturnAfterOne;
use super::router_net::{
    check_unit, hidden_rows, router_site, sigmoid_vec, BatchNorm, Linear, Site, Weights,
};
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::{Decision, ModelSite, Needs, Policy, PolicyContext, Registry, StepView};
use candle_core::{Device, Tensor};
use serde::Deserialize;
use tokenrouter_api::ModelIndex;

/// CITER's CLI default for the confidence threshold.
pub const DEFAULT_THRESHOLD: f64 = 0.95;

/// The CITER confidence network.
pub struct CiterNet {
    fc1: Linear,
    bn: BatchNorm,
    fc2: Linear,
    head: Linear,
    /// Width of the hidden-state input.
    pub hidden: usize,
}

impl CiterNet {
    pub fn from_weights(w: &Weights) -> Result<Self, ConfigError> {
        let fc1 = w.linear("mlp.0", None, None)?;
        let bn = w.batch_norm("mlp.1", fc1.out)?;
        let fc2 = w.linear("mlp.4", Some(fc1.out), None)?;
        let head = w.linear("linear", Some(fc2.out), Some(1))?;
        Ok(CiterNet {
            hidden: fc1.inp,
            fc1,
            bn,
            fc2,
            head,
        })
    }

    /// P(the small model's token is fine), `[rows]`, from h `[rows, hidden]` (fp32).
    pub fn forward(&self, h: &Tensor) -> candle_core::Result<Vec<f32>> {
        let x = self.bn.forward(&self.fc1.forward(h)?)?.relu()?;
        let x = self.fc2.forward(&x)?;
        sigmoid_vec(&self.head.forward(&x)?)
    }
}

/// Small-model side: route iff score < threshold (the token is dropped).
pub struct CiterSlm {
    net: CiterNet,
    threshold: f32,
    to: ModelIndex,
    device: Device,
}

impl CiterSlm {
    fn scores(&self, step: &StepView<'_>) -> candle_core::Result<Vec<f32>> {
        let h = step
            .hidden
            .ok_or_else(|| candle_core::Error::Msg("the step carries no hidden states".into()))?;
        let h = hidden_rows(h, step.rows.len(), self.net.hidden)?.to_device(&self.device)?;
        self.net.forward(&h)
    }
}

impl Policy for CiterSlm {
    fn tunables(&self) -> Vec<crate::policy::Tunable> {
        use crate::policy::Tunable;
        vec![Tunable::unit("threshold")]
    }

    fn needs(&self) -> Needs {
        // The router reads the hidden state only.
        Needs {
            hidden: true,
            no_logits: true,
            entropy: false,
            top_logits: 0,
        }
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        if step.rows.is_empty() {
            return Vec::new();
        }
        let threshold = self.threshold;
        super::decide(step, "citer", self.to, self.scores(step), |row, s| {
            s < row.kwarg("threshold", threshold)
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CiterKwargs {
    /// Router weights (`.safetensors` or `.pt`), relative to the config file.
    model_path: Option<String>,
    /// Route iff P(token fine) < threshold (default 0.95).
    threshold: Option<f64>,
    /// Target model name (default: the other model).
    to: Option<String>,
}

/// The kwargs, validated without weights: the threshold, and for the entry model its
/// target and the router file.
fn settings(
    k: &serde_yaml::Value,
    at: &ModelSite,
) -> Result<(f32, Option<(ModelIndex, std::path::PathBuf)>), ConfigError> {
    let site = Site::at(at);
    let kw: CiterKwargs = parse_kwargs(k, &site.model, &at.config_file)?;
    let threshold = check_unit(
        &site,
        "threshold",
        kw.threshold.unwrap_or(DEFAULT_THRESHOLD),
    )?;
    if at.model != 0 {
        return Ok((threshold, None));
    }
    Ok((threshold, Some(router_site(at, &kw.to, &kw.model_path)?)))
}

pub fn register(r: &mut Registry) {
    fn check(k: &serde_yaml::Value, at: &ModelSite) -> Result<(), ConfigError> {
        settings(k, at).map(drop)
    }
    fn build(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        let site = Site::of(ctx);
        let (threshold, entry) = settings(k, &ctx.site())?;
        let Some((to, path)) = entry else {
            return Ok(Box::new(ReturnAfterOne));
        };
        let w = Weights::load(&path, &ctx.device, &site, "model_path")?;
        let net = CiterNet::from_weights(&w)?;
        if let Some(f) = &ctx.embed {
            // The embedding width equals the hidden size for the supported architectures.
            let width = f(&[0]).ok().and_then(|t| t.dims().last().copied());
            if let Some(width) = width.filter(|&wd| wd != net.hidden) {
                return Err(w.err(format!(
                    "router expects hidden size {}, but model `{}` has hidden size {width}",
                    net.hidden, site.model
                )));
            }
        }
        Ok(Box::new(CiterSlm {
            net,
            threshold,
            to,
            device: ctx.device.clone(),
        }))
    }
    for n in ["citer", "citer_slm", "citer_llm"] {
        r.register(n, check, build);
    }
}
