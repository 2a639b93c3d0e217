//! The HTTP/1.1 client the data plane dials shim replicas with: keep-alive connections reused
//! across requests ([`connections`](super::connections)), a bounded connect, and a deadline on
//! the response head.
//!
//! Each exchange runs on the task that sends it: the request (head and body) is written in one
//! system call and the response head read on the same task, and its body is read as the
//! consumer polls it ([`ShimBody`]). No task per connection, no channel between the request and
//! its connection: a proxied request costs the wake-ups of its own sockets only.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Method, Request, Response, Uri};
use bytes::{Buf, Bytes};
use futures::FutureExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::io::read_buf;

use super::connections::{Conn, IdleConnections, READ_CHUNK};
use super::resolve::Resolver;
use super::shim_body::{Return, ShimBody};
use super::wire::{self, WireError};
use crate::boxed::built_in_box;
use crate::routing::headers::Pins;

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("could not connect to the shim replica: {0}")]
    Connect(#[source] io::Error),
    #[error("the request could not be written to the shim replica: {0}")]
    Write(#[source] io::Error),
    #[error("the exchange with the shim replica failed: {0}")]
    Exchange(#[source] ExchangeError),
    #[error("the shim replica sent no response head within {0:?}")]
    HeadTimeout(Duration),
    /// A [`SendError::HeadTimeout`] while the shim replica answered no other request either:
    /// its own silence, not its workers'.
    #[error("the shim replica answered nothing within {0:?}, to this request or any other")]
    ShimSilent(Duration),
    #[error("the shim URL {0} is not plain http://, the only scheme the data plane speaks to shims")]
    UnsupportedScheme(Uri),
}

/// How long a connection whose request could not be written is read for an answer its
/// server sent early: one already in the socket is read at once.
const EARLY_ANSWER_WAIT: Duration = Duration::from_millis(200);

/// A shim host that dies without a word (power lost, a partition) sends no FIN or RST: its
/// pooled connections look alive, and a request written on one waits out its head timeout (5
/// minutes for a buffered answer) while the next requests take the pool's other dead ones.
/// TCP keepalive probes an idle connection after this long, every [`SHIM_KEEPALIVE_INTERVAL`]
/// (the pool's check finds a dead one then), and bytes the host never acknowledges fail the
/// connection after [`SHIM_USER_TIMEOUT`] rather than the kernel's 15 minutes or so. A live
/// shim's kernel answers both, however long its engine takes to answer.
pub const SHIM_KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub const SHIM_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub const SHIM_USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Why an exchange on an established connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the connection closed before a response head arrived")]
    Closed,
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("the shim URL {0} has no dialable authority")]
    Uri(Uri),
}

impl SendError {
    /// Only a failed connection, a request not written whole, or a refused scheme proves the
    /// request never reached the shim complete (a body framed by its length is no request until
    /// its last byte), so only then may it be sent again to another replica.
    pub fn before_request_sent(&self) -> bool {
        matches!(self, SendError::Connect(_) | SendError::Write(_) | SendError::UnsupportedScheme(_))
    }
}

#[derive(Debug, Clone)]
pub struct ShimClient {
    idle: Arc<IdleConnections>,
    connect_timeout: Duration,
    resolver: Arc<Resolver>,
}

impl ShimClient {
    pub fn new(connect_timeout: Duration) -> Self {
        Self { idle: Arc::default(), connect_timeout, resolver: Arc::default() }
    }

    /// Sends `request` and waits at most `head_timeout` for the response head.
    pub async fn send(&self, request: Request<Bytes>, head_timeout: Duration) -> Result<Response<ShimBody>, SendError> {
        let (parts, body) = request.into_parts();
        let request = Outbound {
            method: &parts.method,
            uri: &parts.uri,
            headers: &parts.headers,
            pins: Pins::default(),
            body: &body,
        };
        let since = Instant::now();
        within((since, head_timeout), self.exchange(request, since)).await
    }

