//! The `tokenrouter` binary: `serve` (OpenAI-compatible server over the routing engine),
//! `generate` (quick raw completions), `fetch` (default models), `bench` (load generator),
//! `bench-model` (runtime speed), `plan-batching` (delayed-batching planner), `eval`
//! (routing quality), `train-router` (learned routers for a pair).
//!
//! A library so the same commands run from the binary and from the Python package
//! (`tokenrouter` console script, `python -m tokenrouter.launch_server`), which calls
//! [`run_with_args`]; [`engine_config`] is the one place a config becomes typed values.

mod device_bench;
mod fused_check;
mod kernel_env;
mod matmul_bench;
mod model_bench;
mod run_batch;
mod subserver;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tokenrouter_engine::{Engine, EngineConfig};
use tokenrouter_runtime::{
    load_model, KvBudget, LoadOptions, Row, Sampler, SamplingParams, StepOptions,
};

/// The configuration `serve` uses when none is given.
const DEFAULT_CONFIG: &str =
    include_str!("../../../config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml");

#[derive(Parser)]
#[command(
    name = "tokenrouter",
    version,
    about = "Token-level routing between LLMs that share a tokenizer"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API (default: the Qwen2.5-Coder 0.5B/1.5B pair on CPU).
    Serve(ServeArgs),
    /// Answer an OpenAI batch file (JSONL) in this process, as vLLM's `run_batch`.
    RunBatch(run_batch::RunBatchArgs),
    /// Serve one model of a config to a front end in another process (its `address:`).
    Subserver(subserver::SubserverArgs),
    /// Print a raw continuation of a prompt (no chat template) with one model.
    Generate(GenerateArgs),
    /// Download the default models into the cache (no-op when present).
    Fetch {
        /// Cache directory (default: $TOKENROUTER_CACHE or ~/.cache/tokenrouter).
        #[arg(long, env = "TOKENROUTER_CACHE")]
        cache_dir: Option<PathBuf>,
    },
    /// Load generator for any OpenAI-compatible server.
    Bench(tokenrouter_bench::BenchArgs),
    /// Measure one model's prefill and decode speed with the runtime alone.
    BenchModel(model_bench::ModelBenchArgs),
    /// Delayed-batching planner (exact Markov model).
    PlanBatching(tokenrouter_planner::PlanArgs),
    /// Quality evaluation (HumanEval or your JSONL): small, large, routed sweep, random,
    /// request-level baselines, Pareto plot.
    Eval(tokenrouter_eval::EvalArgs),
    /// Train a learned router (R2R's classifier) for a pair: `label`, optionally `diverge`, then `fit`.
    #[command(subcommand)]
    TrainRouter(tokenrouter_train::TrainCommand),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// YAML config (TokenRouter shape); default: the built-in CPU pair.
    #[arg(long, env = "TOKENROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// Change one value of the config: `--set model.quick.scheduler_kwargs.threshold=0.1`
    /// (the value is YAML; repeatable; the path must lead into the config).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    #[arg(long, env = "TOKENROUTER_HOST", default_value = "0.0.0.0")]
    host: String,
    #[arg(long, env = "TOKENROUTER_PORT", default_value_t = 30000)]
    port: u16,
    /// Require `Authorization: Bearer <key>` on /v1/*, SGLang's /generate,
    /// /health_generate, /get_model_info, /flush_cache and /abort_request, and vLLM's
    /// /reset_prefix_cache.
    #[arg(long, env = "TOKENROUTER_API_KEY")]
    api_key: Option<String>,
    /// Seconds in-flight requests get to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Browser origins allowed to call the API (CORS), comma-separated or repeated; `*` for
    /// any. Default: none (no CORS headers).
    #[arg(long, env = "TOKENROUTER_ALLOWED_ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// How chat answers' tool calls are read when a request has `tools`: `hermes`
    /// (`<tool_call>{json}</tool_call>`, Qwen2.5 / Qwen3; also `qwen25`), `llama3_json`
    /// (bare `{"name", "parameters"}` calls, Llama 3.1+; also `llama3`) or `none` (the text
    /// as written).
    #[arg(long, default_value = "hermes")]
    tool_call_parser: tokenrouter_server::ToolCallParser,
    /// How reasoning models' thinking is told from their answer in chat responses:
    /// `qwen3` (thinking when the answer opens with `<think>`), `deepseek_r1` (thinking
    /// until `</think>`) or `none` (the text as written). The thinking is sent as
    /// `reasoning_content` and `reasoning`.
    #[arg(long, default_value = "none")]
    reasoning_parser: tokenrouter_server::ReasoningParser,
    /// Which waiting request each model serves next (vLLM's flag): `fcfs` (arrival order;
    /// a request's `priority` must be 0) or `priority` (lowest `priority` first, then
    /// arrival; preemption frees the highest first). Sets `system.scheduling_policy`.
    #[arg(long, value_parser = ["fcfs", "priority"])]
    scheduling_policy: Option<String>,
    /// Responses API answers kept in memory for `previous_response_id` and
    /// `GET /v1/responses/{id}`, the oldest dropped first; 0 stores none (`store` is then
    /// answered `false`).
    #[arg(long, default_value_t = 1000)]
    max_stored_responses: usize,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A GGUF file, a Hugging Face directory, a model id in the HF cache, or a default name.
    #[arg(long)]
    model: String,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs the command line `args` (program name first) and returns the process exit code:
