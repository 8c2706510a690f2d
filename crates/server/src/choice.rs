//! Turns one choice's engine tokens into releasable text deltas: incremental
//! detokenization, stop strings (which may span tokens written by different models), and
//! the attribution of tokens to the delta that carries their text, so streamed chunks can
//! say which model wrote each piece (`token_sources`) and carry the matching logprobs.

use tokenrouter_api::{TextError, TokenEvent};

use crate::detok::IncrementalDecoder;
use crate::line_limits::{LineLimiter, LineLimits};
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

/// What stopped a choice: a stop string (as given) or a stop id (EOS or `stop_token_ids`):
/// vLLM's `stop_reason`, SGLang's `matched`.
#[derive(Debug, Clone, PartialEq)]
pub enum StopMatch {
    Text(String),
    Token(u32),
}

/// Result of adding a token.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Keep generating; `Some` when text could be released.
    Continue(Option<Delta>),
    /// A stop string matched: the output ends before it, the engine request must be dropped.
    Stopped(Delta),
    /// A line limit ended the output (llama.cpp's `n_indent`, `t_max_predict_ms`): it ends
    /// as a length limit does; the engine request must be dropped.
    Limited(Delta),
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
    /// Ids that end the request (see `GenerateStream::stop_ids`).
    stop_ids: Vec<u32>,
    /// A stop string (or stop id)'s text stays in the output.
    include_stops: bool,
    /// Stop strings stop only once this many tokens are written (vLLM's `min_tokens`).
    min_tokens: usize,
    /// Tokens pushed so far.
    pushed: usize,
    /// A stop string must end after this byte of `text` (text before `min_tokens`).
    stop_floor: usize,
    /// What stopped the choice, once something did.
    stopped_by: Option<StopMatch>,
    /// llama.cpp's line limits (off unless asked for).
    limiter: LineLimiter,
}

impl ChoiceDecoder {
    pub fn new(stops: StopStrings) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// The ids that end the request: such a (last) token's text is left out of the output
    /// unless [`ChoiceDecoder::including_stops`] (vLLM's way; an EOS is usually special,
    /// so its text is empty anyway while special tokens are skipped).
    pub fn with_stop_ids(mut self, stop_ids: Vec<u32>) -> Self {
        self.stop_ids = stop_ids;
        self
    }

    /// Keep a matched stop string, or a stop id's text, in the output (vLLM's
    /// `include_stop_str_in_output`, SGLang's `no_stop_trim`).
    pub fn including_stops(mut self, include: bool) -> Self {
        self.include_stops = include;
        self
    }

    /// Stop strings written within the first `n` tokens do not stop (vLLM's `min_tokens`:
    /// the engine holds back the stop ids as long).
    pub fn with_min_tokens(mut self, n: usize) -> Self {
        self.min_tokens = n;
        self
    }

    /// End the output at a line as llama.cpp's `n_indent` and `t_max_predict_ms` do.
    pub fn with_line_limits(mut self, limits: LineLimits) -> Self {
        self.limiter = LineLimiter::new(limits);
        self
    }

