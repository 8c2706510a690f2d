//! Tiny synthetic models (random weights, a small byte-level BPE vocabulary) written as a
//! Hugging Face directory or a GGUF file, so tests of every layer can load real files
//! without downloading anything. Weights come from a seeded RNG: same spec, same model.
//! Behind the default feature `synth` (a library user can leave it out); the vocabulary
//! itself is `synth_vocab.rs`, which random-weight models need in every build.

use crate::config::Arch;
use crate::error::{Result, RuntimeError};
use crate::synth_vocab::{build_tokenizer, MERGES};
pub use crate::synth_vocab::{token_table, CHATML_TEMPLATE, SPECIAL_TOKENS};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub arch: Arch,
    /// lm_head width; larger than the tokenizer's vocabulary so padding ids exist.
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub tie_embeddings: bool,
    pub max_position: usize,
    pub seed: u64,
    /// Scale of random weights; larger gives peakier (more decisive) logits.
    pub scale: f32,
}

impl SynthSpec {
    pub fn tiny(arch: Arch, seed: u64) -> Self {
        Self {
            arch,
            vocab_size: 288,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            tie_embeddings: arch != Arch::Llama,
            max_position: 512,
            seed,
            scale: 0.15,
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Named tensors in Hugging Face naming, `[out, in]` matrices.
fn hf_tensors(spec: &SynthSpec) -> Result<Vec<(String, Tensor)>> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let dev = Device::Cpu;
    let mut rand = |shape: &[usize], scale: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
            .collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let ones = |n: usize,
                rng_scale: f32,
                r: &mut dyn FnMut(&[usize], f32) -> Result<Tensor>|
     -> Result<Tensor> { Ok((r(&[n], rng_scale)? + 1.0)?) };
    let (h, i) = (spec.hidden_size, spec.intermediate_size);
    let (qd, kvd) = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    );
    let s = spec.scale;
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        rand(&[spec.vocab_size, h], 1.0)?,
    )];
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        out.push((
            format!("{p}.input_layernorm.weight"),
            ones(h, 0.1, &mut rand)?,
        ));
        out.push((
            format!("{p}.post_attention_layernorm.weight"),
            ones(h, 0.1, &mut rand)?,
        ));
        out.push((format!("{p}.self_attn.q_proj.weight"), rand(&[qd, h], s)?));
        out.push((format!("{p}.self_attn.k_proj.weight"), rand(&[kvd, h], s)?));
        out.push((format!("{p}.self_attn.v_proj.weight"), rand(&[kvd, h], s)?));
        out.push((format!("{p}.self_attn.o_proj.weight"), rand(&[h, qd], s)?));
        if spec.arch == Arch::Qwen2 {
            out.push((format!("{p}.self_attn.q_proj.bias"), rand(&[qd], s)?));
            out.push((format!("{p}.self_attn.k_proj.bias"), rand(&[kvd], s)?));
            out.push((format!("{p}.self_attn.v_proj.bias"), rand(&[kvd], s)?));
        }
        if spec.arch == Arch::Qwen3 {
            out.push((
                format!("{p}.self_attn.q_norm.weight"),
                ones(spec.head_dim, 0.1, &mut rand)?,
            ));
            out.push((
                format!("{p}.self_attn.k_norm.weight"),
                ones(spec.head_dim, 0.1, &mut rand)?,
            ));
        }
        out.push((format!("{p}.mlp.gate_proj.weight"), rand(&[i, h], s)?));
        out.push((format!("{p}.mlp.up_proj.weight"), rand(&[i, h], s)?));
        out.push((format!("{p}.mlp.down_proj.weight"), rand(&[h, i], s)?));
    }
    out.push(("model.norm.weight".to_string(), ones(h, 0.1, &mut rand)?));
    if !spec.tie_embeddings {
        out.push((
            "lm_head.weight".to_string(),
            rand(&[spec.vocab_size, h], s)?,
        ));
    }
    Ok(out)
}

