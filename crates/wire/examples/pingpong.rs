//! Round trips over the peer protocol on loopback: a session that answers every `Ping` with
//! a `Pong`, timed from the client. Prints p50 / p99 of the one-way time (half a round trip)
//! for TCP and a Unix socket.
//!
//!     cargo run --release -p tokenrouter-wire --example pingpong [-- ROUNDS]

use std::pin::Pin;
use std::time::{Duration, Instant};
use tokenrouter_wire::{connect, pb, Listener, Peer, PeerAddress};
use tokio_stream::{Stream, StreamExt};

struct Echo;

type Out = Pin<Box<dyn Stream<Item = Result<pb::RemoteMsg, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Peer for Echo {
    type SessionStream = Out;

    async fn session(
        &self,
        request: tonic::Request<tonic::Streaming<pb::FrontMsg>>,
    ) -> Result<tonic::Response<Out>, tonic::Status> {
        let out = request.into_inner().filter_map(|m| match m {
            Ok(pb::FrontMsg {
                m: Some(pb::front_msg::M::Ping(p)),
            }) => Some(Ok(pb::RemoteMsg {
                m: Some(pb::remote_msg::M::Pong(pb::Pong {
                    t0_ns: p.t0_ns,
                    remote_ns: 0,
                })),
            })),
            _ => None,
        });
        Ok(tonic::Response::new(Box::pin(out)))
    }
}

async fn measure(
    listen: PeerAddress,
    rounds: usize,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let listener = Listener::bind(&listen).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(listener.serve(Echo, Duration::from_secs(5), std::future::pending()));
    let mut client = connect(&addr, &Default::default()).await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut answers = client
        .session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut one_way = Vec::with_capacity(rounds);
    for i in 0..rounds + 100 {
        let t = Instant::now();
        tx.send(pb::FrontMsg {
            m: Some(pb::front_msg::M::Ping(pb::Ping { t0_ns: i as u64 })),
        })?;
        answers.message().await?.ok_or("the session ended")?;
        if i >= 100 {
            one_way.push(t.elapsed().as_secs_f64() / 2.0);
        }
    }
    one_way.sort_by(f64::total_cmp);
    let q = |p: f64| one_way[((one_way.len() - 1) as f64 * p) as usize] * 1e6;
    Ok((q(0.5), q(0.99)))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    let sock =
        std::env::temp_dir().join(format!("tokenrouter-pingpong-{}.sock", std::process::id()));
    for addr in [
        PeerAddress::Tcp("127.0.0.1:0".into()),
        PeerAddress::Ipc(sock.clone()),
    ] {
        let (p50, p99) = measure(addr.clone(), rounds).await?;
        println!("{addr}: {rounds} round trips, one way p50 {p50:.0} µs, p99 {p99:.0} µs");
    }
    let _ = std::fs::remove_file(sock);
    Ok(())
}
