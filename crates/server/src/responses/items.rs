//! The output items of a response, built as its text arrives: a `reasoning` item (the
//! thinking), a `message` item (`output_text`, with its tokens' log-probabilities when
//! asked), a `function_call` item per tool call; and the stream events each piece makes.

use std::sync::Arc;

use serde_json::{json, Value};
use tokenrouter_api::Backend;

use crate::answer_reader::AnswerReader;
use crate::choice::{Delta, OutToken};
use crate::params::GenerationPlan;
use crate::tools::Shown;

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
pub(super) struct Items {
    reader: AnswerReader,
    pub(super) output: Vec<Value>,
    open: Option<Open>,
    /// Set when the message's log-probabilities were asked for: tokens' text comes from it.
    logprobs: Option<Arc<dyn Backend>>,
}

impl Items {
    pub(super) fn new(plan: &GenerationPlan, backend: Arc<dyn Backend>) -> Self {
        Self {
            logprobs: plan.logprobs.map(|_| backend),
            reader: AnswerReader::new(plan),
            output: Vec::new(),
            open: None,
        }
    }

    /// Takes the next piece of the answer (`last` at its end, which closes every item;
    /// `incomplete` when `max_output_tokens` cut it); the events it makes. Its tokens'
    /// log-probabilities, when asked for, go with the message text it wrote (a piece that
    /// wrote only thinking or tool calls gives the message none).
    pub(super) fn push(&mut self, delta: &Delta, last: bool, incomplete: bool) -> Vec<Value> {
        let Shown {
            content,
            calls,
            reasoning,
        } = self.reader.push(&delta.text, last);
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
    pub(super) fn close(&mut self, status: &str, events: &mut Vec<Value>) {
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
