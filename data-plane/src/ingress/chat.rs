//! `POST /v1/chat/completions`, in the pipeline's explicit phases: ingress (read and validate;
//! of the client's headers only [`ChatHeaders`] is carried past its head) → pick → upstream
//! request (the client's routing body fields stripped, the pins written) → relay.

use std::time::Instant;

use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::FutureExt;

use super::error::ApiError;
use super::request::{ChatRequest, RequestError};
use super::select::{self, SelectError};
use crate::dispatch::{Pinned, Plan, Route};
use crate::http::AppState;
use crate::memory::{Charge, REQUEST_BODIES};
use crate::metrics::Ingress;
use crate::routing::headers::REQUEST_ID;

/// What a chat completion's head hands on, and all it hands on: no other header of the
/// client's can reach a shim.
#[derive(Debug, Default)]
pub struct ChatHeaders {
    /// The client asked (`x-backend`) to see the chosen backend and workers.
    pub disclose: bool,
    /// `x-tenant-id`, the frontend's cache salt.
    pub tenant: Option<String>,
    /// The tracing headers, sent on as they came ([`crate::routing::headers::trace`]).
    pub trace: Vec<(HeaderName, HeaderValue)>,
}

/// One chat completion, answered and observed. The replica's server calls this directly, with
/// none of the client's headers but [`ChatHeaders`]: the outbound headers are the
/// dispatcher's own, the pins, the tenant and the tracing headers. A client's `x-request-id`
/// comes back on the answer, whatever it is. Not an `async fn`: `serve`'s future is handed on
/// as it is, with what becomes of its outcome, rather than built and moved into one more.
pub fn respond(state: &AppState, client: ChatHeaders, body: Bytes) -> impl Future<Output = Response> + '_ {
    let started = Instant::now();
    let request_id = client.trace.iter().find(|(name, _)| name == REQUEST_ID).map(|(_, v)| v.clone());
    serve(state, client, body).map(move |outcome| {
        let mut response = match outcome {
            Ok(response) => response,
            Err(error) => {
                state.metrics.chat_refused(error.code);
                error.into_response()
            }
        };
        if let Some(id) = request_id {
            response.headers_mut().insert(HeaderName::from_static(REQUEST_ID), id);
        }
        state.metrics.observe(Ingress::ChatCompletions, response.status().as_u16(), started.elapsed().as_secs_f64());
        response
    })
}

async fn serve(state: &AppState, client: ChatHeaders, body: Bytes) -> Result<Response, ApiError> {
    let ChatHeaders { disclose, tenant, trace } = client;
    // Ingress. The client's routing body fields are stripped as the outbound body is made,
    // before anything is picked: a body refused then (its rewrite would grow past the bound,
    // or found no room) leaves no dispatch recorded, no cursor moved and no prefix credited.
    let request = ChatRequest::read(body).await?.with_tenant(tenant);
    let stripped = request.outbound(None, disclose).await?;
    // Pick, on the view of the moment: held only while picking, since a request may run for
    // minutes and the control plane publishes a view every few milliseconds under load.
    let routed = {
        let view = state.fleet.view().ok_or(SelectError::NoFleetView)?;
        select::route(state, &view, &request).await?
    };
    // Upstream request and relay.
    let mut route = routed.route;
    // A body the tokens grew past what small bodies are is charged like a request body for
    // as long as the dispatch holds it.
    let mut grown = Charge::default();
    let body = match routed.token_data {
        Some(tokens) => {
            if let Route::Pinned(Pinned { fallback: Some(fallback), .. }) = &mut route {
                // A fallback backend is not a shim: the router's tokens are not for it.
                fallback.body = Some(stripped.clone());
            }
            // The tokens are a saving of the frontend's: without room to add them now (or with
            // a body whose rewrite would grow past the bound, one without `nvext` going out as
            // sent), it tokenizes the prompt itself.
            match request.outbound(Some(tokens), disclose).await {
                Ok(body) if REQUEST_BODIES.grow(&mut grown, body.len()) => {
                    // Not held here beside it for as long as the answer takes (a fallback
                    // backend keeps its own handle on it, for its body).
                    drop(stripped);
                    body
                }
                Ok(_) | Err(RequestError::Busy | RequestError::Grows { .. }) => stripped,
                Err(error) => return Err(error.into()),
            }
        }
        None => stripped,
    };
    // A tenant passed the frontend's own test for a header string when it was read.
    let tenant = request.tenant().and_then(|tenant| HeaderValue::from_str(tenant).ok());
    Ok(state.dispatcher.run(Plan { body, stream: request.stream, disclose, tenant, trace, route }).await?)
}