    /// POSTs `body` with `headers` and `pins` to `uri`, borrowing them (a retry sends the very
    /// same), and waits at most `head_timeout` for the response head, counted from `since`
    /// (the caller's clock reading as it sends: the attempt's start). Not an `async fn`: the
    /// exchange's future is handed to the caller as it is, rather than wrapped in one more that
    /// every request would build and move.
    pub fn post<'a>(
        &'a self,
        uri: &'a Uri,
        headers: &'a HeaderMap,
        pins: Pins,
        body: &'a [u8],
        (since, head_timeout): (Instant, Duration),
    ) -> impl Future<Output = Result<Response<ShimBody>, SendError>> + 'a {
        let request = Outbound { method: &Method::POST, uri, headers, pins, body };
        within((since, head_timeout), self.exchange(request, since))
    }

    /// Idle connections held to the authority (`host:port`) of `uri`.
    #[cfg(test)]
    pub fn idle_connections(&self, uri: &Uri) -> usize {
        uri.authority().map_or(0, |a| self.idle.count(a.as_str()))
    }

    /// Not an `async fn`: it would keep `request` in its future beside the parts it binds.
    /// Idle connections are taken as of `now`, the clock read as the request was sent.
    ///
    /// Built in a box of its own ([`built_in_box`]): its future would be copied whole at each
    /// level that wraps it on its way to the request's (the timeout, the breaker's outcome, the
    /// attempt loop).
    fn exchange<'a>(
        &'a self,
        request: Outbound<'a>,
        now: Instant,
    ) -> Pin<Box<impl Future<Output = Result<Response<ShimBody>, SendError>> + 'a>> {
        let Outbound { method, uri, headers, pins, body } = request;
        built_in_box(move || async move {
            // Plain HTTP only (the shim runs beside the workers): an https:// shim is refused
            // before anything is sent rather than spoken to in plaintext.
            if uri.scheme_str() != Some("http") {
                return Err(SendError::UnsupportedScheme(uri.clone()));
            }
            let authority = uri.authority().ok_or_else(|| exchange(ExchangeError::Uri(uri.clone())))?;
            // One scheduler turn before writing: the other requests ready on this thread get their
            // turn first, so writes to the shims leave in bursts and a shim that went idle is woken
            // once per burst rather than once per request (wake-ups are most of a loopback send's
            // cost). The exchange is otherwise unchanged; only its write waits for the turn.
            tokio::task::yield_now().await;
            let reused = self.idle.take(authority.as_str(), now);
            let was_reused = reused.is_some();
            let mut conn = match reused {
                Some(conn) => conn,
                // Boxed, here and below: a new connection is the rare case, and its future inline
                // would be moved with every request's (the ancestors' futures are as large as it).
                None => Box::pin(self.connect(authority.as_str(), authority.port_u16().unwrap_or(80))).await?,
            };
            conn.write.clear();
            wire::encode_request(&mut conn.write, method, uri, headers, pins, body);
            if let Err(error) = conn.stream.write_all(&conn.write).await {
                // A server may answer before it has read the whole request (a 413 for a body past
                // its limit) and close: that answer, if it came, is the outcome. Nothing else is
                // read from a connection that failed a write, and it is not kept.
                if !was_reused {
                    return early_answer(conn, error).await;
                }
                let mut fresh = Box::pin(self.connect(authority.as_str(), authority.port_u16().unwrap_or(80))).await?;
                std::mem::swap(&mut fresh.write, &mut conn.write);
                conn = fresh;
                if let Err(error) = conn.stream.write_all(&conn.write).await {
                    return early_answer(conn, error).await;
                }
            }
            let head = read_head(&mut conn).await.map_err(exchange)?;
            let back = head.keep_alive.then(|| Return { idle: Arc::clone(&self.idle), authority: authority.clone() });
            let mut response = Response::new(ShimBody::new(conn, head.framing, back));
            *response.status_mut() = head.status;
            *response.headers_mut() = head.headers;
            Ok(response)
        })
    }

    /// A new connection to `authority`, trying each address it resolves to in turn, each
    /// within its share of what is left of the connect timeout: one address that swallows
    /// the handshake (a pod gone from a headless Service) does not starve the others.
    async fn connect(&self, authority: &str, port: u16) -> Result<Conn, SendError> {
        let deadline = tokio::time::Instant::now() + self.connect_timeout;
        let dial = async {
            let addrs = self.resolver.resolve(host(authority), port).await?;
            let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{authority} resolved to no address"));
            for (tried, addr) in addrs.iter().enumerate() {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let share = left / u32::try_from(addrs.len() - tried).unwrap_or(u32::MAX);
                match tokio::time::timeout(share, TcpStream::connect(addr)).await {
                    Ok(Ok(stream)) => return Ok(stream),
                    Ok(Err(error)) => last = error,
                    Err(_) => {
                        last =
                            io::Error::new(io::ErrorKind::TimedOut, format!("no connection to {addr} within {share:?}"))
                    }
                }
            }
            Err(last)
        };
        let stream = match tokio::time::timeout(self.connect_timeout, dial).await {
            Err(_) => {
                let message = format!("no connection to {authority} within {:?}", self.connect_timeout);
                return Err(SendError::Connect(io::Error::new(io::ErrorKind::TimedOut, message)));
            }
            Ok(Err(error)) => return Err(SendError::Connect(error)),
            Ok(Ok(stream)) => stream,
        };
        // Requests are written whole: Nagle's algorithm could only delay them.
        stream.set_nodelay(true).map_err(SendError::Connect)?;
        crate::tcp::probe_idle(&stream, SHIM_KEEPALIVE_IDLE, SHIM_KEEPALIVE_INTERVAL, SHIM_USER_TIMEOUT)
            .map_err(SendError::Connect)?;
        Ok(Conn::new(stream))
    }
}

