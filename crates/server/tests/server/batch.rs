//! OpenAI's batch file format through the router in-process (`batch::run_batch`, vLLM's
//! `run_batch`): answers in input order whatever finishes first, each with its custom_id,
//! status and body; lines that cannot run are answered with their error and the rest go on.

use serde_json::{json, Value};
use tokenrouter_server::batch::{run_batch, BatchSummary};

use crate::common::{app, mock};

fn line(custom_id: &str, url: &str, body: Value) -> String {
    json!({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).to_string()
}

#[tokio::test]
async fn a_batch_is_answered_line_by_line_in_input_order() {
    let m = mock();
    let lines = vec![
        line(
            "long",
            "/v1/completions",
            json!({"prompt": "abc", "max_tokens": 40}),
        ),
        line(
            "chat",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ),
        "   ".to_string(),
        line(
            "responses",
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 2}),
        ),
        line(
            "cold",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
        ),
        "{not json".to_string(),
        line("embed", "/v1/embeddings", json!({"input": "hi"})),
        line(
            "streamed",
            "/v1/completions",
            json!({"prompt": "a", "stream": true}),
        ),
        json!({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}})
            .to_string(),
    ];
    let mut out = Vec::new();
    let summary = run_batch(app(&m), lines, 4, |l| {
        out.push(serde_json::from_str::<Value>(l).unwrap());
        Ok::<(), ()>(())
    })
    .await
    .unwrap();
    let ids: Vec<&Value> = out.iter().map(|o| &o["custom_id"]).collect();
    assert_eq!(
        ids,
        [
            json!("long"),
            json!("chat"),
            json!("responses"),
            json!("cold"),
            Value::Null,
            json!("embed"),
            json!("streamed"),
            json!("get")
        ]
        .iter()
        .collect::<Vec<_>>()
    );
    let status = |i: usize| out[i]["response"]["status_code"].clone();
    assert_eq!(
        (status(0), status(1), status(2)),
        (json!(200), json!(200), json!(200))
    );
    assert_eq!(out[0]["response"]["body"]["usage"]["completion_tokens"], 40);
    assert_eq!(out[0]["response"]["body"]["object"], "text_completion");
    assert_eq!(out[1]["response"]["body"]["object"], "chat.completion");
    assert_eq!(out[2]["response"]["body"]["object"], "response");
    // The request id is the answer's own id; the line's id is the batch's.
    assert_eq!(
        out[1]["response"]["request_id"],
        out[1]["response"]["body"]["id"]
    );
    assert!(out[1]["id"].as_str().unwrap().starts_with("batch_req_"));
    assert_eq!(out[1]["error"], Value::Null);
    // The endpoint's refusal: its status and error, as over HTTP.
    assert_eq!(status(3), json!(400));
    assert_eq!(out[3]["error"]["param"], "temperature");
    // Lines that never reach an endpoint.
    for (i, needle) in [
        (4, "not a batch request line"),
        (5, "url"),
        (6, "stream"),
        (7, "POST"),
    ] {
        assert_eq!(out[i]["response"], Value::Null, "{}", out[i]);
        let message = out[i]["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
    assert_eq!(
        summary,
        BatchSummary {
            succeeded: 3,
            failed: 5,
            completion_tokens: 40 + 3 + 2
        }
    );
    // Each line ran once.
    assert_eq!(m.log().submitted.len(), 3);
}

#[tokio::test]
async fn a_failing_output_stops_the_run() {
    let m = mock();
    let lines: Vec<String> = (0..5)
        .map(|i| {
            line(
                &format!("c{i}"),
                "/v1/completions",
                json!({"prompt": "a", "max_tokens": 1}),
            )
        })
        .collect();
    let mut written = 0;
    let result = run_batch(app(&m), lines, 2, |_| {
        written += 1;
        if written == 2 {
            Err("disk full")
        } else {
            Ok(())
        }
    })
    .await;
    assert_eq!(result, Err("disk full"));
    assert_eq!(written, 2);
}
