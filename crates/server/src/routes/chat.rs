//! `POST /v1/chat/completions`: messages → chat template (with `chat_template_kwargs`, and
//! `tools` as a template variable, assistant `tool_calls` and tool results in the messages)
//! → token ids → generation; the answer's tool calls are read out in `render` (`tools`).

use std::time::Instant;

use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value};
use tokenrouter_api::ChatMessage;

use crate::error::ApiError;
use crate::extract::{parse_value, ApiJson};
use crate::openai::request::{ChatFields, CommonFields, MessageContent, RequestMessage};
use crate::params::{chat_logprobs, GenerationPlan};
use crate::prompt_logprobs;
use crate::reasoning::ReasoningStart;
use crate::render::Kind;
use crate::respond::respond;
use crate::state::AppState;
use crate::tools::{template_tool_calls, ToolUse};

pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let (plan, ids) = prepare(&state, &body).await?;
    respond(&state, plan, Kind::Chat, vec![ids], arrival, None).await
}

/// A chat request's plan and prompt ids: its fields checked, its messages rendered by the
/// chat template and tokenized (also the Responses API's path, `responses.rs`, which
/// speaks in chat requests).
pub(crate) async fn prepare(
    state: &AppState,
    body: &Value,
) -> Result<(GenerationPlan, Vec<u32>), ApiError> {
    let common: CommonFields = parse_value(body)?;
    let chat: ChatFields = parse_value(body)?;
    let model = state.resolve_model(common.model.as_deref())?;
    state.check_ready()?;
    let max_tokens = match (chat.max_completion_tokens, common.max_tokens) {
        (Some(m), _) => Some((m, "max_completion_tokens")),
        (None, Some(m)) => Some((m, "max_tokens")),
        (None, None) => None,
    };
    let logprobs = chat_logprobs(chat.logprobs, chat.top_logprobs, &state.config)?;
    let shown_prompt_logprobs = common.prompt_logprobs;
    let mut plan = GenerationPlan::new(common, model, max_tokens, logprobs, &state.config)?;
    prompt_logprobs::ask(&mut plan, shown_prompt_logprobs, state)?;
    let tool_use = ToolUse::new(
        chat.tools,
        chat.tool_choice.as_ref(),
        state.config.tool_call_parser,
    )?;
    plan.tool_names = tool_use.names();
    plan.single_tool_call = chat.parallel_tool_calls == Some(false);
    if let Some(call) = tool_use.constraint {
        if let Some((_, field)) = &plan.constraint {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("a forced tool call and `{field}` both constrain the answer: give one"),
            ));
        }
        plan.constraint = Some((call, "tool_choice"));
    }
    let text_bytes: usize = chat
        .messages
        .iter()
        .map(|m| match &m.content {
            Some(MessageContent::Text(t)) => t.len(),
            Some(MessageContent::Parts(p)) => p
                .iter()
                .filter_map(|x| x.text.as_ref())
                .map(String::len)
                .sum(),
            None => 0,
        })
        .sum();
    state.check_prompt_size(text_bytes, plan.model.context_length)?;
    let messages = to_chat_messages(&chat.messages)?;
    let (blocking_state, kwargs, tools) =
        (state.clone(), chat.chat_template_kwargs, tool_use.tools);
    let end = PromptEnd::new(chat.add_generation_prompt, chat.continue_final_message)?;
    let include_reasoning = chat.include_reasoning.unwrap_or(true);
    // Template and tokenizer run on the blocking pool: a large conversation never stalls
    // the executor that answers `/health` and the other clients.
    let (ids, reasoning) = tokio::task::spawn_blocking(move || {
        let prompt = render_messages(&blocking_state, &messages, end, kwargs, tools)?;
        let reasoning = ReasoningStart::new(
            blocking_state.config.reasoning_parser,
            &prompt,
            include_reasoning,
        );
        let ids = blocking_state.backend.encode(&prompt)?;
        Ok::<_, ApiError>((ids, reasoning))
    })
    .await
    .map_err(|e| ApiError::Engine(format!("tokenizer task: {e}")))??;
    plan.reasoning = reasoning;
    let mut ids = ids;
    plan.truncate_prompt(&mut ids, plan.model.context_length);
    Ok((plan, ids))
}

