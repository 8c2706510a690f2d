//! `POST /v1/responses`, OpenAI's Responses API: the request is read as the chat request it amounts to — `instructions` a
//! system message; `input` a string or items (messages with `input_text` / `output_text`
//! parts, earlier `function_call`s and their `function_call_output`s); flat function `tools`;
//! `text.format` as `response_format`; `max_output_tokens` — and answered as a response
//! object (`crate::responses`), whole or as its stream of typed events. The chat fields we
//! take beyond OpenAI's (sampling extras, `routing`, `return_token_sources`) pass through.
//! Finished answers are stored (`crate::response_store`) unless `store: false`: a request
//! naming one by `previous_response_id` continues its conversation, and
//! `GET` / `DELETE /v1/responses/{id}` and `GET …/input_items` reach it. With
//! `background: true` the answer runs in a task of its own (`crate::background`): the
//! request returns it `queued` (or streams its events), and `GET …?stream=true`,
//! `POST …/cancel` reach it while it runs.

use std::time::Instant;

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::respond;
use crate::response_store::Stored;
use crate::responses::{self, Echoed};
use crate::routes::chat;
use crate::state::AppState;

/// Fields of a Responses request with no chat counterpart: answered for, then left out.
const RESPONSES_ONLY: &[&str] = &[
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "reasoning",
    "previous_response_id",
    "store",
    "metadata",
    "include",
    "truncation",
    "user",
    "background",
    "top_logprobs",
    "n",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "response_format",
];

pub async fn responses(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let Value::Object(mut fields) = body else {
        return Err(ApiError::invalid(
            "input",
            "the request body must be a JSON object",
        ));
    };
    let store = state.responses.enabled() && fields.get("store") != Some(&Value::Bool(false));
    let background = match fields.get("background") {
        None | Some(Value::Null | Value::Bool(false)) => false,
        Some(Value::Bool(true)) if store => true,
        Some(Value::Bool(true)) => {
            let why = match state.responses.enabled() {
                true => "a background response is stored: `store` cannot be false",
                false => "this server keeps no responses (--max-stored-responses 0), so it runs none in the background",
            };
            return Err(ApiError::invalid("background", why));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "background",
                "`background` must be a boolean",
            ))
        }
    };
    let (own, previous) = continued(&state, &fields)?;
    if let (Some(own), Some(previous)) = (&own, &previous) {
        // The earlier conversation, then this request's items.
        let mut items = previous.input();
        items.extend(previous.output().iter().cloned());
        items.extend(own.iter().cloned());
        fields.insert("input".into(), Value::Array(items));
    }
    let chat_body = chat_request(&fields)?;
    let (mut plan, ids) = chat::prepare(&state, &chat_body)
        .await
        .map_err(responses_param)?;
    let echoed = Echoed::of(&fields, &plan).with("store", json!(store));
    let generation = respond::start(&state, &mut plan, &[ids], arrival)?;
    let mut answer = responses::Answer::new(&state, &plan, echoed, generation);
    if let (true, Some(own)) = (store, own) {
        answer = answer.stored_in(state.responses.clone(), with_ids(own), previous);
    }
    if background {
        let job = state.jobs.start(answer.in_background(), plan.stream);
        return Ok(match plan.stream {
            true => responses::sse(job.follow(None)),
            false => Json(job.snapshot()).into_response(),
        });
    }
    if plan.stream {
        Ok(answer.stream())
    } else {
        answer.whole().await
    }
}

/// This request's own input items (a string is one user message) and the stored response
/// a `previous_response_id` names. `None` items when `input` is neither a string nor a list
/// (`chat_request` says why).
type Continued = (Option<Vec<Value>>, Option<Arc<Stored>>);

fn continued(state: &AppState, fields: &Map<String, Value>) -> Result<Continued, ApiError> {
    let own = match fields.get("input") {
        Some(Value::String(text)) => Some(vec![
            json!({"type": "message", "role": "user", "content": text}),
        ]),
        Some(Value::Array(items)) => Some(items.clone()),
        _ => None,
    };
    let previous = match fields.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => {
            if state.jobs.get(id).is_some_and(|job| job.running()) {
                return Err(ApiError::invalid(
                    "previous_response_id",
                    "that response is still running in the background: wait for it to end",
                ));
            }
            Some(
                state
                    .responses
                    .get(id)
                    .ok_or_else(|| ApiError::ResponseNotFound {
                        id: crate::error::truncate_for_echo(id),
                        param: Some("previous_response_id".into()),
                    })?,
            )
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "previous_response_id",
                "`previous_response_id` must be a string",
            ))
        }
    };
    Ok((own, previous))
}

/// Input items as stored: each with an `id` (kept when given), as
/// `GET /v1/responses/{id}/input_items` lists them.
fn with_ids(items: Vec<Value>) -> Vec<Value> {
    items
        .into_iter()
        .map(|mut item| {
            if let Value::Object(fields) = &mut item {
                if !fields.contains_key("id") {
                    let prefix = match fields.get("type").and_then(Value::as_str) {
                        None | Some("message") => "msg",
                        Some(_) => "item",
                    };
                    let id = format!("{prefix}_{:032x}", rand::random::<u128>());
                    fields.insert("id".into(), Value::String(id));
                }
            }
            item
        })
        .collect()
}

