//! Tokenizer, chat template and end-of-generation ids of a model, from a Hugging Face
//! directory (tokenizer.json, tokenizer_config.json, generation_config.json) or from GGUF
//! metadata alone. Also the pair check: two models may route between each other only if
//! their token tables agree, and ids that are padding in either model are masked.

use crate::error::{Result, RuntimeError};
use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use minijinja::{Environment, ErrorKind};
use std::path::Path;
use tokenizers::Tokenizer;

/// Token strings that end generation in the model families we support.
const END_OF_GENERATION: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "</s>",
];

/// A chat message as templates see it (role, content, and an assistant's tool calls or a
/// tool's result): the API crate's type, so nothing is lost between the server and here.
pub use tokenrouter_api::ChatMessage as Message;

pub struct TextModel {
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
}

fn token_str(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| RuntimeError::bad_file(path, format!("invalid JSON: {e}")))
}

fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl TextModel {
    fn new(
        tokenizer: Tokenizer,
        chat_template: Option<String>,
        bos: Option<String>,
        eos: Option<String>,
        mut eos_ids: Vec<u32>,
    ) -> Self {
        if let Some(e) = &eos {
            if let Some(id) = tokenizer.token_to_id(e) {
                eos_ids.push(id);
            }
        }
        for name in END_OF_GENERATION {
            if let Some(id) = tokenizer.token_to_id(name) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Self {
            tokenizer,
            chat_template,
            bos_token: bos,
            eos_token: eos,
            eos_ids,
        }
    }

    /// Load from a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let chat_template = match tcfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(String::from),
            _ => None,
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            None => {
                let p = dir.join("chat_template.jinja");
                p.exists()
                    .then(|| std::fs::read_to_string(&p).ok())
                    .flatten()
            }
        };
        let bos = tcfg.get("bos_token").and_then(token_str);
        let eos = tcfg.get("eos_token").and_then(token_str);
        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        let mut eos_ids = ids_of(gen.get("eos_token_id"));
        if eos_ids.is_empty() {
            let cfg = read_json(&dir.join("config.json"))?.unwrap_or_default();
            eos_ids = ids_of(cfg.get("eos_token_id"));
        }
        Ok(Self::new(tokenizer, chat_template, bos, eos, eos_ids))
    }

    /// The synthetic byte-level tokenizer with a ChatML template (see `synth_vocab.rs`), padded
    /// to `vocab` tokens, for models built from a shape alone (`random_weights`):
    /// benchmarks need text in and out and a vocabulary of real size, not meaningful words.
    pub fn synthetic(vocab: usize) -> Result<Self> {
        let tokenizer = crate::synth_vocab::build_tokenizer(vocab)?;
        Ok(Self::new(
            tokenizer,
            Some(crate::synth_vocab::CHATML_TEMPLATE.to_string()),
            None,
            Some("<|im_end|>".into()),
            Vec::new(),
        ))
    }

    /// Build from GGUF `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(content)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", path.display())))?;
        let md = &content.metadata;
        let get_str = |k: &str| md.get(k).and_then(|v| v.to_string().ok()).cloned();
        let get_id = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let name_of = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
        let bos = name_of(get_id("tokenizer.ggml.bos_token_id"));
        let eos_id = get_id("tokenizer.ggml.eos_token_id");
        let eos = name_of(eos_id);
        let chat_template = get_str("tokenizer.chat_template");
        Ok(Self::new(
            tokenizer,
            chat_template,
            bos,
            eos,
            eos_id.into_iter().collect(),
        ))
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Number of ids the tokenizer knows, padding included.
    pub fn vocab_len(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Ids below this are real tokens; trailing `[PAD…]` placeholders (Qwen2.5 GGUFs list
    /// 271 of them) and ids the tokenizer does not know are padding rows of the embedding.
    pub fn real_vocab_len(&self) -> usize {
        let mut n = self.vocab_len();
        while n > 0 {
            match self.tokenizer.id_to_token(n as u32 - 1) {
                Some(t) if !t.starts_with("[PAD") => break,
                _ => n -= 1,
            }
        }
        n
    }

    /// Tokenize raw text; special tokens written in the text (e.g. `<|im_start|>`) are parsed.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    /// Render the chat template (HF semantics: trim_blocks, lstrip_blocks, Python string
    /// methods). `extra` holds additional variables such as `enable_thinking`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| RuntimeError::Template("the model has no chat template".into()))?;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", crate::template_json::tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        let mut ctx = serde_json::json!({
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token.clone().unwrap_or_default(),
            "eos_token": self.eos_token.clone().unwrap_or_default(),
        });
        if let (Some(obj), Some(extra)) = (ctx.as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                obj.insert(k.clone(), v.clone());
            }
        }
        let tmpl = env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| RuntimeError::Template(e.to_string()))
    }
}

/// Result of checking that several models can share token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedVocab {
    /// Ids at or above this are padding in at least one model and are never sampled.
    pub sample_limit: usize,
}

/// Check that the models' token tables agree on every id that is a real token in both,
/// and work out which ids must be masked. `logit_sizes[i]` is model i's lm_head width.
pub fn check_shared_vocab(models: &[(&str, &TextModel, usize)]) -> Result<SharedVocab> {
    let Some(first) = models.first() else {
        return Err(RuntimeError::TokenizerMismatch("no models".into()));
    };
    let mut limit = first.1.real_vocab_len().min(first.2);
    for (name, m, logits) in &models[1..] {
        let (a, b) = (first.1.tokenizer(), m.tokenizer());
        let n = first.1.real_vocab_len();
        if n != m.real_vocab_len() {
            return Err(RuntimeError::TokenizerMismatch(format!(
                "`{}` has {} tokens but `{name}` has {}",
                first.0,
                n,
                m.real_vocab_len()
            )));
        }
        for id in 0..n as u32 {
            if a.id_to_token(id) != b.id_to_token(id) {
                return Err(RuntimeError::TokenizerMismatch(format!(
                    "token {id} is {:?} in `{}` but {:?} in `{name}`",
                    a.id_to_token(id),
                    first.0,
                    b.id_to_token(id)
                )));
            }
        }
        limit = limit.min(m.real_vocab_len()).min(*logits);
    }
    Ok(SharedVocab {
        sample_limit: limit,
    })
}
