//! Background Responses over the mock (`background: true`): the request answers `queued`
//! at once and the answer runs on, polled by `GET /v1/responses/{id}`; created with
//! `stream: true` its events are streamed, and read again from any point with
//! `GET …?stream=true&starting_after=N`, even after the first client went away;
//! `POST …/cancel` stops it (aborted in the engine, status `cancelled`, output so far
//! kept); a failure is kept as `failed`; the refusals are 400s / 404s naming the field.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use serde_json::{json, Value};
use tokenrouter_server::{router, ServerConfig};

use crate::common::{error_of, get, post, post_json, send, sse_data, text};
use crate::mock::{MockBackend, MockConfig};

fn slow_mock(token_delay_ms: u64) -> Arc<MockBackend> {
    MockBackend::new(MockConfig {
        token_delay: Duration::from_millis(token_delay_ms),
        ..MockConfig::default()
    })
}

async fn get_json(app: Router, path: &str) -> (StatusCode, Value) {
    let resp = send(app, get(path)).await;
    let status = resp.status();
    (status, serde_json::from_str(&text(resp).await).unwrap())
}

/// POSTs a background request ("hi", with `extra` fields): the status and the answer.
async fn start(app: &Router, extra: Value) -> (StatusCode, Value) {
    let mut body = json!({"input": "hi", "background": true});
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    post_json(app.clone(), "/v1/responses", body).await
}

