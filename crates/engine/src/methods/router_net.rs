//! Building blocks shared by the learned routers (R2R, CITER, Co-LLM): loading router
//! weights from `.safetensors` or PyTorch `.pt` files, shape checks whose errors name the
//! model, the kwarg, the weight file and the tensor, and the few fp32 layers the routers
//! need (Linear, LayerNorm, eval-mode BatchNorm), batched over the rows of a step.

use super::torch_file;
use crate::config::ConfigError;
use crate::policy::{ModelSite, PolicyContext};
use candle_core::{DType, Device, Tensor, D};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a configuration value came from, for error messages:
/// `<config file>: model.<name>.scheduler_kwargs.<key>: ...`.
#[derive(Clone)]
pub struct Site {
    pub model: String,
    pub config_file: PathBuf,
}

impl Site {
    pub fn of(ctx: &PolicyContext) -> Self {
        Site::at(&ctx.site())
    }

    pub fn at(site: &ModelSite) -> Self {
        Site {
            model: site
                .model_names
                .get(site.model)
                .cloned()
                .unwrap_or_else(|| format!("#{}", site.model)),
            config_file: site.config_file.clone(),
        }
    }

    pub fn err(&self, key: &str, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::Invalid {
            file: self.config_file.clone(),
            message: format!("model.{}.scheduler_kwargs.{key}: {message}", self.model),
        }
    }

    /// An error about the model as a whole (not one kwarg).
    pub fn model_err(&self, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::Invalid {
            file: self.config_file.clone(),
            message: format!("model.{}: {message}", self.model),
        }
    }
}

/// A router's tensors (as fp32 on the model's device) plus whatever configuration the
/// file carries (`init_args`, `common_args`, `model_type` of an R2R checkpoint; for
/// safetensors, a sidecar JSON with the same stem).
pub struct Weights {
    pub path: PathBuf,
    tensors: HashMap<String, Tensor>,
    pub meta: serde_json::Value,
    site: Site,
    key: &'static str,
}

impl Weights {
    /// Load `kwargs.<key>` (already resolved against the config file).
    pub fn load(
        path: &Path,
        device: &Device,
        site: &Site,
        key: &'static str,
    ) -> Result<Self, ConfigError> {
        let shown = path.display();
        if let Err(e) = std::fs::metadata(path) {
            // A trained router that was never made: say which commands make one.
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                "; train one for this pair with `tokenrouter train-router label --config PAIR.yaml --prompts FILE.jsonl --out DIR` then `tokenrouter train-router fit --data DIR --out ROUTER_DIR` (README: Training a router)"
            } else {
                ""
            };
            return Err(site.err(
                key,
                format!("cannot read router weights {shown}: {e}{hint}"),
            ));
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        let (raw, meta) = if ext == "safetensors" {
            let raw = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| {
                site.err(
                    key,
                    format!("{shown}: not a readable safetensors file: {e}"),
                )
            })?;
            (raw, sidecar_meta(path, site, key)?)
        } else {
            let (meta, has_state_dict) = torch_file::read_checkpoint_meta(path).map_err(|e| {
                site.err(
                    key,
                    format!("{shown}: not a readable PyTorch checkpoint: {e}"),
                )
            })?;
            // A bare state dict (CITER, Co-LLM exports) carries no configuration.
            let meta = if has_state_dict {
                meta
            } else {
                serde_json::Value::Null
            };
            let wanted = if has_state_dict {
                Some("state_dict")
            } else {
                None
            };
            let list = candle_core::pickle::read_all_with_key(path, wanted)
                .map_err(|e| site.err(key, format!("{shown}: cannot read tensors: {e}")))?;
            (list.into_iter().collect(), meta)
        };
        let mut tensors = HashMap::with_capacity(raw.len());
        for (name, t) in raw {
            let t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_device(device))
                .map_err(|e| site.err(key, format!("{shown}: tensor `{name}`: {e}")))?;
            tensors.insert(name, t);
        }
        if tensors.is_empty() {
            return Err(site.err(key, format!("{shown}: holds no tensors")));
        }
        Ok(Weights {
            path: path.to_path_buf(),
            tensors,
            meta,
            site: site.clone(),
            key,
        })
    }

    /// Build from tensors already in memory (tests, converters).
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        path: &Path,
        site: &Site,
        key: &'static str,
    ) -> Self {
        Weights {
            path: path.to_path_buf(),
            tensors,
            meta: serde_json::Value::Null,
            site: site.clone(),
            key,
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// An error about this file, naming model, kwarg and file.
    pub fn err(&self, message: impl std::fmt::Display) -> ConfigError {
        self.site
            .err(self.key, format!("{}: {message}", self.path.display()))
    }

    /// Tensor `name`, whose shape must match `shape` (`None` = any size on that axis).
    pub fn get(&self, name: &str, shape: &[Option<usize>]) -> Result<Tensor, ConfigError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(format!("missing tensor `{name}`")))?;
        let dims = t.dims();
        let ok = dims.len() == shape.len()
            && dims
                .iter()
                .zip(shape)
                .all(|(d, s)| s.is_none_or(|s| s == *d));
        if !ok {
            let want: Vec<String> = shape
                .iter()
                .map(|s| s.map_or("_".into(), |s| s.to_string()))
                .collect();
            return Err(self.err(format!(
                "tensor `{name}` has shape {dims:?}, expected [{}]",
                want.join(", ")
            )));
        }
        Ok(t.clone())
    }

    pub fn linear(
        &self,
        prefix: &str,
        inp: Option<usize>,
        out: Option<usize>,
    ) -> Result<Linear, ConfigError> {
        let w = self.get(&format!("{prefix}.weight"), &[out, inp])?;
        let (o, i) = (w.dims()[0], w.dims()[1]);
        let b = self.get(&format!("{prefix}.bias"), &[Some(o)])?;
        let wt = w
            .t()
            .and_then(|t| t.contiguous())
            .map_err(|e| self.err(e))?;
        Ok(Linear {
            wt,
            b,
            inp: i,
            out: o,
        })
    }

    pub fn layer_norm(&self, prefix: &str, dim: Option<usize>) -> Result<LayerNorm, ConfigError> {
        let w = self.get(&format!("{prefix}.weight"), &[dim])?;
        let d = w.dims()[0];
        let b = self.get(&format!("{prefix}.bias"), &[Some(d)])?;
        Ok(LayerNorm {
            w,
            b,
            dim: d,
            eps: 1e-5,
        })
    }

    pub fn batch_norm(&self, prefix: &str, dim: usize) -> Result<BatchNorm, ConfigError> {
        let get = |n: &str| self.get(&format!("{prefix}.{n}"), &[Some(dim)]);
        let (w, b, mean, var) = (
            get("weight")?,
            get("bias")?,
            get("running_mean")?,
            get("running_var")?,
        );
        // Eval mode: y = (x - mean) / sqrt(var + eps) * w + b = x * scale + shift.
        let fold = || -> candle_core::Result<(Tensor, Tensor)> {
            let scale = w.div(&(var + 1e-5)?.sqrt()?)?;
            let shift = b.sub(&mean.mul(&scale)?)?;
            Ok((scale, shift))
        };
        let (scale, shift) = fold().map_err(|e| self.err(e))?;
        Ok(BatchNorm { scale, shift })
    }
}

