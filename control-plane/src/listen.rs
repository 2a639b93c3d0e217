//! What the control plane's listeners (the Fleet gRPC and the admin HTTP) let a connection hold.
//!
//! Neither hyper's HTTP/2 server nor axum's HTTP/1 one closes a connection that sends nothing:
//! one that never sends the HTTP/2 preface, or stops inside a request head, would hold its
//! socket for good, and enough of them would exhaust the process's descriptors (tonic then spins
//! on a failing accept). So every accepted connection is [`Guarded`]: closed once it has sent
//! nothing for [`SILENT_FOR`] (or, its window shut to what is written, read nothing for as
//! long), and counted against a bound on the connections each listener
//! holds and each peer address holds on it, past which new ones are closed at
//! once and counted. A live Fleet connection is never silent that long: the server pings every
//! 10 s, idle or not, and the replica's HTTP/2 stack answers.
//!
//! A Fleet connection that makes no call the token admits within [`SILENT_FOR`] of its accept
//! is closed too: a caller without the token (health checks ask for none) could otherwise hold
//! connections by answering pings, and eight addresses would fill the listener. The admin
//! listener's few legitimate peers (a scraper, the kubelet's probes) keep room whatever one
//! other address holds. Where callers must be kept out altogether,
//! `control_plane.tls.client_ca` refuses them at the handshake.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use continuum_proto::log_budget::LogBudget;
use prometheus::IntCounterVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

use crate::grpc::{FleetConnection, MAX_WATCH_SESSIONS};
use crate::metrics::Metrics;

/// A connection that sends nothing for this long is closed, and so is one that reads nothing of
/// what is written to it for as long.
pub const SILENT_FOR: Duration = Duration::from_secs(30);
/// Connections the Fleet listener holds at once: a replica holds two (its Watch stream, its
/// lookups), and the sessions are bounded at 1,024; the rest is room for tools, reconnects and
/// callers the bound makes pay for each connection they hold.
pub const MAX_FLEET_CONNECTIONS: usize = 16_384;
/// Connections one peer address may hold on the Fleet listener: every session's two and room
/// for reconnects, since one address may front every replica (a service mesh's sidecar
/// connects from loopback, a NAT from its own address). A connection with no credential may
/// stay open while it answers pings, so without a share one host could fill the listener and
/// shut out every replica that reconnects; with it, that takes eight.
pub const MAX_FLEET_CONNECTIONS_PER_PEER: usize = 2 * MAX_WATCH_SESSIONS + 256;
/// Connections the admin listener holds at once: operators, scrapers and probes.
pub const MAX_ADMIN_CONNECTIONS: usize = 256;
/// Connections one peer address may hold on the admin listener.
pub const MAX_ADMIN_CONNECTIONS_PER_PEER: usize = 32;

/// The address a request's connection came from, on each request an HTTP listener serves.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

/// Why a connection was closed by its listener rather than by its peer or its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// The listener held its most connections already.
    Full,
    /// The peer's address held its most connections on the listener already.
    PeerFull,
    /// It sent nothing at all for [`SILENT_FOR`] (no HTTP/2 preface, no request).
    Silent,
    /// It sent nothing more for [`SILENT_FOR`] (a keep-alive connection between requests, or
    /// a request head never finished): as a server closes an idle connection.
    Idle,
    /// Its request head was not whole within [`ADMIN_HEAD_TIMEOUT`], however slowly its bytes
    /// kept coming (admin only).
    HeadTimeout,
    /// It read nothing of what was written to it for [`SILENT_FOR`]: an answer left unread
    /// holds its connection's slot, and no read deadline sees it (the server does not read
    /// while it writes).
    Unread,
    /// It made no call the token admits within [`SILENT_FOR`] of its accept (Fleet only).
    NoCall,
}

impl Closed {
    pub const ALL: [Closed; 7] = [
        Closed::Full,
        Closed::PeerFull,
        Closed::Silent,
        Closed::Idle,
        Closed::HeadTimeout,
        Closed::Unread,
        Closed::NoCall,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Closed::Full => "full",
            Closed::PeerFull => "peer_full",
            Closed::Silent => "silent",
            Closed::Idle => "idle",
            Closed::HeadTimeout => "head_timeout",
            Closed::Unread => "unread",
            Closed::NoCall => "no_call",
        }
    }
}

