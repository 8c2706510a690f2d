//! Structured output. A constrained request (`response_format` with a JSON schema, vLLM's
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, llama.cpp's GBNF
//! `grammar`, SGLang's `ebnf`) gets a [`Grammar`]:
//! before each of its tokens is sampled, every token that could not continue the
//! constraint has its logit set to -inf, and each token the request keeps advances it. The
//! parsing and the token masks are llguidance's (the library behind llama.cpp's and vLLM's
//! grammar support); this crate builds its token table from the model's tokenizer and maps
//! our requests onto it.
//!
//! Token routing needs nothing more: a grammar advances only by the tokens a request
//! keeps, so whichever model writes a position samples under the same state, and a token
//! a model drops (rewritten by the other) never entered it. Tokens dropped after they were
//! kept roll it back ([`Grammar::rollback`]).

pub mod gbnf;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use tokenrouter_api::OutputConstraint;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum GrammarError {
    /// The model's tokenizer cannot be turned into a token table (not byte-level).
    #[error("structured output is not available for this tokenizer: {0}")]
    Tokenizer(String),
    /// The request's schema, regex or grammar is invalid or unsupported (a 400).
    #[error("{0}")]
    Invalid(String),
    /// The constraint failed while decoding (a token it did not allow, or an internal
    /// limit): the request fails alone.
    #[error("structured output failed: {0}")]
    Decoding(String),
}

/// Compiles constraints for one vocabulary (built once per engine: the token table and
/// llguidance's precomputed token slices take a moment).
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// The token table (GBNF names tokens by their text).
    env: TokEnv,
    /// The id the token table calls end-of-sequence, and every id that ends generation.
    eos: u32,
    eos_ids: Arc<[u32]>,
}

impl GrammarCompiler {
    /// From the model's tokenizer, the width of its logits (ids past the tokenizer's are
    /// padding, never allowed) and the ids that end generation (the first is the table's
    /// end-of-sequence; any of them ends a constrained request where the grammar may end).
    pub fn new(
        tokenizer: &tokenizers::Tokenizer,
        logits_width: usize,
        eos_ids: &[u32],
    ) -> Result<Self, GrammarError> {
        let tokenizer_error = |e: &dyn std::fmt::Display| GrammarError::Tokenizer(e.to_string());
        let mut words = match byte_level_words(tokenizer) {
            Some(words) => words,
            // Other decoders (byte fallback, metaspace) through llguidance's reading of the
            // tokenizer's JSON (tens of MB while it runs for a 150k vocabulary).
            None => {
                let json = tokenizer
                    .to_string(false)
                    .map_err(|e| tokenizer_error(&e))?;
                let json: serde_json::Value =
                    serde_json::from_str(&json).map_err(|e| tokenizer_error(&e))?;
                llguidance::token_bytes_from_tokenizer_json(&json)
                    .map_err(|e| tokenizer_error(&e))?
            }
        };
        let width = logits_width.max(words.len());
        words.resize(width, Vec::new());
        let eos = *eos_ids
            .first()
            .ok_or_else(|| GrammarError::Tokenizer("the model has no end-of-sequence id".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(width as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| tokenizer_error(&e))?;
        factory.quiet();
        Ok(Self {
            factory,
            env,
            eos,
            eos_ids: eos_ids.into(),
        })
    }

    /// How many ids the token table holds (the logits' width).
    pub fn vocab_len(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// The bytes token `id` writes (empty for padding; special tokens carry the table's
    /// marker byte first, so no text a user gives matches them).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.env.tok_trie().token(id)
    }

    /// A fresh grammar state for one request; an invalid constraint is
    /// [`GrammarError::Invalid`] with llguidance's reason.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<Grammar, GrammarError> {
        let grammar = match constraint {
            OutputConstraint::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            OutputConstraint::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(schema.clone())
            }
            OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputConstraint::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                // Lark string literals take JSON's quoting.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::from(c.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            OutputConstraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            OutputConstraint::Gbnf(gbnf) => {
                let trie = self.env.tok_trie();
                // llama.cpp's `<think>`: a special token of that name, else a plain token
                // spelling exactly that text.
                let token_id = |text: &str| {
                    trie.get_special_token(text)
                        .or_else(|| trie.token_id(text.as_bytes()))
                };
                let lark = gbnf::gbnf_to_lark(gbnf, &token_id, &self.eos_ids)
                    .map_err(|e| GrammarError::Invalid(e.to_string()))?;
                TopLevelGrammar::from_lark(lark)
            }
        };
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Grammar {
            matcher,
            eos: self.eos,
            eos_ids: self.eos_ids.clone(),
        })
    }
}

/// Each token's bytes for a byte-level BPE tokenizer (Qwen2/3, Llama 3): its vocabulary
/// strings spell bytes in GPT-2's printable alphabet; special added tokens get llguidance's
/// 0xFF marker, so no grammar text can produce them. `None` for other decoders.
fn byte_level_words(tokenizer: &tokenizers::Tokenizer) -> Option<Vec<Vec<u8>>> {
    if !matches!(
        tokenizer.get_decoder(),
        Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))
    ) {
        return None;
    }
    // GPT-2's bytes_to_unicode, inverted: printable Latin-1 bytes stand for themselves, the
    // others for U+0100 onwards in byte order.
    let mut byte_of = std::collections::HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1)?
        };
        byte_of.insert(c, b);
    }
    let added = tokenizer.get_added_tokens_decoder();
    let size = tokenizer.get_vocab_size(true);
    let mut words = Vec::with_capacity(size);
    for id in 0..size as u32 {
        let word = match added.get(&id) {
            Some(t) if t.special => [&[0xFF][..], t.content.as_bytes()].concat(),
            Some(t) => t.content.as_bytes().to_vec(),
            None => match tokenizer.id_to_token(id) {
                Some(piece) => piece
                    .chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<_>>()?,
                None => Vec::new(),
            },
        };
        words.push(word);
    }
    Some(words)
}

