//! llama.cpp's native endpoints: `POST /completion` (also `/completions`), which llama.cpp's
//! scripts and UIs call, `POST /infill`, the fill-in-the-middle call of editor plugins
//! (llama.vscode, llama.vim), and `GET /props`, what its web UI reads first. Bodies in
//! `crate::llamacpp`, answers in `crate::llamacpp::answer`, the FIM prompt in `crate::fim`.

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::extract::{parse_value, ApiJson};
use crate::fim::{self, ExtraFile, InfillIds};
use crate::generation::Generation;
use crate::llamacpp::answer::{Answers, Shape};
use crate::llamacpp::{self, Body};
use crate::params::GenerationPlan;
use crate::state::AppState;

pub async fn completion(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body: Body = parse_value(&body)?;
    let plan = plan(&state, &body)?;
    let context = plan.model.context_length;
    let mut prompts = Vec::new();
    for pieces in llamacpp::prompts(body.prompt.as_ref())? {
        prompts.push(llamacpp::encode(&state, pieces, context).await?);
    }
    run(&state, plan, &body, prompts, arrival).await
}

pub async fn infill(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let body: Body = parse_value(&body)?;
    let mut plan = plan(&state, &body)?;
    let tokens = state.fim_tokens().ok_or_else(|| {
        ApiError::invalid(
            "input_prefix",
            "infill is not supported by this model: its tokenizer has no fill-in-the-middle \
             tokens",
        )
    })?;
    plan.fill_in_the_middle(&tokens, state.backend.as_ref());
    let context = plan.model.context_length;
    let request = InfillText::read(&body)?;
    state.check_prompt_size(request.bytes(), context)?;
    let backend = state.backend.clone();
    let ids = tokio::task::spawn_blocking(move || request.encode(backend.as_ref()))
        .await
        .map_err(|e| ApiError::Engine(format!("tokenizer task: {e}")))??;
    // Room for the answer: what `n_predict` asks, else a quarter of the context.
    let max_new = plan.max_tokens.unwrap_or(context / 4);
    let prompt = fim::assemble(&tokens, &ids, context, max_new);
    run(&state, plan, &body, vec![prompt], arrival).await
}

/// llama.cpp's `GET /props`: the routed model's context, the sampling a request gets by
/// default (llama.cpp's defaults), the model file, modalities (text only) and the build.
pub async fn props(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let body: Body = parse_value(&json!({}))?;
    let plan = plan(&state, &body)?;
    let models = state.backend.models();
    let model_path = models.first().map(|m| m.source.clone()).unwrap_or_default();
    Ok(Json(json!({
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": plan.model.context_length,
            "speculative": false,
            "is_processing": false,
            "params": settings(&plan, &body),
        },
        "model_alias": state.config.served_model_name,
        "model_path": model_path,
        "models": models,
        "modalities": {"vision": false, "audio": false},
        "infill": state.fim_tokens().is_some(),
        "build_info": format!("tokenrouter {}", env!("CARGO_PKG_VERSION")),
    })))
}

/// The request's model, once the server is ready, and the plan its prompts share.
fn plan(state: &AppState, body: &Body) -> Result<GenerationPlan, ApiError> {
    let model = state.resolve_model(body.model.as_deref())?;
    state.check_ready()?;
    body.plan(model, state.backend.as_ref(), state.config.max_top_logprobs)
}

/// `/infill`'s text fields, checked as llama.cpp checks them.
struct InfillText {
    prefix: String,
    suffix: String,
    extra: Vec<ExtraFile>,
    prompt: String,
}

