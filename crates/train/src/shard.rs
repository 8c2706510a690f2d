//! The labelled feature store: one safetensors file per shard of prompts, holding per
//! answer position the small model's final-norm hidden state, the input embedding of its
//! greedy token and its top-k logits (all f16), the two models' tokens, the label, and
//! where the position came from. Shards are written whole (temporary file + rename), so a
//! directory holds only complete shards and labelling resumes at the first missing one.

use crate::{Result, TrainError};
use candle_core::{DType, Device, Tensor};
use half::f16;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Features of labelled positions (a shard, or every shard of a directory).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Features {
    /// Width of the hidden state, the embedding and the top-k logits.
    pub hidden_size: usize,
    pub embed_size: usize,
    pub top_k: usize,
    /// `[n, hidden_size]`, `[n, embed_size]`, `[n, top_k]` (descending), row-major.
    pub hidden: Vec<f16>,
    pub embed: Vec<f16>,
    pub top: Vec<f16>,
    /// The small model's greedy token and the large model's token at each position.
    pub small_token: Vec<u32>,
    pub large_token: Vec<u32>,
    /// 1: the small model's token should be routed (it differs from the large model's).
    pub label: Vec<u8>,
    /// Index of the prompt in the prompt set and of the answer position in its answer.
    pub prompt: Vec<u32>,
    pub position: Vec<u32>,
}

impl Features {
    pub fn new(hidden_size: usize, embed_size: usize, top_k: usize) -> Self {
        Features {
            hidden_size,
            embed_size,
            top_k,
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.label.len()
    }

    pub fn is_empty(&self) -> bool {
        self.label.is_empty()
    }

    pub fn positives(&self) -> usize {
        self.label.iter().filter(|&&l| l != 0).count()
    }

    /// Append another set with the same widths.
    pub fn extend(&mut self, o: &Features) -> Result<()> {
        if (o.hidden_size, o.embed_size, o.top_k) != (self.hidden_size, self.embed_size, self.top_k)
        {
            return Err(TrainError::Input(format!(
                "shards disagree on feature widths: {}/{}/{} vs {}/{}/{}",
                self.hidden_size, self.embed_size, self.top_k, o.hidden_size, o.embed_size, o.top_k
            )));
        }
        self.hidden.extend_from_slice(&o.hidden);
        self.embed.extend_from_slice(&o.embed);
        self.top.extend_from_slice(&o.top);
        self.small_token.extend_from_slice(&o.small_token);
        self.large_token.extend_from_slice(&o.large_token);
        self.label.extend_from_slice(&o.label);
        self.prompt.extend_from_slice(&o.prompt);
        self.position.extend_from_slice(&o.position);
        Ok(())
    }

    fn tensors(&self) -> candle_core::Result<HashMap<String, Tensor>> {
        let n = self.len();
        let cpu = Device::Cpu;
        let mut m = HashMap::new();
        m.insert(
            "hidden".into(),
            Tensor::from_slice(&self.hidden, (n, self.hidden_size), &cpu)?,
        );
        m.insert(
            "embed".into(),
            Tensor::from_slice(&self.embed, (n, self.embed_size), &cpu)?,
        );
        m.insert(
            "top".into(),
            Tensor::from_slice(&self.top, (n, self.top_k), &cpu)?,
        );
        for (k, v) in [
            ("small_token", &self.small_token),
            ("large_token", &self.large_token),
            ("prompt", &self.prompt),
            ("position", &self.position),
        ] {
            m.insert(k.into(), Tensor::from_slice(v, n, &cpu)?);
        }
        m.insert("label".into(), Tensor::from_slice(&self.label, n, &cpu)?);
        Ok(m)
    }
}

/// The file of shard `i` in `dir`.
pub fn shard_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("shard-{i:05}.safetensors"))
}

/// Write a shard whole: a temporary file renamed into place.
pub fn write(path: &Path, f: &Features) -> Result<()> {
    if f.is_empty() {
        // safetensors cannot hold zero-length tensors of every kind portably: keep one
        // sentinel-free file by writing widths only.
        let meta = serde_json::json!({"empty": true, "hidden_size": f.hidden_size, "embed_size": f.embed_size, "top_k": f.top_k});
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, meta.to_string()).map_err(|e| TrainError::file(&tmp, e))?;
        return std::fs::rename(&tmp, path.with_extension("empty.json"))
            .map_err(|e| TrainError::file(path, e));
    }
    let tensors = f.tensors()?;
    let tmp = path.with_extension("tmp");
    candle_core::safetensors::save(&tensors, &tmp).map_err(|e| TrainError::file(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::file(path, e))
}

