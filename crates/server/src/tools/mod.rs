//! Tool calling in the Hermes format that Qwen2.5 / Qwen3 (and Hermes, and many others)
//! are trained on: the template lists the request's `tools`, and the model answers a call
//! as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. This module checks
//! the request side (`tools`, `tool_choice`, assistant `tool_calls` fed back to the
//! template) and turns generated text into OpenAI's `tool_calls`, whole or while
//! streaming, as vLLM's `--tool-call-parser hermes` and SGLang's `qwen25` do.

use std::sync::Arc;

use serde_json::{Map, Value};
use tokenrouter_api::OutputConstraint;

use crate::error::ApiError;

mod reader;
pub use reader::{Shown, ToolCall, ToolCallReader};

/// The Hermes format's tags around a call.
const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// How the server reads tool calls out of generated text (`--tool-call-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCallParser {
    /// `<tool_call>{json}</tool_call>` blocks become `tool_calls`.
    #[default]
    Hermes,
    /// Llama 3.1+ (vLLM's `llama3_json`): the answer is the calls' JSON, `{"name": ...,
    /// "parameters": {...}}`, several separated by `;` (Hermes blocks are read too).
    Llama3Json,
    /// Generated text is returned as it is, tool calls included.
    None,
}

impl std::str::FromStr for ToolCallParser {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" | "qwen25" => Ok(Self::Hermes),
            "llama3_json" | "llama3" => Ok(Self::Llama3Json),
            "none" => Ok(Self::None),
            other => Err(format!(
                "unknown tool call parser `{other}` (expected hermes, llama3_json or none)"
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
            Some(_) if parser == ToolCallParser::None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a forced tool call needs the server's tool call parser \
                     (`--tool-call-parser hermes` or `llama3_json`)",
                ))
            }
            Some(choices) => Some(call_grammar(&choices, parser)),
        };
        Ok(Self {
            tools: Some(tools),
            parse_calls: parser != ToolCallParser::None,
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

/// A Lark grammar (llguidance's dialect) for one call of one of `tools` in the parser's
/// format — Hermes: `<tool_call>` + `{"name": "...", "arguments": {...}}` + `</tool_call>`,
/// as Qwen's template shows calls; Llama 3: `{"name": "...", "parameters": {...}}` alone —
/// its arguments valid under the tool's `parameters` (any object if it has none).
fn call_grammar(tools: &[&Value], parser: ToolCallParser) -> OutputConstraint {
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
        let (open, close) = match parser {
            ToolCallParser::Llama3Json => {
                (format!("{{\"name\": {name}, \"parameters\": "), "}".into())
            }
            _ => (
                format!("{START}\n{{\"name\": {name}, \"arguments\": "),
                format!("}}\n{END}"),
            ),
        };
        rules.push(format!(
            "{call}: {} %json {schema} {}",
            literal(&open),
            literal(&close),
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn llama3_forced_calls_are_bare_json_with_parameters() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        let forced = ToolUse::new(
            Some(vec![tool]),
            Some(&json!("required")),
            "llama3_json".parse().unwrap(),
        )
        .unwrap();
        assert!(forced.parse_calls);
        let Some(OutputConstraint::Lark(grammar)) = forced.constraint else {
            panic!("no grammar");
        };
        assert_eq!(
            grammar,
            r#"start: call0
call0: "{\"name\": \"f\", \"parameters\": " %json {} "}""#
        );
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
