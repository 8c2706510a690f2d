//! Server-sent events for `stream: true`. Chunk order per response: content chunks (the
//! first chunk of a chat choice carries `role` together with the first text, never an empty
//! delta before it), each choice's finish chunk, then with `stream_options.include_usage`
//! a final chunk with `choices: []` and usage, then `data: [DONE]`. The SSE body owns the
//! [`Generation`]: a client that disconnects drops the body and thereby aborts the engine
//! requests.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};

use tokenrouter_api::TokenEvent;

use crate::generation::{ChoiceUpdate, Generation};
use crate::provenance::ProvenanceCounter;
use crate::reasoning::{ReasoningReader, Split};
use crate::render::{tool_finish, ResponseContext, SoFar};
use crate::tools::{Shown, ToolCallReader};

pub fn sse_response(ctx: ResponseContext, generation: Generation) -> Response {
    let provenance = ProvenanceCounter::new(ctx.names.clone());
    let state = SseState {
        started: vec![false; generation.num_choices],
        echoed: vec![false; generation.num_choices],
        tool_readers: (0..generation.num_choices)
            .map(|_| {
                ToolCallReader::new(ctx.tool_names.clone().unwrap_or_default())
                    .one_call_at_most(ctx.single_tool_call)
            })
            .collect(),
        reasoning_readers: (0..generation.num_choices)
            .map(|_| ctx.reasoning.map(ReasoningReader::new))
            .collect(),
        finished: 0,
        done: false,
        ctx,
        generation,
        provenance,
    };
    let events = stream::unfold(state, |mut state| async move {
        let events = state.next_events().await?;
        Some((events, state))
    })
    .flat_map(stream::iter)
    .map(Ok::<_, Infallible>);
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

struct SseState {
    ctx: ResponseContext,
    generation: Generation,
    provenance: ProvenanceCounter,
    /// Whether a chunk was already sent for each choice (the first one carries the role).
    started: Vec<bool>,
    /// Whether each choice's prompt was shown (`echo`).
    echoed: Vec<bool>,
    /// Each choice's tool calls, read as its text arrives (when the request reads them).
    tool_readers: Vec<ToolCallReader>,
    /// Each choice's thinking, read apart from its content first (`--reasoning-parser`).
    reasoning_readers: Vec<Option<ReasoningReader>>,
    finished: usize,
    done: bool,
}

impl SseState {
    /// The next events to send; `None` ends the stream.
    async fn next_events(&mut self) -> Option<Vec<Event>> {
        if self.done {
            return None;
        }
        let update = self.generation.next().await;
        let mut stop_reason = serde_json::Value::Null;
        let (index, mut delta, reason) = match update {
            Some(ChoiceUpdate::Prompt { index, scores }) => {
                return Some(self.echo_events(index, Some(&scores)));
            }
            Some(ChoiceUpdate::Delta { index, delta }) => (index, delta, None),
            Some(ChoiceUpdate::Finished {
                index,
                delta,
                reason,
                stopped_by,
            }) => {
                stop_reason = self.ctx.stop_reason(stopped_by.as_ref());
                (index, delta, Some(reason))
            }
            Some(ChoiceUpdate::Failed(err)) => {
                self.done = true;
                let body = serde_json::to_string(&err.body()).unwrap_or_default();
                return Some(vec![Event::default().data(body), done_event()]);
            }
            None => {
                self.done = true;
                let mut events = Vec::new();
                if self.ctx.include_usage {
                    let usage = self.generation.usage(self.provenance.completion_tokens());
                    let chunk = self.ctx.usage_chunk(usage, self.provenance.snapshot());
                    events.push(Event::default().data(chunk));
                }
                events.push(done_event());
                return Some(events);
            }
        };
        // A choice's prompt comes first (without scores when none were asked for).
        let mut events = self.echo_events(index, None);
        if self.ctx.prompt_only() {
            // The prompt alone: the generated token is dropped.
            delta = Default::default();
        }
        if reason.is_none() && delta.is_empty() {
            return Some(events);
        }
        self.provenance.add(index, &delta.tokens);
        let first = match self.started.get_mut(index) {
            Some(started) => !std::mem::replace(started, true),
            None => false,
        };
        let mut provenance = None;
        if reason.is_some() {
            self.finished += 1;
            if self.finished == self.generation.num_choices && !self.ctx.include_usage {
                provenance = Some(self.provenance.snapshot());
            }
        }
        let last = reason.is_some();
        let split = match self.reasoning_readers.get_mut(index) {
            Some(Some(reader)) => Some(reader.push(&delta.text, last)),
            _ => None,
        };
        let reads_reasoning = split.is_some();
        let Split { content, reasoning } = split.unwrap_or_else(|| Split {
            content: delta.text.clone(),
            reasoning: String::new(),
        });
        let (shown, reason) = match self.tool_readers.get_mut(index) {
            Some(reader) if self.ctx.tool_names.is_some() => {
                let mut shown = reader.push(&content, last);
                shown.reasoning = reasoning;
                (Some(shown), tool_finish(reason, reader.called()))
            }
            _ if reads_reasoning => {
                let shown = Shown {
                    content,
                    reasoning,
                    ..Shown::default()
                };
                (Some(shown), reason)
            }
            _ => (None, reason),
        };
        let so_far = SoFar {
            provenance,
            usage: self.generation.usage(self.provenance.completion_tokens()),
            stop_reason,
        };
        let chunk = self.ctx.chunk(index, first, &delta, shown, reason, so_far);
        events.push(Event::default().data(chunk));
        Some(events)
    }

    /// The chunk showing choice `index`'s prompt, once (`echo`; nothing otherwise).
    fn echo_events(&mut self, index: usize, scores: Option<&[TokenEvent]>) -> Vec<Event> {
        match self.echoed.get_mut(index) {
            Some(shown) if !*shown => {
                *shown = true;
                self.ctx
                    .echo_chunk(index, scores)
                    .map(|chunk| Event::default().data(chunk))
                    .into_iter()
                    .collect()
            }
            _ => Vec::new(),
        }
    }
}

fn done_event() -> Event {
    Event::default().data("[DONE]")
}
