//! Turns one choice's engine tokens into releasable text deltas: incremental
//! detokenization, stop strings (which may span tokens written by different models), and
//! the attribution of tokens to the delta that carries their text, so streamed chunks can
//! say which model wrote each piece (`token_sources`) and carry the matching logprobs.

use tokenrouter_api::{TextError, TokenEvent};

use crate::detok::IncrementalDecoder;
use crate::stop::StopStrings;

/// One generated token as reported to the client: the engine's event, passed through as it
/// came, and where its text starts.
#[derive(Debug, Clone, PartialEq)]
pub struct OutToken {
    pub event: TokenEvent,
    /// Offset in characters of this token's text within the choice's output.
    pub text_offset: usize,
}

/// Text released to the client together with the tokens that produced it. `text` is empty
/// only in a final delta (e.g. the tokens of a stop string, which are not shown).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub text: String,
    pub tokens: Vec<OutToken>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tokens.is_empty()
    }
}

/// Result of adding a token.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Keep generating; `Some` when text could be released.
    Continue(Option<Delta>),
    /// A stop string matched: the output ends before it, the engine request must be dropped.
    Stopped(Delta),
}

/// Per-choice state.
#[derive(Debug, Default)]
pub struct ChoiceDecoder {
    detok: IncrementalDecoder,
    stops: StopStrings,
    /// Visible text so far.
    text: String,
    /// Characters in `text`.
    chars: usize,
    /// Bytes of `text` already released.
    released: usize,
    /// Tokens not yet released, with the byte end of their text in `text`.
    pending: Vec<(OutToken, usize)>,
}

impl ChoiceDecoder {
    pub fn new(stops: StopStrings) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// Adds one engine token; `decode` detokenizes (skipping special tokens).
    pub fn push<F>(&mut self, token: TokenEvent, decode: F) -> Result<Step, TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        let piece = self.detok.push(token.id, decode)?;
        let out = OutToken {
            event: token,
            text_offset: self.chars,
        };
        self.append(&piece);
        self.pending.push((out, self.text.len()));
        if let Some(delta) = self.cut_at_stop() {
            return Ok(Step::Stopped(delta));
        }
        let safe = self
            .text
            .len()
            .saturating_sub(self.stops.holdback(&self.text))
            .max(self.released);
        let last = self
            .pending
            .iter()
            .rposition(|&(_, end)| end <= safe && end > self.released);
        Ok(Step::Continue(last.map(|k| {
            let end = self.pending[k].1;
            let tokens = self.pending.drain(..=k).map(|(t, _)| t).collect();
            let text = self.text[self.released..end].to_string();
            self.released = end;
            Delta { text, tokens }
        })))
    }

    /// The engine finished: releases everything still held. Returns the final delta and
    /// whether a stop string matched in the flushed text.
    pub fn finish<F>(&mut self, decode: F) -> Result<(Delta, bool), TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        let tail = self.detok.flush(decode)?;
        self.append(&tail);
        if let Some(delta) = self.cut_at_stop() {
            return Ok((delta, true));
        }
        let text = self.text[self.released..].to_string();
        self.released = self.text.len();
        let tokens = self.pending.drain(..).map(|(t, _)| t).collect();
        Ok((Delta { text, tokens }, false))
    }

    fn append(&mut self, piece: &str) {
        self.text.push_str(piece);
        self.chars += piece.chars().count();
    }

    /// When a stop string is in the unreleased text, truncates before it and releases all
    /// remaining text and tokens.
    fn cut_at_stop(&mut self) -> Option<Delta> {
        let pos = self.stops.find(&self.text, self.released)?;
        let text = self.text[self.released..pos].to_string();
        self.text.truncate(pos);
        self.released = pos;
        let tokens = self.pending.drain(..).map(|(t, _)| t).collect();
        Some(Delta { text, tokens })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(ids: &[u32]) -> Result<String, TextError> {
        let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn tok(id: u8, source: usize) -> TokenEvent {
        TokenEvent {
            id: id.into(),
            source,
            logprob: -0.5,
            top_logprobs: vec![],
            router_score: None,
            rank: None,
        }
    }

    /// Feeds `text` byte by byte, alternating sources, and collects the steps.
    fn run(stops: &[&str], text: &str) -> (Vec<Delta>, Option<Delta>) {
        let mut dec = ChoiceDecoder::new(StopStrings::new(
            stops.iter().map(|s| s.to_string()).collect(),
        ));
        let mut deltas = Vec::new();
        for (i, b) in text.bytes().enumerate() {
            match dec.push(tok(b, i % 2), decode).unwrap() {
                Step::Continue(Some(d)) => deltas.push(d),
                Step::Continue(None) => {}
                Step::Stopped(d) => return (deltas, Some(d)),
            }
        }
        let (last, stopped) = dec.finish(decode).unwrap();
        assert!(!stopped);
        deltas.push(last);
        (deltas, None)
    }

    #[test]
    fn stop_string_spanning_tokens_of_both_sources_truncates_output() {
        let (deltas, stop) = run(&["END"], "abcEND tail");
        let stop = stop.expect("stop string must match");
        let shown: String = deltas
            .iter()
            .map(|d| d.text.as_str())
            .chain([stop.text.as_str()])
            .collect();
        assert_eq!(shown, "abc");
        // "E" (source 1), "N" (source 0), "D" (source 1) were held back, then attributed to the
        // final delta; all 6 tokens are accounted for exactly once.
        let tokens: usize = deltas.iter().chain([&stop]).map(|d| d.tokens.len()).sum();
        assert_eq!(tokens, 6);
        assert_eq!(
            stop.tokens
                .iter()
                .map(|t| t.event.source)
                .collect::<Vec<_>>(),
            vec![1, 0, 1]
        );
        assert!(stop.text.is_empty());
    }

    #[test]
    fn a_partial_stop_prefix_is_released_once_it_diverges() {
        let (deltas, stop) = run(&["ENDX"], "aEND!");
        assert!(stop.is_none());
        let texts: Vec<&str> = deltas.iter().map(|d| d.text.as_str()).collect();
        assert_eq!(texts, vec!["a", "END!", ""]);
        assert_eq!(deltas[1].tokens.len(), 4);
    }

    #[test]
    fn multibyte_text_is_never_split_and_offsets_count_chars() {
        let (deltas, _) = run(&[], "é日x");
        let texts: Vec<&str> = deltas
            .iter()
            .map(|d| d.text.as_str())
            .filter(|t| !t.is_empty())
            .collect();
        assert_eq!(texts, vec!["é", "日", "x"]);
        // "日" is released with its three byte tokens.
        assert_eq!(deltas[1].tokens.len(), 3);
        assert_eq!(deltas[2].tokens[0].text_offset, 2);
    }

    #[test]
    fn stop_found_in_first_token_gives_empty_text() {
        let (deltas, stop) = run(&["a"], "abc");
        assert!(deltas.is_empty());
        let stop = stop.unwrap();
        assert_eq!(stop.text, "");
        assert_eq!(stop.tokens.len(), 1);
    }
}
