//! Idle keep-alive connections to the shim replicas, by authority (`host:port`), for reuse.
//!
//! No task watches an idle connection: a connection is checked when it is taken (one the shim
//! closed, or sent something on unasked, is dropped then), and expired ones are dropped as the
//! list is touched, and from every list once per [`IDLE_TIMEOUT`], so an authority no longer
//! configured keeps nothing. At most [`MAX_IDLE_PER_AUTHORITY`] are kept per authority, each
//! with buffers of at most [`KEPT_BUFFER_CAPACITY`], so the memory held is bounded by the
//! configured replicas.
//!
//! A backend that closes idle connections sooner than [`IDLE_TIMEOUT`] (uvicorn, in front of
//! vLLM or SGLang, after 5 s) would have requests written into connections it is closing, whose
//! failure cannot be retried (the request may have arrived, and a chat completion is not
//! idempotent). The youngest idle connection found closed teaches the authority's limit: from
//! then on, none that old is reused ([`CLOSE_MARGIN`] short of it), for [`LEARNED_FOR`].

use std::io::ErrorKind;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use continuum_proto::fast_hash::FastMap;
use tokio::net::TcpStream;

/// Idle keep-alive connections to one shim replica kept for reuse.
pub const MAX_IDLE_PER_AUTHORITY: usize = 256;
/// An idle connection is not reused after this long. Shorter than the shim holds one: the
/// real 1.6.1 frontend left an idle keep-alive connection open for over 100 s (measured), so
/// a request is not written into a connection the shim is closing.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// What a connection's read buffer starts with, and grows by when it runs out: a buffered
/// completion or a few SSE events.
pub const READ_CHUNK: usize = 16 << 10;
/// A buffer grown past this (a large prompt or answer) is let go before its connection idles.
pub const KEPT_BUFFER_CAPACITY: usize = 64 << 10;
/// How much younger than the youngest connection a backend closed a reused one must be.
pub const CLOSE_MARGIN: Duration = Duration::from_secs(1);
/// The least idle age up to which connections are reused, however young one was found closed
/// (a backend restarting closes its connections at any age).
pub const MIN_REUSE_AGE: Duration = Duration::from_secs(1);
/// How long a learned limit stands before it is learned again: a restart's closes are not the
/// backend's idle timeout, and a reload may put another backend at the same address.
pub const LEARNED_FOR: Duration = Duration::from_secs(600);

/// One HTTP/1.1 connection and the bytes read from it that nothing has consumed yet.
#[derive(Debug)]
pub struct Conn {
    pub stream: TcpStream,
    pub read: BytesMut,
    /// The request being written; kept so its allocation serves the next request too.
    pub write: Vec<u8>,
}

impl Conn {
    pub fn new(stream: TcpStream) -> Self {
        Self { stream, read: BytesMut::with_capacity(READ_CHUNK), write: Vec::new() }
    }

    /// Whether the connection can carry another request: nothing unread, and the shim has not
    /// closed it or sent anything since. Costs no system call while the socket has not become
    /// readable since the last read.
    fn state(&self) -> Idled {
        if !self.read.is_empty() {
            return Idled::Spoken;
        }
        match self.stream.try_read(&mut [0u8; 1]) {
            Err(error) if error.kind() == ErrorKind::WouldBlock => Idled::Open,
            Ok(0) | Err(_) => Idled::Closed,
            Ok(_) => Idled::Spoken,
        }
    }
}

/// What became of a connection while it was idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idled {
    Open,
    /// The backend closed (or reset) it.
    Closed,
    /// The backend sent something unasked.
    Spoken,
}

#[derive(Debug, Default)]
pub struct IdleConnections {
    idle: Mutex<Idle>,
}

#[derive(Debug, Default)]
struct Idle {
    /// By the authorities of configured shim URLs: a fast hash will do.
    by_authority: FastMap<String, Vec<(Conn, Instant)>>,
    /// When every list was last cleared of expired connections.
    swept: Option<Instant>,
    /// By authority, the youngest idle age at which its backend had closed a connection, and
    /// when that was learned.
    closes: FastMap<String, (Duration, Instant)>,
}

