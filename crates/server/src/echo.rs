//! `echo` on `/v1/completions` (as vLLM and OpenAI's legacy endpoint): each choice's text
//! starts with its prompt, and with `logprobs` its log-probability entries start with the
//! prompt's tokens — the first with `null`, each later one scored after the tokens before
//! it. That is how lm-eval's `local-completions` asks for log-likelihoods (`echo`,
//! `logprobs`, `max_tokens` 0 or 1). With `max_tokens: 0` the choice is the prompt alone.

use tokenrouter_api::TextError;

use crate::detok::IncrementalDecoder;

/// The echoed prompts of one request.
#[derive(Debug)]
pub struct Echo {
    /// Per prompt: its text (as given, or decoded from token ids), its ids, and where each
    /// token's text starts in it (characters).
    prompts: Vec<EchoedPrompt>,
    /// Choices per prompt (choice `p * n + i` is prompt p's).
    n: usize,
    /// `max_tokens: 0`: the prompt alone (one token is generated and dropped).
    pub prompt_only: bool,
}

#[derive(Debug)]
pub struct EchoedPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub offsets: Vec<usize>,
}

impl Echo {
    pub fn new(prompts: Vec<EchoedPrompt>, n: usize, prompt_only: bool) -> Self {
        Self {
            prompts,
            n: n.max(1),
            prompt_only,
        }
    }

    /// The prompt of choice `index`.
    pub fn prompt(&self, index: usize) -> Option<&EchoedPrompt> {
        self.prompts.get(index / self.n)
    }
}

impl EchoedPrompt {
    /// `text` shown for the prompt `ids`; `decode` keeps special tokens (the prompt is
    /// shown as it was given).
    pub fn new<F>(text: String, ids: Vec<u32>, decode: F) -> Result<Self, TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        let offsets = token_offsets(&ids, text.chars().count(), decode)?;
        Ok(Self { text, ids, offsets })
    }

    /// Characters of the prompt's text (where the completion's offsets start).
    pub fn chars(&self) -> usize {
        self.text.chars().count()
    }
}

/// Where each token's text starts, in characters: the incremental decoder's pieces, as
/// for generated tokens (a token that completes no character starts where the next
/// does), never past `limit`.
fn token_offsets<F>(ids: &[u32], limit: usize, decode: F) -> Result<Vec<usize>, TextError>
where
    F: Fn(&[u32]) -> Result<String, TextError>,
{
    let mut detok = IncrementalDecoder::default();
    let mut chars = 0;
    let mut offsets = Vec::with_capacity(ids.len());
    for &id in ids {
        offsets.push(chars.min(limit));
        chars += detok.push(id, &decode)?.chars().count();
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(ids: &[u32]) -> Result<String, TextError> {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    #[test]
    fn offsets_count_characters_and_hold_back_partial_ones() {
        // "aé b": 'é' is two byte tokens; the first completes nothing yet.
        let ids: Vec<u32> = "aé b".bytes().map(u32::from).collect();
        let p = EchoedPrompt::new("aé b".into(), ids, decode).unwrap();
        assert_eq!(p.offsets, vec![0, 1, 1, 2, 3]);
        assert_eq!(p.chars(), 4);
    }

    #[test]
    fn choices_map_to_their_prompt() {
        let p = |t: &str| EchoedPrompt::new(t.into(), vec![t.as_bytes()[0].into()], decode);
        let echo = Echo::new(vec![p("x").unwrap(), p("y").unwrap()], 2, false);
        let texts: Vec<&str> = (0..4)
            .map(|i| echo.prompt(i).unwrap().text.as_str())
            .collect();
        assert_eq!(texts, vec!["x", "x", "y", "y"]);
        assert!(echo.prompt(4).is_none());
    }
}
