//! llama.cpp's two limits for code completion in an editor, which end an answer at a line:
//! `n_indent` (the answer stops before a later line that starts left of that column — the
//! block being completed has ended) and `t_max_predict_ms` (past that time, the answer
//! stops at its next newline, so a slow completion still ends on a whole line). llama.vscode
//! and llama.vim send both with every `/infill`. Either ends the answer as a length limit
//! does (llama.cpp's `stop_type: "limit"`).

use std::time::{Duration, Instant};

/// The limits a request asked for (zero / `None`: off).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LineLimits {
    /// A line after the first whose first character that is not a space or tab (a newline
    /// included: a blank line) stands left of this column ends the answer before it.
    pub min_indent: usize,
    /// After this long since the first token, a token that writes a newline ends the answer.
    pub max_time: Option<Duration>,
}

impl LineLimits {
    pub fn is_off(&self) -> bool {
        self.min_indent == 0 && self.max_time.is_none()
    }
}

/// Checks one answer's text against its limits as it grows.
#[derive(Debug, Default)]
pub struct LineLimiter {
    limits: LineLimits,
    /// Start of the line being checked (after a newline), if one is open.
    line_start: Option<usize>,
    /// Where to look for the next newline when no line is open.
    scan_from: usize,
    started: Option<Instant>,
}

impl LineLimiter {
    pub fn new(limits: LineLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// After a token appended `piece` to `text`: the byte position the answer ends at, if a
    /// limit ends it now.
    pub fn check(&mut self, text: &str, piece: &str) -> Option<usize> {
        if self.limits.is_off() {
            return None;
        }
        let started = *self.started.get_or_insert_with(Instant::now);
        if let Some(cut) = self.indent_cut(text) {
            return Some(cut);
        }
        let late = self
            .limits
            .max_time
            .is_some_and(|limit| started.elapsed() > limit);
        (late && piece.contains('\n')).then_some(text.len())
    }

    fn indent_cut(&mut self, text: &str) -> Option<usize> {
        let min = self.limits.min_indent;
        if min == 0 {
            return None;
        }
        loop {
            match self.line_start {
                None => {
                    let newline = text.get(self.scan_from..)?.find('\n')?;
                    self.line_start = Some(self.scan_from + newline + 1);
                }
                Some(start) => {
                    let line = text.get(start..)?;
                    let blank = line.len() - line.trim_start_matches([' ', '\t']).len();
                    if blank == line.len() {
                        return None; // only blanks so far: the next token tells
                    }
                    if blank < min {
                        return Some(start + blank);
                    }
                    self.scan_from = start + blank;
                    self.line_start = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` in turn; the text kept when a limit ends it.
    fn feed(limits: LineLimits, pieces: &[&str]) -> Option<String> {
        let mut limiter = LineLimiter::new(limits);
        let mut text = String::new();
        for piece in pieces {
            text.push_str(piece);
            if let Some(cut) = limiter.check(&text, piece) {
                text.truncate(cut);
                return Some(text);
            }
        }
        None
    }

    fn indent(n: usize) -> LineLimits {
        LineLimits {
            min_indent: n,
            max_time: None,
        }
    }

    #[test]
    fn a_line_left_of_the_indent_ends_the_answer_before_its_text() {
        let pieces = ["x = 1", "\n    y = 2\n", "  ", "  z", "\n", "  ", "w"];
        // The first line is never checked; "    y" and "    z" pass; "  w" ends it, its
        // blanks kept (llama.cpp cuts at the first character that is not a blank).
        assert_eq!(
            feed(indent(4), &pieces).as_deref(),
            Some("x = 1\n    y = 2\n    z\n  ")
        );
        assert_eq!(feed(indent(2), &pieces), None);
        assert_eq!(feed(LineLimits::default(), &pieces), None);
    }

    #[test]
    fn a_blank_line_or_one_token_with_several_lines_is_checked_too() {
        assert_eq!(
            feed(indent(4), &["    a\n\n    b"]).as_deref(),
            Some("    a\n")
        );
        assert_eq!(
            feed(indent(1), &["a\n b\n c\nd"]).as_deref(),
            Some("a\n b\n c\n")
        );
        assert_eq!(feed(indent(1), &["a\n\tb"]), None);
    }

    #[test]
    fn past_the_time_limit_the_next_newline_ends_the_answer() {
        let limits = LineLimits {
            min_indent: 0,
            max_time: Some(Duration::ZERO),
        };
        let mut limiter = LineLimiter::new(limits);
        assert_eq!(limiter.check("ab", "ab"), None);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(limiter.check("abc", "c"), None);
        assert_eq!(limiter.check("abc\nd", "\nd"), Some(5));
        let generous = LineLimits {
            min_indent: 0,
            max_time: Some(Duration::from_secs(3600)),
        };
        assert_eq!(feed(generous, &["a", "\n", "b\n"]), None);
    }
}
