//! R2R (Roads to Rome, arXiv:2505.21600): a ~55M-parameter neural router reads the small
//! model's final-norm hidden state, the input embedding of the token it just sampled and
//! its top-k raw logits, and predicts the probability that this token makes the reasoning
//! diverge from the large model. At p >= threshold the token is dropped and the large
//! model rewrites that one position, then control returns to the small model.
//!
//! Weights: the official `torch.save` checkpoint (`default_router.pt`: `model_type`,
//! `init_args`, `common_args {threshold, input_type}`, `model_specific_args`,
//! `state_dict`) or a `.safetensors` state dict with an optional `<stem>.json` holding the
//! other entries. All sizes (hidden, top-k, blocks, expansion) come from the weight shapes.

use super::basic::{RStitchLlm, ReturnAfterOne};
use super::router_net::{
    check_unit, hidden_rows, router_site, sigmoid_vec, LayerNorm, Linear, Site, Weights,
};
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::{Decision, ModelSite, Needs, Policy, PolicyContext, Registry, StepView};
use candle_core::{Device, Tensor};
use serde::Deserialize;
use std::sync::Arc;
use tokenrouter_api::ModelIndex;
use tokenrouter_runtime::sampling::top_k_indices;

/// The class name R2R's `save_model` writes for this architecture.
pub const MODEL_TYPE: &str = "HiddenStatesTokenLMHeadLogitsClassifier";

/// Threshold of R2R's own server when neither YAML nor the checkpoint gives one.
pub const DEFAULT_THRESHOLD: f32 = 0.5;

struct Block {
    norm: LayerNorm,
    up: Linear,
    down: Linear,
    /// Present when a block changes width (`hidden_dims` not constant).
    dim_change: Option<Linear>,
}

/// The router network (R2R `HiddenStatesTokenLMHeadLogitsClassifier`, eval mode).
pub struct R2rNet {
    logits_proj: Linear,
    /// `normalize_input=True` checkpoints: LayerNorm on h and e, softmax on the top-k.
    input_norm: Option<(LayerNorm, LayerNorm)>,
    combined: Linear,
    input_proj: Linear,
    blocks: Vec<Block>,
    out_norm: LayerNorm,
    out: Linear,
    /// Width of the hidden-state input.
    pub hidden: usize,
    /// Width of the token-embedding input.
    pub embed_dim: usize,
    /// Number of top logits fed to `logits_projection`.
    pub top_k: usize,
    /// `token_embeddings.weight` when the file has it (R2R's `*_all.pt`).
    pub token_embeddings: Option<Tensor>,
}

impl R2rNet {
    pub fn from_weights(w: &Weights) -> Result<Self, ConfigError> {
        if let Some(mt) = w.meta.get("model_type").and_then(|v| v.as_str()) {
            if mt != MODEL_TYPE {
                return Err(w.err(format!(
                    "model_type `{mt}` is not supported (expected {MODEL_TYPE})"
                )));
            }
        }
        if w.contains("backbone.position_embedding") {
            return Err(w.err("routers with use_position_embedding are not supported"));
        }
        let logits_proj = w.linear("logits_projection", None, None)?;
        let (hidden, top_k) = (logits_proj.out, logits_proj.inp);
        let combined = w.linear("combined_projection", None, None)?;
        if combined.inp <= 2 * hidden {
            return Err(w.err(format!(
                "tensor `combined_projection.weight` has {} inputs, expected 2 x {hidden} + embedding width",
                combined.inp
            )));
        }
        let embed_dim = combined.inp - 2 * hidden;
        for (arg, want) in [("hidden_states_size", hidden), ("logits_size", top_k)] {
            if let Some(v) = w
                .meta
                .get("init_args")
                .and_then(|a| a.get(arg))
                .and_then(|v| v.as_u64())
            {
                if v as usize != want {
                    return Err(w.err(format!("init_args.{arg} = {v} but the weights say {want}")));
                }
            }
        }
        let input_norm = if w.contains("layer_norm_hidden_states.weight") {
            Some((
                w.layer_norm("layer_norm_hidden_states", Some(hidden))?,
                w.layer_norm("layer_norm_token", Some(embed_dim))?,
            ))
        } else {
            None
        };
        let input_proj = w.linear("backbone.input_projection", Some(combined.out), None)?;
        let mut width = input_proj.out;
        let mut blocks = Vec::new();
        while w.contains(&format!(
            "backbone.blocks.{}.layer_norm.weight",
            blocks.len()
        )) {
            let p = format!("backbone.blocks.{}", blocks.len());
            let norm = w.layer_norm(&format!("{p}.layer_norm"), Some(width))?;
            let up = w.linear(&format!("{p}.mlp.0"), Some(width), None)?;
            let down = w.linear(&format!("{p}.mlp.3"), Some(up.out), None)?;
            let dim_change = if w.contains(&format!("{p}.dim_change.weight")) {
                Some(w.linear(&format!("{p}.dim_change"), Some(width), Some(down.out))?)
            } else if down.out != width {
                return Err(w.err(format!(
                    "missing tensor `{p}.dim_change.weight` ({width} -> {})",
                    down.out
                )));
            } else {
                None
            };
            width = down.out;
            blocks.push(Block {
                norm,
                up,
                down,
                dim_change,
            });
        }
        if blocks.is_empty() {
            return Err(w.err("missing tensor `backbone.blocks.0.layer_norm.weight`"));
        }
        let out_norm = w.layer_norm("backbone.output_layer.0", Some(width))?;
        let out = w.linear("backbone.output_layer.1", Some(width), Some(1))?;
        let token_embeddings = if w.contains("token_embeddings.weight") {
            Some(w.get("token_embeddings.weight", &[None, Some(embed_dim)])?)
        } else {
            None
        };
        Ok(R2rNet {
            logits_proj,
            input_norm,
            combined,
            input_proj,
            blocks,
            out_norm,
            out,
            hidden,
            embed_dim,
            top_k,
            token_embeddings,
        })
    }

