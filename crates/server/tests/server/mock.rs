//! A deterministic mock of the engine behind the `Backend` trait: a byte-level tokenizer
//! (ids 0..=255 are bytes, 256.. are special tokens), a ChatML-like template, and a
//! generator task that writes a fixed script one byte-token at a time, alternating the
//! writing model every two tokens (or staying on the pinned model). It records every
//! submitted request and every abort, so tests can check the mapping of request fields
//! and that dropping a response aborts the engine request. Like the engine's prefix cache,
//! it reports as cached the longest start a prompt shares with an earlier one (never all
//! of it). Shared by the integration tests
//! and `examples/mock_server.rs`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;
use tokenrouter_api::{
    Backend, ChatMessage, FinishReason, GenerateEvent, GenerateRequest, GenerateStream, ModelInfo,
    ModelLoad, OutputConstraint, RoutingOverrides, SubmitError, TextError, TokenEvent,
};
use tokio::sync::{mpsc, Notify};

pub const EOS: u32 = 256;
const SPECIALS: [(&str, u32); 9] = [
    ("<|endoftext|>", 256),
    ("<|im_start|>", 257),
    ("<|im_end|>", 258),
    ("<|fim_prefix|>", FIM_PREFIX),
    ("<|fim_middle|>", FIM_MIDDLE),
    ("<|fim_suffix|>", FIM_SUFFIX),
    ("<|fim_pad|>", 262),
    ("<|repo_name|>", FIM_REPO),
    ("<|file_sep|>", FIM_FILE_SEP),
];
/// Qwen2.5-Coder's fill-in-the-middle tokens (`/infill`, `suffix`).
pub const FIM_PREFIX: u32 = 259;
pub const FIM_MIDDLE: u32 = 260;
pub const FIM_SUFFIX: u32 = 261;
pub const FIM_REPO: u32 = 263;
pub const FIM_FILE_SEP: u32 = 264;
/// What the mock generates and how it behaves.
#[derive(Clone, Debug)]
pub struct MockConfig {
    pub models: Vec<ModelInfo>,
    /// Output text; a request with a seed writes `"seed {seed}: "` before it.
    pub script: String,
    /// Pause before each token.
    pub token_delay: Duration,
    pub ready: bool,
    /// `QueueFull` once this many requests are running.
    pub max_running: Option<usize>,
    /// Emit an engine error instead of the token at this position.
    pub error_at: Option<usize>,
    /// Answer like a tool-using model: a prompt listing tools (`<tools>`) and no tool
    /// result yet gets a `<tool_call>` of the first tool with `{"city": "Paris"}`.
    pub calls_tools: bool,
    /// The tokenizer knows the FIM tokens (a model without them refuses `/infill`).
    pub fim: bool,
    /// The routing a fill-in-the-middle request gets when it gives none.
    pub fim_routing: RoutingOverrides,
    /// What `Backend::load` reports.
    pub load: Vec<ModelLoad>,
}

impl Default for MockConfig {
    fn default() -> Self {
        let model = |name: &str, source: &str| ModelInfo {
            name: name.into(),
            source: source.into(),
            context_length: 512,
        };
        Self {
            models: vec![
                model("quick", "mock/small"),
                model("reference", "mock/large"),
            ],
            script: "Hello, world! The answer is 42. é日本🙂 END of story.".into(),
            token_delay: Duration::ZERO,
            ready: true,
            max_running: None,
            error_at: None,
            calls_tools: false,
            fim: true,
            fim_routing: RoutingOverrides::default(),
            load: Vec::new(),
        }
    }
}

/// What the mock saw.
#[derive(Debug, Default)]
pub struct MockLog {
    pub submitted: Vec<GenerateRequest>,
    pub aborted: Vec<u64>,
    pub completed: Vec<u64>,
    pub running: usize,
    /// Last `apply_chat_template` call: (messages, add_generation_prompt, kwargs).
    pub last_template: Option<(Vec<ChatMessage>, bool, Value)>,
    /// Requests submitted before the last `flush_cache` (their prompts are not cached).
    pub flushed_before: usize,
}

pub struct MockBackend {
    pub cfg: MockConfig,
    ready: AtomicBool,
    log: Arc<Mutex<MockLog>>,
    changed: Arc<Notify>,
}

impl MockBackend {
    pub fn new(cfg: MockConfig) -> Arc<Self> {
        Arc::new(Self {
            ready: AtomicBool::new(cfg.ready),
            cfg,
            log: Arc::default(),
            changed: Arc::default(),
        })
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn log(&self) -> MutexGuard<'_, MockLog> {
        lock(&self.log)
    }