/// Write a Hugging Face model directory (config.json, model.safetensors, tokenizer files).
pub fn write_hf_dir(spec: &SynthSpec, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors: HashMap<String, Tensor> = hf_tensors(spec)?.into_iter().collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    let config = serde_json::json!({
        "architectures": [match spec.arch { Arch::Qwen3 => "Qwen3ForCausalLM", Arch::Qwen2 => "Qwen2ForCausalLM", Arch::Llama => "LlamaForCausalLM" }],
        "model_type": spec.arch.name(),
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": false,
        "eos_token_id": 258 + MERGES.len() as u32,
        "torch_dtype": "float32",
    });
    let write = |name: &str, v: &serde_json::Value| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).unwrap_or_default()).map_err(io(&p))
    };
    write("config.json", &config)?;
    let tok_path = dir.join("tokenizer.json");
    build_tokenizer(0)?
        .save(&tok_path, false)
        .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
    write(
        "tokenizer_config.json",
        &serde_json::json!({"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": null}),
    )?;
    write(
        "generation_config.json",
        &serde_json::json!({"eos_token_id": [eos_id(), endoftext_id()]}),
    )?;
    Ok(dir.to_path_buf())
}

/// GGUF name of a Hugging Face tensor name.
fn gguf_tensor_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.trim_start_matches("model.layers.");
    let (layer, name) = rest.split_once('.').unwrap_or(("0", rest));
    let parts = [
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let (base, suffix) = name.rsplit_once('.').unwrap_or((name, "weight"));
    let g = parts
        .iter()
        .find(|(h, _)| *h == base)
        .map(|(_, g)| *g)
        .unwrap_or(base);
    format!("blk.{layer}.{g}.{suffix}")
}

/// Llama GGUFs store q/k rows permuted for adjacent-pair RoPE (llama.cpp's converter).
fn permute_for_interleaved_rope(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = t.dims2()?;
    let hd = out / heads;
    Ok(t.reshape((heads, 2, hd / 2, inp))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((out, inp))?)
}

/// Write a GGUF file with the same weights as [`write_hf_dir`] (matrices in `dtype`, norms
/// and biases in F32) and the tokenizer in `tokenizer.ggml.*` metadata.
pub fn write_gguf(spec: &SynthSpec, path: &Path, dtype: GgmlDType) -> Result<PathBuf> {
    use gguf_file::Value;
    let arch = spec.arch.name();
    let mut qtensors = Vec::new();
    for (name, t) in hf_tensors(spec)? {
        let t = match (
            spec.arch,
            name.contains("q_proj.weight"),
            name.contains("k_proj.weight"),
        ) {
            (Arch::Llama, true, _) => permute_for_interleaved_rope(&t, spec.num_heads)?,
            (Arch::Llama, _, true) => permute_for_interleaved_rope(&t, spec.num_kv_heads)?,
            _ => t,
        };
        let q = if t.rank() == 2 {
            QTensor::quantize(&t, dtype)?
        } else {
            QTensor::quantize(&t, GgmlDType::F32)?
        };
        qtensors.push((gguf_tensor_name(&name), q));
    }
    let tokens = token_table();
    let n_plain = tokens.len() - SPECIAL_TOKENS.len();
    let u = |x: usize| Value::U32(x as u32);
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), u(spec.num_layers)),
        (format!("{arch}.context_length"), u(spec.max_position)),
        (format!("{arch}.embedding_length"), u(spec.hidden_size)),
        (
            format!("{arch}.feed_forward_length"),
            u(spec.intermediate_size),
        ),
        (format!("{arch}.attention.head_count"), u(spec.num_heads)),
        (
            format!("{arch}.attention.head_count_kv"),
            u(spec.num_kv_heads),
        ),
        (format!("{arch}.attention.key_length"), u(spec.head_dim)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(
                MERGES
                    .iter()
                    .map(|(a, b)| Value::String(format!("{a} {b}")))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                (0..tokens.len())
                    .map(|i| Value::I32(if i < n_plain { 1 } else { 3 }))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos_id())),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHATML_TEMPLATE.into()),
        ),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).map_err(io(path))?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(path.to_path_buf())
}

fn special_id(name: &str) -> u32 {
    token_table().iter().position(|t| t == name).unwrap_or(0) as u32
}

/// Id of `<|im_end|>` in the synthetic vocabulary.
pub fn eos_id() -> u32 {
    special_id("<|im_end|>")
}

/// Id of `<|endoftext|>` in the synthetic vocabulary.
pub fn endoftext_id() -> u32 {
    special_id("<|endoftext|>")
}
