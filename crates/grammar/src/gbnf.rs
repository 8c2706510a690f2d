//! GBNF, the grammar format of llama.cpp (its `grammar` field and `--grammar-file`), which
//! vLLM's `guided_grammar` and SGLang's `ebnf` also take (xgrammar reads it), translated
//! into llguidance's Lark dialect so the one grammar engine serves every format.
//!
//! The parser follows llama.cpp's `llama-grammar.cpp` rule for rule: a rule is
//! `name ::= alternatives`; a sequence ends at a newline unless it is inside parentheses or
//! right after a `|`; `#` starts a comment; literals and character classes take `\x`, `\u`,
//! `\U`, `\t`, `\r`, `\n`, `\\`, `\"`, `\[` and `\]`; `.` is any character; `*`, `+`, `?`
//! and `{m}`, `{m,}`, `{m,n}` repeat; a later definition of a name replaces the earlier;
//! `root` is where the text starts. llama.cpp's token references (`<[id]>`, `<think>` for
//! the one token of that text, each negated with `!`) become llguidance's token ranges.
//!
//! One difference stays: llguidance lexes literals and classes greedily (as it does for
//! llama.cpp's own `%llguidance` grammars and vLLM's `guidance` backend), where llama.cpp
//! matches character by character; a literal that is a prefix of another literal allowed
//! at the same place can therefore miss a text llama.cpp would accept.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

/// A grammar that is not valid GBNF: where and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("GBNF grammar, line {line}, column {column}: {message}")]
pub struct GbnfError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// The Lark text of a GBNF grammar (its `root` rule becomes Lark's `start`); `token_id`
/// finds the id of a token named by its text (`<think>`), which must be one token;
/// `end_ids` end generation, so a grammar may not ask for them (it ends where `root` does).
pub fn gbnf_to_lark(
    text: &str,
    token_id: &dyn Fn(&str) -> Option<u32>,
    end_ids: &[u32],
) -> Result<String, GbnfError> {
    let mut parser = Parser::new(text, token_id);
    parser.end_ids = end_ids;
    let rules = parser.grammar()?;
    Ok(emit(&rules))
}

