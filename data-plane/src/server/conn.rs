//! One client connection: read a request, answer it, and again while the connection lasts.
//!
//! Chat completions go straight to [`chat::respond`]; every other request goes through the axum
//! router, so the replica's smaller endpoints keep their extractors and tests. A response is
//! written with as few system calls as its body allows: the head and every frame that is ready
//! leave in one write, so a buffered completion is one write and a stream one write per burst
//! of events.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::CONTENT_LENGTH;
use axum::http::{HeaderMap, Method, Request, StatusCode, Version};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures::FutureExt;
use futures::future::Either;
use http_body_util::BodyExt;
use prometheus::IntGauge;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tower_service::Service;

use super::head::{
    BodyFraming, HeadError, LAST_CHUNK, MAX_HEAD_BYTES, Persistence, RequestHead, ResponseFraming, Route, encode_chunk,
    encode_response, http_date, parse_request,
};
use super::idle::{IdleCall, IdleCalls, Waiting};
use super::{App, Slots, Stages};
use crate::boxed::built_in_box;
use crate::dispatch::wire::{Chunked, Decoded, WireError, head_due};
use crate::ingress::MAX_REQUEST_BODY_BYTES;
use crate::ingress::chat;
use crate::ingress::error::ApiError;
use crate::memory::{Charge, FREE_BYTES, REQUEST_BODIES, append_charged, reallocate, settle};
use crate::metrics::Metrics;

/// A keep-alive connection with no request in progress is closed after this long.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(75);
/// ...and after this long when it starts waiting while the server is crowded (its connection
/// slots nearly all taken): it holds a slot a new client may need.
pub const CROWDED_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// A request's head and body must arrive within this long of its first byte, and each byte's
/// time at [`MIN_READ_BYTES_PER_SECOND`] longer: a large body on a slow uplink (8 MiB at
/// 1 Mbit/s) still arrives, while a client that trickles a few bytes gains next to nothing.
/// While more than half the budget for large bodies is charged, bytes earn nothing: clients
/// that sent most of a large body at once and then a byte now and then, each just inside the
/// stall timeout, would otherwise hold the budget for minutes for the upload of one.
pub const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The slowest average upload a request may take beyond [`REQUEST_READ_TIMEOUT`].
pub const MIN_READ_BYTES_PER_SECOND: u64 = 64 << 10;
/// Nor may a request's bytes stop coming for longer than this, whatever time they earned: a
/// client that sent most of an 8 MiB body at once and then stopped would otherwise hold its
/// buffer, charged against the process's budget for large bodies, for the two minutes and more
/// those bytes earned. While the server is crowded, [`CROWDED_IDLE_TIMEOUT`] instead: a client
/// that sends a byte and stops holds a slot a new client may need.
pub const READ_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that takes none of a response's bytes for this long is dropped: its connection,
/// and the dispatch behind a stream, would otherwise be held for as long as it chose.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Nor may a client keep one answer's writes waiting longer in all than [`WRITE_STALL_TIMEOUT`]
/// plus their bytes' time at this rate: one that read a byte now and then, or a stream's event
/// just before each wait timed out, would hold its connection (and the dispatch behind it, or a
/// buffered answer's charge against the process's budget) as long as it liked.
pub const MIN_WRITE_BYTES_PER_SECOND: u64 = 256 << 10;
/// What a connection's read buffer starts with and grows by.
const READ_CHUNK: usize = 8 << 10;
/// A read buffer a larger request (head and body) went through is let go once the body is
/// copied out, so neither a long response nor an idle connection holds it: idle keep-alive
/// connections hold at most this much each, not the 64 KiB a large head grew theirs to.
const KEPT_READ_CAPACITY: usize = 32 << 10;
/// Bytes of pipelined requests kept while a response is pending; past it, what comes is read
/// only to see the client leave, and dropped.
const MAX_PIPELINED_BYTES: usize = 64 << 10;
/// What one read past [`MAX_PIPELINED_BYTES`] drops at most.
const DISCARD_CHUNK: usize = 8 << 10;
/// A write buffer grown past this (a large buffered answer) is let go once it is written.
const KEPT_WRITE_CAPACITY: usize = 64 << 10;
/// How far behind the idle timer may run before it is re-armed.
const IDLE_DEADLINE_SLACK: Duration = Duration::from_secs(1);
/// After a refusal, how long and how much of the client's unread body is read and discarded.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 2 * MAX_REQUEST_BODY_BYTES;
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Why a connection stops.
enum Stop {
    /// The client closed it, the server is shutting down, or it idled out: nothing to answer.
    Quietly,
    /// The request cannot be read: answer this and close.
    Refuse(HeadError),
    /// The client took none of an interim answer (`100 Continue`) for the write deadline.
    Stalled,
    /// Idled out while the server was crowded: closed to free its slot.
    Crowded,
}