    /// Probabilities `[rows]` from h `[rows, hidden]`, e `[rows, embed]`, top `[rows, k]`.
    pub fn forward(&self, h: &Tensor, e: &Tensor, top: &Tensor) -> candle_core::Result<Vec<f32>> {
        let (h, e, top) = match &self.input_norm {
            Some((nh, ne)) => (
                nh.forward(h)?,
                ne.forward(e)?,
                candle_nn::ops::softmax_last_dim(top)?,
            ),
            None => (h.clone(), e.clone(), top.clone()),
        };
        let z = self.logits_proj.forward(&top)?;
        let x = Tensor::cat(&[&h, &e, &z], 1)?;
        let mut x = self.input_proj.forward(&self.combined.forward(&x)?)?;
        for b in &self.blocks {
            let m = b
                .down
                .forward(&b.up.forward(&b.norm.forward(&x)?)?.gelu_erf()?)?;
            let residual = match &b.dim_change {
                Some(l) => l.forward(&x)?,
                None => x,
            };
            x = (residual + m)?;
        }
        sigmoid_vec(&self.out.forward(&self.out_norm.forward(&x)?)?)
    }
}

type EmbedFn = Arc<dyn Fn(&[u32]) -> candle_core::Result<Tensor> + Send + Sync>;

enum Embed {
    /// The small model's own input embedding (from the engine).
    Engine(EmbedFn),
    /// `token_embeddings.weight` from the checkpoint.
    Table(Tensor),
}

/// The small-model side: score every row, route iff p >= threshold (token dropped).
pub struct R2rSlm {
    net: R2rNet,
    threshold: f32,
    to: ModelIndex,
    embed: Embed,
    device: Device,
}

impl R2rSlm {
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    fn probabilities(&self, step: &StepView<'_>) -> candle_core::Result<Vec<f32>> {
        let n = step.rows.len();
        let h = step
            .hidden
            .ok_or_else(|| candle_core::Error::Msg("the step carries no hidden states".into()))?;
        let h = hidden_rows(h, n, self.net.hidden)?.to_device(&self.device)?;
        let tokens: Vec<u32> = step.rows.iter().map(|r| r.token).collect();
        let e = match &self.embed {
            Embed::Engine(f) => f(&tokens)?,
            Embed::Table(t) => t.index_select(&Tensor::new(tokens.as_slice(), t.device())?, 0)?,
        };
        let e = hidden_rows(&e, n, self.net.embed_dim)?.to_device(&self.device)?;
        let k = self.net.top_k;
        let mut top = Vec::with_capacity(n * k);
        for r in step.rows {
            // The step's own top logits (computed on the model's device), else the host's.
            if let Some(t) = r.top_logits.filter(|t| t.len() == k) {
                top.extend_from_slice(t);
                continue;
            }
            if r.logits.len() < k {
                candle_core::bail!(
                    "request {} has {} logits, the router reads the top {k}",
                    r.rid,
                    r.logits.len()
                );
            }
            top.extend(
                top_k_indices(r.logits, k)
                    .into_iter()
                    .map(|i| r.logits[i as usize]),
            );
        }
        let top = Tensor::from_vec(top, (n, k), &self.device)?;
        self.net.forward(&h, &e, &top)
    }
}

impl Policy for R2rSlm {
    fn tunables(&self) -> Vec<crate::policy::Tunable> {
        use crate::policy::Tunable;
        vec![Tunable::unit("threshold")]
    }

