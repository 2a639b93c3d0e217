//! The OpenAI traffic ingresses a replica serves beside its health and metrics endpoints:
//! `POST /v1/chat/completions` (buffered, or streamed as SSE) and `GET /v1/models`.
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
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use kv::{KvRouting, Term};
pub use models::client_ids;
pub use request::MAX_REQUEST_BODY_BYTES;

use crate::http::AppState;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models::list_models))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
}
