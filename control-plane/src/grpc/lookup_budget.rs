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
//! One connection's calls hold at most [`MAX_LOOKUP_BYTES_PER_CONNECTION`] of the budget
//! between them (`over_connection_budget` past it): a replica looks up over one connection of
//! its own, so one replica that floods its lookups (a bug, a burst of huge prompts) leaves the
//! rest of the budget to the others instead of refusing theirs. A token holder opening many
//! connections can still fill the whole budget; the process stays within it all the same.
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
/// The most of it one connection's calls hold at once: an eighth, so that one replica's
/// lookups leave room for seven more's at their worst. Still some 400 lookups of 128k-token
/// prompts at once.
pub const MAX_LOOKUP_BYTES_PER_CONNECTION: usize = MAX_LOOKUP_BYTES_IN_FLIGHT / 8;

/// The path of the one call charged.
const FIND_MATCHES: &str = "/continuum.fleet.v1.Fleet/FindMatches";

/// The process's budget for lookup bytes in flight.
#[derive(Debug)]
pub struct LookupBudget {
    limit: usize,
    /// The most one connection's calls hold of it.
    per_connection: usize,
    held: AtomicUsize,
    refused: Refusals,
    /// `continuum_dynamo_kv_lookup_bytes_held`: what `held` holds.
    gauge: IntGauge,
}

/// Where lookups the budget refused are counted, by the bound they would have passed.
#[derive(Debug)]
pub struct Refusals {
    /// `continuum_dynamo_kv_find_matches_total{result="over_budget"}`: the process's.
    pub over_budget: IntCounter,
    /// `…{result="over_connection_budget"}`: their connection's share.
    pub over_connection_budget: IntCounter,
}

/// What one connection's calls hold of the budget. The listener gives each connection one,
/// and tonic hands it to every call made on it (in the connection's `ConnectInfo`,
/// [`super::FleetConnection`]).
#[derive(Clone, Debug, Default)]
pub struct ConnectionLookups(Arc<AtomicUsize>);

/// Takes `bytes` into `held` if that leaves it at most `limit`.
fn take_within(held: &AtomicUsize, bytes: usize, limit: usize) -> bool {
    held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
        held.checked_add(bytes).filter(|after| *after <= limit)
    })
    .is_ok()
}

impl LookupBudget {
    /// A budget of `limit` bytes, `per_connection` of them at most for one connection's calls.
    pub fn new((limit, per_connection): (usize, usize), refused: Refusals, gauge: IntGauge) -> Self {
        Self { limit, per_connection, held: AtomicUsize::new(0), refused, gauge }
    }

