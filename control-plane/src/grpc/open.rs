//! The one service a caller reaches without a token: `grpc.health.v1`'s `Check`, which probes
//! send without one, under a bound of its own.
//!
//! The server holds each call's stream, and the room tonic sets aside for its message as the
//! message's prefix arrives, until the call is answered, and a caller that never finishes its
//! message holds them for [`CALL_TIMEOUT`](super::CALL_TIMEOUT). Across the thousands of
//! streams the listener's connections may hold, callers without a token could have the
//! process set aside gigabytes that way. So `Check` calls in flight are bounded across the
//! process ([`MAX_OPEN_CALLS`]); past it one is refused at once (`RESOURCE_EXHAUSTED`,
//! counted in `continuum_fleet_calls_refused_total{call="health_check"}`). A probe's call is answered within
//! microseconds, so the bound is reached only by callers holding theirs open. `Watch`, a stream
//! its caller may keep for good, asks for the token as the Fleet calls do (and reflection does,
//! through the [`Gate`] itself).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::FutureExt;
use futures::future::BoxFuture;
use prometheus::IntCounter;
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response, header};
use tonic::server::NamedService;
use tower_service::Service;

use super::Gate;

/// Health checks in flight at once, across every connection, from callers with or without a
/// token.
pub const MAX_OPEN_CALLS: usize = 64;

/// The health service's stream, which asks for the token.
const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

/// The health service: `Check` open to every caller within [`MAX_OPEN_CALLS`], `Watch` to the
/// token's holders.
#[derive(Clone, Debug)]
pub struct Open<S> {
    inner: S,
    gate: Gate,
    calls: Arc<Semaphore>,
    refused: IntCounter,
}

impl<S> Open<S> {
    pub fn new(inner: S, gate: Gate, refused: IntCounter) -> Self {
        Self { inner, gate, calls: Arc::new(Semaphore::new(MAX_OPEN_CALLS)), refused }
    }
}

impl<S: NamedService> NamedService for Open<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Open<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if request.uri().path() == HEALTH_WATCH {
            let authorization = request.headers().get(header::AUTHORIZATION).map(|value| value.as_bytes());
            return match self.gate.admit(authorization) {
                Ok(_) => {
                    if let Some(connection) = request.extensions().get::<super::FleetConnection>() {
                        connection.admitted.set();
                    }
                    self.inner.call(request).boxed()
                }
                Err(refused) => futures::future::ready(Ok(refused.into_http())).boxed(),
            };
        }
        let Ok(permit) = Arc::clone(&self.calls).try_acquire_owned() else {
            self.refused.inc();
            let busy = Status::resource_exhausted(format!(
                "{MAX_OPEN_CALLS} health checks are in flight already; check again shortly"
            ));
            return futures::future::ready(Ok(busy.into_http())).boxed();
        };
        self.inner
            .call(request)
            .map(move |answer| {
                drop(permit);
                answer
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::watch;
    use tonic::Code;

    use super::*;
    use crate::bearer::Token;

    /// A health service whose every call waits until its `Notify` is told.
    #[derive(Clone)]
    struct Waits(Arc<tokio::sync::Notify>);

    impl Service<Request<Body>> for Waits {
        type Response = Response<Body>;
        type Error = Infallible;
        type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<Body>) -> Self::Future {
            let release = Arc::clone(&self.0);
            async move {
                release.notified().await;
                Ok(Response::new(Body::default()))
            }
            .boxed()
        }
    }

    fn open(release: &Arc<tokio::sync::Notify>) -> Open<Waits> {
        let (_, tokens) = watch::channel(vec![Token::new("t")]);
        let unauthenticated = IntCounter::new("unauthenticated", "unauthenticated").expect("a valid counter");
        let gate = Gate { tokens, unauthenticated };
        Open::new(Waits(Arc::clone(release)), gate, IntCounter::new("refused", "refused").expect("a valid counter"))
    }

    fn call(path: &str, authorization: Option<&str>) -> Request<Body> {
        let mut request = Request::builder().uri(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        request.body(Body::default()).expect("a request")
    }

    /// The gRPC status an answer carries in its head, if it is an error.
    fn code(answer: &Response<Body>) -> Option<Code> {
        Status::from_header_map(answer.headers()).map(|status| status.code())
    }

    #[tokio::test]
    async fn checks_in_flight_are_bounded_and_watch_asks_for_the_token() {
        let release = Arc::new(tokio::sync::Notify::new());
        let mut health = open(&release);
        let check = "/grpc.health.v1.Health/Check";
        let mut held: Vec<_> = (0..MAX_OPEN_CALLS).map(|_| health.call(call(check, None))).collect();
        for pending in &mut held {
            assert!(futures::poll!(pending).is_pending(), "within the bound, each check goes on");
        }
        let refused = health.call(call(check, None)).await.expect("infallible");
        assert_eq!(code(&refused), Some(Code::ResourceExhausted));
        assert_eq!(health.refused.get(), 1, "the refusal counted");
        // Checks that end give their room back.
        held.truncate(MAX_OPEN_CALLS - 1);
        let mut next = health.call(call(check, None));
        assert!(futures::poll!(&mut next).is_pending(), "room again");
        drop(held);

        let refused = health.call(call(HEALTH_WATCH, None)).await.expect("infallible");
        assert_eq!(code(&refused), Some(Code::Unauthenticated), "no token, no stream");
        assert_eq!(health.gate.unauthenticated.get(), 1);
        let mut watched = health.call(call(HEALTH_WATCH, Some("Bearer t")));
        assert!(futures::poll!(&mut watched).is_pending(), "the token's holder watches");
        release.notify_waiters();
        let answer = watched.await.expect("infallible");
        assert_eq!(code(&answer), None);
    }
}
