//! The replica's HTTP/1.1 server: an accept loop and one task per client connection.
//!
//! The data plane's hot path is a proxy hop, so its server is built for that: a request is read
//! into one buffer and parsed in place ([`head`]), a chat completion goes to its handler without
//! a routing layer in between, and a response leaves in as few writes as its body allows
//! (`conn`). The other endpoints are served by the axum router the connection hands them to.
//! Its cost per request is measured against nginx in `docs/benchmarks.md` (Data plane vs nginx).

mod conn;
pub mod head;

pub use conn::{MIN_WRITE_BYTES_PER_SECOND, WRITE_STALL_TIMEOUT};

use std::io::ErrorKind;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::http::AppState;

/// What every connection serves with.
#[derive(Debug, Clone)]
pub struct App {
    pub state: Arc<AppState>,
    /// Every endpoint but the chat completions fast path.
    pub router: Router,
}

/// Client connections served at once. Past it the server stops accepting until one closes, so
/// new clients wait in the listen backlog: memory stays bounded (each connection holds at most
/// `conn`'s buffers) however many clients connect.
pub const MAX_CONNECTIONS: usize = 16_384;

/// How a server winds down, in three steps a replica takes in order (see `Replica::drain`).
#[derive(Debug, Clone, Default)]
pub struct Stages {
    /// Draining: every response from now on closes its connection, so keep-alive clients
    /// reconnect (through a load balancer that has stopped choosing this replica) while the
    /// server still accepts and answers.
    pub draining: CancellationToken,
    /// Closing: accepting stops and idle connections close; a connection answering a request
    /// finishes it first.
    pub closing: CancellationToken,
    /// Cut: the grace period is over and every connection still open is closed mid-answer.
    pub cut: CancellationToken,
}

/// Accepts connections until `stages.closing`, then waits for the ones open to finish their
/// current request (idle ones close at once), or for `stages.cut`.
pub async fn serve(listener: TcpListener, app: App, stages: Stages) {
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            () = stages.closing.cancelled() => break,
            accepted = accept(&listener, &slots) => accepted,
        };
        match accepted {
            Ok((stream, slot)) => {
                // Responses go out whole, so Nagle's algorithm could only hold one back.
                if let Err(error) = stream.set_nodelay(true) {
                    tracing::debug!(%error, "could not set TCP_NODELAY on a client connection");
                }
                let gauge = app.state.metrics.http_connections.clone();
                gauge.inc();
                let (app, stages) = (app.clone(), stages.clone());
                connections.spawn(async move {
                    // Dropping a connection cut mid-answer closes its socket and ends the
                    // dispatch behind it.
                    tokio::select! {
                        () = conn::serve(stream, app, &stages) => {}
                        () = stages.cut.cancelled() => {}
                    }
                    gauge.dec();
                    drop(slot);
                });
            }
            // The client gave up before it was accepted: nothing to do.
            Err(error) if matches!(error.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset) => {}
            // Out of file descriptors or memory: back off rather than spin.
            Err(error) => {
                tracing::warn!(%error, "accepting a client connection failed; retrying shortly");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(listener);
    connections.close();
    tokio::select! {
        () = connections.wait() => return,
        () = stages.cut.cancelled() => {}
    }
    tracing::warn!(connections = connections.len(), "the grace period is over: closing connections still answering");
    connections.wait().await;
}

/// The next connection, once a slot is free for it.
async fn accept(listener: &TcpListener, slots: &Arc<Semaphore>) -> std::io::Result<(TcpStream, OwnedSemaphorePermit)> {
    // The semaphore is never closed.
    let slot = Arc::clone(slots).acquire_owned().await.map_err(std::io::Error::other)?;
    let (stream, _) = listener.accept().await?;
    Ok((stream, slot))
}
