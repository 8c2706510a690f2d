//! Co-LLM (clinicalml/co-llm): a learned deferral. The small model's lm_head carries one
//! extra row g; p_defer = sigmoid(g·h + b) on the final-norm hidden state h. At
//! p_defer > η the small model's token is dropped and the large model writes that
//! position ("defer" mode), then control returns to the small model.
//!
//! Weights file (`model_path`, `.safetensors` or `.pt`): tensor `deferral.weight`, shape
//! `[hidden]` or `[1, hidden]` (g), and optionally `deferral.bias`, shape `[]` or `[1]`.
//! η (`threshold`, default 0.5) is floored at 0.01 as in the paper.

use super::basic::ReturnAfterOne;
use super::router_net::{check_unit, hidden_rows, router_site, sigmoid_vec, Site, Weights};
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::{Decision, ModelSite, Needs, Policy, PolicyContext, Registry, StepView};
use candle_core::{Device, Tensor};
use serde::Deserialize;
use tokenrouter_api::ModelIndex;

/// Default deferral threshold η.
pub const DEFAULT_THRESHOLD: f64 = 0.5;
/// Co-LLM never uses a threshold below this.
pub const MIN_THRESHOLD: f32 = 0.01;

/// Small-model side: route iff p_defer > threshold (the token is dropped).
pub struct CoLlmSlm {
    /// g as a column `[hidden, 1]`.
    g: Tensor,
    bias: f32,
    hidden: usize,
    threshold: f32,
    to: ModelIndex,
    device: Device,
}

impl CoLlmSlm {
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    fn p_defer(&self, step: &StepView<'_>) -> candle_core::Result<Vec<f32>> {
        let h = step
            .hidden
            .ok_or_else(|| candle_core::Error::Msg("the step carries no hidden states".into()))?;
        let h = hidden_rows(h, step.rows.len(), self.hidden)?.to_device(&self.device)?;
        sigmoid_vec(&(h.matmul(&self.g)? + f64::from(self.bias))?)
    }
}

impl Policy for CoLlmSlm {
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
        super::decide(step, "co-llm", self.to, self.p_defer(step), |row, p| {
            p > row.kwarg("threshold", threshold).max(MIN_THRESHOLD)
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CoLlmKwargs {
    /// File with `deferral.weight` (and optionally `deferral.bias`).
    model_path: Option<String>,
    /// η: route iff p_defer > η (default 0.5, floored at 0.01).
    threshold: Option<f64>,
    /// Target model name (default: the other model).
    to: Option<String>,
}

/// The kwargs parsed and the threshold checked (no weights needed).
fn parse(k: &serde_yaml::Value, at: &ModelSite) -> Result<(CoLlmKwargs, f32), ConfigError> {
    let site = Site::at(at);
    let kw: CoLlmKwargs = parse_kwargs(k, &site.model, &at.config_file)?;
    let threshold = check_unit(
        &site,
        "threshold",
        kw.threshold.unwrap_or(DEFAULT_THRESHOLD),
    )?
    .max(MIN_THRESHOLD);
    Ok((kw, threshold))
}

/// Build the Co-LLM small-model policy from its kwargs (also used by tests).
pub fn build_slm(kwargs: &serde_yaml::Value, ctx: &PolicyContext) -> Result<CoLlmSlm, ConfigError> {
    let site = Site::of(ctx);
    let at = ctx.site();
    let (kw, threshold) = parse(kwargs, &at)?;
    let (to, path) = router_site(&at, &kw.to, &kw.model_path)?;
    let w = Weights::load(&path, &ctx.device, &site, "model_path")?;
    if !w.contains("deferral.weight") {
        return Err(w.err("missing tensor `deferral.weight`"));
    }
    let g = w
        .get("deferral.weight", &[None])
        .or_else(|_| w.get("deferral.weight", &[Some(1), None]))
        .map_err(|_| w.err("tensor `deferral.weight` must have shape [hidden] or [1, hidden]"))?;
    let hidden = g.elem_count();
    let g = g.reshape((hidden, 1)).map_err(|e| w.err(e))?;
    let bias = if w.contains("deferral.bias") {
        let b = w
            .get("deferral.bias", &[])
            .or_else(|_| w.get("deferral.bias", &[Some(1)]))
            .map_err(|_| w.err("tensor `deferral.bias` must have shape [] or [1]"))?;
        b.flatten_all()
            .and_then(|b| b.to_vec1::<f32>())
            .map_err(|e| w.err(e))?[0]
    } else {
        0.0
    };
    if let Some(f) = &ctx.embed {
        let width = f(&[0]).ok().and_then(|t| t.dims().last().copied());
        if let Some(width) = width.filter(|&wd| wd != hidden) {
            return Err(w.err(format!(
                "tensor `deferral.weight` has {hidden} entries, but model `{}` has hidden size {width}",
                site.model
            )));
        }
    }
    Ok(CoLlmSlm {
        g,
        bias,
        hidden,
        threshold,
        to,
        device: ctx.device.clone(),
    })
}

pub fn register(r: &mut Registry) {
    fn check(k: &serde_yaml::Value, at: &ModelSite) -> Result<(), ConfigError> {
        let (kw, _) = parse(k, at)?;
        if at.model == 0 {
            router_site(at, &kw.to, &kw.model_path)?;
        }
        Ok(())
    }
    fn build(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        if ctx.model == 0 {
            return Ok(Box::new(build_slm(k, ctx)?));
        }
        parse(k, &ctx.site())?;
        Ok(Box::new(ReturnAfterOne))
    }
    for n in ["collm", "collm_slm", "collm_llm"] {
        r.register(n, check, build);
    }
}
