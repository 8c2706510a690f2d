//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), which
//! Anthropic's SDKs and Claude Code speak (vLLM and llama.cpp serve it too): the request is
//! read as the chat request it amounts to — `system` a system message; user and assistant
//! messages of text blocks; an assistant's `tool_use` blocks its `tool_calls`, a user's
//! `tool_result` blocks `tool` messages; `tools` with their `input_schema`; `tool_choice`
//! (`auto`, `any`, `tool`, `none`); `stop_sequences`; the chat fields we take beyond
//! Anthropic's (`routing`, sampling extras) pass through — and answered as a message
//! (`message::Answer`): `content` blocks (`thinking` with `--reasoning-parser`, `text`,
//! `tool_use`), `stop_reason`, `usage`, whole or as Anthropic's stream of events. Errors
//! come in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.

pub mod message;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::error::{truncate_for_echo, ApiError};

/// Fields of a Messages request with no chat counterpart (or another meaning there).
const MESSAGES_ONLY: &[&str] = &[
    "system",
    "messages",
    "tools",
    "tool_choice",
    "stop_sequences",
    "metadata",
    "thinking",
    "service_tier",
    "container",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "response_format",
    "max_completion_tokens",
    "output_config",
];

/// An error in Anthropic's shape, with the status the server gives it.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let kind = match status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        };
        let body = error_body(kind, &self.0.to_string());
        let mut response = self.0.into_response();
        *response.body_mut() = Json(body).into_response().into_body();
        response
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The chat request a Messages request amounts to. `count_only`: no `max_tokens` is needed
/// (`count_tokens`).
pub fn chat_request(body: &Value, count_only: bool) -> Result<Value, ApiError> {
    let Value::Object(fields) = body else {
        return Err(ApiError::invalid(
            "messages",
            "the request body must be a JSON object",
        ));
    };
    let mut chat: Map<String, Value> = fields
        .iter()
        .filter(|(k, _)| !MESSAGES_ONLY.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match (fields.get("max_tokens"), count_only) {
        (None | Some(Value::Null), false) => {
            return Err(ApiError::MissingField("max_tokens".into()))
        }
        (_, true) => {
            chat.insert("max_tokens".into(), json!(1));
        }
        _ => {}
    }
    let mut messages = Vec::new();
    if let Some(system) = fields.get("system").filter(|v| !v.is_null()) {
        messages.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    let Some(Value::Array(turns)) = fields.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a list of messages",
        ));
    };
    for (i, turn) in turns.iter().enumerate() {
        push_turn(i, turn, &mut messages)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    match fields.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
            chat.insert("stop".into(), Value::Array(stops.clone()));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_sequences",
                "`stop_sequences` must be a list of strings",
            ))
        }
    }
    if let Some(tools) = fields.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = fields.get("tool_choice").filter(|v| !v.is_null()) {
        let (choice, parallel) = chat_tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if !parallel {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    // Structured output: `output_config.format` is a JSON schema the answer follows.
    match fields.get("output_config").and_then(|c| c.get("format")) {
        None | Some(Value::Null) => {}
        Some(format) if format.get("type").and_then(Value::as_str) == Some("json_schema") => {
            let schema = format.get("schema").cloned().unwrap_or_default();
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
            );
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "output_config.format",
                "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": …}",
            ))
        }
    }
    if let Some(thinking) = fields.get("thinking").filter(|v| !v.is_null()) {
        // Qwen3's templates read `enable_thinking`; others ignore it.
        let enabled = thinking.get("type").and_then(Value::as_str) == Some("enabled");
        let kwargs = chat
            .entry("chat_template_kwargs")
            .or_insert_with(|| json!({}));
        if let Value::Object(kwargs) = kwargs {
            kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(enabled));
        }
    }
    Ok(Value::Object(chat))
}

/// A string, or text blocks joined (`system`, a tool result's content).
fn text_of(value: &Value, field: &str) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, block)| match (block_type(block), block.get("text")) {
                ("text", Some(Value::String(text))) => Ok(text.clone()),
                (kind, _) => Err(unsupported_block(&format!("{field}[{j}]"), kind)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.join("\n")),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a string or a list of text blocks"),
        )),
    }
}

fn block_type(block: &Value) -> &str {
    block
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn unsupported_block(field: &str, kind: &str) -> ApiError {
    ApiError::invalid(
        field,
        format!(
            "content blocks of type {:?} are not supported here (text, tool_use, tool_result)",
            truncate_for_echo(kind)
        ),
    )
}

/// One message as chat messages: a user's `tool_result` blocks become `tool` messages
/// (before the user's text, as they answer the calls just made), an assistant's `tool_use`
/// blocks its `tool_calls`; earlier `thinking` is not shown to the template again.
fn push_turn(i: usize, turn: &Value, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let field = |name: &str| format!("messages[{i}].{name}");
    let role = match turn.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant")) => role,
        _ => {
            return Err(ApiError::invalid(
                field("role"),
                "a message's `role` must be \"user\" or \"assistant\"",
            ))
        }
    };
    let blocks = match turn.get("content") {
        Some(Value::String(text)) => {
            messages.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid(
                field("content"),
                "a message's `content` must be a string or a list of blocks",
            ))
        }
    };
    let (mut texts, mut calls) = (Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let at = |name: &str| format!("messages[{i}].content[{j}].{name}");
        let string = |name: &str| match block.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(ApiError::invalid(
                at(name),
                format!("`{}` must be a string", at(name)),
            )),
        };
        match (role, block_type(block)) {
            (_, "text") => texts.push(json!({"type": "text", "text": string("text")?})),
            ("assistant", "tool_use") => {
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"id": string("id")?, "type": "function",
                    "function": {"name": string("name")?, "arguments": input.to_string()}}));
            }
            ("user", "tool_result") => {
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(content) => text_of(content, &at("content"))?,
                };
                let content = match block.get("is_error") == Some(&Value::Bool(true)) {
                    true => format!("Error: {content}"),
                    false => content,
                };
                messages.push(
                    json!({"role": "tool", "tool_call_id": string("tool_use_id")?,
                    "content": content}),
                );
            }
            ("assistant", "thinking" | "redacted_thinking") => {}
            (_, kind) => {
                return Err(unsupported_block(
                    &format!("messages[{i}].content[{j}]"),
                    kind,
                ))
            }
        }
    }
    if !calls.is_empty() {
        let content = match texts.is_empty() {
            true => Value::Null,
            false => Value::Array(texts),
        };
        messages.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
    } else if !texts.is_empty() {
        messages.push(json!({"role": role, "content": texts}));
    }
    Ok(())
}

