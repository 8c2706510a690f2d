//! The tiny synthetic pair with its large model in a second process (`tokenrouter
//! subserver`) over the real transport on loopback: the same outputs as in one process,
//! KV freed on both sides, a killed or restarted sub-server, and peers that are not ours.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokenrouter_api::{Backend, GenerateEvent, SamplingParams};
use tokenrouter_engine::{Engine, EngineConfig, GenerateParams};

/// A running `tokenrouter subserver` for `reference`.
struct Remote {
    child: Child,
    peer: String,
    http: String,
}

impl Remote {
    fn start(config: &Path, listen: &str, extra: &[&str]) -> Remote {
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

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tiny(dir: &Path, p: f64) -> PathBuf {
    tokenrouter_engine::synth_pair::write_tiny_pair(dir, p, 3, "").expect("write the tiny pair")
}

fn front_config(file: &Path, peer: &str, extra: &[&str]) -> EngineConfig {
    let mut sets = vec![format!("model.reference.address={peer}")];
    sets.extend(extra.iter().map(|s| s.to_string()));
    EngineConfig::from_file_with_overrides(file, &sets).expect("front config")
}

async fn start(cfg: EngineConfig) -> Result<Engine, String> {
    let e = Engine::start(cfg).map_err(|e| e.to_string())?;
    let e2 = e.clone();
    tokio::task::spawn_blocking(move || e2.wait_ready(Duration::from_secs(120)))
        .await
        .expect("join")
        .map_err(|e| e.to_string())?;
    Ok(e)
}

const PROMPTS: [&str; 8] = [
    "def add(a, b):",
    "The quick brown fox",
    "import numpy as np\n",
    "SELECT * FROM",
    "Once upon a time",
    "fn main() {",
    "1, 2, 3, 5, 8,",
    "<html><body>",
];

fn params(seeded: bool, i: usize) -> GenerateParams {
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
            seed: Some(100 + i as u64),
            ..Default::default()
        };
    }
    p
}

