//! Stored Responses over the mock: a finished answer is kept (whole or streamed) unless
//! `store: false`; `previous_response_id` continues its conversation (its input and output
//! before the new input; its instructions not carried over); `GET` / `DELETE
//! /v1/responses/{id}` and `GET …/input_items` (order, limit, after); unknown ids are 404s
//! naming the field; `max_stored_responses: 0` keeps none.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tokenrouter_server::{router, ServerConfig};

use crate::common::{app, error_of, get, mock, post, post_json, send, text};

async fn get_json(app: Router, path: &str) -> (StatusCode, Value) {
    let resp = send(app, get(path)).await;
    let status = resp.status();
    (status, serde_json::from_str(&text(resp).await).unwrap())
}

async fn delete_json(app: Router, path: &str) -> (StatusCode, Value) {
    let req = Request::delete(path).body(Body::empty()).unwrap();
    let resp = send(app, req).await;
    let status = resp.status();
    (status, serde_json::from_str(&text(resp).await).unwrap())
}

fn texts(items: &Value) -> Vec<String> {
    items
        .as_array()
        .unwrap()
        .iter()
        .map(|item| match &item["content"] {
            Value::String(s) => s.clone(),
            parts => parts[0]["text"].as_str().unwrap().to_string(),
        })
        .collect()
}

#[tokio::test]
async fn a_stored_response_is_continued_fetched_listed_and_deleted() {
    let m = mock();
    let a = app(&m);
    let (status, first) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": "hi", "instructions": "Be brief."}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["store"], true);
    let id = first["id"].as_str().unwrap().to_string();
    let (status, fetched) = get_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fetched, first);

    let (status, second) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": [{"role": "user", "content": "more"}], "previous_response_id": id,
            "instructions": "Be long."}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{second}");
    assert_eq!(second["previous_response_id"], id.as_str());
    // The earlier exchange, then the new input; only this request's instructions.
    let (messages, _, _) = m.log().last_template.clone().unwrap();
    let shown: Vec<(&str, String)> = messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.clone()))
        .collect();
    let answer = crate::responses::output_text(&first);
    assert_eq!(
        shown,
        [
            ("system", "Be long.".to_string()),
            ("user", "hi".to_string()),
            ("assistant", answer.clone()),
            ("user", "more".to_string())
        ]
    );

    let second_id = second["id"].as_str().unwrap().to_string();
    let items = format!("/v1/responses/{second_id}/input_items");
    let (status, list) = get_json(a.clone(), &items).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(list["object"], "list");
    assert_eq!(texts(&list["data"]), ["more", answer.as_str(), "hi"]);
    assert_eq!(list["has_more"], false);
    assert_eq!(list["first_id"], list["data"][0]["id"]);
    let (_, asc) = get_json(a.clone(), &format!("{items}?order=asc&limit=2")).await;
    assert_eq!(texts(&asc["data"]), ["hi", answer.as_str()]);
    assert_eq!(asc["has_more"], true);
    let after = asc["last_id"].as_str().unwrap();
    let (_, rest) = get_json(a.clone(), &format!("{items}?order=asc&after={after}")).await;
    assert_eq!(texts(&rest["data"]), ["more"]);
    for bad in ["order=up", "limit=0", "limit=101", "after=nope"] {
        let (status, r) = get_json(a.clone(), &format!("{items}?{bad}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {r}");
    }

    let (status, deleted) = delete_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        deleted,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    let (status, r) = get_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&r)["code"], "response_not_found");
    let (status, _) = delete_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The continuation still stands on its own.
    let (status, _) = get_json(a, &format!("/v1/responses/{second_id}")).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_streamed_answer_is_stored_when_it_completes() {
    let a = app(&mock());
    let body = json!({"input": "hi", "stream": true});
    let raw = text(send(a.clone(), post("/v1/responses", body.to_string())).await).await;
    let completed: Value = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str::<Value>(d.trim()).unwrap())
        .find(|e| e["type"] == "response.completed")
        .expect("a completed event");
    let id = completed["response"]["id"].as_str().unwrap();
    let (status, fetched) = get_json(a, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fetched, completed["response"]);
}

#[tokio::test]
async fn unstored_and_unknown_responses() {
    let a = app(&mock());
    let (_, r) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": "hi", "store": false}),
    )
    .await;
    assert_eq!(r["store"], false);
    let id = r["id"].as_str().unwrap();
    let (status, _) = get_json(a.clone(), &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, r) = post_json(
        a.clone(),
        "/v1/responses",
        json!({"input": "x", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&r)["param"], "previous_response_id");
    let (status, r) = post_json(
        a,
        "/v1/responses",
        json!({"input": "x", "previous_response_id": 5}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&r)["param"], "previous_response_id");

    // A server keeping none answers `store: false` and keeps nothing.
    let config = ServerConfig {
        max_stored_responses: 0,
        ..ServerConfig::default()
    };
    let a = router(mock(), config);
    let (_, r) = post_json(a.clone(), "/v1/responses", json!({"input": "hi"})).await;
    assert_eq!(r["store"], false);
    let id = r["id"].as_str().unwrap();
    let (status, _) = get_json(a, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
