//! `tokenrouter run-batch`: an OpenAI batch file (JSONL of chat / completions / Responses
//! requests) answered by the routed pair in this process, as vLLM's `run_batch` does — no
//! server, no port; every line goes through the same router as an HTTP request, so the
//! answers are the server's (`tokenrouter_server::batch`).

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokenrouter_engine::Engine;

#[derive(clap::Args)]
pub struct RunBatchArgs {
    /// The batch file: one `{"custom_id", "method": "POST", "url", "body"}` a line
    /// (`url`: /v1/chat/completions, /v1/completions or /v1/responses); `-` reads stdin.
    #[arg(short = 'i', long = "input-file")]
    input: PathBuf,
    /// Where the answers go, one line each in input order; `-` writes stdout.
    #[arg(short = 'o', long = "output-file")]
    output: PathBuf,
    /// YAML config (TokenRouter shape); default: the built-in CPU pair.
    #[arg(long, env = "TOKENROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// Change one value of the config (as `serve --set`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Lines in flight at once (the engine batches them); more than the engine's
    /// `max_queued_requests` only waits.
    #[arg(long, default_value_t = 64)]
    max_concurrency: usize,
}

pub fn run(a: RunBatchArgs) -> Result<()> {
    let lines = read_lines(&a.input)?;
    let cfg = crate::engine_config_with(a.config.as_deref(), &a.set)?;
    let engine = Engine::start(cfg)?;
    engine.wait_ready(Duration::from_secs(24 * 3600))?;
    let app = tokenrouter_server::router(
        Arc::new(engine.clone()),
        crate::server_config(&engine, None, Default::default()),
    );
    let total = lines.iter().filter(|l| !l.trim().is_empty()).count() as u64;
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} lines  {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out: BufWriter<Box<dyn Write>> = BufWriter::new(match a.output.to_str() {
        Some("-") => Box::new(std::io::stdout()),
        _ => Box::new(
            std::fs::File::create(&a.output)
                .with_context(|| format!("cannot write {}", a.output.display()))?,
        ),
    });
    let started = Instant::now();
    let rt = tokio::runtime::Runtime::new()?;
    let summary = rt.block_on(tokenrouter_server::batch::run_batch(
        app,
        lines,
        a.max_concurrency,
        |line| {
            bar.inc(1);
            writeln!(out, "{line}")
        },
    ));
    bar.finish();
    engine.shutdown();
    let summary = summary.with_context(|| format!("cannot write {}", a.output.display()))?;
    out.flush()
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "{} lines: {} succeeded, {} failed in {seconds:.1} s; {} completion tokens ({:.1} tok/s)",
        summary.succeeded + summary.failed,
        summary.succeeded,
        summary.failed,
        summary.completion_tokens,
        summary.completion_tokens as f64 / seconds.max(1e-9),
    );
    Ok(())
}

fn read_lines(input: &Path) -> Result<Vec<String>> {
    let text = match input.to_str() {
        Some("-") => std::io::read_to_string(std::io::stdin()).context("cannot read stdin")?,
        _ => std::fs::read_to_string(input)
            .with_context(|| format!("cannot read {}", input.display()))?,
    };
    Ok(text.lines().map(str::to_string).collect())
}
