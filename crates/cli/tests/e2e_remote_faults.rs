//! The remote sub-server's faults, end to end: a killed or restarted process, a stopped one
//! (detected by the timeout), and peers that are not ours (garbage, another protocol version, a
//! mismatched config or tokenizer) refused with a message that says why.
mod remote_common;

use remote_common::*;

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
        await_tokens(s, 5).await;
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
    match first_answer(&remote.peer, hello).await {
        Some(tokenrouter_wire::pb::remote_msg::M::Refuse(r)) => {
            assert!(
                r.reason.contains("999")
                    && r.reason
                        .contains(&tokenrouter_wire::PROTOCOL_VERSION.to_string()),
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

/// A front end whose models have another tokenizer is refused at the greeting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tokenizer_is_refused_at_hello() {
    use tokenrouter_wire::pb;
    let dir = tempfile::tempdir().unwrap();
    let file = tiny(dir.path(), 0.5);
    let remote = Remote::start(&file, "tcp://127.0.0.1:0", &[]);
    let cfg = EngineConfig::from_file(&file).unwrap();
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
    match first_answer(&remote.peer, hello).await {
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
    await_tokens(&mut stream, 5).await;
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
