//! Builds the JSON of responses and streamed chunks for both endpoint kinds (chat and
//! legacy completions) from choice deltas, so the streaming and non-streaming paths share
//! one definition of every field, logprobs shapes and extension fields included.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tokenrouter_api::{Backend, TokenEvent};

use crate::choice::{Delta, OutToken, StopMatch};
use crate::echo::{Echo, EchoedPrompt};
use crate::openai::response::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatDelta,
    ChatLogprob, ChatLogprobs, ChoiceExtension, Completion, CompletionChoice, CompletionChunk,
    LegacyLogprobs, PromptLogprobs, Provenance, TokenDetail, TopLogprob, Usage,
};
use crate::params::GenerationPlan;
use crate::provenance::source_name;
use crate::reasoning::{self, ReasoningStart};
use crate::tools::{Shown, ToolCallReader};

/// What a streamed chunk may report of the whole response.
pub struct SoFar {
    /// Attached to the response's last chunk when usage was not requested.
    pub provenance: Option<Provenance>,
    /// The usage so far, shown with `continuous_usage_stats`.
    pub usage: Usage,
    /// vLLM's `stop_reason` of a choice's last chunk (null on the others).
    pub stop_reason: Value,
}

/// Which OpenAI endpoint shape to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// One finished choice of a non-streaming response.
#[derive(Debug, Default)]
pub struct ChoiceOutput {
    pub text: String,
    pub tokens: Vec<OutToken>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's `stop_reason` (see [`ResponseContext::stop_reason`]).
    pub stop_reason: Value,
    /// The prompt's scores, when `echo` with `logprobs` or `prompt_logprobs` asked for them.
    pub prompt_scores: Option<Vec<TokenEvent>>,
}

/// Everything that is the same for every chunk of one response.
pub struct ResponseContext {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Configured model names by index (for `source` fields).
    pub names: Vec<String>,
    backend: Arc<dyn Backend>,
    logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: shown with this many alternatives a token.
    prompt_logprobs: Option<usize>,
    return_token_sources: bool,
    /// Logprob entries name tokens `token_id:{id}`.
    tokens_as_ids: bool,
    /// The request's `stop_token_ids` (what `stop_reason` names; an EOS it does not).
    stop_token_ids: Vec<u32>,
    pub include_usage: bool,
    /// Usage so far on every chunk (`continuous_usage_stats`).
    pub continuous_usage: bool,
    /// `echo` (completions only).
    echo: Option<Echo>,
    /// Chat answers' calls of these tools become `tool_calls`.
    pub tool_names: Option<Arc<[String]>>,
    /// At most one tool call a choice (`parallel_tool_calls: false`).
    pub single_tool_call: bool,
    /// Chat answers' thinking is read apart from their content.
    pub reasoning: Option<ReasoningStart>,
}