impl InfillText {
    fn read(body: &Body) -> Result<Self, ApiError> {
        let text = |field: &'static str, value: &Option<Value>| match value {
            None => Err(ApiError::MissingField(field.into())),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(ApiError::invalid(
                field,
                format!("`{field}` must be a string"),
            )),
        };
        let prompt = match &body.prompt {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    "prompt",
                    "`prompt` must be a string on /infill",
                ))
            }
        };
        let bad_extra = || {
            ApiError::invalid(
                "input_extra",
                "`input_extra` must be a list of {\"filename\": string, \"text\": string}",
            )
        };
        let extra = match &body.input_extra {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(chunks)) => chunks
                .iter()
                .map(|chunk| {
                    let chunk = chunk.as_object().ok_or_else(bad_extra)?;
                    let field = |key: &str, default: &str| match chunk.get(key) {
                        None => Ok(default.to_string()),
                        Some(Value::String(s)) => Ok(s.clone()),
                        Some(_) => Err(bad_extra()),
                    };
                    Ok(ExtraFile {
                        filename: field("filename", "tmp")?,
                        text: field("text", "")?,
                    })
                })
                .collect::<Result<_, ApiError>>()?,
            Some(_) => return Err(bad_extra()),
        };
        Ok(Self {
            prefix: text("input_prefix", &body.input_prefix)?,
            suffix: text("input_suffix", &body.input_suffix)?,
            extra,
            prompt,
        })
    }

    fn bytes(&self) -> usize {
        let extra: usize = self
            .extra
            .iter()
            .map(|f| f.filename.len() + f.text.len())
            .sum();
        self.prefix.len() + self.suffix.len() + self.prompt.len() + extra
    }

    /// Every part tokenized on its own, as llama.cpp does (runs on the blocking pool).
    fn encode(&self, backend: &dyn tokenrouter_api::Backend) -> Result<InfillIds, ApiError> {
        let encode = |text: &str| -> Result<Vec<u32>, ApiError> {
            match text.is_empty() {
                true => Ok(Vec::new()),
                false => backend.encode(text).map_err(ApiError::from),
            }
        };
        Ok(InfillIds {
            prefix: encode(&self.prefix)?,
            suffix: encode(&self.suffix)?,
            extra: self
                .extra
                .iter()
                .map(|f| Ok((encode(&format!("{}\n", f.filename))?, encode(&f.text)?)))
                .collect::<Result<_, ApiError>>()?,
            repo_name: encode(fim::REPO_NAME)?,
            current_file: encode(fim::CURRENT_FILE)?,
            snippet_separator: encode(fim::SNIPPET_SEPARATOR)?,
            middle_start: encode(&self.prompt)?,
        })
    }
}

/// Starts the prompts and answers in llama.cpp's shape, whole or streamed.
async fn run(
    state: &AppState,
    plan: GenerationPlan,
    body: &Body,
    prompts: Vec<Vec<u32>>,
    arrival: Instant,
) -> Result<Response, ApiError> {
    let settings = settings(&plan, body);
    let generation = Generation::start(state, &plan, &prompts, arrival)?;
    let shape = Shape {
        model: plan.model.name.clone(),
        names: state.backend.models().into_iter().map(|m| m.name).collect(),
        batch: prompts.len() > 1,
        stream: plan.stream,
        return_tokens: body.return_tokens.unwrap_or(false),
        n_probs: plan.logprobs,
        prompts,
        response_fields: body.response_fields.clone(),
        settings,
        backend: state.backend.clone(),
        arrival,
    };
    let answers = Answers::new(shape, generation);
    if !plan.stream {
        return answers.collect().await.map(|j| Json(j).into_response());
    }
    // One SSE event per update; the final answer last; an error as an `error` object.
    let events = stream::unfold(Some(answers), |answers| async move {
        let mut answers = answers?;
        match answers.next_events().await? {
            Ok(events) => {
                let events: Vec<Event> = events
                    .into_iter()
                    .map(|e| Event::default().data(e.to_string()))
                    .collect();
                Some((stream::iter(events), Some(answers)))
            }
            Err(error) => {
                let body = json!({"error": {"message": error.to_string(), "code": error.status().as_u16()}});
                Some((stream::iter(vec![Event::default().data(body.to_string())]), None))
            }
        }
    })
    .flatten()
    .map(Ok::<_, Infallible>);
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `generation_settings`: the sampling the answer was written under.
fn settings(plan: &GenerationPlan, body: &Body) -> Value {
    let s = &plan.sampling;
    let mut settings = json!({
        "n_predict": plan.max_tokens.map_or(-1, |n| n as i64),
        "seed": s.seed.map_or(-1, |seed| seed as i64),
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repetition_penalty,
        "repeat_last_n": match s.penalty_last_n {
            Some(usize::MAX) => -1,
            Some(n) => n as i64,
            None => -1,
        },
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "stop": body.stop.clone().unwrap_or_default(),
        "ignore_eos": plan.ignore_eos,
        "n_probs": plan.logprobs.unwrap_or(0),
        "stream": plan.stream,
        "logit_bias": s.logit_bias.iter().map(|&(id, b)| json!([id, b])).collect::<Vec<_>>(),
    });
    if let Value::Object(map) = &mut settings {
        map.extend(crate::llama_samplers::settings(s.llama.as_ref()));
    }
    settings
}