/// 0 on success, 2 for a usage error (after printing clap's message), 1 for a failure
/// (after printing its cause chain).
pub fn run_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    init_tracing();
    match run(cli.command) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("Error: {e:?}");
            1
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Serve(a) => serve(a),
        Command::RunBatch(a) => run_batch::run(a),
        Command::Subserver(a) => subserver::run(a),
        Command::Generate(a) => generate(a),
        Command::Fetch { cache_dir } => {
            let dir = cache_dir.unwrap_or_else(tokenrouter_fetch::default_cache_dir);
            for p in tokenrouter_fetch::fetch_default_models(&dir, true)? {
                println!("{}", p.display());
            }
            Ok(())
        }
        Command::Bench(a) if !a.report.is_empty() => {
            print!("{}", tokenrouter_bench::compare_runs(&a.report)?);
            Ok(())
        }
        Command::Bench(a) => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(tokenrouter_bench::run(a))?;
            Ok(())
        }
        Command::BenchModel(a) => model_bench::run(a),
        Command::TrainRouter(c) => Ok(tokenrouter_train::run(c)?),
        Command::Eval(a) => {
            let rt = tokio::runtime::Runtime::new()?;
            let outcome = rt.block_on(tokenrouter_eval::run(a))?;
            print!("{}", outcome.table);
            if let Some(c) = outcome.calibration {
                println!("{c}");
            }
            Ok(())
        }
        Command::PlanBatching(a) => {
            print!("{}", tokenrouter_planner::run(&a)?);
            Ok(())
        }
    }
}

/// The config file (or the built-in default) with the environment's kernel switches over
/// every model's `runtime:` options.
pub fn engine_config(path: Option<&std::path::Path>) -> Result<EngineConfig> {
    engine_config_with(path, &[])
}

/// [`engine_config`] with `--set KEY=VALUE` overrides applied before the typed parse.
pub fn engine_config_with(
    path: Option<&std::path::Path>,
    overrides: &[String],
) -> Result<EngineConfig> {
    let cfg = match path {
        Some(p) => EngineConfig::from_file_with_overrides(p, overrides)?,
        None => EngineConfig::from_yaml_with_overrides(
            DEFAULT_CONFIG,
            std::path::Path::new("<built-in default config>"),
            overrides,
        )?,
    };
    with_kernel_env(cfg)
}

/// A config given as YAML (or JSON) text; `origin` names it in errors and anchors relative
/// paths, as a file's location would.
pub fn engine_config_from_yaml(text: &str, origin: &std::path::Path) -> Result<EngineConfig> {
    with_kernel_env(EngineConfig::from_yaml(text, origin)?)
}

fn with_kernel_env(mut cfg: EngineConfig) -> Result<EngineConfig> {
    for m in &mut cfg.models {
        kernel_env::apply(&mut m.section.runtime)?;
    }
    Ok(cfg)
}