/// The position after the spaces, tabs and comments at `at` (and newlines, if `newlines`).
fn skip_space(chars: &[char], mut at: usize, newlines: bool) -> usize {
    while let Some(&c) = chars.get(at) {
        match c {
            ' ' | '\t' => at += 1,
            '\r' | '\n' if newlines => at += 1,
            '#' => {
                while chars.get(at).is_some_and(|&c| c != '\r' && c != '\n') {
                    at += 1;
                }
            }
            _ => break,
        }
    }
    at
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Literal(String),
    /// `[...]`: inclusive ranges of code points, maybe negated.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// `.`
    AnyChar,
    Rule(String),
    /// A token by id, maybe negated: `<[id]>` / `<[^id]>` in Lark.
    Token {
        id: String,
        negated: bool,
    },
    Group(Vec<Vec<Node>>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

/// Rules in definition order (a redefinition keeps the first place, takes the new body).
struct Rules {
    order: Vec<String>,
    bodies: HashMap<String, Vec<Vec<Node>>>,
}

struct Parser<'t> {
    token_id: &'t dyn Fn(&str) -> Option<u32>,
    end_ids: &'t [u32],
    chars: Vec<char>,
    pos: usize,
    /// Every rule name used, and where (checked once all rules are read).
    references: Vec<(String, usize)>,
    /// Groups open around the parser (bounded: the parser recurses into them).
    depth: usize,
}

/// The deepest nesting of groups a grammar may have (the parser's recursion stays small).
const MAX_DEPTH: usize = 256;

impl<'t> Parser<'t> {
    fn new(text: &str, token_id: &'t dyn Fn(&str) -> Option<u32>) -> Parser<'t> {
        Parser {
            token_id,
            end_ids: &[],
            chars: text.chars().collect(),
            pos: 0,
            references: Vec::new(),
            depth: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.pos + ahead).copied()
    }

    fn error(&self, message: impl Into<String>) -> GbnfError {
        self.error_at(self.pos, message)
    }

    fn error_at(&self, pos: usize, message: impl Into<String>) -> GbnfError {
        let before = &self.chars[..pos.min(self.chars.len())];
        let line = before.iter().filter(|&&c| c == '\n').count() + 1;
        let column = before.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        GbnfError {
            line,
            column,
            message: message.into(),
        }
    }

    /// Spaces, tabs and comments; newlines too where a rule may go on.
    fn skip_space(&mut self, newlines: bool) {
        self.pos = skip_space(&self.chars, self.pos, newlines);
    }

    fn grammar(&mut self) -> Result<Rules, GbnfError> {
        let mut rules = Rules {
            order: Vec::new(),
            bodies: HashMap::new(),
        };
        self.skip_space(true);
        while self.peek().is_some() {
            let name = self.name()?;
            self.skip_space(false);
            if !(self.peek() == Some(':')
                && self.peek_at(1) == Some(':')
                && self.peek_at(2) == Some('='))
            {
                return Err(self.error(format!("expected `::=` after the rule name `{name}`")));
            }
            self.pos += 3;
            self.skip_space(true);
            let body = self.alternatives(false)?;
            match self.peek() {
                None => {}
                Some('\r' | '\n') => {}
                Some(c) => {
                    return Err(self.error(format!("expected a newline or the end, found `{c}`")))
                }
            }
            self.skip_space(true);
            if rules.bodies.insert(name.clone(), body).is_none() {
                rules.order.push(name);
            }
        }
        if !rules.bodies.contains_key("root") {
            return Err(self.error("the grammar has no `root` rule"));
        }
        if let Some((name, pos)) = self
            .references
            .iter()
            .find(|(name, _)| !rules.bodies.contains_key(name))
        {
            return Err(self.error_at(*pos, format!("the rule `{name}` is used but never defined")));
        }
        Ok(rules)
    }

    /// Whether what follows the blank lines and comments from here is the end or `name ::=`.
    fn next_line_starts_a_rule(&self) -> bool {
        let mut at = skip_space(&self.chars, self.pos, true);
        if at == self.chars.len() {
            return true;
        }
        let name_start = at;
        while self.chars.get(at).copied().is_some_and(is_word_char) {
            at += 1;
        }
        at = skip_space(&self.chars, at, false);
        at > name_start && self.chars[at..].starts_with(&[':', ':', '='])
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word_char) {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.error("expected a rule name"));
        }
        Ok(self.chars[start..self.pos].iter().collect())
    }

    fn alternatives(&mut self, nested: bool) -> Result<Vec<Vec<Node>>, GbnfError> {
        let mut alternatives = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.skip_space(true);
            alternatives.push(self.sequence(nested)?);
        }
        Ok(alternatives)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Node>, GbnfError> {
        let mut nodes: Vec<Node> = Vec::new();
        while let Some(c) = self.peek() {
            if matches!(c, '\r' | '\n') {
                // llama.cpp ends the rule here; xgrammar (vLLM's, SGLang's) reads on while
                // the next line starts no rule. Reading on accepts both.
                if nested || self.next_line_starts_a_rule() {
                    break;
                }
                self.skip_space(true);
                continue;
            }
            match c {
                '"' => {
                    self.pos += 1;
                    let mut literal = String::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.error("a literal is not closed with `\"`")),
                            Some('"') => break,
                            Some(_) => literal.push(self.char()?),
                        }
                    }
                    self.pos += 1;
                    nodes.push(Node::Literal(literal));
                }
                '[' => nodes.push(self.class()?),
                '.' => {
                    self.pos += 1;
                    nodes.push(Node::AnyChar);
                }
                '(' => {
                    if self.depth >= MAX_DEPTH {
                        return Err(self.error(format!("groups nested deeper than {MAX_DEPTH}")));
                    }
                    self.pos += 1;
                    self.skip_space(true);
                    self.depth += 1;
                    let group = self.alternatives(true);
                    self.depth -= 1;
                    let group = group?;
                    if self.peek() != Some(')') {
                        return Err(self.error("expected `)`"));
                    }
                    self.pos += 1;
                    nodes.push(Node::Group(group));
                }
                '<' | '!' => nodes.push(self.token_reference()?),
                '*' | '+' | '?' | '{' => {
                    let Some(last) = nodes.pop() else {
                        return Err(self.error(format!("`{c}` repeats nothing")));
                    };
                    let (min, max) = self.repetition()?;
                    nodes.push(Node::Repeat {
                        node: Box::new(last),
                        min,
                        max,
                    });
                }
                c if is_word_char(c) => {
                    let at = self.pos;
                    let name = self.name()?;
                    self.references.push((name.clone(), at));
                    nodes.push(Node::Rule(name));
                }
                _ => break,
            }
            self.skip_space(nested);
        }
        Ok(nodes)
    }

    /// One (maybe escaped) character of a literal or class.
    fn char(&mut self) -> Result<char, GbnfError> {
        let Some(c) = self.peek() else {
            return Err(self.error("unexpected end of the grammar"));
        };
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(escape) = self.peek() else {
            return Err(self.error("unexpected end of the grammar after `\\`"));
        };
        self.pos += 1;
        let digits = match escape {
            'x' => 2,
            'u' => 4,
            'U' => 8,
            't' => return Ok('\t'),
            'r' => return Ok('\r'),
            'n' => return Ok('\n'),
            '\\' | '"' | '[' | ']' => return Ok(escape),
            other => return Err(self.error(format!("unknown escape `\\{other}`"))),
        };
        let hex: String = self.chars[self.pos..]
            .iter()
            .take(digits)
            .take_while(|c| c.is_ascii_hexdigit())
            .collect();
        if hex.len() != digits {
            return Err(self.error(format!("`\\{escape}` needs {digits} hex digits")));
        }
        self.pos += digits;
        u32::from_str_radix(&hex, 16)
            .ok()
            .and_then(char::from_u32)
            .ok_or_else(|| self.error(format!("`\\{escape}{hex}` is not a character")))
    }

    fn class(&mut self) -> Result<Node, GbnfError> {
        self.pos += 1; // '['
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return Err(self.error("a character class is not closed with `]`")),
                Some(']') => break,
                Some(_) => {}
            }
            let low = self.char()?;
            let high = if self.peek() == Some('-') && self.peek_at(1).is_some_and(|c| c != ']') {
                self.pos += 1;
                self.char()?
            } else {
                low
            };
            if high < low {
                return Err(self.error(format!("the range `{low}-{high}` is empty")));
            }
            ranges.push((low, high));
        }
        self.pos += 1; // ']'
        Ok(Node::Class { negated, ranges })
    }

    /// llama.cpp's `<[id]>`, `<token text>` and their `!` negations.
    fn token_reference(&mut self) -> Result<Node, GbnfError> {
        let negated = self.peek() == Some('!');
        if negated {
            self.pos += 1;
        }
        if self.peek() != Some('<') {
            return Err(self.error("expected `<` (a token reference) after `!`"));
        }
        let start = self.pos;
        while self.peek().is_some_and(|c| c != '>' && !c.is_whitespace()) {
            self.pos += 1;
        }
        if self.peek() != Some('>') {
            return Err(self.error("a token reference is not closed with `>`"));
        }
        self.pos += 1;
        let inner: String = self.chars[start + 1..self.pos - 1].iter().collect();
        let id = match inner.strip_prefix('[').and_then(|i| i.strip_suffix(']')) {
            Some(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => id.to_string(),
            Some(_) => return Err(self.error_at(start, format!("`<{inner}>` is not a token id"))),
            None => match (self.token_id)(&format!("<{inner}>")) {
                Some(id) => id.to_string(),
                None => {
                    return Err(self.error_at(
                        start,
                        format!("`<{inner}>` is not a token of this model's vocabulary"),
                    ))
                }
            },
        };
        if !negated && id.parse().is_ok_and(|id: u32| self.end_ids.contains(&id)) {
            return Err(self.error_at(
                start,
                format!(
                    "`<{inner}>` ends generation: a grammar ends where `root` is complete, \
                     so leave it out"
                ),
            ));
        }
        Ok(Node::Token { id, negated })
    }

    fn repetition(&mut self) -> Result<(u32, Option<u32>), GbnfError> {
        let c = self.peek();
        self.pos += 1;
        match c {
            Some('*') => return Ok((0, None)),
            Some('+') => return Ok((1, None)),
            Some('?') => return Ok((0, Some(1))),
            _ => {}
        }
        self.skip_space(true);
        let min = self.number()?;
        self.skip_space(true);
        let max = if self.peek() == Some(',') {
            self.pos += 1;
            self.skip_space(true);
            if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                Some(self.number()?)
            } else {
                None
            }
        } else {
            Some(min)
        };
        self.skip_space(true);
        if self.peek() != Some('}') {
            return Err(self.error("expected `}` to close the repetition"));
        }
        self.pos += 1;
        if max.is_some_and(|max| max < min) {
            return Err(self.error("a repetition's maximum is below its minimum"));
        }
        Ok((min, max))
    }

    fn number(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        let digits: String = self.chars[start..self.pos].iter().collect();
        digits
            .parse()
            .map_err(|_| self.error("expected a repetition count"))
    }
}

