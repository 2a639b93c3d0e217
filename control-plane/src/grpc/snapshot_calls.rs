//! `GetSnapshot` calls in flight, bounded across the process.
//!
//! A call builds the whole fleet as one message (a 16,384-worker fleet is some 1.2 MiB, up to
//! the 64 MiB a Fleet message may hold) and tonic encodes it whole; both are held until the
//! caller has read the answer. Replicas never call it (their Watch streams send snapshots, one
//! unacknowledged at a time): it is for inspection, so [`MAX_SNAPSHOT_CALLS`] in flight suffice,
//! and a token holder polling it in a loop over many streams cannot have the process hold a
//! fleet per stream. Past the bound a call is refused at once (`RESOURCE_EXHAUSTED`, counted in
//! `continuum_fleet_calls_refused_total{call="get_snapshot"}`). A call's room is held until its
//! answer's body is sent or dropped.

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

/// `GetSnapshot` calls answered at once, at most.
pub const MAX_SNAPSHOT_CALLS: usize = 4;

const GET_SNAPSHOT: &str = "/continuum.fleet.v1.Fleet/GetSnapshot";

/// A service whose `GetSnapshot` calls are bounded; every other call passes.
#[derive(Clone, Debug)]
pub struct SnapshotCalls<S> {
    inner: S,
    room: Arc<Semaphore>,
    refused: IntCounter,
}

impl<S> SnapshotCalls<S> {
    pub fn new(inner: S, refused: IntCounter) -> Self {
        Self { inner, room: Arc::new(Semaphore::new(MAX_SNAPSHOT_CALLS)), refused }
    }
}

impl<S: NamedService> NamedService for SnapshotCalls<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<Request<Body>> for SnapshotCalls<S>
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
        if request.uri().path() != GET_SNAPSHOT {
            return self.inner.call(request).map(|answer| answer.map(|response| response.map(Body::new))).boxed();
        }
        let Ok(room) = Arc::clone(&self.room).try_acquire_owned() else {
            self.refused.inc();
            let busy = Status::resource_exhausted(format!(
                "{MAX_SNAPSHOT_CALLS} snapshots are being answered already; ask again shortly"
            ));
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

    /// A service answering every call at once with a one-frame body.
    #[derive(Clone)]
    struct Answers;

    impl Service<Request<Body>> for Answers {
        type Response = Response<Body>;
        type Error = Infallible;
        type Future = futures::future::Ready<Result<Response<Body>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<Body>) -> Self::Future {
            futures::future::ready(Ok(Response::new(Body::new(http_body_util::Full::new(Bytes::from_static(
                b"fleet",
            ))))))
        }
    }

    fn call(path: &str) -> Request<Body> {
        Request::builder().uri(path).body(Body::default()).expect("a request")
    }

    fn code(answer: &Response<Body>) -> Option<Code> {
        Status::from_header_map(answer.headers()).map(|status| status.code())
    }

    /// Snapshots are answered a few at a time, each holding its room until its body is sent
    /// or dropped; every other call passes.
    #[tokio::test]
    async fn snapshots_in_flight_are_bounded_until_their_bodies_go() {
        let refused = IntCounter::new("refused", "refused").expect("a valid counter");
        let mut fleet = SnapshotCalls::new(Answers, refused.clone());
        let mut held = Vec::new();
        for _ in 0..MAX_SNAPSHOT_CALLS {
            let answer = fleet.call(call(GET_SNAPSHOT)).await.expect("infallible");
            assert_eq!(code(&answer), None);
            held.push(answer.into_body());
        }
        let busy = fleet.call(call(GET_SNAPSHOT)).await.expect("infallible");
        assert_eq!(code(&busy), Some(Code::ResourceExhausted));
        assert_eq!(refused.get(), 1);
        let other = fleet.call(call("/continuum.fleet.v1.Fleet/FindMatches")).await.expect("infallible");
        assert_eq!(code(&other), None, "other calls are not bounded");

        // A body sent whole gives its room back (dropped, as the server drops it once sent).
        let sent = http_body_util::BodyExt::collect(held.remove(0)).await.expect("a body").to_bytes();
        assert_eq!(&sent[..], b"fleet");
        let answer = fleet.call(call(GET_SNAPSHOT)).await.expect("infallible");
        assert_eq!(code(&answer), None, "room again");
    }
}
