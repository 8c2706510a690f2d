//! The synthetic byte-level vocabulary (Qwen2's pre-tokenizer, a few merges, ChatML
//! specials): the tokenizer of random-weight models (GPU benchmarks, `load_random_model`)
//! and of the synthetic test models (`synth`, feature `synth`).

use crate::error::{Result, RuntimeError};
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// ChatML's, then Qwen2.5-Coder's fill-in-the-middle tokens (so `/infill` and `suffix` can be
/// tested on synthetic models).
pub const SPECIAL_TOKENS: [&str; 9] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];
pub(crate) const MERGES: [(&str, &str); 6] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
];
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The vocabulary of the synthetic tokenizer in id order.
pub fn token_table() -> Vec<String> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let mut tokens: Vec<String> = alphabet.into_iter().map(String::from).collect();
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
    }
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    tokens
}

/// The synthetic tokenizer; `vocab` > the base table pads it with filler tokens
/// (`<f123>`: never produced by encoding, but sampled and decoded like real ones) so a
/// model of real shape samples from a vocabulary of real size.
pub(crate) fn build_tokenizer(vocab: usize) -> Result<Tokenizer> {
    let mut tokens = token_table();
    let n_plain = tokens.len() - SPECIAL_TOKENS.len();
    let fillers = vocab.saturating_sub(tokens.len());
    tokens.splice(n_plain..n_plain, (0..fillers).map(|i| format!("<f{i}>")));
    let n_plain = tokens.len() - SPECIAL_TOKENS.len();
    let vocab: tokenizers::models::bpe::Vocab = tokens[..n_plain]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = MERGES
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
    // The same pipeline as Qwen2's tokenizer.json (and candle's GGUF `qwen2` pre-tokenizer).
    let split = Split::new(
        SplitPattern::Regex(QWEN2_SPLIT.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
    let pre = Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ]);
    let mut tok = Tokenizer::new(bpe);
    tok.with_normalizer(Some(NFC))
        .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::new(false, false, false)));
    tok.with_post_processor(Some(ByteLevel::new(false, false, false)));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
    Ok(tok)
}
