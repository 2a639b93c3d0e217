//! Calls of one kind in flight, bounded across the process: past the bound one is refused at
//! once (`RESOURCE_EXHAUSTED`, counted in `continuum_fleet_calls_refused_total{call}`), and a
//! call's room is held until its answer's body is sent or dropped.
//!
//! Two kinds are bounded. A health `Check` asks for no token (probes send none), and the server
//! holds each call's stream, and the room tonic sets aside for its message as the message's
//! prefix arrives, until the call is answered: across the thousands of streams the listener's
//! connections may hold, callers without a token could otherwise have the process set aside
//! gigabytes ([`MAX_OPEN_CALLS`]; a probe's check is answered within microseconds, so only
//! callers holding theirs open reach it). A `GetSnapshot` builds the whole fleet as one message
//! (a 16,384-worker fleet is some 1.2 MiB, up to the 64 MiB a Fleet message may hold), which
//! tonic encodes whole and both are held until the caller has read the answer; replicas never
//! call it (their Watch streams send snapshots, one unacknowledged at a time), so a few suffice
//! ([`MAX_SNAPSHOT_CALLS`]), and a token holder polling it over many streams cannot have the
//! process hold a fleet per stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body::{Frame, SizeHint};
use prometheus::IntCounter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::server::NamedService;
use tower_service::Service;

/// Health checks in flight at once, across every connection, from callers with or without a
/// token.
pub const MAX_OPEN_CALLS: usize = 64;
/// `GetSnapshot` calls answered at once, at most.
pub const MAX_SNAPSHOT_CALLS: usize = 4;

/// One kind of call, bounded: its path, how many may be in flight, and how it is named in the
/// refusal (a plural) and in `continuum_fleet_calls_refused_total{call}`.
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    pub path: &'static str,
    pub most: usize,
    pub what: &'static str,
    pub label: &'static str,
}

pub const HEALTH_CHECKS: Kind =
    Kind { path: "/grpc.health.v1.Health/Check", most: MAX_OPEN_CALLS, what: "health checks", label: "health_check" };
pub const SNAPSHOTS: Kind = Kind {
    path: "/continuum.fleet.v1.Fleet/GetSnapshot",
    most: MAX_SNAPSHOT_CALLS,
    what: "snapshots",
    label: "get_snapshot",
};

/// A service whose calls of one [`Kind`] are bounded; every other call passes.
#[derive(Clone, Debug)]
pub struct Bounded<S> {
    inner: S,
    kind: Kind,
    room: Arc<Semaphore>,
    refused: IntCounter,
}

impl<S> Bounded<S> {
    pub fn new(inner: S, kind: Kind, refused: IntCounter) -> Self {
        Self { inner, kind, room: Arc::new(Semaphore::new(kind.most)), refused }
    }
}

impl<S: NamedService> NamedService for Bounded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<Request<Body>> for Bounded<S>
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if request.uri().path() != self.kind.path {
            return self.inner.call(request).map(|answer| answer.map(|response| response.map(Body::new))).boxed();
        }
        let Ok(room) = Arc::clone(&self.room).try_acquire_owned() else {
            self.refused.inc();
            let Kind { most, what, .. } = self.kind;
            let busy = Status::resource_exhausted(format!("{most} {what} are in flight already; ask again shortly"));
            return futures::future::ready(Ok(busy.into_http())).boxed();
        };
        self.inner
            .call(request)
            .map(|answer| answer.map(|response| response.map(|body| Body::new(Holding { body, _room: room }))))
            .boxed()
    }
}

/// An answer's body holding its call's room until it is sent whole or dropped.
struct Holding<B> {
    body: B,
    _room: OwnedSemaphorePermit,
}

impl<B: http_body::Body<Data = Bytes> + Unpin> http_body::Body for Holding<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;
    use crate::grpc::tests::{Answers, code};

    fn call(path: &str) -> Request<Body> {
        Request::builder().uri(path).body(Body::default()).expect("a request")
    }

    /// Calls of a kind are answered a few at a time, each holding its room until its body is
    /// sent or dropped; every other call passes.
    #[tokio::test]
    async fn calls_in_flight_are_bounded_until_their_bodies_go() {
        for kind in [SNAPSHOTS, HEALTH_CHECKS] {
            let refused = IntCounter::new("refused", "refused").expect("a valid counter");
            let mut service = Bounded::new(Answers, kind, refused.clone());
            let mut held = Vec::new();
            for _ in 0..kind.most {
                let answer = service.call(call(kind.path)).await.expect("infallible");
                assert_eq!(code(&answer), None, "{}", kind.label);
                held.push(answer.into_body());
            }
            let busy = service.call(call(kind.path)).await.expect("infallible");
            assert_eq!(code(&busy), Some(Code::ResourceExhausted), "{}", kind.label);
            assert_eq!(refused.get(), 1);
            let other = service.call(call("/continuum.fleet.v1.Fleet/FindMatches")).await.expect("infallible");
            assert_eq!(code(&other), None, "other calls are not bounded");

            // A body sent whole gives its room back (dropped, as the server drops it once sent).
            let sent = http_body_util::BodyExt::collect(held.remove(0)).await.expect("a body").to_bytes();
            assert_eq!(&sent[..], b"fleet");
            let answer = service.call(call(kind.path)).await.expect("infallible");
            assert_eq!(code(&answer), None, "{}: room again", kind.label);
        }
    }
}
