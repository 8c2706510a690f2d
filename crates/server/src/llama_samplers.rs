//! llama.cpp's sampler keys, read the same way on its own endpoints (`/completion`,
//! `/infill`) and on the OpenAI ones (llama.cpp's OpenAI endpoints take them too, and its
//! clients send them there): DRY, XTC, locally typical, top-n-sigma, dynamic temperature
//! and `samplers`, the chain's order. On llama.cpp's endpoints its chain always applies
//! (its order puts the temperature after the cuts); on the OpenAI endpoints a request that
//! sends any of these keys gets it, the others keep vLLM's order. Mirostat is refused by
//! name: its running state would have to travel with every hand-off.

use serde::Deserialize;
use serde_json::Value;
use tokenrouter_api::{DryParams, LlamaChain, LlamaStage, SamplingParams};

use crate::error::ApiError;

#[derive(Debug, Default, Deserialize)]
pub struct LlamaSamplerFields {
    typical_p: Option<f64>,
    top_n_sigma: Option<f64>,
    xtc_probability: Option<f64>,
    xtc_threshold: Option<f64>,
    dynatemp_range: Option<f64>,
    dynatemp_exponent: Option<f64>,
    dry_multiplier: Option<f64>,
    dry_base: Option<f64>,
    dry_allowed_length: Option<i64>,
    dry_penalty_last_n: Option<i64>,
    dry_sequence_breakers: Option<Vec<String>>,
    /// The chain's order: names (`["top_k", "temperature"]`) or letters (`"kt"`).
    samplers: Option<Value>,
    mirostat: Option<i64>,
}

impl LlamaSamplerFields {
    /// Whether the request sent any of llama.cpp's chain keys.
    fn any_given(&self) -> bool {
        self.typical_p.is_some()
            || self.top_n_sigma.is_some()
            || self.xtc_probability.is_some()
            || self.xtc_threshold.is_some()
            || self.dynatemp_range.is_some()
            || self.dynatemp_exponent.is_some()
            || self.dry_multiplier.is_some()
            || self.dry_base.is_some()
            || self.dry_allowed_length.is_some()
            || self.dry_penalty_last_n.is_some()
            || self.dry_sequence_breakers.is_some()
            || self.samplers.is_some()
    }

    /// Puts llama.cpp's chain into `sampling` (`always`: llama.cpp's own endpoints; else
    /// only when the request sent one of its keys). A stage the request's `samplers` leaves
    /// out is not applied: its value in `sampling` is set to "off" (no `penalties`: no
    /// penalties; no `temperature`: 1 unless greedy).
    pub fn apply(&self, always: bool, sampling: &mut SamplingParams) -> Result<(), ApiError> {
        if self.mirostat.is_some_and(|m| m != 0) {
            return Err(ApiError::invalid(
                "mirostat",
                "`mirostat` is not supported: leave it at 0 (its state would have to follow \
                 the request from model to model)",
            ));
        }
        if !always && !self.any_given() {
            return Ok(());
        }
        let d = LlamaChain::default();
        let (order, penalties) = match &self.samplers {
            None | Some(Value::Null) => (d.order.clone(), true),
            Some(given) => order(given)?,
        };
        if !penalties {
            sampling.repetition_penalty = 1.0;
            sampling.presence_penalty = 0.0;
            sampling.frequency_penalty = 0.0;
        }
        let off = |stage| !order.contains(&stage);
        if off(LlamaStage::TopK) {
            sampling.top_k = 0;
        }
        if off(LlamaStage::TopP) {
            sampling.top_p = 1.0;
        }
        if off(LlamaStage::MinP) {
            sampling.min_p = 0.0;
        }
        if off(LlamaStage::Temperature) && sampling.temperature > 0.0 {
            sampling.temperature = 1.0;
        }
        let f = |v: Option<f64>, param: &str, default: f32| -> Result<f32, ApiError> {
            match v {
                None => Ok(default),
                Some(v) if v.is_finite() && (v as f32).is_finite() => Ok(v as f32),
                Some(_) => Err(ApiError::invalid(
                    param,
                    format!("`{param}` must be a finite number"),
                )),
            }
        };
        let multiplier = f(self.dry_multiplier, "dry_multiplier", 0.0)?;
        let dry = (multiplier != 0.0)
            .then(|| -> Result<DryParams, ApiError> {
                Ok(DryParams {
                    multiplier,
                    base: f(self.dry_base, "dry_base", DryParams::BASE)?,
                    allowed_length: count(
                        self.dry_allowed_length,
                        "dry_allowed_length",
                        DryParams::ALLOWED_LENGTH,
                    )?,
                    penalty_last_n: window(self.dry_penalty_last_n)?,
                    sequence_breakers: self
                        .dry_sequence_breakers
                        .clone()
                        .unwrap_or_else(DryParams::default_breakers),
                })
            })
            .transpose()?;
        sampling.llama = Some(LlamaChain {
            order,
            typical_p: f(self.typical_p, "typical_p", d.typical_p)?,
            top_n_sigma: f(self.top_n_sigma, "top_n_sigma", d.top_n_sigma)?,
            xtc_probability: f(self.xtc_probability, "xtc_probability", d.xtc_probability)?,
            xtc_threshold: f(self.xtc_threshold, "xtc_threshold", d.xtc_threshold)?,
            dynatemp_range: f(self.dynatemp_range, "dynatemp_range", d.dynatemp_range)?,
            dynatemp_exponent: f(
                self.dynatemp_exponent,
                "dynatemp_exponent",
                d.dynatemp_exponent,
            )?,
            dry,
        });
        Ok(())
    }
}

