//! The replica's HTTP/1.1 server: an accept loop and one task per client connection.
//!
//! The data plane's hot path is a proxy hop, so its server is built for that: a request is read
//! into one buffer and parsed in place ([`head`]), a chat completion goes to its handler without
//! a routing layer in between, and a response leaves in as few writes as its body allows
//! (`conn`). The other endpoints are served by the axum router the connection hands them to.
//! Its cost per request is measured against nginx in `docs/benchmarks.md` (Data plane vs nginx).

mod conn;
pub mod head;
mod idle;

pub use conn::{MIN_WRITE_BYTES_PER_SECOND, WRITE_STALL_TIMEOUT};

use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use prometheus::IntGauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::http::AppState;

/// What every connection serves with.
#[derive(Debug, Clone)]
pub struct App {
    pub state: Arc<AppState>,
    /// Every endpoint but the chat completions fast path.
    pub router: Router,
}

/// Client connections served at once. Past it the server stops accepting until one closes, so
/// new clients wait (one accepted, the rest in the listen backlog): memory stays bounded (each connection holds at most
/// `conn`'s buffers) however many clients connect. Near it, connections wait idle only briefly
/// (`Slots::crowded`).
pub const MAX_CONNECTIONS: usize = 16_384;

/// The part of the slots whose being free or not makes the server crowded: with no more than
/// a sixteenth of them free, connections waiting idle hold what a new client may need.
const CROWDED_SHARE: usize = 16;

/// The connection slots, and whether they are nearly all taken.
#[derive(Debug)]
pub(super) struct Slots {
    free: Arc<Semaphore>,
    crowded_at: usize,
    /// Wakes the connections waiting idle: the server is closing, or became crowded
    /// (`Self::took_one`). One signal for both, so that a connection waits on one.
    pub(super) idle_call: Notify,
    /// Whether the last connection accepted found the server crowded.
    was_crowded: AtomicBool,
}

impl Slots {
    fn new(capacity: usize) -> Self {
        let (idle_call, was_crowded) = (Notify::new(), AtomicBool::new(false));
        Self { free: Arc::new(Semaphore::new(capacity)), crowded_at: capacity / CROWDED_SHARE, idle_call, was_crowded }
    }

    /// A connection took its slot. If that made the server crowded, every connection waiting
    /// idle since before is woken and waits only `CROWDED_IDLE_TIMEOUT` more, as those that
    /// start waiting while it is crowded do: otherwise the connections a client opened and
    /// left silent before the crowding (15 of every 16 slots) would keep their slots for the
    /// whole idle timeout, and open them again as soon as they were closed, while real clients
    /// competed for the rest. nginx closes its idle connections when it runs short so.
    fn took_one(&self) {
        let crowded = self.crowded();
        if self.was_crowded.swap(crowded, Ordering::Relaxed) != crowded && crowded {
            self.idle_call.notify_waiters();
        }
    }

    /// Whether a connection starting to wait idle should wait only briefly, as nginx reuses
    /// idle connections when it runs short: otherwise clients that connect and send nothing
    /// (or keep-alive ones between requests) could hold every slot for the idle timeout, and
    /// real ones wait in the listen backlog meanwhile. One atomic read.
    pub(super) fn crowded(&self) -> bool {
        self.free.available_permits() <= self.crowded_at
    }
}

/// How a server winds down, in three steps a replica takes in order (see `Replica::drain`).
#[derive(Debug, Clone, Default)]
pub struct Stages {
    /// Draining: every response from now on closes its connection, so keep-alive clients
    /// reconnect (through a load balancer that has stopped choosing this replica) while the
    /// server still accepts and answers.
    pub draining: Draining,
    /// Closing: accepting stops and idle connections close; a connection answering a request
    /// finishes it first.
    pub closing: CancellationToken,
    /// Cut: the grace period is over and every connection still open is closed mid-answer.
    pub cut: CancellationToken,
}

/// Whether the replica drains: read after every answer, so a flag (one atomic load) rather
/// than a `CancellationToken`, whose `is_cancelled` takes a mutex. Nothing waits on it.
#[derive(Debug, Clone, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    pub fn start(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Descriptors kept for all but client connections and their shim connections: the listener,
/// the fleet stream, liveness probes, artifact reads.
const RESERVED_DESCRIPTORS: u64 = 256;

