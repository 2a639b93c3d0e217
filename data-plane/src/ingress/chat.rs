//! `POST /v1/chat/completions`, in the pipeline's explicit phases: ingress (read and validate) →
//! strip (client routing headers and body fields) → pick → upstream request → relay.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::BytesRejection;
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
use crate::routing::headers::{attach_token_data, strip_body_routing, strip_client_routing, wants_disclosure};

pub async fn chat_completions(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = Instant::now();
    // The headers are taken rather than cloned (as the `HeaderMap` extractor would); the body
    // goes through the `Bytes` extractor all the same, so the route's body limit applies.
    let (mut parts, body) = request.into_parts();
    let headers = std::mem::take(&mut parts.headers);
    let body = Bytes::from_request(Request::from_parts(parts, body), &state).await;
    let response = serve(&state, headers, body).await.unwrap_or_else(IntoResponse::into_response);
    state.metrics.observe(Ingress::ChatCompletions, response.status().as_u16(), started.elapsed().as_secs_f64());
    response
}

async fn serve(
    state: &AppState,
    mut headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Ingress.
    let mut request = ChatRequest::parse(&body.map_err(RequestError::from)?)?;
    // Strip: the client's routing never travels further than this.
    let disclose = wants_disclosure(&headers);
    strip_client_routing(&mut headers);
    strip_body_routing(&mut request.body);
    // Pick.
    let view = state.fleet.view().ok_or(SelectError::NoFleetView)?;
    let routed = select::route(state, &view, &request).await?;
    // Upstream request and relay.
    if let Some(tokens) = routed.token_data {
        attach_token_data(&mut request.body, tokens);
    }
    let body = Bytes::from(serde_json::to_vec(&request.body).map_err(RequestError::Json)?);
    Ok(state.dispatcher.run(Plan { body, stream: request.stream, disclose, route: routed.route }).await?)
}