/// Lark names for GBNF's: a name Lark takes as a rule name (`[a-z][a-z0-9_-]*`) is kept,
/// others are lowered and prefixed; `start` is Lark's entry, so a GBNF rule of that name moves.
fn lark_names(order: &[String]) -> (HashMap<&str, String>, HashSet<String>) {
    let mut taken: HashSet<String> = HashSet::from(["start".to_string()]);
    let mut names = HashMap::new();
    for name in order {
        let lark_like = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        let base = if lark_like {
            name.clone()
        } else {
            let lowered: String = name
                .chars()
                .map(|c| match c {
                    'A'..='Z' => c.to_ascii_lowercase(),
                    'a'..='z' | '0'..='9' | '-' => c,
                    _ => '_',
                })
                .collect();
            format!("r_{lowered}")
        };
        let name_for = fresh(&mut taken, &base);
        names.insert(name.as_str(), name_for);
    }
    (names, taken)
}

/// `base`, or `base_1`, `base_2`, … whichever is not taken yet (and takes it).
fn fresh(taken: &mut HashSet<String>, base: &str) -> String {
    let mut candidate = base.to_string();
    let mut n = 1;
    while taken.contains(&candidate) {
        candidate = format!("{base}_{n}");
        n += 1;
    }
    taken.insert(candidate.clone());
    candidate
}

