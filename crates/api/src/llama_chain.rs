//! llama.cpp's sampler chain, for requests that ask for it: its own samplers (DRY,
//! top-n-sigma, locally typical, XTC, dynamic temperature) and its order, in which the
//! temperature comes after the truncations (vLLM's order, the default here, scales
//! first). llama.cpp clients send these keys to `/completion` and to its OpenAI endpoints;
//! their presets (SillyTavern, text-generation-webui) lean on DRY and XTC.

use serde::{Deserialize, Serialize};

use crate::InvalidParam;

/// One stage of llama.cpp's chain (`samplers`), by its llama.cpp name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LlamaStage {
    Dry,
    TopNSigma,
    TopK,
    TypicalP,
    TopP,
    MinP,
    Xtc,
    Temperature,
}

impl LlamaStage {
    /// llama.cpp's default chain after the penalties:
    /// `dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature`.
    pub const DEFAULT_ORDER: [LlamaStage; 8] = [
        LlamaStage::Dry,
        LlamaStage::TopNSigma,
        LlamaStage::TopK,
        LlamaStage::TypicalP,
        LlamaStage::TopP,
        LlamaStage::MinP,
        LlamaStage::Xtc,
        LlamaStage::Temperature,
    ];

    /// A stage from one of the names llama.cpp's `samplers` accepts (canonical and
    /// alternative spellings); `None` for the rest.
    pub fn from_name(name: &str) -> Option<LlamaStage> {
        Some(match name {
            "dry" => LlamaStage::Dry,
            "top_n_sigma" | "top-n-sigma" => LlamaStage::TopNSigma,
            "top_k" | "top-k" => LlamaStage::TopK,
            "typ_p" | "typical_p" | "typical-p" | "typ-p" | "typ" | "typical" => {
                LlamaStage::TypicalP
            }
            "top_p" | "top-p" | "nucleus" => LlamaStage::TopP,
            "min_p" | "min-p" => LlamaStage::MinP,
            "xtc" => LlamaStage::Xtc,
            "temperature" | "temp" => LlamaStage::Temperature,
            _ => return None,
        })
    }

    /// A stage from its letter in llama.cpp's `samplers` string form (`"dkypmxt"`).
    pub fn from_char(c: char) -> Option<LlamaStage> {
        Some(match c {
            'd' => LlamaStage::Dry,
            's' => LlamaStage::TopNSigma,
            'k' => LlamaStage::TopK,
            'y' => LlamaStage::TypicalP,
            'p' => LlamaStage::TopP,
            'm' => LlamaStage::MinP,
            'x' => LlamaStage::Xtc,
            't' => LlamaStage::Temperature,
            _ => return None,
        })
    }
}

/// llama.cpp's DRY ("don't repeat yourself") penalty: a token that would extend a sequence
/// already seen in the context by more than `allowed_length` tokens loses
/// `multiplier * base ^ (length - allowed_length)` from its logit; a sequence breaker in
/// the context cuts the sequences that cross it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DryParams {
    pub multiplier: f32,
    pub base: f32,
    pub allowed_length: usize,
    /// The last this many tokens of prompt and output are scanned; `None`: all of them.
    pub penalty_last_n: Option<usize>,
    /// The breakers as text; the engine finds the token sequences that spell them.
    pub sequence_breakers: Vec<String>,
}

