//! Prompt scoring (`echo` with `logprobs` on `/v1/completions`, how lm-eval asks for
//! log-likelihoods): before a request that asks for it joins its first step, the prompt is
//! prefilled here in chunks with every position's logits, and each prompt token's
//! log-probability after the tokens before it (with the top alternatives) is sent to the
//! client in one event. The KV stays, so the request's first step recomputes only its
//! last position to sample from.

use super::{Outbound, SubServer};
use tokenrouter_api::{ModelIndex, TokenEvent};
use tokenrouter_runtime::sampling::{log_sum_exp, logprob_and_top};
use tokenrouter_runtime::{Row, RuntimeError, StepOptions};

/// Prompt tokens scored per forward pass: every position's logits are held at once, twice
/// (the tensor and its rows: `2 * SCORE_CHUNK * vocab` floats, ~78 MB for a 152k
/// vocabulary). A 2,146-token prompt on the 0.5B (2 CPU cores) took 14.3 s in passes of 64,
/// 12.9-13.8 in passes of 128, 13.3-13.9 in passes of 256; plain prefill 8.6-9.2: the
/// output projection at every position is most of the difference.
const SCORE_CHUNK: usize = 128;

impl SubServer {
    /// Scores the prompts of running requests that ask for it and have no KV here yet. A
    /// request whose scoring fails fails alone.
    pub(super) fn score_prompts(&mut self, out: &mut Vec<Outbound>) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            let Some(top) = r.prompt_logprobs else {
                i += 1;
                continue;
            };
            if !r.output.is_empty() || self.runner.seq_len(r.rid).is_some() {
                i += 1;
                continue;
            }
            let (rid, prompt) = (r.rid, r.prompt.clone());
            if let Some(salt) = &r.cache_salt {
                self.runner.salt_sequence(rid, salt);
            }
            match self.score(rid, &prompt, top) {
                Ok(scores) => {
                    let r = &mut self.running[i];
                    r.prompt_logprobs = None;
                    r.send_prompt_scores(scores);
                    i += 1;
                }
                Err(e) => {
                    let req = self.running.remove(i);
                    tracing::warn!(model = self.name(), rid, error = %e, "prompt scoring failed");
                    req.fail(format!(
                        "model `{}` failed to score the prompt: {e}",
                        self.name()
                    ));
                    self.finish(req, None, out);
                }
            }
        }
    }

    /// Prefills `prompt` as sequence `rid` in chunks, returning the scores of its tokens
    /// after the first.
    fn score(
        &mut self,
        rid: u64,
        prompt: &[u32],
        top: usize,
    ) -> Result<Vec<TokenEvent>, RuntimeError> {
        let opts = StepOptions {
            want_hidden: false,
            all_logits: true,
        };
        let mut scores = Vec::with_capacity(prompt.len().saturating_sub(1));
        for (c, chunk) in prompt.chunks(SCORE_CHUNK).enumerate() {
            let rows = self
                .runner
                .step(&[Row::new(rid, chunk.to_vec())], opts)?
                .logits_rows()?;
            // Position p's logits give the token at p + 1 (the last one's, the first
            // output token, is left to the request's first step).
            for (j, logits) in rows.iter().enumerate() {
                let Some(&id) = prompt.get(c * SCORE_CHUNK + j + 1) else {
                    break;
                };
                scores.push(score_token(logits, self.sample_limit, id, top, self.idx));
            }
        }
        Ok(scores)
    }
}

/// Token `id`'s log-probability under `logits` (the first `limit`, as sampling sees them)
/// and the `top` most likely tokens'.
fn score_token(
    logits: &[f32],
    limit: usize,
    id: u32,
    top: usize,
    source: ModelIndex,
) -> TokenEvent {
    let raw = &logits[..limit.min(logits.len())];
    let (logprob, top_logprobs) = logprob_and_top(raw, log_sum_exp(raw), id, top);
    // vLLM's rank: one more than the count of more likely tokens.
    let rank = raw.get(id as usize).map(|&l| {
        let above = raw.iter().filter(|&&x| x > l).count();
        u32::try_from(above + 1).unwrap_or(u32::MAX)
    });
    TokenEvent {
        id,
        source,
        logprob,
        top_logprobs,
        router_score: None,
        rank,
    }
}

#[cfg(test)]
mod tests {
    use super::score_token;

    #[test]
    fn a_token_scores_its_log_softmax_within_the_limit() {
        // ln(e^0 + e^ln3) = ln 4: token 1 has p = 3/4, token 0 p = 1/4; the logit past the
        // limit (a padded vocabulary row) does not count.
        let logits = [0.0, 3f32.ln(), 100.0];
        let t = score_token(&logits, 2, 0, 1, 1);
        assert!((t.logprob - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(t.top_logprobs.len(), 1);
        assert_eq!(t.top_logprobs[0].0, 1);
        assert!((t.top_logprobs[0].1 - 0.75f32.ln()).abs() < 1e-6);
        assert_eq!((t.source, t.router_score), (1, None));
        // Its rank counts the more likely tokens within the limit (token 2 is past it).
        assert_eq!(t.rank, Some(2));
        assert_eq!(score_token(&logits, 2, 1, 0, 0).rank, Some(1));
        assert_eq!(score_token(&logits, 3, 1, 0, 0).rank, Some(2));
        // A token beyond the limit has no probability, and no rank.
        let past = score_token(&logits, 2, 2, 0, 0);
        assert_eq!((past.logprob, past.rank), (f32::NEG_INFINITY, None));
    }
}