fn emit(rules: &Rules) -> String {
    let (names, taken) = lark_names(&rules.order);
    let mut emitter = Emitter {
        names,
        taken,
        hoisted: Vec::new(),
    };
    let mut out = format!("start: {}\n", emitter.names["root"]);
    for name in &rules.order {
        let body = emitter.alternatives(&rules.bodies[name], 0);
        let _ = writeln!(out, "{}: {body}", emitter.names[name.as_str()]);
    }
    for rule in &emitter.hoisted {
        let _ = writeln!(out, "{rule}");
    }
    out
}

/// Groups nested this deep in a rule become rules of their own: llguidance's Lark parser
/// refuses nesting past 30, GBNF has no limit.
const HOIST_DEPTH: usize = 16;

struct Emitter<'a> {
    names: HashMap<&'a str, String>,
    taken: HashSet<String>,
    /// Rules made of groups nested too deep.
    hoisted: Vec<String>,
}

impl Emitter<'_> {
    fn alternatives(&mut self, alternatives: &[Vec<Node>], depth: usize) -> String {
        let texts: Vec<String> = alternatives
            .iter()
            .map(|sequence| {
                if sequence.is_empty() {
                    "\"\"".to_string()
                } else {
                    let parts: Vec<String> = sequence.iter().map(|n| self.node(n, depth)).collect();
                    parts.join(" ")
                }
            })
            .collect();
        texts.join(" | ")
    }

    /// `(alternatives)` one level below `depth`, or a new rule's name at [`HOIST_DEPTH`].
    fn group(&mut self, alternatives: &[Vec<Node>], depth: usize) -> String {
        if depth + 1 < HOIST_DEPTH {
            return format!("({})", self.alternatives(alternatives, depth + 1));
        }
        let body = self.alternatives(alternatives, 0);
        let name = fresh(&mut self.taken, "group");
        self.hoisted.push(format!("{name}: {body}"));
        name
    }

    fn node(&mut self, node: &Node, depth: usize) -> String {
        match node {
            Node::Literal(text) => literal(text),
            Node::Class { negated, ranges } => {
                let mut class = String::from(if *negated { "/[^" } else { "/[" });
                for &(low, high) in ranges {
                    class_char(&mut class, low);
                    if high != low {
                        class.push('-');
                        class_char(&mut class, high);
                    }
                }
                class.push_str("]/");
                class
            }
            Node::AnyChar => "/(?s:.)/".to_string(),
            Node::Rule(name) => self.names[name.as_str()].clone(),
            Node::Token { id, negated } => {
                format!("<[{}{id}]>", if *negated { "^" } else { "" })
            }
            Node::Group(group) => self.group(group, depth),
            Node::Repeat {
                node: inner,
                min,
                max,
            } => {
                let inner_text = match &**inner {
                    Node::Repeat { .. } => self.group(&[vec![(**inner).clone()]], depth),
                    _ => self.node(inner, depth),
                };
                match (min, max) {
                    // llguidance refuses a range ending at 0: nothing, repeated never, is "".
                    (_, Some(0)) => "\"\"".to_string(),
                    (0, None) => format!("{inner_text}*"),
                    (1, None) => format!("{inner_text}+"),
                    (0, Some(1)) => format!("{inner_text}?"),
                    (min, None) => format!("{inner_text}{{{min},}}"),
                    (min, Some(max)) => format!("{inner_text}{{{min},{max}}}"),
                }
            }
        }
    }
}

