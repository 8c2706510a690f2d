//! Generated text to OpenAI's `tool_calls`: the Hermes blocks (and bare calls) of one
//! choice read whole, or piece by piece while it streams.

use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};

use super::{END, START};

/// One parsed call, as OpenAI sends it (`index` only in streamed deltas).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON string, as OpenAI sends them.
    pub arguments: String,
}

/// What a piece of generated text shows: content, calls completed by it, and thinking
/// (set by the reasoning reader that runs before this one).
#[derive(Debug, Default, PartialEq)]
pub struct Shown {
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub reasoning: String,
}

/// Reads one choice's text as it arrives. Text before the first `<tool_call>` is content
/// at once (a possible start of the tag held back); a block becomes a call when its
/// `</tool_call>` arrives (or at the end, if its JSON is whole); text between and after
/// blocks is content only if it is more than whitespace. A block that is not a call's
/// JSON is shown as the text it was.
///
/// An answer that is nothing but a call's JSON without the tags (`{"name": "get_weather",
/// "arguments": {...}}`, naming one of the request's tools) is a call too: Qwen2.5-Coder
/// answers so more often than not. An answer that starts with `{` is therefore held until
/// its end to tell.
#[derive(Debug, Default)]
pub struct ToolCallReader {
    /// The request's tool names (a bare call must name one).
    names: Arc<[String]>,
    /// Leading text held while the answer may still be a bare call.
    held: String,
    /// Whether the answer has shown it is not a bare call.
    decided: bool,
    /// Text not yet classified.
    pending: String,
    /// Inside a block (its start tag consumed).
    in_block: bool,
    /// A block has started: text outside blocks is held from now on.
    opened: bool,
    /// Text outside blocks after the first, held until more than whitespace is known.
    between: String,
    /// Calls made so far (their stream indices).
    calls: usize,
    /// At most one call is returned (`parallel_tool_calls: false`); later ones are dropped.
    single: bool,
}

impl ToolCallReader {
    /// A reader for a request offering the tools `names`.
    pub fn new(names: Arc<[String]>) -> Self {
        Self {
            names,
            ..Self::default()
        }
    }

    /// Return the first call alone (OpenAI's `parallel_tool_calls: false`): later calls are
    /// dropped, their markup not shown either.
    pub fn one_call_at_most(mut self, single: bool) -> Self {
        self.single = single;
        self
    }

    /// Whether any call was read (then a `stop` finish is reported as `tool_calls`).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The next piece of text; `last` at the choice's end.
    pub fn push(&mut self, text: &str, last: bool) -> Shown {
        if self.decided || self.names.is_empty() {
            return self.read(text, last);
        }
        self.held.push_str(text);
        let start = self.held.trim_start();
        let maybe_bare = start.starts_with('{')
            || start.starts_with(PYTHON_TAG)
            || PYTHON_TAG.starts_with(start);
        if !last && maybe_bare {
            return Shown::default();
        }
        self.decided = true;
        let held = std::mem::take(&mut self.held);
        if last {
            let offered = |f: &FunctionCall| self.names.contains(&f.name);
            if let Some(functions) = bare_calls(&held).filter(|fs| fs.iter().all(offered)) {
                let most = if self.single { 1 } else { functions.len() };
                let calls = functions
                    .into_iter()
                    .take(most)
                    .map(|f| self.call(f))
                    .collect();
                return Shown {
                    calls,
                    ..Shown::default()
                };
            }
        }
        self.read(&held, last)
    }

    /// A whole choice's text read at once: its content (`None` when calls leave only
    /// whitespace) and its calls (without stream indices).
    pub fn whole(mut self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let shown = self.push(text, true);
        let calls: Vec<ToolCall> = shown
            .calls
            .into_iter()
            .map(|c| ToolCall { index: None, ..c })
            .collect();
        let content = match calls.is_empty() || !shown.content.trim().is_empty() {
            true => Some(shown.content),
            false => None,
        };
        (content, calls)
    }

    /// `push` once the answer is known not to be a bare call.
    fn read(&mut self, text: &str, last: bool) -> Shown {
        let mut shown = Shown::default();
        self.pending.push_str(text);
        loop {
            if self.in_block {
                let Some(end) = self.pending.find(END) else {
                    break;
                };
                let body: String = self.pending.drain(..end + END.len()).collect();
                self.in_block = false;
                self.block(&body[..end], true, &mut shown);
            } else if let Some(start) = self.pending.find(START) {
                let before: String = self.pending.drain(..start + START.len()).collect();
                self.outside(&before[..start], &mut shown);
                self.flush_between(&mut shown);
                self.in_block = true;
                self.opened = true;
            } else {
                let keep = if last { 0 } else { partial_tag(&self.pending) };
                let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
                self.outside(&ready, &mut shown);
                break;
            }
        }
        if last {
            if self.in_block {
                let body = std::mem::take(&mut self.pending);
                self.in_block = false;
                self.block(&body, false, &mut shown);
            }
            self.flush_between(&mut shown);
        }
        shown
    }

    fn outside(&mut self, text: &str, shown: &mut Shown) {
        match self.opened {
            false => shown.content.push_str(text),
            true => self.between.push_str(text),
        }
    }