/// The client connections an open-file limit (`None`: unlimited) leaves room for: each may
/// hold a shim connection beside its own while its request is dispatched, so half of what the
/// reserve leaves, and at most [`MAX_CONNECTIONS`]. A cap past the limit would never be
/// reached: accepting would fail for want of descriptors instead, and dispatches with it, while
/// connections idle for their whole timeout since the server never looks crowded.
pub fn connection_cap(open_files: Option<u64>) -> usize {
    let room = open_files.map_or(u64::MAX, |limit| limit.saturating_sub(RESERVED_DESCRIPTORS) / 2);
    usize::try_from(room).unwrap_or(usize::MAX).clamp(1, MAX_CONNECTIONS)
}

/// Accepts connections until `stages.closing`, then waits for the ones open to finish their
/// current request (idle ones close at once), or for `stages.cut`. The open-file limit is raised
/// as far as it goes, and bounds the connections served at once ([`connection_cap`]).
pub async fn serve(listener: TcpListener, app: App, stages: Stages) {
    let (open_files, refused) = continuum_proto::os::raise_open_file_limit();
    if let Some(error) = refused {
        tracing::warn!(%error, "could not raise the open-file limit to its hard limit");
    }
    let capacity = connection_cap(open_files);
    if capacity < MAX_CONNECTIONS {
        tracing::warn!(
            open_files,
            capacity,
            "the open-file limit leaves room for fewer client connections than {MAX_CONNECTIONS}; raise it (ulimit -n, LimitNOFILE) to serve more"
        );
    }
    app.state.metrics.http_connection_capacity.set(i64::try_from(capacity).unwrap_or(i64::MAX));
    serve_at_most(listener, app, stages, capacity).await;
}

/// How long a client connection may be silent before the kernel probes it, and between probes
/// (three unanswered end it); and how long bytes written to it may go unacknowledged. A client
/// gone without a FIN or a reset (its host lost, a NAT's mapping expired) would otherwise hold
/// its dispatch, a worker generating for nobody, until the answer's own timeout.
pub const CLIENT_KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
pub const CLIENT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const CLIENT_USER_TIMEOUT: Duration = Duration::from_secs(60);

fn keep_alive(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    crate::tcp::probe_idle(stream, CLIENT_KEEPALIVE_IDLE, CLIENT_KEEPALIVE_INTERVAL, CLIENT_USER_TIMEOUT)
}

