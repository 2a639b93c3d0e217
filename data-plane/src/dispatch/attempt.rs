//! Sending one request to a pool: replicas in rotation, skipping open breakers, moving on to the
//! next replica only when the connection failed (the request never reached a shim) and the
//! retry budget allows. The same headers, pins included, go to every replica tried.

use std::time::{Duration, Instant};

use axum::http::header::{ACCEPT, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode};
use bytes::Bytes;
use futures::FutureExt;

use super::budget::MAX_ATTEMPTS;
use super::pool::{ShimReplica, rotation};
use super::shim_body::ShimBody;
use super::{Dispatcher, Failure, SendError};
use crate::routing::headers::Pins;

/// The headers of every request to a shim, the dispatcher's own: of the client's, only its
/// tenant is added (`Dispatcher::request_headers`), and the encoder writes no routing header
/// but the pins.
pub(super) fn shim_headers(stream: bool) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let accept = if stream { "text/event-stream" } else { "application/json" };
    headers.insert(ACCEPT, HeaderValue::from_static(accept));
    headers
}

impl Dispatcher {
    /// The first response head any replica of `replicas` gives, or why none did. Not an
    /// `async fn`: it would keep its arguments in its future beside the locals it binds them to.
    #[allow(clippy::manual_async_fn)]
    pub(super) fn send<'a>(
        &'a self,
        replicas: &'a [ShimReplica],
        (headers, pins): (&'a HeaderMap, Pins),
        body: &'a Bytes,
        stream: bool,
    ) -> impl Future<Output = Result<(&'a ShimReplica, Response<ShimBody>), Failure>> + 'a {
        async move {
            let head_timeout = if stream { self.settings.stream_head_timeout } else { self.settings.buffered_timeout };
            let mut attempts = 0;
            let mut last: Option<SendError> = None;
            for replica in rotation(replicas, self.next_start()) {
                if attempts == MAX_ATTEMPTS {
                    break;
                }
                let (retry, now) = (attempts > 0, Instant::now());
                // A retry asks first, so that a replica it would skip costs no retry budget.
                if retry && !self.health.of(replica).usable(now) {
                    continue;
                }
                if retry && !self.budget.withdraw() {
                    self.metrics.shim_retries_refused.inc();
                    return Err(last.map_or(Failure::NoReplica, Failure::BudgetSpent));
                }
                // Out, or a half-open breaker whose one probe another request took: no retry was made.
                if !self.health.of(replica).admit(now) {
                    if retry {
                        self.budget.refund();
                    }
                    continue;
                }
                if retry {
                    self.metrics.shim_retries.inc();
                }
                attempts += 1;
                match self.attempt(replica, (headers, pins), body, (now, head_timeout)).await {
                    Ok(response) => return Ok((replica, response)),
                    Err(error) => {
                        let retry = error.before_request_sent();
                        last = Some(error);
                        if !retry {
                            break;
                        }
                    }
                }
            }
            Err(last.map_or(Failure::NoReplica, Failure::Send))
        }
    }
}

impl Dispatcher {
    /// One send to one replica, admitted by its breaker at `sent`, its outcome fed to the
    /// breaker. Not an `async fn`: the client's future is handed on with what becomes of its
    /// outcome, rather than built and moved into one more; dropped unfinished, it drops
    /// [`Unfinished`] with it.
    fn attempt<'a>(
        &'a self,
        replica: &'a ShimReplica,
        (headers, pins): (&'a HeaderMap, Pins),
        body: &'a Bytes,
        (sent, head_timeout): (Instant, Duration),
    ) -> impl Future<Output = Result<Response<ShimBody>, SendError>> + 'a {
        let unfinished = Unfinished { dispatcher: self, replica, sent };
        let send = self.client.post(&replica.endpoint, headers, pins, body, (sent, head_timeout));
        send.map(move |outcome| {
            unfinished.finished();
            self.outcome(replica, sent, outcome)
        })
    }

    /// An attempt's outcome, fed to its replica's breaker and counted.
    fn outcome(
        &self,
        replica: &ShimReplica,
        sent: Instant,
        mut outcome: Result<Response<ShimBody>, SendError>,
    ) -> Result<Response<ShimBody>, SendError> {
        let (health, now) = (self.health.of(replica), Instant::now());
        match &outcome {
            // A success's outcome is its body's: recorded when it ends (`Dispatcher::success`).
            Ok(response) if response.status().is_success() => health.head_arrived((sent, now)),
            Ok(response) if is_gateway_failure(response.status()) => health.failed((sent, now)),
            Ok(_) => health.answered((sent, now)),
            // A buffered answer's head comes only once generation is done, so a hung worker
            // (or a long generation) looks just so: the shim's failure only if it answered
            // nothing else meanwhile, and then its alone (counted against it, a few requests
            // stuck on one hung worker would open the breaker of a shim serving every other
            // worker well; blamed on the pins, a hung shim would eject workers that serve
            // every other shim well). `Dispatcher::pinned` blames the pins of a `HeadTimeout`.
            Err(SendError::HeadTimeout(after)) => {
                if health.record_unanswered(sent, now) {
                    outcome = Err(SendError::ShimSilent(*after));
                }
            }
            Err(_) => health.failed((sent, now)),
        }
        // A shim that breaks most connections but not enough in a row to open its breaker
        // fails most attempts: `continuum_shim_attempts_total` counts each.
        if let Err(error) = &outcome {
            continuum_proto::warn_limited!(backend = %replica.name, %error, "shim dispatch attempt failed");
        }
        self.metrics.shim_attempts.with_label_values(&[replica.name.as_str(), outcome_label(&outcome)]).inc();
        outcome
    }
}

/// Counts a send dropped before its outcome came: its client left, or a shutdown's cut ended
/// its connection (the request's future is dropped either way). The shim's health learns
/// nothing from it, but a trial it carried is handed on
/// ([`ShimHealth::abandoned`](super::breaker::ShimHealth::abandoned)).
struct Unfinished<'a> {
    dispatcher: &'a Dispatcher,
    replica: &'a ShimReplica,
    /// When the breaker admitted the send.
    sent: Instant,
}

impl Unfinished<'_> {
    /// The outcome came: counted by it instead.
    fn finished(self) {
        std::mem::forget(self);
    }
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        let name = self.replica.name.as_str();
        self.dispatcher.metrics.shim_attempts.with_label_values(&[name, "client_left"]).inc();
        self.dispatcher.health.of(self.replica).abandoned(self.sent);
    }
}

/// An attempt's `outcome` label in `continuum_shim_attempts_total`.
fn outcome_label(outcome: &Result<Response<ShimBody>, SendError>) -> &'static str {
    match outcome {
        Ok(response) if response.status().is_success() => "success",
        Ok(response) if is_gateway_failure(response.status()) => "gateway_failure",
        Ok(response) if response.status().is_client_error() => "client_error",
        Ok(response) if response.status().is_server_error() => "server_error",
        Ok(_) => "other",
        Err(SendError::HeadTimeout(_) | SendError::ShimSilent(_)) => "timeout",
        Err(SendError::Connect(_)) => "connect_failed",
        Err(SendError::Write(_) | SendError::Exchange(_) | SendError::UnsupportedScheme(_)) => "broken",
    }
}

/// 502 and 504: what a proxy in front of a shim answers when the shim is down or silent.
/// Dynamo's frontend itself answers 500 and 503 only (the 1.6.1 captures).
pub(super) fn is_gateway_failure(status: StatusCode) -> bool {
    status == StatusCode::BAD_GATEWAY || status == StatusCode::GATEWAY_TIMEOUT
}
