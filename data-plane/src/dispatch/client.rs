//! The pooled HTTP/1.1 client the data plane dials shim replicas with: keep-alive connections
//! reused across requests, a bounded connect, and a deadline on the response head.

use std::time::Duration;

use axum::http::{Request, Response};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Idle keep-alive connections to one shim replica kept for reuse.
pub const POOL_MAX_IDLE_PER_HOST: usize = 256;
/// An idle pooled connection is closed after this long.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("could not connect to the shim replica: {0}")]
    Connect(#[source] hyper_util::client::legacy::Error),
    #[error("the exchange with the shim replica failed: {0}")]
    Exchange(#[source] hyper_util::client::legacy::Error),
    #[error("the shim replica sent no response head within {0:?}")]
    HeadTimeout(Duration),
}

impl SendError {
    /// Only a failed connection proves the request never reached the shim, so only then may it
    /// be sent again to another replica.
    pub fn before_request_sent(&self) -> bool {
        matches!(self, SendError::Connect(_))
    }
}

#[derive(Debug, Clone)]
pub struct ShimClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl ShimClient {
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Self { inner }
    }

    /// Sends `request` and waits at most `head_timeout` for the response head.
    pub async fn send(
        &self,
        request: Request<Full<Bytes>>,
        head_timeout: Duration,
    ) -> Result<Response<Incoming>, SendError> {
        match tokio::time::timeout(head_timeout, self.inner.request(request)).await {
            Err(_) => Err(SendError::HeadTimeout(head_timeout)),
            Ok(Err(error)) if error.is_connect() => Err(SendError::Connect(error)),
            Ok(Err(error)) => Err(SendError::Exchange(error)),
            Ok(Ok(response)) => Ok(response),
        }
    }
}
