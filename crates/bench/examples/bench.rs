//! Runs the load generator from the command line, e.g.
//! `cargo run --release -p tokenrouter-bench --example bench -- --concurrency 4 --dataset math`.

use clap::Parser;
use tokenrouter_bench::{run, BenchArgs};

#[tokio::main]
async fn main() {
    let args = BenchArgs::parse();
    if let Err(e) = run(args).await {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