/// One request to write, borrowed from its sender.
#[derive(Debug, Clone, Copy)]
struct Outbound<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    pins: Pins,
    body: &'a [u8],
}

fn exchange(error: ExchangeError) -> SendError {
    SendError::Exchange(error)
}

/// `exchange`, given at most `head_timeout` from `since` to bring a response head. The clock
/// was read for the attempt already: a timeout from now would read it again, for every request.
fn within<F>(
    (since, head_timeout): (Instant, Duration),
    exchange: F,
) -> impl Future<Output = Result<Response<ShimBody>, SendError>>
where
    F: Future<Output = Result<Response<ShimBody>, SendError>>,
{
    // A timeout past what the clock can hold is a year (tokio's own far future is longer).
    let deadline = since.checked_add(head_timeout).unwrap_or_else(|| since + Duration::from_secs(365 * 86_400));
    tokio::time::timeout_at(deadline.into(), exchange)
        .map(move |outcome| outcome.unwrap_or_else(|_| Err(SendError::HeadTimeout(head_timeout))))
}

/// The outcome of a request whose write failed with `error` on a new connection. A server may
/// answer before it has read the whole request (a 413 for a body past its limit) and close:
/// that refusal, if it came, is the outcome. Nothing else is read from the connection, which
/// is not kept; no success can answer a request not sent whole.
async fn early_answer(mut conn: Conn, error: io::Error) -> Result<Response<ShimBody>, SendError> {
    let early = tokio::time::timeout(EARLY_ANSWER_WAIT, read_head(&mut conn)).await;
    let Ok(Ok(head)) = early else { return Err(SendError::Write(error)) };
    if !(head.status.is_client_error() || head.status.is_server_error()) {
        return Err(SendError::Write(error));
    }
    let mut response = Response::new(ShimBody::new(conn, head.framing, None));
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers;
    Ok(response)
}

/// Reads until a whole response head is in, leaving the bytes past it in the read buffer.
async fn read_head(conn: &mut Conn) -> Result<wire::Head, ExchangeError> {
    conn.read.clear();
    let mut scanned: usize = 0;
    loop {
        if conn.read.capacity() - conn.read.len() < READ_CHUNK / 4 {
            conn.read.reserve(READ_CHUNK);
        }
        if read_buf(&mut conn.stream, &mut conn.read).await? == 0 {
            return Err(ExchangeError::Closed);
        }
        if wire::head_due(&conn.read, scanned, wire::MAX_HEAD_BYTES)
            && let Some((head, length)) = wire::parse_head(&conn.read)?
        {
            conn.read.advance(length);
            return Ok(head);
        }
        scanned = conn.read.len();
    }
}