impl DryParams {
    /// llama.cpp's defaults for everything but the multiplier.
    pub const BASE: f32 = 1.75;
    pub const ALLOWED_LENGTH: usize = 2;
    pub const BREAKERS: [&'static str; 4] = ["\n", ":", "\"", "*"];
    /// llama.cpp's bounds on a breaker: 40 characters, 20 tokens after its first.
    pub const MAX_BREAKER_CHARS: usize = 40;
    pub const MAX_BREAKER_TAIL: usize = 20;
    /// More breakers than this are refused (llama.cpp sets no bound; each one costs a scan
    /// of the vocabulary).
    pub const MAX_BREAKERS: usize = 64;

    /// llama.cpp's default breakers as the owned list a request carries.
    pub fn default_breakers() -> Vec<String> {
        Self::BREAKERS.iter().map(|s| s.to_string()).collect()
    }

    /// Whether the penalty can change a logit (llama.cpp's own switches).
    pub fn is_active(&self) -> bool {
        self.multiplier > 0.0 && self.base >= 1.0 && self.penalty_last_n != Some(0)
    }
}

/// What a request asks of llama.cpp's chain: the stages in their order and the settings
/// of the samplers vLLM lacks. Top-k, top-p, min-p and the temperature keep their values
/// in [`crate::SamplingParams`]; a stage left out of `order` is not applied (the front end
/// neutralises its value there too).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaChain {
    pub order: Vec<LlamaStage>,
    /// Locally typical sampling; 1 = off.
    pub typical_p: f32,
    /// Keep logits within n standard deviations of the largest; <= 0 = off.
    pub top_n_sigma: f32,
    /// XTC: with this probability, drop every token at or above the threshold but the
    /// least likely of them; 0 = off.
    pub xtc_probability: f32,
    /// XTC's threshold; above 0.5 = off.
    pub xtc_threshold: f32,
    /// Dynamic temperature: the temperature moves within ±range with the normalised
    /// entropy (raised to `dynatemp_exponent`); 0 = off.
    pub dynatemp_range: f32,
    pub dynatemp_exponent: f32,
    pub dry: Option<DryParams>,
}

impl Default for LlamaChain {
    /// llama.cpp's defaults: its order, every extra sampler off.
    fn default() -> Self {
        Self {
            order: LlamaStage::DEFAULT_ORDER.to_vec(),
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
            dry: None,
        }
    }
}

impl LlamaChain {
    fn has(&self, stage: LlamaStage) -> bool {
        self.order.contains(&stage)
    }

    /// Whether a sampler vLLM's order has no counterpart for is in force.
    pub fn extra_samplers(&self) -> bool {
        (self.has(LlamaStage::TypicalP) && self.typical_p < 1.0)
            || (self.has(LlamaStage::TopNSigma) && self.top_n_sigma > 0.0)
            || (self.has(LlamaStage::Xtc) && self.xtc_active())
            || (self.has(LlamaStage::Temperature) && self.dynatemp_range > 0.0)
            || (self.has(LlamaStage::Dry) && self.dry.as_ref().is_some_and(DryParams::is_active))
    }

    pub fn xtc_active(&self) -> bool {
        self.xtc_probability > 0.0 && self.xtc_threshold <= 0.5
    }

    /// Whether this chain can draw other tokens than vLLM's order with the same top-k,
    /// top-p, min-p and temperature: an extra sampler, or a temperature other than 1 that
    /// comes after a top-p or min-p cut (top-k keeps the same ids at any temperature).
    pub fn differs_from_vllm(&self, temperature: f32, top_p: f32, min_p: f32) -> bool {
        if self.extra_samplers() {
            return true;
        }
        if temperature <= 0.0 || temperature == 1.0 || (top_p >= 1.0 && min_p <= 0.0) {
            return false;
        }
        let at = |s| self.order.iter().position(|&x| x == s);
        let temp = at(LlamaStage::Temperature);
        [LlamaStage::TopP, LlamaStage::MinP]
            .into_iter()
            .filter_map(at)
            .any(|cut| temp.is_none_or(|t| t > cut))
    }

