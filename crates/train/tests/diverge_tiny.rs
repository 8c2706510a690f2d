//! R2R's steps 2-3 on the tiny synthetic pair: every continuation equals the large
//! model's greedy continuation recomputed from scratch, runs resume and re-judge, an LLM
//! judge is asked over HTTP (a stand-in server here), and `fit --labels divergent` routes
//! only what was judged to matter.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokenrouter_runtime::{load_model, Row, StepOptions};
use tokenrouter_train::diverge::{
    self, divergence_path, span_text, DivergeArgs, ShardDivergence, Spans,
};
use tokenrouter_train::fit::{self, FitArgs, LabelKind};
use tokenrouter_train::judge::{JudgeKind, Verifier};
use tokenrouter_train::label;
use tokenrouter_train::prompts::{encode, read_prompts};

mod common;
use common::*;

fn diverge_args(config: &Path, prompts: &Path, data: &Path, judge: JudgeKind) -> DivergeArgs {
    DivergeArgs {
        config: config.to_path_buf(),
        prompts: prompts.to_path_buf(),
        data: data.to_path_buf(),
        lines: 1,
        max_continuation: 5,
        context_lines: 3,
        batch: 2,
        judge,
        verifier: Verifier {
            verifier_url: None,
            verifier_model: "judge".into(),
            verifier_key: None,
            verifier_concurrency: 3,
            verifier_timeout: 30,
        },
        no_progress: true,
    }
}

fn shard_points(data: &Path, shards: usize) -> Vec<ShardDivergence> {
    (0..shards)
        .map(|s| {
            serde_json::from_str(&std::fs::read_to_string(divergence_path(data, s)).unwrap())
                .unwrap()
        })
        .collect()
}

/// A stand-in OpenAI-compatible judge: answers "1" or "0" by a hash of the question (or
/// fails every request), and keeps the request bodies.
fn judge_server(fail: bool) -> (String, Arc<Mutex<Vec<serde_json::Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; len];
            reader.read_exact(&mut body).unwrap();
            let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let q = req["messages"][1]["content"]
                .as_str()
                .unwrap_or("")
                .to_string();
            log.lock().unwrap().push(req);
            let (status, reply) = if fail {
                (
                    "500 Internal Server Error",
                    r#"{"error":{"message":"overloaded"}}"#.to_string(),
                )
            } else {
                let verdict = if q.len().is_multiple_of(2) {
                    "Answer: 1"
                } else {
                    "0"
                };
                (
                    "200 OK",
                    serde_json::json!({"choices": [{"message": {"role": "assistant", "content": verdict}}]})
                        .to_string(),
                )
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                reply.len()
            );
        }
    });
    (url, seen)
}