impl From<io::Error> for Stop {
    fn from(_: io::Error) -> Self {
        Stop::Quietly
    }
}

/// Writes `100 Continue`; a client that takes none of it is a stalled one, to count.
async fn write_continue(stream: &mut TcpStream) -> Result<(), Stop> {
    write_unless_stalled(stream, CONTINUE, &mut Patience::default()).await.map_err(|error| match error.kind() {
        io::ErrorKind::TimedOut => Stop::Stalled,
        _ => Stop::Quietly,
    })
}

/// When the rest of a request must have arrived: [`REQUEST_READ_TIMEOUT`] after its first
/// bytes, later by the time of each byte read since at [`MIN_READ_BYTES_PER_SECOND`], up to
/// [`MAX_READ_CREDIT`] bytes of them; and each read within `stall` of the one before.
#[derive(Debug)]
struct ReadDeadline {
    start: tokio::time::Instant,
    received: u64,
    stall: Duration,
}

impl ReadDeadline {
    fn from_now() -> Self {
        Self { start: tokio::time::Instant::now(), received: 0, stall: READ_STALL_TIMEOUT }
    }

    /// A request that began while the server was crowded: its reads may pause no longer than
    /// an idle connection may wait then.
    fn crowded(mut self) -> Self {
        self.stall = CROWDED_IDLE_TIMEOUT;
        self
    }

    /// When the next read must have come.
    fn next_read_by(&self) -> tokio::time::Instant {
        self.at().min(tokio::time::Instant::now() + self.stall)
    }

    fn received(&mut self, bytes: usize) {
        let credit = u64::try_from(MAX_READ_CREDIT).unwrap_or(u64::MAX);
        self.received = self.received.saturating_add(u64::try_from(bytes).unwrap_or(u64::MAX)).min(credit);
    }

    fn at(&self) -> tokio::time::Instant {
        let earned = match REQUEST_BODIES.crowded() {
            true => Duration::ZERO,
            false => Duration::from_millis(self.received.saturating_mul(1000) / MIN_READ_BYTES_PER_SECOND),
        };
        self.start + REQUEST_READ_TIMEOUT + earned
    }
}

/// The most bytes of one request that earn it time: the largest head and body, and an eighth
/// more for a chunked body's framing. Past it a request earns nothing, so a chunked body
/// padded out with chunk extensions (4 KiB of them around each byte of body) cannot hold its
/// connection for days at the minimum rate.
const MAX_READ_CREDIT: usize = MAX_HEAD_BYTES + MAX_REQUEST_BODY_BYTES + MAX_REQUEST_BODY_BYTES / 8;

struct Connection<'m> {
    stream: TcpStream,
    read: BytesMut,
    write: Vec<u8>,
    /// Where bytes pipelined past [`MAX_PIPELINED_BYTES`] are read to be dropped; made when
    /// first needed.
    overflow: Option<Box<[u8; DISCARD_CHUNK]>>,
    /// Bytes were dropped so: the connection closes after the answer in progress.
    overflowed: bool,
    /// Where a connection whose client pipelined so far is counted, once, as it happens.
    metrics: &'m Metrics,
    /// When the connection idles out; one timer for the connection's life, moved forward.
    idle: Pin<Box<Sleep>>,
}

