//! What the remote end-to-end tests share: a `tokenrouter subserver` child process, the tiny
//! pair's configs, requests and the waits on KV and health.
#![allow(dead_code)] // each test binary uses its own part

pub use std::io::{BufRead, BufReader};
pub use std::path::{Path, PathBuf};
pub use std::process::{Child, Command, Stdio};
pub use std::sync::atomic::Ordering;
pub use std::time::{Duration, Instant};

pub use tokenrouter_api::{Backend, GenerateEvent, SamplingParams};
pub use tokenrouter_engine::{Engine, EngineConfig, GenerateParams};

/// A running `tokenrouter subserver` for `reference`.
pub struct Remote {
    pub child: Child,
    pub peer: String,
    pub http: String,
}

impl Remote {
    pub fn start(config: &Path, listen: &str, extra: &[&str]) -> Remote {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .arg("subserver")
            .arg("--config")
            .arg(config)
            .args(["--model", "reference", "--listen", listen])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the sub-server");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut peer = None;
        let mut http = None;
        while peer.is_none() || http.is_none() {
            let line = lines
                .next()
                .expect("the sub-server prints its addresses")
                .expect("read");
            if let Some(a) = line.strip_prefix("listening on ") {
                peer = Some(a.to_string());
            }
            if let Some(a) = line.strip_prefix("http on ") {
                http = Some(a.to_string());
            }
        }
        Remote {
            child,
            peer: peer.unwrap_or_default(),
            http: http.unwrap_or_default(),
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn tiny(dir: &Path, p: f64) -> PathBuf {
    tokenrouter_engine::synth_pair::write_tiny_pair(dir, p, 3, "").expect("write the tiny pair")
}

pub fn front_config(file: &Path, peer: &str, extra: &[&str]) -> EngineConfig {
    let mut sets = vec![format!("model.reference.address={peer}")];
    sets.extend(extra.iter().map(|s| s.to_string()));
    EngineConfig::from_file_with_overrides(file, &sets).expect("front config")
}

pub async fn start(cfg: EngineConfig) -> Result<Engine, String> {
    let e = Engine::start(cfg).map_err(|e| e.to_string())?;
    let e2 = e.clone();
    tokio::task::spawn_blocking(move || e2.wait_ready(Duration::from_secs(120)))
        .await
        .expect("join")
        .map_err(|e| e.to_string())?;
    Ok(e)
}

pub const PROMPTS: [&str; 8] = [
    "def add(a, b):",
    "The quick brown fox",
    "import numpy as np\n",
    "SELECT * FROM",
    "Once upon a time",
    "fn main() {",
    "1, 2, 3, 5, 8,",
    "<html><body>",
];

pub fn params(seeded: bool, i: usize) -> GenerateParams {
    let mut p = GenerateParams {
        max_tokens: 32,
        ignore_eos: true,
        ..Default::default()
    };
    // Routing decisions are seeded by the request's seed: fix it, or each run routes anew.
    p.sampling.seed = Some(10 + i as u64);
    if seeded {
        p.sampling = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            presence_penalty: 0.5,
            // Every other prompt under llama.cpp's penalty window, which the remote rebuilds
            // from the tokens.
            repetition_penalty: 1.2,
            penalty_last_n: (i % 2 == 1).then_some(5),
            seed: Some(100 + i as u64),
            ..Default::default()
        };
        // Every third prompt through llama.cpp's chain, which travels with the request:
        // DRY (its window rebuilt from the tokens) and XTC (its draws from the request's
        // RNG, whose position travels). Dropping the chain on the wire fails this test.
        if i % 3 == 2 {
            p.sampling.llama = Some(tokenrouter_api::LlamaChain {
                // The tiny models' rows are flat (~1/256 a token): a low threshold.
                xtc_probability: 0.5,
                xtc_threshold: 0.002,
                dry: Some(tokenrouter_api::DryParams {
                    multiplier: 2.0,
                    base: 1.75,
                    allowed_length: 2,
                    penalty_last_n: None,
                    sequence_breakers: vec!["\n".into(), ", ".into()],
                }),
                ..Default::default()
            });
        }
    }
    p
}

/// (ids, sources) per prompt, one at a time (c = 1) or all at once (c = 8).
pub async fn outputs(e: &Engine, concurrent: bool, seeded: bool) -> Vec<(Vec<u32>, Vec<usize>)> {
    let mut out = Vec::new();
    if concurrent {
        let handles: Vec<_> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let e = e.clone();
                tokio::spawn(async move { e.generate(p, params(seeded, i)).await })
            })
            .collect();
        for h in handles {
            let g = h.await.expect("join").expect("generate");
            out.push((g.token_ids, g.sources));
        }
    } else {
        for (i, p) in PROMPTS.iter().enumerate() {
            let g = e.generate(p, params(seeded, i)).await.expect("generate");
            out.push((g.token_ids, g.sources));
        }
    }
    out
}

