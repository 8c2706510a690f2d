//! The answer of `POST /v1/responses` (OpenAI's Responses API): a response object whose
//! `output` holds a `reasoning` item (the thinking, with `--reasoning-parser`), a `message`
//! item (`output_text`) and a `function_call` item per tool call, read from the text as chat
//! reads it; whole, or streamed as typed events (`response.created`, `…output_item.added`,
//! `…output_text.delta`, …, `response.completed` / `response.incomplete`), each an SSE
//! event named by its type and numbered by `sequence_number`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value};
use tokenrouter_api::Backend;

use crate::choice::{Delta, OutToken};
use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};
use crate::params::GenerationPlan;
use crate::provenance::ProvenanceCounter;
use crate::reasoning::{ReasoningReader, Split};
use crate::response_store::{ResponseStore, Stored};
use crate::state::AppState;
use crate::tools::{Shown, ToolCallReader};

/// The request's settings a response object repeats, with OpenAI's defaults.
pub struct Echoed(Map<String, Value>);

impl Echoed {
    pub fn of(request: &Map<String, Value>, plan: &GenerationPlan) -> Self {
        let given = |key: &str, default: Value| {
            let value = request.get(key).filter(|v| !v.is_null()).cloned();
            (key.to_string(), value.unwrap_or(default))
        };
        Self(Map::from_iter([
            given("instructions", Value::Null),
            given("max_output_tokens", Value::Null),
            given("metadata", json!({})),
            given("parallel_tool_calls", json!(true)),
            given("reasoning", json!({"effort": null, "summary": null})),
            given("text", json!({"format": {"type": "text"}})),
            given("tool_choice", json!("auto")),
            given("tools", json!([])),
            given("user", Value::Null),
            given("previous_response_id", Value::Null),
            ("store".into(), json!(false)),
            ("truncation".into(), json!("disabled")),
            ("temperature".into(), json!(plan.sampling.temperature)),
            ("top_p".into(), json!(plan.sampling.top_p)),
        ]))
    }
}

impl Echoed {
    /// The same with `key` set to `value`.
    pub fn with(mut self, key: &str, value: Value) -> Self {
        self.0.insert(key.into(), value);
        self
    }
}

/// One response in the making.
pub struct Answer {
    id: String,
    created_at: u64,
    model: String,
    echoed: Echoed,
    generation: Generation,
    provenance: ProvenanceCounter,
    items: Items,
    /// Events are numbered from 0.
    sequence: u64,
    /// Where the finished response goes (`store`).
    store: Option<StoreTo>,
}

/// The store a finished response goes to, with its request's input items and the stored
/// response it continues.
struct StoreTo {
    store: Arc<ResponseStore>,
    own_input: Vec<Value>,
    previous: Option<Arc<Stored>>,
}

impl Answer {
    pub fn new(
        state: &AppState,
        plan: &GenerationPlan,
        echoed: Echoed,
        generation: Generation,
    ) -> Self {
        let names: Vec<String> = state.backend.models().into_iter().map(|m| m.name).collect();
        Self {
            id: format!("resp_{:032x}", rand::random::<u128>()),
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: plan.model.name.clone(),
            echoed,
            generation,
            provenance: ProvenanceCounter::new(names),
            items: Items::new(plan, state.backend.clone()),
            sequence: 0,
            store: None,
        }
    }

    /// The finished response is kept in `store` with its request's `own_input`, after
    /// `previous`.
    pub fn stored_in(
        mut self,
        store: Arc<ResponseStore>,
        own_input: Vec<Value>,
        previous: Option<Arc<Stored>>,
    ) -> Self {
        self.store = Some(StoreTo {
            store,
            own_input,
            previous,
        });
        self
    }

    /// The finished response object, stored when asked.
    fn finished(&mut self, incomplete: bool) -> Value {
        let object = self.object(Some(incomplete));
        if let Some(StoreTo {
            store,
            own_input,
            previous,
        }) = self.store.take()
        {
            let stored = Stored {
                response: object.clone(),
                own_input,
                previous,
            };
            store.insert(self.id.clone(), Arc::new(stored));
        }
        object
    }

    /// Waits for the whole answer.
    pub async fn whole(mut self) -> Result<Response, ApiError> {
        // The items are built delta by delta, as streamed (the events are dropped): a
        // delta's tokens are told to the item its text went to.
        let mut incomplete = false;
        while let Some(update) = self.generation.next().await {
            match update {
                ChoiceUpdate::Failed(e) => return Err(e),
                ChoiceUpdate::Prompt { .. } => {}
                ChoiceUpdate::Delta { delta, .. } => {
                    self.provenance.add(0, &delta.tokens);
                    self.items.push(&delta, false, false);
                }
                ChoiceUpdate::Finished { delta, reason, .. } => {
                    self.provenance.add(0, &delta.tokens);
                    incomplete = reason == "length";
                    self.items.push(&delta, true, incomplete);
                }
            }
        }
        Ok(Json(self.finished(incomplete)).into_response())
    }

