//! SGLang's native answer shape for `POST /generate`: per prompt `{"text", "output_ids",
//! "meta_info"}` — `meta_info` with `id`, `finish_reason` (`{"type": "length", "length"}`,
//! `{"type": "stop", "matched"}` naming the stop string or id), the token counts,
//! `e2e_latency`, the log-probabilities asked for as `[logprob, id, text]` triples, and our
//! provenance (`tokens_by_model`, `switches`, `token_sources`, as the Python engine's).
//! Built from the same [`Generation`] updates as the OpenAI endpoints.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tokenrouter_api::{Backend, TokenEvent};

use crate::choice::{OutToken, StopMatch};
use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};

/// What the answers' shape depends on beyond the tokens.
pub struct Shape {
    /// Model names by index.
    pub names: Vec<String>,
    /// The request's id; a batch's answers are `{rid}_{i}`.
    pub rid: String,
    /// A batch is answered with a list, one prompt with an object.
    pub batch: bool,
    /// Log-probability entries carry their token's text (`return_text_in_logprobs`).
    pub text_in_logprobs: bool,
    /// Per prompt, the first prompt position whose score is returned (`logprob_start_len`).
    pub input_from: Vec<Option<usize>>,
    /// Per prompt, whether the output's log-probabilities are returned (`return_logprob`).
    pub output_logprobs: Vec<bool>,
    /// Per prompt, its first token (scored as `null`: nothing comes before it).
    pub first_prompt_ids: Vec<Option<u32>>,
    pub prompt_tokens: Vec<usize>,
    pub backend: Arc<dyn Backend>,
    pub arrival: Instant,
}

/// One prompt's answer so far. Log-probability entries are made once, as their tokens
/// arrive: a streamed answer is sent whole at every chunk.
#[derive(Default)]
struct Answer {
    text: String,
    tokens: Vec<OutToken>,
    finish_reason: Option<Value>,
    /// `output_token_logprobs` and `output_top_logprobs` so far (when asked for).
    output_logprobs: Vec<Value>,
    output_top_logprobs: Vec<Value>,
    /// `input_token_logprobs` and `input_top_logprobs` (when asked for, once scored).
    input_logprobs: Option<(Value, Value)>,
}

/// The answers of one `/generate` request, filled as its generation runs.
pub struct Answers {
    shape: Shape,
    generation: Generation,
    answers: Vec<Answer>,
}

impl Answers {
    pub fn new(shape: Shape, generation: Generation) -> Self {
        let answers = (0..generation.num_choices)
            .map(|_| Answer::default())
            .collect();
        Self {
            shape,
            generation,
            answers,
        }
    }

    /// Waits for every prompt's answer: an object, or a list for a batch.
    pub async fn collect(mut self) -> Result<Value, ApiError> {
        while let Some(progress) = self.advance().await {
            progress?;
        }
        let mut all: Vec<Value> = (0..self.answers.len()).map(|i| self.json(i)).collect();
        Ok(match (self.shape.batch, all.len()) {
            (false, 1) => all.remove(0),
            _ => Value::Array(all),
        })
    }

    /// The next streamed chunk: the answer so far of the prompt that progressed, with its
    /// `index`; `None` once all have finished.
    pub async fn next_chunk(&mut self) -> Option<Result<Value, ApiError>> {
        let index = match self.advance().await? {
            Ok(index) => index,
            Err(e) => return Some(Err(e)),
        };
        let mut chunk = self.json(index);
        chunk["index"] = json!(index);
        Some(Ok(chunk))
    }

    /// Applies the next update; the index of the answer it changed.
    async fn advance(&mut self) -> Option<Result<usize, ApiError>> {
        let (index, delta, finish) = match self.generation.next().await? {
            ChoiceUpdate::Failed(e) => return Some(Err(e)),
            ChoiceUpdate::Prompt { index, scores } => {
                let input = self.input_logprobs(index, &scores);
                if let Some(answer) = self.answers.get_mut(index) {
                    answer.input_logprobs = input;
                }
                return Some(Ok(index));
            }
            ChoiceUpdate::Delta { index, delta } => (index, delta, None),
            ChoiceUpdate::Finished {
                index,
                delta,
                reason,
                stopped_by,
            } => (
                index,
                delta,
                Some(self.finish_reason(index, reason, stopped_by)),
            ),
        };
        let wants_logprobs = self.shape.output_logprobs.get(index) == Some(&true);
        let (entries, tops): (Vec<Value>, Vec<Value>) = match wants_logprobs {
            true => delta
                .tokens
                .iter()
                .map(|t| {
                    (
                        self.entry(Some(t.event.logprob), t.event.id),
                        self.alternatives(&t.event),
                    )
                })
                .unzip(),
            false => Default::default(),
        };
        if let Some(answer) = self.answers.get_mut(index) {
            answer.text.push_str(&delta.text);
            answer.tokens.extend(delta.tokens);
            answer.output_logprobs.extend(entries);
            answer.output_top_logprobs.extend(tops);
            if finish.is_some() {
                answer.finish_reason = finish;
            }
        }
        Some(Ok(index))
    }

