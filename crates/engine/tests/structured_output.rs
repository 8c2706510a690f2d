//! Structured output on the tiny pair (`GenerateRequest::constraint`): whatever the random
//! models would write, the kept tokens decode to text the constraint accepts — routed (both
//! models writing, tokens rewritten by the other model) and pinned, greedy and sampled —
//! and an invalid constraint is refused at submission, naming the field; routing reads a
//! constrained row over the tokens it may write (a forced position is never rewritten).

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::Duration;
use tokenrouter_api::{
    Backend, FinishReason, GenerateEvent, GenerateRequest, OutputConstraint, SamplingParams,
    SubmitError,
};
use tokenrouter_engine::Engine;

/// The text a request wrote (end-of-sequence tokens left out), its sources, its finish.
async fn answer(e: &Engine, req: GenerateRequest) -> (String, Vec<usize>, FinishReason) {
    let mut s = e.submit(req).unwrap();
    let (mut ids, mut sources) = (Vec::new(), Vec::new());
    let reason = loop {
        match s.events.recv().await.expect("the request ends") {
            GenerateEvent::Token(t) => {
                ids.push(t.id);
                sources.push(t.source);
            }
            GenerateEvent::Finished { reason } => break reason,
            GenerateEvent::PromptCached(_) => {}
            GenerateEvent::Error(m) => panic!("request failed: {m}"),
            GenerateEvent::Prompt(_) => panic!("prompt scores were not asked for"),
        }
    };
    let text = e.text().unwrap().decode(&ids, true).unwrap();
    (text, sources, reason)
}

fn constrained(salt: u32, constraint: OutputConstraint, temperature: f32) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            temperature,
            seed: Some(u64::from(salt)),
            ..Default::default()
        },
        ignore_eos: false,
        constraint: Some(constraint),
        ..greedy_request(prompt(9, salt), 120)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_and_pinned_answers_keep_to_their_constraint() {
    let (_pair, e) = routed_pair();
    let schema = json!({"type": "object", "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "flag": {"type": "boolean"}},
        "required": ["answer", "count", "flag"], "additionalProperties": false,
        // Random models would pad flexible whitespace up to max_tokens.
        "x-guidance": {"whitespace_flexible": false}});
    let mut both_models = 0;
    for salt in 0..8u32 {
        for (pinned, temperature) in [(None, 0.0), (None, 1.0), (Some(1), 1.0)] {
            let mut req = constrained(
                salt,
                OutputConstraint::JsonSchema(schema.clone()),
                temperature,
            );
            req.pinned_model = pinned;
            let (text, sources, reason) = answer(&e, req).await;
            let v: Value =
                serde_json::from_str(&text).unwrap_or_else(|err| panic!("{text:?}: {err}"));
            assert!(
                ["yes", "no", "maybe"].contains(&v["answer"].as_str().unwrap()),
                "{text}"
            );
            assert!(
                v["count"].as_u64().unwrap() <= 999 && v["flag"].is_boolean(),
                "{text}"
            );
            assert_eq!(reason, FinishReason::Stop, "{text}");
            if let Some(m) = pinned {
                assert!(sources.iter().all(|&s| s == m));
            }
            both_models += usize::from(sources.contains(&0) && sources.contains(&1));

            let rx = OutputConstraint::Regex("[a-d]{2}-[0-9]{3}".into());
            let (text, _, _) = answer(&e, constrained(salt, rx, temperature)).await;
            let b = text.as_bytes();
            assert!(
                b.len() == 6
                    && b[..2].iter().all(|c| (b'a'..=b'd').contains(c))
                    && b[2] == b'-'
                    && b[3..].iter().all(u8::is_ascii_digit),
                "{text:?}"
            );
            let choices = vec!["left".to_string(), "right".into(), "stop here".into()];
            let choice = OutputConstraint::Choice(choices.clone());
            let (text, _, _) = answer(&e, constrained(salt, choice, temperature)).await;
            assert!(choices.contains(&text), "{text:?}");
        }
    }
    assert!(
        both_models >= 4,
        "routed answers written by both models: {both_models}"
    );
    assert_all_free(&e, Duration::from_secs(5));
}