#[test]
fn continuations_equal_a_brute_force_recomputation_and_judges_label_them() {
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let prompts = write_prompts(p.dir.path(), 5);
    let data = p.dir.path().join("labels");
    let stats = label::run(&label_args(cfg.clone(), prompts.clone(), data.clone())).unwrap();
    assert!(stats.mismatches > 3, "{}", stats.summary());
    let f = fit::load_dir(&data).unwrap();

    let a = diverge_args(&cfg, &prompts, &data, JudgeKind::Exact);
    let first = diverge::run(&a).unwrap();
    println!("{}", first.summary(JudgeKind::Exact));
    assert_eq!(first.disagreements, f.positives());
    assert_eq!(
        first.divergent + first.neutral + first.unjudged,
        first.disagreements
    );
    assert!(first.continued_s > 0.0);
    let shards = shard_points(&data, 3);
    let points: Vec<_> = shards.iter().flat_map(|s| s.points.clone()).collect();
    assert_eq!(points.len(), f.positives());

    // Brute force: each point continued alone, on a fresh sequence, one token per step.
    let mut large = load_model(&p.large, &opts()).unwrap();
    let limit = large.text.vocab_len();
    let spans = Spans {
        lines: 1,
        max: 5,
        eos: large.text.eos_ids().to_vec(),
    };
    let all_prompts = read_prompts(&prompts, true).unwrap();
    let mut seq = 5000;
    for pt in &points {
        let rows: Vec<usize> = (0..f.len()).filter(|&r| f.prompt[r] == pt.prompt).collect();
        let answer: Vec<u32> = rows.iter().map(|&r| f.large_token[r]).collect();
        let j = pt.position as usize;
        let r = rows[j];
        assert_eq!(f.label[r], 1);
        assert_eq!(
            (pt.small_token, pt.large_token),
            (f.small_token[r], answer[j])
        );
        let (reference, closed) = span_text(&spans, &large.text, &answer[j..]).unwrap();
        assert_eq!(pt.reference, reference);
        assert_eq!(pt.complete, closed);
        let mut written = vec![pt.small_token];
        let mut feed = encode(&all_prompts[pt.prompt as usize], &large.text).unwrap();
        feed.extend_from_slice(&answer[..j]);
        feed.push(pt.small_token);
        seq += 1;
        let branch = loop {
            let (t, closed) = span_text(&spans, &large.text, &written).unwrap();
            if closed {
                break t;
            }
            let o = large
                .runner
                .step(&[Row::new(seq, feed)], StepOptions::default())
                .unwrap();
            let tok = o.greedy_rows(limit).unwrap()[0].0;
            written.push(tok);
            feed = vec![tok];
        };
        large.runner.free(seq);
        assert_eq!(pt.branch, branch, "prompt {} position {j}", pt.prompt);
        if pt.complete {
            assert_eq!(pt.divergent, Some(pt.branch != pt.reference));
        } else {
            assert_eq!(pt.divergent, None);
        }
    }
    assert!(points.iter().any(|p| p.branch != p.reference));

    // Resumed: nothing continued again. Another judge re-labels the stored continuations.
    let again = diverge::run(&a).unwrap();
    assert_eq!((again.shards_resumed, again.continued_s), (3, 0.0));
    let code = diverge::run(&diverge_args(&cfg, &prompts, &data, JudgeKind::Code)).unwrap();
    assert_eq!((code.shards_resumed, code.continued_s), (0, 0.0));
    assert_eq!(code.disagreements, first.disagreements);
    let rejudged: Vec<_> = shard_points(&data, 3)
        .into_iter()
        .flat_map(|s| s.points)
        .collect();
    assert!(rejudged
        .iter()
        .zip(&points)
        .all(|(x, y)| x.branch == y.branch));

    // The LLM judge: one request per complete point, greedy, the model named; a failing
    // server is a clear error and leaves the shard as it was.
    let (bad_url, _) = judge_server(true);
    let mut m = diverge_args(&cfg, &prompts, &data, JudgeKind::Model);
    m.verifier.verifier_url = Some(bad_url);
    let e = diverge::run(&m).unwrap_err().to_string();
    assert!(e.contains("HTTP 500") && e.contains("overloaded"), "{e}");
    assert_eq!(shard_points(&data, 3)[0].judge, "code:2");
    let (url, seen) = judge_server(false);
    m.verifier.verifier_url = Some(format!("{url}/v1"));
    let judged = diverge::run(&m).unwrap();
    assert_eq!(shard_points(&data, 3)[0].judge, "model:judge");
    // The same verifier again: resumed, nothing asked.
    assert_eq!(diverge::run(&m).unwrap().shards_resumed, 3);
    println!("{}", judged.summary(JudgeKind::Model));
    let complete = points.iter().filter(|p| p.complete).count();
    let requests = seen.lock().unwrap().clone();
    assert_eq!(requests.len(), complete);
    assert!(requests
        .iter()
        .all(|r| r["model"] == "judge" && r["temperature"] == 0));
    let by_model: Vec<_> = shard_points(&data, 3)
        .into_iter()
        .flat_map(|s| s.points)
        .collect();
    for pt in &by_model {
        let want = pt.complete.then(|| diverge_question_is_even(pt));
        assert_eq!(pt.divergent, want);
    }
    assert!(
        judged.neutral > 0 && judged.divergent > 0,
        "{}",
        judged.summary(JudgeKind::Model)
    );

    // fit: divergent labels clear exactly the neutral disagreements.
    let mut fa = FitArgs::new(&data, p.dir.path().join("router"));
    fa.labels = LabelKind::Divergent;
    let mut g = fit::load_dir(&data).unwrap();
    let cleared = fit::apply_divergence(&data, &mut g).unwrap();
    assert_eq!(cleared, judged.neutral);
    assert_eq!(g.positives(), f.positives() - judged.neutral);
    std::fs::remove_file(divergence_path(&data, 1)).unwrap();
    let e = fit::run(&fa).unwrap_err().to_string();
    assert!(e.contains("train-router diverge"), "{e}");
}

fn diverge_question_is_even(pt: &diverge::Point) -> bool {
    tokenrouter_train::judge::question(pt)
        .len()
        .is_multiple_of(2)
}

#[test]
fn bad_diverge_inputs_are_clear_errors() {
    let p = pair();
    let cfg = pair_config(&p, &p.large, "");
    let prompts = write_prompts(p.dir.path(), 3);
    let data = p.dir.path().join("labels");
    // Not a label directory.
    let e = diverge::run(&diverge_args(&cfg, &prompts, &data, JudgeKind::Exact))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a label directory"), "{e}");
    label::run(&label_args(cfg.clone(), prompts.clone(), data.clone())).unwrap();
    // Another prompt file than the labels were made from.
    std::fs::create_dir_all(p.dir.path().join("o")).unwrap();
    let other = write_prompts(&p.dir.path().join("o"), 4);
    let e = diverge::run(&diverge_args(&cfg, &other, &data, JudgeKind::Exact))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not the prompt file"), "{e}");
    // The model judge without an endpoint, before any work.
    let e = diverge::run(&diverge_args(&cfg, &prompts, &data, JudgeKind::Model))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--verifier-url"), "{e}");
    // Other continuation options than the directory holds.
    diverge::run(&diverge_args(&cfg, &prompts, &data, JudgeKind::Exact)).unwrap();
    let mut longer = diverge_args(&cfg, &prompts, &data, JudgeKind::Exact);
    longer.max_continuation = 9;
    let e = diverge::run(&longer).unwrap_err().to_string();
    assert!(e.contains("other options"), "{e}");
}