    /// Held text between blocks: shown unless it is whitespace.
    fn flush_between(&mut self, shown: &mut Shown) {
        let between = std::mem::take(&mut self.between);
        if !between.trim().is_empty() {
            shown.content.push_str(&between);
        }
    }

    /// A block's body (`closed` by its end tag, or cut by the choice's end): a call, or
    /// (not a call's JSON) the text it was.
    fn block(&mut self, body: &str, closed: bool, shown: &mut Shown) {
        match parse_call(body) {
            Some(_) if self.single && self.calls > 0 => {}
            Some(function) => {
                let call = self.call(function);
                shown.calls.push(call);
            }
            None => {
                self.flush_between(shown);
                shown.content.push_str(START);
                shown.content.push_str(body);
                if closed {
                    shown.content.push_str(END);
                }
            }
        }
    }

    /// The choice's next call.
    fn call(&mut self, function: FunctionCall) -> ToolCall {
        self.calls += 1;
        ToolCall {
            index: Some(self.calls - 1),
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            kind: "function",
            function,
        }
    }
}

/// The length of the longest end of `text` that could start `<tool_call>`.
fn partial_tag(text: &str) -> usize {
    (1..START.len())
        .rev()
        .find(|&n| text.ends_with(&START[..n]))
        .unwrap_or(0)
}

/// `{"name": "...", "arguments": {...}}` (or `"parameters"`, which some models write).
fn parse_call(body: &str) -> Option<FunctionCall> {
    call_of(serde_json::from_str(body.trim()).ok()?)
}

/// Llama 3's start of a tool call (a special token, so usually already left out of the
/// text).
const PYTHON_TAG: &str = "<|python_tag|>";