/// Serves one connection until it closes; while `slots` are crowded, it waits idle for a
/// request only [`CROWDED_IDLE_TIMEOUT`].
pub(super) async fn serve(stream: TcpStream, app: App, stages: &Stages, slots: &Slots) {
    let mut conn = Connection::new(stream, &app.state.metrics);
    let mut calls = IdleCalls::new(slots, &stages.closing);
    loop {
        let waiting = &app.state.metrics.http_connections_waiting;
        let call = std::pin::pin!(calls.next());
        let (head, body, charge) = match conn.read_request(call, slots.crowded(), waiting).await {
            Ok(request) => request,
            Err(Stop::Quietly) => return,
            Err(Stop::Crowded) => {
                app.state.metrics.connection_shed();
                return;
            }
            Err(Stop::Refuse(error)) => {
                app.state.metrics.refused(&error);
                let response = ApiError::from(error).into_response();
                match conn.write_response(response, Version::HTTP_11, false, false).await {
                    Ok(_) => conn.linger().await,
                    Err(error) => app.state.metrics.write_failed(&error),
                }
                return;
            }
            Err(Stop::Stalled) => {
                app.state.metrics.write_stalled();
                return;
            }
        };
        let (asked_keep_alive, head_only, version) = (head.keep_alive, head.method == Method::HEAD, head.version);
        // Boxed, and only while the request is answered: inline, its future (some 2 KB, the
        // dispatch's own boxed apart) would be part of the connection's task for the
        // connection's whole life, every idle keep-alive connection's included. A chat
        // completion's future is built in its box ([`built_in_box`]), not inside another's:
        // each level of `async fn` would build and move the one below it.
        let work = if head.route == Route::ChatCompletions {
            Either::Left(built_in_box(|| chat::respond(&app.state, head.client, body)))
        } else {
            Either::Right(Box::pin(app.respond(head, body)))
        };
        let Some(response) = conn.until_client_leaves(work).await else {
            return app.state.metrics.abandoned();
        };
        // A draining replica answers, and asks the client to go elsewhere for the next request.
        let keep_alive = asked_keep_alive && !stages.draining.is_on() && !conn.overflowed;
        // The dispatch, which kept the body for a retry, is done with it: a stream's answer
        // runs on without it.
        drop(charge);
        match conn.write_response(response, version, keep_alive, head_only).await {
            // A stream answered keep-alive before the drain began may end during it: the
            // connection closes then, as every answer from the drain on says it will.
            Ok(true) if stages.draining.is_on() => return conn.close().await,
            // Requests were dropped under a stream: what follows is not where they began.
            Ok(true) if conn.overflowed => return conn.close().await,
            Ok(true) => {}
            Ok(false) => return conn.close().await,
            Err(error) => {
                app.state.metrics.write_failed(&error);
                return;
            }
        }
        conn.release_large_write_buffer();
    }
}

impl App {
    /// The response to one request other than a chat completion's, via the router.
    async fn respond(&self, head: RequestHead, body: Bytes) -> Response {
        let mut request = Request::new(Body::from(body));
        *request.method_mut() = head.method;
        *request.version_mut() = head.version;
        *request.headers_mut() = head.headers;
        match head.target.parse() {
            Ok(uri) => *request.uri_mut() = uri,
            // httparse takes some bytes in a target (`<`, `>`, a backtick) that a URI may not hold.
            Err(_) => {
                let error = HeadError::Malformed("request target".into());
                self.state.metrics.refused(&error);
                return ApiError::from(error).into_response();
            }
        }
        // The router is always ready and never fails: its errors are responses.
        match self.router.clone().call(request).await {
            Ok(response) => response,
            Err(infallible) => match infallible {},
        }
    }
}

/// One read from `stream`, kept in `read` while there is `room`, else read into `overflow`
/// to be dropped: how many bytes came, and whether they were dropped.
async fn read_or_drop(
    stream: &mut TcpStream,
    read: &mut BytesMut,
    overflow: &mut Option<Box<[u8; DISCARD_CHUNK]>>,
    room: bool,
) -> io::Result<(usize, bool)> {
    if room {
        return stream.read_buf(read).await.map(|n| (n, false));
    }
    let overflow = overflow.get_or_insert_with(|| Box::new([0; DISCARD_CHUNK]));
    stream.read(&mut overflow[..]).await.map(|n| (n, true))
}

impl<'m> Connection<'m> {
    fn new(stream: TcpStream, metrics: &'m Metrics) -> Self {
        Self {
            stream,
            metrics,
            read: BytesMut::with_capacity(READ_CHUNK),
            write: Vec::with_capacity(1024),
            overflow: None,
            overflowed: false,
            idle: Box::pin(tokio::time::sleep(IDLE_TIMEOUT)),
        }
    }

