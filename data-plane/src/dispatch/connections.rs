//! Idle keep-alive connections to the shim replicas, by authority (`host:port`), for reuse.
//!
//! No task watches an idle connection: a connection is checked when it is taken (one the shim
//! closed, or sent something on unasked, is dropped then), and expired ones are dropped as the
//! list is touched, and from every list once per [`IDLE_TIMEOUT`], so an authority no longer
//! configured keeps nothing. At most [`MAX_IDLE_PER_AUTHORITY`] are kept per authority, each
//! with buffers of at most [`KEPT_BUFFER_CAPACITY`], so the memory held is bounded by the
//! configured replicas.

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
    fn reusable(&self) -> bool {
        self.read.is_empty()
            && matches!(self.stream.try_read(&mut [0u8; 1]), Err(error) if error.kind() == ErrorKind::WouldBlock)
    }
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
}

impl IdleConnections {
    /// The most recently returned usable connection to `authority`, if any.
    pub fn take(&self, authority: &str, now: Instant) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let conns = idle.by_authority.get_mut(authority)?;
        while let Some((conn, since)) = conns.pop() {
            if now.saturating_duration_since(since) < IDLE_TIMEOUT && conn.reusable() {
                return Some(conn);
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
    pub fn count(&self, authority: &str) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).by_authority.get(authority).map_or(0, Vec::len)
    }

    /// Authorities with idle connections held.
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