    /// The answer as its stream of events.
    pub fn stream(self) -> Response {
        let events = stream::unfold((self, false), |(mut answer, done)| async move {
            if done {
                return None;
            }
            let (events, done) = answer.next_events().await;
            Some((stream::iter(events), (answer, done)))
        })
        .flatten()
        .map(Ok::<_, Infallible>);
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }

    /// The events of the next update; `true` once the stream is over.
    async fn next_events(&mut self) -> (Vec<Event>, bool) {
        let mut out = Vec::new();
        if self.sequence == 0 {
            let object = self.object(None);
            out.push(json!({"type": "response.created", "response": object}));
            out.push(json!({"type": "response.in_progress", "response": object}));
        }
        let done = match self.generation.next().await {
            Some(ChoiceUpdate::Failed(e)) => {
                let body = serde_json::to_value(e.body()).unwrap_or_default();
                let error = &body["error"];
                out.push(json!({"type": "error", "message": error["message"],
                    "code": error["code"], "param": error["param"]}));
                true
            }
            Some(ChoiceUpdate::Prompt { .. }) => false,
            Some(ChoiceUpdate::Delta { delta, .. }) => {
                self.provenance.add(0, &delta.tokens);
                out.extend(self.items.push(&delta, false, false));
                false
            }
            Some(ChoiceUpdate::Finished { delta, reason, .. }) => {
                self.provenance.add(0, &delta.tokens);
                let incomplete = reason == "length";
                out.extend(self.items.push(&delta, true, incomplete));
                let kind = match incomplete {
                    true => "response.incomplete",
                    false => "response.completed",
                };
                out.push(json!({"type": kind, "response": self.finished(incomplete)}));
                true
            }
            None => true,
        };
        let events = out
            .into_iter()
            .map(|mut event| {
                event["sequence_number"] = json!(self.sequence);
                self.sequence += 1;
                let kind = event["type"].as_str().unwrap_or("message").to_string();
                Event::default().event(kind).data(event.to_string())
            })
            .collect();
        (events, done)
    }

    /// The response object; `finished`: `None` while in progress, else whether it was cut
    /// by `max_output_tokens`.
    fn object(&self, finished: Option<bool>) -> Value {
        let (status, incomplete_details) = match finished {
            None => ("in_progress", Value::Null),
            Some(false) => ("completed", Value::Null),
            Some(true) => ("incomplete", json!({"reason": "max_output_tokens"})),
        };
        let usage = finished.map(|_| {
            let usage = self.generation.usage(self.provenance.completion_tokens());
            let (input, output) = (usage.prompt_tokens, usage.completion_tokens);
            let cached = usage.prompt_tokens_details.cached_tokens;
            // Reasoning tokens are not told apart here: reported as 0.
            json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output})
        });
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete_details,
            "model": self.model,
            "output": if finished.is_some() { json!(self.items.output) } else { json!([]) },
            "usage": usage,
            "tokenrouter": self.provenance.snapshot(),
        });
        for (key, value) in &self.echoed.0 {
            object[key] = value.clone();
        }
        object
    }
}

/// What an item being written is.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Reasoning,
    Message,
}

/// The item being written: its kind, id, place in `output` and text so far.
struct Open {
    kind: Kind,
    id: String,
    index: usize,
    text: String,
    /// A message's token log-probabilities so far (when asked for).
    logprobs: Vec<Value>,
}

/// The output items, built as the text arrives (thinking, then text and tool calls).
struct Items {
    reasoning: Option<ReasoningReader>,
    tools: Option<ToolCallReader>,
    output: Vec<Value>,
    open: Option<Open>,
    /// Set when the message's log-probabilities were asked for: tokens' text comes from it.
    logprobs: Option<Arc<dyn Backend>>,
}

impl Items {
    fn new(plan: &GenerationPlan, backend: Arc<dyn Backend>) -> Self {
        Self {
            logprobs: plan.logprobs.map(|_| backend),
            reasoning: plan.reasoning.map(ReasoningReader::new),
            tools: plan
                .tool_names
                .clone()
                .map(|names| ToolCallReader::new(names).one_call_at_most(plan.single_tool_call)),
            output: Vec::new(),
            open: None,
        }
    }

