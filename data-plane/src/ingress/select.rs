//! The pick phase: from a validated request to a route. The client's model maps through
//! `model_map` to the Dynamo display name for candidate matching only; the picker runs over the
//! namespaces that have a usable shim replica; a pinned route is recorded in the ledger.

use std::time::Instant;

use continuum_proto::model::Role;
use continuum_proto::view::FleetView;

use super::request::ChatRequest;
use crate::dispatch::pool::{ShimPools, serving_backends};
use crate::dispatch::{DispatchEnd, Pinned, Route};
use crate::http::AppState;
use crate::routing::picker::{PickRequest, estimate_prompt_tokens};

#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("no fleet view from the control plane yet")]
    NoFleetView,
    #[error("no worker serves model {model:?}")]
    ModelNotFound { model: String },
    #[error("no usable shim replica for the namespaces serving {model:?}")]
    ShimUnavailable { model: String },
    #[error("no worker serving {model:?} can be picked now")]
    NoWorkers { model: String },
}

/// Chooses how `request` is sent.
pub fn route(state: &AppState, view: &FleetView, request: &ChatRequest, now: Instant) -> Result<Route, SelectError> {
    let config = view.config();
    if !config.disaggregated_serving.enabled {
        let replicas = serving_backends(config, &request.model);
        if replicas.is_empty() {
            return Err(SelectError::ModelNotFound { model: request.model.clone() });
        }
        return Ok(Route::Unified { replicas });
    }
    let display = config.model_map.get(&request.model).map_or(request.model.as_str(), String::as_str);
    let pools = state.dispatcher.pools(config);
    let usable = usable_namespaces(state, &pools, now);
    let prompt_tokens = estimate_prompt_tokens(&request.body);
    let pick = PickRequest { model: display, prompt_tokens, namespaces: Some(&usable) };
    let Some(selection) = state.picker.pick(view, &pick, now) else {
        return Err(why_not(view, display, &usable, &request.model));
    };
    let replicas = pools.pool(&selection.namespace).to_vec();
    let dispatch = DispatchEnd::record(&state.ledger, &state.reporter, view, &selection, prompt_tokens);
    let fallback_to_unified = config.disaggregated_serving.fallback_to_unified;
    Ok(Route::Pinned(Pinned { selection, replicas, fallback_to_unified, dispatch }))
}

/// Namespaces whose pool has at least one replica a request would be let through to now.
fn usable_namespaces(state: &AppState, pools: &ShimPools, now: Instant) -> Vec<String> {
    pools
        .iter()
        .filter(|(_, replicas)| replicas.iter().any(|r| state.dispatcher.usable(r, now)))
        .map(|(namespace, _)| namespace.to_string())
        .collect()
}

/// Why the picker found nobody: the model is served nowhere, only where no shim is usable, or
/// its workers cannot take a request now.
fn why_not(view: &FleetView, display: &str, usable: &[String], client_model: &str) -> SelectError {
    let model = client_model.to_string();
    let serving = || view.workers().values().filter(|w| w.model == display && w.role != Role::Unknown);
    if serving().next().is_none() {
        SelectError::ModelNotFound { model }
    } else if !serving().any(|w| usable.iter().any(|n| **n == *w.key.namespace)) {
        SelectError::ShimUnavailable { model }
    } else {
        SelectError::NoWorkers { model }
    }
}