/// One listener's bound and its count of closed connections (labelled `listener`, `reason`).
#[derive(Debug, Clone)]
pub struct Guard {
    slots: Arc<Semaphore>,
    /// Connections held per peer address, when bounded ([`MAX_ADMIN_CONNECTIONS_PER_PEER`],
    /// [`MAX_FLEET_CONNECTIONS_PER_PEER`]).
    peers: Option<(PeerCounts, usize)>,
    closed: IntCounterVec,
    listener: &'static str,
    silent_for: Duration,
    /// How long a connection may go without a call the token admits (Fleet only).
    call_within: Option<Duration>,
    /// A line a minute about peers over their share, for this listener.
    peer_full_warnings: Arc<LogBudget>,
}

impl Guard {
    pub fn new(listener: &'static str, max_connections: usize, closed: IntCounterVec) -> Self {
        for reason in Closed::ALL {
            closed.with_label_values(&[listener, reason.as_str()]);
        }
        Self {
            slots: Arc::new(Semaphore::new(max_connections)),
            peers: None,
            closed,
            listener,
            silent_for: SILENT_FOR,
            call_within: None,
            peer_full_warnings: Arc::new(LogBudget::per_minute(1)),
        }
    }

    /// At most `per_peer` connections from one address.
    fn per_peer(self, per_peer: usize) -> Self {
        Self { peers: Some((Arc::default(), per_peer)), ..self }
    }

    /// The Fleet gRPC listener's: [`MAX_FLEET_CONNECTIONS`].
    pub fn fleet(metrics: &Metrics) -> Self {
        let guard = Self::new("fleet", MAX_FLEET_CONNECTIONS, metrics.connections_closed.clone());
        Self { call_within: Some(SILENT_FOR), ..guard.per_peer(MAX_FLEET_CONNECTIONS_PER_PEER) }
    }

    /// The admin HTTP listener's: [`MAX_ADMIN_CONNECTIONS`].
    pub fn admin(metrics: &Metrics) -> Self {
        Self::new("admin", MAX_ADMIN_CONNECTIONS, metrics.connections_closed.clone())
            .per_peer(MAX_ADMIN_CONNECTIONS_PER_PEER)
    }

    #[cfg(test)]
    pub(crate) fn silent_after(mut self, silent_for: Duration) -> Self {
        self.silent_for = silent_for;
        self
    }

    #[cfg(test)]
    pub(crate) fn calls_within(mut self, within: Duration) -> Self {
        self.call_within = Some(within);
        self
    }

    /// Takes `stream`, from `peer`, in if the listener (and the peer's share of it) has room;
    /// closes and counts it if not.
    pub fn admit<S>(&self, stream: S, peer: IpAddr) -> Option<Guarded<S>> {
        let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() else {
            self.count(Closed::Full);
            return None;
        };
        let peer = match &self.peers {
            None => None,
            Some((counts, most)) => {
                let peer = peer_of(peer);
                let mut held = counts.lock().unwrap_or_else(PoisonError::into_inner);
                let count = held.entry(peer).or_default();
                if *count >= *most {
                    drop(held);
                    self.count(Closed::PeerFull);
                    self.warn_peer_full(peer, *most);
                    return None;
                }
                *count += 1;
                Some((Arc::clone(counts), peer))
            }
        };
        Some(Guarded {
            inner: stream,
            silence: Box::pin(tokio::time::sleep(self.silent_for)),
            unread: Box::pin(tokio::time::sleep(self.silent_for)),
            write_blocked: false,
            progress: Arc::default(),
            connection: FleetConnection::default(),
            uncalled: self.call_within.map(|within| Box::pin(tokio::time::sleep(within))),
            guard: self.clone(),
            _slot: Slot { _permit: slot, peer },
        })
    }

