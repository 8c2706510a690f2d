//! Routing policies: what a method decides, never how requests are batched or threaded.
//! Each model gets its own policy instance (its *role*). After every step of that model,
//! `route` says for each request whether it stays or goes to another model; `send` says
//! what the receiver gets (keep or drop the token just written here, e.g. R2R drops the
//! small model's token so the large model rewrites that position); `receive` says how
//! much of an incoming delta a model accepts. Policies are registered by name and built
//! from YAML `scheduler_class` + `scheduler_kwargs`.

use crate::config::ConfigError;
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenrouter_api::{ModelIndex, RoutingOverrides};

/// What the engine must compute in a step for this policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The final-norm hidden state of each row's last token (`StepView::hidden`).
    pub hidden: bool,
    /// The policy never reads `RowView::logits`: on a GPU, greedy requests are then sampled
    /// on the device and only (token, logprob) comes back, not ~150k logits per row.
    pub no_logits: bool,
    /// The normalised entropy of each row's distribution (`RowView::entropy`), computed on
    /// the model's device inside the step.
    pub entropy: bool,
    /// The `top_logits` largest logits of each row, descending (`RowView::top_logits`),
    /// computed on the model's device inside the step (0: none).
    pub top_logits: usize,
}

impl Needs {
    /// Only the sampled tokens matter (policies that ignore the distribution).
    pub const TOKENS_ONLY: Needs = Needs {
        hidden: false,
        no_logits: true,
        entropy: false,
        top_logits: 0,
    };
    /// Only the sampled tokens and the entropy of the distribution (R-Stitch, ME).
    pub const ENTROPY_ONLY: Needs = Needs {
        hidden: false,
        no_logits: true,
        entropy: true,
        top_logits: 0,
    };
}

/// One request in a finished step, as the policy sees it.
pub struct RowView<'a> {
    pub rid: u64,
    /// Raw logits of the row's last position (padding ids already excluded); empty when
    /// the policy declared `Needs::no_logits`.
    pub logits: &'a [f32],
    /// The token this model just sampled at that position.
    pub token: u32,
    /// Prompt tokens.
    pub prompt: &'a [u32],
    /// Output so far, *without* `token`.
    pub output: &'a [u32],
    /// Which model wrote each output token.
    pub sources: &'a [ModelIndex],
    /// Tokens this model has written since the request last arrived here.
    pub visit_tokens: usize,
    /// Per-request seed (stable across runs and batch compositions).
    pub seed: u64,
    /// Normalised entropy `H / ln V` of the row's distribution (V: the sampled vocabulary),
    /// when the policy declared `Needs::entropy`.
    pub entropy: Option<f32>,
    /// The largest logits of the row, descending, when the policy declared
    /// `Needs::top_logits`.
    pub top_logits: Option<&'a [f32]>,
    /// The request's own overrides of this method's kwargs (already checked against
    /// `Policy::tunables`).
    pub routing: &'a RoutingOverrides,
    /// The tokens the row's constraint (structured output, token restrictions) lets it
    /// write; `None`: any.
    pub allowed: Option<&'a dyn AllowedTokens>,
}

/// The tokens a constrained row may write.
pub trait AllowedTokens {
    fn allows(&self, id: u32) -> bool;
}

impl RowView<'_> {
    /// A tunable kwarg for this row: the request's override, else the configured value.
    pub fn kwarg(&self, key: &str, configured: f32) -> f32 {
        self.routing.get(key).map_or(configured, |v| v as f32)
    }

    /// The normalised entropy: from the step when it was computed there, else from the
    /// logits.
    pub fn normalised_entropy(&self) -> f32 {
        self.entropy
            .unwrap_or_else(|| crate::methods::basic::normalised_entropy(self.logits))
    }
}

/// A finished step of one model.
pub struct StepView<'a> {
    pub model: ModelIndex,
    pub rows: &'a [RowView<'a>],
    /// `[rows, hidden]` on the model's device, when `Needs::hidden` was set.
    pub hidden: Option<&'a Tensor>,
}