/// The host of an authority (`h:80`, `h`, `[fd00::1]:80`, `[fd00::1]`), without brackets: an
/// IPv6 literal's colons are not a port's.
fn host(authority: &str) -> &str {
    if let Some(bracketed) = authority.strip_prefix('[') {
        return bracketed.split_once(']').map_or(bracketed, |(host, _)| host);
    }
    authority.rsplit_once(':').map_or(authority, |(host, _)| host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_authority_names_its_host_without_port_or_brackets() {
        let rows = [
            ("shim:8000", "shim"),
            ("shim", "shim"),
            ("[fd00::1]:8000", "fd00::1"),
            ("[fd00::1]", "fd00::1"),
            ("10.0.0.1:80", "10.0.0.1"),
        ];
        for (authority, expected) in rows {
            assert_eq!(host(authority), expected, "{authority}");
        }
    }

    #[test]
    fn only_a_request_that_never_arrived_whole_may_go_to_another_replica() {
        let reset = || io::Error::from(io::ErrorKind::ConnectionReset);
        assert!(SendError::Connect(reset()).before_request_sent());
        assert!(SendError::Write(reset()).before_request_sent(), "a body short of its length is no request");
        assert!(!SendError::Exchange(ExchangeError::Closed).before_request_sent(), "the shim may be running it");
        assert!(!SendError::Exchange(ExchangeError::Io(reset())).before_request_sent());
        assert!(!SendError::HeadTimeout(Duration::from_secs(1)).before_request_sent());
    }

    /// A shim host that dies without a word is found out in seconds: its connections probe an
    /// idle peer and give up on bytes it never acknowledges.
    #[tokio::test]
    async fn shim_connections_notice_a_silent_host() -> io::Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let client = ShimClient::new(Duration::from_secs(1));
        let conn = client.connect(&addr.to_string(), addr.port()).await.map_err(io::Error::other)?;
        let socket = socket2::SockRef::from(&conn.stream);
        assert!(socket.keepalive()?);
        assert_eq!(socket.tcp_keepalive_time()?, SHIM_KEEPALIVE_IDLE);
        assert_eq!(socket.tcp_keepalive_interval()?, SHIM_KEEPALIVE_INTERVAL);
        assert_eq!(socket.tcp_user_timeout()?, Some(SHIM_USER_TIMEOUT));
        Ok(())
    }

    /// An address that swallows the handshake (here a listener whose backlog is full, so the
    /// kernel drops further SYNs) takes only its share of the connect timeout: the name's
    /// next address still gets a connection within it.
    #[tokio::test]
    async fn an_address_that_swallows_the_handshake_leaves_time_for_the_next() -> io::Result<()> {
        let full = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        full.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
        full.listen(0)?;
        let swallowing = full.local_addr()?.as_socket().ok_or_else(|| io::Error::other("no address"))?;
        // Never accepted: these fill the backlog, and the kernel drops the SYNs after them.
        let mut fillers = Vec::new();
        for _ in 0..4 {
            fillers.push(tokio::spawn(TcpStream::connect(swallowing)));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let good = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let good_addr = good.local_addr()?;
        let client = ShimClient::new(Duration::from_secs(2));
        // One name, two addresses: the swallowing one first.
        client.resolver.keep("pool.test:80".into(), Arc::from([swallowing, good_addr]));
        let conn = client.connect("pool.test", 80).await.map_err(io::Error::other)?;
        assert_eq!(conn.stream.peer_addr()?, good_addr);
        fillers.iter().for_each(tokio::task::JoinHandle::abort);
        Ok(())
    }

    #[tokio::test]
    async fn a_shim_url_that_is_not_plain_http_is_refused_before_anything_is_sent() {
        // A listener that would record any connection: nothing may reach it.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = ShimClient::new(Duration::from_secs(1));
        let request = Request::post(format!("https://{addr}/v1/chat/completions")).body(Bytes::new()).expect("request");
        let error = client.send(request, Duration::from_secs(1)).await.expect_err("refused");
        assert!(matches!(error, SendError::UnsupportedScheme(_)), "{error}");
        assert!(error.before_request_sent(), "another (http) replica may take it");
        let accepted = tokio::time::timeout(Duration::from_millis(50), listener.accept()).await;
        assert!(accepted.is_err(), "no connection was made");
    }

    /// A server that refuses a request before reading its body (a 413) and closes makes the
    /// rest of the write fail: its answer, already sent, is the outcome, not an unreachable
    /// replica (which would be retried elsewhere and count against its breaker).
    #[tokio::test]
    async fn an_answer_sent_before_the_request_was_read_whole_is_the_outcome() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        // A small window: the body cannot all fit in the buffers between the two ends.
        socket.set_recv_buffer_size(4096).expect("rcvbuf");
        socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let listener = socket.listen(1).expect("listen");
        let addr = listener.local_addr().expect("addr");
        let shim = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut head = vec![0u8; 1024];
            let _ = stream.read(&mut head).await.expect("the head");
            stream.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n").await.expect("write");
            // Closed with the body unread: the kernel resets the connection.
            drop(stream);
        });
        let client = ShimClient::new(Duration::from_secs(1));
        let body = Bytes::from(vec![b'x'; 16 << 20]);
        let request = Request::post(format!("http://{addr}/v1/chat/completions")).body(body).expect("request");
        let response = client.send(request, Duration::from_secs(5)).await.expect("the early answer");
        assert_eq!(response.status(), 413);
        // Read to its end, a kept-alive answer would give its connection back: this one not.
        let body = http_body_util::BodyExt::collect(response.into_body()).await.expect("the body").to_bytes();
        assert!(body.is_empty());
        assert_eq!(client.idle_connections(&format!("http://{addr}/").parse().expect("uri")), 0, "not kept");
        drop(shim.await);
    }

    /// A head that trickles in, an interim `100 Continue` before it and its blank line split
    /// across reads, is read whole: parsing waits for a blank line, and the one it waits for
    /// may begin in bytes read before.
    #[tokio::test]
    async fn a_response_head_that_arrives_a_few_bytes_at_a_time_is_read_whole() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shim = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut request = vec![0u8; 4096];
            let _ = stream.read(&mut request).await.expect("the request");
            let answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
            for piece in answer.chunks(3) {
                stream.write_all(piece).await.expect("write");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            stream
        });
        let client = ShimClient::new(Duration::from_secs(1));
        let request = Request::post(format!("http://{addr}/v1/chat/completions")).body(Bytes::new()).expect("request");
        let response = client.send(request, Duration::from_secs(5)).await.expect("an answer");
        assert_eq!(response.status(), 201);
        let body = http_body_util::BodyExt::collect(response.into_body()).await.expect("the body").to_bytes();
        assert_eq!(&body[..], b"ok");
        drop(shim.await);
    }
}