/// Polls the response until its status is none of `queued` / `in_progress`.
async fn wait_ended(app: &Router, id: &str) -> Value {
    for _ in 0..1000 {
        let (status, r) = get_json(app.clone(), &format!("/v1/responses/{id}")).await;
        assert_eq!(status, StatusCode::OK, "{r}");
        if !["queued", "in_progress"].contains(&r["status"].as_str().unwrap()) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("response {id} did not end");
}

/// The events of an SSE body of response events.
fn events(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn a_background_response_answers_queued_and_is_polled_to_its_end() {
    let m = slow_mock(3);
    let a = router(m.clone(), ServerConfig::default());
    let (status, r) = start(&a, json!({})).await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["status"], "queued");
    assert_eq!(r["background"], true);
    assert_eq!(r["output"], json!([]));
    let id = r["id"].as_str().unwrap().to_string();
    // Still running: polled as it stands.
    let (_, polled) = get_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert!(["queued", "in_progress"].contains(&polled["status"].as_str().unwrap()));

    let done = wait_ended(&a, &id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["background"], true);
    let whole = crate::responses::output_text(&done);
    assert_eq!(whole, m.cfg.script);
    assert!(done["usage"]["output_tokens"].as_u64().unwrap() > 0);
    // Stored: it is continued like any other response.
    let (status, next) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": "more", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{next}");
    // An ended response cannot be cancelled; nor can one that never ran in the background.
    let (status, r) = post_json(a.clone(), &format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_of(&r)["message"]
            .as_str()
            .unwrap()
            .contains("already completed"),
        "{r}"
    );
    let sync_id = next["id"].as_str().unwrap();
    let (status, r) = post_json(
        a.clone(),
        &format!("/v1/responses/{sync_id}/cancel"),
        json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_of(&r)["message"]
            .as_str()
            .unwrap()
            .contains("synchronous"),
        "{r}"
    );
    let (status, _) = post_json(a, "/v1/responses/resp_nope/cancel", json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cancel_stops_a_background_response_in_the_engine() {
    let m = slow_mock(40);
    let a = router(m.clone(), ServerConfig::default());
    let (_, r) = start(&a, json!({"max_output_tokens": 200})).await;
    let id = r["id"].as_str().unwrap().to_string();
    // A few tokens in, then cancelled.
    assert!(
        m.wait_for(Duration::from_secs(5), |log| log.running == 1)
            .await
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    // A response still running cannot be continued yet.
    let (status, r) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": "more", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&r)["param"], "previous_response_id");
    // Created without `stream`: its events are not kept to read.
    let (status, r) = get_json(a.clone(), &format!("/v1/responses/{id}?stream=true")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{r}");
    assert_eq!(error_of(&r)["param"], "stream");

    let (status, cancelled) =
        post_json(a.clone(), &format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    // The output so far is kept, shorter than the whole script.
    let partial = crate::responses::output_text(&cancelled);
    assert!(
        !partial.is_empty() && m.cfg.script.starts_with(&partial),
        "{partial:?}"
    );
    assert!(partial.len() < m.cfg.script.len());
    assert!(
        m.wait_for(Duration::from_secs(5), |log| log.aborted.len() == 1)
            .await
    );
    assert!(m.log().completed.is_empty());
    let (_, fetched) = get_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(fetched["status"], "cancelled");
    let (status, r) = post_json(a, &format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_of(&r)["message"]
            .as_str()
            .unwrap()
            .contains("already cancelled"),
        "{r}"
    );
}

#[tokio::test]
async fn a_streamed_background_response_is_read_again_after_the_client_left() {
    let m = slow_mock(2);
    let a = router(m.clone(), ServerConfig::default());
    // The first client reads only the headers and goes.
    let body = json!({"input": "hi", "background": true, "stream": true});
    let resp = send(a.clone(), post("/v1/responses", body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    drop(resp);
    assert!(
        m.wait_for(Duration::from_secs(10), |log| log.completed.len() == 1)
            .await,
        "the answer runs on without its client"
    );
    assert!(m.log().aborted.is_empty(), "the request was aborted");

    // The response's id is in its first event: read them all again, then from a point.
    let resp = send(a.clone(), post("/v1/responses", body.to_string())).await;
    let all = events(&text(resp).await);
    let kinds: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        &kinds[..3],
        [
            "response.created",
            "response.queued",
            "response.in_progress"
        ]
    );
    assert_eq!(all[0]["response"]["status"], "queued");
    assert_eq!(kinds.last(), Some(&"response.completed"));
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let rid = all[0]["response"]["id"].as_str().unwrap().to_string();
    let resp = send(a.clone(), get(&format!("/v1/responses/{rid}?stream=true"))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(events(&text(resp).await), all);
    let resp = send(
        a.clone(),
        get(&format!("/v1/responses/{rid}?stream=true&starting_after=4")),
    )
    .await;
    assert_eq!(events(&text(resp).await), all[5..]);
    let (_, done) = get_json(a.clone(), &format!("/v1/responses/{rid}")).await;
    assert_eq!(done, all.last().unwrap()["response"]);

    // Only a background response created with `stream` is streamed again.
    let (_, plain) = post_json(a.clone(), "/v1/responses", json!({"input": "hi"})).await;
    let pid = plain["id"].as_str().unwrap();
    let (status, r) = get_json(a.clone(), &format!("/v1/responses/{pid}?stream=true")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&r)["param"], "stream");
    let (status, r) = get_json(
        a.clone(),
        &format!("/v1/responses/{rid}?stream=true&starting_after=x"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&r)["param"], "starting_after");
    let (status, _) = get_json(a, "/v1/responses/resp_nope?stream=true").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_failed_background_response_is_kept_as_failed() {
    let m = MockBackend::new(MockConfig {
        error_at: Some(3),
        ..MockConfig::default()
    });
    let a = router(m, ServerConfig::default());
    let (_, r) = start(&a, json!({})).await;
    let id = r["id"].as_str().unwrap().to_string();
    let failed = wait_ended(&a, &id).await;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert!(failed["error"]["message"].is_string(), "{failed}");
    assert!(failed["error"]["code"].is_string(), "{failed}");

    let body = json!({"input": "hi", "background": true, "stream": true});
    let all = events(&text(send(a, post("/v1/responses", body.to_string())).await).await);
    let kinds: Vec<&str> = all.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[kinds.len() - 2..], ["error", "response.failed"]);
    assert_eq!(all.last().unwrap()["response"]["status"], "failed");
}

#[tokio::test]
async fn deleting_a_running_background_response_cancels_it() {
    let m = slow_mock(40);
    let a = router(m.clone(), ServerConfig::default());
    let (_, r) = start(&a, json!({})).await;
    let id = r["id"].as_str().unwrap().to_string();
    assert!(
        m.wait_for(Duration::from_secs(5), |log| log.running == 1)
            .await
    );
    let req = axum::http::Request::delete(format!("/v1/responses/{id}"))
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = send(a.clone(), req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        m.wait_for(Duration::from_secs(5), |log| log.aborted.len() == 1)
            .await
    );
    let (status, _) = get_json(a, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn background_needs_a_stored_response() {
    let a = router(slow_mock(0), ServerConfig::default());
    for (body, param) in [
        (
            json!({"input": "hi", "background": true, "store": false}),
            "background",
        ),
        (json!({"input": "hi", "background": "yes"}), "background"),
    ] {
        let (status, r) = post_json(a.clone(), "/v1/responses", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{r}");
        assert_eq!(error_of(&r)["param"], param);
    }
    let config = ServerConfig {
        max_stored_responses: 0,
        ..ServerConfig::default()
    };
    let a = router(slow_mock(0), config);
    let (status, r) = post_json(
        a,
        "/v1/responses",
        json!({"input": "hi", "background": true}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_of(&r)["message"]
        .as_str()
        .unwrap()
        .contains("--max-stored-responses"));
}