/// The decision for one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// `None` = stay at this model.
    pub to: Option<ModelIndex>,
    /// The router's score for this position (probability, entropy, ...), for provenance.
    pub score: Option<f32>,
}

impl Decision {
    pub const STAY: Decision = Decision {
        to: None,
        score: None,
    };

    pub fn stay(score: Option<f32>) -> Self {
        Decision { to: None, score }
    }

    pub fn go(to: ModelIndex, score: Option<f32>) -> Self {
        Decision {
            to: Some(to),
            score,
        }
    }
}

/// A kwarg a request may override through `"routing": {key: value}`, and the range the
/// method accepts for it (the config may narrow it, `system.request_routing`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tunable {
    pub key: &'static str,
    pub min: f64,
    pub max: f64,
}

impl Tunable {
    /// A probability-like kwarg in [0, 1].
    pub const fn unit(key: &'static str) -> Tunable {
        Tunable {
            key,
            min: 0.0,
            max: 1.0,
        }
    }
}

/// What happens to the token a model just wrote when the request leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendMode {
    /// Append it to the output; the receiver continues after it.
    KeepLast,
    /// Discard it: the receiver rewrites this position (`output_ids[:-1]`).
    DropLast,
}

/// Where a policy sits: its model, every model's name, the config file. All that checking
/// a method's kwargs needs — no weights — so a config is checked completely before any
/// model loads.
#[derive(Clone, Debug)]
pub struct ModelSite {
    pub model: ModelIndex,
    pub model_names: Vec<String>,
    pub config_file: PathBuf,
}

impl ModelSite {
    /// This model's name (for messages).
    pub fn name(&self) -> &str {
        self.model_names
            .get(self.model)
            .map(String::as_str)
            .unwrap_or("?")
    }

    /// A path from scheduler_kwargs, relative to the config file; a leading
    /// `$TOKENROUTER_CACHE/` stands for the tokenrouter cache (where trained routers live),
    /// which is also found when the variable is unset (`~/.cache/tokenrouter`).
    pub fn resolve_path(&self, p: &str) -> PathBuf {
        if let Some(rest) = p
            .strip_prefix("$TOKENROUTER_CACHE/")
            .or_else(|| p.strip_prefix("${TOKENROUTER_CACHE}/"))
        {
            return cache_dir().join(rest);
        }
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.config_file
                .parent()
                .map(|d| d.join(p))
                .unwrap_or_else(|| p.to_path_buf())
        }
    }
}

/// Read-only facts about the models, given to policies at construction.
#[derive(Clone)]
pub struct PolicyContext {
    /// This policy's model.
    pub model: ModelIndex,
    /// All model names, index order (0 = entry).
    pub model_names: Vec<String>,
    /// Token id -> decoded text, for text-aware policies (e.g. GlimpRouter's "\n\n").
    pub token_text: Arc<Vec<String>>,
    /// Vocabulary size of this model's logits (before padding is masked).
    pub vocab_size: usize,
    /// Ids at or above this are padding and never sampled.
    pub sample_limit: usize,
    /// The config file (for relative weight paths and error messages).
    pub config_file: PathBuf,
    /// The model's input embedding of token ids, `[n, hidden]` (routers such as R2R use
    /// the small model's embedding).
    pub embed: Option<tokenrouter_runtime::model::Embedder>,
    /// Device of this model (routers run next to it).
    pub device: candle_core::Device,
}

impl PolicyContext {
    /// This policy's place among the models (what its kwargs are checked against).
    pub fn site(&self) -> ModelSite {
        ModelSite {
            model: self.model,
            model_names: self.model_names.clone(),
            config_file: self.config_file.clone(),
        }
    }

    /// See [`ModelSite::resolve_path`].
    pub fn resolve_path(&self, p: &str) -> PathBuf {
        self.site().resolve_path(p)
    }
}

pub trait Policy: Send {
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// Kwargs a request may override for itself (read them with `RowView::kwarg`).
    fn tunables(&self) -> Vec<Tunable> {
        Vec::new()
    }

