//! The pick phase: from a validated request to a route. The client's model maps through
//! `model_map` to the Dynamo display name for candidate matching only; the picker runs over the
//! namespaces that have a usable shim replica; a pinned route is recorded in the ledger.

use std::borrow::Cow;
use std::time::Instant;

use continuum_proto::model::Role;
use continuum_proto::view::FleetView;

use super::kv::Term;
use super::request::ChatRequest;
use crate::dispatch::pool::{ShimPools, ShimReplica, serving_backends};
use crate::dispatch::{DispatchEnd, Pinned, Route};
use crate::http::AppState;
use crate::routing::picker::{KvSelectionResult, KvTerm, PickRequest, PromptChain};

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

/// How a request goes out.
#[derive(Debug)]
pub struct Routed {
    pub route: Route,
    /// The rendered prompt tokens, for `nvext.token_data` when `kv.send_token_data` is on.
    pub token_data: Option<Vec<u32>>,
}

/// Chooses how `request` is sent.
pub async fn route(state: &AppState, view: &FleetView, request: &ChatRequest) -> Result<Routed, SelectError> {
    let config = view.config();
    if !config.disaggregated_serving.enabled {
        let replicas = serving_backends(config, &request.model);
        if replicas.is_empty() {
            return Err(SelectError::ModelNotFound { model: request.model.clone() });
        }
        return Ok(Routed { route: Route::Unified { replicas: replicas.into() }, token_data: None });
    }
    let display = config.model_map.get(&request.model).map_or(request.model.as_str(), String::as_str);
    let kv = state.kv.as_ref().filter(|_| config.picker.kv_enabled);
    let term = match kv {
        Some(kv) => Some(match request.tree() {
            Ok(body) => kv.routing.term(view, display, &body).await,
            // Not for a body the ingress accepted; scored on load alone if it ever happens.
            Err(_) => Term::Unavailable(KvSelectionResult::RenderUnavailable),
        }),
        None => None,
    };
    // Rendering and the index lookup take time: the pick runs on the clock after them.
    let now = Instant::now();
    let pools = state.dispatcher.pools(config);
    let usable = usable_namespaces(state, &pools, now);
    let pick = |prompt_tokens| PickRequest { model: display, prompt_tokens, namespaces: Some(&*usable) };
    let (selection, prompt_tokens, tokens, chain) = match (kv, term) {
        (Some(kv), Some(Term::Scored { tokens, block_size, overlaps, block_hashes, recent })) => {
            let isl_tokens = tokens.len() as u64;
            let scored = KvTerm::Scored { isl_tokens, block_size, overlaps: &overlaps, recent };
            let chain = PromptChain { block_size, hashes: block_hashes };
            (kv.picker.pick(view, &pick(isl_tokens), scored, now), isl_tokens, Some(tokens), chain)
        }
        (Some(kv), Some(Term::Unavailable(result))) => {
            let estimate = request.prompt_estimate;
            (
                kv.picker.pick(view, &pick(estimate), KvTerm::Unavailable(result), now),
                estimate,
                None,
                PromptChain::default(),
            )
        }
        _ => {
            let estimate = request.prompt_estimate;
            (state.picker.pick(view, &pick(estimate), now), estimate, None, PromptChain::default())
        }
    };
    let selection = selection.ok_or_else(|| why_not(view, display, &usable, &request.model))?;
    let replicas = pools.pool(&selection.namespace);
    let dispatch = DispatchEnd::record(&state.ledger, &state.reporter, view, &selection, prompt_tokens, &chain);
    let fallback_to_unified = config.disaggregated_serving.fallback_to_unified;
    let token_data = tokens.filter(|_| config.picker.send_token_data);
    Ok(Routed { route: Route::Pinned(Pinned { selection, replicas, fallback_to_unified, dispatch }), token_data })
}

/// Namespaces whose pool has at least one replica a request would be let through to now: all of
/// them, borrowed, while every pool has one (the usual case), else a filtered copy.
fn usable_namespaces<'p>(state: &AppState, pools: &'p ShimPools, now: Instant) -> Cow<'p, [String]> {
    let usable = |replicas: &[ShimReplica]| replicas.iter().any(|r| state.dispatcher.usable(r, now));
    if pools.iter().all(|(_, replicas)| usable(replicas)) {
        return Cow::Borrowed(pools.namespaces());
    }
    let filtered = pools.iter().filter(|(_, replicas)| usable(replicas)).map(|(namespace, _)| namespace.to_string());
    Cow::Owned(filtered.collect())
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
