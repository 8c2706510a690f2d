//! Serves the deterministic mock backend of the integration tests on a port, to try the
//! API by hand (curl, the `openai` client, `tests/openai_client.py`) before the real
//! engine is wired in:
//!
//!     cargo run -p tokenrouter-server --example mock_server -- 30000 [api-key]
//!     python3 crates/server/tests/openai_client.py --base-url http://127.0.0.1:30000/v1

#[path = "../tests/server/mock.rs"]
mod mock;

use std::time::Duration;

use mock::{MockBackend, MockConfig};
use tokenrouter_server::{serve, ServerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let port: u16 = match args.next() {
        Some(p) => p.parse()?,
        None => 30000,
    };
    let cfg = ServerConfig {
        api_key: args.next(),
        shutdown_grace: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    let backend = MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(5),
        ..MockConfig::default()
    });
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("mock tokenrouter on http://127.0.0.1:{port}/v1 (ctrl-c to stop)");
    serve(listener, backend, cfg, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