    /// The next request's head and whole body. Waits at most [`IDLE_TIMEOUT`] for its first
    /// byte (and not at all once the server is closing), then [`REQUEST_READ_TIMEOUT`] for the
    /// rest, with no pause past [`READ_STALL_TIMEOUT`] (the first wait and the pauses shorter while `crowded`).
    /// Until the first byte comes, the connection counts on `waiting`.
    async fn read_request(
        &mut self,
        mut call: Pin<&mut impl Future<Output = IdleCall>>,
        crowded: bool,
        waiting: &IntGauge,
    ) -> Result<(RequestHead, Bytes, Charge), Stop> {
        self.refresh_idle_deadline();
        if crowded {
            let soon = tokio::time::Instant::now() + CROWDED_IDLE_TIMEOUT;
            if soon < self.idle.deadline() {
                self.idle.as_mut().reset(soon);
            }
        }
        let mut idled_out = if crowded { Stop::Crowded } else { Stop::Quietly };
        // A call, once come, is not waited for again in this wait (its future is done).
        let mut called = false;
        let waited = Waiting::on(waiting);
        // Blank lines before a request line are ignored (RFC 9112 §2.2: some clients end a
        // body with an extra CRLF), and still idle: they move neither deadline.
        while self.skip_blank_lines() {
            self.make_room();
            let Connection { stream, read, idle, .. } = self;
            tokio::select! {
                biased;
                // The deadlines first: a client that keeps sending blank lines is still idle.
                () = idle.as_mut() => return Err(idled_out),
                next = call.as_mut(), if !called => match next {
                    IdleCall::Closing => return Err(Stop::Quietly),
                    // Crowded while it waited: it waits no longer than a wait begun now.
                    IdleCall::Crowded => {
                        called = true;
                        let soon = tokio::time::Instant::now() + CROWDED_IDLE_TIMEOUT;
                        if soon < idle.deadline() {
                            idle.as_mut().reset(soon);
                            idled_out = Stop::Crowded;
                        }
                    }
                },
                read = stream.read_buf(read) => match read {
                    Ok(0) | Err(_) => return Err(Stop::Quietly),
                    Ok(_) => {}
                },
            }
        }
        drop(waited);
        // Usually the whole request came with its first bytes: no reading left to time.
        if let Some(request) = self.buffered_request()? {
            return Ok(request);
        }
        let deadline = ReadDeadline::from_now();
        self.read_rest(&mut if crowded { deadline.crowded() } else { deadline }).await
    }

    /// Drops the blank lines at the front of the read buffer (CRLF, or a bare LF, which RFC
    /// 9112 §2.2 lets a server take as a line's end); whether nothing else is there. A bare CR
    /// stays, for the head's parser to refuse: that section says it is invalid.
    fn skip_blank_lines(&mut self) -> bool {
        let mut blank = 0;
        loop {
            match self.read.get(blank..) {
                Some([b'\r', b'\n', ..]) => blank += 2,
                Some([b'\n', ..]) => blank += 1,
                _ => break,
            }
        }
        self.read.advance(blank);
        // Tens of kilobytes of them, pipelined under the last answer, are not held while idle.
        self.release_large_read_buffer(blank);
        self.read.is_empty()
    }

    /// Moves the idle deadline to [`IDLE_TIMEOUT`] from now. The timer is re-armed only once
    /// it is a second behind, not for every request: the deadline needs no finer grain.
    fn refresh_idle_deadline(&mut self) {
        let deadline = tokio::time::Instant::now() + IDLE_TIMEOUT;
        if deadline.duration_since(self.idle.deadline()) > IDLE_DEADLINE_SLACK {
            self.idle.as_mut().reset(deadline);
        }
    }