/// Anthropic's tools (`name`, `description`, `input_schema`) as chat's function tools;
/// Anthropic's own server tools (a `type` such as `web_search_20250305`) are refused.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(ApiError::invalid("tools", "`tools` must be a list"));
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| match tool.get("type").and_then(Value::as_str) {
            None | Some("custom") => {
                let mut function = Map::new();
                function.insert("name".into(), tool.get("name").cloned().unwrap_or_default());
                if let Some(d) = tool.get("description") {
                    function.insert("description".into(), d.clone());
                }
                let schema = tool.get("input_schema").cloned();
                function.insert("parameters".into(), schema.unwrap_or_else(|| json!({})));
                Ok(json!({"type": "function", "function": function}))
            }
            Some(other) => Err(ApiError::invalid(
                format!("tools[{i}].type"),
                format!(
                    "only custom tools (name, description, input_schema) are supported, got {:?}",
                    truncate_for_echo(other)
                ),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `tool_choice` as chat's, and whether several calls may come
/// (`disable_parallel_tool_use`).
fn chat_tool_choice(choice: &Value) -> Result<(Value, bool), ApiError> {
    let parallel = choice.get("disable_parallel_tool_use") != Some(&Value::Bool(true));
    let chat = match (
        choice.get("type").and_then(Value::as_str),
        choice.get("name"),
    ) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(Value::String(name))) => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be {\"type\": \"auto\" | \"any\" | \"none\"} or \
                 {\"type\": \"tool\", \"name\": …}",
            ))
        }
    };
    Ok((chat, parallel))
}

/// A refusal of the chat request, naming the Messages field the client sent.
pub fn messages_param(error: ApiError) -> ApiError {
    match error {
        ApiError::InvalidParam { param, message } if param == "stop" => ApiError::InvalidParam {
            param: "stop_sequences".into(),
            message,
        },
        ApiError::InvalidParam { param, message } if param.starts_with("response_format") => {
            ApiError::InvalidParam {
                param: "output_config.format".into(),
                message,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_conversation_reads_as_its_chat_request() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0, "routing": {"threshold": 0.1},
            "tools": [{"name": "weather", "description": "d",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "text", "text": "Thanks"}]}
            ]
        });
        let chat = chat_request(&body, false).unwrap();
        assert_eq!(chat["max_tokens"], 64);
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["routing"], json!({"threshold": 0.1}));
        assert_eq!(chat["tool_choice"], "required");
        assert_eq!(chat["parallel_tool_calls"], false);
        assert_eq!(chat["tools"][0]["function"]["parameters"]["type"], "object");
        let m = chat["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(
            m[1],
            json!({"role": "user", "content": "Weather in Paris?"})
        );
        assert_eq!(
            m[2]["content"],
            json!([{"type": "text", "text": "Let me look."}])
        );
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Paris"}"#
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"})
        );
        assert_eq!(
            m[4],
            json!({"role": "user", "content": [{"type": "text", "text": "Thanks"}]})
        );
        assert_eq!(m.len(), 5);
        assert!(chat.get("system").is_none() && chat.get("stop_sequences").is_none());
        let mut structured = body.clone();
        structured["output_config"] = json!({"format": {"type": "json_schema",
            "schema": {"type": "object"}}});
        let chat = chat_request(&structured, false).unwrap();
        assert_eq!(
            chat["response_format"]["json_schema"]["schema"],
            json!({"type": "object"})
        );
        assert!(chat.get("output_config").is_none());
    }

    #[test]
    fn what_cannot_be_read_is_named() {
        let base =
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        let cases = [
            (json!({"max_tokens": null}), "max_tokens"),
            (json!({"messages": "hi"}), "messages"),
            (
                json!({"messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"tools": [{"type": "web_search_20250305", "name": "w"}]}),
                "tools[0].type",
            ),
            (json!({"tool_choice": {"type": "tool"}}), "tool_choice"),
            (json!({"system": 5}), "system"),
            (json!({"stop_sequences": "END"}), "stop_sequences"),
        ];
        for (change, param) in cases {
            let mut body = base.clone();
            for (k, v) in change.as_object().unwrap() {
                body[k] = v.clone();
            }
            let err = chat_request(&body, false).unwrap_err();
            let got = match &err {
                ApiError::InvalidParam { param, .. } => param.clone(),
                ApiError::MissingField(f) => f.clone(),
                other => panic!("{other:?}"),
            };
            assert_eq!(got, param, "{change}");
        }
        // count_tokens needs no max_tokens.
        let mut body = base.clone();
        body.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(chat_request(&body, true).unwrap()["max_tokens"], 1);
    }
}
