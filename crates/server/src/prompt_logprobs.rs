//! vLLM's `prompt_logprobs`: the log-probability of every prompt token under the model
//! that read it, each position a map from token id to `{logprob, rank, decoded_token}`
//! holding the prompt's token and the `k` most likely ones (the first position `null`:
//! nothing before it). Scored by the engine as `echo` with `logprobs` is (one model's
//! numbers, so a pinned model only); shown per choice on completions and once at the top
//! of a chat response, as vLLM shows them.

use serde::Serialize;
use serde_json::{Map, Value};
use tokenrouter_api::TokenEvent;

use crate::error::ApiError;
use crate::params::GenerationPlan;
use crate::state::AppState;

/// One candidate at one prompt position.
#[derive(Debug, Serialize)]
struct Candidate {
    logprob: f32,
    /// 1-based rank among the model's logits at that position.
    rank: Option<u32>,
    decoded_token: String,
}

/// Checks the request's `prompt_logprobs` (`value`) and has `plan` score and show them.
pub fn ask(
    plan: &mut GenerationPlan,
    value: Option<i64>,
    state: &AppState,
) -> Result<(), ApiError> {
    let Some(k) = value else { return Ok(()) };
    let max = state.config.max_top_logprobs;
    let k = match usize::try_from(k) {
        Ok(k) if k <= max => k,
        _ => {
            return Err(ApiError::invalid(
                PARAM,
                format!("`prompt_logprobs` must be between 0 and {max}, got {k}"),
            ))
        }
    };
    if plan.stream {
        return Err(ApiError::invalid(
            PARAM,
            "`prompt_logprobs` are not available when `stream` is true",
        ));
    }
    if plan.model.pinned.is_none() {
        let names: Vec<String> = state.backend.models().into_iter().map(|m| m.name).collect();
        return Err(ApiError::invalid(
            PARAM,
            format!(
                "`prompt_logprobs` scores the prompt with one model (a routed request's prompt \
                 is read by its entry model alone): set `model` to one of {}",
                names.join(", ")
            ),
        ));
    }
    plan.score_prompt(k);
    plan.shown_prompt_logprobs = Some(k);
    Ok(())
}

const PARAM: &str = "prompt_logprobs";

/// The response field for a prompt scored as `scores` (one entry per token after the
/// first), `k` alternatives a position; `decode` gives a token's text.
pub fn render(
    scores: &[TokenEvent],
    k: usize,
    decode: impl Fn(u32) -> String,
) -> Vec<Option<Map<String, Value>>> {
    let mut out = Vec::with_capacity(scores.len() + 1);
    out.push(None);
    for s in scores {
        let mut position = Map::new();
        let mut add = |id: u32, logprob: f32, rank: Option<u32>| {
            if let serde_json::map::Entry::Vacant(slot) = position.entry(id.to_string()) {
                let c = Candidate {
                    logprob,
                    rank,
                    decoded_token: decode(id),
                };
                if let Ok(v) = serde_json::to_value(c) {
                    slot.insert(v);
                }
            }
        };
        let rank = s.rank.or_else(|| {
            let i = s.top_logprobs.iter().position(|&(id, _)| id == s.id)?;
            u32::try_from(i + 1).ok()
        });
        add(s.id, s.logprob, rank);
        for (i, &(id, logprob)) in s.top_logprobs.iter().take(k).enumerate() {
            add(id, logprob, u32::try_from(i + 1).ok());
        }
        out.push(Some(position));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(id: u32, logprob: f32, rank: u32, top: &[(u32, f32)]) -> TokenEvent {
        TokenEvent {
            id,
            source: 0,
            logprob,
            top_logprobs: top.to_vec(),
            router_score: None,
            rank: Some(rank),
        }
    }

    #[test]
    fn positions_hold_the_prompt_token_and_the_top_k() {
        let scores = [
            score(7, -0.1, 1, &[(7, -0.1), (3, -2.5), (9, -3.0)]),
            score(4, -5.0, 12, &[(1, -0.2), (2, -1.9), (5, -2.2)]),
        ];
        let out = render(&scores, 2, |id| format!("t{id}"));
        assert_eq!(out.len(), 3);
        assert!(out[0].is_none());
        let first = out[1].as_ref().unwrap();
        // The prompt token is among the top two: two entries.
        assert_eq!(first.len(), 2);
        assert_eq!(first["7"]["rank"], 1);
        assert_eq!(first["3"]["rank"], 2);
        assert_eq!(first["3"]["decoded_token"], "t3");
        let second = out[2].as_ref().unwrap();
        assert_eq!(second.len(), 3);
        assert_eq!(second["4"]["rank"], 12);
        assert_eq!(second["4"]["logprob"], -5.0);
        assert_eq!(second["1"]["rank"], 1);
        assert!(!second.contains_key("5"));
        // k = 0: the prompt token alone.
        let only = render(&scores, 0, |id| id.to_string());
        assert_eq!(only[2].as_ref().unwrap().len(), 1);
    }
}
