//! Runs the delayed-batching planner from the command line, e.g.
//! `cargo run --release -p tokenrouter-planner --example plan -- --M 2 --N 4 --latencies 6.0 27.9
//! --P '[[0.65,0.35],[1,0]]' --C '[[1,0],[1,0]]' --delta 0.1`.

use clap::Parser;
use tokenrouter_planner::{run, PlanArgs};

fn main() {
    let args = PlanArgs::parse();
    match run(&args) {
        Ok(text) => print!("{text}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