/// `GET /v1/responses/{id}`: a stored response, or one running in the background as it
/// stands; with `stream=true` (a background response created with `stream: true`) its
/// events after `starting_after`, then each new one until it ends.
pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let job = state.jobs.get(&id);
    match query.get("stream").map(String::as_str) {
        None | Some("false") => {}
        Some("true") => {
            let starting_after = match query.get("starting_after") {
                None => None,
                Some(n) => Some(n.parse::<u64>().map_err(|_| {
                    ApiError::invalid(
                        "starting_after",
                        "`starting_after` must be an event's sequence number",
                    )
                })?),
            };
            return match job {
                Some(job) if job.streamed() => Ok(responses::sse(job.follow(starting_after))),
                Some(_) => Err(not_streamed()),
                None if stored(&state, &id).is_ok() => Err(not_streamed()),
                None => Err(not_found(&id)),
            };
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream",
                "`stream` must be true or false",
            ))
        }
    }
    let response = match job {
        Some(job) => job.snapshot(),
        None => stored(&state, &id)?.response.clone(),
    };
    Ok(Json(response).into_response())
}

/// `POST /v1/responses/{id}/cancel`: stops a background response (its output so far kept,
/// status `cancelled`); one that has ended, or never ran in the background, is a 400.
pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let response = match state.jobs.get(&id) {
        Some(job) if job.running() => return Ok(Json(job.cancel().await)),
        Some(job) => job.snapshot(),
        None => stored(&state, &id)?.response.clone(),
    };
    let message = match response.get("background") == Some(&Value::Bool(true)) {
        true => format!(
            "cannot cancel a response that is already {}",
            response["status"].as_str().unwrap_or("ended")
        ),
        false => "cannot cancel a synchronous response: only one created with \
                  `background: true` can be cancelled"
            .to_string(),
    };
    Err(ApiError::invalid("response_id", message))
}

/// `DELETE /v1/responses/{id}` (a background response still running is cancelled first).
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let running = state.jobs.remove(&id).await;
    if !state.responses.remove(&id) && !running {
        return Err(not_found(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}

/// `GET /v1/responses/{id}/input_items`: the input a stored response answered, OpenAI's
/// list (`order` `desc` by default, `limit` 1-100 (20), `after` an item id).
pub async fn input_items(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let mut items = stored(&state, &id)?.input();
    match query.get("order").map(String::as_str) {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(_) => return Err(ApiError::invalid("order", "`order` must be asc or desc")),
    }
    let limit = match query.get("limit") {
        None => 20,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| {
                ApiError::invalid("limit", "`limit` must be an integer from 1 to 100")
            })?,
    };
    if let Some(after) = query.get("after") {
        let at = items
            .iter()
            .position(|item| item.get("id").and_then(Value::as_str) == Some(after))
            .ok_or_else(|| {
                ApiError::invalid("after", "`after` names no input item of this response")
            })?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    let id_of = |item: Option<&Value>| {
        item.and_then(|i| i.get("id"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    Ok(Json(
        json!({"object": "list", "first_id": id_of(items.first()),
        "last_id": id_of(items.last()), "has_more": has_more, "data": items}),
    ))
}

fn stored(state: &AppState, id: &str) -> Result<Arc<Stored>, ApiError> {
    state.responses.get(id).ok_or_else(|| not_found(id))
}

fn not_streamed() -> ApiError {
    ApiError::invalid(
        "stream",
        "this response's events are not kept: only a background response created with \
         `stream: true` can be streamed again, while the server keeps its events",
    )
}

fn not_found(id: &str) -> ApiError {
    ApiError::ResponseNotFound {
        id: crate::error::truncate_for_echo(id),
        param: None,
    }
}

/// A refusal of the chat request, naming the Responses field the client sent.
fn responses_param(error: ApiError) -> ApiError {
    match error {
        ApiError::InvalidParam { param, message } => {
            let param = match param.as_str() {
                "max_tokens" => "max_output_tokens".to_string(),
                p if p.starts_with("messages") => "input".to_string(),
                p => match p.strip_prefix("response_format") {
                    Some(rest) => {
                        let rest = rest.strip_prefix(".json_schema").unwrap_or(rest);
                        format!("text.format{rest}")
                    }
                    None => param,
                },
            };
            ApiError::InvalidParam { param, message }
        }
        other => other,
    }
}

/// The chat request a Responses request amounts to.
fn chat_request(fields: &Map<String, Value>) -> Result<Value, ApiError> {
    let mut chat: Map<String, Value> = fields
        .iter()
        .filter(|(k, _)| !RESPONSES_ONLY.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut messages = Vec::new();
    match fields.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => messages.push(json!({"role": "system", "content": text})),
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "`instructions` must be a string",
            ))
        }
    }
    match fields.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        None | Some(Value::Null) => return Err(ApiError::MissingField("input".into())),
        Some(_) => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or a list of items",
            ))
        }
    }
    chat.insert("messages".into(), Value::Array(messages));
    // The message's log-probabilities: `include` names them, `top_logprobs` counts the
    // alternatives (chat's fields).
    let included = fields
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|list| list.iter().any(|v| v == "message.output_text.logprobs"));
    let top = fields.get("top_logprobs").filter(|v| !v.is_null());
    if included || top.is_some() {
        chat.insert("logprobs".into(), Value::Bool(true));
        chat.insert("top_logprobs".into(), top.cloned().unwrap_or(json!(0)));
    }
    if let Some(max) = fields.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_tokens".into(), max.clone());
    }
    if let Some(tools) = fields.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = fields.get("tool_choice").filter(|v| !v.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    if let Some(format) = fields.get("text").and_then(|t| t.get("format")) {
        if let Some(response_format) = chat_response_format(format)? {
            chat.insert("response_format".into(), response_format);
        }
    }
    Ok(Value::Object(chat))
}

