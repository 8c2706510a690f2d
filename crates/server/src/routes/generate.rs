//! SGLang's native `POST /generate`, which SGLang's own examples and clients (the research
//! system's among them) call: `text` or `input_ids`, one prompt or a batch; `sampling_params`
//! (one dict, or one per prompt; SGLang's keys, `crate::sglang`; `n` samples a prompt that
//! many times, answered as a list in SGLang's order); the log-probability fields
//! at the top level as SGLang has them; `stream` (SSE whose every chunk carries the text so
//! far, then `[DONE]`). The answer is `{"text", "output_ids", "meta_info"}`, a list for a
//! batch (`crate::native`). Our extension: `model` pins the request to one model.

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::extract::{parse_value, ApiJson};
use crate::generation::Generation;
use crate::native::{Answers, Shape};
use crate::params::GenerationPlan;
use crate::sglang::Params;
use crate::state::AppState;

/// `text`: one prompt or a batch.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Texts {
    One(String),
    Many(Vec<String>),
}

/// `input_ids`: one prompt's ids or a batch of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Ids {
    One(Vec<u32>),
    Many(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct GenerateBody {
    text: Option<Texts>,
    input_ids: Option<Ids>,
    /// One dict for every prompt, or one per prompt.
    sampling_params: Option<Value>,
    #[serde(default)]
    stream: bool,
    return_logprob: Option<bool>,
    logprob_start_len: Option<i64>,
    top_logprobs_num: Option<usize>,
    /// Each log-probability entry's token as text, not `null`.
    #[serde(default)]
    return_text_in_logprobs: bool,
    /// The request's id (`meta_info.id`); a batch's are `{rid}_{i}`.
    rid: Option<String>,
    /// Our extension: a configured model's name pins the request to it.
    model: Option<String>,
    /// SGLang's: the requests' priority under priority scheduling (lower first, vLLM's
    /// order, which SGLang's `--schedule-low-priority-values-first` gives).
    priority: Option<i64>,
    image_data: Option<Value>,
    input_embeds: Option<Value>,
}

pub async fn generate(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body: GenerateBody = parse_value(&body)?;
    let model = state.resolve_model(body.model.as_deref())?;
    state.check_ready()?;
    for (field, given) in [
        ("image_data", &body.image_data),
        ("input_embeds", &body.input_embeds),
    ] {
        if given.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                field,
                format!("`{field}` is not supported: the models read text"),
            ));
        }
    }
    let (prompts, batch) =
        read_prompts(&state, body.text, body.input_ids, model.context_length).await?;
    let top_level = LogprobFields {
        return_logprob: body.return_logprob,
        logprob_start_len: body.logprob_start_len,
        top_logprobs_num: body.top_logprobs_num,
    };
    let params = per_prompt_params(body.sampling_params, prompts.len(), &top_level)?;
    let n = params.first().map_or(1, |p| p.n);
    if params.iter().any(|p| p.n != n) {
        return Err(ApiError::invalid(
            "sampling_params",
            "every prompt's `n` must be the same",
        ));
    }
    if n > state.config.max_n {
        return Err(ApiError::invalid(
            "sampling_params",
            format!(
                "sampling_params: n must be at most {}, got {n}",
                state.config.max_n
            ),
        ));
    }
    // SGLang's order: the whole batch once per sample, sample i seeded `seed + i`.
    let samples: Vec<(Params, &Vec<u32>)> = (0..n)
        .flat_map(|i| {
            params
                .iter()
                .zip(&prompts)
                .map(move |(p, ids)| (p.sample(i), ids))
        })
        .collect();
    let priority = crate::params::priority(body.priority)?;
    let plans: Vec<GenerationPlan> = samples
        .iter()
        .map(|(p, _)| GenerationPlan {
            priority,
            ..p.plan(model.clone(), body.stream)
        })
        .collect();
    let items: Vec<(&GenerationPlan, &[u32])> = plans
        .iter()
        .zip(&samples)
        .map(|(plan, (_, ids))| (plan, ids.as_slice()))
        .collect();
    let rid = body
        .rid
        .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
    let abortable = state.aborts.register(&rid);
    let generation = Generation::start_each(&state, &items, arrival, Some(abortable))?;
    let shape = Shape {
        names: state.backend.models().into_iter().map(|m| m.name).collect(),
        rid,
        batch: batch || n > 1,
        text_in_logprobs: body.return_text_in_logprobs,
        input_from: samples
            .iter()
            .map(|(p, _)| p.input_logprobs.map(|i| i.start))
            .collect(),
        output_logprobs: samples.iter().map(|(p, _)| p.return_logprob).collect(),
        first_prompt_ids: samples
            .iter()
            .map(|(_, ids)| ids.first().copied())
            .collect(),
        prompt_tokens: samples.iter().map(|(_, ids)| ids.len()).collect(),
        backend: state.backend.clone(),
        arrival,
    };
    let answers = Answers::new(shape, generation);
    if body.stream {
        Ok(stream_response(answers))
    } else {
        answers
            .collect()
            .await
            .map(|json| Json(json).into_response())
    }
}