    /// The request at the front of the read buffer if it is all there (head and a
    /// `Content-Length` body), taken off the buffer; else `None`, the buffer untouched.
    fn buffered_request(&mut self) -> Result<Option<(RequestHead, Bytes, Charge)>, Stop> {
        let Some((head, length)) = parse_request(&self.read).map_err(Stop::Refuse)? else { return Ok(None) };
        let BodyFraming::Length(body) = head.body else { return Ok(None) };
        if self.read.len() - length < body {
            return Ok(None);
        }
        // The body is here already: charged if there is room, else refused.
        let mut charge = Charge::default();
        if !REQUEST_BODIES.grow(&mut charge, body) {
            return Err(Stop::Refuse(HeadError::Busy));
        }
        self.read.advance(length);
        let body = self.take_body(length, body);
        Ok(Some((head, body, charge)))
    }

    /// The body of `length` bytes at the front of the read buffer, behind a head of `head`.
    fn take_body(&mut self, head: usize, length: usize) -> Bytes {
        let body = Bytes::copy_from_slice(&self.read[..length]);
        self.read.advance(length);
        self.release_large_read_buffer(head + length);
        body
    }

    /// After a request of `passed` bytes went through the read buffer, gives its allocation
    /// back if it is large: the body is copied out, and the response may stream for minutes.
    /// The allocation is at least the bytes passed and the room left past them (`capacity()`
    /// counts only that room), which a head that arrived in parts, or pipelined requests read
    /// under an answer, may have doubled however small each request was. It is kept while
    /// what is left fills half of it or more (requests pipelined behind a small one): copying
    /// that out would copy the same bytes again for each of them.
    fn release_large_read_buffer(&mut self, passed: usize) {
        let allocation = passed + self.read.capacity();
        if allocation > KEPT_READ_CAPACITY && allocation >= 2 * self.read.len().max(READ_CHUNK) {
            self.read = BytesMut::from(&self.read[..]);
        }
    }

    async fn read_rest(&mut self, deadline: &mut ReadDeadline) -> Result<(RequestHead, Bytes, Charge), Stop> {
        // Parsed first as it is, then again only once its end has arrived (`head_due`).
        let mut scanned: usize = 0;
        let (head, head_length) = loop {
            let due = scanned == 0 || head_due(&self.read, scanned, MAX_HEAD_BYTES);
            if due && let Some((head, length)) = parse_request(&self.read).map_err(Stop::Refuse)? {
                self.read.advance(length);
                // A large head's buffer goes before a body that may take its time: beside its
                // budgets a connection holds its target and tenant (8 KiB each) and a free body.
                self.release_large_read_buffer(length);
                break (head, length);
            }
            scanned = self.read.len();
            // A head that never ends is refused once past the bound, so the buffer need grow
            // no further than that and a read (doubling would take it to twice the bound).
            self.grow_toward(MAX_HEAD_BYTES + READ_CHUNK);
            self.fill_by(deadline, (MAX_HEAD_BYTES + READ_CHUNK).saturating_sub(scanned).max(1)).await?;
        };
        let (body, charge) = match head.body {
            BodyFraming::Length(length) => {
                if self.read.len() < length && head.expects_continue {
                    // Not invited to send a body that would be refused for lack of room.
                    if !REQUEST_BODIES.has_room(length) {
                        return Err(Stop::Refuse(HeadError::Busy));
                    }
                    write_continue(&mut self.stream).await?;
                }
                // The buffer grows as the body arrives, not by what the head announces, and is
                // charged for what it holds: a client that announces 8 MiB and sends nothing
                // holds no more than its reads, and one that stops halfway holds no more than
                // it is charged for.
                let mut charge = Charge::default();
                loop {
                    // No more than the body and a read's worth past it: what lies beyond (the
                    // next request, or junk) is not charged, and must not come in megabytes.
                    let most = length.saturating_sub(self.read.len()) + READ_CHUNK;
                    self.grow_toward(self.read.len() + most);
                    if !REQUEST_BODIES.grow(&mut charge, self.read.capacity().min(length)) {
                        return Err(Stop::Refuse(HeadError::Busy));
                    }
                    if self.read.len() >= length {
                        break;
                    }
                    self.fill_by(deadline, most).await?;
                }
                (self.take_body(head_length, length), charge)
            }
            BodyFraming::Chunked => {
                if self.read.is_empty() && head.expects_continue {
                    // Its length unknown: invited only while a body past the free size would
                    // find room.
                    if !REQUEST_BODIES.has_room(FREE_BYTES + 1) {
                        return Err(Stop::Refuse(HeadError::Busy));
                    }
                    write_continue(&mut self.stream).await?;
                }
                self.read_chunked(head_length, deadline).await?
            }
        };
        Ok((head, body, charge))
    }