/// `<stem>.json` next to a safetensors file: `{model_type, init_args, common_args, ...}`.
fn sidecar_meta(path: &Path, site: &Site, key: &str) -> Result<serde_json::Value, ConfigError> {
    let side = path.with_extension("json");
    match std::fs::read_to_string(&side) {
        Ok(text) => serde_json::from_str(&text)
            .map_err(|e| site.err(key, format!("{}: invalid JSON: {e}", side.display()))),
        Err(_) => Ok(serde_json::Value::Null),
    }
}

/// `y = x W^T + b` on `[rows, in]`.
pub struct Linear {
    wt: Tensor,
    b: Tensor,
    pub inp: usize,
    pub out: usize,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.wt)?.broadcast_add(&self.b)
    }
}

/// LayerNorm over the last axis, biased variance, eps 1e-5 (PyTorch's default).
pub struct LayerNorm {
    w: Tensor,
    b: Tensor,
    pub dim: usize,
    eps: f64,
}

impl LayerNorm {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xn = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        xn.broadcast_mul(&self.w)?.broadcast_add(&self.b)
    }
}

/// BatchNorm1d in eval mode (running statistics), folded into a scale and a shift.
pub struct BatchNorm {
    scale: Tensor,
    shift: Tensor,
}

impl BatchNorm {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_mul(&self.scale)?.broadcast_add(&self.shift)
    }
}

/// `[rows, d]` fp32 hidden states from a step, checking the width.
pub fn hidden_rows(h: &Tensor, rows: usize, width: usize) -> candle_core::Result<Tensor> {
    let (r, w) = h.dims2()?;
    if r != rows || w != width {
        candle_core::bail!("hidden states are [{r}, {w}], the router expects [{rows}, {width}]");
    }
    h.to_dtype(DType::F32)
}

/// Probabilities as a host vector from a `[rows, 1]` or `[rows]` logit tensor.
pub fn sigmoid_vec(logit: &Tensor) -> candle_core::Result<Vec<f32>> {
    candle_nn::ops::sigmoid(&logit.flatten_all()?)?.to_vec1::<f32>()
}

/// Role-independent kwargs error for a missing weight file path.
pub fn require_path(site: &Site, path: &Option<String>, key: &str) -> Result<String, ConfigError> {
    path.clone().ok_or_else(|| {
        site.err(
            key,
            "required (path of the router weights, .safetensors or .pt)",
        )
    })
}

/// The entry model's side of a learned router: where it routes (`to`) and which router file
/// it reads (`model_path`, required; relative to the config or `$TOKENROUTER_CACHE/`).
pub fn router_site(
    at: &ModelSite,
    to: &Option<String>,
    model_path: &Option<String>,
) -> Result<(usize, PathBuf), ConfigError> {
    let to = target(at, to, "to")?;
    let path = at.resolve_path(&require_path(&Site::at(at), model_path, "model_path")?);
    Ok((to, path))
}

/// A probability-like threshold must lie in [0, 1].
pub fn check_unit(site: &Site, key: &str, v: f64) -> Result<f32, ConfigError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(site.err(key, format!("{v} is not in [0, 1]")));
    }
    Ok(v as f32)
}

/// The model a routed request goes to: `kwargs.<key>` by name, else the other model of a
/// pair (model 0 -> 1, others -> 0).
pub fn target(ctx: &ModelSite, to: &Option<String>, key: &str) -> Result<usize, ConfigError> {
    let site = Site::at(ctx);
    match to {
        None if ctx.model_names.len() < 2 => Err(site.err(key, "routing needs a second model")),
        None => Ok(if ctx.model == 0 { 1 } else { 0 }),
        Some(name) => match ctx.model_names.iter().position(|n| n == name) {
            Some(i) if i != ctx.model => Ok(i),
            Some(_) => Err(site.err(key, format!("`{name}` is this model itself"))),
            None => Err(site.err(key, format!("no model named `{name}`"))),
        },
    }
}