    /// Says why a peer's connections are closed, at most once a minute per listener: a proxy
    /// or NAT fronting every replica fills one share, and would otherwise only show as
    /// transport errors on the replicas.
    fn warn_peer_full(&self, peer: IpAddr, most: usize) {
        let Some(held_back) = self.peer_full_warnings.admit() else { return };
        tracing::warn!(
            listener = self.listener, %peer, most, held_back,
            "one address holds the most connections the listener allows it; its new ones are closed \
             (counted in continuum_connections_closed_total{{reason=\"peer_full\"}})"
        );
    }

    fn count(&self, reason: Closed) {
        self.closed.with_label_values(&[self.listener, reason.as_str()]).inc();
    }

    /// Accepts the next connection on `listener` this guard admits. Failures to accept (out of
    /// descriptors, say) are retried after a pause rather than in a loop.
    pub async fn accept(&self, listener: &TcpListener) -> (Guarded<TcpStream>, SocketAddr) {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    if let Err(error) = stream.set_nodelay(true) {
                        tracing::debug!(%error, "could not set TCP_NODELAY on an accepted connection");
                    }
                    if let Some(guarded) = self.admit(stream, peer.ip()) {
                        return (guarded, peer);
                    }
                }
                Err(error)
                    if matches!(error.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset) => {}
                Err(error) => {
                    tracing::warn!(listener = self.listener, %error, "accepting a connection failed; retrying shortly");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// An accepted connection holding its listener's slot until dropped, and closed (its reads
/// failing) once its peer has sent nothing for the guard's silence.
#[derive(Debug)]
pub struct Guarded<S> {
    inner: S,
    silence: Pin<Box<Sleep>>,
    /// Armed when a write finds the peer's window shut, until one goes through.
    unread: Pin<Box<Sleep>>,
    write_blocked: bool,
    /// Where the conversation stands, shared with whoever serves the connection.
    progress: Arc<Progress>,
    /// What each call learns of its connection (its `ConnectInfo`, which tonic hands to each
    /// call made on it): its lookups' share of the budget, whether a call was admitted.
    connection: FleetConnection,
    /// Runs out when the connection must have made a call the token admits; `None` once it
    /// has (or on a listener that asks none).
    uncalled: Option<Pin<Box<Sleep>>>,
    guard: Guard,
    _slot: Slot,
}

type PeerCounts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The peer a connection's address counts against: an IPv4 address (an IPv4-mapped IPv6 one
/// as its IPv4 address), or an IPv6 address's /64, which one host commonly holds whole and
/// may draw any number of addresses from.
fn peer_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(v6.to_bits() & !((1u128 << 64) - 1))),
        },
        v4 => v4,
    }
}

/// A connection's place on its listener, and its peer's, given back when dropped.
#[derive(Debug)]
struct Slot {
    _permit: OwnedSemaphorePermit,
    peer: Option<(PeerCounts, IpAddr)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((held, peer)) = &self.peer {
            let mut held = held.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(count) = held.get_mut(peer) {
                *count -= 1;
                if *count == 0 {
                    held.remove(peer);
                }
            }
        }
    }
}

impl<S> Guarded<S> {
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Where the conversation stands, to tell why a server that timed it out closed it.
    fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }

    /// A write's outcome, and the peer given up once writes have found its window shut for
    /// as long as it may stay silent.
    fn written(&mut self, cx: &mut Context<'_>, written: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.progress.answered();
                }
                self.write_blocked = false;
                Poll::Ready(Ok(n))
            }
            Poll::Pending => {
                if !std::mem::replace(&mut self.write_blocked, true) {
                    let deadline = Instant::now() + self.guard.silent_for;
                    self.unread.as_mut().reset(deadline);
                }
                if self.unread.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.guard.count(Closed::Unread);
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the peer read nothing for too long")))
            }
            failed => failed,
        }
    }
}

/// Where a connection's conversation stands: nothing heard yet, between requests (the last
/// bytes went out), or within one (the last bytes came in).
#[derive(Debug, Default)]
struct Progress(std::sync::atomic::AtomicU8);

impl Progress {
    const SILENT: u8 = 0;
    const BETWEEN: u8 = 1;
    const WITHIN: u8 = 2;