    /// Adds one engine token; `decode` detokenizes (skipping special tokens).
    pub fn push<F>(&mut self, token: TokenEvent, decode: F) -> Result<Step, TextError>
    where
        F: Fn(&[u32]) -> Result<String, TextError>,
    {
        self.pushed += 1;
        // A stop id is the request's last token: its text, when left out, never enters
        // the detokenizer.
        let is_stop = self.stop_ids.contains(&token.id);
        if is_stop {
            self.stopped_by = Some(StopMatch::Token(token.id));
        }
        let piece = if is_stop && !self.include_stops {
            String::new()
        } else {
            self.detok.push(token.id, decode)?
        };
        let out = OutToken {
            event: token,
            text_offset: self.chars,
        };
        self.append(&piece);
        self.pending.push((out, self.text.len()));
        if self.pushed < self.min_tokens {
            self.stop_floor = self.text.len();
        } else if let Some(delta) = self.cut_at_stop() {
            return Ok(Step::Stopped(delta));
        }
        if let Some(end) = self.limiter.check(&self.text, &piece) {
            return Ok(Step::Limited(self.release_until(end)));
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
        if self.pushed >= self.min_tokens {
            if let Some(delta) = self.cut_at_stop() {
                return Ok((delta, true));
            }
        }
        let text = self.text[self.released..].to_string();
        self.released = self.text.len();
        let tokens = self.pending.drain(..).map(|(t, _)| t).collect();
        Ok((Delta { text, tokens }, false))
    }

    /// What stopped the choice (a stop string or a stop id), if it stopped.
    pub fn stopped_by(&self) -> Option<&StopMatch> {
        self.stopped_by.as_ref()
    }

    fn append(&mut self, piece: &str) {
        self.text.push_str(piece);
        self.chars += piece.chars().count();
    }

    /// When a stop string is in the unreleased text, truncates before it (after it, when
    /// stops are included) and releases all remaining text and tokens.
    fn cut_at_stop(&mut self) -> Option<Delta> {
        let found = self
            .stops
            .first_match(&self.text, self.released, self.stop_floor)?;
        self.stopped_by = Some(StopMatch::Text(self.text[found.clone()].to_string()));
        let pos = if self.include_stops {
            found.end
        } else {
            found.start
        };
        Some(self.release_until(pos))
    }

    /// Ends the text at byte `end` (never before what was released) and releases it with
    /// every pending token.
    fn release_until(&mut self, end: usize) -> Delta {
        let end = end.max(self.released);
        let text = self.text[self.released..end].to_string();
        self.text.truncate(end);
        self.released = end;
        let tokens = self.pending.drain(..).map(|(t, _)| t).collect();
        Delta { text, tokens }
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
                Step::Stopped(d) | Step::Limited(d) => return (deltas, Some(d)),
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

    /// Feeds `text` byte by byte to `dec`: the whole text shown, whether a stop string
    /// ended it, and how many tokens were attributed.
    fn shown(mut dec: ChoiceDecoder, text: &[u8]) -> (String, bool, usize) {
        let (mut out, mut tokens) = (String::new(), 0);
        for &b in text {
            match dec.push(tok(b, 0), decode).unwrap() {
                Step::Continue(Some(d)) => {
                    out.push_str(&d.text);
                    tokens += d.tokens.len();
                }
                Step::Continue(None) => {}
                Step::Stopped(d) | Step::Limited(d) => {
                    return (out + &d.text, true, tokens + d.tokens.len())
                }
            }
        }
        let (last, stopped) = dec.finish(decode).unwrap();
        (out + &last.text, stopped, tokens + last.tokens.len())
    }

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(list.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn stop_strings_within_min_tokens_do_not_stop() {
        let dec = || ChoiceDecoder::new(stops(&["ab"]));
        assert_eq!(shown(dec(), b"xabyabz"), ("x".into(), true, 3));
        // The first "ab" ends at the third token: before min_tokens 4 it does not stop.
        assert_eq!(
            shown(dec().with_min_tokens(4), b"xabyabz"),
            ("xaby".into(), true, 6)
        );
        // One that starts before the min_tokens-th token and ends with it stops.
        assert_eq!(
            shown(dec().with_min_tokens(3), b"xabyabz"),
            ("x".into(), true, 3)
        );
        assert_eq!(
            shown(dec().with_min_tokens(2), b"xabyabz"),
            ("x".into(), true, 3)
        );
        assert_eq!(
            shown(dec().with_min_tokens(9), b"xabyabz"),
            ("xabyabz".into(), false, 7)
        );
    }

    #[test]
    fn included_stops_stay_in_the_text() {
        let dec = ChoiceDecoder::new(stops(&["ab"])).including_stops(true);
        assert_eq!(shown(dec, b"xabyab"), ("xab".into(), true, 3));
    }

    #[test]
    fn what_stopped_is_reported() {
        let mut dec = ChoiceDecoder::new(stops(&["b", "zz"])).with_stop_ids(vec![9]);
        for b in *b"ab" {
            dec.push(tok(b, 0), decode).unwrap();
        }
        assert_eq!(dec.stopped_by(), Some(&StopMatch::Text("b".into())));
        let mut dec = ChoiceDecoder::new(stops(&["zz"])).with_stop_ids(vec![9]);
        assert_eq!(dec.stopped_by(), None);
        dec.push(tok(9, 0), decode).unwrap();
        assert_eq!(dec.stopped_by(), Some(&StopMatch::Token(9)));
    }

    /// A stop id's text is left out unless stops are included; its token is still counted.
    #[test]
    fn a_stop_ids_text_is_left_out_unless_included() {
        let dec = || ChoiceDecoder::new(StopStrings::default()).with_stop_ids(vec![b'!'.into()]);
        assert_eq!(shown(dec(), b"hey!"), ("hey".into(), false, 4));
        assert_eq!(
            shown(dec().including_stops(true), b"hey!"),
            ("hey!".into(), false, 4)
        );
    }

    #[test]
    fn a_line_limit_ends_the_text_with_every_token_attributed() {
        let limits = LineLimits {
            min_indent: 2,
            max_time: None,
        };
        // A held-back stop prefix ("X") does not delay the cut; all 8 tokens are reported.
        let dec = ChoiceDecoder::new(StopStrings::new(vec!["XYZ".into()])).with_line_limits(limits);
        assert_eq!(
            shown(dec, b"a\n  bX\ncd"),
            ("a\n  bX\n".to_string(), true, 8)
        );
        let dec = ChoiceDecoder::new(StopStrings::default()).with_line_limits(limits);
        assert_eq!(shown(dec, b"a\n  b"), ("a\n  b".to_string(), false, 5));
    }
}