/// Whether shard `path` exists (complete), possibly as an empty shard.
pub fn exists(path: &Path) -> bool {
    path.is_file() || path.with_extension("empty.json").is_file()
}

/// Read a shard, checking every tensor's dtype and shape.
pub fn read(path: &Path) -> Result<Features> {
    let empty = path.with_extension("empty.json");
    if !path.is_file() && empty.is_file() {
        let text = std::fs::read_to_string(&empty).map_err(|e| TrainError::file(&empty, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TrainError::file(&empty, e))?;
        let get = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as usize;
        return Ok(Features::new(
            get("hidden_size"),
            get("embed_size"),
            get("top_k"),
        ));
    }
    let bad = |m: String| TrainError::file(path, format!("not a label shard: {m}"));
    let t = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| bad(e.to_string()))?;
    let get = |k: &str, dtype: DType, rank: usize| -> Result<&Tensor> {
        let x = t.get(k).ok_or_else(|| bad(format!("no tensor `{k}`")))?;
        if x.dtype() != dtype || x.rank() != rank {
            return Err(bad(format!(
                "tensor `{k}` is {:?} {:?}, expected {dtype:?} of rank {rank}",
                x.dtype(),
                x.dims()
            )));
        }
        Ok(x)
    };
    let label = get("label", DType::U8, 1)?;
    let n = label.dim(0)?;
    let mat = |k: &str| -> Result<(usize, Vec<f16>)> {
        let x = get(k, DType::F16, 2)?;
        if x.dim(0)? != n {
            return Err(bad(format!(
                "tensor `{k}` has {} rows, expected {n}",
                x.dim(0)?
            )));
        }
        Ok((x.dim(1)?, x.flatten_all()?.to_vec1::<f16>()?))
    };
    let ids = |k: &str| -> Result<Vec<u32>> {
        let x = get(k, DType::U32, 1)?;
        if x.dim(0)? != n {
            return Err(bad(format!(
                "tensor `{k}` has {} rows, expected {n}",
                x.dim(0)?
            )));
        }
        Ok(x.to_vec1::<u32>()?)
    };
    let (hidden_size, hidden) = mat("hidden")?;
    let (embed_size, embed) = mat("embed")?;
    let (top_k, top) = mat("top")?;
    Ok(Features {
        hidden_size,
        embed_size,
        top_k,
        hidden,
        embed,
        top,
        small_token: ids("small_token")?,
        large_token: ids("large_token")?,
        label: label.to_vec1::<u8>()?,
        prompt: ids("prompt")?,
        position: ids("position")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Features {
        let mut f = Features::new(3, 2, 2);
        for i in 0..4u32 {
            f.hidden
                .extend((0..3).map(|j| f16::from_f32((i * 3 + j) as f32 * 0.5)));
            f.embed
                .extend((0..2).map(|j| f16::from_f32(j as f32 - 1.0)));
            f.top.extend([f16::from_f32(9.0), f16::from_f32(8.0)]);
            f.small_token.push(i);
            f.large_token.push(i % 2);
            f.label.push((i != i % 2) as u8);
            f.prompt.push(i / 2);
            f.position.push(i % 2);
        }
        f
    }

    #[test]
    fn round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let p = shard_path(dir.path(), 0);
        let f = sample();
        write(&p, &f).unwrap();
        assert!(exists(&p));
        assert_eq!(read(&p).unwrap(), f);
        assert_eq!(f.positives(), 2);
        // Truncated file: a clear error, not a panic.
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("not a label shard"), "{e}");
        std::fs::write(&p, b"garbage").unwrap();
        assert!(read(&p).is_err());
        // An empty shard round-trips too.
        let q = shard_path(dir.path(), 1);
        write(&q, &Features::new(3, 2, 2)).unwrap();
        assert!(exists(&q));
        assert!(read(&q).unwrap().is_empty());
        let mut g = Features::new(4, 2, 2);
        assert!(g.extend(&f).is_err());
    }
}
