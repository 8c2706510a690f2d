//! `POST /v1/completions`: a raw prompt (text, token ids, or a batch of either) →
//! generation. Choice `p * n + i` is the i-th sample of prompt p, as in OpenAI. With
//! `echo` each choice starts with its prompt (see `echo.rs`). With `suffix` the prompt is
//! the text before an insertion and the model writes what goes between (`crate::fim`).

use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::Value;

use crate::echo::{Echo, EchoedPrompt};
use crate::error::ApiError;
use crate::extract::{parse_value, ApiJson};
use crate::openai::request::{CommonFields, CompletionFields, PromptField};
use crate::params::{completion_logprobs, GenerationPlan};
use crate::prompt_logprobs;
use crate::render::Kind;
use crate::respond::respond;
use crate::state::AppState;

pub async fn completions(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let common: CommonFields = parse_value(&body)?;
    let fields: CompletionFields = parse_value(&body)?;
    let model = state.resolve_model(common.model.as_deref())?;
    state.check_ready()?;
    let echo = fields.echo.unwrap_or(false);
    let suffix = fields.suffix.filter(|s| !s.is_empty());
    let fim = match &suffix {
        None => None,
        Some(_) if echo => {
            return Err(ApiError::invalid(
                "echo",
                "`echo` cannot be combined with `suffix`",
            ))
        }
        Some(_) => Some(state.fim_tokens().ok_or_else(|| {
            ApiError::invalid(
                "suffix",
                "`suffix` needs a model with fill-in-the-middle tokens; this tokenizer has none",
            )
        })?),
    };
    // `max_tokens: 0` with `echo`: the prompt alone (one token is generated and dropped).
    let prompt_only = echo && common.max_tokens == Some(0);
    let max_tokens = common
        .max_tokens
        .map(|m| (if prompt_only { 1 } else { m }, "max_tokens"));
    let logprobs = completion_logprobs(fields.logprobs, &state.config)?;
    if echo && logprobs.is_some() && model.pinned.is_none() {
        let names: Vec<String> = state.backend.models().into_iter().map(|m| m.name).collect();
        return Err(ApiError::invalid(
            "echo",
            format!(
                "`echo` with `logprobs` scores the prompt with one model (a routed request's \
                 prompt is read by its entry model alone): set `model` to one of {}",
                names.join(", ")
            ),
        ));
    }
    let shown_prompt_logprobs = common.prompt_logprobs;
    let mut plan = GenerationPlan::new(common, model, max_tokens, logprobs, &state.config)?;
    if let (true, Some(k)) = (echo, logprobs) {
        plan.score_prompt(k);
    }
    prompt_logprobs::ask(&mut plan, shown_prompt_logprobs, &state)?;
    let context = plan.model.context_length;
    if let Some(tokens) = &fim {
        plan.fill_in_the_middle(tokens, state.backend.as_ref());
    }
    // Each prompt's ids, and its text when it came as text (what `echo` shows).
    let prompts: Vec<(Vec<u32>, Option<String>)> = match fields.prompt {
        PromptField::Text(text) => vec![(
            state.encode_prompt(text.clone(), context).await?,
            Some(text),
        )],
        PromptField::Texts(texts) => {
            let mut out = Vec::with_capacity(texts.len());
            for t in texts {
                out.push((state.encode_prompt(t.clone(), context).await?, Some(t)));
            }
            out
        }
        PromptField::Tokens(ids) => vec![(ids, None)],
        PromptField::TokenBatches(batches) => batches.into_iter().map(|ids| (ids, None)).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    // A truncated prompt is echoed as the model reads it: its kept ids, decoded.
    let prompts: Vec<(Vec<u32>, Option<String>)> = prompts
        .into_iter()
        .map(|(mut ids, text)| {
            let whole = ids.len();
            plan.truncate_prompt(&mut ids, context);
            let text = text.filter(|_| ids.len() == whole);
            (ids, text)
        })
        .collect();
    let echo = match echo {
        true => Some(echoed(&state, &prompts, plan.n, prompt_only)?),
        false => None,
    };
    let mut ids: Vec<Vec<u32>> = prompts.into_iter().map(|(ids, _)| ids).collect();
    if let (Some(tokens), Some(suffix)) = (&fim, suffix) {
        // The prompt is the text before the cursor: `[PRE]prompt[SUF]suffix[MID]`.
        let suffix = state.encode_prompt(suffix, context).await?;
        for prompt in &mut ids {
            let mut wrapped = Vec::with_capacity(prompt.len() + suffix.len() + 3);
            wrapped.push(tokens.prefix);
            wrapped.append(prompt);
            wrapped.push(tokens.suffix);
            wrapped.extend(&suffix);
            wrapped.push(tokens.middle);
            *prompt = wrapped;
        }
    }
    respond(&state, plan, Kind::Completion, ids, arrival, echo).await
}

/// What `echo` shows of each prompt: its text as given, or its ids decoded (special
/// tokens kept).
fn echoed(
    state: &AppState,
    prompts: &[(Vec<u32>, Option<String>)],
    n: usize,
    prompt_only: bool,
) -> Result<Echo, ApiError> {
    let decode = |ids: &[u32]| state.backend.decode(ids, false);
    let failed = |e| ApiError::invalid("prompt", format!("the prompt cannot be detokenized: {e}"));
    let mut out = Vec::with_capacity(prompts.len());
    for (ids, text) in prompts {
        let text = match text {
            Some(t) => t.clone(),
            None => decode(ids).map_err(failed)?,
        };
        out.push(EchoedPrompt::new(text, ids.clone(), decode).map_err(failed)?);
    }
    Ok(Echo::new(out, n, prompt_only))
}
