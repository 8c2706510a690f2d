//! `tokenrouter bench`: a load generator for any OpenAI-compatible server (tokenrouter, llama.cpp's
//! llama-server, vLLM). It streams every request, measures TTFT / TPOT / ITL / end-to-end latency,
//! counts failures without aborting, aggregates tokenrouter's per-model provenance when the server
//! sends it, prints a table like vLLM's `bench serve` and writes `requests.csv` + `summary.json`.
//!
//! Two load shapes: closed loop (`--concurrency N`: N requests always in flight, each finished one
//! immediately replaced) and open loop (`--request-rate R`: Poisson arrivals, optionally capped by
//! `--max-concurrency`). The request list is `--num-prompts` prompts (cycling through the dataset)
//! times `--repeats`, in that order.

mod args;
mod builtin;
mod client;
mod compare;
mod dataset;
mod report;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::sync::{mpsc, Semaphore};

pub use args::{BenchArgs, BenchError, Endpoint};
pub use client::RequestRecord;
pub use compare::{compare_runs, read_requests_csv};
pub use dataset::{load as load_dataset, Prompt};
pub use report::{Stats, Summary, CSV_COLUMNS};

/// One request to send.
struct Job {
    index: usize,
    prompt_index: usize,
    repeat: usize,
    body: Value,
}

/// Shared, read-only context of the request tasks.
struct Ctx {
    client: reqwest::Client,
    url: String,
    api_key: Option<String>,
    timeout: Duration,
    t0: Instant,
    progress: ProgressBar,
}

impl Ctx {
    async fn send(&self, job: &Job) -> RequestRecord {
        let rec = RequestRecord {
            index: job.index,
            prompt_index: job.prompt_index,
            repeat: job.repeat,
            start_ms: self.t0.elapsed().as_secs_f64() * 1000.0,
            ..RequestRecord::default()
        };
        let rec = client::execute(
            &self.client,
            &self.url,
            self.api_key.as_deref(),
            &job.body,
            self.timeout,
            rec,
        )
        .await;
        self.progress.inc(1);
        rec
    }
}

/// Asks `GET /v1/models` for the first model id; `None` when the server does not say.
async fn discover_model(client: &reqwest::Client, args: &BenchArgs) -> Option<String> {
    let mut req = client.get(format!("{}/models", args::api_root(&args.base_url)));
    if let Some(key) = &args.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req.timeout(Duration::from_secs(10)).send().await.ok()?;
    let v: Value = resp.error_for_status().ok()?.json().await.ok()?;
    v.get("data")?
        .get(0)?
        .get("id")?
        .as_str()
        .map(str::to_string)
}

fn progress_bar(args: &BenchArgs, total: usize) -> ProgressBar {
    if args.no_progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests ({per_sec}, eta {eta})",
    ) {
        pb.set_style(style);
    }
    pb
}

/// Runs the benchmark described by `args`, prints the table (unless `--quiet`) and writes the
/// output files (with `--out-dir`). Failed requests are counted, they do not stop the run.
pub async fn run(args: BenchArgs) -> Result<Summary, BenchError> {
    let args = args.resolve_positional()?;
    args.validate()?;
    let prompts = dataset::load(&args.dataset)?;
    let client = reqwest::Client::builder()
        .build()
        .map_err(BenchError::Client)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &args)
            .await
            .unwrap_or_else(|| "default".to_string()),
    };
    let num_prompts = args.num_prompts.unwrap_or(prompts.len());
    let jobs: Vec<Job> = (0..args.repeats)
        .flat_map(|repeat| (0..num_prompts).map(move |i| (repeat, i)))
        .enumerate()
        .map(|(index, (repeat, i))| Job {
            index,
            prompt_index: i % prompts.len(),
            repeat,
            body: prompts[i % prompts.len()].body(&args, &model, index as u64),
        })
        .collect();
    let total = jobs.len();
    let ctx = Arc::new(Ctx {
        client,
        url: args.endpoint_url(),
        api_key: args.api_key.clone(),
        timeout: Duration::from_secs_f64(args.request_timeout),
        t0: Instant::now(),
        progress: progress_bar(&args, total),
    });
    let jobs = Arc::new(jobs);
    let (tx, mut rx) = mpsc::unbounded_channel::<RequestRecord>();
    let concurrency = match args.request_rate {
        None => Some(args.concurrency.unwrap_or(1)),
        Some(_) => None,
    };
    match (concurrency, args.request_rate) {
        (Some(c), _) => closed_loop(&ctx, &jobs, c, &tx),
        (None, Some(rate)) => {
            open_loop(&ctx, &jobs, rate, args.max_concurrency, args.seed, &tx).await
        }
        (None, None) => {}
    }
    drop(tx);
    let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
    while let Some(r) = rx.recv().await {
        records.push(r);
    }
    let duration_s = ctx.t0.elapsed().as_secs_f64();
    ctx.progress.finish_and_clear();
    records.sort_by_key(|r| r.index);
    let summary = report::summarize(
        report::RunInfo {
            base_url: args.base_url.clone(),
            endpoint: ctx.url.clone(),
            model,
            concurrency,
            request_rate: args.request_rate,
            max_concurrency: args.max_concurrency,
            max_tokens: args.max_tokens,
        },
        &records,
        duration_s,
    );
    if let Some(dir) = &args.out_dir {
        report::write_outputs(dir, &records, &summary)?;
    }
    if !args.quiet {
        print!("{}", summary.table());
        if let Some(dir) = &args.out_dir {
            println!(
                "Wrote {} and summary.json",
                dir.join("requests.csv").display()
            );
        }
    }
    Ok(summary)
}

/// `concurrency` workers, each sending the next unsent request as soon as its previous one ends.
fn closed_loop(
    ctx: &Arc<Ctx>,
    jobs: &Arc<Vec<Job>>,
    concurrency: usize,
    tx: &mpsc::UnboundedSender<RequestRecord>,
) {
    let next = Arc::new(AtomicUsize::new(0));
    for _ in 0..concurrency.min(jobs.len()) {
        let (ctx, jobs, next, tx) = (ctx.clone(), jobs.clone(), next.clone(), tx.clone());
        tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                if tx.send(ctx.send(job).await).is_err() {
                    break;
                }
            }
        });
    }
}

/// Poisson arrivals at `rate` requests/s (all at once when infinite); with `max_concurrency`, an
/// arrival waits for a free slot before it is sent.
async fn open_loop(
    ctx: &Arc<Ctx>,
    jobs: &Arc<Vec<Job>>,
    rate: f64,
    max_concurrency: Option<usize>,
    seed: Option<u64>,
    tx: &mpsc::UnboundedSender<RequestRecord>,
) {
    let mut rng = StdRng::seed_from_u64(seed.unwrap_or(0));
    let slots = max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = tokio::time::Instant::now();
    let mut at = 0.0f64;
    for i in 0..jobs.len() {
        if i > 0 && rate.is_finite() {
            let u: f64 = rng.random();
            at += -(1.0 - u).ln() / rate;
        }
        tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
        let permit = match &slots {
            Some(s) => match s.clone().acquire_owned().await {
                Ok(p) => Some(p),
                Err(_) => break,
            },
            None => None,
        };
        let (ctx, jobs, tx) = (ctx.clone(), jobs.clone(), tx.clone());
        tokio::spawn(async move {
            let rec = ctx.send(&jobs[i]).await;
            drop(permit);
            let _ = tx.send(rec);
        });
    }
}
