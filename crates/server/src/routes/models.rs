//! `GET /v1/models`: the routed model (`served_model_name`, listed first) and every
//! configured model by name (naming one of those in a request pins it to that model), then
//! the aliases of the routed model (`default`, as the research system's clients send).

use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Weights of a pinned model; for the routed model, the configured model names.
    pub root: String,
    pub max_model_len: usize,
    /// Extension: true for the token-routed model, false for a pinned one.
    pub routed: bool,
}

fn cards(state: &AppState) -> Vec<ModelCard> {
    let models = state.backend.models();
    let routed_len = models.iter().map(|m| m.context_length).min().unwrap_or(0);
    let routed = ModelCard {
        id: state.config.served_model_name.clone(),
        object: "model",
        created: 0,
        owned_by: "tokenrouter",
        root: models
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>()
            .join("+"),
        max_model_len: routed_len,
        routed: true,
    };
    let aliases: Vec<ModelCard> = state
        .config
        .served_model_aliases
        .iter()
        .filter(|a| **a != routed.id && !models.iter().any(|m| &m.name == *a))
        .map(|a| ModelCard {
            id: a.clone(),
            object: "model",
            created: 0,
            owned_by: "tokenrouter",
            root: routed.root.clone(),
            max_model_len: routed.max_model_len,
            routed: true,
        })
        .collect();
    std::iter::once(routed)
        .chain(models.into_iter().map(|m| ModelCard {
            id: m.name,
            object: "model",
            created: 0,
            owned_by: "tokenrouter",
            root: m.source,
            max_model_len: m.context_length,
            routed: false,
        }))
        .chain(aliases)
        .collect()
}

pub async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: cards(&state),
    })
}

pub async fn get_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    cards(&state)
        .into_iter()
        .find(|c| c.id == id)
        .map(Json)
        .ok_or_else(|| ApiError::ModelNotFound(crate::error::truncate_for_echo(&id)))
}
