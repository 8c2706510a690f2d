//! Tool calling in the Hermes format that Qwen2.5 / Qwen3 (and Hermes, and many others)
//! are trained on: the template lists the request's `tools`, and the model answers a call
//! as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. This module checks
//! the request side (`tools`, `tool_choice`, assistant `tool_calls` fed back to the
//! template) and turns generated text into OpenAI's `tool_calls`, whole or while
//! streaming, as vLLM's `--tool-call-parser hermes` and SGLang's `qwen25` do.

use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};
use tokenrouter_api::OutputConstraint;

use crate::error::ApiError;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// How the server reads tool calls out of generated text (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCallParser {
    /// `<tool_call>{json}</tool_call>` blocks become `tool_calls`.
    #[default]
    Hermes,
    /// Generated text is returned as it is, tool calls included.
    None,
}

impl std::str::FromStr for ToolCallParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" | "qwen25" => Ok(Self::Hermes),
            "none" => Ok(Self::None),
            other => Err(format!(
                "unknown tool call parser `{other}` (expected hermes or none)"
            )),
        }
    }
}

/// What a chat request asks of tools, checked: the tools for the template (`None` when
/// there are none or `tool_choice` is `"none"`), whether to parse calls, and for
/// `"required"` or a named function the constraint that makes the answer such a call.
#[derive(Debug, Default)]
pub struct ToolUse {
    pub tools: Option<Vec<Value>>,
    pub parse_calls: bool,
    pub constraint: Option<OutputConstraint>,
}

impl ToolUse {
    /// The tools' names when calls are read (see [`ToolCallReader::new`]).
    pub fn names(&self) -> Option<Arc<[String]>> {
        let tools = self.tools.as_ref().filter(|_| self.parse_calls)?;
        Some(
            tools
                .iter()
                .filter_map(tool_name)
                .map(String::from)
                .collect(),
        )
    }
}

impl ToolUse {
    /// Checks `tools` (each `{"type": "function", "function": {"name": ...}}`) and
    /// `tool_choice`. `"required"` (a call of some tool) and a named function (a call of
    /// that one) constrain the answer to one Hermes call, its arguments valid under the
    /// tool's `parameters` schema.
    pub fn new(
        tools: Option<Vec<Value>>,
        tool_choice: Option<&Value>,
        parser: ToolCallParser,
    ) -> Result<Self, ApiError> {
        let tools = tools.unwrap_or_default();
        for (i, tool) in tools.iter().enumerate() {
            check_tool(i, tool)?;
        }
        let forced: Option<Vec<&Value>> =
            match tool_choice {
                None => None,
                Some(Value::String(s)) if s == "auto" => None,
                Some(Value::String(s)) if s == "none" => return Ok(Self::default()),
                Some(Value::String(s)) if s == "required" => Some(tools.iter().collect()),
                Some(Value::Object(choice)) => Some(vec![named_tool(choice, &tools)?]),
                Some(_) => return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be \"auto\", \"none\", \"required\" or a named function",
                )),
            };
        let constraint = match forced {
            None if tools.is_empty() => return Ok(Self::default()),
            None => None,
            Some(choices) if choices.is_empty() => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` asks for a tool call, but `tools` is empty",
                ))
            }
            Some(_) if parser != ToolCallParser::Hermes => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a forced tool call needs the server's tool call parser \
                     (`--tool-call-parser hermes`)",
                ))
            }
            Some(choices) => Some(call_grammar(&choices)),
        };
        Ok(Self {
            tools: Some(tools),
            parse_calls: parser == ToolCallParser::Hermes,
            constraint,
        })
    }
}

/// The tool a named `tool_choice` (`{"type": "function", "function": {"name"}}`) picks.
fn named_tool<'a>(choice: &Map<String, Value>, tools: &'a [Value]) -> Result<&'a Value, ApiError> {
    let name = choice
        .get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::invalid(
                "tool_choice",
                "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
            )
        })?;
    tools
        .iter()
        .find(|t| tool_name(t) == Some(name))
        .ok_or_else(|| {
            ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` names `{}`, which is not among `tools`",
                    crate::error::truncate_for_echo(name)
                ),
            )
        })
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

/// A Lark grammar (llguidance's dialect) for one Hermes call of one of `tools`, written as
/// the template shows calls (`{"name": "...", "arguments": {...}}`), its arguments valid
/// under the tool's `parameters` (any object if it has none).
fn call_grammar(tools: &[&Value]) -> OutputConstraint {
    // Lark string literals take JSON's quoting.
    let literal = |s: &str| Value::from(s).to_string();
    let calls: Vec<String> = (0..tools.len()).map(|i| format!("call{i}")).collect();
    let mut rules = vec![format!("start: {}", calls.join(" | "))];
    for (call, tool) in calls.iter().zip(tools) {
        let name = Value::from(tool_name(tool).unwrap_or_default()).to_string();
        let schema = tool["function"]
            .get("parameters")
            .filter(|p| p.is_object())
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        rules.push(format!(
            "{call}: {} %json {schema} {}",
            literal(&format!("{START}\n{{\"name\": {name}, \"arguments\": ")),
            literal(&format!("}}\n{END}")),
        ));
    }
    OutputConstraint::Lark(rules.join("\n"))
}

fn check_tool(i: usize, tool: &Value) -> Result<(), ApiError> {
    let bad = |why: &str| ApiError::invalid(format!("tools[{i}]"), why.to_string());
    let tool = tool
        .as_object()
        .ok_or_else(|| bad("a tool must be an object"))?;
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("only tools of `\"type\": \"function\"` are supported"));
    }
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("a tool needs a `function` object"))?;
    match function.get("name") {
        Some(Value::String(name)) if !name.is_empty() => Ok(()),
        _ => Err(ApiError::invalid(
            format!("tools[{i}].function.name"),
            "a function needs a non-empty string `name`",
        )),
    }
}