    /// A chunked body behind a head of `head` bytes, charged as it grows.
    async fn read_chunked(&mut self, head: usize, deadline: &mut ReadDeadline) -> Result<(Bytes, Charge), Stop> {
        let mut decoder = Chunked::default();
        let mut body = BytesMut::new();
        let mut charge = Charge::default();
        loop {
            match decoder.decode(&mut self.read) {
                Ok(Decoded::Data(data)) if body.len() + data.len() > MAX_REQUEST_BODY_BYTES => {
                    return Err(Stop::Refuse(HeadError::BodyTooLarge));
                }
                Ok(Decoded::Data(data)) => {
                    if !append_charged(&mut body, &data, MAX_REQUEST_BODY_BYTES, (&REQUEST_BODIES, &mut charge)) {
                        return Err(Stop::Refuse(HeadError::Busy));
                    }
                }
                Ok(Decoded::End) => {
                    self.release_large_read_buffer(head + body.len());
                    return Ok((settle(body, &mut charge), charge));
                }
                Ok(Decoded::More) => self.fill_by(deadline, usize::MAX).await?,
                Err(WireError::Chunk(reason)) => return Err(Stop::Refuse(HeadError::Body(reason.into()))),
                Err(error) => return Err(Stop::Refuse(HeadError::Body(error.to_string()))),
            }
        }
    }

    /// Closes a connection whose last answer said it would (`Connection: close`, HTTP/1.0, a
    /// drain): as after a refusal, since a client may have sent more behind its request, and
    /// closing with it unread would reset the connection under the answer just written.
    async fn close(mut self) {
        self.linger().await;
    }

    fn make_room(&mut self) {
        if self.read.capacity() - self.read.len() < READ_CHUNK / 4 {
            self.read.reserve(READ_CHUNK);
        }
    }

    /// [`Self::make_room`] for a read buffer that should hold no more than `most` bytes in
    /// all: it doubles as a vector would, but stops there (a vector's doubling would take an
    /// 8 MiB body's buffer to 16 MiB).
    fn grow_toward(&mut self, most: usize) {
        let len = self.read.len();
        if self.read.capacity() - len >= READ_CHUNK / 4 {
            return;
        }
        let capacity = (2 * len).max(len + READ_CHUNK).min(most.max(len + READ_CHUNK / 4));
        reallocate(&mut self.read, capacity);
    }

