//! The engine as a library: load a YAML config, generate a whole completion, then stream
//! one token by token, printing which model wrote each piece.
//!
//! ```sh
//! cargo run --release -p tokenrouter-engine --example library                  # default CPU pair
//! cargo run --release -p tokenrouter-engine --example library -- config/random/qwen2.5-coder-0.5b_1.5b_cpu.yaml "def add(a, b):"
//! ```
//! (The default config's models are fetched on first use, like `tokenrouter serve`.)

use std::io::Write;
use std::path::PathBuf;

use tokenrouter_api::{Backend, ChatMessage, GenerateEvent};
use tokenrouter_engine::{Engine, GenerateParams};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let config = args.next().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../config/rstitch/qwen2.5-coder-0.5b_1.5b_cpu.yaml")
    });
    let prompt = args
        .next()
        .unwrap_or_else(|| "def is_prime(n: int) -> bool:".to_string());

    // Loads every model (blocking) and starts the sub-servers and the inter-model loop.
    let engine = Engine::from_config(&config)?;
    let names: Vec<String> = engine.models().into_iter().map(|m| m.name).collect();

    // 1. A whole completion of a raw prompt (no chat template), greedy by default.
    let params = GenerateParams {
        max_tokens: 48,
        ..GenerateParams::default()
    };
    let g = engine.generate(&prompt, params.clone()).await?;
    let mut counts = vec![0usize; names.len()];
    for &s in &g.sources {
        counts[s] += 1;
    }
    println!("== generate ({:?})\n{prompt}{}", g.finish_reason, g.text);
    for (name, n) in names.iter().zip(&counts) {
        println!("  {name}: {n} tokens");
    }

    // 2. A stream, here of a chat prompt rendered with the model's chat template.
    let chat = engine.apply_chat_template(
        &[ChatMessage::new(
            "user",
            "Explain in one sentence what a hash map is.",
        )],
        true,
        &serde_json::json!({}),
    )?;
    let text = engine.text().ok_or("engine not ready")?;
    let mut stream = engine.generate_stream(&chat, params)?;
    println!("\n== generate_stream (each piece tagged with the model that wrote it)");
    let (mut ids, mut printed, mut last_source) = (Vec::new(), 0usize, None);
    let mut out = std::io::stdout();
    while let Some(event) = stream.events.recv().await {
        match event {
            GenerateEvent::Token(t) => {
                ids.push(t.id);
                // Print only whole UTF-8 text; tag every change of model.
                let so_far = text.decode(&ids, true)?;
                if so_far.ends_with('\u{FFFD}') || so_far.len() <= printed {
                    continue;
                }
                if last_source != Some(t.source) {
                    write!(out, "[{}]", names[t.source])?;
                    last_source = Some(t.source);
                }
                write!(out, "{}", &so_far[printed..])?;
                out.flush()?;
                printed = so_far.len();
            }
            GenerateEvent::Finished { reason } => {
                println!("\n(finished: {reason:?}, {} tokens)", ids.len());
                break;
            }
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(e) => return Err(e.into()),
            // Only asked for by `prompt_logprobs`, which this example does not set.
            GenerateEvent::Prompt(_) => {}
        }
    }
    engine.shutdown();
    Ok(())
}