/// A [`GrammarCompiler`] built on first use, once (callers meanwhile wait for it); a
/// thread may call [`LazyCompiler::get`] ahead to have it ready.
pub struct LazyCompiler {
    tokenizer: tokenizers::Tokenizer,
    logits_width: usize,
    eos_ids: Vec<u32>,
    built: OnceLock<Result<Arc<GrammarCompiler>, GrammarError>>,
}

impl LazyCompiler {
    /// [`GrammarCompiler::new`]'s arguments, kept until it is built.
    pub fn new(tokenizer: tokenizers::Tokenizer, logits_width: usize, eos_ids: Vec<u32>) -> Self {
        Self {
            tokenizer,
            logits_width,
            eos_ids,
            built: OnceLock::new(),
        }
    }

    pub fn get(&self) -> Result<Arc<GrammarCompiler>, GrammarError> {
        self.built
            .get_or_init(|| {
                GrammarCompiler::new(&self.tokenizer, self.logits_width, &self.eos_ids)
                    .map(Arc::new)
            })
            .clone()
    }

    /// `text`'s ids as the tokenizer splits it, no special tokens added (the ids that
    /// follow a DRY sequence breaker's first token).
    pub fn encode_plain(&self, text: &str) -> Vec<u32> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }

    /// Builds it now on a thread of its own, so that the first constrained request finds
    /// it ready (Qwen2.5's 151k tokens: 0.4 s on 2 cores).
    pub fn build_in_background(self: &Arc<Self>) {
        let this = self.clone();
        let _ = std::thread::Builder::new()
            .name("tokenrouter-grammar".into())
            .spawn(move || {
                if let Err(e) = this.get() {
                    tracing::warn!("structured output is unavailable: {e}");
                }
            });
    }
}

/// One request's place in its constraint.
pub struct Grammar {
    matcher: Matcher,
    eos: u32,
    eos_ids: Arc<[u32]>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Grammar {
    /// Sets the logit of every token that cannot come next to -inf. Where the constraint
    /// may end, every end-of-generation id stays allowed; once it must end, only those.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        self.allowed()?.apply(logits);
        Ok(())
    }

    /// The tokens that may come next ([`Grammar::mask`] without logits at hand: computed
    /// while a GPU runs the step, applied to its logits there).
    pub fn allowed(&mut self) -> Result<Allowed, GrammarError> {
        let mut allowed = self.matcher.compute_mask_or_eos().map_err(decoding)?;
        if allowed.is_allowed(self.eos) {
            for &id in self.eos_ids.iter() {
                if (id as usize) < allowed.len() {
                    allowed.allow_token(id);
                }
            }
        }
        Ok(Allowed(allowed))
    }

    /// The request kept `token` (any end-of-generation id counts as the table's; once the
    /// constraint is complete, only those are accepted, and change nothing).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        let end = self.eos_ids.contains(&token);
        if self.matcher.is_stopped() {
            return match end {
                true => Ok(()),
                false => Err(GrammarError::Decoding(format!(
                    "token {token} after the end of the constraint"
                ))),
            };
        }
        let token = if end { self.eos } else { token };
        self.matcher.consume_token(token).map_err(decoding)
    }

    /// The request dropped its last `n` kept tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.matcher.rollback(n).map_err(decoding)
    }

    /// Nothing but an end of generation may follow.
    pub fn must_end(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// One step's set of tokens a constrained request may sample.
pub struct Allowed(llguidance::toktrie::SimpleVob);

impl Allowed {
    /// Sets the logit of every other token to -inf (ids past the token table included).
    pub fn apply(&self, logits: &mut [f32]) {
        let covered = self.0.len().min(logits.len());
        self.0.iter_unset_entries(|i| {
            if let Some(x) = logits.get_mut(i) {
                *x = f32::NEG_INFINITY;
            }
        });
        logits[covered..].fill(f32::NEG_INFINITY);
    }

    /// Writes the set as bits over `bits` (id `i` is bit `i % 8` of byte `i / 8`; ids past
    /// the token table: 0): the form a mask is uploaded to a GPU in, an eighth of the
    /// bytes of one flag a token.
    pub fn write_bits(&self, bits: &mut [u8]) {
        let words = self.0.as_slice();
        let mut chunks = bits.chunks_mut(4);
        for (chunk, word) in chunks.by_ref().zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
        }
        chunks.for_each(|rest| rest.fill(0));
        // Ids from the table's end to its word's end.
        let len = self.0.len();
        if let Some(byte) = bits.get_mut(len / 8) {
            *byte &= ((1u16 << (len % 8)) - 1) as u8;
        }
        if let Some(rest) = bits.get_mut(len / 8 + 1..) {
            rest.fill(0);
        }
    }

    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// How many tokens the set allows.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

fn decoding(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Decoding(e.to_string())
}

#[cfg(test)]
mod tests;