impl Idle {
    /// The idle age up to which a connection to `authority` is reused at `now`.
    fn reuse_limit(&self, authority: &str, now: Instant) -> Duration {
        if self.closes.is_empty() {
            return IDLE_TIMEOUT;
        }
        match self.closes.get(authority) {
            Some((age, learned)) if now.saturating_duration_since(*learned) < LEARNED_FOR => {
                age.saturating_sub(CLOSE_MARGIN).max(MIN_REUSE_AGE).min(IDLE_TIMEOUT)
            }
            _ => IDLE_TIMEOUT,
        }
    }
}

impl IdleConnections {
    /// The most recently returned usable connection to `authority`, if any.
    pub fn take(&self, authority: &str, now: Instant) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let limit = idle.reuse_limit(authority, now);
        let Idle { by_authority, closes, .. } = &mut *idle;
        let conns = by_authority.get_mut(authority)?;
        while let Some((conn, since)) = conns.pop() {
            let age = now.saturating_duration_since(since);
            if age >= limit {
                continue;
            }
            match conn.state() {
                Idled::Open => return Some(conn),
                Idled::Closed => {
                    let learned =
                        closes.get(authority).filter(|(_, at)| now.saturating_duration_since(*at) < LEARNED_FOR);
                    if learned.is_none_or(|(youngest, _)| age < *youngest) {
                        closes.insert(authority.to_string(), (age, now));
                    }
                }
                Idled::Spoken => {}
            }
        }
        None
    }

    /// Keeps `conn` for reuse, unless `authority` already has its fill or the shim sent bytes
    /// past the answer's end: whatever they are, they would be read as the next answer (and
    /// the buffer let go below would take the evidence with it).
    pub fn put(&self, authority: &str, mut conn: Conn, now: Instant) {
        if !conn.read.is_empty() {
            return;
        }
        if conn.write.capacity() > KEPT_BUFFER_CAPACITY {
            conn.write = Vec::new();
        }
        if conn.read.capacity() > KEPT_BUFFER_CAPACITY {
            conn.read = BytesMut::with_capacity(READ_CHUNK);
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.swept.is_none_or(|swept| now.saturating_duration_since(swept) >= IDLE_TIMEOUT) {
            idle.by_authority.retain(|_, conns| {
                drop_expired(conns, now);
                !conns.is_empty()
            });
            idle.closes.retain(|_, (_, learned)| now.saturating_duration_since(*learned) < LEARNED_FOR);
            idle.swept = Some(now);
        }
        let conns = match idle.by_authority.get_mut(authority) {
            Some(conns) => conns,
            None => idle.by_authority.entry(authority.to_string()).or_default(),
        };
        drop_expired(conns, now);
        if conns.len() < MAX_IDLE_PER_AUTHORITY {
            conns.push((conn, now));
        }
    }

    /// Idle connections held for `authority`.
    #[cfg(test)]
    pub fn count(&self, authority: &str) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).by_authority.get(authority).map_or(0, Vec::len)
    }

    /// Authorities with idle connections held.
    #[cfg(test)]
    pub fn authorities(&self) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).by_authority.len()
    }
}