/// The chain's settings as llama.cpp reports them (`generation_settings`, `/props`).
pub fn settings(chain: Option<&LlamaChain>) -> serde_json::Map<String, Value> {
    let default = LlamaChain::default();
    let c = chain.unwrap_or(&default);
    let dry = c.dry.clone().unwrap_or(DryParams {
        multiplier: 0.0,
        base: DryParams::BASE,
        allowed_length: DryParams::ALLOWED_LENGTH,
        penalty_last_n: None,
        sequence_breakers: DryParams::default_breakers(),
    });
    let names: Vec<&str> = std::iter::once("penalties")
        .chain(c.order.iter().map(|s| match s {
            LlamaStage::Dry => "dry",
            LlamaStage::TopNSigma => "top_n_sigma",
            LlamaStage::TopK => "top_k",
            LlamaStage::TypicalP => "typ_p",
            LlamaStage::TopP => "top_p",
            LlamaStage::MinP => "min_p",
            LlamaStage::Xtc => "xtc",
            LlamaStage::Temperature => "temperature",
        }))
        .collect();
    let json = serde_json::json!({
        "typical_p": c.typical_p,
        "top_n_sigma": c.top_n_sigma,
        "xtc_probability": c.xtc_probability,
        "xtc_threshold": c.xtc_threshold,
        "dynatemp_range": c.dynatemp_range,
        "dynatemp_exponent": c.dynatemp_exponent,
        "dry_multiplier": dry.multiplier,
        "dry_base": dry.base,
        "dry_allowed_length": dry.allowed_length,
        "dry_penalty_last_n": dry.penalty_last_n.map_or(-1, |n| n as i64),
        "dry_sequence_breakers": dry.sequence_breakers,
        "mirostat": 0,
        "samplers": names,
    });
    match json {
        Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// `samplers` as the chain's stages and whether `penalties` is among them. Names llama.cpp
/// has and we do not run (`infill`) are skipped, as llama.cpp skips names it does not know.
fn order(given: &Value) -> Result<(Vec<LlamaStage>, bool), ApiError> {
    let bad = || {
        ApiError::invalid(
            "samplers",
            "`samplers` must be an array of sampler names or a string of their letters",
        )
    };
    let mut stages = Vec::new();
    let mut penalties = false;
    let mut add = |stage: Option<LlamaStage>, is_penalties: bool| {
        penalties |= is_penalties;
        if let Some(s) = stage.filter(|s| !stages.contains(s)) {
            stages.push(s);
        }
    };
    match given {
        Value::String(letters) => {
            for c in letters.chars() {
                add(LlamaStage::from_char(c), c == 'e');
            }
        }
        Value::Array(names) => {
            for name in names {
                let name = name.as_str().ok_or_else(bad)?;
                add(LlamaStage::from_name(name), name == "penalties");
            }
        }
        _ => return Err(bad()),
    }
    Ok((stages, penalties))
}

fn count(v: Option<i64>, param: &str, default: usize) -> Result<usize, ApiError> {
    match v {
        None => Ok(default),
        Some(n) => usize::try_from(n)
            .map_err(|_| ApiError::invalid(param, format!("`{param}` must be at least 0"))),
    }
}

/// `dry_penalty_last_n`: -1 (the default) scans the whole context, 0 turns DRY off.
fn window(v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None | Some(-1) => Ok(None),
        Some(n) => usize::try_from(n).map(Some).map_err(|_| {
            ApiError::invalid(
                "dry_penalty_last_n",
                format!(
                    "`dry_penalty_last_n` must be -1 (the whole context) or at least 0, got {n}"
                ),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: Value) -> LlamaSamplerFields {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn llama_cpp_endpoints_always_get_the_chain_openai_ones_when_asked() {
        let mut s = SamplingParams::default();
        fields(serde_json::json!({})).apply(false, &mut s).unwrap();
        assert_eq!(s.llama, None);
        fields(serde_json::json!({})).apply(true, &mut s).unwrap();
        assert_eq!(s.llama, Some(LlamaChain::default()));
        let mut s = SamplingParams::default();
        fields(serde_json::json!({"xtc_probability": 0.5, "dry_multiplier": 0.8}))
            .apply(false, &mut s)
            .unwrap();
        let chain = s.llama.unwrap();
        assert_eq!(chain.xtc_probability, 0.5);
        let dry = chain.dry.unwrap();
        assert_eq!(
            (dry.base, dry.allowed_length, dry.penalty_last_n),
            (1.75, 2, None)
        );
        assert_eq!(dry.sequence_breakers, ["\n", ":", "\"", "*"]);
    }

    #[test]
    fn samplers_set_the_order_and_switch_off_what_they_leave_out() {
        let mut s = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            ..SamplingParams::default()
        };
        fields(serde_json::json!({"samplers": ["temperature", "top_k", "infill"]}))
            .apply(true, &mut s)
            .unwrap();
        let chain = s.llama.as_ref().unwrap();
        assert_eq!(chain.order, [LlamaStage::Temperature, LlamaStage::TopK]);
        assert_eq!((s.top_k, s.top_p, s.min_p), (40, 1.0, 0.0));
        assert_eq!((s.temperature, s.repetition_penalty), (0.7, 1.0));
        let mut s = SamplingParams {
            temperature: 0.7,
            repetition_penalty: 1.1,
            ..SamplingParams::default()
        };
        fields(serde_json::json!({"samplers": "ekp"}))
            .apply(true, &mut s)
            .unwrap();
        assert_eq!(s.llama.unwrap().order, [LlamaStage::TopK, LlamaStage::TopP]);
        assert_eq!((s.temperature, s.repetition_penalty), (1.0, 1.1));
    }

    #[test]
    fn bad_values_are_named() {
        let cases = [
            (serde_json::json!({"mirostat": 2}), "mirostat"),
            (serde_json::json!({"samplers": 3}), "samplers"),
            (serde_json::json!({"samplers": [1]}), "samplers"),
            (
                serde_json::json!({"dry_multiplier": 1, "dry_allowed_length": -1}),
                "dry_allowed_length",
            ),
            (
                serde_json::json!({"dry_multiplier": 1, "dry_penalty_last_n": -2}),
                "dry_penalty_last_n",
            ),
            (serde_json::json!({"typical_p": 1e300}), "typical_p"),
        ];
        for (json, param) in cases {
            let e = fields(json.clone())
                .apply(true, &mut SamplingParams::default())
                .unwrap_err();
            assert!(format!("{e:?}").contains(param), "{json}: {e:?}");
        }
        // mirostat 0 is the default: accepted.
        assert!(fields(serde_json::json!({"mirostat": 0}))
            .apply(true, &mut SamplingParams::default())
            .is_ok());
    }
}