impl ResponseContext {
    pub fn new(kind: Kind, backend: Arc<dyn Backend>, plan: &GenerationPlan) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Self {
            kind,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created,
            model: plan.model.name.clone(),
            names: backend.models().into_iter().map(|m| m.name).collect(),
            backend,
            logprobs: plan.logprobs,
            prompt_logprobs: plan.shown_prompt_logprobs,
            return_token_sources: plan.return_token_sources,
            tokens_as_ids: plan.tokens_as_ids,
            stop_token_ids: plan.stop_token_ids.clone(),
            include_usage: plan.include_usage,
            continuous_usage: plan.continuous_usage,
            echo: None,
            tool_names: plan.tool_names.clone().filter(|_| kind == Kind::Chat),
            single_tool_call: plan.single_tool_call,
            reasoning: plan.reasoning.filter(|_| kind == Kind::Chat),
        }
    }

    pub fn with_echo(mut self, echo: Option<Echo>) -> Self {
        self.echo = echo;
        self
    }

    /// Choice `index`'s echoed prompt, if any.
    pub fn echoed(&self, index: usize) -> Option<&EchoedPrompt> {
        self.echo.as_ref().and_then(|e| e.prompt(index))
    }

    /// Whether choices show their prompt alone (`echo` with `max_tokens: 0`).
    pub fn prompt_only(&self) -> bool {
        self.echo.as_ref().is_some_and(|e| e.prompt_only)
    }

    /// vLLM's `stop_reason`: the stop string that ended a choice, or the id of its
    /// `stop_token_ids` that did; null for an EOS, `max_tokens` or no stop.
    pub fn stop_reason(&self, stopped_by: Option<&StopMatch>) -> Value {
        match stopped_by {
            Some(StopMatch::Text(text)) => Value::from(text.as_str()),
            Some(StopMatch::Token(id)) if self.stop_token_ids.contains(id) => Value::from(*id),
            _ => Value::Null,
        }
    }

    fn source(&self, index: usize) -> String {
        source_name(&self.names, index)
    }

    /// Text of one token for logprob entries (special tokens shown, not skipped), or
    /// `token_id:{id}` (vLLM's `return_tokens_as_token_ids`: for tokens that are not whole
    /// characters alone).
    fn token_text(&self, id: u32) -> String {
        if self.tokens_as_ids {
            return format!("token_id:{id}");
        }
        self.backend.decode(&[id], false).unwrap_or_default()
    }

    /// `text`: the visible text that `tokens` produced (a delta's or a whole choice's).
    fn extension(&self, tokens: &[OutToken], text: &str) -> ChoiceExtension {
        if !self.return_token_sources {
            return ChoiceExtension::default();
        }
        ChoiceExtension {
            token_sources: Some(tokens.iter().map(|t| self.source(t.event.source)).collect()),
            token_details: Some(
                tokens
                    .iter()
                    .zip(token_texts(tokens, text))
                    .map(|(t, text)| TokenDetail {
                        source: self.source(t.event.source),
                        text,
                        logprob: t.event.logprob,
                        router_score: t.event.router_score,
                    })
                    .collect(),
            ),
        }
    }

    fn chat_logprobs(&self, tokens: &[OutToken]) -> Option<ChatLogprobs> {
        self.logprobs?;
        let content = tokens
            .iter()
            .map(|t| {
                let token = self.token_text(t.event.id);
                ChatLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: t.event.logprob,
                    top_logprobs: t
                        .event
                        .top_logprobs
                        .iter()
                        .map(|&(id, logprob)| {
                            let token = self.token_text(id);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob,
                            }
                        })
                        .collect(),
                    source: self.source(t.event.source),
                }
            })
            .collect();
        Some(ChatLogprobs { content })
    }

    /// Legacy logprobs of generated `tokens`, their text offsets shifted by `base`
    /// characters (an echoed prompt's).
    fn legacy_logprobs(&self, tokens: &[OutToken], base: usize) -> Option<LegacyLogprobs> {
        let k = self.logprobs?;
        let mut out = LegacyLogprobs::default();
        for t in tokens {
            out.tokens.push(self.token_text(t.event.id));
            out.token_logprobs.push(Some(t.event.logprob));
            out.top_logprobs.push((k > 0).then(|| {
                t.event
                    .top_logprobs
                    .iter()
                    .map(|&(id, lp)| (self.token_text(id), lp))
                    .collect::<BTreeMap<_, _>>()
            }));
            out.text_offset.push(base + t.text_offset);
            out.sources.push(self.source(t.event.source));
        }
        Some(out)
    }

    /// Legacy logprobs of an echoed prompt's tokens: the first `null`, token i > 0 scored
    /// by `scores[i - 1]`; `None` unless logprobs were asked for.
    fn prompt_logprobs(
        &self,
        prompt: &EchoedPrompt,
        scores: Option<&[TokenEvent]>,
    ) -> Option<LegacyLogprobs> {
        let k = self.logprobs?;
        let scores = scores.unwrap_or_default();
        let mut out = LegacyLogprobs::default();
        for (i, (&id, &offset)) in prompt.ids.iter().zip(&prompt.offsets).enumerate() {
            let score = i.checked_sub(1).and_then(|j| scores.get(j));
            out.tokens.push(self.token_text(id));
            out.token_logprobs.push(score.map(|s| s.logprob));
            out.top_logprobs.push(score.filter(|_| k > 0).map(|s| {
                s.top_logprobs
                    .iter()
                    .take(k)
                    .map(|&(id, lp)| (self.token_text(id), lp))
                    .collect::<BTreeMap<_, _>>()
            }));
            out.text_offset.push(offset);
            // Echo with logprobs is pinned to one model: it scored the prompt.
            out.sources.push(self.model.clone());
        }
        Some(out)
    }

    /// vLLM's `prompt_logprobs` of a choice's prompt, when asked.
    fn vllm_prompt_logprobs(&self, out: &ChoiceOutput) -> Option<PromptLogprobs> {
        let k = self.prompt_logprobs?;
        let scores = out.prompt_scores.as_deref().unwrap_or_default();
        Some(crate::prompt_logprobs::render(scores, k, |id| {
            self.token_text(id)
        }))
    }

    /// A completion choice's text and logprobs: the echoed prompt's, then the generated
    /// tokens' (none when the prompt is shown alone).
    fn completion_parts(
        &self,
        index: usize,
        out: &ChoiceOutput,
    ) -> (String, Option<LegacyLogprobs>) {
        let (text, tokens) = match self.prompt_only() {
            true => ("", &[][..]),
            false => (out.text.as_str(), &out.tokens[..]),
        };
        let Some(prompt) = self.echoed(index) else {
            return (text.to_string(), self.legacy_logprobs(tokens, 0));
        };
        let mut logprobs = self.prompt_logprobs(prompt, out.prompt_scores.as_deref());
        if let (Some(all), Some(generated)) = (
            logprobs.as_mut(),
            self.legacy_logprobs(tokens, prompt.chars()),
        ) {
            all.append(generated);
        }
        (format!("{}{text}", prompt.text), logprobs)
    }

    /// The streamed chunk that shows choice `index`'s prompt (`echo`), with its scores.
    pub fn echo_chunk(&self, index: usize, scores: Option<&[TokenEvent]>) -> Option<String> {
        let prompt = self.echoed(index)?;
        let choice = CompletionChoice {
            index,
            text: prompt.text.clone(),
            logprobs: self.prompt_logprobs(prompt, scores),
            finish_reason: None,
            stop_reason: Value::Null,
            prompt_logprobs: None,
            ext: ChoiceExtension::default(),
        };
        let usage = self.include_usage.then_some(None);
        serde_json::to_string(&self.completion_chunk(choice, None, usage)).ok()
    }

    /// A streamed completions chunk carrying `choice` (`usage` as `chunk` shows it).
    fn completion_chunk(
        &self,
        choice: CompletionChoice,
        tokenrouter: Option<Provenance>,
        usage: Option<Option<Usage>>,
    ) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![choice],
            usage,
            tokenrouter,
        }
    }

    /// Body of a non-streaming response.
    pub fn full(
        &self,
        outputs: Vec<ChoiceOutput>,
        usage: Usage,
        provenance: Provenance,
    ) -> Response {
        match self.kind {
            Kind::Chat => Json(ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion",
                created: self.created,
                model: self.model.clone(),
                // One prompt, scored the same for every choice.
                prompt_logprobs: outputs.first().and_then(|o| self.vllm_prompt_logprobs(o)),
                choices: outputs
                    .into_iter()
                    .enumerate()
                    .map(|(index, out)| {
                        let (reasoning, text) = match self.reasoning {
                            Some(start) => reasoning::read_whole(start, &out.text),
                            None => (None, out.text.clone()),
                        };
                        let (content, tool_calls) = match &self.tool_names {
                            Some(names) => ToolCallReader::new(names.clone())
                                .one_call_at_most(self.single_tool_call)
                                .whole(&text),
                            None => (Some(text), Vec::new()),
                        };
                        // Thinking alone (cut by `max_tokens`): no answer yet.
                        let content = content.filter(|c| reasoning.is_none() || !c.is_empty());
                        ChatChoice {
                            index,
                            logprobs: self.chat_logprobs(&out.tokens),
                            ext: self.extension(&out.tokens, &out.text),
                            finish_reason: tool_finish(out.finish_reason, !tool_calls.is_empty()),
                            stop_reason: out.stop_reason.clone(),
                            message: AssistantMessage {
                                role: "assistant",
                                content,
                                reasoning_content: reasoning.clone(),
                                reasoning,
                                tool_calls,
                            },
                        }
                    })
                    .collect(),
                usage,
                tokenrouter: provenance,
            })
            .into_response(),
            Kind::Completion => Json(Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: outputs
                    .into_iter()
                    .enumerate()
                    .map(|(index, out)| {
                        let (text, logprobs) = self.completion_parts(index, &out);
                        let ext = match self.prompt_only() {
                            true => ChoiceExtension::default(),
                            false => self.extension(&out.tokens, &out.text),
                        };
                        CompletionChoice {
                            index,
                            logprobs,
                            ext,
                            text,
                            finish_reason: out.finish_reason,
                            stop_reason: out.stop_reason.clone(),
                            prompt_logprobs: self.vllm_prompt_logprobs(&out),
                        }
                    })
                    .collect(),
                usage,
                tokenrouter: provenance,
            })
            .into_response(),
        }
    }

    /// One streamed chunk for choice `index`. `first` adds the chat role; `shown` is what
    /// a chat delta shows when tool calls are read (its text without the calls' blocks,
    /// and the calls it completed); `finish` marks the choice's last chunk.
    pub fn chunk(
        &self,
        index: usize,
        first: bool,
        delta: &Delta,
        shown: Option<Shown>,
        finish: Option<&'static str>,
        so_far: SoFar,
    ) -> String {
        let SoFar {
            provenance,
            usage,
            stop_reason,
        } = so_far;
        let usage = self
            .include_usage
            .then(|| self.continuous_usage.then_some(usage));
        let result = match self.kind {
            Kind::Chat => {
                let Shown {
                    content: text,
                    calls,
                    reasoning,
                } = shown.unwrap_or_else(|| Shown {
                    content: delta.text.clone(),
                    ..Shown::default()
                });
                let content = (!text.is_empty() || first).then_some(text);
                let reasoning = (!reasoning.is_empty()).then_some(reasoning);
                serde_json::to_string(&ChatChunk {
                    id: self.id.clone(),
                    object: "chat.completion.chunk",
                    created: self.created,
                    model: self.model.clone(),
                    choices: vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: first.then_some("assistant"),
                            content,
                            reasoning_content: reasoning.clone(),
                            reasoning,
                            tool_calls: calls,
                        },
                        logprobs: self.chat_logprobs(&delta.tokens),
                        finish_reason: finish,
                        stop_reason,
                        ext: self.extension(&delta.tokens, &delta.text),
                    }],
                    usage,
                    tokenrouter: provenance,
                })
            }
            Kind::Completion => {
                let choice = CompletionChoice {
                    index,
                    text: delta.text.clone(),
                    logprobs: self.legacy_logprobs(
                        &delta.tokens,
                        self.echoed(index).map_or(0, |p| p.chars()),
                    ),
                    finish_reason: finish,
                    stop_reason,
                    prompt_logprobs: None,
                    ext: self.extension(&delta.tokens, &delta.text),
                };
                serde_json::to_string(&self.completion_chunk(choice, provenance, usage))
            }
        };
        result.unwrap_or_default()
    }

    /// The final chunk of `stream_options.include_usage`: no choices, usage and provenance.
    pub fn usage_chunk(&self, usage: Usage, provenance: Provenance) -> String {
        let result = match self.kind {
            Kind::Chat => serde_json::to_string(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![],
                usage: Some(Some(usage)),
                tokenrouter: Some(provenance),
            }),
            Kind::Completion => serde_json::to_string(&CompletionChunk {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![],
                usage: Some(Some(usage)),
                tokenrouter: Some(provenance),
            }),
        };
        result.unwrap_or_default()
    }
}