/// An assistant message's `tool_calls` (`messages[index]`) as templates expect them: each
/// call's `function.arguments`, a JSON string in the API, parsed into its object (what
/// vLLM and Hugging Face templates do).
pub fn template_tool_calls(index: usize, calls: &[Value]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("messages[{index}].tool_calls[{j}]");
            let mut call = call.clone();
            let function = call
                .get_mut("function")
                .and_then(Value::as_object_mut)
                .ok_or_else(|| ApiError::invalid(&at, "a tool call needs a `function` object"))?;
            if !matches!(function.get("name"), Some(Value::String(_))) {
                return Err(ApiError::invalid(
                    format!("{at}.function.name"),
                    "a tool call needs a string `name`",
                ));
            }
            if let Some(Value::String(arguments)) = function.get("arguments") {
                let parsed: Value = serde_json::from_str(arguments).map_err(|e| {
                    ApiError::invalid(
                        format!("{at}.function.arguments"),
                        format!("`arguments` must be JSON: {e}"),
                    )
                })?;
                function.insert("arguments".into(), parsed);
            }
            Ok(call)
        })
        .collect()
}

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

/// What a piece of generated text shows: content, and calls completed by it.
#[derive(Debug, Default, PartialEq)]
pub struct Shown {
    pub content: String,
    pub calls: Vec<ToolCall>,
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
}

impl ToolCallReader {
    /// A reader for a request offering the tools `names`.
    pub fn new(names: Arc<[String]>) -> Self {
        Self {
            names,
            ..Self::default()
        }
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
        if !last && (start.is_empty() || start.starts_with('{')) {
            return Shown::default();
        }
        self.decided = true;
        let held = std::mem::take(&mut self.held);
        if last && held.trim_start().starts_with('{') {
            if let Some(function) = parse_call(&held).filter(|f| self.names.contains(&f.name)) {
                let call = self.call(function);
                return Shown {
                    content: String::new(),
                    calls: vec![call],
                };
            }
        }
        self.read(&held, last)
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
}

impl ToolCallReader {
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
    let value: Map<String, Value> = serde_json::from_str(body.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => serde_json::to_string(v).ok()?,
    };
    Some(FunctionCall { name, arguments })
}

/// A whole choice's text read at once (for a request offering the tools `names`): its
/// content (`None` when calls leave only whitespace) and its calls (without stream indices).
pub fn read_whole(text: &str, names: Arc<[String]>) -> (Option<String>, Vec<ToolCall>) {
    let shown = ToolCallReader::new(names).push(text, true);
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

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn requests_are_checked() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        let parser = ToolCallParser::Hermes;
        let use_ = ToolUse::new(Some(vec![tool.clone()]), None, parser).unwrap();
        assert!(use_.parse_calls && use_.tools.is_some() && use_.constraint.is_none());
        let none = ToolUse::new(Some(vec![tool.clone()]), Some(&json!("none")), parser).unwrap();
        assert!(!none.parse_calls && none.tools.is_none());
        let off = ToolUse::new(Some(vec![tool.clone()]), None, ToolCallParser::None).unwrap();
        assert!(!off.parse_calls && off.tools.is_some());
        assert!(!ToolUse::new(None, None, parser).unwrap().parse_calls);
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "f"}}),
        ] {
            let forced = ToolUse::new(Some(vec![tool.clone()]), Some(&choice), parser).unwrap();
            assert!(forced.parse_calls && forced.tools.is_some());
            let Some(OutputConstraint::Lark(grammar)) = forced.constraint else {
                panic!("{choice}: no grammar");
            };
            let want = r#"start: call0
call0: "<tool_call>\n{\"name\": \"f\", \"arguments\": " %json {} "}\n</tool_call>""#;
            assert_eq!(grammar, want);
        }
        for (choice, tools) in [
            (
                json!({"type": "function", "function": {"name": "g"}}),
                vec![tool.clone()],
            ),
            (json!({"type": "function"}), vec![tool.clone()]),
            (json!("required"), vec![]),
            (json!(3), vec![tool.clone()]),
        ] {
            let err = ToolUse::new(Some(tools), Some(&choice), parser).unwrap_err();
            assert_eq!(err.param().as_deref(), Some("tool_choice"), "{choice}");
        }
        let required = Some(&json!("required"));
        let err = ToolUse::new(Some(vec![tool.clone()]), required, ToolCallParser::None);
        assert_eq!(err.unwrap_err().param().as_deref(), Some("tool_choice"));
        for (bad, param) in [
            (json!("f"), "tools[1]"),
            (json!({"type": "code_interpreter"}), "tools[1]"),
            (json!({"type": "function"}), "tools[1]"),
            (
                json!({"type": "function", "function": {"name": ""}}),
                "tools[1].function.name",
            ),
        ] {
            let err = ToolUse::new(Some(vec![tool.clone(), bad]), None, parser).unwrap_err();
            assert_eq!(err.param().as_deref(), Some(param));
        }
    }

    #[test]
    fn assistant_calls_reach_the_template_with_object_arguments() {
        let calls = [json!({"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}})];
        let out = template_tool_calls(2, &calls).unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!({"x": [1, 2]}));
        let bad = [json!({"function": {"name": "f", "arguments": "{x"}})];
        let err = template_tool_calls(2, &bad).unwrap_err();
        assert_eq!(
            err.param().as_deref(),
            Some("messages[2].tool_calls[0].function.arguments")
        );
        let err = template_tool_calls(0, &[json!({"type": "function"})]).unwrap_err();
        assert_eq!(err.param().as_deref(), Some("messages[0].tool_calls[0]"));
    }
}