/// An answer that is nothing but calls' JSON objects (after an optional `<|python_tag|>`),
/// separated by `;` as Llama 3 writes several; `None` if it is anything else.
fn bare_calls(text: &str) -> Option<Vec<FunctionCall>> {
    let text = text.trim_start();
    let mut rest = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim_start();
    let mut calls = Vec::new();
    loop {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Map<String, Value>>();
        calls.push(call_of(values.next()?.ok()?)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = match rest.strip_prefix(';') {
            Some(after) => after.trim_start(),
            None if rest.is_empty() => return Some(calls),
            None => return None,
        };
        if rest.is_empty() {
            return Some(calls);
        }
    }
}

/// A call from its JSON object: `name`, and `arguments` (Hermes) or `parameters` (Llama 3).
fn call_of(value: Map<String, Value>) -> Option<FunctionCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => serde_json::to_string(v).ok()?,
    };
    Some(FunctionCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_whole(text: &str, names: Arc<[String]>) -> (Option<String>, Vec<ToolCall>) {
        ToolCallReader::new(names).whole(text)
    }
    use serde_json::json;

    const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";

    fn names() -> Arc<[String]> {
        ["get_weather", "f", "g"].map(String::from).into()
    }

    fn streamed(pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut reader = ToolCallReader::new(names());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for (i, piece) in pieces.iter().enumerate() {
            let shown = reader.push(piece, i + 1 == pieces.len());
            content.push_str(&shown.content);
            calls.extend(shown.calls);
        }
        (content, calls)
    }

    /// Every split of `text` into two pieces, and one character at a time.
    fn splits(text: &str) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = text
            .char_indices()
            .map(|(i, _)| vec![text[..i].to_string(), text[i..].to_string()])
            .collect();
        out.push(text.chars().map(String::from).collect());
        out
    }

    /// Llama 3's calls: bare JSON with `parameters`, several separated by `;`, an optional
    /// `<|python_tag|>` first; read the same whole and in any pieces. Anything else after
    /// them (or a tool not offered) leaves the text as it was.
    #[test]
    fn llama3_calls_are_read_whole_and_streamed() {
        let one = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#;
        let two = format!(r#"<|python_tag|>{one}; {{"name": "f", "parameters": {{}}}};"#);
        for (text, names_called) in [
            (one.to_string(), vec!["get_weather"]),
            (two, vec!["get_weather", "f"]),
        ] {
            for pieces in splits(&text) {
                let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
                let (content, calls) = streamed(&refs);
                assert_eq!(content, "", "{pieces:?}");
                let got: Vec<&str> = calls.iter().map(|c| c.function.name.as_str()).collect();
                assert_eq!(got, names_called, "{pieces:?}");
                assert_eq!(calls[0].index, Some(0));
            }
            let (content, calls) = read_whole(&text, names());
            assert_eq!((content, calls.len()), (None, names_called.len()));
            let args: Value = serde_json::from_str(&calls[0].function.arguments).unwrap();
            assert_eq!(args, json!({"city": "Paris"}));
        }
        for not_calls in [
            format!("{one} and then some text"),
            r#"{"name": "unknown_tool", "parameters": {}}"#.to_string(),
            format!("{one}; {{\"name\": \"nope\"}}"),
        ] {
            let (content, calls) = read_whole(&not_calls, names());
            assert!(calls.is_empty(), "{not_calls}");
            assert_eq!(content.as_deref(), Some(not_calls.as_str()));
        }
    }

    #[test]
    fn a_call_becomes_a_tool_call_with_its_arguments_as_a_json_string() {
        let (content, calls) = read_whole(CALL, names());
        assert_eq!(content, None);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].function.arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris", "days": 2}));
        assert!(calls[0].id.starts_with("call_") && calls[0].index.is_none());
    }

    #[test]
    fn text_without_calls_is_unchanged() {
        for text in [
            "",
            "plain",
            "a < b <tool",
            "x <tool_cal y",
            "</tool_call> z",
        ] {
            assert_eq!(read_whole(text, names()), (Some(text.to_string()), vec![]));
            let (content, calls) = streamed(&[text]);
            assert_eq!((content.as_str(), calls.len()), (text, 0));
        }
    }

    #[test]
    fn streaming_gives_what_reading_whole_gives_for_every_split() {
        let texts = [
            format!("Let me look that up.\n{CALL}"),
            format!("{CALL}\n{CALL}\n"),
            format!("{CALL} and then some words"),
            "<tool_call>\nnot json\n</tool_call> after".to_string(),
            "before <tool_call>{\"name\": \"f\", \"arguments\": {}}".to_string(),
            "before <tool_call>{\"name\": \"f\", \"argu".to_string(),
            "é<tool_call>{\"name\": \"g\", \"parameters\": {\"q\": \"日本\"}}</tool_call>"
                .to_string(),
        ];
        for text in &texts {
            let (whole_content, whole_calls) = read_whole(text, names());
            for pieces in splits(text) {
                let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
                let (content, calls) = streamed(&pieces);
                assert_eq!(
                    whole_content.clone().unwrap_or_default(),
                    content,
                    "{pieces:?}"
                );
                let names = |c: &[ToolCall]| -> Vec<(String, String)> {
                    c.iter()
                        .map(|c| (c.function.name.clone(), c.function.arguments.clone()))
                        .collect()
                };
                assert_eq!(names(&whole_calls), names(&calls), "{pieces:?}");
                let indices: Vec<_> = calls.iter().map(|c| c.index).collect();
                let expected: Vec<_> = (0..calls.len()).map(Some).collect();
                assert_eq!(indices, expected);
            }
        }
    }

    #[test]
    fn a_bare_call_naming_a_tool_is_a_call() {
        let (content, calls) = read_whole(
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            names(),
        );
        assert_eq!((content, calls.len()), (None, 1));
        assert_eq!(calls[0].function.arguments, r#"{"city":"Paris"}"#);
        // Not one of the tools, or more than the call: text.
        for text in [
            "{\"name\": \"rm_rf\", \"arguments\": {}}",
            "{\"name\": \"f\", \"arguments\": {}} trailing",
        ] {
            assert_eq!(read_whole(text, names()), (Some(text.to_string()), vec![]));
        }
        // Without tool names (the parser alone) nothing bare is read.
        let text = "{\"name\": \"f\", \"arguments\": {}}";
        assert_eq!(
            read_whole(text, Arc::from([])),
            (Some(text.to_string()), vec![])
        );
    }

    /// `parallel_tool_calls: false`: the first call alone, later ones (and their markup)
    /// dropped — Hermes blocks whole and streamed a character at a time, bare Llama 3 calls.
    #[test]
    fn one_call_at_most_keeps_the_first() {
        let single = || ToolCallReader::new(names()).one_call_at_most(true);
        let text = format!("Checking.\n{CALL}\n{CALL}\n");
        let (content, calls) = single().whole(&text);
        assert_eq!((content.as_deref(), calls.len()), (Some("Checking.\n"), 1));
        let mut reader = single();
        let mut streamed = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for (i, c) in chars.iter().enumerate() {
            streamed.extend(reader.push(&c.to_string(), i + 1 == chars.len()).calls);
        }
        assert_eq!(streamed.len(), 1);
        assert_eq!(streamed[0].index, Some(0));
        let bare = r#"{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {}}"#;
        assert_eq!(single().whole(bare).1.len(), 1);
        assert_eq!(read_whole(bare, names()).1.len(), 2);
    }

    #[test]
    fn content_around_calls() {
        let (content, calls) = read_whole(&format!("Checking.\n{CALL}\n{CALL}\n"), names());
        assert_eq!((content.as_deref(), calls.len()), (Some("Checking.\n"), 2));
        let (content, calls) = read_whole(&format!("{CALL} done"), names());
        assert_eq!((content.as_deref(), calls.len()), (Some(" done"), 1));
        // Not a call: the block is shown as it was written.
        let bad = "<tool_call>\n[1, 2]\n</tool_call>";
        assert_eq!(read_whole(bad, names()), (Some(bad.to_string()), vec![]));
        // Cut off inside the JSON (max_tokens): text, not a call.
        let cut = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\"";
        assert_eq!(read_whole(cut, names()), (Some(cut.to_string()), vec![]));
        // The end tag never came but the JSON is whole: a call.
        let (_, calls) = read_whole("<tool_call>{\"name\": \"f\"}", names());
        assert_eq!(calls[0].function.arguments, "{}");
    }
}
