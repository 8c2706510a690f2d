//! Which tokens the large model wrote: per token text (count, routed count, routed share),
//! per class (digits, identifiers, keywords, punctuation/operators, whitespace, first
//! token of a line), and inside vs outside code blocks (code vs the reasoning around it).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::client::TokenSource;

const PY_KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

/// Token classes; `first_of_line` overlaps the others.
pub const CLASSES: &[&str] = &[
    "digits",
    "keyword",
    "identifier",
    "punctuation/operator",
    "whitespace",
    "other",
    "first_of_line",
];

pub fn class_of(text: &str) -> &'static str {
    let t = text.trim();
    if t.is_empty() {
        "whitespace"
    } else if t.chars().all(|c| c.is_ascii_digit()) {
        "digits"
    } else if PY_KEYWORDS.contains(&t) {
        "keyword"
    } else if t.chars().all(|c| c.is_alphanumeric() || c == '_')
        && t.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
    {
        "identifier"
    } else if t.chars().all(|c| c.is_ascii_punctuation()) {
        "punctuation/operator"
    } else {
        "other"
    }
}

/// Counts of one group of tokens.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Count {
    pub total: u64,
    pub routed: u64,
}

impl Count {
    fn add(&mut self, routed: bool) {
        self.total += 1;
        self.routed += u64::from(routed);
    }

    pub fn share(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.routed as f64 / self.total as f64
        }
    }
}

/// The analysis of one variant's answers.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TokenStats {
    pub by_text: BTreeMap<String, Count>,
    pub by_class: BTreeMap<String, Count>,
    pub in_code: Count,
    pub outside_code: Count,
}

impl TokenStats {
    /// Add one answer; `large` names the model(s) whose tokens count as routed. `all_code`:
    /// the answer is code throughout (filled in the middle of a program, no fences).
    pub fn add_answer(
        &mut self,
        tokens: &[TokenSource],
        is_large: &dyn Fn(&str) -> bool,
        all_code: bool,
    ) {
        let mut text_so_far = String::new();
        let mut line_start = true;
        for t in tokens {
            let routed = is_large(&t.source);
            self.by_text.entry(t.text.clone()).or_default().add(routed);
            self.by_class
                .entry(class_of(&t.text).to_string())
                .or_default()
                .add(routed);
            let blank = t.text.trim().is_empty();
            if line_start && !blank {
                self.by_class
                    .entry("first_of_line".to_string())
                    .or_default()
                    .add(routed);
            }
            // Inside a fenced block when an odd number of fences precede this token.
            let in_code = all_code || text_so_far.matches("```").count() % 2 == 1;
            if in_code {
                self.in_code.add(routed);
            } else {
                self.outside_code.add(routed);
            }
            text_so_far.push_str(&t.text);
            if let Some((_, after)) = t.text.rsplit_once('\n') {
                line_start = after.trim().is_empty();
            } else if !blank {
                line_start = false;
            }
        }
    }

    /// The most often routed token texts, most routed first.
    pub fn top_routed(&self, n: usize) -> Vec<(&str, &Count)> {
        let mut v: Vec<(&str, &Count)> = self
            .by_text
            .iter()
            .filter(|(_, c)| c.routed > 0)
            .map(|(t, c)| (t.as_str(), c))
            .collect();
        v.sort_by(|a, b| b.1.routed.cmp(&a.1.routed).then(a.0.cmp(b.0)));
        v.truncate(n);
        v
    }
}

/// A CSV field (RFC 4180 quoting; newlines shown as `\n` so a row stays a line).
pub fn csv_field(s: &str) -> String {
    let s = s
        .replace('\n', "\\n")
        .replace('\r', "\\r")
        .replace('\t', "\\t");
    if s.contains([',', '"']) || s.starts_with(' ') || s.ends_with(' ') {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(parts: &[(&str, &str)]) -> Vec<TokenSource> {
        parts
            .iter()
            .map(|(t, s)| TokenSource {
                text: t.to_string(),
                source: s.to_string(),
            })
            .collect()
    }

    #[test]
    fn classes() {
        assert_eq!(class_of(" 42"), "digits");
        assert_eq!(class_of(" return"), "keyword");
        assert_eq!(class_of("_count"), "identifier");
        assert_eq!(class_of(" =="), "punctuation/operator");
        assert_eq!(class_of("\n    "), "whitespace");
        assert_eq!(class_of("é!"), "other");
    }

    #[test]
    fn counts_code_vs_text_and_line_starts() {
        let mut s = TokenStats::default();
        let answer = toks(&[
            ("Sure", "large"),
            (":\n", "small"),
            ("```", "small"),
            ("python\n", "small"),
            ("def", "large"),
            (" f", "small"),
            ("():\n", "small"),
            ("    ", "small"),
            ("return", "large"),
            (" 1", "small"),
        ]);
        s.add_answer(&answer, &|m| m == "large", false);
        assert_eq!(
            s.by_class["keyword"],
            Count {
                total: 2,
                routed: 2
            }
        );
        assert_eq!(
            s.by_class["digits"],
            Count {
                total: 1,
                routed: 0
            }
        );
        // "Sure", "```", "def", "return" start lines.
        assert_eq!(
            s.by_class["first_of_line"],
            Count {
                total: 4,
                routed: 3
            }
        );
        // Outside: "Sure", ":\n", "```"; inside: the rest.
        assert_eq!(
            s.outside_code,
            Count {
                total: 3,
                routed: 1
            }
        );
        assert_eq!(
            s.in_code,
            Count {
                total: 7,
                routed: 2
            }
        );
        let top = s.top_routed(2);
        assert_eq!(top[0].0, "Sure");
        assert_eq!(top.len(), 2);
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("x\n"), "x\\n");
        // A line filled in the middle is code throughout.
        let mut infill = TokenStats::default();
        infill.add_answer(
            &toks(&[("    ", "large"), ("return", "small")]),
            &|m| m == "large",
            true,
        );
        assert_eq!(
            infill.in_code,
            Count {
                total: 2,
                routed: 1
            }
        );
        assert_eq!(infill.outside_code, Count::default());
    }
}
