//! Answers a validated generation request: submits it, then either collects every choice
//! into one JSON body or hands the in-flight generation to the SSE streamer.

use std::time::Instant;

use axum::response::Response;

use crate::echo::Echo;
use crate::error::ApiError;
use crate::generation::{ChoiceUpdate, Generation};
use crate::params::GenerationPlan;
use crate::provenance::ProvenanceCounter;
use crate::render::{ChoiceOutput, Kind, ResponseContext};
use crate::state::AppState;
use crate::streaming;

/// Runs `plan` on `prompts` (token ids) and answers in the shape of `kind`.
pub async fn respond(
    state: &AppState,
    mut plan: GenerationPlan,
    kind: Kind,
    prompts: Vec<Vec<u32>>,
    arrival: Instant,
    echo: Option<Echo>,
) -> Result<Response, ApiError> {
    let generation = start(state, &mut plan, &prompts, arrival)?;
    let ctx = ResponseContext::new(kind, state.backend.clone(), &plan).with_echo(echo);
    if plan.stream {
        Ok(streaming::sse_response(ctx, generation))
    } else {
        collect(ctx, generation).await
    }
}

/// Submits `plan` on `prompts` (its `bad_words` tokenized first).
pub fn start(
    state: &AppState,
    plan: &mut GenerationPlan,
    prompts: &[Vec<u32>],
    arrival: Instant,
) -> Result<Generation, ApiError> {
    if !plan.bad_words.is_empty() {
        plan.tokenize_bad_words(state.backend.as_ref())?;
    }
    Generation::start(state, plan, prompts, arrival)
}

/// Waits for every choice; any failure fails the whole request (the other choices are
/// dropped, which aborts them in the engine).
async fn collect(ctx: ResponseContext, mut generation: Generation) -> Result<Response, ApiError> {
    let mut outputs: Vec<ChoiceOutput> = (0..generation.num_choices)
        .map(|_| ChoiceOutput::default())
        .collect();
    let mut provenance = ProvenanceCounter::new(ctx.names.clone());
    while let Some(update) = generation.next().await {
        let (index, delta, reason) = match update {
            ChoiceUpdate::Prompt { index, scores } => {
                if let Some(out) = outputs.get_mut(index) {
                    out.prompt_scores = Some(scores);
                }
                continue;
            }
            ChoiceUpdate::Delta { index, delta } => (index, delta, None),
            ChoiceUpdate::Finished {
                index,
                delta,
                reason,
                stopped_by,
            } => {
                if let Some(out) = outputs.get_mut(index) {
                    out.stop_reason = ctx.stop_reason(stopped_by.as_ref());
                }
                (index, delta, Some(reason))
            }
            ChoiceUpdate::Failed(err) => return Err(err),
        };
        // The prompt alone: the generated token is dropped, and not counted.
        if !ctx.prompt_only() {
            provenance.add(index, &delta.tokens);
        }
        if let Some(out) = outputs.get_mut(index) {
            out.text.push_str(&delta.text);
            out.tokens.extend(delta.tokens);
            if reason.is_some() {
                out.finish_reason = reason;
            }
        }
    }
    let usage = generation.usage(provenance.completion_tokens());
    Ok(ctx.full(outputs, usage, provenance.snapshot()))
}