fn serve(a: ServeArgs) -> Result<()> {
    let mut overrides = a.set.clone();
    if let Some(policy) = &a.scheduling_policy {
        overrides.push(format!("system.scheduling_policy={policy}"));
    }
    let cfg = engine_config_with(a.config.as_deref(), &overrides)?;
    let cors = tokenrouter_server::CorsPolicy::parse(&a.allowed_origins)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        // Models load in the background: /health answers 503 until they are ready.
        let engine = Engine::start(cfg)?;
        tracing::info!("listening on http://{addr} (loading models; /health is 503 until ready)");
        let watcher = engine.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                if let Some(e) = watcher.load_error() {
                    tracing::error!("cannot start: {e}");
                    std::process::exit(1);
                }
                if tokenrouter_api::Backend::is_ready(&watcher) {
                    tracing::info!("ready: try  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Write a haiku about Rust\"}}]}}'");
                    return;
                }
            }
        });
        let server_cfg = tokenrouter_server::ServerConfig {
            shutdown_grace: std::time::Duration::from_secs(a.shutdown_grace),
            tool_call_parser: a.tool_call_parser,
            reasoning_parser: a.reasoning_parser,
            max_stored_responses: a.max_stored_responses,
            ..server_config(&engine, a.api_key, cors)
        };
        let backend: Arc<dyn tokenrouter_api::Backend> = Arc::new(engine.clone());
        tokenrouter_server::serve(listener, backend, server_cfg, shutdown_signal()).await?;
        engine.shutdown();
        tracing::info!("stopped");
        Ok(())
    })
}

/// The server's settings for `engine`'s config: its served model names, and the key and
/// CORS policy given.
pub(crate) fn server_config(
    engine: &Engine,
    api_key: Option<String>,
    cors: tokenrouter_server::CorsPolicy,
) -> tokenrouter_server::ServerConfig {
    let defaults = tokenrouter_server::ServerConfig::default();
    let system = &engine.config().system;
    tokenrouter_server::ServerConfig {
        api_key,
        cors,
        served_model_name: system
            .served_model_name
            .clone()
            .unwrap_or(defaults.served_model_name.clone()),
        served_model_aliases: system.served_model_aliases.clone(),
        ..defaults
    }
}

pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    let loc = tokenrouter_fetch::resolve_model(&a.model)?;
    let t0 = Instant::now();
    let mut m = load_model(
        loc.path(),
        &LoadOptions {
            kv: KvBudget::Tokens(a.max_tokens + 4096),
            kernels: kernel_env::from_env()?,
            ..Default::default()
        },
    )?;
    eprintln!(
        "loaded {} in {:.2}s",
        loc.path().display(),
        t0.elapsed().as_secs_f64()
    );
    let prompt = m.text.encode(&a.prompt)?;
    let limit = m.text.real_vocab_len();
    let cfg = SamplingParams {
        temperature: a.temperature,
        seed: Some(a.seed),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(cfg, a.seed, &prompt);
    let mut next = prompt.clone();
    let mut out: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let mut stdout = std::io::stdout();
    let t1 = Instant::now();
    let mut first = None;
    while out.len() < a.max_tokens {
        let logits = m
            .runner
            .step(&[Row::new(1, next)], StepOptions::default())?
            .logits_rows()?;
        first.get_or_insert_with(|| t1.elapsed());
        let tok = sampler.sample(&logits[0], limit, 0).token;
        if m.text.eos_ids().contains(&tok) {
            break;
        }
        out.push(tok);
        sampler.observe(tok);
        // Print only complete UTF-8 text.
        let text = m.text.decode(&out, true)?;
        if !text.ends_with('\u{FFFD}') && text.len() > printed {
            write!(stdout, "{}", &text[printed..])?;
            stdout.flush()?;
            printed = text.len();
        }
        next = vec![tok];
    }
    writeln!(stdout)?;
    let total = t1.elapsed().as_secs_f64();
    let prefill = first.map(|d| d.as_secs_f64()).unwrap_or(total);
    let decode_n = out.len().saturating_sub(1).max(1);
    eprintln!(
        "prompt {} tokens: prefill {:.1} tok/s; {} tokens: decode {:.1} tok/s",
        prompt.len(),
        prompt.len() as f64 / prefill,
        out.len(),
        decode_n as f64 / (total - prefill).max(1e-9)
    );
    Ok(())
}
