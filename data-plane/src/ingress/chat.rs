//! `POST /v1/chat/completions`, in the pipeline's explicit phases: ingress (read and validate) →
//! strip (client routing headers and body fields) → pick → upstream request → relay.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{FromRequest, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::error::ApiError;
use super::request::{ChatRequest, RequestError};
use super::select::{self, SelectError};
use crate::dispatch::Plan;
use crate::http::AppState;
use crate::metrics::Ingress;
use crate::routing::headers::{strip_client_routing, wants_disclosure};

pub async fn chat_completions(State(state): State<Arc<AppState>>, request: Request) -> Response {
    // The headers are taken rather than cloned (as the `HeaderMap` extractor would); the body
    // goes through the `Bytes` extractor all the same, so the route's body limit applies.
    let (mut parts, body) = request.into_parts();
    let headers = std::mem::take(&mut parts.headers);
    let body = Bytes::from_request(Request::from_parts(parts, body), &state).await.map_err(RequestError::from);
    respond(&state, headers, body).await
}

/// One chat completion, answered and observed: the replica's server calls this directly.
pub async fn respond(state: &AppState, headers: HeaderMap, body: Result<Bytes, RequestError>) -> Response {
    let started = Instant::now();
    let response = serve(state, headers, body).await.unwrap_or_else(IntoResponse::into_response);
    state.metrics.observe(Ingress::ChatCompletions, response.status().as_u16(), started.elapsed().as_secs_f64());
    response
}

async fn serve(
    state: &AppState,
    mut headers: HeaderMap,
    body: Result<Bytes, RequestError>,
) -> Result<Response, ApiError> {
    // Ingress.
    let request = ChatRequest::parse(body?)?;
    // Strip: the client's routing headers never travel further than this; its routing body
    // fields are stripped as the outbound body is made.
    let disclose = wants_disclosure(&headers);
    strip_client_routing(&mut headers);
    // Pick.
    let view = state.fleet.view().ok_or(SelectError::NoFleetView)?;
    let routed = select::route(state, &view, &request).await?;
    // Upstream request and relay.
    let body = request.outbound(routed.token_data)?;
    Ok(state.dispatcher.run(Plan { body, stream: request.stream, disclose, route: routed.route }).await?)
}
