//! `GET /v1/models`: the models a chat completion can be routed for, under the ids clients use:
//! those routable workers serve (a display name the model map targets listed under its client
//! ids instead) and those unpinned routing takes to a backend listing them. `GET
//! /v1/models/{id}` answers one of them (OpenAI's `models.retrieve`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use continuum_proto::view::FleetView;
use serde_json::json;

use super::error::ApiError;
use super::select::SelectError;
use crate::dispatch::pool::unpinned_models;
use crate::http::AppState;
use crate::metrics::Ingress;

pub async fn list_models(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let response = match state.fleet.view() {
        Some(view) => Json(models_body(&view)).into_response(),
        None => ApiError::from(SelectError::NoFleetView).into_response(),
    };
    state.metrics.observe(Ingress::Models, response.status().as_u16(), started.elapsed().as_secs_f64());
    response
}

/// One model as the list shows it, or 404 `model_not_found`. An id may hold slashes
/// (`Qwen/Qwen3-0.6B`), which OpenAI's clients send unescaped.
pub async fn retrieve_model(State(state): State<Arc<AppState>>, id: Result<Path<String>, PathRejection>) -> Response {
    let started = Instant::now();
    // An id that does not decode (not UTF-8) names no model either.
    let id = id.map_or_else(|_| String::new(), |Path(id)| id);
    let response = match state.fleet.view() {
        Some(view) if client_ids(&view).contains(&id) => Json(model_object(&id)).into_response(),
        Some(_) => ApiError::from(SelectError::ModelNotFound { model: id }).into_response(),
        None => ApiError::from(SelectError::NoFleetView).into_response(),
    };
    state.metrics.observe(Ingress::Models, response.status().as_u16(), started.elapsed().as_secs_f64());
    response
}

fn models_body(view: &FleetView) -> serde_json::Value {
    let data: Vec<_> = client_ids(view).iter().map(|id| model_object(id)).collect();
    json!({"object": "list", "data": data})
}

fn model_object(id: &str) -> serde_json::Value {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    json!({"id": id, "object": "model", "created": created, "owned_by": "continuum"})
}

/// The client ids a chat completion can be routed for, sorted: the models that routable
/// workers serve (decode or aggregated ones, as dynamo.frontend lists them, in a namespace
/// with a shim pool) while disaggregated serving is on, and those that unpinned routing takes
/// to a backend ([`unpinned_models`]).
pub fn client_ids(view: &FleetView) -> BTreeSet<String> {
    let config = view.config();
    let unpinned = unpinned_models(config).map(str::to_owned);
    if !config.disaggregated_serving.enabled {
        return unpinned.collect();
    }
    let pooled: BTreeSet<&str> =
        config.shim_pools.iter().filter(|p| !p.backends.is_empty()).map(|p| p.namespace.as_str()).collect();
    let served: BTreeSet<&str> = view
        .workers()
        .values()
        // A worker without a model name (its card not yet read, or refused) serves no request:
        // a chat completion names its model.
        .filter(|w| w.role.serves_model() && !w.model.is_empty() && pooled.contains(&*w.key.namespace))
        .map(|w| w.model.as_str())
        .collect();
    served.into_iter().flat_map(|display| ids_for(display, &config.model_map)).chain(unpinned).collect()
}

/// The client ids that reach the workers of display name `display`: the `model_map` keys that
/// name it, or else the name itself, unless that is a key mapping elsewhere (a request for it
/// goes to that model's workers, not these).
fn ids_for(display: &str, model_map: &BTreeMap<String, String>) -> Vec<String> {
    let aliases: Vec<String> =
        model_map.iter().filter(|(_, target)| *target == display).map(|(id, _)| id.clone()).collect();
    match model_map.get(display) {
        _ if !aliases.is_empty() => aliases,
        Some(elsewhere) if elsewhere != display => Vec::new(),
        _ => vec![display.to_string()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_display_names_are_listed_under_their_client_ids() {
        let map = BTreeMap::from([
            ("qwen".to_string(), "Qwen/Qwen3".to_string()),
            ("q3".to_string(), "Qwen/Qwen3".to_string()),
        ]);
        assert_eq!(ids_for("Qwen/Qwen3", &map), ["q3", "qwen"]);
        assert_eq!(ids_for("tiny", &map), ["tiny"]);
        // Workers whose own name is a client id mapped to another model: no id reaches them.
        assert!(ids_for("qwen", &map).is_empty());
        let to_itself = BTreeMap::from([("tiny".to_string(), "tiny".to_string())]);
        assert_eq!(ids_for("tiny", &to_itself), ["tiny"]);
    }
}
