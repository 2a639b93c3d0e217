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
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
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
/// `conn`'s buffers) however many clients connect. Connections idle between requests are
/// closed to make room (see `accept`).
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
    serve_at_most(listener, app, stages, MAX_CONNECTIONS).await;
}

/// [`serve`], with `capacity` connections at once.
async fn serve_at_most(listener: TcpListener, app: App, stages: Stages, capacity: usize) {
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(capacity));
    let crowded = Arc::new(Notify::new());
    loop {
        let accepted = tokio::select! {
            () = stages.closing.cancelled() => break,
            accepted = accept(&listener, &slots, &crowded) => accepted,
        };
        match accepted {
            Ok((stream, slot)) => {
                // Responses go out whole, so Nagle's algorithm could only hold one back.
                if let Err(error) = stream.set_nodelay(true) {
                    tracing::debug!(%error, "could not set TCP_NODELAY on a client connection");
                }
                let gauge = app.state.metrics.http_connections.clone();
                gauge.inc();
                let (app, stages, crowded) = (app.clone(), stages.clone(), Arc::clone(&crowded));
                connections.spawn(async move {
                    // Dropping a connection cut mid-answer closes its socket and ends the
                    // dispatch behind it.
                    tokio::select! {
                        () = conn::serve(stream, app, &stages, &crowded) => {}
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

/// The next connection, once a slot is free for it. With every slot taken, the connections
/// waiting idle for a request (keep-alive ones between requests, and ones opened and silent)
/// are told to close, as nginx reuses its idle connections when it runs out: otherwise clients
/// that connect and send nothing could hold every slot for the idle timeout, and real ones
/// wait in the listen backlog meanwhile.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
    crowded: &Notify,
) -> std::io::Result<(TcpStream, OwnedSemaphorePermit)> {
    // Accepted first, so that idle connections close only for one that came: past the cap, one
    // connection waits here for its slot, and the rest in the listen backlog.
    let (stream, _) = listener.accept().await?;
    if slots.available_permits() == 0 {
        crowded.notify_waiters();
    }
    // The semaphore is never closed.
    let slot = Arc::clone(slots).acquire_owned().await.map_err(std::io::Error::other)?;
    Ok((stream, slot))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::http::{self, AppState};

    /// With every slot held by clients that connected and said nothing, a new client is still
    /// served: the silent ones are closed for it, and counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_connections_holding_every_slot_are_closed_for_a_new_one() -> anyhow::Result<()> {
        const CAPACITY: usize = 3;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(AppState::for_tests());
        let app = App { router: http::router(Arc::clone(&state)), state: Arc::clone(&state) };
        let stages = Stages::default();
        let server = tokio::spawn(serve_at_most(listener, app, stages.clone(), CAPACITY));
        let mut silent = Vec::new();
        for _ in 0..CAPACITY {
            silent.push(TcpStream::connect(addr).await?);
        }
        // Every slot taken (the gauge counts accepted connections).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while state.metrics.http_connections.get() < CAPACITY as i64 {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "the silent connections were accepted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut client = TcpStream::connect(addr).await?;
        client.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await?;
        let mut answer = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut answer)).await??;
        assert!(answer.starts_with(b"HTTP/1.1 "), "{:?}", String::from_utf8_lossy(&answer));
        for mut stream in silent {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest)).await;
            assert!(matches!(read, Ok(Ok(0))), "a silent connection closed: {read:?}");
        }
        assert_eq!(state.metrics.http_connections_shed.get(), CAPACITY as u64);
        stages.closing.cancel();
        stages.cut.cancel();
        server.await?;
        Ok(())
    }
}