    /// Reads what has arrived, `most` bytes at most; how many it read. The client closing is an
    /// error here (a request was expected).
    async fn fill_at_most(&mut self, most: usize) -> io::Result<usize> {
        self.make_room();
        let mut stream = (&mut self.stream).take(u64::try_from(most).unwrap_or(u64::MAX));
        match stream.read_buf(&mut self.read).await? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            read => Ok(read),
        }
    }

    /// [`Self::fill_at_most`] before the request's `deadline`, which the bytes read extend.
    async fn fill_by(&mut self, deadline: &mut ReadDeadline, most: usize) -> Result<(), Stop> {
        match tokio::time::timeout_at(deadline.next_read_by(), self.fill_at_most(most)).await {
            Ok(read) => {
                deadline.received(read?);
                Ok(())
            }
            Err(_) => Err(Stop::Refuse(HeadError::Timeout)),
        }
    }

    /// Closes after a refusal the way a client still sending its body can read: the answer is
    /// already written, so stop writing and discard what arrives, for a bounded time and
    /// amount, before closing. Closing with unread bytes would reset the connection, and the
    /// client could lose the answer to the reset.
    async fn linger(&mut self) {
        if self.stream.shutdown().await.is_err() {
            return;
        }
        let drain = async {
            let mut discarded = 0;
            while discarded < LINGER_BYTES {
                self.read.clear();
                self.make_room();
                match self.stream.read_buf(&mut self.read).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => discarded += n,
                }
            }
        };
        let _ = tokio::time::timeout(LINGER_TIME, drain).await;
    }

    /// Runs `work` (making a response, or waiting for its next frame) while watching the
    /// client: if it closes the connection first, `work` is dropped (which ends the dispatch
    /// behind it) and `None` returned. Bytes of a pipelined next request are kept for later,
    /// up to a bound; past it, what more comes is read only to see the client leave, and
    /// dropped: the requests it belongs to cannot all be served, so the connection closes
    /// after this answer ([`Self::overflowed`]).
    async fn until_client_leaves<T>(&mut self, mut work: impl Future<Output = T> + Unpin) -> Option<T> {
        loop {
            let room = self.read.len() < MAX_PIPELINED_BYTES;
            tokio::select! {
                biased;
                done = &mut work => return Some(done),
                read = read_or_drop(&mut self.stream, &mut self.read, &mut self.overflow, room) => match read {
                    Ok((0, _)) | Err(_) => return None,
                    Ok((_, dropped)) => {
                        if dropped && !self.overflowed {
                            self.metrics.pipelined_too_far();
                        }
                        self.overflowed |= dropped;
                    }
                },
            }
        }
    }

    /// Empties the write buffer, letting it go if a large answer grew it: neither an idle
    /// connection nor a long stream's later writes hold what one burst needed.
    fn release_large_write_buffer(&mut self) {
        if self.write.capacity() > KEPT_WRITE_CAPACITY {
            self.write = Vec::with_capacity(1024);
        } else {
            self.write.clear();
        }
    }

    /// Writes `response`; whether the connection can carry another request after it.
    async fn write_response(
        &mut self,
        response: Response,
        version: Version,
        keep_alive: bool,
        head_only: bool,
    ) -> io::Result<bool> {
        let (parts, mut body) = response.into_parts();
        let status = parts.status;
        let bodiless =
            status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
        let framing = match http_body::Body::size_hint(&body).exact() {
            _ if bodiless => ResponseFraming::NoBody,
            // A HEAD answer says what the GET's would be (RFC 9110 §9.3.2): the router sets
            // the length and empties the body.
            _ if head_only => declared_length(&parts.headers).map_or(ResponseFraming::NoBody, ResponseFraming::Length),
            Some(length) => ResponseFraming::Length(length),
            None if version == Version::HTTP_11 => ResponseFraming::Chunked,
            None => ResponseFraming::UntilClose,
        };
        let keep_alive = keep_alive && framing != ResponseFraming::UntilClose;
        self.write.clear();
        let persistence = Persistence::of(keep_alive, version);
        encode_response(&mut self.write, status, &parts.headers, framing, persistence, &http_date());
        let mut patience = Patience::default();
        if bodiless || head_only {
            write_unless_stalled(&mut self.stream, &self.write, &mut patience).await?;
            return Ok(keep_alive);
        }
        let mut frames = Frames::new(framing);
        frames.gather_ready(&mut body, &mut self.write);
        write_unless_stalled(&mut self.stream, &self.write, &mut patience).await?;
        while !frames.ended {
            self.release_large_write_buffer();
            let frame = self.until_client_leaves(body.frame()).await.ok_or(io::ErrorKind::ConnectionReset)?;
            frames.append(frame, &mut self.write);
            frames.gather_ready(&mut body, &mut self.write);
            write_unless_stalled(&mut self.stream, &self.write, &mut patience).await?;
        }
        // A body that broke off cannot be ended properly: closing tells the client it is cut.
        Ok(keep_alive && !frames.broken)
    }
}

/// The `Content-Length` a handler set, if it is one number.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// How long one response's writes may still wait on a slow client: [`WRITE_STALL_TIMEOUT`] in
/// all, and each write's bytes at [`MIN_WRITE_BYTES_PER_SECOND`] besides. Kept across the
/// response's writes, so that a client reading a stream's events a little before each wait
/// would time out is dropped all the same, once its waits add up.
#[derive(Debug, Clone, Copy)]
struct Patience(Duration);

impl Default for Patience {
    fn default() -> Self {
        Self(WRITE_STALL_TIMEOUT)
    }
}

impl Patience {
    /// The longest the next wait of a write may take; the first wait of each write is granted
    /// the time of its `len` bytes too. No wait is longer than [`WRITE_STALL_TIMEOUT`]: a
    /// client that takes none of a write for that long has stopped reading.
    fn allow(&mut self, len: usize, first_wait: bool) -> Duration {
        if first_wait {
            self.0 += transfer_time(len);
        }
        self.0.min(WRITE_STALL_TIMEOUT)
    }

