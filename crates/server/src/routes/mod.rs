//! Route table and the layers around it (API key, HTTP metrics, body limit, CORS).

pub mod chat;
pub mod completions;
pub mod generate;
pub mod llama;
pub mod messages;
pub mod misc;
pub mod models;
pub mod responses;
pub mod tokenize;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use crate::auth::require_api_key;
use crate::state::AppState;

pub fn build(state: AppState) -> Router {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/models", get(models::list_models))
        .route("/v1/models/{id}", get(models::get_model))
        .route("/health", get(misc::health))
        .route("/health_generate", get(misc::health_generate))
        .route("/get_model_info", get(misc::model_info))
        .route("/model_info", get(misc::model_info))
        .route("/get_server_info", get(misc::server_info))
        .route("/server_info", get(misc::server_info))
        .route("/get_load", get(misc::get_load))
        .route(
            "/flush_cache",
            get(misc::flush_cache).post(misc::flush_cache),
        )
        .route("/reset_prefix_cache", post(misc::flush_cache))
        .route("/abort_request", post(misc::abort_request))
        .route("/metrics", get(misc::metrics))
        .route("/version", get(misc::version))
        .route("/generate", post(generate::generate))
        .route("/completion", post(llama::completion))
        .route("/completions", post(llama::completion))
        .route("/infill", post(llama::infill))
        .route("/props", get(llama::props))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/apply-template", post(tokenize::apply_template))
        .merge(crate::web::routes())
        .fallback(misc::not_found)
        .method_not_allowed_fallback(misc::method_not_allowed)
        .layer(from_fn_with_state(state.clone(), require_api_key))
        .layer(from_fn_with_state(state.clone(), count_http))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes));
    // Outermost, so a browser's preflight (OPTIONS, no API key) is answered before the key
    // check, and error responses carry the CORS headers too.
    let app = match state.config.cors.layer() {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.with_state(state)
}

/// Counts responses by route template and status code.
async fn count_http(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let response = next.run(req).await;
    state
        .metrics
        .http_requests
        .with_label_values(&[path.as_str(), response.status().as_str()])
        .inc();
    response
}
