//! Why a dispatch did not produce a response to relay. The ingress maps these to HTTP.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;

use super::client::SendError;

/// What went wrong on one leg (the pinned send, or its unpinned fallback).
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("no shim replica of the pool was available")]
    NoReplica,
    #[error("the retry budget is spent")]
    BudgetSpent(#[source] SendError),
    #[error(transparent)]
    Send(SendError),
    #[error("the shim answered {0}")]
    Status(StatusCode),
    #[error("the shim's response body failed: {0}")]
    Body(String),
    /// A streamed request answered with a success that is no event stream (JSON, or nothing
    /// under a 204): relayed, it would reach the client as a success holding an error event,
    /// or as an empty one.
    #[error("the shim answered a streamed request {0} without an event stream")]
    NotAnEventStream(StatusCode),
    #[error("the shim's response did not finish within {0:?}")]
    BodyTimeout(Duration),
    /// A buffered answer past the relay's bound: the request's own (its generation is that
    /// long), so it is neither the workers' failure nor worth generating again.
    #[error("the shim's response is larger than the {0} bytes relayed buffered; stream it instead")]
    TooLarge(usize),
    /// The replica already holds as many buffered answers as it may ([`crate::memory`]).
    #[error("the replica holds as many buffered answers as it may")]
    Overloaded,
}

impl Failure {
    /// Whether the failure says "not now" (overload, unreachable) rather than "broken".
    pub fn is_unavailable(&self) -> bool {
        match self {
            Failure::NoReplica | Failure::BudgetSpent(_) => true,
            Failure::Send(error) => error.before_request_sent(),
            Failure::Status(status) => {
                *status == StatusCode::SERVICE_UNAVAILABLE || *status == StatusCode::TOO_MANY_REQUESTS
            }
            Failure::Body(_)
            | Failure::NotAnEventStream(_)
            | Failure::BodyTimeout(_)
            | Failure::TooLarge(_)
            | Failure::Overloaded => false,
        }
    }

    pub fn is_timeout(&self) -> bool {
        matches!(self, Failure::Send(SendError::HeadTimeout(_) | SendError::ShimSilent(_)) | Failure::BodyTimeout(_))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The frontend refused the pinned pair for lack of a prefill pin.
    #[error("the shim of namespace {namespace} refused the pinned request: prefill worker id required")]
    PrefillRefused { namespace: Arc<str> },
    /// The pinned request failed, and so did its unpinned fallback when one was sent.
    #[error("the pinned request failed: {cause}")]
    DecodeFailed {
        #[source]
        cause: Failure,
        fallback: Option<Failure>,
        /// The frontend refused the pins themselves (a worker id it no longer knows, a dp rank
        /// out of bounds): the router's view of the fleet, not the client's request.
        stale_pins: bool,
    },
    /// This replica holds as many buffered answers as it may ([`crate::memory`]).
    #[error("the replica holds as many buffered answers as it may")]
    Overloaded,
    /// No replica of the pinned namespace's pool would take the request, and no backend
    /// serves the model unpinned: nothing was sent.
    #[error("no shim replica of the pool would take the request, and no backend serves the model unpinned")]
    NoShim,
    /// A plain unpinned request (disaggregated serving off) failed: no backend could be
    /// reached, or the one that answered failed.
    #[error("the unpinned request failed: {0}")]
    UnifiedFailed(#[source] Failure),
}
