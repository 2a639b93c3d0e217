//! The bytes of `FindMatches` calls in flight, across every connection, under one bound.
//!
//! A lookup's message (up to [`MAX_INBOUND_FLEET_MESSAGE_BYTES`]) is read whole before its
//! handler runs, and a connection may hold [`MAX_STREAMS_PER_CONNECTION`] calls: a replica's
//! token and a few connections would otherwise make the process hold gigabytes of lookups
//! that are still arriving. Each call's body is charged, frame by frame as it arrives, to one
//! process-wide budget, [`MAX_LOOKUP_BYTES_IN_FLIGHT`], and gives the bytes back once the call
//! is answered (or dropped). A frame that would overdraw the budget fails its call with
//! `RESOURCE_EXHAUSTED` at once, counted as `over_budget` in
//! `continuum_dynamo_kv_find_matches_total`; the replica picks that request on load alone, as
//! it does for any lookup not answered. Every other call passes untouched: a Watch stream's
//! messages are bounded by its session's own queue.
//!
//! [`MAX_INBOUND_FLEET_MESSAGE_BYTES`]: continuum_proto::MAX_INBOUND_FLEET_MESSAGE_BYTES
//! [`MAX_STREAMS_PER_CONNECTION`]: super::MAX_STREAMS_PER_CONNECTION

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body::{Frame, SizeHint};
use prometheus::IntCounter;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::Request;
use tonic::server::NamedService;
use tower_service::Service;

/// The bytes of lookup messages held at once, raw, across every call. A lookup of a
/// 128k-token prompt at 16 tokens a block is some 80 KiB: thousands of ordinary lookups fit.
pub const MAX_LOOKUP_BYTES_IN_FLIGHT: usize = 256 << 20;

/// The path of the one call charged.
const FIND_MATCHES: &str = "/continuum.fleet.v1.Fleet/FindMatches";

/// The process's budget for lookup bytes in flight.
#[derive(Debug)]
pub struct LookupBudget {
    limit: usize,
    held: AtomicUsize,
    /// `continuum_dynamo_kv_find_matches_total{result="over_budget"}`.
    refused: IntCounter,
}

impl LookupBudget {
    pub fn new(limit: usize, refused: IntCounter) -> Self {
        Self { limit, held: AtomicUsize::new(0), refused }
    }

    /// Takes `bytes` if they fit under the limit with what is held.
    fn take(&self, bytes: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|after| *after <= self.limit)
            })
            .is_ok()
    }

    /// Bytes held by the calls in flight.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// What one call holds of the budget; given back when both its body and its answer are done.
#[derive(Debug)]
struct Charge {
    budget: Arc<LookupBudget>,
    held: AtomicUsize,
}

impl Charge {
    fn take(&self, bytes: usize) -> bool {
        let taken = self.budget.take(bytes);
        if taken {
            self.held.fetch_add(bytes, Ordering::AcqRel);
        }
        taken
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(*self.held.get_mut(), Ordering::AcqRel);
    }
}

/// A lookup's body, charging each frame's bytes as it arrives.
struct Charged {
    inner: Body,
    charge: Arc<Charge>,
    /// The budget refused a frame: the body ends with that error.
    refused: bool,
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(data)) = frame.as_ref().map(|frame| frame.as_ref().map(Frame::data_ref)) {
            let bytes = data.map_or(0, Bytes::len);
            if !self.charge.take(bytes) {
                self.refused = true;
                self.charge.budget.refused.inc();
                let limit = self.charge.budget.limit;
                return Poll::Ready(Some(Err(Status::resource_exhausted(format!(
                    "the control plane holds {limit} bytes of lookups in flight at most; \
                     this one is answered by load alone"
                )))));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A service whose `FindMatches` calls are charged to the budget; every other call passes.
#[derive(Clone, Debug)]
pub struct Budgeted<S> {
    inner: S,
    budget: Arc<LookupBudget>,
}

impl<S> Budgeted<S> {
    pub fn new(inner: S, budget: Arc<LookupBudget>) -> Self {
        Self { inner, budget }
    }
}

impl<S: NamedService> NamedService for Budgeted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Budgeted<S>
where
    S: Service<Request<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<S::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if request.uri().path() != FIND_MATCHES {
            return self.inner.call(request).boxed();
        }
        let charge = Arc::new(Charge { budget: Arc::clone(&self.budget), held: AtomicUsize::new(0) });
        let body = Arc::clone(&charge);
        let request = request.map(|inner| Body::new(Charged { inner, charge: body, refused: false }));
        // Held by the answer too: the decoded message lives until the handler is done with it.
        self.inner
            .call(request)
            .map(move |answer| {
                drop(charge);
                answer
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn budget(limit: usize) -> Arc<LookupBudget> {
        Arc::new(LookupBudget::new(limit, IntCounter::new("refused", "refused").expect("counter")))
    }

    fn charged(budget: &Arc<LookupBudget>, bytes: usize) -> Charged {
        let charge = Arc::new(Charge { budget: Arc::clone(budget), held: AtomicUsize::new(0) });
        Charged { inner: Body::new(http_body_util::Full::new(Bytes::from(vec![0u8; bytes]))), charge, refused: false }
    }

    #[tokio::test]
    async fn bodies_are_charged_until_dropped_and_one_past_the_budget_is_refused() {
        let budget = budget(100);
        let mut first = charged(&budget, 60);
        let frame = first.frame().await.expect("a frame").expect("within the budget");
        assert_eq!(frame.data_ref().map(Bytes::len), Some(60));
        assert_eq!(budget.held(), 60);

        let mut second = charged(&budget, 50);
        let refused = second.frame().await.expect("an answer").expect_err("past the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(second.frame().await.is_none(), "a refused body ends");
        assert_eq!(budget.refused.get(), 1);
        assert_eq!(budget.held(), 60, "a refused frame holds nothing");

        drop(first);
        assert_eq!(budget.held(), 0, "a body dropped gives its bytes back");
        let mut third = charged(&budget, 50);
        assert!(third.frame().await.expect("a frame").is_ok(), "room again once the first let go");
        drop((second, third));
        assert_eq!(budget.held(), 0);
    }
}