/// Wait until the front end is healthy again, then check a routed request uses the remote.
pub async fn back_in_service(front: &Engine, prompt: &str) {
    let start = Instant::now();
    while !front.unhealthy().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            front.unhealthy()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let g = front
        .generate(prompt, params(false, 2))
        .await
        .expect("served after the sub-server is back");
    assert!(g.sources.contains(&1));
}

/// The sub-server's own `/metrics` (not what the front end mirrors) show no KV in use.
pub async fn remote_kv_is_zero(remote: &Remote) {
    let start = Instant::now();
    loop {
        let (_, m) = http_get(format!("http://{}/metrics", remote.http)).await;
        let line = m
            .lines()
            .find(|l| l.contains("kv_cache_usage_perc{"))
            .unwrap_or_default()
            .to_string();
        if line.ends_with(" 0") {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "remote KV: {line}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn wait_free_async(front: &Engine) {
    let f = front.clone();
    tokio::task::spawn_blocking(move || wait_free(&f, Duration::from_secs(10)))
        .await
        .unwrap();
}

/// The first event after the tokens (its end), which must come within `within`.
pub async fn end_within(
    s: &mut tokenrouter_api::GenerateStream,
    within: Duration,
) -> Option<GenerateEvent> {
    tokio::time::timeout(within, async {
        loop {
            match s.events.recv().await {
                Some(GenerateEvent::Token(_) | GenerateEvent::PromptCached(_)) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the request ends within the timeout")
}

/// Waits for `n` tokens of `s` (told cached prompt tokens pass by; anything else fails).
pub async fn await_tokens(s: &mut tokenrouter_api::GenerateStream, n: usize) {
    let mut tokens = 0;
    while tokens < n {
        match s.events.recv().await {
            Some(GenerateEvent::Token(_)) => tokens += 1,
            Some(GenerateEvent::PromptCached(_)) => {}
            other => panic!("expected a token, got {other:?}"),
        }
    }
}

/// A 3000-token request for prompt `i`, running until the test ends it.
pub fn submit_long(e: &Engine, i: usize, pinned: Option<usize>) -> tokenrouter_api::GenerateStream {
    let mut p = params(false, i);
    p.max_tokens = 3000;
    p.pinned_model = pinned;
    let prompt = e.text().unwrap().encode(PROMPTS[i]).unwrap();
    e.submit(p.into_request(prompt)).unwrap()
}

pub fn wait_free(e: &Engine, within: Duration) {
    let shared = e.shared().expect("running");
    let start = Instant::now();
    loop {
        let used: Vec<usize> = shared
            .kv_used
            .iter()
            .map(|u| u.load(Ordering::SeqCst))
            .collect();
        let active = shared.active.load(Ordering::SeqCst);
        if used.iter().all(|&u| u == 0) && active == 0 {
            return;
        }
        assert!(
            start.elapsed() < within,
            "KV not freed: {used:?} blocks in use, {active} active requests"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub async fn http_get(url: String) -> (u16, String) {
    match reqwest::get(&url).await {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// Opens a session to the sub-server at `peer` with `hello` alone and returns its first answer.
pub async fn first_answer(
    peer: &str,
    hello: tokenrouter_wire::pb::FrontMsg,
) -> Option<tokenrouter_wire::pb::remote_msg::M> {
    let addr: tokenrouter_wire::PeerAddress = peer.parse().unwrap();
    let mut client = tokenrouter_wire::connect(&addr, &Default::default())
        .await
        .unwrap();
    let mut answers = client
        .session(tokio_stream::iter(vec![hello]))
        .await
        .unwrap()
        .into_inner();
    answers.message().await.unwrap().and_then(|m| m.m)
}