/// How a rendered conversation ends: with the assistant's turn opened
/// (`add_generation_prompt`, the default), closed after the last message, or with the last
/// message left open for the answer to continue (`continue_final_message`, vLLM's and
/// Hugging Face's: an assistant's prefix the model goes on from).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum PromptEnd {
    OpenTurn,
    Closed,
    ContinueFinal,
}

impl PromptEnd {
    pub(crate) fn new(
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
    ) -> Result<Self, ApiError> {
        match (
            add_generation_prompt,
            continue_final_message.unwrap_or(false),
        ) {
            (Some(true), true) => Err(ApiError::invalid(
                "continue_final_message",
                "`continue_final_message` continues the last message, `add_generation_prompt` \
                 opens a new one: set one of them",
            )),
            (_, true) => Ok(PromptEnd::ContinueFinal),
            (Some(false), false) => Ok(PromptEnd::Closed),
            (_, false) => Ok(PromptEnd::OpenTurn),
        }
    }
}

/// Applies the backend's chat template to `messages`.
pub(crate) fn render_prompt(
    state: &AppState,
    messages: &[RequestMessage],
    end: PromptEnd,
    kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Value>>,
) -> Result<String, ApiError> {
    let messages = to_chat_messages(messages)?;
    render_messages(state, &messages, end, kwargs, tools)
}

/// Applies the chat template to already flattened messages.
fn render_messages(
    state: &AppState,
    messages: &[ChatMessage],
    end: PromptEnd,
    kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Value>>,
) -> Result<String, ApiError> {
    let mut kwargs = kwargs.unwrap_or_default();
    if let Some(tools) = tools {
        kwargs.insert("tools".into(), Value::Array(tools));
    }
    let rendered = state.backend.apply_chat_template(
        messages,
        end == PromptEnd::OpenTurn,
        &Value::Object(kwargs),
    )?;
    match (end, messages.last()) {
        (PromptEnd::ContinueFinal, Some(last)) => open_final_message(rendered, &last.content),
        _ => Ok(rendered),
    }
}

/// The rendering cut right after the last message's content, as Hugging Face's
/// `continue_final_message` cuts it (the content as given, else trimmed: some templates
/// trim messages).
fn open_final_message(rendered: String, content: &str) -> Result<String, ApiError> {
    let end_of = |needle: &str| {
        (!needle.is_empty())
            .then(|| rendered.rfind(needle).map(|at| at + needle.len()))
            .flatten()
    };
    match end_of(content).or_else(|| end_of(content.trim())) {
        Some(end) => Ok(rendered[..end].to_string()),
        None => Err(ApiError::invalid(
            "continue_final_message",
            "the last message's content is empty or the chat template does not show it, \
             so there is nothing to continue",
        )),
    }
}

/// Roles a chat template may see (OpenAI's, plus `ipython` of Llama 3 templates).
const KNOWN_ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "ipython",
];

/// Flattens OpenAI messages (string content, text parts, or null) into template messages.
pub(crate) fn to_chat_messages(messages: &[RequestMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(text)) => text.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "only text content parts are supported, got type {:?}",
                                        part.kind
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            if !KNOWN_ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "unknown role `{}` (expected one of: {})",
                        crate::error::truncate_for_echo(&m.role),
                        KNOWN_ROLES.join(", ")
                    ),
                ));
            }
            let tool_calls = match (&m.tool_calls, m.role.as_str()) {
                (None, _) => None,
                (Some(calls), "assistant") => Some(template_tool_calls(i, calls)?),
                (Some(_), _) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].tool_calls"),
                        "only assistant messages carry `tool_calls`",
                    ))
                }
            };
            Ok(ChatMessage {
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                reasoning_content: m.reasoning_content.clone().or_else(|| m.reasoning.clone()),
                ..ChatMessage::new(m.role.clone(), content)
            })
        })
        .collect()
}