    /// The ranges llama.cpp's samplers make sense in; the error names the field.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let fields = [
            ("typical_p", self.typical_p, 0.0, f32::MAX),
            ("top_n_sigma", self.top_n_sigma, f32::MIN, f32::MAX),
            ("xtc_probability", self.xtc_probability, 0.0, 1.0),
            ("xtc_threshold", self.xtc_threshold, 0.0, 1.0),
            ("dynatemp_range", self.dynatemp_range, 0.0, f32::MAX),
            ("dynatemp_exponent", self.dynatemp_exponent, 0.0, f32::MAX),
        ];
        let dry = self.dry.as_ref();
        let dry_fields = dry
            .map(|d| {
                [
                    ("dry_multiplier", d.multiplier, 0.0, f32::MAX),
                    ("dry_base", d.base, 0.0, f32::MAX),
                ]
            })
            .into_iter()
            .flatten();
        for (param, value, low, high) in fields.into_iter().chain(dry_fields) {
            if !value.is_finite() || !(low..=high).contains(&value) {
                let rule = match (low, high) {
                    (0.0, 1.0) => "in [0, 1]".to_string(),
                    (0.0, _) => "a finite number >= 0".to_string(),
                    _ => "a finite number".to_string(),
                };
                return Err(InvalidParam::new(
                    param,
                    format!("`{param}` must be {rule}, got {value}"),
                ));
            }
        }
        if let Some(d) = dry {
            if d.sequence_breakers.len() > DryParams::MAX_BREAKERS {
                return Err(InvalidParam::new(
                    "dry_sequence_breakers",
                    format!(
                        "`dry_sequence_breakers` may hold at most {} strings, got {}",
                        DryParams::MAX_BREAKERS,
                        d.sequence_breakers.len()
                    ),
                ));
            }
            if d.sequence_breakers.iter().any(String::is_empty) {
                return Err(InvalidParam::new(
                    "dry_sequence_breakers",
                    "a sequence breaker must not be empty".into(),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_letters_read_as_llama_cpp_reads_them() {
        let names = "dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature";
        let order: Vec<_> = names.split(';').filter_map(LlamaStage::from_name).collect();
        assert_eq!(order, LlamaStage::DEFAULT_ORDER);
        let letters: Vec<_> = "dskypmxt"
            .chars()
            .filter_map(LlamaStage::from_char)
            .collect();
        assert_eq!(letters, LlamaStage::DEFAULT_ORDER);
        assert_eq!(LlamaStage::from_name("temp"), Some(LlamaStage::Temperature));
        assert_eq!(LlamaStage::from_name("infill"), None);
    }

    #[test]
    fn the_order_matters_only_where_a_cut_meets_a_temperature() {
        let chain = LlamaChain::default();
        assert!(!chain.extra_samplers());
        // Temperature last, after top-p and min-p: other cuts than vLLM's.
        assert!(chain.differs_from_vllm(0.8, 0.95, 0.05));
        assert!(!chain.differs_from_vllm(1.0, 0.95, 0.05));
        assert!(!chain.differs_from_vllm(0.0, 0.95, 0.05));
        assert!(!chain.differs_from_vllm(0.8, 1.0, 0.0));
        let temp_first = LlamaChain {
            order: vec![LlamaStage::Temperature, LlamaStage::TopK, LlamaStage::TopP],
            ..LlamaChain::default()
        };
        assert!(!temp_first.differs_from_vllm(0.8, 0.95, 0.05));
        let xtc = LlamaChain {
            xtc_probability: 0.5,
            ..LlamaChain::default()
        };
        assert!(xtc.differs_from_vllm(1.0, 1.0, 0.0));
        let xtc_off_by_threshold = LlamaChain {
            xtc_threshold: 0.6,
            ..xtc.clone()
        };
        assert!(!xtc_off_by_threshold.extra_samplers());
    }

    #[test]
    fn validate_names_the_field() {
        assert!(LlamaChain::default().validate().is_ok());
        let bad = [
            (
                LlamaChain {
                    xtc_probability: 1.5,
                    ..LlamaChain::default()
                },
                "xtc_probability",
            ),
            (
                LlamaChain {
                    typical_p: f32::NAN,
                    ..LlamaChain::default()
                },
                "typical_p",
            ),
            (
                LlamaChain {
                    dry: Some(DryParams {
                        multiplier: -1.0,
                        base: 1.75,
                        allowed_length: 2,
                        penalty_last_n: None,
                        sequence_breakers: vec![],
                    }),
                    ..LlamaChain::default()
                },
                "dry_multiplier",
            ),
            (
                LlamaChain {
                    dry: Some(DryParams {
                        multiplier: 0.8,
                        base: 1.75,
                        allowed_length: 2,
                        penalty_last_n: None,
                        sequence_breakers: vec![String::new()],
                    }),
                    ..LlamaChain::default()
                },
                "dry_sequence_breakers",
            ),
        ];
        for (chain, field) in bad {
            let e = chain.validate().unwrap_err();
            assert_eq!(e.param, field, "{}", e.message);
        }
    }
}