    /// Decide, for every row of a finished step, whether the request stays or moves.
    fn route(&mut self, step: &StepView<'_>) -> Vec<Decision>;

    /// What the receiver gets when a request leaves this model.
    fn send(&self, _rid: u64, _to: ModelIndex) -> SendMode {
        SendMode::DropLast
    }

    /// How many tokens of an incoming delta this model accepts (a prefix; default all).
    fn receive(&mut self, _rid: u64, _from: ModelIndex, delta: &[u32]) -> usize {
        delta.len()
    }

    /// The request finished or was aborted: drop any per-request state.
    fn forget(&mut self, _rid: u64) {}
}

/// Builds one model's policy from its kwargs.
pub type PolicyFactory =
    fn(kwargs: &serde_yaml::Value, ctx: &PolicyContext) -> Result<Box<dyn Policy>, ConfigError>;

/// Parses one model's kwargs into the method's typed settings and checks every value that
/// needs no weights (ranges, target models, required keys) — the same function the
/// factory starts with, so the check and the build cannot disagree.
pub type KwargsCheck = fn(kwargs: &serde_yaml::Value, site: &ModelSite) -> Result<(), ConfigError>;

/// A registered method: its kwargs check and its factory.
#[derive(Clone, Copy)]
struct Method {
    check: KwargsCheck,
    build: PolicyFactory,
}

/// Name -> factory. Names follow TokenRouter (`r2r_slm`, `r2r_llm`, ...).
pub struct Registry {
    methods: HashMap<&'static str, Method>,
}

impl Registry {
    pub fn empty() -> Self {
        Self {
            methods: HashMap::new(),
        }
    }

    pub fn register(&mut self, name: &'static str, check: KwargsCheck, build: PolicyFactory) {
        self.methods.insert(name, Method { check, build });
    }

    pub fn names(&self) -> Vec<&'static str> {
        let mut v: Vec<_> = self.methods.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn method(&self, name: &str, site: &ModelSite) -> Result<Method, ConfigError> {
        self.methods
            .get(name)
            .copied()
            .ok_or_else(|| ConfigError::Invalid {
                file: site.config_file.clone(),
                message: format!(
                    "model.{}.scheduler_class: unknown `{name}` (known: {})",
                    site.name(),
                    self.names().join(", ")
                ),
            })
    }

    /// Checks a model's `scheduler_class` and kwargs without building anything.
    pub fn check(
        &self,
        name: &str,
        kwargs: &serde_yaml::Value,
        site: &ModelSite,
    ) -> Result<(), ConfigError> {
        (self.method(name, site)?.check)(kwargs, site)
    }

    pub fn build(
        &self,
        name: &str,
        kwargs: &serde_yaml::Value,
        ctx: &PolicyContext,
    ) -> Result<Box<dyn Policy>, ConfigError> {
        (self.method(name, &ctx.site())?.build)(kwargs, ctx)
    }
}

impl Default for Registry {
    /// Every method shipped with tokenrouter.
    fn default() -> Self {
        let mut r = Registry::empty();
        crate::methods::register_all(&mut r);
        r
    }
}

/// The tokenrouter cache (trained routers live there).
#[cfg(feature = "fetch")]
fn cache_dir() -> PathBuf {
    tokenrouter_fetch::default_cache_dir()
}

/// The tokenrouter cache without the fetch crate, by the fetch crate's rule:
/// `TOKENROUTER_CACHE`, else `$XDG_CACHE_HOME/tokenrouter`, else `~/.cache/tokenrouter`.
#[cfg(not(feature = "fetch"))]
fn cache_dir() -> PathBuf {
    let set = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    set("TOKENROUTER_CACHE")
        .or_else(|| set("XDG_CACHE_HOME").map(|x| x.join("tokenrouter")))
        .or_else(|| set("HOME").map(|h| h.join(".cache").join("tokenrouter")))
        .unwrap_or_else(|| std::env::temp_dir().join("tokenrouter-cache"))
}