/// (ids, sources) per prompt, one at a time (c = 1) or all at once (c = 8).
async fn outputs(e: &Engine, concurrent: bool, seeded: bool) -> Vec<(Vec<u32>, Vec<usize>)> {
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
async fn back_in_service(front: &Engine, prompt: &str) {
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
async fn remote_kv_is_zero(remote: &Remote) {
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

async fn wait_free_async(front: &Engine) {
    let f = front.clone();
    tokio::task::spawn_blocking(move || wait_free(&f, Duration::from_secs(10)))
        .await
        .unwrap();
}

/// The first event after the tokens (its end), which must come within `within`.
async fn end_within(
    s: &mut tokenrouter_api::GenerateStream,
    within: Duration,
) -> Option<GenerateEvent> {
    tokio::time::timeout(within, async {
        loop {
            match s.events.recv().await {
                Some(GenerateEvent::Token(_)) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the request ends within the timeout")
}

/// A 3000-token request for prompt `i`, running until the test ends it.
fn submit_long(e: &Engine, i: usize, pinned: Option<usize>) -> tokenrouter_api::GenerateStream {
    let mut p = params(false, i);
    p.max_tokens = 3000;
    p.pinned_model = pinned;
    let prompt = e.text().unwrap().encode(PROMPTS[i]).unwrap();
    e.submit(p.into_request(prompt)).unwrap()
}

fn wait_free(e: &Engine, within: Duration) {
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

async fn http_get(url: String) -> (u16, String) {
    match reqwest::get(&url).await {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// (concurrent, seeded sampling): greedy at c = 1 and c = 8, seeded sampling at c = 1.
/// Seeded sampling at c = 8 is left out: in one process it already varies from run to run
/// (1 to 5 of 40 outputs differed over five repeats; batch composition changes the logits in the last bits,
/// which can move a sampled token across a boundary), so it has nothing exact to match.
const CASES: [(bool, bool); 3] = [(false, false), (true, false), (false, true)];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_matches_in_process_at_c1_and_c8() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let local = start(EngineConfig::from_file(&file).unwrap())
        .await
        .unwrap();
    let mut want = Vec::new();
    for (concurrent, seeded) in CASES {
        want.push(outputs(&local, concurrent, seeded).await);
    }
    local.shutdown();

    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let front = start(front_config(&file, &remote.peer, &[])).await.unwrap();
    for (k, (concurrent, seeded)) in CASES.into_iter().enumerate() {
        let got = outputs(&front, concurrent, seeded).await;
        for (i, (g, w)) in got.iter().zip(&want[k]).enumerate() {
            assert_eq!(
                g, w,
                "prompt {i} (concurrent {concurrent}, seeded {seeded}) differs from in-process"
            );
        }
        let sources: Vec<usize> = got.iter().flat_map(|(_, s)| s.clone()).collect();
        assert!(
            sources.contains(&0) && sources.contains(&1),
            "both models wrote"
        );
    }
    wait_free(&front, Duration::from_secs(5));
    let (status, metrics) = http_get(format!("http://{}/metrics", remote.http)).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("reference"), "{metrics}");
    front.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_unix_socket_too() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let sock = format!("ipc://{}", dir.path().join("reference.sock").display());
    let remote = Remote::start(&file, &sock, &[]);
    assert_eq!(remote.peer, sock);
    let front = start(front_config(&file, &remote.peer, &[])).await.unwrap();
    let g = front.generate("hello", params(false, 0)).await.unwrap();
    assert_eq!(g.token_ids.len(), 32);
    front.shutdown();
}

/// Abort (the client drops its stream) and a finished request: KV free in both processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_frees_kv_on_both_processes() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let front = start(front_config(&file, &remote.peer, &[])).await.unwrap();
    let shared = front.shared().unwrap();
    for pinned in [None, Some(1)] {
        let mut streams: Vec<_> = (0..4).map(|i| submit_long(&front, i, pinned)).collect();
        // Let every request write some tokens, and the remote hold KV for some.
        for s in &mut streams {
            for _ in 0..20 {
                match s.events.recv().await {
                    Some(GenerateEvent::Token(_)) => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        let start = Instant::now();
        while shared.kv_used[1].load(Ordering::SeqCst) == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the remote never holds KV"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(streams);
        wait_free_async(&front).await;
        remote_kv_is_zero(&remote).await;
    }
    front.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_remote_then_restarting_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("tcp://127.0.0.1:{port}");
    let mut remote = Remote::start(&file, &addr, &[]);
    let front = start(front_config(
        &file,
        &addr,
        &["system.remote={timeout_s: 2}"],
    ))
    .await
    .unwrap();
    let mut streams: Vec<_> = (0..4).map(|i| submit_long(&front, i, None)).collect();
    for s in &mut streams {
        for _ in 0..5 {
            assert!(matches!(
                s.events.recv().await,
                Some(GenerateEvent::Token(_))
            ));
        }
    }
    remote.kill();
    let killed = Instant::now();
    for s in &mut streams {
        let end = end_within(s, Duration::from_secs(3)).await;
        match end {
            Some(GenerateEvent::Error(e)) => assert!(e.contains("reference"), "{e}"),
            other => panic!("expected an error, got {other:?}"),
        }
    }
    println!("all requests ended {:?} after the kill", killed.elapsed());
    let unhealthy = front.unhealthy();
    assert!(
        unhealthy
            .iter()
            .any(|(m, r)| m == "reference" && r.contains("unreachable")),
        "{unhealthy:?}"
    );
    // Routed requests are refused; a request pinned to the healthy model works.
    let prompt = front.text().unwrap().encode("hi").unwrap();
    let routed = front.submit(params(false, 0).into_request(prompt.clone()));
    assert!(routed.is_err());
    let mut pinned = params(false, 0);
    pinned.pinned_model = Some(0);
    let g = front.generate("hi", pinned).await.expect("pinned to quick");
    assert_eq!(g.token_ids.len(), 32);
    // Back on the same port: healthy again, new requests succeed, KV free.
    let _remote = Remote::start(&file, &addr, &[]);
    back_in_service(&front, "hi").await;
    assert_eq!(front.remote_stats().reconnects.load(Ordering::SeqCst), 1);
    wait_free_async(&front).await;
    front.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_wrong_version_and_mismatched_peers_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    // (a) Something else listens there: it writes junk.
    let junk = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let junk_addr = format!("tcp://{}", junk.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::Write;
        for mut s in junk.incoming().flatten() {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nhello, I am not gRPC");
        }
    });
    let err = start(front_config(
        &file,
        &junk_addr,
        &["system.remote={connect_timeout_s: 3}"],
    ))
    .await
    .err()
    .expect("a junk peer is refused");
    assert!(
        err.contains("reference") && err.contains(&junk_addr),
        "{err}"
    );
    println!("junk peer: {err}");

    // (b) Junk bytes to a real sub-server: it stays up and serves a real front end after.
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    {
        use std::io::Write;
        let hp = remote.peer.trim_start_matches("tcp://");
        let mut s = std::net::TcpStream::connect(hp).unwrap();
        let _ = s.write_all(&[0xff; 4096]);
    }
    // (c) Another protocol version: refused, naming both.
    let addr: tokenrouter_wire::PeerAddress = remote.peer.parse().unwrap();
    let mut client = tokenrouter_wire::connect(&addr, &Default::default())
        .await
        .unwrap();
    let hello = tokenrouter_wire::pb::FrontMsg {
        m: Some(tokenrouter_wire::pb::front_msg::M::Hello(
            tokenrouter_wire::pb::Hello {
                protocol_version: 999,
                model_name: "reference".into(),
                model_index: 1,
                ..Default::default()
            },
        )),
    };
    let mut answers = client
        .session(tokio_stream::iter(vec![hello]))
        .await
        .unwrap()
        .into_inner();
    match answers.message().await.unwrap().and_then(|m| m.m) {
        Some(tokenrouter_wire::pb::remote_msg::M::Refuse(r)) => {
            assert!(
                r.reason.contains("999") && r.reason.contains('1'),
                "{}",
                r.reason
            );
            assert_eq!(r.protocol_version, tokenrouter_wire::PROTOCOL_VERSION);
        }
        other => panic!("expected Refuse, got {other:?}"),
    }
    let front = start(front_config(&file, &remote.peer, &[])).await.unwrap();
    front.generate("still up", params(false, 0)).await.unwrap();
    front.shutdown();
    drop(remote);

    // (d) The sub-server runs another method for the model: the front end says what differs.
    let other = Remote::start(
        &file,
        "tcp://127.0.0.1:0",
        &["--set", "model.reference.scheduler_class=slm_only"],
    );
    let err = start(front_config(&file, &other.peer, &[]))
        .await
        .err()
        .expect("a mismatched config is refused");
    assert!(
        err.contains("scheduler_class") && err.contains("random_llm") && err.contains("slm_only"),
        "{err}"
    );
}

/// `handoff_bytes{kind="delta"}`'s (sum, count) in the front end's metrics.
fn delta_bytes(e: &Engine) -> (f64, f64) {
    let text = e.metrics_text();
    let read = |suffix: &str| {
        text.lines()
            .find(|l| {
                l.contains(&format!("handoff_bytes_{suffix}{{")) && l.contains("kind=\"delta\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (read("sum"), read("count"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_does_not_grow_with_the_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let front = start(front_config(&file, &remote.peer, &[])).await.unwrap();
    let mut means = Vec::new();
    for len in [20usize, 2000] {
        let before = delta_bytes(&front);
        let prompt: Vec<u32> = (0..len as u32).map(|i| 10 + i % 200).collect();
        let mut p = params(false, 1);
        p.max_tokens = 48;
        let mut s = front.submit(p.into_request(prompt)).unwrap();
        while let Some(ev) = s.events.recv().await {
            match ev {
                GenerateEvent::Token(_) => {}
                GenerateEvent::Finished { .. } => break,
                GenerateEvent::Error(e) => panic!("{e}"),
            }
        }
        let after = delta_bytes(&front);
        let n = after.1 - before.1;
        assert!(n > 3.0, "too few hand-offs after the first contact: {n}");
        means.push((after.0 - before.0) / n);
    }
    println!(
        "bytes per delta hand-off: 20-token prompt {:.1}, 2000-token prompt {:.1}",
        means[0], means[1]
    );
    assert!(means[1] <= means[0] + 8.0, "{means:?}");
    front.shutdown();
}

/// A front end whose models have another tokenizer is refused at the greeting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tokenizer_is_refused_at_hello() {
    use tokenrouter_wire::pb;
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let cfg = EngineConfig::from_file(&file).unwrap();
    let addr: tokenrouter_wire::PeerAddress = remote.peer.parse().unwrap();
    let mut client = tokenrouter_wire::connect(&addr, &Default::default())
        .await
        .unwrap();
    let hello = pb::FrontMsg {
        m: Some(pb::front_msg::M::Hello(pb::Hello {
            protocol_version: tokenrouter_wire::PROTOCOL_VERSION,
            front_instance: 1,
            model_name: "reference".into(),
            model_index: 1,
            model_names: vec!["quick".into(), "reference".into()],
            expect: Some(pb::Identity {
                model_path: cfg.models[1].section.model_path.clone(),
                scheduler_class: "random_llm".into(),
                scheduler_kwargs: "null".into(),
                delayed_batching_threshold: format!(
                    "{:?}",
                    cfg.models[1].section.delayed_batching_threshold
                ),
                random_weights: false,
            }),
            vocab_sha256: vec![0; 32],
        })),
    };
    let mut answers = client
        .session(tokio_stream::iter(vec![hello]))
        .await
        .unwrap()
        .into_inner();
    match answers.message().await.unwrap().and_then(|m| m.m) {
        Some(pb::remote_msg::M::Refuse(r)) => {
            assert!(r.reason.contains("tokenizer"), "{}", r.reason)
        }
        other => panic!("expected Refuse, got {other:?}"),
    }
}

/// A stopped sub-server (SIGSTOP: the connection stays open, nothing answers) is detected by
/// the liveness timeout; once it runs again the front end reconnects (replacing its old
/// session there) and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_remote_is_detected_by_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let front = start(front_config(
        &file,
        &remote.peer,
        &["system.remote={timeout_s: 1.5}"],
    ))
    .await
    .unwrap();
    let mut stream = submit_long(&front, 0, None);
    for _ in 0..5 {
        assert!(matches!(
            stream.events.recv().await,
            Some(GenerateEvent::Token(_))
        ));
    }
    let pid = remote.child.id().to_string();
    let signal = |s: &str| {
        let ok = Command::new("kill")
            .args([s, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {s}");
    };
    signal("-STOP");
    let stopped = Instant::now();
    let end = end_within(&mut stream, Duration::from_secs(4)).await;
    assert!(
        matches!(&end, Some(GenerateEvent::Error(e)) if e.contains("reference")),
        "{end:?}"
    );
    println!("stopped remote detected after {:?}", stopped.elapsed());
    signal("-CONT");
    back_in_service(&front, "again").await;
    wait_free_async(&front).await;
    front.shutdown();
}

/// The next message that is not a load report or a pong.
async fn next_remote(
    a: &mut tonic::Streaming<tokenrouter_wire::pb::RemoteMsg>,
) -> Option<tokenrouter_wire::pb::remote_msg::M> {
    use tokenrouter_wire::pb::remote_msg::M as R;
    loop {
        match a.message().await.unwrap().and_then(|m| m.m) {
            Some(R::Load(_)) | Some(R::Pong(_)) => continue,
            other => return other,
        }
    }
}

/// A delta for a request the sub-server has no copy of is answered `Unknown` (never applied to
/// KV it does not have); the same request as a first contact is then served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_for_an_unknown_request_is_answered_unknown() {
    use tokenrouter_wire::pb;
    use tokenrouter_wire::pb::front_msg::M as F;
    use tokenrouter_wire::pb::remote_msg::M as R;
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let cfg = EngineConfig::from_file(&file).unwrap();
    let small = tokenrouter_runtime::TextModel::from_hf_dir(&dir.path().join("small")).unwrap();
    let reference = &cfg.models[1].section;
    let addr: tokenrouter_wire::PeerAddress = remote.peer.parse().unwrap();
    let mut client = tokenrouter_wire::connect(&addr, &Default::default())
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let send = |m: F| tx.send(pb::FrontMsg { m: Some(m) }).unwrap();
    send(F::Hello(pb::Hello {
        protocol_version: tokenrouter_wire::PROTOCOL_VERSION,
        front_instance: 7,
        model_name: "reference".into(),
        model_index: 1,
        model_names: vec!["quick".into(), "reference".into()],
        expect: Some(pb::Identity {
            model_path: reference.model_path.clone(),
            scheduler_class: "random_llm".into(),
            scheduler_kwargs: "null".into(),
            delayed_batching_threshold: format!("{:?}", reference.delayed_batching_threshold),
            random_weights: false,
        }),
        vocab_sha256: tokenrouter_engine::remote::vocab_fingerprint(&small),
    }));
    let mut answers = client
        .session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let welcome = next_remote(&mut answers).await;
    assert!(matches!(welcome, Some(R::Welcome(_))), "{welcome:?}");
    send(F::Configure(pb::Configure {
        sample_limit: small.real_vocab_len() as u32,
        context_limit: 4096,
    }));
    assert!(matches!(next_remote(&mut answers).await, Some(R::Ready(_))));
    let prompt: Vec<u32> = vec![10, 11, 12, 13, 14];
    let pos = tokenrouter_wire::rng_pos_bytes(0);
    // A delta (anchor > 0) for request 99, which this sub-server never saw.
    send(F::Handoff(pb::Handoff {
        rid: 99,
        seq: 1,
        from: Some(0),
        anchor: 5,
        tokens: vec![15],
        sources: vec![0],
        rng_word_pos: pos.clone(),
        ..Default::default()
    }));
    match next_remote(&mut answers).await {
        Some(R::Unknown(u)) => assert_eq!((u.rid, u.seq), (99, 1)),
        other => panic!("expected Unknown, got {other:?}"),
    }
    // The same request in full: served (one token, then handed back to `quick`).
    send(F::Handoff(pb::Handoff {
        rid: 99,
        seq: 2,
        from: Some(0),
        anchor: 0,
        tokens: prompt.iter().copied().chain([15]).collect(),
        sources: vec![0],
        rng_word_pos: pos,
        first: Some(pb::FirstContact {
            prompt_len: prompt.len() as u32,
            sampling: Some(pb::Sampling {
                top_p: 1.0,
                repetition_penalty: 1.0,
                ..Default::default()
            }),
            seed: 1,
            max_tokens: 16,
            ..Default::default()
        }),
        ..Default::default()
    }));
    match next_remote(&mut answers).await {
        Some(R::Token(t)) => assert_eq!((t.rid, t.pos, t.source), (99, 1, 1)),
        other => panic!("expected a token, got {other:?}"),
    }
    match next_remote(&mut answers).await {
        Some(R::HandBack(h)) => assert_eq!((h.rid, h.to, h.output_len), (99, 0, 2)),
        other => panic!("expected the hand-back, got {other:?}"),
    }
}

/// Over HTTP, as a client sees it: a streaming client that disconnects frees KV in both
/// processes; after the sub-server is killed the front end's `/health` is 503 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_disconnect_frees_kv_and_health_names_the_dead_model() {
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let mut remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let front = start(front_config(
        &file,
        &remote.peer,
        &["system.remote={timeout_s: 2}"],
    ))
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let backend: std::sync::Arc<dyn Backend> = std::sync::Arc::new(front.clone());
    let server = tokio::spawn(tokenrouter_server::serve(
        listener,
        backend,
        tokenrouter_server::ServerConfig::default(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let body = serde_json::json!({"prompt": "def f(", "max_tokens": 3000, "stream": true,
        "ignore_eos": true, "seed": 1});
    let mut resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let shared = front.shared().unwrap();
    let start_t = Instant::now();
    while shared.kv_used[1].load(Ordering::SeqCst) == 0 {
        assert!(
            resp.chunk().await.unwrap().is_some(),
            "the stream ended early"
        );
        assert!(
            start_t.elapsed() < Duration::from_secs(10),
            "the remote never holds KV"
        );
    }
    drop(resp);
    wait_free_async(&front).await;
    remote_kv_is_zero(&remote).await;
    remote.kill();
    let start_t = Instant::now();
    loop {
        let (status, text) = http_get(format!("http://{addr}/health")).await;
        if status == 503 && text.contains("reference") {
            break;
        }
        assert!(
            start_t.elapsed() < Duration::from_secs(5),
            "{status} {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), server).await;
    front.shutdown();
}
