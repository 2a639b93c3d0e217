//! The bytes of `FindMatches` calls in flight, across every connection, under one bound.
//!
//! A lookup's message (up to [`MAX_INBOUND_FLEET_MESSAGE_BYTES`]) is read whole before its
//! handler runs, and a connection may hold [`MAX_STREAMS_PER_CONNECTION`] calls: a replica's
//! token and a few connections would otherwise make the process hold gigabytes of lookups
//! that are still arriving. Each call's messages are charged to one process-wide budget,
//! [`MAX_LOOKUP_BYTES_IN_FLIGHT`], at the length each one's gRPC prefix declares (at most what
//! the server reads of one message; past that tonic refuses it, `OUT_OF_RANGE`), as soon as the
//! prefix arrives: tonic sets aside room for that length then, before the bytes come. The call
//! gives them back once it is answered (or dropped). A message that would overdraw the
//! budget fails its call with `RESOURCE_EXHAUSTED` at once, counted as `over_budget` in
//! `continuum_dynamo_kv_find_matches_total`; the replica picks that request on load alone, as
//! it does for any lookup not answered. Every other call passes untouched: a Watch stream's
//! messages are bounded by its session's own queue.
//!
//! [`MAX_STREAMS_PER_CONNECTION`]: super::MAX_STREAMS_PER_CONNECTION

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use continuum_proto::MAX_INBOUND_FLEET_MESSAGE_BYTES;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body::{Frame, SizeHint};
use prometheus::{IntCounter, IntGauge};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::Request;
use tonic::server::NamedService;
use tower_service::Service;

/// The bytes of lookup messages held at once, as their prefixes declare them, across every
/// call. A lookup of a 128k-token prompt at 16 tokens a block is some 80 KiB: thousands of
/// ordinary lookups fit.
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
    /// `continuum_dynamo_kv_lookup_bytes_held`: what `held` holds.
    gauge: IntGauge,
}

impl LookupBudget {
    pub fn new(limit: usize, refused: IntCounter, gauge: IntGauge) -> Self {
        Self { limit, held: AtomicUsize::new(0), refused, gauge }
    }

    /// Takes `bytes` if they fit under the limit with what is held.
    fn take(&self, bytes: usize) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|after| *after <= self.limit)
            })
            .is_ok();
        if taken {
            self.gauge.add(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        taken
    }

    fn give_back(&self, bytes: usize) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.sub(i64::try_from(bytes).unwrap_or(i64::MAX));
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
        self.budget.give_back(*self.held.get_mut());
    }
}

/// A lookup's body, charging each message's declared length as its prefix arrives.
struct Charged {
    inner: Body,
    charge: Arc<Charge>,
    framing: Framing,
    /// The budget refused a message: the body ends with that error.
    refused: bool,
}

/// Where a body is in its gRPC framing: each message is a compressed flag, a 4-byte length,
/// and that many bytes.
#[derive(Debug, Default)]
struct Framing {
    /// The bytes of the current message's prefix read so far.
    prefix: [u8; PREFIX],
    prefix_read: usize,
    /// The bytes of the current message's body yet to come, once its prefix is whole.
    body_left: usize,
}

/// A gRPC message's prefix: a compressed flag and a big-endian length.
const PREFIX: usize = 5;