/// Many constrained requests in one batch (their masks computed on several threads), each
/// with its own pattern, beside free ones: every answer keeps to its own constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_constraints_keeps_each_row_to_its_own() {
    let (_pair, e) = routed_pair();
    let words = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen"];
    let mut tasks = Vec::new();
    for salt in 0..24u32 {
        let word = words[salt as usize % words.len()];
        let temperature = if salt % 3 == 0 { 1.0 } else { 0.0 };
        let req = match salt % 4 {
            3 => GenerateRequest {
                ignore_eos: false,
                ..greedy_request(prompt(9, salt), 12)
            },
            _ => constrained(
                salt,
                OutputConstraint::Regex(format!("{word}-[0-9]{{3}}")),
                temperature,
            ),
        };
        let free = req.constraint.is_none();
        let e = e.clone();
        tasks.push(tokio::spawn(
            async move { (word, free, answer(&e, req).await) },
        ));
    }
    for t in tasks {
        let (word, free, (text, _, reason)) = t.await.unwrap();
        if free {
            continue;
        }
        let b = text.as_bytes();
        assert!(
            b.len() == 7
                && text.starts_with(&format!("{word}-"))
                && b[4..].iter().all(u8::is_ascii_digit),
            "{word}: {text:?}"
        );
        assert_eq!(reason, FinishReason::Stop);
    }
    // Steps with masks are timed, per model.
    let metrics = e.metrics_text();
    let count = |model: &str| {
        let key = format!("tokenrouter:token_mask_seconds_count{{model=\"{model}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        count("quick") > 0.0 && count("reference") > 0.0,
        "{metrics}"
    );
    assert_all_free(&e, Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_constraints_are_refused_naming_the_field() {
    let (_pair, e) = routed_pair();
    for bad in [
        OutputConstraint::Regex("(unclosed".into()),
        OutputConstraint::JsonSchema(json!({"type": "no-such-type"})),
        OutputConstraint::Choice(vec![]),
    ] {
        match e.submit(constrained(1, bad.clone(), 0.0)) {
            Err(SubmitError::InvalidField { param, message }) => {
                assert_eq!(param, "constraint");
                assert!(
                    message.starts_with("invalid output constraint"),
                    "{message}"
                );
            }
            other => panic!("{bad:?}: {:?}", other.map(|s| s.request_id)),
        }
    }
    assert_all_free(&e, Duration::from_secs(5));
}

/// A position the constraint forces (one token allowed, or only the end) is never handed to
/// the other model to rewrite: it could only write the same token. Routing every position
/// at random (p = 1) sends each free token to the large model and no forced one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_positions_are_not_rewritten_by_the_other_model() {
    let p = pair();
    let e = start(config(
        &p,
        "random",
        "{p: 1.0, seed: 3}",
        "random",
        "",
        "async",
    ));
    let (_, sources, _) = answer(&e, greedy_request(prompt(9, 1), 6)).await;
    assert_eq!(sources, vec![1; 6], "free tokens go to the large model");
    // No merges join these letters in the synthetic vocabulary: every position is forced.
    let forced = OutputConstraint::Regex("abcd".into());
    let (text, sources, reason) = answer(&e, constrained(1, forced, 0.0)).await;
    assert_eq!((text.as_str(), reason), ("abcd", FinishReason::Stop));
    assert!(sources.iter().all(|&s| s == 0), "{sources:?}");
    // Two letters a position: free, so routed; the forced end is not.
    let free = OutputConstraint::Regex("[ab]{4}".into());
    let (text, sources, _) = answer(&e, constrained(1, free, 0.0)).await;
    assert_eq!(text.len(), 4, "{text:?}");
    assert_eq!(sources[..4], [1; 4], "{sources:?}");
    assert!(sources[4..].iter().all(|&s| s == 0), "{sources:?}");
    assert_all_free(&e, Duration::from_secs(5));
}

/// Routing reads a constrained row over the tokens it may write: between two letters the
/// random small model is nearly sure, though over the whole vocabulary it is not — so it
/// keeps writing, where a free answer goes to the large model.
async fn constrained_rows_stay_where_free_ones_route(slm: &str, kwargs: &str, llm: &str) {
    let p = pair();
    let e = start(config(&p, slm, kwargs, llm, "", "async"));
    let (_, sources, _) = answer(&e, greedy_request(prompt(9, 2), 6)).await;
    assert!(sources.contains(&1), "a free answer is routed: {sources:?}");
    for salt in 0..3 {
        let two = OutputConstraint::Regex("[ab]{6}".into());
        let (text, sources, _) = answer(&e, constrained(salt, two, 1.0)).await;
        assert_eq!(text.len(), 6, "{text:?}");
        assert!(sources.iter().all(|&s| s == 0), "{sources:?}");
    }
    assert_all_free(&e, Duration::from_secs(5));
}

/// R-Stitch's entropy over two letters is at most ln 2 / ln V, under τ 0.2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rstitch_reads_the_entropy_over_the_allowed_tokens() {
    constrained_rows_stay_where_free_ones_route("rstitch", "{threshold: 0.2}", "rstitch").await;
}

/// GlimpRouter's top-20 glimpse over two letters is at most ln 2, under 1.0, where a free
/// answer's (random weights: near ln 20) routes the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glimprouter_glimpses_over_the_allowed_tokens() {
    constrained_rows_stay_where_free_ones_route(
        "glimprouter_slm",
        "{threshold: 1.0}",
        "glimprouter_llm",
    )
    .await;
}
