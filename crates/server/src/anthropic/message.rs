//! The answer of `POST /v1/messages`: Anthropic's message object — `content` blocks
//! (`thinking`, `text`, one `tool_use` per call, read from the text as chat reads it),
//! `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence` with the sequence, `tool_use`),
//! `usage` (`input_tokens` beyond those read from the prefix cache,
//! `cache_read_input_tokens`, `output_tokens`) and our `tokenrouter` provenance — whole, or
//! as Anthropic's events: `message_start`, `ping`, per block `content_block_start`,
//! `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`),
//! `content_block_stop`, then `message_delta` (the stop reason and usage) and
//! `message_stop`; each an SSE event named by its type.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::answer_reader::AnswerReader;
use crate::choice::StopMatch;
use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};
use crate::params::GenerationPlan;
use crate::provenance::ProvenanceCounter;
use crate::state::AppState;
use crate::tools::Shown;

/// The block being written.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Thinking,
    Text,
}

/// One message in the making.
pub struct Answer {
    id: String,
    model: String,
    generation: Generation,
    provenance: ProvenanceCounter,
    reader: AnswerReader,
    /// Finished blocks.
    content: Vec<Value>,
    /// The block being written: its kind and text so far.
    open: Option<(Kind, String)>,
    /// `stop_reason` and `stop_sequence` once it ended.
    stop: Option<(&'static str, Option<String>)>,
}

impl Answer {
    pub fn new(state: &AppState, plan: &GenerationPlan, generation: Generation) -> Self {
        let names: Vec<String> = state.backend.models().into_iter().map(|m| m.name).collect();
        Self {
            id: format!("msg_{:032x}", rand::random::<u128>()),
            model: plan.model.name.clone(),
            generation,
            provenance: ProvenanceCounter::new(names),
            reader: AnswerReader::new(plan),
            content: Vec::new(),
            open: None,
            stop: None,
        }
    }

    /// Waits for the whole message.
    pub async fn whole(mut self) -> Result<Response, ApiError> {
        while let Some(update) = self.generation.next().await {
            self.apply(update)?;
        }
        Ok(Json(self.message()).into_response())
    }

    /// The message as Anthropic's events; an error mid-way is an `error` event.
    pub fn stream(self) -> Response {
        let start = self.start_events();
        let events = stream::unfold(Some(self), |answer| async move {
            let mut answer = answer?;
            let update = answer.generation.next().await?;
            match answer.apply(update) {
                Ok(events) => Some((events, Some(answer))),
                Err(e) => {
                    let error = super::error_body("api_error", &e.to_string());
                    Some((vec![error], None))
                }
            }
        });
        let events = stream::iter([start])
            .chain(events)
            .flat_map(stream::iter)
            .map(|event| {
                let kind = event["type"].as_str().unwrap_or("message").to_string();
                Ok::<_, Infallible>(Event::default().event(kind).data(event.to_string()))
            });
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }

    fn start_events(&self) -> Vec<Value> {
        let mut message = self.message();
        message["content"] = json!([]);
        message["stop_reason"] = Value::Null;
        message["usage"]["output_tokens"] = json!(0);
        vec![
            json!({"type": "message_start", "message": message}),
            json!({"type": "ping"}),
        ]
    }

    /// Takes one update; the events it makes.
    fn apply(&mut self, update: ChoiceUpdate) -> Result<Vec<Value>, ApiError> {
        let (delta, end) = match update {
            ChoiceUpdate::Failed(e) => return Err(e),
            ChoiceUpdate::Prompt { .. } => return Ok(Vec::new()),
            ChoiceUpdate::Delta { delta, .. } => (delta, None),
            ChoiceUpdate::Finished {
                delta,
                reason,
                stopped_by,
                ..
            } => (delta, Some((reason, stopped_by))),
        };
        self.provenance.add(0, &delta.tokens);
        let Shown {
            content,
            calls,
            reasoning,
        } = self.reader.push(&delta.text, end.is_some());
        let mut events = Vec::new();
        if !reasoning.is_empty() {
            self.write(Kind::Thinking, &reasoning, &mut events);
        }
        if !content.is_empty() {
            self.write(Kind::Text, &content, &mut events);
        }
        let called = !calls.is_empty();
        for call in calls {
            self.close(&mut events);
            let index = self.content.len();
            let input: Value =
                serde_json::from_str(&call.function.arguments).unwrap_or_else(|_| json!({}));
            let id = format!("toolu_{}", call.id.trim_start_matches("call_"));
            events.push(json!({"type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": id, "name": call.function.name,
                "input": {}}}));
            events.push(json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.function.arguments}}));
            events.push(json!({"type": "content_block_stop", "index": index}));
            self.content.push(
                json!({"type": "tool_use", "id": id, "name": call.function.name, "input": input}),
            );
        }
        if let Some((reason, stopped_by)) = end {
            self.close(&mut events);
            let has_call = called || self.content.iter().any(|b| b["type"] == "tool_use");
            self.stop = Some(match (reason, stopped_by) {
                ("length", _) => ("max_tokens", None),
                (_, _) if has_call => ("tool_use", None),
                (_, Some(StopMatch::Text(sequence))) => ("stop_sequence", Some(sequence)),
                _ => ("end_turn", None),
            });
            let message = self.message();
            events.push(json!({"type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"],
                    "stop_sequence": message["stop_sequence"]},
                "usage": message["usage"], "tokenrouter": message["tokenrouter"]}));
            events.push(json!({"type": "message_stop"}));
        }
        Ok(events)
    }

    /// Appends `text` to a block of `kind`, opening it (and closing another) first.
    fn write(&mut self, kind: Kind, text: &str, events: &mut Vec<Value>) {
        if self.open.as_ref().is_some_and(|(k, _)| *k != kind) {
            self.close(events);
        }
        let index = self.content.len();
        if self.open.is_none() {
            let block = match kind {
                Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Kind::Text => json!({"type": "text", "text": ""}),
            };
            events.push(
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            );
            self.open = Some((kind, String::new()));
        }
        if let Some((_, so_far)) = self.open.as_mut() {
            so_far.push_str(text);
        }
        let delta = match kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Kind::Text => json!({"type": "text_delta", "text": text}),
        };
        events.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
    }

    /// Finishes the open block, if any.
    fn close(&mut self, events: &mut Vec<Value>) {
        let Some((kind, text)) = self.open.take() else {
            return;
        };
        let index = self.content.len();
        events.push(json!({"type": "content_block_stop", "index": index}));
        self.content.push(match kind {
            Kind::Thinking => json!({"type": "thinking", "thinking": text, "signature": ""}),
            Kind::Text => json!({"type": "text", "text": text}),
        });
    }

    /// The message as it stands.
    fn message(&self) -> Value {
        let usage = self.generation.usage(self.provenance.completion_tokens());
        let cached = usage.prompt_tokens_details.cached_tokens;
        let (reason, sequence) = match &self.stop {
            Some((reason, sequence)) => (json!(reason), json!(sequence)),
            None => (Value::Null, Value::Null),
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": usage.prompt_tokens.saturating_sub(cached),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": usage.completion_tokens,
            },
            "tokenrouter": self.provenance.snapshot(),
        })
    }
}
