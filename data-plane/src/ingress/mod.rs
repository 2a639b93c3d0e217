//! The OpenAI traffic ingresses a replica serves beside its health and metrics endpoints:
//! `POST /v1/chat/completions` (buffered, or streamed as SSE), which the replica's server calls
//! directly ([`chat::respond`]), and `GET /v1/models`, served by the router with the rest.
//! Handlers are thin: they read the request, call the routing and dispatch phases, and map
//! errors to OpenAI-shaped bodies at this edge ([`error`]).

pub mod chat;
pub mod error;
mod kv;
mod models;
mod recent;
pub mod request;
pub mod select;

use std::sync::Arc;

use axum::Router;
use axum::routing::get;

pub use kv::{KvRouting, Term};
pub use models::client_ids;
pub use request::MAX_REQUEST_BODY_BYTES;

use crate::http::AppState;

/// The ingresses the router serves. Request bodies reach it already bounded by the server
/// ([`MAX_REQUEST_BODY_BYTES`]).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/models", get(models::list_models))
}
