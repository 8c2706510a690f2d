//! The learned routers as trainable candle networks: R2R's classifier
//! (`HiddenStatesTokenLMHeadLogitsClassifier`), CITER's confidence MLP and Co-LLM's
//! deferral head — the same tensors under the same names as the `r2r`, `citer` and `collm`
//! methods load (PyTorch `[out, in]` weights), initialised like PyTorch's `nn.Linear` from
//! a seeded generator so that a seed gives identical weights, with dropout masks from that
//! generator too.

use crate::{Result, TrainError};
use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::Path;

/// The class name R2R's files carry (what the `r2r` method checks).
pub const MODEL_TYPE: &str = "HiddenStatesTokenLMHeadLogitsClassifier";

/// Which router is trained (all read the features `label` stores).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Head {
    /// R2R: hidden state, token embedding and top-k logits; p = P(route).
    R2r,
    /// CITER: an MLP with BatchNorm on the hidden state; p = P(the small token is fine).
    Citer,
    /// Co-LLM: one linear deferral unit on the hidden state; p = P(defer).
    Collm,
}

impl Head {
    /// Whether the network's probability is that of *keeping* the token (CITER), so that
    /// routing happens below a threshold instead of at or above it.
    pub fn scores_keeping(self) -> bool {
        self == Head::Citer
    }
}

/// The network's sizes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NetSpec {
    pub head: Head,
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
    /// BatchNorm running statistics (CITER): not trained, updated by training steps.
    buffers: std::cell::RefCell<Vec<(String, Tensor)>>,
}

/// PyTorch's BatchNorm1d momentum for the running statistics.
const BN_MOMENTUM: f64 = 0.1;

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
            buffers: std::cell::RefCell::new(Vec::new()),
        };
        let (h, e, k, d) = (spec.hidden_size, spec.embed_size, spec.top_k, spec.width);
        match spec.head {
            Head::R2r => {}
            Head::Collm => {
                net.linear(&mut rng, "deferral", h, 1)?;
                return Ok(net);
            }
            Head::Citer => {
                // CITER's widths come from the hidden size: H -> 2H -> H -> 1.
                net.linear(&mut rng, "mlp.0", h, 2 * h)?;
                net.layer_norm("mlp.1", 2 * h)?;
                net.buffers.borrow_mut().extend([
                    (
                        "mlp.1.running_mean".to_string(),
                        Tensor::zeros(2 * h, DType::F32, &Device::Cpu)?,
                    ),
                    (
                        "mlp.1.running_var".to_string(),
                        Tensor::ones(2 * h, DType::F32, &Device::Cpu)?,
                    ),
                ]);
                net.linear(&mut rng, "mlp.4", 2 * h, h)?;
                net.linear(&mut rng, "linear", h, 1)?;
                return Ok(net);
            }
        }
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
        match self.spec.head {
            Head::R2r => {}
            Head::Collm => return self.apply_linear("deferral", h)?.flatten_all(),
            Head::Citer => return self.citer_forward(h, dropout),
        }
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

    /// CITER: Linear -> BatchNorm -> ReLU -> Dropout -> Linear -> Dropout -> Linear.
    /// Training (`dropout` given) normalises by the batch and updates the running
    /// statistics; otherwise the running statistics are used, as in eval mode.
    fn citer_forward(
        &self,
        h: &Tensor,
        mut dropout: Option<&mut ChaCha8Rng>,
    ) -> candle_core::Result<Tensor> {
        let x = self.apply_linear("mlp.0", h)?;
        let (mean, var) = match dropout.is_some() {
            true => {
                let n = x.dim(0)? as f64;
                let mean = x.mean_keepdim(0)?;
                let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)?;
                let mut buf = self.buffers.borrow_mut();
                let unbiased = if n > 1.0 {
                    (var.detach() * (n / (n - 1.0)))?
                } else {
                    var.detach()
                };
                for (name, stat) in buf.iter_mut() {
                    let batch = if name.ends_with("running_mean") {
                        mean.detach().flatten_all()?
                    } else {
                        unbiased.flatten_all()?
                    };
                    *stat = ((&*stat * (1.0 - BN_MOMENTUM))? + (batch * BN_MOMENTUM)?)?;
                }
                (mean, var)
            }
            false => {
                let buf = self.buffers.borrow();
                (buf[0].1.unsqueeze(0)?, buf[1].1.unsqueeze(0)?)
            }
        };
        let xn = x
            .broadcast_sub(&mean)?
            .broadcast_div(&(var + LN_EPS)?.sqrt()?)?
            .broadcast_mul(self.t("mlp.1.weight"))?
            .broadcast_add(self.t("mlp.1.bias"))?;
        let mut x = xn.relu()?;
        let p = self.spec.dropout;
        if let (Some(rng), true) = (dropout.as_deref_mut(), p > 0.0) {
            x = x.mul(&dropout_mask(rng, x.dims2()?, p)?)?;
        }
        let mut x = self.apply_linear("mlp.4", &x)?;
        if let (Some(rng), true) = (dropout, p > 0.0) {
            x = x.mul(&dropout_mask(rng, x.dims2()?, p)?)?;
        }
        self.apply_linear("linear", &x)?.flatten_all()
    }

    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|(_, v)| v.clone()).collect()
    }

    pub fn parameters(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// A copy of every weight (to keep the best epoch's).
    pub fn snapshot(&self) -> Result<Vec<Tensor>> {
        let mut out: Vec<Tensor> = self
            .vars
            .iter()
            .map(|(_, v)| v.as_tensor().copy())
            .collect::<candle_core::Result<_>>()?;
        for (_, b) in self.buffers.borrow().iter() {
            out.push(b.copy()?);
        }
        Ok(out)
    }

    pub fn restore(&self, snap: &[Tensor]) -> Result<()> {
        for ((_, v), t) in self.vars.iter().zip(snap) {
            v.set(t)?;
        }
        for ((_, b), t) in self
            .buffers
            .borrow_mut()
            .iter_mut()
            .zip(&snap[self.vars.len().min(snap.len())..])
        {
            *b = t.clone();
        }
        Ok(())
    }

    /// Every tensor the file holds: weights, then buffers.
    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        out.extend(self.buffers.borrow().iter().cloned());
        out
    }

    /// The weights as raw little-endian f32 (to compare runs bit for bit).
    pub fn weight_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (_, t) in self.named_tensors() {
            for x in t.flatten_all()?.to_vec1::<f32>()? {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Write `<dir>/router.safetensors` and `<dir>/router.json` (R2R's `init_args`,
    /// `common_args` with the threshold, plus `training`).
    pub fn save(&self, dir: &Path, threshold: f64, training: serde_json::Value) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::file(dir, e))?;
        let tensors: HashMap<String, Tensor> = self.named_tensors().into_iter().collect();
        let st = dir.join("router.safetensors");
        let tmp = dir.join("router.safetensors.tmp");
        candle_core::safetensors::save(&tensors, &tmp).map_err(|e| TrainError::file(&tmp, e))?;
        std::fs::rename(&tmp, &st).map_err(|e| TrainError::file(&st, e))?;
        let s = &self.spec;
        let meta = match s.head {
            Head::R2r => serde_json::json!({
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
            }),
            // CITER and Co-LLM read only the tensors; the threshold goes in the YAML.
            Head::Citer | Head::Collm => serde_json::json!({
                "model_type": if s.head == Head::Citer { "citer" } else { "collm" },
                "init_args": {"hidden_size": s.hidden_size, "dropout_rate": s.dropout},
                "common_args": {"threshold": threshold},
                "training": training,
            }),
        };
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