    /// Waits until `cond` holds on the log (checked after every change), up to `timeout`.
    pub async fn wait_for(&self, timeout: Duration, cond: impl Fn(&MockLog) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if cond(&self.log()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return cond(&self.log());
            }
        }
    }

    /// The text the generator writes for `request` (before max_tokens / stop ids).
    pub fn script_for(&self, request: &GenerateRequest) -> String {
        if self.cfg.calls_tools {
            let prompt = self.decode(&request.prompt_ids, false).unwrap_or_default();
            if let Some(call) = tool_call_answer(&prompt) {
                return call;
            }
        }
        match request.sampling.seed {
            Some(seed) => format!("seed {seed}: {}", self.cfg.script),
            None => self.cfg.script.clone(),
        }
    }
}

/// A call of the first tool the prompt lists, unless a tool already answered.
fn tool_call_answer(prompt: &str) -> Option<String> {
    if prompt.contains("<tool_response>") {
        return None;
    }
    let listed = prompt.split_once("<tools>")?.1.split_once("</tools>")?.0;
    let tools: Vec<Value> = serde_json::from_str(listed).ok()?;
    let name = tools.first()?["function"]["name"].as_str()?.to_string();
    let call = serde_json::json!({"name": name, "arguments": {"city": "Paris"}});
    Some(format!("<tool_call>\n{call}\n</tool_call>"))
}

fn lock(log: &Mutex<MockLog>) -> MutexGuard<'_, MockLog> {
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Source of the i-th generated token: the pinned model, or two tokens per model in turn.
pub fn source_of(i: usize, pinned: Option<usize>, models: usize) -> usize {
    pinned.unwrap_or((i / 2) % models.max(1))
}

/// Logprob of the i-th generated token.
pub fn logprob_of(i: usize) -> f32 {
    -0.01 - 0.1 * (i % 7) as f32
}

/// Score of the prompt's token i + 1 (`prompt_logprobs`).
pub fn prompt_logprob_of(i: usize) -> f32 {
    -1.0 - 0.25 * (i % 3) as f32
}

impl Backend for MockBackend {
    fn models(&self) -> Vec<ModelInfo> {
        self.cfg.models.clone()
    }