/// A choice's finish reason: a natural stop after tool calls is `tool_calls`, as OpenAI
/// reports it (a cut by `max_tokens` stays `length`).
pub fn tool_finish(reason: Option<&'static str>, called: bool) -> Option<&'static str> {
    match reason {
        Some("stop") if called => Some("tool_calls"),
        other => other,
    }
}

/// Splits `text` (the visible text produced by `tokens`, starting at the first token's
/// `text_offset`) into one piece per token, using the character offsets recorded by the
/// decoder. Offsets past the end of `text` (tokens of a cut-off stop string) give empty
/// pieces, so the pieces always concatenate to `text`.
fn token_texts(tokens: &[OutToken], text: &str) -> Vec<String> {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(b, _)| b)
        .chain(std::iter::once(text.len()))
        .collect();
    let chars = bounds.len() - 1;
    let base = tokens.first().map_or(0, |t| t.text_offset);
    let at = |offset: usize| bounds[offset.saturating_sub(base).min(chars)];
    tokens
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let start = at(t.text_offset);
            let end = tokens
                .get(k + 1)
                .map_or(text.len(), |next| at(next.text_offset));
            text.get(start..end.max(start))
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter_api::TokenEvent;

    fn toks(offsets: &[usize]) -> Vec<OutToken> {
        offsets
            .iter()
            .map(|&text_offset| OutToken {
                event: TokenEvent {
                    id: 0,
                    source: 0,
                    logprob: 0.0,
                    top_logprobs: vec![],
                    router_score: None,
                    rank: None,
                },
                text_offset,
            })
            .collect()
    }

    #[test]
    fn token_texts_split_a_delta_by_char_offsets() {
        // A delta starting at char 5: "é" from two byte tokens (the first yields nothing),
        // then " ab" and "c".
        let pieces = token_texts(&toks(&[5, 5, 6, 9]), "é abc");
        assert_eq!(pieces, vec!["", "é", " ab", "c"]);
        assert_eq!(pieces.concat(), "é abc");
    }

    #[test]
    fn token_texts_of_a_cut_stop_string_are_empty() {
        // "ab" shown, then a stop string "XY" whose tokens start at char 2 (cut off).
        let pieces = token_texts(&toks(&[0, 1, 2, 3]), "ab");
        assert_eq!(pieces, vec!["a", "b", "", ""]);
        assert!(token_texts(&[], "").is_empty());
    }
}