    fn heard(&self) {
        self.0.store(Self::WITHIN, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes went out: between requests, if any came in (an HTTP/2 server speaks first).
    fn answered(&self) {
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let _ = self.0.compare_exchange(Self::WITHIN, Self::BETWEEN, relaxed, relaxed);
    }

    /// Why a connection closed while waiting on its peer is closed: `within` when it stopped
    /// part way through a request.
    fn closed_waiting(&self, within: Closed) -> Closed {
        match self.0.load(std::sync::atomic::Ordering::Relaxed) {
            Self::SILENT => Closed::Silent,
            Self::BETWEEN => Closed::Idle,
            _ => within,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        // Checked at every read until a call is admitted: pings answered keep the reads coming,
        // and a connection that sends nothing is woken by the timer.
        let this = &mut *self;
        if let Some(uncalled) = this.uncalled.as_mut() {
            if this.connection.admitted.get() {
                this.uncalled = None;
            } else if uncalled.as_mut().poll(cx).is_ready() {
                this.guard.count(Closed::NoCall);
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "no call was admitted in time")));
            }
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                let deadline = Instant::now() + self.guard.silent_for;
                self.silence.as_mut().reset(deadline);
                self.progress.heard();
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.silence.as_mut().poll(cx).is_ready() => {
                self.guard.count(self.progress.closed_waiting(Closed::Idle));
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the peer sent nothing for too long")))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.written(cx, written)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.written(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A connection's calls learn of it what the lookup budget and the no-call rule need, the same
/// over TLS or not (no handler reads the peer's address or certificates from a request).
impl<S> Connected for Guarded<S> {
    type ConnectInfo = FleetConnection;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.connection.clone()
    }
}

/// The admin listener: connections its guard admits, served by [`GuardedListener::serve`].
#[derive(Debug)]
pub struct GuardedListener {
    listener: TcpListener,
    guard: Guard,
    head_timeout: Duration,
}

/// How long the admin listener waits for the rest of a request's head once it began.
pub const ADMIN_HEAD_TIMEOUT: Duration = Duration::from_secs(10);

impl GuardedListener {
    pub fn new(listener: TcpListener, guard: Guard) -> Self {
        Self { listener, guard, head_timeout: ADMIN_HEAD_TIMEOUT }
    }

    #[cfg(test)]
    fn head_within(self, head_timeout: Duration) -> Self {
        Self { head_timeout, ..self }
    }

    /// Serves `router` on the connections the guard admits until `shutdown`, then lets the
    /// requests under way finish. HTTP/1.1 alone, each request's head whole within
    /// [`ADMIN_HEAD_TIMEOUT`]: the guard closes only a connection that falls silent, so a client
    /// sending a header byte (or, over HTTP/2, a PING) now and then would otherwise hold its
    /// place for as long as it liked, and a few addresses doing so would shut out the probes and
    /// scrapers. Operators, probes and Prometheus all speak HTTP/1.1.
    pub async fn serve(self, router: axum::Router, shutdown: tokio_util::sync::CancellationToken) {
        let connections = tokio_util::task::TaskTracker::new();
        loop {
            let (io, peer) = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = self.guard.accept(&self.listener) => accepted,
            };
            let router = router.clone().layer(axum::Extension(Peer(peer)));
            let service = hyper_util::service::TowerToHyperService::new(router);
            let (shutdown, head_timeout, guard) = (shutdown.clone(), self.head_timeout, self.guard.clone());
            let progress = io.progress();
            connections.spawn(async move {
                let mut http = hyper::server::conn::http1::Builder::new();
                http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(head_timeout);
                let connection = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
                tokio::pin!(connection);
                tokio::select! {
                    served = connection.as_mut() => {
                        // Hyper's head timer also runs while a keep-alive connection waits for
                        // its next request, and closes it before the guard's silence would.
                        if served.is_err_and(|error| error.is_timeout()) {
                            guard.count(progress.closed_waiting(Closed::HeadTimeout));
                        }
                    }
                    () = shutdown.cancelled() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.await;
                    }
                }
            });
        }
        connections.close();
        connections.wait().await;
    }
}

#[cfg(test)]
mod tests;
