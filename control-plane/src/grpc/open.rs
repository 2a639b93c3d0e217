//! The health service, which a caller reaches without a token for its `Check` (probes send
//! none; [`super::bounded`] bounds those in flight) and only with one for its `Watch`, a stream
//! its caller may keep for good, as the Fleet calls and reflection ask (through the [`Gate`]).

use std::convert::Infallible;
use std::task::{Context, Poll};

use futures::FutureExt;
use futures::future::BoxFuture;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response, header};
use tonic::server::NamedService;
use tower_service::Service;

use super::{FleetConnection, Gate};

/// The health service's stream, which asks for the token.
const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

/// The health service with its `Watch` behind the gate; every other call passes.
#[derive(Clone, Debug)]
pub struct Open<S> {
    inner: S,
    gate: Gate,
}

impl<S> Open<S> {
    pub fn new(inner: S, gate: Gate) -> Self {
        Self { inner, gate }
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
        if request.uri().path() != HEALTH_WATCH {
            return self.inner.call(request).boxed();
        }
        let authorization = request.headers().get(header::AUTHORIZATION).map(|value| value.as_bytes());
        match self.gate.admit(authorization) {
            Ok(_) => {
                if let Some(connection) = request.extensions().get::<FleetConnection>() {
                    connection.admitted.set();
                }
                self.inner.call(request).boxed()
            }
            Err(refused) => futures::future::ready(Ok(refused.into_http())).boxed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::IntCounter;
    use tokio::sync::watch;
    use tonic::Code;

    use super::*;
    use crate::bearer::Token;
    use crate::grpc::tests::{Answers, code};

    fn call(path: &str, authorization: Option<&str>) -> Request<Body> {
        let mut request = Request::builder().uri(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        let mut request = request.body(Body::default()).expect("a request");
        request.extensions_mut().insert(FleetConnection::default());
        request
    }

    #[tokio::test]
    async fn watch_asks_for_the_token_and_check_does_not() {
        let (_, tokens) = watch::channel(vec![Token::new("t")]);
        let unauthenticated = IntCounter::new("unauthenticated", "unauthenticated").expect("a valid counter");
        let mut health = Open::new(Answers, Gate { tokens, unauthenticated: unauthenticated.clone() });

        let checked = health.call(call("/grpc.health.v1.Health/Check", None)).await.expect("infallible");
        assert_eq!(code(&checked), None, "a check needs no token");
        let refused = health.call(call(HEALTH_WATCH, None)).await.expect("infallible");
        assert_eq!(code(&refused), Some(Code::Unauthenticated), "no token, no stream");
        assert_eq!(unauthenticated.get(), 1);

        let request = call(HEALTH_WATCH, Some("Bearer t"));
        let connection = request.extensions().get::<FleetConnection>().cloned().expect("the connection");
        let watched = health.call(request).await.expect("infallible");
        assert_eq!(code(&watched), None, "the token's holder watches");
        assert!(connection.admitted.get(), "and its connection counts as one that made a call");
    }
}
