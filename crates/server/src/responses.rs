//! The answer of `POST /v1/responses` (OpenAI's Responses API): a response object whose
//! `output` holds a `reasoning` item (the thinking, with `--reasoning-parser`), a `message`
//! item (`output_text`) and a `function_call` item per tool call, read from the text as chat
//! reads it; whole, or streamed as typed events (`response.created`, `…output_item.added`,
//! `…output_text.delta`, …, `response.completed` / `response.incomplete`), each an SSE
//! event named by its type and numbered by `sequence_number`. In the background
//! (`crate::background`) it starts `queued`, and may end `failed` or `cancelled`.

mod items;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};
use crate::params::GenerationPlan;
use crate::provenance::ProvenanceCounter;
use crate::response_store::{ResponseStore, Stored};
use crate::state::AppState;
use items::Items;

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
            given("background", json!(false)),
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
    /// Runs in the background (`background: true`): starts `queued`, and a failure is
    /// kept as a `failed` response.
    background: bool,
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
            background: false,
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

    /// The ended response object (`end`: completed, incomplete, failed or cancelled),
    /// stored when asked.
    fn finished(&mut self, end: Status) -> Value {
        let object = self.object(end);
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

    /// Stops the answer where it is (a background response's `cancel`): the generation is
    /// dropped, which aborts it in the engine, and the response ends `cancelled` with the
    /// output written so far.
    pub fn cancel(&mut self) -> Value {
        self.generation.abort();
        let mut events = Vec::new();
        self.items.close("incomplete", &mut events);
        self.finished(Status::Cancelled)
    }

    /// The answer runs in the background.
    pub fn in_background(mut self) -> Self {
        self.background = true;
        self
    }

    /// The response's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Waits for the whole answer.
    pub async fn whole(mut self) -> Result<Response, ApiError> {
        // The items are built delta by delta, as streamed (the events are dropped): a
        // delta's tokens are told to the item its text went to.
        let mut end = Status::Completed;
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
                    end = Status::ended_by(reason);
                    self.items.push(&delta, true, end.cut_short());
                }
            }
        }
        Ok(Json(self.finished(end)).into_response())
    }

    /// The answer as its stream of events.
    pub fn stream(self) -> Response {
        let events = stream::unfold((self, false), |(mut answer, done)| async move {
            if done {
                return None;
            }
            let (events, done) = answer.next_events().await;
            let sent = events
                .iter()
                .map(|e| Arc::new(SentEvent::of(e)))
                .collect::<Vec<_>>();
            Some((stream::iter(sent), (answer, done)))
        })
        .flatten();
        sse(events)
    }

    /// The response as it stands before its first event: `queued` in the background,
    /// else `in_progress`.
    pub fn started(&self) -> Value {
        self.object(match self.background {
            true => Status::Queued,
            false => Status::InProgress,
        })
    }

    /// The events of the next update, numbered; `true` once the answer is over.
    pub async fn next_events(&mut self) -> (Vec<Value>, bool) {
        let mut out = Vec::new();
        if self.sequence == 0 {
            out.push(json!({"type": "response.created", "response": self.started()}));
            if self.background {
                out.push(json!({"type": "response.queued", "response": self.started()}));
            }
            let object = self.object(Status::InProgress);
            out.push(json!({"type": "response.in_progress", "response": object}));
        }
        let done = match self.generation.next().await {
            Some(ChoiceUpdate::Failed(e)) => {
                let body = serde_json::to_value(e.body()).unwrap_or_default();
                let error = &body["error"];
                out.push(json!({"type": "error", "message": error["message"],
                    "code": error["code"], "param": error["param"]}));
                if self.background {
                    // Kept for those who poll: the response failed, and why.
                    let error = json!({"code": error["code"], "message": error["message"]});
                    let object = self.finished(Status::Failed(error));
                    out.push(json!({"type": "response.failed", "response": object}));
                }
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
                let end = Status::ended_by(reason);
                out.extend(self.items.push(&delta, true, end.cut_short()));
                // OpenAI's stream has no event of its own for a stopped response: it ends
                // as incomplete, with the status saying why.
                let kind = match end.cut_short() {
                    true => "response.incomplete",
                    false => "response.completed",
                };
                out.push(json!({"type": kind, "response": self.finished(end)}));
                true
            }
            None => true,
        };
        for event in &mut out {
            event["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
        }
        (out, done)
    }

    /// The response object with `status`.
    fn object(&self, status: Status) -> Value {
        let (error, incomplete_details) = match &status {
            Status::Incomplete => (Value::Null, json!({"reason": "max_output_tokens"})),
            Status::Failed(error) => (error.clone(), Value::Null),
            _ => (Value::Null, Value::Null),
        };
        let ended = status.ended();
        let usage = ended.then(|| {
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
            "status": status.name(),
            "error": error,
            "incomplete_details": incomplete_details,
            "model": self.model,
            "output": if ended { json!(self.items.output) } else { json!([]) },
            "usage": usage,
            "tokenrouter": self.provenance.snapshot(),
        });
        for (key, value) in &self.echoed.0 {
            object[key] = value.clone();
        }
        object
    }
}

/// Where a response stands (OpenAI's `status`); `Failed` carries its `error` object.
enum Status {
    Queued,
    InProgress,
    Completed,
    Incomplete,
    Failed(Value),
    Cancelled,
}

impl Status {
    fn name(&self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Failed(_) => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    /// How an answer that finished with `reason` ends: `length` is incomplete (cut by
    /// `max_output_tokens`), `abort` cancelled (stopped through `/abort_request` or by the
    /// server), anything else completed.
    fn ended_by(reason: &str) -> Status {
        match reason {
            "length" => Status::Incomplete,
            "abort" => Status::Cancelled,
            _ => Status::Completed,
        }
    }

    /// The answer stopped before the model ended it.
    fn cut_short(&self) -> bool {
        matches!(self, Status::Incomplete | Status::Cancelled)
    }

    /// Whether the response is over (its output and usage are final).
    fn ended(&self) -> bool {
        !matches!(self, Status::Queued | Status::InProgress)
    }
}

/// A response event as sent: its type (the SSE event's name) and its JSON text.
pub struct SentEvent {
    kind: String,
    data: String,
}

impl SentEvent {
    pub fn of(event: &Value) -> Self {
        Self {
            kind: event["type"].as_str().unwrap_or("message").to_string(),
            data: event.to_string(),
        }
    }

    /// Bytes held.
    pub fn size(&self) -> usize {
        self.kind.len() + self.data.len()
    }
}

/// Response events as SSE, each named by its type.
pub fn sse(events: impl Stream<Item = Arc<SentEvent>> + Send + 'static) -> Response {
    let events = events
        .map(|event| Ok::<_, Infallible>(Event::default().event(&event.kind).data(&event.data)));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
