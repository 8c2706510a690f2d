//! GlimpRouter (Zengwh02/GlimpRouter): training-free, step-level routing. A reasoning
//! step ends at "\n\n". At each step start the small model writes one "glimpse" token;
//! the entropy (natural log) of its top-20 renormalised probabilities decides who writes
//! the step: at entropy >= threshold the large model writes the whole step (until its
//! text ends with "\n\n", or EOS, which the engine handles), otherwise the small model.
//!
//! The glimpse token: METHODS.md says "the glimpse token is discarded". When the large
//! model takes the step it is (sent with DropLast: the large model rewrites that
//! position). When the small model keeps the step we keep the glimpse as the step's
//! first token instead of discarding and re-sampling it: the small model would draw the
//! same token under greedy decoding and one from the same distribution under sampling,
//! so the output distribution is unchanged and one small-model step is saved.

use super::router_net::{check_unit, target, Site};
use crate::config::{parse_kwargs, ConfigError};
use crate::policy::{
    AllowedTokens, Decision, ModelSite, Policy, PolicyContext, Registry, SendMode, StepView,
};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;
use tokenrouter_api::ModelIndex;
use tokenrouter_runtime::sampling::top_k_indices;

/// GlimpRouter's entropy is taken over this many most likely tokens.
pub const GLIMPSE_TOP_K: usize = 20;
/// Default threshold (the paper uses 0.9-1.0).
pub const DEFAULT_THRESHOLD: f64 = 0.95;
/// The text that ends a reasoning step.
pub const STEP_BREAK: &str = "\n\n";

/// Entropy (natural log) of the top-`k` probabilities of `logits`, renormalised; of a
/// constrained row, over the tokens it may write (a forced token: 0), as R-Stitch's.
pub fn top_k_entropy(logits: &[f32], k: usize, allowed: Option<&dyn AllowedTokens>) -> f32 {
    let masked: Vec<f32>;
    let logits = match allowed {
        Some(a) => {
            masked = (0u32..)
                .zip(logits)
                .map(|(i, &l)| if a.allows(i) { l } else { f32::NEG_INFINITY })
                .collect();
            &masked[..]
        }
        None => logits,
    };
    let top: Vec<f64> = top_k_indices(logits, k)
        .into_iter()
        .map(|i| f64::from(logits[i as usize]))
        .collect();
    let Some(max) = top.first().copied() else {
        return 0.0;
    };
    let z: f64 = top.iter().map(|l| (l - max).exp()).sum();
    let h: f64 = top
        .iter()
        .map(|l| {
            let p = (l - max).exp() / z;
            if p > 0.0 {
                -p * p.ln()
            } else {
                0.0
            }
        })
        .sum();
    h as f32
}

/// Whether the decoded text of `tokens` ends with "\n\n" (looking back only as far as
/// needed: a break may be split over several tokens).
pub fn ends_with_step_break(texts: &[String], tokens: &[u32]) -> bool {
    let mut tail = String::new();
    for &t in tokens.iter().rev() {
        let piece = texts.get(t as usize).map(String::as_str).unwrap_or("");
        tail.insert_str(0, piece);
        if tail.len() >= STEP_BREAK.len() {
            break;
        }
    }
    tail.ends_with(STEP_BREAK)
}

/// Small-model side: glimpse at step starts, stay elsewhere.
struct GlimpSlm {
    threshold: f32,
    to: ModelIndex,
    texts: Arc<Vec<String>>,
}

impl Policy for GlimpSlm {
    fn tunables(&self) -> Vec<crate::policy::Tunable> {
        use crate::policy::Tunable;
        vec![Tunable {
            key: "threshold",
            min: 0.0,
            max: 3.0,
        }]
    }

    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                let step_start = r.output.is_empty() || ends_with_step_break(&self.texts, r.output);
                if !step_start {
                    return Decision::STAY;
                }
                let h = top_k_entropy(r.logits, GLIMPSE_TOP_K, r.allowed);
                if h >= r.kwarg("threshold", self.threshold) {
                    Decision::go(self.to, Some(h))
                } else {
                    Decision::stay(Some(h))
                }
            })
            .collect()
    }

    fn send(&self, _rid: u64, _to: ModelIndex) -> SendMode {
        SendMode::DropLast
    }
}