    /// Prompt `index`'s scored tokens from `logprob_start_len` on (the first prompt token's
    /// logprob `null`: nothing comes before it), and their alternatives; `None` unless asked.
    fn input_logprobs(&self, index: usize, scores: &[TokenEvent]) -> Option<(Value, Value)> {
        let from = self.shape.input_from.get(index).copied().flatten()?;
        let first = self.shape.first_prompt_ids.get(index).copied().flatten();
        let tokens = first.map(|id| self.entry(None, id)).into_iter();
        let tokens = tokens.chain(scores.iter().map(|s| self.entry(Some(s.logprob), s.id)));
        let tops = std::iter::once(Value::Null).chain(scores.iter().map(|s| self.alternatives(s)));
        Some((tokens.skip(from).collect(), tops.skip(from).collect()))
    }

    fn finish_reason(&self, index: usize, reason: &str, stopped_by: Option<StopMatch>) -> Value {
        match (reason, stopped_by) {
            ("length", _) => json!({
                "type": "length",
                "length": self.generation.max_tokens.get(index).copied().unwrap_or_default(),
            }),
            (_, Some(StopMatch::Text(text))) => json!({"type": "stop", "matched": text}),
            (_, Some(StopMatch::Token(id))) => json!({"type": "stop", "matched": id}),
            (other, None) => json!({"type": other}),
        }
    }

    /// Prompt `index`'s answer so far.
    fn json(&self, index: usize) -> Value {
        let answer = &self.answers[index];
        let shape = &self.shape;
        let ids: Vec<u32> = answer.tokens.iter().map(|t| t.event.id).collect();
        let sources: Vec<usize> = answer.tokens.iter().map(|t| t.event.source).collect();
        let name = |source: usize| shape.names.get(source).cloned().unwrap_or_default();
        let mut by_model: BTreeMap<String, usize> =
            shape.names.iter().map(|n| (n.clone(), 0)).collect();
        for &source in &sources {
            *by_model.entry(name(source)).or_default() += 1;
        }
        let id = match shape.batch {
            true => format!("{}_{index}", shape.rid),
            false => shape.rid.clone(),
        };
        let mut meta = json!({
            "id": id,
            "finish_reason": answer.finish_reason,
            "prompt_tokens": shape.prompt_tokens.get(index),
            "completion_tokens": ids.len(),
            "cached_tokens": self.generation.cached_tokens_of(index),
            "e2e_latency": shape.arrival.elapsed().as_secs_f64(),
            "tokens_by_model": by_model,
            "switches": sources.windows(2).filter(|w| w[0] != w[1]).count(),
            "token_sources": sources.iter().map(|&s| name(s)).collect::<Vec<_>>(),
        });
        if shape.output_logprobs.get(index) == Some(&true) {
            meta["output_token_logprobs"] = json!(answer.output_logprobs);
            meta["output_top_logprobs"] = json!(answer.output_top_logprobs);
        }
        if shape.input_from.get(index).copied().flatten().is_some() {
            // Scored before any token; empty until then (a prompt that failed to score).
            let (tokens, tops) = answer
                .input_logprobs
                .clone()
                .unwrap_or((json!([]), json!([])));
            meta["input_token_logprobs"] = tokens;
            meta["input_top_logprobs"] = tops;
        }
        json!({"text": answer.text, "output_ids": ids, "meta_info": meta})
    }

    /// `[logprob, id, text]` (the text `null` unless `return_text_in_logprobs`).
    fn entry(&self, logprob: Option<f32>, id: u32) -> Value {
        let text = self
            .shape
            .text_in_logprobs
            .then(|| self.shape.backend.decode(&[id], false).unwrap_or_default());
        json!([logprob, id, text])
    }

    /// A token's alternatives as entries, best first (`null` when none were asked for).
    fn alternatives(&self, event: &TokenEvent) -> Value {
        if event.top_logprobs.is_empty() {
            return Value::Null;
        }
        event
            .top_logprobs
            .iter()
            .map(|&(id, logprob)| self.entry(Some(logprob), id))
            .collect()
    }
}