    /// Takes `bytes` if they fit under the limit with what is held.
    fn take(&self, bytes: usize) -> bool {
        let taken = take_within(&self.held, bytes, self.limit);
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

/// What one call holds of the budget, and of its connection's share (none for a call that
/// came without one); given back when both its body and its answer are done.
#[derive(Debug)]
struct Charge {
    budget: Arc<LookupBudget>,
    connection: Option<ConnectionLookups>,
    held: AtomicUsize,
}

/// The bound a message would have passed.
#[derive(Clone, Copy, Debug)]
enum Over {
    Budget,
    ConnectionShare,
}

impl Charge {
    fn new(budget: &Arc<LookupBudget>, connection: Option<ConnectionLookups>) -> Self {
        Self { budget: Arc::clone(budget), connection, held: AtomicUsize::new(0) }
    }

    /// The process's budget first: when both are full, the refusal says the control plane is.
    fn take(&self, bytes: usize) -> Result<(), Over> {
        if !self.budget.take(bytes) {
            return Err(Over::Budget);
        }
        if let Some(ConnectionLookups(held)) = &self.connection
            && !take_within(held, bytes, self.budget.per_connection)
        {
            self.budget.give_back(bytes);
            return Err(Over::ConnectionShare);
        }
        self.held.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Counts a refusal past `over`, and says it to the caller.
    fn refuse(&self, over: Over) -> Status {
        let (counted, bound, whose) = match over {
            Over::Budget => (&self.budget.refused.over_budget, self.budget.limit, "the control plane holds"),
            Over::ConnectionShare => {
                (&self.budget.refused.over_connection_budget, self.budget.per_connection, "one connection's calls hold")
            }
        };
        counted.inc();
        Status::resource_exhausted(format!(
            "{whose} {bound} bytes of lookups in flight at most; this one is answered by load alone"
        ))
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let held = *self.held.get_mut();
        self.budget.give_back(held);
        if let Some(ConnectionLookups(connection)) = &self.connection {
            connection.fetch_sub(held, Ordering::AcqRel);
        }
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
            if declared > 0
                && let Err(over) = this.charge.take(declared)
            {
                this.refused = true;
                return Poll::Ready(Some(Err(this.charge.refuse(over))));
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
        // The connection's share, as the listener made it: absent, the process's bound alone.
        let connection = request.extensions().get::<super::FleetConnection>().map(|c| c.lookups.clone());
        let charge = Arc::new(Charge::new(&self.budget, connection));
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
        shared_budget(limit, limit)
    }

    fn shared_budget(limit: usize, per_connection: usize) -> Arc<LookupBudget> {
        let counter = |name: &str| IntCounter::new(name, name).expect("counter");
        let refused = Refusals { over_budget: counter("over"), over_connection_budget: counter("over_connection") };
        Arc::new(LookupBudget::new((limit, per_connection), refused, IntGauge::new("held", "held").expect("gauge")))
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
        charged_on(budget, None, frames)
    }

    /// A lookup's body on `connection` (none: a call without one).
    fn charged_on(budget: &Arc<LookupBudget>, connection: Option<&ConnectionLookups>, frames: Vec<Bytes>) -> Charged {
        let charge = Arc::new(Charge::new(budget, connection.cloned()));
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
        assert_eq!(budget.refused.over_budget.get(), 1);
        assert_eq!(budget.held(), 1200, "a refused message holds nothing");

        drop(first);
        assert_eq!(budget.held(), 0, "a body dropped gives its bytes back");
        assert_eq!(budget.gauge.get(), 0);
        let mut third = charged(&budget, message(995, &[]));
        assert!(third.frame().await.expect("a frame").is_ok(), "room again once the first let go");
        drop((second, third));
        assert_eq!(budget.held(), 0);
    }

    /// One connection's calls hold at most its share: past it, a lookup is refused as over
    /// the connection's share (not the process's budget, which has room), while a call on
    /// another connection still fits; a share comes back as its calls let go.
    #[tokio::test]
    async fn one_connections_lookups_hold_at_most_its_share() {
        let budget = shared_budget(4000, 1500);
        let (busy, other) = (ConnectionLookups::default(), ConnectionLookups::default());
        let mut first = charged_on(&budget, Some(&busy), message(995, &[]));
        assert!(first.frame().await.expect("a frame").is_ok(), "within the share");

        let mut second = charged_on(&budget, Some(&busy), message(995, &[]));
        let refused = second.frame().await.expect("an answer").expect_err("past the connection's share");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("one connection's calls hold 1500 bytes"), "{}", refused.message());
        assert_eq!((budget.refused.over_connection_budget.get(), budget.refused.over_budget.get()), (1, 0));
        assert_eq!(budget.held(), 1000, "the refused message gave the process's bytes back");

        let mut elsewhere = charged_on(&budget, Some(&other), message(995, &[]));
        assert!(elsewhere.frame().await.expect("a frame").is_ok(), "another connection has its own share");
        let mut unshared = charged_on(&budget, None, message(1995, &[]));
        assert!(unshared.frame().await.expect("a frame").is_ok(), "a call without a connection: the budget alone");
        assert_eq!(budget.held(), 4000);

        // Past both bounds at once, the process's is the one said.
        let mut again = charged_on(&budget, Some(&other), message(995, &[]));
        let full = again.frame().await.expect("an answer").expect_err("the process's budget is full");
        assert!(full.message().contains("the control plane holds 4000 bytes"), "{}", full.message());
        assert_eq!((budget.refused.over_connection_budget.get(), budget.refused.over_budget.get()), (1, 1));
        drop((first, second, elsewhere, unshared, again));
        assert_eq!(budget.held(), 0);
        let mut after = charged_on(&budget, Some(&busy), message(1495, &[]));
        assert!(after.frame().await.expect("a frame").is_ok(), "the connection's share came back whole");
    }
}