/// One `input` item appended as chat messages (consecutive function calls join one
/// assistant message, as a chat client sends them).
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let field = |name: &str| format!("input[{i}].{name}");
    let kind = item.get("type").and_then(Value::as_str);
    let text_of = |name: &str| -> Result<String, ApiError> {
        match item.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(ApiError::invalid(
                field(name),
                format!("`{}` must be a string", field(name)),
            )),
        }
    };
    match kind {
        None | Some("message") => {
            let role = item
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(field("role"), "a message item needs a `role`"))?;
            let content = message_content(i, item.get("content"))?;
            messages.push(json!({"role": role, "content": content}));
        }
        Some("function_call") => {
            let call = json!({"id": text_of("call_id")?, "type": "function",
                "function": {"name": text_of("name")?, "arguments": text_of("arguments")?}});
            let joined = messages.last_mut().filter(|m| {
                m["role"] == "assistant" && m.get("tool_calls").is_some() && m["content"].is_null()
            });
            match joined {
                Some(last) => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                None => messages
                    .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        Some("function_call_output") => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            messages.push(json!({"role": "tool", "tool_call_id": text_of("call_id")?,
                "content": output}));
        }
        // Earlier reasoning is not shown to the template again (as chat clients drop it).
        Some("reasoning") => {}
        Some(other) => {
            return Err(ApiError::invalid(
                field("type"),
                format!(
                    "input items of type `{}` are not supported (message, function_call, \
                     function_call_output)",
                    crate::error::truncate_for_echo(other)
                ),
            ))
        }
    }
    Ok(())
}

/// A message item's content as chat text parts: a string, or `input_text` / `output_text`
/// parts (images and files are refused, naming the part).
fn message_content(i: usize, content: Option<&Value>) -> Result<Value, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                match (kind, part.get("text")) {
                    ("input_text" | "output_text" | "text", Some(Value::String(text))) => {
                        out.push(json!({"type": "text", "text": text}))
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("input[{i}].content[{j}]"),
                            format!(
                                "only text content parts are supported, got type {:?}",
                                crate::error::truncate_for_echo(kind)
                            ),
                        ))
                    }
                }
            }
            Ok(Value::Array(out))
        }
        _ => Err(ApiError::invalid(
            format!("input[{i}].content"),
            "a message's content must be a string or a list of parts",
        )),
    }
}

/// Flat function tools (`{"type": "function", "name", "description", "parameters"}`) as
/// chat's nested ones; other tool types are refused.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(ApiError::invalid("tools", "`tools` must be a list"));
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| match tool.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut function = Map::new();
                for key in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = tool.get(key) {
                        function.insert(key.into(), v.clone());
                    }
                }
                Ok(json!({"type": "function", "function": function}))
            }
            other => Err(ApiError::invalid(
                format!("tools[{i}].type"),
                format!(
                    "only function tools are supported, got {:?}",
                    other.map(crate::error::truncate_for_echo)
                ),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `tool_choice`: the strings pass; `{"type": "function", "name"}` becomes chat's shape.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            Ok(json!({"type": "function", "function": {"name": o.get("name")}}))
        }
        _ => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be \"auto\", \"none\", \"required\" or a function",
        )),
    }
}

/// `text.format` as chat's `response_format` (`None` for plain text).
fn chat_response_format(format: &Value) -> Result<Option<Value>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => Ok(Some(json!({"type": "json_schema", "json_schema": {
            "name": format.get("name"), "schema": format.get("schema"),
            "strict": format.get("strict")}}))),
        Some(other) => Err(ApiError::invalid(
            "text.format.type",
            format!(
                "unknown format `{}` (text, json_object, json_schema)",
                crate::error::truncate_for_echo(other)
            ),
        )),
    }
}