/// Large-model side: write until the text written in this visit ends with "\n\n".
struct GlimpLlm {
    texts: Arc<Vec<String>>,
    /// Tail of the text written since the request arrived, per request.
    written: HashMap<u64, String>,
}

impl Policy for GlimpLlm {
    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision> {
        step.rows
            .iter()
            .map(|r| {
                let tail = self.written.entry(r.rid).or_default();
                tail.push_str(
                    self.texts
                        .get(r.token as usize)
                        .map(String::as_str)
                        .unwrap_or(""),
                );
                if tail.ends_with(STEP_BREAK) {
                    self.written.remove(&r.rid);
                    return Decision::go(0, None);
                }
                // Only the last few characters matter for the break test.
                if tail.len() > 16 {
                    let mut cut = tail.len() - 8;
                    while !tail.is_char_boundary(cut) {
                        cut += 1;
                    }
                    tail.drain(..cut);
                }
                Decision::STAY
            })
            .collect()
    }

    fn send(&self, _rid: u64, _to: ModelIndex) -> SendMode {
        SendMode::KeepLast
    }

    fn receive(&mut self, rid: u64, _from: ModelIndex, delta: &[u32]) -> usize {
        // A new visit: the step text starts here.
        self.written.remove(&rid);
        delta.len()
    }

    fn forget(&mut self, rid: u64) {
        self.written.remove(&rid);
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GlimpKwargs {
    /// Route the step iff the glimpse entropy (nats, top-20) >= threshold (default 0.95).
    threshold: Option<f64>,
    /// Target model name (default: the other model).
    to: Option<String>,
}

/// The kwargs, validated without weights: the threshold, and the entry model's target.
fn settings(
    k: &serde_yaml::Value,
    at: &ModelSite,
) -> Result<(f64, Option<ModelIndex>), ConfigError> {
    let site = Site::at(at);
    let kw: GlimpKwargs = parse_kwargs(k, &site.model, &at.config_file)?;
    let threshold = kw.threshold.unwrap_or(DEFAULT_THRESHOLD);
    // Entropy over 20 outcomes lies in [0, ln 20].
    let max = (GLIMPSE_TOP_K as f64).ln();
    check_unit(&site, "threshold", threshold / max).map_err(|_| {
        site.err(
            "threshold",
            format!("{threshold} is not in [0, ln {GLIMPSE_TOP_K} = {max:.3}]"),
        )
    })?;
    let to = (at.model == 0)
        .then(|| target(at, &kw.to, "to"))
        .transpose()?;
    Ok((threshold, to))
}

pub fn register(r: &mut Registry) {
    fn check(k: &serde_yaml::Value, at: &ModelSite) -> Result<(), ConfigError> {
        settings(k, at).map(drop)
    }
    fn build(k: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError> {
        let site = Site::of(ctx);
        let (threshold, to) = settings(k, &ctx.site())?;
        if ctx.token_text.is_empty() {
            return Err(
                site.model_err("glimprouter needs the tokenizer's token texts to find \"\\n\\n\"")
            );
        }
        let texts = ctx.token_text.clone();
        if let Some(to) = to {
            Ok(Box::new(GlimpSlm {
                threshold: threshold as f32,
                to,
                texts,
            }))
        } else {
            Ok(Box::new(GlimpLlm {
                texts,
                written: HashMap::new(),
            }))
        }
    }
    for n in ["glimprouter", "glimprouter_slm", "glimprouter_llm"] {
        r.register(n, check, build);
    }
}
