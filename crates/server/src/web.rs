//! The live web view: `GET /` serves a page that streams answers with every token coloured
//! and underlined by the model that wrote it, compares token-level routing with each model
//! pinned, and shows live engine metrics. The front-end is plain ES modules in
//! `crates/server/web/`, embedded at compile time: no Node.js at build or run time, no CDN.
//!
//! The page only uses the public API (`/v1/models`, streamed `/v1/chat/completions` with
//! `return_token_sources`, `/metrics`, `/health`), so it is also a worked example of it.

use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::error::ApiError;
use crate::state::AppState;

/// One embedded file of `crates/server/web/`, served at `/web/<name>`.
pub struct Asset {
    pub name: &'static str,
    pub content_type: &'static str,
    pub body: &'static str,
}

macro_rules! asset {
    ($name:literal, $content_type:expr) => {
        Asset {
            name: $name,
            content_type: $content_type,
            body: include_str!(concat!("../web/", $name)),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file of the front-end (a test checks that the directory holds no other file).
pub const ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("style.css", "text/css; charset=utf-8"),
    asset!("favicon.svg", "image/svg+xml"),
    asset!("app.js", JS),
    asset!("api.js", JS),
    asset!("answer.js", JS),
    asset!("metrics.js", JS),
    asset!("tooltip.js", JS),
];

/// Everything the page loads comes from this server; scripts are modules, no inline code.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

/// `/` and `/web/<file>`.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(index))
        .route("/web/{file}", get(file))
}

async fn index() -> Response {
    serve("index.html").unwrap_or_else(|| ApiError::RouteNotFound("/".into()).into_response())
}

async fn file(Path(name): Path<String>) -> Response {
    serve(&name).unwrap_or_else(|| ApiError::RouteNotFound(format!("/web/{name}")).into_response())
}

fn serve(name: &str) -> Option<Response> {
    let asset = ASSETS.iter().find(|a| a.name == name)?;
    Some(
        (
            [
                (header::CONTENT_TYPE, asset.content_type),
                // Small files, revalidated on every load so an upgraded server is seen at once.
                (header::CACHE_CONTROL, "no-cache"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                (header::CONTENT_SECURITY_POLICY, CSP),
                (header::REFERRER_POLICY, "no-referrer"),
            ],
            asset.body,
        )
            .into_response(),
    )
}