/// The prompts' ids (text tokenized on the blocking pool) and whether they came as a batch.
async fn read_prompts(
    state: &AppState,
    text: Option<Texts>,
    input_ids: Option<Ids>,
    context: usize,
) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let (prompts, batch) = match (text, input_ids) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "input_ids",
                "give `text` or `input_ids`, not both",
            ))
        }
        (None, None) => return Err(ApiError::MissingField("text".into())),
        (Some(Texts::One(t)), None) => (vec![state.encode_prompt(t, context).await?], false),
        (Some(Texts::Many(texts)), None) => {
            let mut ids = Vec::with_capacity(texts.len());
            for t in texts {
                ids.push(state.encode_prompt(t, context).await?);
            }
            (ids, true)
        }
        (None, Some(Ids::One(ids))) => (vec![ids], false),
        (None, Some(Ids::Many(batch))) => (batch, true),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("text", "the batch is empty"));
    }
    Ok((prompts, batch))
}

/// SGLang's top-level log-probability fields, which apply to every prompt.
struct LogprobFields {
    return_logprob: Option<bool>,
    logprob_start_len: Option<i64>,
    top_logprobs_num: Option<usize>,
}

/// Each prompt's parameters: one dict for all, or a list with one per prompt; the
/// top-level log-probability fields go into each (where the dict does not set them).
fn per_prompt_params(
    given: Option<Value>,
    prompts: usize,
    top: &LogprobFields,
) -> Result<Vec<Params>, ApiError> {
    let dicts: Vec<Value> = match given {
        None | Some(Value::Null) => vec![Value::Object(Map::new()); prompts],
        Some(Value::Array(list)) if list.len() == prompts => list,
        Some(Value::Array(list)) => {
            return Err(ApiError::invalid(
                "sampling_params",
                format!(
                    "{} sampling_params for {prompts} prompts: give one dict, or one per prompt",
                    list.len()
                ),
            ))
        }
        Some(one) => vec![one; prompts],
    };
    dicts
        .into_iter()
        .map(|dict| {
            let Value::Object(mut map) = dict else {
                return Err(ApiError::invalid(
                    "sampling_params",
                    "sampling_params must be a dict (or a list of dicts)",
                ));
            };
            let fields = [
                ("return_logprob", top.return_logprob.map(Value::from)),
                ("logprob_start_len", top.logprob_start_len.map(Value::from)),
                ("top_logprobs_num", top.top_logprobs_num.map(Value::from)),
            ];
            for (key, value) in fields {
                if let Some(value) = value {
                    map.entry(key).or_insert(value);
                }
            }
            Params::from_json(&Value::Object(map).to_string())
                .map_err(|message| ApiError::invalid("sampling_params", message))
        })
        .collect()
}

/// SSE: one event per update of any prompt, each carrying that prompt's text so far
/// (SGLang's shape), an error as an `error` event, then `[DONE]`.
fn stream_response(answers: Answers) -> Response {
    let events = stream::unfold(Some(answers), |answers| async move {
        let mut answers = answers?;
        match answers.next_chunk().await {
            Some(Ok(chunk)) => Some((Event::default().data(chunk.to_string()), Some(answers))),
            Some(Err(error)) => {
                let body = serde_json::json!({"error": {"message": error.to_string()}});
                Some((Event::default().data(body.to_string()), None))
            }
            None => Some((Event::default().data("[DONE]"), None)),
        }
    })
    .map(Ok::<_, Infallible>);
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