/// Drops the connections idle for [`IDLE_TIMEOUT`] or longer; the oldest are at the front.
fn drop_expired(conns: &mut Vec<(Conn, Instant)>, now: Instant) {
    let expired = conns.iter().take_while(|(_, since)| now.saturating_duration_since(*since) >= IDLE_TIMEOUT).count();
    conns.drain(..expired);
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;

    async fn pair(listener: &TcpListener) -> (Conn, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (Conn::new(client), server)
    }

    #[tokio::test]
    async fn a_connection_the_shim_closed_or_wrote_on_is_not_reused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = IdleConnections::default();
        let now = Instant::now();
        let (open, _kept) = pair(&listener).await;
        let (closed, server) = pair(&listener).await;
        let (chatty, mut talker) = pair(&listener).await;
        drop(server);
        talker.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        idle.put("a", open, now);
        idle.put("a", closed, now);
        idle.put("a", chatty, now);
        assert_eq!(idle.count("a"), 3);
        assert!(idle.take("a", now).is_some(), "the open connection is found under the broken ones");
        assert!(idle.take("a", now).is_none());
        assert!(idle.take("b", now).is_none());
    }

    /// A backend that closes idle connections after 5 s (uvicorn's default) teaches the pool
    /// not to reuse one that old: a request written into a connection as it closes would fail,
    /// and could not be sent again.
    #[tokio::test]
    async fn a_backends_idle_close_teaches_the_age_past_which_nothing_is_reused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = IdleConnections::default();
        let t0 = Instant::now();
        let (closed, server) = pair(&listener).await;
        idle.put("a", closed, t0);
        drop(server);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(idle.take("a", t0 + Duration::from_secs(5)).is_none(), "found closed at 5 s");
        let t1 = t0 + Duration::from_secs(10);
        let (old, _kept) = pair(&listener).await;
        idle.put("a", old, t1);
        assert!(idle.take("a", t1 + Duration::from_millis(4_500)).is_none(), "as old as closes come, less the margin");
        let (young, _kept) = pair(&listener).await;
        idle.put("a", young, t1);
        assert!(idle.take("a", t1 + Duration::from_secs(3)).is_some(), "younger ones are reused");
        // Learned for a while, not for good; and another authority learned nothing.
        let (later, _kept) = pair(&listener).await;
        idle.put("a", later, t1 + LEARNED_FOR);
        assert!(idle.take("a", t1 + LEARNED_FOR + Duration::from_millis(4_500)).is_some());
        let (other, _kept) = pair(&listener).await;
        idle.put("b", other, t1);
        assert!(idle.take("b", t1 + Duration::from_millis(4_500)).is_some());
    }

    #[tokio::test]
    async fn expired_connections_are_dropped_and_the_fill_is_bounded() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = IdleConnections::default();
        let then = Instant::now();
        let mut servers = Vec::new();
        for _ in 0..MAX_IDLE_PER_AUTHORITY + 2 {
            let (conn, server) = pair(&listener).await;
            servers.push(server);
            idle.put("a", conn, then);
        }
        assert_eq!(idle.count("a"), MAX_IDLE_PER_AUTHORITY);
        let later = then + IDLE_TIMEOUT;
        assert!(idle.take("a", later).is_none(), "every connection has expired");
        let (conn, _server) = pair(&listener).await;
        idle.put("a", conn, later);
        assert_eq!(idle.count("a"), 1);
    }

    #[tokio::test]
    async fn an_authority_no_longer_used_keeps_nothing_and_large_buffers_are_let_go() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let idle = IdleConnections::default();
        let then = Instant::now();
        let (mut conn, _server) = pair(&listener).await;
        conn.write.reserve(8 << 20);
        conn.read.reserve(8 << 20);
        idle.put("gone:8000", conn, then);
        let kept = idle.take("gone:8000", then).expect("the connection is kept");
        assert!(kept.write.capacity() <= KEPT_BUFFER_CAPACITY && kept.read.capacity() <= KEPT_BUFFER_CAPACITY);
        // Bytes past an answer's end, in a buffer large enough to be let go: not kept at all.
        let (mut overread, _third) = pair(&listener).await;
        overread.read.reserve(8 << 20);
        overread.read.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        idle.put("gone:8000", overread, then);
        assert_eq!(idle.count("gone:8000"), 0, "what the shim sent past the answer would be read as the next one");
        idle.put("gone:8000", kept, then);
        // Only another authority's connections are put back from now on.
        let (conn, _other) = pair(&listener).await;
        idle.put("new:8000", conn, then + IDLE_TIMEOUT);
        assert_eq!((idle.count("gone:8000"), idle.authorities()), (0, 1), "the sweep cleared the unused authority");
    }
}
