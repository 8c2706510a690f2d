//! llama.cpp's answer shape for `/completion` and `/infill`: per prompt `{"content",
//! "tokens", "stop", "model", "tokens_predicted", "tokens_evaluated", "generation_settings",
//! "prompt", "has_new_line", "truncated", "stop_type", "stopping_word", "tokens_cached",
//! "timings", "completion_probabilities"}` plus our `tokenrouter` provenance. Streamed, each
//! update is `{"content", "tokens", "stop": false, …}` with the new text only, and the last
//! event is the final answer with empty `content` (no `[DONE]`, as llama.cpp ends it).
//! Built from the same [`Generation`] updates as the other endpoints.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tokenrouter_api::{Backend, TokenEvent};

use crate::choice::{OutToken, StopMatch};
use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};
use crate::provenance::ProvenanceCounter;

/// What the answers' shape depends on beyond the tokens.
pub struct Shape {
    /// The name the request was served under (`model`).
    pub model: String,
    /// Model names by index, for provenance.
    pub names: Vec<String>,
    /// A batch of prompts is answered with a list.
    pub batch: bool,
    pub stream: bool,
    /// `tokens` carries the ids (`return_tokens`).
    pub return_tokens: bool,
    /// `completion_probabilities` with this many alternatives (`n_probs`).
    pub n_probs: Option<usize>,
    /// Each prompt's ids (`tokens_evaluated`, `prompt`).
    pub prompts: Vec<Vec<u32>>,
    /// The final answer reduced to these paths (`response_fields`).
    pub response_fields: Option<Vec<String>>,
    /// `generation_settings`: the request's sampling as applied.
    pub settings: Value,
    pub backend: Arc<dyn Backend>,
    pub arrival: Instant,
}

/// One prompt's answer so far.
struct Answer {
    content: String,
    tokens: Vec<OutToken>,
    probabilities: Vec<Value>,
    provenance: ProvenanceCounter,
    /// (`stop_type`, `stopping_word`) once it has ended.
    end: Option<(&'static str, String)>,
    first_token_at: Option<Instant>,
    ended_at: Option<Instant>,
}

/// The answers of one request, filled as its generation runs.
pub struct Answers {
    shape: Shape,
    generation: Generation,
    answers: Vec<Answer>,
}

impl Answers {
    pub fn new(shape: Shape, generation: Generation) -> Self {
        let answers = (0..generation.num_choices)
            .map(|_| Answer {
                content: String::new(),
                tokens: Vec::new(),
                probabilities: Vec::new(),
                provenance: ProvenanceCounter::new(shape.names.clone()),
                end: None,
                first_token_at: None,
                ended_at: None,
            })
            .collect();
        Self {
            shape,
            generation,
            answers,
        }
    }

    /// Waits for every prompt's final answer: an object, or a list for a batch.
    pub async fn collect(mut self) -> Result<Value, ApiError> {
        while let Some(update) = self.generation.next().await {
            self.apply(update)?;
        }
        let mut all: Vec<Value> = (0..self.answers.len()).map(|i| self.last(i)).collect();
        Ok(match (self.shape.batch, all.len()) {
            (false, 1) => all.remove(0),
            _ => Value::Array(all),
        })
    }

    /// The next streamed events: a partial answer with the new text, and the final answer
    /// when that prompt ended; `None` once all have ended.
    pub async fn next_events(&mut self) -> Option<Result<Vec<Value>, ApiError>> {
        loop {
            let update = self.generation.next().await?;
            let news = match self.apply(update) {
                Ok(Some(news)) => news,
                Ok(None) => continue,
                Err(e) => return Some(Err(e)),
            };
            let mut events = Vec::new();
            if !news.text.is_empty() || news.tokens_from < self.answers[news.index].tokens.len() {
                events.push(self.partial(&news));
            }
            if self.answers[news.index].end.is_some() {
                events.push(self.last(news.index));
            }
            if !events.is_empty() {
                return Some(Ok(events));
            }
        }
    }

    /// Applies one update; what it added to which answer (`None`: nothing to show).
    fn apply(&mut self, update: ChoiceUpdate) -> Result<Option<News>, ApiError> {
        let (index, delta, end) = match update {
            ChoiceUpdate::Failed(e) => return Err(e),
            ChoiceUpdate::Prompt { .. } => return Ok(None),
            ChoiceUpdate::Delta { index, delta } => (index, delta, None),
            ChoiceUpdate::Finished {
                index,
                delta,
                reason,
                stopped_by,
            } => (index, delta, Some(stop_type(reason, stopped_by))),
        };
        let probabilities: Vec<Value> = match self.shape.n_probs {
            Some(_) => delta
                .tokens
                .iter()
                .map(|t| self.probability(&t.event))
                .collect(),
            None => Vec::new(),
        };
        let now = Instant::now();
        let Some(answer) = self.answers.get_mut(index) else {
            return Ok(None);
        };
        let news = News {
            index,
            text: delta.text.clone(),
            tokens_from: answer.tokens.len(),
            probabilities_from: answer.probabilities.len(),
        };
        if !delta.tokens.is_empty() && answer.first_token_at.is_none() {
            answer.first_token_at = Some(now);
        }
        answer.content.push_str(&delta.text);
        answer.provenance.add(0, &delta.tokens);
        answer.tokens.extend(delta.tokens);
        answer.probabilities.extend(probabilities);
        if end.is_some() {
            answer.end = end;
            answer.ended_at = Some(now);
        }
        Ok(Some(news))
    }