    fn needs(&self) -> Needs {
        // Hidden state and the top logits only: on a GPU the step computes both on the
        // device and greedy requests are sampled there (no logits reach the host).
        Needs {
            hidden: true,
            no_logits: true,
            entropy: false,
            top_logits: self.net.top_k,
        }
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        if step.rows.is_empty() {
            return Vec::new();
        }
        let threshold = self.threshold;
        super::decide(step, "r2r", self.to, self.probabilities(step), |row, p| {
            p >= row.kwarg("threshold", threshold)
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct R2rKwargs {
    /// Router weights (`default_router.pt` or `.safetensors`), relative to the config.
    model_path: Option<String>,
    /// Route iff p >= threshold; default: the checkpoint's `common_args.threshold`, else 0.5.
    threshold: Option<f64>,
    /// TokenRouter's key; only `neural` exists.
    switching_strategy: Option<String>,
    /// Target model name (default: the other model).
    to: Option<String>,
    /// Large-model side: keep writing while its own normalised entropy is above this
    /// (R-Stitch's rule; per request `"routing": {"stay_entropy": t}`); absent: one token,
    /// as R2R.
    stay_entropy: Option<f64>,
}

/// The kwargs parsed and checked without weights (the switching strategy, a given
/// threshold's range).
fn parse(k: &serde_yaml::Value, at: &ModelSite) -> Result<(R2rKwargs, Option<f32>), ConfigError> {
    let site = Site::at(at);
    let kw: R2rKwargs = parse_kwargs(k, &site.model, &at.config_file)?;
    if let Some(s) = kw.switching_strategy.as_deref().filter(|s| *s != "neural") {
        return Err(site.err(
            "switching_strategy",
            format!("`{s}` is not supported (only `neural`)"),
        ));
    }
    let threshold = kw
        .threshold
        .map(|t| check_unit(&site, "threshold", t))
        .transpose()?;
    if let Some(t) = kw.stay_entropy {
        if at.model == 0 {
            return Err(site.err(
                "stay_entropy",
                "belongs to the large model's `r2r_llm` (how long it keeps writing)",
            ));
        }
        check_unit(&site, "stay_entropy", t)?;
    }
    Ok((kw, threshold))
}

/// Build the R2R small-model policy from its kwargs (also used by tests).
pub fn build_slm(kwargs: &serde_yaml::Value, ctx: &PolicyContext) -> Result<R2rSlm, ConfigError> {
    let site = Site::of(ctx);
    let at = ctx.site();
    let (kw, threshold) = parse(kwargs, &at)?;
    let (to, path) = router_site(&at, &kw.to, &kw.model_path)?;
    let w = Weights::load(&path, &ctx.device, &site, "model_path")?;
    let net = R2rNet::from_weights(&w)?;
    let threshold = match threshold {
        Some(t) => t,
        None => match w
            .meta
            .get("common_args")
            .and_then(|c| c.get("threshold"))
            .and_then(|t| t.as_f64())
        {
            Some(t) => check_unit(&site, "threshold", t)
                .map_err(|_| w.err(format!("common_args.threshold {t} is not in [0, 1]")))?,
            None => DEFAULT_THRESHOLD,
        },
    };
    let limit = ctx.sample_limit.min(ctx.vocab_size);
    if net.top_k > limit {
        return Err(w.err(format!(
            "the router reads the top {} logits but the model has {limit}",
            net.top_k
        )));
    }
    let embed = match (&ctx.embed, &net.token_embeddings) {
        (Some(f), _) => {
            let probe = f(&[0]).map_err(|e| site.err("model_path", format!("cannot embed a token: {e}")))?;
            let width = probe.dims().last().copied().unwrap_or(0);
            if width != net.embed_dim || width != net.hidden {
                return Err(w.err(format!(
                    "router expects hidden size {} and embedding width {}, but model `{}` has hidden size {width}",
                    net.hidden, net.embed_dim, site.model
                )));
            }
            Embed::Engine(f.clone())
        }
        (None, Some(t)) => Embed::Table(t.clone()),
        (None, None) => {
            return Err(w.err("needs the small model's input embeddings: the engine gives none and the file has no `token_embeddings.weight`"))
        }
    };
    Ok(R2rSlm {
        net,
        threshold,
        to,
        embed,
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
            Ok(Box::new(build_slm(k, ctx)?))
        } else {
            // The large model writes one token, keeps it, and hands the request back (or,
            // with `stay_entropy`, keeps writing while unsure). Its kwargs are still checked
            // so a typo does not pass silently.
            let (kw, _) = parse(k, &ctx.site())?;
            Ok(match kw.stay_entropy {
                Some(t) => Box::new(RStitchLlm {
                    threshold: t as f32,
                    key: "stay_entropy",
                }),
                None => Box::new(ReturnAfterOne),
            })
        }
    }
    for n in ["r2r", "r2r_slm", "r2r_llm"] {
        r.register(n, check, build);
    }
}
