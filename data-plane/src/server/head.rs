//! HTTP/1.x as the replica's server speaks it, as pure functions over bytes: a request head
//! parsed with its body framing and persistence, and a response head written with the framing
//! the server chose. The connection loop (`super::conn`) owns the sockets.

use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::header::{CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};

use super::conn::{CROWDED_IDLE_TIMEOUT, MIN_READ_BYTES_PER_SECOND, READ_STALL_TIMEOUT, REQUEST_READ_TIMEOUT};
use crate::dispatch::wire::{LengthError, content_length, has_token, listed_codings, transfer_codings, values};
use crate::ingress::MAX_REQUEST_BODY_BYTES;
use crate::ingress::chat::ChatHeaders;
use crate::routing::headers::{TENANT_ID, asks_disclosure, is_routing_header, tenant, trace};

/// The most headers a request head may carry.
pub const MAX_HEADERS: usize = 64;
/// The largest request head accepted.
pub const MAX_HEAD_BYTES: usize = 64 << 10;
/// The longest request target: with [`MAX_TENANT_BYTES`], what a request keeps of its head
/// beyond its read buffer while its body arrives, so together they bound what each of
/// thousands of connections holds outside any budget (nginx refuses a request line past 8 KiB
/// by default).
pub const MAX_TARGET_BYTES: usize = 8 << 10;
/// The longest `x-tenant-id` (see [`MAX_TARGET_BYTES`]).
pub const MAX_TENANT_BYTES: usize = 8 << 10;

/// Why a request head was refused; each maps to the status the client is answered with, after
/// which the connection closes (its framing can no longer be trusted). A target that parsed as
/// the head did but is no URI is the one refusal a whole, framed request gets: the connection
/// goes on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("malformed request head: {0}")]
    Malformed(String),
    #[error("the request head is larger than {MAX_HEAD_BYTES} bytes or has more than {MAX_HEADERS} headers")]
    TooLarge,
    #[error("the request target is longer than {MAX_TARGET_BYTES} bytes")]
    TargetTooLong,
    #[error("the {0} header is longer than {MAX_TENANT_BYTES} bytes")]
    FieldTooLong(&'static str),
    #[error("the request is not HTTP/1.0 or HTTP/1.1")]
    Version,
    #[error("the request body is sent with a transfer coding other than `chunked` alone")]
    UnsupportedCoding,
    #[error("the request body is larger than {MAX_REQUEST_BODY_BYTES} bytes")]
    BodyTooLarge,
    #[error("{0}")]
    Framing(&'static str),
    #[error("malformed chunked request body: {0}")]
    Body(String),
    #[error(
        "the request did not arrive in time: within {} seconds of its first byte (longer by its bytes' time at {} KiB/s), with no pause in its bytes over {} seconds ({} while the server is crowded)",
        REQUEST_READ_TIMEOUT.as_secs(),
        MIN_READ_BYTES_PER_SECOND >> 10,
        READ_STALL_TIMEOUT.as_secs(),
        CROWDED_IDLE_TIMEOUT.as_secs()
    )]
    Timeout,
    #[error("the replica holds as many large request bodies as it may")]
    Busy,
}