/// A Lark string literal (JSON's quoting; llguidance takes control characters only escaped).
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A class member in the regex: letters and digits as they are, all else by code point (so
/// no character can close the class, the regex literal or start a class operation).
fn class_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:X}}}", c as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of two named tokens.
    fn vocab(text: &str) -> Option<u32> {
        match text {
            "<|im_end|>" => Some(7),
            "<think>" => Some(9),
            _ => None,
        }
    }

    #[test]
    fn translates_each_construct() {
        let lark = gbnf_to_lark(
            "root ::= greeting ws name # a comment\n\
             greeting ::= \"hi\" | \"hello\\n\"\n\
             ws ::= [ \\t]*\n\
             name ::= [A-Z] [a-z]{1,8} (\"-\" [a-z]+)? .\n",
            &vocab,
            &[7],
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: root\n\
             root: greeting ws name\n\
             greeting: \"hi\" | \"hello\\u000a\"\n\
             ws: /[\\x{20}\\x{9}]/*\n\
             name: /[A-Z]/ /[a-z]/{1,8} (\"-\" /[a-z]/+)? /(?s:.)/\n"
        );
    }

    #[test]
    fn sequences_go_on_inside_groups_and_after_a_bar() {
        let lark = gbnf_to_lark(
            "root ::= (\n  \"a\"\n  \"b\"\n) |\n  \"c\"\nother ::= \"d\"",
            &vocab,
            &[7],
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: root\nroot: (\"a\" \"b\") | \"c\"\nother: \"d\"\n"
        );
        // xgrammar's reading: a rule goes on while the next line starts none.
        let lark = gbnf_to_lark(
            "root ::= \"a\"\n  | \"b\" # b\n\n  \"c\"\nx ::= \"d\"\n",
            &vocab,
            &[7],
        )
        .unwrap();
        assert_eq!(lark, "start: root\nroot: \"a\" | \"b\" \"c\"\nx: \"d\"\n");
    }

    #[test]
    fn names_lark_cannot_take_are_renamed_and_kept_apart() {
        let lark =
            gbnf_to_lark("root ::= Value start value-x 9ab\nValue ::= \"v\"\nstart ::= \"s\"\nvalue-x ::= \"x\"\n9ab ::= \"9\"", &vocab, &[7]).unwrap();
        assert_eq!(
            lark,
            "start: root\nroot: r_value start_1 value-x r_9ab\nr_value: \"v\"\nstart_1: \"s\"\nvalue-x: \"x\"\nr_9ab: \"9\"\n"
        );
    }

    #[test]
    fn escapes_negations_tokens_and_repeats() {
        let lark = gbnf_to_lark(
            "root ::= [^\"\\\\] \"\\x41\\u00e9\\\"\" <[151645]> !<[13]> !<|im_end|> !<think> (\"a\"{2}){0,3} \"b\"{0} \"c\"{2,}",
            &vocab,
            &[7],
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: root\nroot: /[^\\x{22}\\x{5C}]/ \"Aé\\\"\" <[151645]> <[^13]> <[^7]> <[^9]> (\"a\"{2,2}){0,3} \"\" \"c\"{2,}\n"
        );
    }

    #[test]
    fn deep_groups_become_rules_and_too_deep_ones_are_refused() {
        let nested = |depth: usize| {
            format!(
                "root ::= {}\"a\"{}",
                "(\"x\" ".repeat(depth),
                ")".repeat(depth)
            )
        };
        let lark = gbnf_to_lark(&nested(40), &vocab, &[7]).unwrap();
        // No line nests more than HOIST_DEPTH groups.
        for line in lark.lines() {
            let mut open = 0usize;
            let mut deepest = 0;
            for c in line.chars() {
                match c {
                    '(' => open += 1,
                    ')' => open -= 1,
                    _ => {}
                }
                deepest = deepest.max(open);
            }
            assert!(deepest < HOIST_DEPTH, "{line}");
        }
        assert!(
            lark.contains("\ngroup: ") && lark.contains("\ngroup_1: "),
            "{lark}"
        );
        let e = gbnf_to_lark(&nested(MAX_DEPTH + 1), &vocab, &[7]).unwrap_err();
        assert!(e.message.contains("nested deeper"), "{e}");
    }

    /// Whatever a client sends, the translation answers (a grammar or an error): random
    /// texts over GBNF's own characters, after a `root ::=`.
    #[test]
    fn random_grammars_never_panic() {
        const PIECES: [&str; 28] = [
            "\"", "a", "[", "]", "(", ")", "|", "*", "+", "?", "{", "}", ",", "1", "-", "^", "\\",
            "x", ".", "#", "<", ">", "!", "\n", " ", "::=", "root", "é",
        ];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut translated = 0;
        for _ in 0..20_000 {
            let mut text = String::from("root ::= ");
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            for _ in 0..(state % 24) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                text.push_str(PIECES[(state % PIECES.len() as u64) as usize]);
            }
            translated += usize::from(gbnf_to_lark(&text, &vocab, &[7]).is_ok());
        }
        assert!(translated > 100, "only {translated} were valid");
    }

    #[test]
    fn a_later_definition_replaces_the_earlier() {
        let lark = gbnf_to_lark("root ::= x\nx ::= \"1\"\nx ::= \"2\"", &vocab, &[7]).unwrap();
        assert_eq!(lark, "start: root\nroot: x\nx: \"2\"\n");
    }

    #[test]
    fn errors_say_where_and_why() {
        let cases = [
            ("root ::= \"a", 1, "not closed"),
            ("root ::= [a-", 1, "not closed"),
            ("root ::= \"a\"\n  | x", 2, "`x` is used but never defined"),
            ("root ::= \"a\"\n\"b\" ::= \"c\"", 2, "expected a newline"),
            ("thing ::= \"a\"", 1, "no `root` rule"),
            ("root = \"a\"", 1, "expected `::=`"),
            ("root ::= \"a\"\nx ::= * \"b\"", 2, "`*` repeats nothing"),
            ("root ::= \"\\q\"", 1, "unknown escape"),
            ("root ::= \"a\"{3,2}", 1, "below its minimum"),
            (
                "root ::= \"a\" <im_end>",
                1,
                "not a token of this model's vocabulary",
            ),
            ("root ::= <[12x]>", 1, "not a token id"),
            ("root ::= \"a\" <|im_end|>", 1, "ends generation"),
            ("root ::= \"a\" <[7]>", 1, "ends generation"),
            ("root ::= ! \"a\"", 1, "expected `<`"),
            ("root ::= \"a\" )", 1, "expected a newline"),
        ];
        for (grammar, line, why) in cases {
            let e = gbnf_to_lark(grammar, &vocab, &[7]).unwrap_err();
            assert_eq!(e.line, line, "{grammar}: {e}");
            assert!(e.message.contains(why), "{grammar}: {e}");
        }
    }
}
