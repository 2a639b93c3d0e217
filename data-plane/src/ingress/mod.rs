//! The OpenAI traffic ingresses a replica serves beside its health and metrics endpoints:
//! `POST /v1/chat/completions` (buffered, or streamed as SSE), which the replica's server calls
//! directly ([`chat::respond`]), and `GET /v1/models` (and `/v1/models/{id}`), served by the router with the rest.
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
use axum::extract::State;
use axum::http::header::ALLOW;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use error::ApiError;

pub use kv::{KvRouting, Term};
pub use models::client_ids;
pub use request::MAX_REQUEST_BODY_BYTES;

use crate::http::AppState;
use crate::server::head::CHAT_COMPLETIONS;

/// The ingresses the router serves. Request bodies reach it already bounded by the server
/// ([`MAX_REQUEST_BODY_BYTES`]).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/models", get(models::list_models)).route("/v1/models/{*id}", get(models::retrieve_model))
}

/// What a request for no endpoint gets: an OpenAI-shaped 404 or 405, counted. Chat
/// completions never reach the router by POST (the server serves them), so any request for
/// their path that does is one with another method.
pub fn no_endpoint(router: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    fn refuse(state: &AppState, status: StatusCode, method: &Method, uri: &Uri) -> Response {
        if uri.path() == CHAT_COMPLETIONS {
            let error = ApiError::no_endpoint(StatusCode::METHOD_NOT_ALLOWED, method, uri.path());
            state.metrics.no_endpoint(error.code);
            // RFC 9110 §15.5.6: a 405 names the methods the resource takes.
            return ([(ALLOW, "POST")], error).into_response();
        }
        let error = ApiError::no_endpoint(status, method, uri.path());
        state.metrics.no_endpoint(error.code);
        error.into_response()
    }
    router
        .fallback(|State(state): State<Arc<AppState>>, method: Method, uri: Uri| async move {
            refuse(&state, StatusCode::NOT_FOUND, &method, &uri)
        })
        .method_not_allowed_fallback(|State(state): State<Arc<AppState>>, method: Method, uri: Uri| async move {
            refuse(&state, StatusCode::METHOD_NOT_ALLOWED, &method, &uri)
        })
}