impl HeadError {
    pub fn status(&self) -> StatusCode {
        match self {
            HeadError::Malformed(_) | HeadError::Framing(_) | HeadError::Body(_) => StatusCode::BAD_REQUEST,
            HeadError::Timeout => StatusCode::REQUEST_TIMEOUT,
            HeadError::TooLarge | HeadError::FieldTooLong(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadError::Version => StatusCode::HTTP_VERSION_NOT_SUPPORTED,
            HeadError::TargetTooLong => StatusCode::URI_TOO_LONG,
            HeadError::UnsupportedCoding => StatusCode::NOT_IMPLEMENTED,
            HeadError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            HeadError::Busy => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// How a request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// Exactly this many bytes follow (zero: no body).
    Length(usize),
    Chunked,
}

/// Where a request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions`: the proxy hop, served without a routing layer.
    ChatCompletions,
    /// Everything else, through the axum router.
    Router,
}

/// A parsed request head.
#[derive(Debug)]
pub struct RequestHead {
    pub method: Method,
    /// The request target as sent (origin form: path and query).
    pub target: String,
    pub version: Version,
    pub route: Route,
    /// The headers, for the router. Empty for a chat completion: of the client's headers only
    /// what [`RequestHead::client`] says is carried past its head, so no other can reach a shim.
    pub headers: HeaderMap,
    /// What the client's headers hand on: whether it asked for disclosure (any route), and a
    /// chat completion's tenant and tracing headers ([`trace`]).
    pub client: ChatHeaders,
    pub body: BodyFraming,
    /// Whether the connection may carry another request after this one's response.
    pub keep_alive: bool,
    /// The client waits for `100 Continue` before sending its body.
    pub expects_continue: bool,
}

/// Whether a line of `head` ends in an LF alone. RFC 9112 §2.2 lets a recipient take one for
/// a line's end, and httparse does; a hop in front that does not would read the next line as
/// part of the header before it (`X: y\nContent-Length: 40`), and frame the request by other
/// headers than these. Refused, as chunk lines ending so are.
fn has_bare_lf(head: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', head).any(|at| at == 0 || head[at - 1] != b'\r')
}

/// The request head at the start of `buf` and its length, or `None` while it is incomplete.
pub fn parse_request(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut slots);
    let length = match request.parse(buf) {
        Ok(httparse::Status::Complete(length)) => length,
        // RFC 9112 §3: a request line that alone does not fit is a target too long to read.
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES && !buf[..MAX_HEAD_BYTES].contains(&b'\n') => {
            return Err(HeadError::TargetTooLong);
        }
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => return Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(httparse::Error::Version) => return Err(HeadError::Version),
        Err(error) => return Err(HeadError::Malformed(error.to_string())),
    };
    if length > MAX_HEAD_BYTES {
        return Err(HeadError::TooLarge);
    }
    if has_bare_lf(&buf[..length]) {
        return Err(HeadError::Framing("every line of a request head must end in CRLF, not a bare LF"));
    }
    let method = Method::from_bytes(request.method.unwrap_or_default().as_bytes())
        .map_err(|_| HeadError::Malformed("method".into()))?;
    let version = if request.version == Some(1) { Version::HTTP_11 } else { Version::HTTP_10 };
    let target = request.path.unwrap_or("/");
    if target.len() > MAX_TARGET_BYTES {
        return Err(HeadError::TargetTooLong);
    }
    let path = origin_path(target)?.split(['?', '#']).next().unwrap_or_default();
    let route = if method == Method::POST && path == CHAT_COMPLETIONS { Route::ChatCompletions } else { Route::Router };
    let raw = &*request.headers;
    check_host(raw, version)?;
    let headers = match route {
        Route::ChatCompletions => HeaderMap::new(),
        Route::Router => header_map(raw)?,
    };
    if version == Version::HTTP_10 && values(raw, "transfer-encoding").next().is_some() {
        // RFC 9112 §6.1: HTTP/1.0 has no transfer codings, so a hop that speaks it may frame
        // this body by other rules than ours, whatever the codings listed.
        return Err(HeadError::Framing("an HTTP/1.0 request may not carry Transfer-Encoding"));
    }
    let body = body_framing(raw)?;
    let keep_alive = match version {
        Version::HTTP_11 => !has_token(raw, "connection", "close"),
        // RFC 9112 §9.3: `close` wins over `keep-alive`, wherever each is listed.
        _ => has_token(raw, "connection", "keep-alive") && !has_token(raw, "connection", "close"),
    };
    let expects_continue = version == Version::HTTP_11
        && values(raw, "expect").any(|v| v.trim_ascii().eq_ignore_ascii_case(b"100-continue"));
    let disclose = raw.iter().any(|h| asks_disclosure(h.name));
    let (tenant, trace) = match route {
        Route::ChatCompletions => {
            // Measured as the tenant is read (it reads every value), in one pass.
            let mut too_long = false;
            let tenant = tenant(values(raw, TENANT_ID).inspect(|value| too_long |= value.len() > MAX_TENANT_BYTES));
            if too_long {
                return Err(HeadError::FieldTooLong(TENANT_ID));
            }
            (tenant, trace(raw.iter().map(|h| (h.name, h.value))))
        }
        Route::Router => (None, Vec::new()),
    };
    let head = RequestHead {
        method,
        target: target.to_string(),
        version,
        route,
        headers,
        client: ChatHeaders { disclose, tenant, trace },
        body,
        keep_alive,
        expects_continue,
    };
    Ok(Some((head, length)))
}

/// The path the server answers itself, by POST.
pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";

/// The path and query of a request target: an origin-form target as it is, an absolute-form
/// one (`http://host/path`, which RFC 9112 §3.2.2 has servers accept) less its scheme and
/// authority, `*` (OPTIONS) as it is. Anything else, or a byte no URI holds (httparse lets
/// some through: `<`, `"`, a backtick, non-ASCII), is refused on every route alike: a hop in
/// front that reads such a target its own way must not see another path than the one routed.
fn origin_path(target: &str) -> Result<&str, HeadError> {
    let malformed = || HeadError::Malformed("request target: not a path, `*` or an http(s) URL".into());
    if !target.bytes().all(|b| TARGET_BYTES[usize::from(b)]) {
        return Err(malformed());
    }
    if target.starts_with('/') || target == "*" {
        // Origin form: a `://` is in its query (`?cb=http://…`), not a scheme.
        return Ok(target);
    }
    let rest = ["http://", "https://"]
        .iter()
        .find(|scheme| target.get(..scheme.len()).is_some_and(|s| s.eq_ignore_ascii_case(scheme)))
        .map(|scheme| &target[scheme.len()..])
        .ok_or_else(malformed)?;
    // The authority ends at the first `/`, `?` or `#` (RFC 3986 §3.2): `http://x?/v1/…` has
    // the path `/`, and `/v1/…` is its query.
    Ok(match rest.find(['/', '?', '#']) {
        Some(at) if rest[at..].starts_with('/') => &rest[at..],
        _ => "/",
    })
}

/// The bytes a request target may hold: visible ASCII but those no URI holds (RFC 3986 §2).
/// Looked up, not searched for: each request's target is checked byte by byte.
const TARGET_BYTES: [bool; 256] = visible_ascii_but(b"<>\"{}|\\^`");
/// The bytes a Host value may hold: a target's, but those that end or precede a host.
const HOST_BYTES: [bool; 256] = visible_ascii_but(b"<>\"{}|\\^`/?#@");

const fn visible_ascii_but(excluded: &[u8]) -> [bool; 256] {
    let mut table = [false; 256];
    let mut b = b'!';
    while b <= b'~' {
        table[b as usize] = true;
        b += 1;
    }
    let mut i = 0;
    while i < excluded.len() {
        table[excluded[i] as usize] = false;
        i += 1;
    }
    table
}

/// RFC 9112 §3.2: a request names its host at most once (an HTTP/1.1 one exactly once), and
/// as a host, with no white space or path in it; otherwise it is a 400. A hop in front that
/// takes the first of two, or reads `a b` its own way, would route by another host.
fn check_host(raw: &[httparse::Header<'_>], version: Version) -> Result<(), HeadError> {
    let mut hosts = values(raw, "host");
    let (first, more) = (hosts.next(), hosts.next().is_some());
    if more || (first.is_none() && version == Version::HTTP_11) {
        return Err(HeadError::Malformed("a request must carry one Host header (HTTP/1.1: exactly one)".into()));
    }
    if first.is_some_and(|host| !host.trim_ascii().iter().all(|b| HOST_BYTES[usize::from(*b)])) {
        return Err(HeadError::Malformed("the Host header is not a host (and port)".into()));
    }
    Ok(())
}

fn header_map(raw: &[httparse::Header<'_>]) -> Result<HeaderMap, HeadError> {
    let mut headers = HeaderMap::with_capacity(raw.len());
    for header in raw {
        let name = HeaderName::from_bytes(header.name.as_bytes())
            .map_err(|_| HeadError::Malformed(format!("header name {:?}", header.name)))?;
        // Header hygiene at the ingress, for the endpoints that get headers at all (a chat
        // completion gets none): no routing header of the client's goes further.
        if is_routing_header(name.as_str()) {
            continue;
        }
        let value = HeaderValue::from_bytes(header.value)
            .map_err(|_| HeadError::Malformed(format!("value of header {name}")))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// RFC 9112 §6.3 for requests, strictly: a request that carries both `Transfer-Encoding` and
/// `Content-Length`, conflicting lengths, or a coding other than a final `chunked` is refused,
/// since a proxy that guesses its framing can be made to read a second, smuggled request.
fn body_framing(raw: &[httparse::Header<'_>]) -> Result<BodyFraming, HeadError> {
    if let Some(codings) = transfer_codings(raw) {
        if values(raw, "content-length").next().is_some() {
            return Err(HeadError::Framing("a request may not carry both Transfer-Encoding and Content-Length"));
        }
        if !codings.final_chunked {
            return Err(HeadError::Framing("the only transfer coding accepted is a final `chunked`"));
        }
        // RFC 9112 §6.1: chunked is applied once; a hop that decodes it once would take the
        // rest of the body for the framing of the next request.
        if listed_codings(raw).filter(|c| c.eq_ignore_ascii_case(b"chunked")).count() > 1 {
            return Err(HeadError::Framing("chunked may be applied to a body only once"));
        }
        // RFC 9112 §6.1: a coding the server cannot decode (`gzip, chunked`) is not
        // implemented, rather than passed on still encoded.
        if !codings.only_chunked() {
            return Err(HeadError::UnsupportedCoding);
        }
        return Ok(BodyFraming::Chunked);
    }
    let length = match content_length(raw) {
        Ok(length) => length.unwrap_or(0),
        Err(LengthError::NotANumber) => return Err(HeadError::Framing("Content-Length is not a number")),
        Err(LengthError::TooLarge) => return Err(HeadError::BodyTooLarge),
        Err(LengthError::Conflicting) => return Err(HeadError::Framing("conflicting Content-Length values")),
    };
    match usize::try_from(length) {
        Ok(length) if length <= MAX_REQUEST_BODY_BYTES => Ok(BodyFraming::Length(length)),
        _ => Err(HeadError::BodyTooLarge),
    }
}

/// How a response body goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFraming {
    /// `Content-Length`: the size is known before the first byte.
    Length(u64),
    /// Chunked: a stream, to an HTTP/1.1 client.
    Chunked,
    /// Neither: a stream to an HTTP/1.0 client, ended by closing the connection.
    UntilClose,
    /// No body by its status (1xx, 204, 304): no framing header either.
    NoBody,
}

/// Whether the connection carries another request after a response, as its head says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// It ends after this response: `connection: close`.
    Close,
    /// It stays open, as HTTP/1.1 assumes: nothing to say.
    KeepAlive,
    /// It stays open for an HTTP/1.0 client that asked, which must be told so
    /// (`connection: keep-alive`) or it waits for the server to close.
    KeepAlive10,
}

impl Persistence {
    pub fn of(keep_alive: bool, version: Version) -> Self {
        match (keep_alive, version) {
            (false, _) => Persistence::Close,
            (true, Version::HTTP_10) => Persistence::KeepAlive10,
            (true, _) => Persistence::KeepAlive,
        }
    }
}

/// Writes a response head into `out`: the status line, `date`, the response's own headers
/// except the framing, persistence and date ones (the server owns those), then the framing
/// and the persistence.
pub fn encode_response(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    framing: ResponseFraming,
    persistence: Persistence,
    date: &str,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("Unknown").as_bytes());
    out.extend_from_slice(b"\r\ndate: ");
    out.extend_from_slice(date.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers.iter().filter(|(name, _)| !server_owned(name)) {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        ResponseFraming::Length(length) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        ResponseFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        ResponseFraming::UntilClose | ResponseFraming::NoBody => {}
    }
    match persistence {
        Persistence::Close => out.extend_from_slice(b"connection: close\r\n"),
        Persistence::KeepAlive10 => out.extend_from_slice(b"connection: keep-alive\r\n"),
        Persistence::KeepAlive => {}
    }
    out.extend_from_slice(b"\r\n");
}

/// The `date` header's value for now (IMF-fixdate), formatted at most once a second per thread.
pub fn http_date() -> Rc<str> {
    thread_local! {
        static CACHED: RefCell<(u64, Rc<str>)> = RefCell::new((u64::MAX, Rc::from("")));
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second {
            *cached = (second, Rc::from(httpdate::fmt_http_date(now)));
        }
        Rc::clone(&cached.1)
    })
}

/// Response headers the server writes itself, whatever the handler set.
fn server_owned(name: &HeaderName) -> bool {
    [CONTENT_LENGTH, TRANSFER_ENCODING, CONNECTION, DATE].contains(name) || name == "keep-alive"
}

/// Appends one chunk of a chunked body (nothing for an empty one: that would end the body).
pub fn encode_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let _ = write!(out, "{:x}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body: the last chunk, no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::dispatch::wire::{flipped, head_text};

    /// Parses `text`, given a `host: x` line after its first when it is an HTTP/1.1 head that
    /// names none (see `an_http11_request_names_its_host_once`).
    fn parse(text: &str) -> Result<Option<(RequestHead, usize)>, HeadError> {
        match text.split_once("HTTP/1.1\r\n") {
            Some((line, rest)) if !text.to_ascii_lowercase().contains("\nhost:") => {
                parse_request(format!("{line}HTTP/1.1\r\nhost: x\r\n{rest}").as_bytes())
            }
            _ => parse_request(text.as_bytes()),
        }
    }

    fn head(text: &str) -> RequestHead {
        parse(text).unwrap().unwrap().0
    }

    #[test]
    fn a_request_head_is_read_whole_with_its_framing_and_persistence() {
        assert!(parse("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").unwrap().is_none());
        let text = "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
        let (h, n) = parse(text).unwrap().unwrap();
        assert_eq!(n, text.len() - 2, "the body is left in the buffer");
        assert_eq!(
            (h.method, h.target.as_str(), h.body),
            (Method::POST, "/v1/chat/completions?x=1", BodyFraming::Length(2))
        );
        assert!(h.keep_alive && !h.expects_continue && !h.client.disclose);
        assert_eq!(h.route, Route::ChatCompletions);
        assert!(h.headers.is_empty(), "no client header is kept for a chat completion");
        let h = head("GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Backend: \r\n\r\n");
        assert_eq!((h.route, h.client.disclose, h.headers["host"].as_bytes()), (Route::Router, true, &b"x"[..]));
        assert_eq!(head("GET /v1/chat/completions HTTP/1.1\r\n\r\n").route, Route::Router);
        let absolute = head("POST http://router:8080/v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(absolute.route, Route::ChatCompletions, "an absolute-form target is routed by its path");
        let query = head("POST /v1/chat/completions?cb=http://x/y HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(query.route, Route::ChatCompletions, "a URL in the query is not the target's scheme");
        assert_eq!(head("GET http://router HTTP/1.1\r\n\r\n").route, Route::Router);
        for target in ["http://x?/v1/chat/completions", "http://x#/v1/chat/completions"] {
            let text = format!("POST {target} HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
            assert_eq!(head(&text).route, Route::Router, "{target}: the path is `/`, the rest its query");
        }

        let rows = [
            ("GET / HTTP/1.1\r\n\r\n", BodyFraming::Length(0), true),
            ("GET / HTTP/1.1\r\nConnection: Keep-Alive, CLOSE\r\n\r\n", BodyFraming::Length(0), false),
            ("GET / HTTP/1.0\r\n\r\n", BodyFraming::Length(0), false),
            ("GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", BodyFraming::Length(0), true),
            ("GET / HTTP/1.0\r\nconnection: keep-alive, close\r\n\r\n", BodyFraming::Length(0), false),
            ("GET / HTTP/1.0\r\nconnection: keep-alive\r\nconnection: close\r\n\r\n", BodyFraming::Length(0), false),
            ("POST / HTTP/1.1\r\ntransfer-encoding:  Chunked \r\n\r\n", BodyFraming::Chunked, true),
            ("POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n", BodyFraming::Length(5), true),
        ];
        for (text, body, keep_alive) in rows {
            let h = head(text);
            assert_eq!((h.body, h.keep_alive), (body, keep_alive), "{text:?}");
        }
        assert!(head("POST / HTTP/1.1\r\nExpect: 100-Continue\r\ncontent-length: 1\r\n\r\n").expects_continue);
        let tenant =
            "POST /v1/chat/completions HTTP/1.1\r\nX-Tenant-Id: a\r\nx-tenant-id:  b \r\ncontent-length: 0\r\n\r\n";
        assert_eq!(head(tenant).client.tenant.as_deref(), Some("b"), "the last value, trimmed");
        assert_eq!(
            head("GET /v1/models HTTP/1.1\r\nx-tenant-id: a\r\n\r\n").client.tenant,
            None,
            "only a chat completion's"
        );
        assert!(!head("POST / HTTP/1.0\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\n").expects_continue);
    }

    #[test]
    fn heads_whose_framing_cannot_be_trusted_are_refused_and_say_why() {
        let refused = |text: &str| parse(text).unwrap_err();
        let rows = [
            ("POST / HTTP/1.1\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n", "both"),
            ("POST / HTTP/1.1\r\ntransfer-encoding: chunked, gzip\r\n\r\n", "final `chunked`"),
            ("POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", "conflicting"),
            ("POST / HTTP/1.1\r\ncontent-length: +1\r\n\r\n", "not a number"),
            ("POST / HTTP/1.1\r\ncontent-length: x\r\n\r\n", "not a number"),
            ("GET / HTTP/1.1\r\nbad header\r\n\r\n", "malformed"),
            ("\x16\x03\x01 TLS hello\r\n\r\n", "malformed"),
            ("POST / HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n", "HTTP/1.0"),
            // Whatever the codings: HTTP/1.0 has none.
            ("POST / HTTP/1.0\r\ntransfer-encoding: gzip, chunked\r\n\r\n", "HTTP/1.0"),
            ("POST / HTTP/1.1\r\ntransfer-encoding: chunked, chunked\r\n\r\n", "only once"),
            ("POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: Chunked\r\n\r\n", "only once"),
            // A hop splitting lines on CRLF alone would see no Content-Length here.
            ("POST / HTTP/1.1\r\nhost: x\r\nx: y\ncontent-length: 40\r\n\r\n", "bare LF"),
            ("GET / HTTP/1.1\nhost: x\n\n", "bare LF"),
            // What httparse refuses for us, pinned here: each is a way to hide a header from
            // one hop and show it to the next.
            ("POST / HTTP/1.1\r\nx: a\r\n content-length: 40\r\n\r\n", "malformed"),
            ("POST / HTTP/1.1\r\nx: a\rcontent-length: 40\r\n\r\n", "malformed"),
            ("POST / HTTP/1.1\r\ncontent-length : 5\r\n\r\n", "malformed"),
            ("POST / HTTP/1.1\r\nx: a\0b\r\n\r\n", "malformed"),
            ("POST / HTTP/1.1\r\ncontent-length: 5, 5\r\n\r\n", "not a number"),
            ("POST / HTTP/1.1\r\ncontent-length: 5,6\r\n\r\n", "not a number"),
            ("POST / HTTP/1.1\r\ntransfer-encoding: chunked,\r\n\r\n", "final `chunked`"),
            ("POST / HTTP/1.1\r\ntransfer-encoding: identity\r\n\r\n", "final `chunked`"),
            ("POST / HTTP/1.1\r\ntransfer-encoding:\r\n\r\n", "final `chunked`"),
        ];
        for (text, says) in rows {
            let error = refused(text);
            assert!(error.to_string().contains(says), "{text:?}: {error}");
            assert_eq!(error.status(), StatusCode::BAD_REQUEST, "{text:?}");
        }
        let gzip = refused("POST / HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n");
        assert_eq!((gzip.clone(), gzip.status()), (HeadError::UnsupportedCoding, StatusCode::NOT_IMPLEMENTED));
        let target = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(refused(&target).status(), StatusCode::URI_TOO_LONG);
        let huge = format!("POST / HTTP/1.1\r\ncontent-length: {}\r\n\r\n", MAX_REQUEST_BODY_BYTES + 1);
        assert_eq!(refused(&huge), HeadError::BodyTooLarge);
        assert_eq!(refused("POST / HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n"), HeadError::BodyTooLarge);
        assert_eq!(refused(&huge).status(), StatusCode::PAYLOAD_TOO_LARGE);
        let endless = format!("GET / HTTP/1.1\r\nx: {}", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(refused(&endless), HeadError::TooLarge);
        let many: String = (0..=MAX_HEADERS).map(|i| format!("h{i}: v\r\n")).collect();
        assert_eq!(
            refused(&format!("GET / HTTP/1.1\r\n{many}\r\n")).status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
    }

    #[test]
    fn a_request_names_its_host_once_and_as_a_host() {
        let host = |text: &str| parse_request(text.as_bytes());
        let rows = [
            ("GET / HTTP/1.1\r\n\r\n", "one Host"),
            ("GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", "one Host"),
            ("GET / HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n", "one Host"),
            ("GET / HTTP/1.1\r\nHost: a b\r\n\r\n", "not a host"),
            ("GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", "not a host"),
            ("GET / HTTP/1.0\r\nHost: user@a\r\n\r\n", "not a host"),
        ];
        for (text, says) in rows {
            let error = host(text).unwrap_err();
            assert!(error.to_string().contains(says), "{text:?}: {error}");
            assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        }
        for text in ["GET / HTTP/1.1\r\nHOST: a\r\n\r\n", "GET / HTTP/1.1\r\nHost: [::1]:8080 \r\n\r\n"] {
            assert!(host(text).unwrap().is_some(), "{text:?}");
        }
        assert!(host("GET / HTTP/1.0\r\n\r\n").unwrap().is_some(), "HTTP/1.0 need not name one");
    }

    #[test]
    fn a_target_is_a_path_star_or_http_url_within_its_bound_on_every_route() {
        let refused = |text: String| parse(&text).unwrap_err();
        for target in [
            "x?y=http://a/v1/chat/completions",
            "ftp://a/v1/chat/completions",
            "/v1/chat/completions<script>",
            "/v1/chat/completions?q=\"",
            "/v1/chat/compl\u{e9}tions",
        ] {
            for method in ["POST", "GET"] {
                let error = refused(format!("{method} {target} HTTP/1.1\r\ncontent-length: 0\r\n\r\n"));
                assert!(error.to_string().contains("request target"), "{method} {target}: {error}");
                assert_eq!(error.status(), StatusCode::BAD_REQUEST, "{method} {target}");
            }
        }
        let https = head("POST HTTPS://r/v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(https.route, Route::ChatCompletions, "a scheme in any case");
        assert_eq!(head("OPTIONS * HTTP/1.1\r\n\r\n").target, "*");
        let at_bound = format!("/v1/chat/completions?{}", "q".repeat(MAX_TARGET_BYTES - 21));
        assert_eq!(at_bound.len(), MAX_TARGET_BYTES);
        assert!(parse(&format!("POST {at_bound} HTTP/1.1\r\ncontent-length: 0\r\n\r\n")).is_ok());
        let past = refused(format!("POST {at_bound}q HTTP/1.1\r\ncontent-length: 0\r\n\r\n"));
        assert_eq!((past.clone(), past.status()), (HeadError::TargetTooLong, StatusCode::URI_TOO_LONG));
    }

    #[test]
    fn a_tenant_past_its_bound_and_an_unknown_version_are_refused_with_their_statuses() {
        let tenant = |value: &str| {
            let text =
                format!("POST /v1/chat/completions HTTP/1.1\r\nx-tenant-id: {value}\r\ncontent-length: 0\r\n\r\n");
            parse(&text)
        };
        let at_bound = "t".repeat(MAX_TENANT_BYTES);
        assert_eq!(tenant(&at_bound).unwrap().unwrap().0.client.tenant.as_deref(), Some(at_bound.as_str()));
        let error = tenant(&format!("{at_bound}t")).unwrap_err();
        assert_eq!(error, HeadError::FieldTooLong(TENANT_ID));
        assert_eq!(error.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert!(error.to_string().contains("x-tenant-id"), "{error}");
        for version in ["HTTP/2.0", "HTTP/1.2", "HTTP/3"] {
            let error = parse_request(format!("GET / {version}\r\nhost: x\r\n\r\n").as_bytes()).unwrap_err();
            assert_eq!((error.clone(), error.status()), (HeadError::Version, StatusCode::HTTP_VERSION_NOT_SUPPORTED));
        }
    }

    #[test]
    fn a_response_head_carries_the_servers_framing_not_the_handlers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("999"));
        headers.insert("connection", HeaderValue::from_static("upgrade"));
        headers.insert("date", HeaderValue::from_static("the shim's"));
        let encode = |framing, persistence| {
            let mut out = Vec::new();
            encode_response(&mut out, StatusCode::OK, &headers, framing, persistence, "Sun, 06 Nov 1994 08:49:37 GMT");
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            encode(ResponseFraming::Length(2), Persistence::KeepAlive),
            "HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"
        );
        assert_eq!(
            encode(ResponseFraming::Chunked, Persistence::Close),
            "HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        );
        assert_eq!(
            encode(ResponseFraming::UntilClose, Persistence::Close),
            "HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
        );
        assert_eq!(
            encode(ResponseFraming::Length(2), Persistence::of(true, Version::HTTP_10)),
            "HTTP/1.1 200 OK\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n",
            "an HTTP/1.0 client is told the connection stays open"
        );
        let date = http_date();
        assert!(httpdate::parse_http_date(&date).is_ok(), "{date}");
        let mut out = Vec::new();
        encode_chunk(&mut out, b"data: {}\n\n");
        encode_chunk(&mut out, b"");
        out.extend_from_slice(LAST_CHUNK);
        assert_eq!(out, b"a\r\ndata: {}\n\n\r\n0\r\n\r\n");
    }

    /// A request head as a client might write it, its Host, framing headers and all, and half
    /// the time one byte overwritten.
    fn request_head() -> impl Strategy<Value = Vec<u8>> {
        let method = prop::sample::select(vec!["GET", "POST", "PUT", "HEAD"]);
        let target =
            prop::sample::select(vec!["/v1/chat/completions", "/v1/models", "/", "http://r/v1/chat/completions?x=1"]);
        let version = prop::sample::select(vec!["HTTP/1.1", "HTTP/1.0"]);
        let header = (
            prop::sample::select(vec![
                "Host",
                "content-length",
                "Content-Length",
                "transfer-encoding",
                "connection",
                "expect",
                "x-backend",
                "x-tenant-id",
                "x-dynamo-worker-instance-id",
                "x-other",
            ]),
            prop::sample::select(vec![
                "0",
                "12",
                "chunked",
                "gzip, chunked",
                "close",
                "keep-alive",
                "100-continue",
                "a b",
                "",
            ]),
        );
        let flip = prop::option::of((any::<prop::sample::Index>(), any::<u8>()));
        (method, target, version, prop::collection::vec(header, 0..8), flip).prop_map(
            |(method, target, version, headers, flip)| {
                // A Host first, as clients send it (the generated ones may add another).
                let headers = std::iter::once(("Host", "r")).chain(headers);
                flipped(head_text(&format!("{method} {target} {version}"), headers), flip)
            },
        )
    }

    /// What a parse came to, comparable across parses.
    fn outcome(parsed: Result<Option<(RequestHead, usize)>, HeadError>) -> Result<Option<String>, HeadError> {
        parsed.map(|head| {
            head.map(|(h, length)| {
                format!("{length} {} {} {:?} {:?} {}", h.method, h.target, h.route, h.body, h.keep_alive)
            })
        })
    }

    proptest! {
        /// A head read in pieces is never refused for where a read ended: every prefix of a head
        /// the server takes whole is incomplete, and bytes after it (a body, the next request)
        /// change nothing about it. Whatever the bytes, parsing never panics.
        #[test]
        fn a_request_head_parses_the_same_whatever_arrives_with_it(
            head in request_head(),
            after in prop::collection::vec(any::<u8>(), 0..32),
        ) {
            let whole = outcome(parse_request(&head));
            let mut followed = head.clone();
            followed.extend_from_slice(&after);
            if let Ok(Some((_, length))) = parse_request(&head) {
                prop_assert_eq!(outcome(parse_request(&followed)), whole.clone());
                for end in 0..length {
                    prop_assert_eq!(outcome(parse_request(&head[..end])), Ok(None), "prefix of {} bytes", end);
                }
            }
        }
    }
}