    fn load(&self) -> Vec<ModelLoad> {
        self.cfg.load.clone()
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = Vec::new();
        let mut rest = text;
        'outer: while !rest.is_empty() {
            for (name, id) in SPECIALS {
                if id >= FIM_PREFIX && !self.cfg.fim {
                    continue;
                }
                if let Some(after) = rest.strip_prefix(name) {
                    ids.push(id);
                    rest = after;
                    continue 'outer;
                }
            }
            let ch = rest.chars().next().unwrap_or_default();
            ids.extend(rest[..ch.len_utf8()].bytes().map(u32::from));
            rest = &rest[ch.len_utf8()..];
        }
        Ok(ids)
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        let names: HashMap<u32, &str> = SPECIALS.iter().map(|&(n, i)| (i, n)).collect();
        let mut bytes = Vec::new();
        for &id in ids {
            match (u8::try_from(id), names.get(&id)) {
                (Ok(b), _) => bytes.push(b),
                (Err(_), Some(name)) if !skip_special => bytes.extend(name.bytes()),
                (Err(_), Some(_)) => {}
                (Err(_), None) => {
                    return Err(TextError::Tokenizer(format!("unknown token id {id}")))
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &Value,
    ) -> Result<String, TextError> {
        lock(&self.log).last_template =
            Some((messages.to_vec(), add_generation_prompt, kwargs.clone()));
        let mut out = String::new();
        if let Some(tools) = kwargs.get("tools") {
            out.push_str(&format!(
                "<|im_start|>system\n<tools>{tools}</tools><|im_end|>\n"
            ));
        }
        for m in messages {
            if !["system", "user", "assistant", "tool"].contains(&m.role.as_str()) {
                return Err(TextError::Template(format!("unknown role {:?}", m.role)));
            }
            let content = match m.role.as_str() {
                "tool" => format!("<tool_response>{}</tool_response>", m.content),
                _ => m.content.clone(),
            };
            out.push_str(&format!("<|im_start|>{}\n{content}<|im_end|>\n", m.role));
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
            if kwargs.get("enable_thinking") == Some(&Value::Bool(false)) {
                out.push_str("<think>\n\n</think>\n\n");
            }
        }
        Ok(out)
    }

    fn submit(&self, request: GenerateRequest) -> Result<GenerateStream, SubmitError> {
        if !self.is_ready() {
            return Err(SubmitError::NotReady("mock is loading".into()));
        }
        let models = self.cfg.models.len();
        let context_length = match request.pinned_model {
            Some(i) if i >= models => {
                return Err(SubmitError::InvalidRequest(format!("no model {i}")))
            }
            Some(i) => self.cfg.models[i].context_length,
            None => self
                .cfg
                .models
                .iter()
                .map(|m| m.context_length)
                .min()
                .unwrap_or(0),
        };
        // The same bound the engine applies (an absent max_tokens fills the context).
        let max_tokens = request.output_bound(context_length)?;
        // The engine's refusal of a constraint it cannot compile, by its own field name.
        if let Some(OutputConstraint::Regex(rx)) = &request.constraint {
            if rx.contains("((") {
                return Err(SubmitError::InvalidField {
                    param: "constraint".into(),
                    message: "invalid output constraint: unbalanced".into(),
                });
            }
        }
        let (request_id, cached) = {
            let mut log = lock(&self.log);
            if let Some(limit) = self.cfg.max_running {
                if log.running >= limit {
                    return Err(SubmitError::QueueFull {
                        queued: log.running,
                        limit,
                    });
                }
            }
            log.running += 1;
            let cached = log.submitted[log.flushed_before..]
                .iter()
                .map(|earlier| common_start(&earlier.prompt_ids, &request.prompt_ids))
                .max()
                .unwrap_or(0)
                .min(request.prompt_ids.len().saturating_sub(1));
            log.submitted.push(request.clone());
            (log.submitted.len() as u64, cached)
        };
        self.changed.notify_waiters();
        let (tx, rx) = mpsc::unbounded_channel();
        let script = self.script_for(&request).into_bytes();
        let mut stop_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_ids.push(EOS);
        }
        let (log, changed, cfg) = (self.log.clone(), self.changed.clone(), self.cfg.clone());
        tokio::spawn(async move {
            let _ = tx.send(GenerateEvent::PromptCached(cached));
            let outcome = generate(&tx, &request, max_tokens, &script, &cfg).await;
            let mut log = lock(&log);
            log.running -= 1;
            match outcome {
                Outcome::Aborted => log.aborted.push(request_id),
                Outcome::Completed => log.completed.push(request_id),
            }
            drop(log);
            changed.notify_waiters();
        });
        Ok(GenerateStream {
            request_id,
            max_tokens,
            stop_ids,
            events: rx,
        })
    }

    fn fim_routing(&self) -> RoutingOverrides {
        self.cfg.fim_routing.clone()
    }

    fn flush_cache(&self) -> Result<(), SubmitError> {
        if !self.is_ready() {
            return Err(SubmitError::NotReady("mock is loading".into()));
        }
        let mut log = lock(&self.log);
        log.flushed_before = log.submitted.len();
        Ok(())
    }

    fn metrics_text(&self) -> String {
        let log = lock(&self.log);
        format!(
            "# TYPE mock_engine_aborted_total counter\nmock_engine_aborted_total {}\n",
            log.aborted.len()
        )
    }
}

enum Outcome {
    Aborted,
    Completed,
}

async fn generate(
    tx: &mpsc::UnboundedSender<GenerateEvent>,
    request: &GenerateRequest,
    max_tokens: usize,
    script: &[u8],
    cfg: &MockConfig,
) -> Outcome {
    let models = cfg.models.len();
    if let Some(k) = request.prompt_logprobs {
        let scores = request.prompt_ids[1..]
            .iter()
            .enumerate()
            .map(|(i, &id)| TokenEvent {
                id,
                source: request.pinned_model.unwrap_or(0),
                logprob: prompt_logprob_of(i),
                top_logprobs: (0..k as u32)
                    .map(|j| ((id + j) % 256, -(j as f32)))
                    .collect(),
                router_score: None,
                // The prompt's token heads its alternatives.
                rank: Some(1),
            })
            .collect();
        if tx.send(GenerateEvent::Prompt(scores)).is_err() {
            return Outcome::Aborted;
        }
    }
    for i in 0..max_tokens {
        tokio::select! {
            biased;
            () = tx.closed() => return Outcome::Aborted,
            () = pause(cfg.token_delay) => {}
        }
        if cfg.error_at == Some(i) {
            let _ = tx.send(GenerateEvent::Error("mock failure".into()));
            return Outcome::Completed;
        }
        let id = match script.get(i) {
            Some(&b) => u32::from(b),
            None if request.ignore_eos && !script.is_empty() => u32::from(script[i % script.len()]),
            None => EOS,
        };
        let token = TokenEvent {
            id,
            source: source_of(i, request.pinned_model, models),
            logprob: logprob_of(i),
            top_logprobs: (0..request.top_logprobs as u32)
                .map(|k| ((id + k) % 256, logprob_of(i) - k as f32))
                .collect(),
            router_score: request.pinned_model.is_none().then_some(0.5),
            rank: None,
        };
        if tx.send(GenerateEvent::Token(token)).is_err() {
            return Outcome::Aborted;
        }
        if id == EOS || request.stop_token_ids.contains(&id) {
            let _ = tx.send(GenerateEvent::Finished {
                reason: FinishReason::Stop,
            });
            return Outcome::Completed;
        }
    }
    let _ = tx.send(GenerateEvent::Finished {
        reason: FinishReason::Length,
    });
    Outcome::Completed
}

fn common_start(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

async fn pause(delay: Duration) {
    if delay.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(delay).await;
    }
}
