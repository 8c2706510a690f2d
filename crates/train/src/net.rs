//! R2R's router (`HiddenStatesTokenLMHeadLogitsClassifier`) as a trainable candle network:
//! the same tensors under the same names as the `r2r` method loads (PyTorch `[out, in]`
//! weights), initialised like PyTorch's `nn.Linear` from a seeded generator so that a seed
//! gives identical weights, with dropout masks from that generator too.

use crate::{Result, TrainError};
use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::Path;

/// The class name R2R's files carry (what the `r2r` method checks).
pub const MODEL_TYPE: &str = "HiddenStatesTokenLMHeadLogitsClassifier";

/// The network's sizes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NetSpec {
    /// Width of the small model's hidden state (and of the top-k projection).
    pub hidden_size: usize,
    /// Width of the token embedding (the small model's input embedding).
    pub embed_size: usize,
    /// Number of top logits read.
    pub top_k: usize,
    /// Width of the residual MLP.
    pub width: usize,
    pub blocks: usize,
    /// Inner width of each block, as a multiple of `width`.
    pub expansion: usize,
    pub dropout: f32,
    /// LayerNorm on hidden state and embedding, softmax on the top logits.
    pub normalize_input: bool,
}

const LN_EPS: f64 = 1e-5;

/// The network's variables, by R2R's tensor names.
pub struct TrainNet {
    pub spec: NetSpec,
    vars: Vec<(String, Var)>,
    index: HashMap<String, usize>,
}

