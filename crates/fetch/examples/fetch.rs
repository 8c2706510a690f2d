//! Command-line front end for manual use: `fetch [CACHE_DIR]` puts the default model pair into
//! the tokenrouter cache (default: `default_cache_dir()`); `fetch --resolve SPEC` prints where a
//! model spec resolves to.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use tokenrouter_fetch::{default_cache_dir, fetch_default_models, resolve_model, ModelLocation};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let start = Instant::now();
    let result = match args.as_slice() {
        [flag, spec] if flag == "--resolve" => resolve_model(spec).map(|loc| match loc {
            ModelLocation::Gguf(p) => vec![format!("gguf {}", p.display())],
            ModelLocation::HfDir(p) => vec![format!("hf-dir {}", p.display())],
        }),
        [] | [_] => {
            let dir = args
                .first()
                .map(PathBuf::from)
                .unwrap_or_else(default_cache_dir);
            fetch_default_models(&dir, true)
                .map(|paths| paths.iter().map(|p| p.display().to_string()).collect())
        }
        _ => {
            eprintln!("usage: fetch [CACHE_DIR] | fetch --resolve SPEC");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            eprintln!("done in {:.1}s", start.elapsed().as_secs_f64());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