    fn spend(&mut self, waited: Duration) {
        self.0 = self.0.saturating_sub(waited);
    }
}

/// Writes all of `bytes`, failing with [`io::ErrorKind::TimedOut`] once the client has taken
/// none of them for [`WRITE_STALL_TIMEOUT`], or once the waits of this response (`patience`)
/// outlast what it allows: a slow reader of a large answer is served, one that stopped
/// reading or barely reads is not waited on.
async fn write_unless_stalled(stream: &mut TcpStream, mut bytes: &[u8], patience: &mut Patience) -> io::Result<()> {
    let mut granted = false;
    while !bytes.is_empty() {
        // Usually the socket takes it all at once, with no timer to arm.
        let written = match stream.try_write(bytes) {
            Ok(n) => n,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                let allowed = patience.allow(bytes.len(), !std::mem::replace(&mut granted, true));
                let waited_from = tokio::time::Instant::now();
                let wait = tokio::time::timeout(allowed, stream.write(bytes)).await;
                patience.spend(waited_from.elapsed());
                match wait {
                    Ok(written) => written?,
                    Err(_) => return Err(io::ErrorKind::TimedOut.into()),
                }
            }
            Err(error) => return Err(error),
        };
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[written..];
    }
    Ok(())
}

/// How long `len` bytes take at [`MIN_WRITE_BYTES_PER_SECOND`].
fn transfer_time(len: usize) -> Duration {
    Duration::from_secs_f64(len as f64 / MIN_WRITE_BYTES_PER_SECOND as f64)
}

/// Framing a response body's frames into the write buffer.
struct Frames {
    framing: ResponseFraming,
    /// Of a `Content-Length` answer, the bytes still owed: a body that ends short of its
    /// length, or runs past it, would frame the next answer on the connection wrongly.
    owed: u64,
    ended: bool,
    broken: bool,
}

type Frame = Option<Result<http_body::Frame<Bytes>, axum::Error>>;

impl Frames {
    fn new(framing: ResponseFraming) -> Self {
        let owed = match framing {
            ResponseFraming::Length(length) => length,
            _ => 0,
        };
        Self { framing, owed, ended: false, broken: false }
    }

    /// Appends the frames the body has ready now, without waiting, until the buffer holds
    /// [`KEPT_WRITE_CAPACITY`]: behind a client reading slower than the shim sends, a stream's
    /// frames wait in the shim connection's socket, not in this buffer.
    fn gather_ready(&mut self, body: &mut Body, out: &mut Vec<u8>) {
        while !self.ended && out.len() < KEPT_WRITE_CAPACITY {
            match body.frame().now_or_never() {
                Some(frame) => self.append(frame, out),
                None => return,
            }
        }
    }

    fn append(&mut self, frame: Frame, out: &mut Vec<u8>) {
        match frame {
            Some(Ok(frame)) => {
                // Trailers are not relayed.
                let Ok(data) = frame.into_data() else { return };
                match self.framing {
                    ResponseFraming::Chunked => encode_chunk(out, &data),
                    ResponseFraming::Length(_) => {
                        let fits = usize::try_from(self.owed).map_or(data.len(), |owed| owed.min(data.len()));
                        out.extend_from_slice(&data[..fits]);
                        self.owed -= fits as u64;
                        if fits < data.len() {
                            tracing::debug!(past = data.len() - fits, "a response body ran past its length");
                            self.ended = true;
                            self.broken = true;
                        }
                    }
                    _ => out.extend_from_slice(&data),
                }
            }
            None => {
                self.ended = true;
                match self.framing {
                    ResponseFraming::Chunked => out.extend_from_slice(LAST_CHUNK),
                    ResponseFraming::Length(_) if self.owed > 0 => {
                        tracing::debug!(short = self.owed, "a response body ended short of its length");
                        self.broken = true;
                    }
                    _ => {}
                }
            }
            Some(Err(error)) => {
                tracing::debug!(%error, "a response body failed while being written");
                self.ended = true;
                self.broken = true;
            }
        }
    }
}

#[cfg(test)]
mod tests;