impl TrainNet {
    /// Fresh weights: Linear weights and biases uniform in ±1/sqrt(fan_in) (PyTorch's
    /// default), LayerNorm weights 1 and biases 0.
    pub fn init(spec: NetSpec, seed: u64) -> Result<Self> {
        if spec.width == 0 || spec.blocks == 0 || spec.expansion == 0 {
            return Err(TrainError::Input(
                "--width, --blocks and --expansion must be at least 1".into(),
            ));
        }
        if !(0.0..1.0).contains(&spec.dropout) {
            return Err(TrainError::Input(format!(
                "--dropout {} is not in [0, 1)",
                spec.dropout
            )));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut net = TrainNet {
            spec: spec.clone(),
            vars: Vec::new(),
            index: HashMap::new(),
        };
        let (h, e, k, d) = (spec.hidden_size, spec.embed_size, spec.top_k, spec.width);
        net.linear(&mut rng, "logits_projection", k, h)?;
        if spec.normalize_input {
            net.layer_norm("layer_norm_hidden_states", h)?;
            net.layer_norm("layer_norm_token", e)?;
        }
        net.linear(&mut rng, "combined_projection", 2 * h + e, d)?;
        net.linear(&mut rng, "backbone.input_projection", d, d)?;
        for b in 0..spec.blocks {
            let p = format!("backbone.blocks.{b}");
            net.layer_norm(&format!("{p}.layer_norm"), d)?;
            net.linear(&mut rng, &format!("{p}.mlp.0"), d, d * spec.expansion)?;
            net.linear(&mut rng, &format!("{p}.mlp.3"), d * spec.expansion, d)?;
        }
        net.layer_norm("backbone.output_layer.0", d)?;
        net.linear(&mut rng, "backbone.output_layer.1", d, 1)?;
        Ok(net)
    }

    fn push(&mut self, name: String, t: Tensor) -> Result<()> {
        self.index.insert(name.clone(), self.vars.len());
        self.vars.push((name, Var::from_tensor(&t)?));
        Ok(())
    }

    fn linear(&mut self, rng: &mut ChaCha8Rng, name: &str, inp: usize, out: usize) -> Result<()> {
        let bound = 1.0 / (inp as f32).sqrt();
        let mut draw =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-bound..bound)).collect() };
        let w = Tensor::from_vec(draw(out * inp), (out, inp), &Device::Cpu)?;
        let b = Tensor::from_vec(draw(out), out, &Device::Cpu)?;
        self.push(format!("{name}.weight"), w)?;
        self.push(format!("{name}.bias"), b)
    }

    fn layer_norm(&mut self, name: &str, dim: usize) -> Result<()> {
        self.push(
            format!("{name}.weight"),
            Tensor::ones(dim, DType::F32, &Device::Cpu)?,
        )?;
        self.push(
            format!("{name}.bias"),
            Tensor::zeros(dim, DType::F32, &Device::Cpu)?,
        )
    }

    fn t(&self, name: &str) -> &Tensor {
        // Every name used in `forward` was created in `init`.
        self.vars[self.index[name]].1.as_tensor()
    }

    fn apply_linear(&self, name: &str, x: &Tensor) -> candle_core::Result<Tensor> {
        let w = self.t(&format!("{name}.weight"));
        x.matmul(&w.t()?)?
            .broadcast_add(self.t(&format!("{name}.bias")))
    }

    fn apply_layer_norm(&self, name: &str, x: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xn = xc.broadcast_div(&(var + LN_EPS)?.sqrt()?)?;
        xn.broadcast_mul(self.t(&format!("{name}.weight")))?
            .broadcast_add(self.t(&format!("{name}.bias")))
    }

    /// Logits `[rows]` (before the sigmoid) of h `[rows, hidden]`, e `[rows, embed]`, top
    /// `[rows, k]`; with `dropout`, masks drawn from it (training).
    pub fn forward(
        &self,
        h: &Tensor,
        e: &Tensor,
        top: &Tensor,
        mut dropout: Option<&mut ChaCha8Rng>,
    ) -> candle_core::Result<Tensor> {
        let (h, e, top) = if self.spec.normalize_input {
            (
                self.apply_layer_norm("layer_norm_hidden_states", h)?,
                self.apply_layer_norm("layer_norm_token", e)?,
                candle_nn::ops::softmax(top, D::Minus1)?,
            )
        } else {
            (h.clone(), e.clone(), top.clone())
        };
        let z = self.apply_linear("logits_projection", &top)?;
        let x = Tensor::cat(&[&h, &e, &z], 1)?;
        let x = self.apply_linear("combined_projection", &x)?;
        let mut x = self.apply_linear("backbone.input_projection", &x)?;
        for b in 0..self.spec.blocks {
            let p = format!("backbone.blocks.{b}");
            let n = self.apply_layer_norm(&format!("{p}.layer_norm"), &x)?;
            let mut u = self.apply_linear(&format!("{p}.mlp.0"), &n)?.gelu_erf()?;
            if let (Some(rng), true) = (dropout.as_deref_mut(), self.spec.dropout > 0.0) {
                u = u.mul(&dropout_mask(rng, u.dims2()?, self.spec.dropout)?)?;
            }
            x = (x + self.apply_linear(&format!("{p}.mlp.3"), &u)?)?;
        }
        let x = self.apply_layer_norm("backbone.output_layer.0", &x)?;
        self.apply_linear("backbone.output_layer.1", &x)?
            .flatten_all()
    }

    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|(_, v)| v.clone()).collect()
    }

    pub fn parameters(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// A copy of every weight (to keep the best epoch's).
    pub fn snapshot(&self) -> Result<Vec<Tensor>> {
        Ok(self
            .vars
            .iter()
            .map(|(_, v)| v.as_tensor().copy())
            .collect::<candle_core::Result<_>>()?)
    }

    pub fn restore(&self, snap: &[Tensor]) -> Result<()> {
        for ((_, v), t) in self.vars.iter().zip(snap) {
            v.set(t)?;
        }
        Ok(())
    }

    /// The weights as raw little-endian f32 (to compare runs bit for bit).
    pub fn weight_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (_, v) in &self.vars {
            for x in v.as_tensor().flatten_all()?.to_vec1::<f32>()? {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Write `<dir>/router.safetensors` and `<dir>/router.json` (R2R's `init_args`,
    /// `common_args` with the threshold, plus `training`).
    pub fn save(&self, dir: &Path, threshold: f64, training: serde_json::Value) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::file(dir, e))?;
        let tensors: HashMap<String, Tensor> = self
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let st = dir.join("router.safetensors");
        let tmp = dir.join("router.safetensors.tmp");
        candle_core::safetensors::save(&tensors, &tmp).map_err(|e| TrainError::file(&tmp, e))?;
        std::fs::rename(&tmp, &st).map_err(|e| TrainError::file(&st, e))?;
        let s = &self.spec;
        let meta = serde_json::json!({
            "model_type": MODEL_TYPE,
            "init_args": {
                "hidden_states_size": s.hidden_size,
                "logits_size": s.top_k,
                "hidden_dims": vec![s.width; s.blocks],
                "expansion_factor": s.expansion,
                "dropout_rate": s.dropout,
                "normalize_input": s.normalize_input,
            },
            "common_args": {
                "threshold": threshold,
                "input_type": ["hidden_states", "token", "logits"],
            },
            "training": training,
        });
        let js = dir.join("router.json");
        std::fs::write(&js, serde_json::to_string_pretty(&meta).unwrap_or_default())
            .map_err(|e| TrainError::file(&js, e))
    }
}

/// Inverted dropout: each unit kept with probability 1 - p and scaled by 1 / (1 - p).
fn dropout_mask(
    rng: &mut ChaCha8Rng,
    (r, c): (usize, usize),
    p: f32,
) -> candle_core::Result<Tensor> {
    let keep = 1.0 / (1.0 - p);
    let m: Vec<f32> = (0..r * c)
        .map(|_| if rng.random::<f32>() < p { 0.0 } else { keep })
        .collect();
    Tensor::from_vec(m, (r, c), &Device::Cpu)
}