/// [`serve`], with `capacity` connections at once.
async fn serve_at_most(listener: TcpListener, app: App, stages: Stages, capacity: usize) {
    // The connection tasks, aborted together once the grace period is over. (A select on the
    // cut inside each task would take its token's two locks at every wake of every connection.)
    let mut connections = JoinSet::new();
    let slots = Arc::new(Slots::new(capacity));
    loop {
        let accepted = tokio::select! {
            () = stages.closing.cancelled() => break,
            accepted = accept(&listener, &slots.free) => accepted,
        };
        match accepted {
            Ok((stream, slot)) => {
                slots.took_one();
                // Responses go out whole, so Nagle's algorithm could only hold one back.
                if let Err(error) = stream.set_nodelay(true) {
                    tracing::debug!(%error, "could not set TCP_NODELAY on a client connection");
                }
                if let Err(error) = keep_alive(&stream) {
                    tracing::debug!(%error, "could not set TCP keepalive on a client connection");
                }
                // The set lets go of the connections that ended, so it holds about as many
                // tasks as there are open connections (at most twice `capacity`).
                while connections.try_join_next().is_some() {}
                let open = Open::new(&app.state.metrics.http_connections, slot);
                let (app, stages, slots) = (app.clone(), stages.clone(), Arc::clone(&slots));
                connections.spawn(async move {
                    // Aborted mid-answer, the task drops the connection, which closes its
                    // socket and ends the dispatch behind it.
                    conn::serve(stream, app, &stages, &slots).await;
                    drop(open);
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
    // Connections waiting idle close now; those answering finish first.
    slots.idle_call.notify_waiters();
    let all_ended = async { while connections.join_next().await.is_some() {} };
    tokio::select! {
        () = all_ended => return,
        () = stages.cut.cancelled() => {}
    }
    tracing::warn!(connections = connections.len(), "the grace period is over: closing connections still answering");
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// An open connection: counted on `continuum_http_connections` and holding its slot until it
/// ends or is cut.
struct Open {
    gauge: IntGauge,
    _slot: OwnedSemaphorePermit,
}

impl Open {
    fn new(gauge: &IntGauge, slot: OwnedSemaphorePermit) -> Self {
        gauge.inc();
        Self { gauge: gauge.clone(), _slot: slot }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The next connection, once a slot is free for it. Accepted first: a slot taken ahead of the
/// connection would read as one more taken to `Slots::crowded`. Past the cap, one connection
/// waits here for its slot, and the rest in the listen backlog.
async fn accept(listener: &TcpListener, slots: &Arc<Semaphore>) -> std::io::Result<(TcpStream, OwnedSemaphorePermit)> {
    let (stream, _) = listener.accept().await?;
    // The semaphore is never closed.
    let slot = Arc::clone(slots).acquire_owned().await.map_err(std::io::Error::other)?;
    Ok((stream, slot))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::http::{self, AppState};
    use crate::server::conn::CROWDED_IDLE_TIMEOUT;

    /// A client connection is probed when idle and given up when its bytes go unacknowledged.
    #[tokio::test]
    async fn client_connections_are_probed_by_tcp_keepalive() -> std::io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let _client = tokio::net::TcpStream::connect(listener.local_addr()?).await?;
        let (stream, _) = listener.accept().await?;
        keep_alive(&stream)?;
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive()?);
        assert_eq!(socket.tcp_keepalive_time()?, CLIENT_KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval()?, CLIENT_KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_keepalive_retries()?, 3);
        assert_eq!(socket.tcp_user_timeout()?, Some(CLIENT_USER_TIMEOUT));
        Ok(())
    }

    #[test]
    fn the_open_file_limit_bounds_the_connections_served_at_once() {
        assert_eq!(connection_cap(None), MAX_CONNECTIONS);
        assert_eq!(connection_cap(Some(1 << 20)), MAX_CONNECTIONS);
        assert_eq!(connection_cap(Some(1024)), 384, "a shim connection beside each, 256 kept for the rest");
        assert_eq!(connection_cap(Some(100)), 1, "never none");
    }

    /// Every connection's task lives as long as the connection, idle ones included (up to
    /// [`MAX_CONNECTIONS`] of them): the work of answering a request is held apart, and only
    /// while a request is answered, so an idle connection holds its buffers and little else.
    #[tokio::test]
    async fn an_idle_connection_holds_a_small_task() -> anyhow::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let client = TcpStream::connect(listener.local_addr()?).await?;
        let (stream, _) = listener.accept().await?;
        let state = Arc::new(AppState::for_tests());
        let app = App { router: http::router(Arc::clone(&state)), state };
        let (stages, slots) = (Stages::default(), Slots::new(1));
        let task = conn::serve(stream, app, &stages, &slots);
        let size = std::mem::size_of_val(&task);
        assert!(size <= 2048, "a connection's task holds {size} bytes");
        drop((task, client));
        Ok(())
    }

    /// One whole answer to a request `stream` sent: its head, then as many bytes as its
    /// `content-length` says.
    async fn read_answer(stream: &mut TcpStream) -> anyhow::Result<String> {
        let mut answer = Vec::new();
        let mut byte = [0u8; 1];
        while !answer.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).await?;
            answer.push(byte[0]);
        }
        let head = String::from_utf8(answer)?;
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .ok_or_else(|| anyhow::anyhow!("no content-length in {head:?}"))?
            .trim()
            .parse()?;
        let mut body = vec![0u8; length];
        stream.read_exact(&mut body).await?;
        Ok(head + &String::from_utf8_lossy(&body))
    }

    /// A keep-alive connection waiting for its next request closes as soon as the server
    /// begins to close, however many requests it served (each wait reuses the connection's
    /// one wait for the closing), without the grace period's cut.
    #[tokio::test]
    async fn closing_ends_a_connection_that_waits_between_requests() -> anyhow::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(AppState::for_tests());
        let app = App { router: http::router(Arc::clone(&state)), state: Arc::clone(&state) };
        let stages = Stages::default();
        let server = tokio::spawn(serve_at_most(listener, app, stages.clone(), 4));
        let mut client = TcpStream::connect(addr).await?;
        for _ in 0..3 {
            client.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await?;
            let answer = tokio::time::timeout(Duration::from_secs(5), read_answer(&mut client)).await??;
            // Without a fleet yet the answer is a 503, on a connection kept open all the same.
            anyhow::ensure!(answer.starts_with("HTTP/1.1 ") && !answer.contains("connection: close"), "{answer}");
        }
        let waiting = &state.metrics.http_connections_waiting;
        let back = async {
            while waiting.get() < 1 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), back).await?;
        stages.closing.cancel();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "closed with nothing more said: {closed:?}");
        tokio::time::timeout(Duration::from_secs(5), server).await??;
        assert!(!stages.cut.is_cancelled(), "no cut was needed");
        assert_eq!(waiting.get(), 0);
        Ok(())
    }

    /// With nearly every slot held, connections waiting idle wait only briefly, those idle from
    /// before the crowding too: a new client gets a slot; without the crowding they wait on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn near_capacity_idle_connections_give_their_slots_to_new_ones() -> anyhow::Result<()> {
        const CAPACITY: usize = 3;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(AppState::for_tests());
        let app = App { router: http::router(Arc::clone(&state)), state: Arc::clone(&state) };
        let stages = Stages::default();
        let server = tokio::spawn(serve_at_most(listener, app, stages.clone(), CAPACITY));
        // Keep-alive clients, one after another, each idle after one request.
        let ask = async |stream: &mut TcpStream| -> anyhow::Result<()> {
            stream.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await?;
            let mut head = [0u8; 12];
            tokio::time::timeout(CROWDED_IDLE_TIMEOUT * 5, stream.read_exact(&mut head)).await??;
            anyhow::ensure!(head.starts_with(b"HTTP/1.1 "), "{:?}", String::from_utf8_lossy(&head));
            Ok(())
        };
        let waiting = &state.metrics.http_connections_waiting;
        let shed = || state.metrics.http_connections_shed.get();
        let mut idle = Vec::new();
        let mut open_one = async || -> anyhow::Result<()> {
            let mut stream = TcpStream::connect(addr).await?;
            ask(&mut stream).await?;
            idle.push(stream);
            // Its connection back in its idle wait before the next one comes.
            let back = async {
                while waiting.get() < idle.len() as i64 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            };
            Ok(tokio::time::timeout(Duration::from_secs(10), back).await?)
        };
        open_one().await?;
        open_one().await?;
        // Not crowded: they may wait longer than a crowded server's idle timeout.
        tokio::time::sleep(CROWDED_IDLE_TIMEOUT + Duration::from_millis(500)).await;
        assert_eq!((waiting.get(), shed()), (2, 0), "both wait on");
        // The last slot taken: the server is crowded, and every idle connection, those that
        // waited from before too, waits only the crowded timeout more.
        open_one().await?;
        let mut client = TcpStream::connect(addr).await?;
        ask(&mut client).await?;
        // The first to go let the client in; the others' deadlines came with it.
        let all_gave_way = async {
            while shed() < CAPACITY as u64 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let gave_way = tokio::time::timeout(CROWDED_IDLE_TIMEOUT * 2, all_gave_way).await;
        assert!(gave_way.is_ok(), "every idle connection gave way, not only the last: {} did", shed());
        for mut stream in idle {
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
            assert!(matches!(closed, Ok(Ok(_))), "closed: {closed:?}");
        }
        stages.closing.cancel();
        stages.cut.cancel();
        server.await?;
        assert_eq!(waiting.get(), 0, "no connection is left counted as waiting once all closed");
        Ok(())
    }
}