impl Framing {
    /// Follows `data` through the framing; returns the bytes the messages whose prefix it
    /// completed declare, prefixes included. A length past what the server reads at all is
    /// charged as that most: the server refuses it (`OUT_OF_RANGE`) without setting room aside.
    fn declared(&mut self, mut data: &[u8]) -> usize {
        let mut declared = 0usize;
        while !data.is_empty() {
            if self.body_left > 0 {
                let skipped = self.body_left.min(data.len());
                self.body_left -= skipped;
                data = &data[skipped..];
                continue;
            }
            let taken = (PREFIX - self.prefix_read).min(data.len());
            self.prefix[self.prefix_read..self.prefix_read + taken].copy_from_slice(&data[..taken]);
            self.prefix_read += taken;
            data = &data[taken..];
            if self.prefix_read == PREFIX {
                let [_, length @ ..] = self.prefix;
                let length = u32::from_be_bytes(length) as usize;
                declared = declared.saturating_add(PREFIX + length.min(MAX_INBOUND_FLEET_MESSAGE_BYTES));
                (self.prefix_read, self.body_left) = (0, length);
            }
        }
        declared
    }
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(data) = frame.as_ref().and_then(|frame| frame.as_ref().ok()).and_then(Frame::data_ref) {
            let this = &mut *self;
            let declared = this.framing.declared(data);
            if declared > 0 && !this.charge.take(declared) {
                this.refused = true;
                this.charge.budget.refused.inc();
                let limit = this.charge.budget.limit;
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
        let request = request
            .map(|inner| Body::new(Charged { inner, charge: body, framing: Framing::default(), refused: false }));
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
        let refused = IntCounter::new("refused", "refused").expect("counter");
        Arc::new(LookupBudget::new(limit, refused, IntGauge::new("held", "held").expect("gauge")))
    }

    /// A body holding one gRPC message of `length` bytes, arriving as `cuts` frames.
    fn message(length: usize, cuts: &[usize]) -> Vec<Bytes> {
        let mut wire = vec![0u8];
        wire.extend_from_slice(&u32::try_from(length).expect("small").to_be_bytes());
        wire.resize(PREFIX + length, 7);
        let mut frames = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&wire.len()]) {
            frames.push(Bytes::copy_from_slice(&wire[from..cut]));
            from = cut;
        }
        frames
    }

    fn charged(budget: &Arc<LookupBudget>, frames: Vec<Bytes>) -> Charged {
        let charge = Arc::new(Charge { budget: Arc::clone(budget), held: AtomicUsize::new(0) });
        let stream = futures::stream::iter(frames.into_iter().map(|data| Ok::<_, Status>(Frame::data(data))));
        let inner = Body::new(http_body_util::StreamBody::new(stream));
        Charged { inner, charge, framing: Framing::default(), refused: false }
    }

    #[test]
    fn a_message_is_charged_its_declared_length_once_its_prefix_is_whole() {
        let mut framing = Framing::default();
        let frames = message(1000, &[3, 5, 400]);
        let declared: Vec<usize> = frames.iter().map(|frame| framing.declared(frame)).collect();
        assert_eq!(declared, [0, 1005, 0, 0], "charged when the fifth prefix byte came, not as the rest did");
        let mut two = message(10, &[]).concat();
        two.extend_from_slice(&message(20, &[])[0]);
        assert_eq!(Framing::default().declared(&two), 15 + 25, "two messages in one frame");
        let huge = [0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            Framing::default().declared(&huge),
            PREFIX + MAX_INBOUND_FLEET_MESSAGE_BYTES,
            "no more than the server would read"
        );
    }

    #[tokio::test]
    async fn bodies_are_charged_until_dropped_and_one_past_the_budget_is_refused() {
        let budget = budget(2000);
        // Only the prefix has come: the declared length is held all the same.
        let mut first = charged(&budget, message(1195, &[5]));
        assert!(first.frame().await.expect("a frame").is_ok(), "within the budget");
        assert_eq!(budget.held(), 1200);
        assert_eq!(budget.gauge.get(), 1200, "the gauge shows what is held");

        let mut second = charged(&budget, message(995, &[]));
        let refused = second.frame().await.expect("an answer").expect_err("past the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(second.frame().await.is_none(), "a refused body ends");
        assert_eq!(budget.refused.get(), 1);
        assert_eq!(budget.held(), 1200, "a refused message holds nothing");

        drop(first);
        assert_eq!(budget.held(), 0, "a body dropped gives its bytes back");
        assert_eq!(budget.gauge.get(), 0);
        let mut third = charged(&budget, message(995, &[]));
        assert!(third.frame().await.expect("a frame").is_ok(), "room again once the first let go");
        drop((second, third));
        assert_eq!(budget.held(), 0);
    }
}