    /// Takes the next piece of the answer (`last` at its end, which closes every item;
    /// `incomplete` when `max_output_tokens` cut it); the events it makes. Its tokens'
    /// log-probabilities, when asked for, go with the message text it wrote (a piece that
    /// wrote only thinking or tool calls gives the message none).
    fn push(&mut self, delta: &Delta, last: bool, incomplete: bool) -> Vec<Value> {
        let text = delta.text.as_str();
        let Split { content, reasoning } = match self.reasoning.as_mut() {
            Some(reader) => reader.push(text, last),
            None => Split {
                content: text.to_string(),
                reasoning: String::new(),
            },
        };
        let Shown { content, calls, .. } = match self.tools.as_mut() {
            Some(reader) => reader.push(&content, last),
            None => Shown {
                content,
                ..Shown::default()
            },
        };
        let mut events = Vec::new();
        if !reasoning.is_empty() {
            self.write(Kind::Reasoning, &reasoning, Vec::new(), &mut events);
        }
        if !content.is_empty() {
            let logprobs = self.logprob_entries(&delta.tokens);
            self.write(Kind::Message, &content, logprobs, &mut events);
        }
        for call in calls {
            self.close("completed", &mut events);
            let index = self.output.len();
            let item = |status: &str, arguments: &str| {
                json!({"type": "function_call", "id": format!("fc_{}", call.id),
                    "call_id": call.id, "name": call.function.name, "arguments": arguments,
                    "status": status})
            };
            let id = format!("fc_{}", call.id);
            let arguments = call.function.arguments.as_str();
            events.push(
                json!({"type": "response.output_item.added", "output_index": index,
                "item": item("in_progress", "")}),
            );
            events.push(json!({"type": "response.function_call_arguments.delta",
                "item_id": id, "output_index": index, "delta": arguments}));
            events.push(json!({"type": "response.function_call_arguments.done",
                "item_id": id, "output_index": index, "arguments": arguments}));
            let done = item("completed", arguments);
            events.push(
                json!({"type": "response.output_item.done", "output_index": index,
                "item": done}),
            );
            self.output.push(done);
        }
        if last {
            // An answer with nothing in it is still a (empty) message.
            if self.output.is_empty() && self.open.is_none() {
                self.write(Kind::Message, "", Vec::new(), &mut events);
            }
            let status = if incomplete {
                "incomplete"
            } else {
                "completed"
            };
            self.close(status, &mut events);
        }
        events
    }

    /// OpenAI's log-probability entries of `tokens` (none unless asked for).
    fn logprob_entries(&self, tokens: &[OutToken]) -> Vec<Value> {
        let Some(backend) = &self.logprobs else {
            return Vec::new();
        };
        let entry = |id: u32, logprob: f32| {
            let token = backend.decode(&[id], false).unwrap_or_default();
            json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
        };
        tokens
            .iter()
            .map(|t| {
                let mut e = entry(t.event.id, t.event.logprob);
                e["top_logprobs"] = t
                    .event
                    .top_logprobs
                    .iter()
                    .map(|&(id, lp)| entry(id, lp))
                    .collect();
                e
            })
            .collect()
    }

    /// Appends `text` (with its tokens' `logprobs`, for a message) to an item of `kind`,
    /// opening it (and closing another) first.
    fn write(&mut self, kind: Kind, text: &str, logprobs: Vec<Value>, events: &mut Vec<Value>) {
        if self.open.as_ref().is_some_and(|o| o.kind != kind) {
            self.close("completed", events);
        }
        let index = self.output.len();
        let open = self.open.get_or_insert_with(|| {
            let (prefix, item) = match kind {
                Kind::Reasoning => (
                    "rs",
                    json!({"type": "reasoning", "summary": [],
                    "content": [], "status": "in_progress"}),
                ),
                Kind::Message => (
                    "msg",
                    json!({"type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}),
                ),
            };
            let id = format!("{prefix}_{:032x}", rand::random::<u128>());
            let mut item = item;
            item["id"] = json!(id);
            events.push(
                json!({"type": "response.output_item.added", "output_index": index,
                "item": item}),
            );
            if kind == Kind::Message {
                events.push(json!({"type": "response.content_part.added", "item_id": id,
                    "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}}));
            }
            Open {
                kind,
                id,
                index,
                text: String::new(),
                logprobs: Vec::new(),
            }
        });
        open.text.push_str(text);
        open.logprobs.extend(logprobs.iter().cloned());
        if text.is_empty() {
            return;
        }
        let kind_name = match kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            Kind::Message => "response.output_text.delta",
        };
        let mut delta = json!({"type": kind_name, "item_id": open.id,
            "output_index": open.index, "content_index": 0, "delta": text});
        if kind == Kind::Message {
            delta["logprobs"] = Value::Array(logprobs);
        }
        events.push(delta);
    }

    /// Finishes the open item, if any, with `status`.
    fn close(&mut self, status: &str, events: &mut Vec<Value>) {
        let Some(Open {
            kind,
            id,
            index,
            text,
            logprobs,
        }) = self.open.take()
        else {
            return;
        };
        let item = match kind {
            Kind::Reasoning => {
                events.push(
                    json!({"type": "response.reasoning_text.done", "item_id": id,
                    "output_index": index, "content_index": 0, "text": text}),
                );
                json!({"type": "reasoning", "id": id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": text}]})
            }
            Kind::Message => {
                let part = json!({"type": "output_text", "text": text, "annotations": [],
                    "logprobs": logprobs});
                events.push(json!({"type": "response.output_text.done", "item_id": id,
                    "output_index": index, "content_index": 0, "text": text,
                    "logprobs": logprobs}));
                events.push(json!({"type": "response.content_part.done", "item_id": id,
                    "output_index": index, "content_index": 0, "part": part}));
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                    "content": [part]})
            }
        };
        events.push(
            json!({"type": "response.output_item.done", "output_index": index,
            "item": item}),
        );
        self.output.push(item);
    }
}