    /// A streamed update of one answer: its new text and tokens.
    fn partial(&self, news: &News) -> Value {
        let answer = &self.answers[news.index];
        let ids = match self.shape.return_tokens {
            true => answer.tokens[news.tokens_from..]
                .iter()
                .map(|t| t.event.id)
                .collect(),
            false => Vec::new(),
        };
        let mut out = json!({
            "index": news.index,
            "content": news.text,
            "tokens": ids,
            "stop": false,
            "id_slot": -1,
            "tokens_predicted": answer.tokens.len(),
            "tokens_evaluated": self.prompt_len(news.index),
        });
        if self.shape.n_probs.is_some() {
            out["completion_probabilities"] =
                json!(answer.probabilities[news.probabilities_from..]);
        }
        out
    }

    /// Prompt `index`'s final answer (streamed: without the text and probabilities already
    /// sent), reduced to `response_fields` when given.
    fn last(&self, index: usize) -> Value {
        let answer = &self.answers[index];
        let shape = &self.shape;
        let (stop_type, stopping_word) = answer.end.clone().unwrap_or(("none", String::new()));
        let prompt = shape.prompts.get(index).map_or(&[][..], Vec::as_slice);
        let ids: Vec<u32> = match shape.return_tokens && !shape.stream {
            true => answer.tokens.iter().map(|t| t.event.id).collect(),
            false => Vec::new(),
        };
        let predicted = answer.tokens.len();
        let mut out = json!({
            "index": index,
            "content": if shape.stream { "" } else { answer.content.as_str() },
            "tokens": ids,
            "id_slot": -1,
            "stop": true,
            "model": shape.model,
            "tokens_predicted": predicted,
            "tokens_evaluated": prompt.len(),
            "generation_settings": shape.settings,
            "prompt": shape.backend.decode(prompt, false).unwrap_or_default(),
            "has_new_line": answer.content.contains('\n'),
            "truncated": false,
            "stop_type": stop_type,
            "stopping_word": stopping_word,
            "tokens_cached": prompt.len() + predicted.saturating_sub(1),
            "timings": self.timings(index),
            "tokenrouter": answer.provenance.snapshot(),
        });
        if shape.n_probs.is_some() && !shape.stream {
            out["completion_probabilities"] = json!(answer.probabilities);
        }
        match &shape.response_fields {
            Some(paths) if !paths.is_empty() => super::select_fields(&out, paths),
            _ => out,
        }
    }

    /// llama.cpp's `timings`: the prompt's part up to the first token (queueing included),
    /// the rest for the tokens after it.
    fn timings(&self, index: usize) -> Value {
        let answer = &self.answers[index];
        let cached = self.generation.cached_tokens_of(index);
        let prompt_n = self.prompt_len(index).saturating_sub(cached);
        let first = answer.first_token_at.unwrap_or(self.shape.arrival);
        let end = answer.ended_at.unwrap_or_else(Instant::now);
        let prompt_ms = first.duration_since(self.shape.arrival).as_secs_f64() * 1e3;
        let predicted_n = answer.tokens.len();
        let predicted_ms = end.duration_since(first).as_secs_f64() * 1e3;
        let per = |ms: f64, n: usize| if n == 0 { 0.0 } else { ms / n as f64 };
        let rate = |ms: f64, n: usize| if ms > 0.0 { 1e3 * n as f64 / ms } else { 0.0 };
        json!({
            "cache_n": cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": per(prompt_ms, prompt_n),
            "prompt_per_second": rate(prompt_ms, prompt_n),
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": per(predicted_ms, predicted_n),
            "predicted_per_second": rate(predicted_ms, predicted_n),
        })
    }

    fn prompt_len(&self, index: usize) -> usize {
        self.shape.prompts.get(index).map_or(0, Vec::len)
    }

    /// A token's `completion_probabilities` entry: `{"id", "token", "logprob", "bytes",
    /// "top_logprobs"}` (llama.cpp's shape without `post_sampling_probs`).
    fn probability(&self, event: &TokenEvent) -> Value {
        let mut entry = self.token_entry(event.id, event.logprob);
        entry["top_logprobs"] = event
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| self.token_entry(id, logprob))
            .collect();
        entry
    }

    fn token_entry(&self, id: u32, logprob: f32) -> Value {
        let text = self.shape.backend.decode(&[id], false).unwrap_or_default();
        json!({"id": id, "token": text, "logprob": logprob, "bytes": text.as_bytes()})
    }
}

/// What one update added to an answer.
struct News {
    index: usize,
    text: String,
    tokens_from: usize,
    probabilities_from: usize,
}

/// llama.cpp's `stop_type` and `stopping_word` of a finish.
fn stop_type(reason: &str, stopped_by: Option<StopMatch>) -> (&'static str, String) {
    match (reason, stopped_by) {
        ("length", _) => ("limit", String::new()),
        ("stop", Some(StopMatch::Text(word))) => ("word", word),
        ("stop", _) => ("eos", String::new()),
        _ => ("none", String::new()),
    }
}
