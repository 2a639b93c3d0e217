//! HTTP/1.1 as the shim client speaks it, as pure functions over bytes: a request written in
//! one buffer (head and body, so it leaves in one write), a response head parsed with its body
//! framing, and a chunked-body decoder that works on whatever part of the body has arrived.
//!
//! Only what a `dynamo.frontend` (a hyper server) sends needs reading: `Content-Length` or
//! chunked bodies, a body running to the close otherwise, and no body where HTTP says so.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use bytes::{Buf, Bytes, BytesMut};

use crate::routing::headers::{Pins, is_routing_header};

/// The most headers a response head may carry.
pub const MAX_HEADERS: usize = 64;
/// The largest response head accepted.
pub const MAX_HEAD_BYTES: usize = 64 << 10;
/// The longest chunk-size line (size, extensions) or trailer line accepted.
const MAX_CHUNK_LINE_BYTES: usize = 4 << 10;
/// A chunked body's trailer section, at most.
const MAX_TRAILER_BYTES: usize = 8 << 10;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("the response head is larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("malformed chunked body: {0}")]
    Chunk(&'static str),
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Exactly this many bytes follow (zero: no body at all).
    Length(u64),
    Chunked,
    /// The body runs until the shim closes the connection.
    UntilClose,
}

/// Response headers a client may see: the content's type and caching, and the pace a refusal
/// (a 429) asks for. The rest (hop-by-hop, `server`, `date`, anything a frontend adds) are read
/// for the framing and dropped at the parse, so a relayed response never carries them.
pub const RELAYED_HEADERS: [HeaderName; 3] = [CONTENT_TYPE, CACHE_CONTROL, RETRY_AFTER];

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    /// Only the [`RELAYED_HEADERS`].
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request once this body is read.
    pub keep_alive: bool,
}

/// Writes `method uri` with `headers`, `pins` and `body` into `out`: the origin-form target,
/// `host` from the URI, and `content-length` whenever a body is sent. Header hygiene applies
/// here, just before dispatch: of `headers`, no routing header is written, so the pins are
/// the only ones that can leave.
pub fn encode_request(out: &mut Vec<u8>, method: &Method, uri: &Uri, headers: &HeaderMap, pins: Pins, body: &[u8]) {
    out.reserve(256 + body.len());
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(uri.authority().map_or("", |a| a.as_str()).as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if is_framing_header(name) || is_routing_header(name.as_str()) {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let mut decimal = itoa::Buffer::new();
    for (name, value) in pins.iter() {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(decimal.format(value).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || *method == Method::POST {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(decimal.format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
}

/// Headers the client owns: the body's framing and the connection's persistence.
fn is_framing_header(name: &HeaderName) -> bool {
    use axum::http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
    [HOST, CONTENT_LENGTH, TRANSFER_ENCODING, CONNECTION].contains(name)
}

/// Whether a head read into `buf`, of which the first `scanned` bytes were there at the last
/// parse, is worth parsing again: its end (a blank line) has arrived since, or it is past `max`
/// bytes, to be refused. Parsing the whole buffer on every read would cost a head sent a byte
/// at a time quadratic work, about 2 GB of scanning for 64 KiB.
pub(crate) fn head_due(buf: &[u8], scanned: usize, max: usize) -> bool {
    buf.len() > max || holds_blank_line(&buf[scanned.saturating_sub(2).min(buf.len())..])
}

/// Whether `bytes` hold a line feed, an optional carriage return and another line feed
/// (httparse takes bare line feeds too). It stops at the first: a read usually carries the head
/// and the body behind it, and only the head's few hundred bytes need looking at.
fn holds_blank_line(bytes: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', bytes).any(|at| matches!(&bytes[at + 1..], [b'\n', ..] | [b'\r', b'\n', ..]))
}

/// The response head at the start of `buf` and its length, or `None` while it is incomplete.
/// Informational (1xx) heads are skipped: the length covers them too.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, WireError> {
    let mut offset = 0;
    loop {
        let Some(rest) = buf.get(offset..) else { return Ok(None) };
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut slots);
        let length = match response.parse(rest) {
            // Whole or not, no head (and the interim ones before it) is taken past the bound.
            Ok(httparse::Status::Complete(length)) if offset + length > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge);
            }
            Ok(httparse::Status::Complete(length)) => length,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => return Err(WireError::HeadTooLarge),
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(error) => return Err(WireError::Head(error.to_string())),
        };
        let code = response.code.unwrap_or(0);
        let status = StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
        // RFC 9110 §15.2.2: a 101 answers only a request that asked to upgrade, which no
        // request of the data plane's does; past it the connection speaks another protocol, so
        // it is no answer and must never go back to the pool.
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(WireError::Head("101 Switching Protocols, to a request that asked for no upgrade".into()));
        }
        if status.is_informational() {
            offset += length;
            continue;
        }
        let raw = &*response.headers;
        let mut headers = HeaderMap::new();
        for name in RELAYED_HEADERS {
            for value in values(raw, name.as_str()) {
                let value =
                    HeaderValue::from_bytes(value).map_err(|_| WireError::Head(format!("value of header {name}")))?;
                headers.append(name.clone(), value);
            }
        }
        let framing = framing(status, raw)?;
        let keep_alive = response.version == Some(1) && !has_token(raw, "connection", "close");
        return Ok(Some((Head { status, headers, framing, keep_alive }, offset + length)));
    }
}

/// RFC 9112 §6.3: no body for 204 and 304; chunked with `Transfer-Encoding`; else the one
/// `Content-Length`; else until the close. The data plane asks for no transfer coding (it
/// sends no `TE`), so `chunked` alone may come back (§7), and never beside a `Content-Length`,
/// which §6.3 has a client handle as an error: a body it cannot decode, or frames two ways,
/// fails the exchange rather than reach the client still encoded.
fn framing(status: StatusCode, raw: &[httparse::Header<'_>]) -> Result<Framing, WireError> {
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Length(0));
    }
    if let Some(codings) = transfer_codings(raw) {
        if !codings.only_chunked() {
            return Err(WireError::Head("a transfer coding other than chunked".into()));
        }
        if values(raw, "content-length").next().is_some() {
            return Err(WireError::Head("both transfer-encoding and content-length".into()));
        }
        return Ok(Framing::Chunked);
    }
    match content_length(raw) {
        Ok(Some(length)) => Ok(Framing::Length(length)),
        Ok(None) => Ok(Framing::UntilClose),
        Err(LengthError::NotANumber | LengthError::TooLarge) => Err(WireError::Head("content-length".into())),
        Err(LengthError::Conflicting) => Err(WireError::Head("conflicting content-length values".into())),
    }
}

/// What a head's `Transfer-Encoding` lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Codings {
    /// Whether the final coding is `chunked` (an empty last item, `chunked,`, is not).
    pub final_chunked: bool,
    /// How many codings are listed, over every `Transfer-Encoding` line.
    pub listed: usize,
}

impl Codings {
    /// `chunked` alone: the one coding this proxy decodes.
    pub fn only_chunked(self) -> bool {
        self.final_chunked && self.listed == 1
    }
}

/// The transfer codings a head lists; `None` without `Transfer-Encoding`. Requests and
/// responses alike are framed by the final coding; empty list items are ignored (RFC 9110
/// §5.6.1).
pub(crate) fn transfer_codings(raw: &[httparse::Header<'_>]) -> Option<Codings> {
    let last = values(raw, "transfer-encoding").next_back()?;
    let last = last.rsplit(|b| *b == b',').next().unwrap_or_default();
    Some(Codings {
        final_chunked: last.trim_ascii().eq_ignore_ascii_case(b"chunked"),
        listed: listed_codings(raw).count(),
    })
}

/// The transfer codings a head lists, over every `Transfer-Encoding` line, trimmed; empty list
/// items left out.
pub(crate) fn listed_codings<'h>(raw: &'h [httparse::Header<'_>]) -> impl Iterator<Item = &'h [u8]> {
    let items = values(raw, "transfer-encoding").flat_map(|v| v.split(|b| *b == b','));
    items.map(<[u8]>::trim_ascii).filter(|c| !c.is_empty())
}

/// Why a head's `Content-Length` cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LengthError {
    NotANumber,
    /// All digits, past what 64 bits hold.
    TooLarge,
    Conflicting,
}

/// A head's one `Content-Length` (`None` without one). Values must be plain digits, and
/// repeated values must agree: a length read two ways is how requests get smuggled.
pub(crate) fn content_length(raw: &[httparse::Header<'_>]) -> Result<Option<u64>, LengthError> {
    let parse = |v: &[u8]| {
        let digits = v.trim_ascii();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return Err(LengthError::NotANumber);
        }
        // Summed by hand: the bytes are digits already, and `str::parse` would check them
        // again after a UTF-8 check that costs more than the sum.
        digits
            .iter()
            .try_fold(0u64, |sum, digit| sum.checked_mul(10)?.checked_add(u64::from(digit - b'0')))
            .ok_or(LengthError::TooLarge)
    };
    let mut lengths = values(raw, "content-length");
    let Some(first) = lengths.next() else { return Ok(None) };
    let length = parse(first)?;
    if lengths.any(|other| parse(other) != Ok(length)) {
        return Err(LengthError::Conflicting);
    }
    Ok(Some(length))
}

/// The values of every header named `name` (case-insensitively), in order.
pub(crate) fn values<'h>(raw: &'h [httparse::Header<'_>], name: &'h str) -> impl DoubleEndedIterator<Item = &'h [u8]> {
    raw.iter().filter(move |h| h.name.eq_ignore_ascii_case(name)).map(|h| h.value)
}

/// Whether a comma-separated header `name` lists `token` (case-insensitively).
pub(crate) fn has_token(raw: &[httparse::Header<'_>], name: &str, token: &str) -> bool {
    values(raw, name)
        .flat_map(|v| v.split(|b| *b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// What the chunked decoder could make of the bytes so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// The body (trailers included) is complete.
    End,
    /// More bytes are needed.
    More,
}

/// A chunked-body decoder. It consumes from the front of the buffer it is given and leaves
/// whatever follows the body (nothing, on a well-behaved connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunked {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    /// The trailer section, and how many of its bytes have been read.
    Trailers(usize),
    Done,
}

impl Chunked {
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        loop {
            match *self {
                Chunked::Done => return Ok(Decoded::End),
                Chunked::Size => {
                    let Some(line) = take_line(buf)? else { return Ok(Decoded::More) };
                    let size = chunk_size(&line).ok_or(WireError::Chunk("chunk size"))?;
                    *self = if size == 0 { Chunked::Trailers(0) } else { Chunked::Data(size) };
                }
                Chunked::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::More);
                    }
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let data = buf.split_to(n).freeze();
                    let left = left - n as u64;
                    *self = if left == 0 { Chunked::DataEnd } else { Chunked::Data(left) };
                    return Ok(Decoded::Data(data));
                }
                Chunked::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::Chunk("chunk not followed by CRLF"));
                    }
                    buf.advance(2);
                    *self = Chunked::Size;
                }
                Chunked::Trailers(read) => {
                    let Some(line) = take_line(buf)? else { return Ok(Decoded::More) };
                    if line.is_empty() {
                        *self = Chunked::Done;
                        continue;
                    }
                    let read = read + line.len() + 2;
                    if read > MAX_TRAILER_BYTES {
                        return Err(WireError::Chunk("trailers too long"));
                    }
                    if line.iter().any(|b| is_forbidden_in_line(*b)) {
                        return Err(WireError::Chunk("control byte in a trailer"));
                    }
                    // A field, `name:` with the name a token, as strictly as a head's: a hop in
                    // front that ended the body at the last chunk would read a line that is
                    // no field (a request line, a folded line) as the next request's.
                    if !is_field_line(&line) {
                        return Err(WireError::Chunk("malformed trailer field"));
                    }
                    *self = Chunked::Trailers(read);
                }
            }
        }
    }
}

/// Whether a trailer line is a header field: a token, then `:` (RFC 9110 5.1, 5.6.2).
fn is_field_line(line: &[u8]) -> bool {
    let name_len = line.iter().position(|b| *b == b':').unwrap_or(0);
    name_len > 0 && line[..name_len].iter().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b))
}

/// A chunk-size line's size: hex digits, at most 16 past any leading zeros (which RFC 9112
/// allows however many), then nothing, or white space and `;` extensions. Anything looser (a sign, leading white space, a bare CR or LF, another control
/// byte) is refused: a hop in front that split or read the line otherwise would see other chunk
/// boundaries than this decoder, and could be handed a smuggled request.
fn chunk_size(line: &[u8]) -> Option<u64> {
    if line.iter().any(|b| is_forbidden_in_line(*b)) {
        return None;
    }
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let (digits, rest) = line.split_at(digits);
    let significant = &digits[digits.iter().take_while(|b| **b == b'0').count()..];
    if digits.is_empty() || significant.len() > 16 {
        return None;
    }
    if !matches!(rest.trim_ascii_start().first(), None | Some(b';')) {
        return None;
    }
    match significant {
        [] => Some(0),
        _ => u64::from_str_radix(std::str::from_utf8(significant).ok()?, 16).ok(),
    }
}

/// A control byte other than horizontal tab, which no chunk line or trailer may hold.
fn is_forbidden_in_line(byte: u8) -> bool {
    byte.is_ascii_control() && byte != b'\t'
}

/// One CRLF-terminated line off the front of `buf` (without its CRLF), or `None` if it has not
/// all arrived.
fn take_line(buf: &mut BytesMut) -> Result<Option<Bytes>, WireError> {
    // A line is refused past the bound however the reads split it: only its first bytes are
    // searched for the CRLF.
    let searched = &buf[..buf.len().min(MAX_CHUNK_LINE_BYTES + 2)];
    match searched.windows(2).position(|w| w == b"\r\n") {
        Some(end) => {
            let line = buf.split_to(end).freeze();
            buf.advance(2);
            Ok(Some(line))
        }
        None if searched.len() == MAX_CHUNK_LINE_BYTES + 2 => Err(WireError::Chunk("line too long")),
        None => Ok(None),
    }
}

/// What the framing property tests feed the parsers: `text` with one byte overwritten when
/// `flip` says, the index taken within the text.
#[cfg(test)]
pub(crate) fn flipped(text: impl Into<Vec<u8>>, flip: Option<(proptest::sample::Index, u8)>) -> Vec<u8> {
    let mut bytes = text.into();
    if let Some((at, byte)) = flip {
        let at = at.index(bytes.len());
        bytes[at] = byte;
    }
    bytes
}

/// A head's text: its first line, its headers, and the blank line that ends it.
#[cfg(test)]
pub(crate) fn head_text<'a>(first_line: &str, headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut head = format!("{first_line}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head
}

#[cfg(test)]
mod tests {
    use continuum_proto::model::WorkerKey;
    use proptest::prelude::*;

    use super::*;
    use crate::routing::headers::pins;
    use crate::routing::picker::{Pin, Reason, Selection};

    fn head(text: &str) -> (Head, usize) {
        parse_head(text.as_bytes()).unwrap().unwrap()
    }

    #[test]
    fn a_head_is_due_once_a_blank_line_arrives_even_across_reads() {
        // (buffer, bytes there at the last parse, due)
        let rows: [(&[u8], usize, bool); 10] = [
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", 0, true),
            (b"HTTP/1.1 200 OK\ncontent-length: 2\n\nok", 0, true),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\n\r\n", 0, true),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n", 0, false),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r", 0, false),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\n", 0, false),
            // The end split over two reads: the last parse saw up to "\r\n\r" or "\r\n".
            (b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n", 24, true),
            (b"HTTP/1.1 200 OK\r\nx: 1\r\n\r\n", 23, true),
            (b"HTTP/1.1 200 OK\nx: 1\n\n", 22, true),
            // A blank line wholly before what the last parse saw is not news.
            (b"a\r\n\r\nbcdefgh", 10, false),
        ];
        for (i, (buf, scanned, due)) in rows.into_iter().enumerate() {
            assert_eq!(head_due(buf, scanned, 64), due, "row {i}: {:?} from {scanned}", String::from_utf8_lossy(buf));
        }
        // Past the bound, due whatever it holds, so that it is refused.
        assert!(head_due(b"0123456789", 10, 8));
    }

    #[test]
    fn a_request_goes_out_in_origin_form_with_its_length_and_without_client_framing() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("x-dynamo-worker-instance-id", HeaderValue::from_static("7"));
        headers.insert("content-length", HeaderValue::from_static("999"));
        headers.insert("connection", HeaderValue::from_static("close"));
        headers.insert("x-worker-instance-id", HeaderValue::from_static("8"));
        let uri: Uri = "http://10.0.0.1:8000/v1/chat/completions".parse().unwrap();
        let mut out = Vec::new();
        let pin = |id| Pin { worker: WorkerKey::new("dynamo", id), dp_rank: None };
        let selection = Selection {
            namespace: "dynamo".into(),
            model: "tiny".into(),
            decode: pin(5),
            prefill: Some(pin(6)),
            decode_reason: Reason::Load,
            prefill_reason: Reason::Load,
            cached_tokens: 0,
        };
        encode_request(&mut out, &Method::POST, &uri, &headers, pins(&selection), b"{}");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.1:8000\r\ncontent-type: application/json\r\n\
             x-dynamo-worker-instance-id: 5\r\nx-dynamo-prefill-instance-id: 6\r\ncontent-length: 2\r\n\r\n{}",
            "the pins are the only routing headers written"
        );
        let mut out = Vec::new();
        encode_request(
            &mut out,
            &Method::GET,
            &"http://h/live".parse().unwrap(),
            &HeaderMap::new(),
            Pins::default(),
            b"",
        );
        assert_eq!(String::from_utf8(out).unwrap(), "GET /live HTTP/1.1\r\nhost: h\r\n\r\n");
    }

    #[test]
    fn heads_are_read_whole_with_their_framing() {
        assert!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        let text = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: a/b\r\ndate: x\r\nx-dynamo-worker-instance-id: 7\r\n\r\nhello";
        let (h, n) = head(text);
        assert_eq!((h.status, h.framing, h.keep_alive, n), (StatusCode::OK, Framing::Length(5), true, text.len() - 5));
        assert_eq!(h.headers.keys().collect::<Vec<_>>(), ["content-type"], "only relayable headers are kept");
        assert_eq!(h.headers["content-type"], "a/b");
        assert_eq!(head("HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n").0.framing, Framing::Chunked);
        // Nothing but `chunked` was asked for, and a body framed two ways is no body.
        for refused in [
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
        ] {
            assert!(matches!(parse_head(refused.as_bytes()), Err(WireError::Head(_))), "{refused:?}");
        }
        assert_eq!(head("HTTP/1.1 200 OK\r\n\r\n").0.framing, Framing::UntilClose);
        assert_eq!(head("HTTP/1.1 204 No Content\r\n\r\n").0.framing, Framing::Length(0));
        assert!(!head("HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\n\r\n").0.keep_alive);
        assert!(!head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n").0.keep_alive);
        let text = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n";
        let (h, n) = head(text);
        assert_eq!((h.status, n), (StatusCode::SERVICE_UNAVAILABLE, text.len()));
    }

    #[test]
    fn malformed_heads_are_refused_and_say_why() {
        let bad = |text: &str| parse_head(text.as_bytes()).unwrap_err().to_string();
        assert!(bad("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n").contains("content-length"));
        assert!(bad("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n").contains("conflicting"));
        assert!(bad("SMTP ready\r\n\r\n").contains("malformed"));
        assert!(bad("HTTP/1.1 101 Switching Protocols\r\ncontent-length: 0\r\n\r\n").contains("upgrade"));
        let endless = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(parse_head(endless.as_bytes()).unwrap_err(), WireError::HeadTooLarge);
        let whole = format!("{endless}\r\n\r\n");
        assert_eq!(parse_head(whole.as_bytes()).unwrap_err(), WireError::HeadTooLarge, "whole in one read, too");
    }

    #[test]
    fn a_chunked_body_decodes_from_any_split() {
        let wire = b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\ntrailer: x\r\n\r\nNEXT";
        for split in 0..wire.len() {
            let mut decoder = Chunked::default();
            let mut buf = BytesMut::from(&wire[..split]);
            let mut body = Vec::new();
            let mut fed = false;
            loop {
                match decoder.decode(&mut buf).unwrap() {
                    Decoded::Data(data) => body.extend_from_slice(&data),
                    Decoded::End => {
                        if !fed {
                            buf.extend_from_slice(&wire[split..]);
                        }
                        break;
                    }
                    Decoded::More => {
                        assert!(!fed, "split {split}: stalled with everything fed");
                        buf.extend_from_slice(&wire[split..]);
                        fed = true;
                    }
                }
            }
            assert_eq!(body, b"hello world!", "split {split}");
            assert_eq!(&buf[..], b"NEXT", "split {split}: what follows the body is left");
        }
    }

    #[test]
    fn a_broken_chunked_body_is_refused() {
        let decode = |wire: &[u8]| {
            let mut decoder = Chunked::default();
            let mut buf = BytesMut::from(wire);
            loop {
                match decoder.decode(&mut buf) {
                    Ok(Decoded::Data(_)) => {}
                    other => return other,
                }
            }
        };
        assert_eq!(decode(b"zz\r\n"), Err(WireError::Chunk("chunk size")));
        assert_eq!(decode(b"2\r\nabc\r\n"), Err(WireError::Chunk("chunk not followed by CRLF")));
        assert_eq!(decode(b"11111111111111111\r\n"), Err(WireError::Chunk("chunk size")));
        assert_eq!(decode(b"\r\n"), Err(WireError::Chunk("chunk size")), "no digit at all");
        assert_eq!(decode(&[b'1'; MAX_CHUNK_LINE_BYTES + 2]), Err(WireError::Chunk("line too long")));
        // Refused as well when the whole line, CRLF and all, came in one read.
        let mut long_extension = b"1;".to_vec();
        long_extension.extend(std::iter::repeat_n(b'a', 6000));
        long_extension.extend_from_slice(b"\r\nX\r\n0\r\n\r\n");
        assert_eq!(decode(&long_extension), Err(WireError::Chunk("line too long")));
        // Size lines another hop could split or read otherwise.
        for loose in
            [&b"+5\r\nhello\r\n"[..], b" 5\r\nhello\r\n", b"5;\nXX\r\nhello\r\n", b"5\x0b\r\nhello\r\n", b"5 x\r\n"]
        {
            assert_eq!(decode(loose), Err(WireError::Chunk("chunk size")), "{:?}", String::from_utf8_lossy(loose));
        }
        assert_eq!(decode(b"0\r\nx: a\nb\r\n\r\n"), Err(WireError::Chunk("control byte in a trailer")));
        // Lines that are no field: a request line a hop in front would take for the next
        // request, a folded line, a field name with a space before its colon.
        for loose in
            [&b"0\r\nGET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"[..], b"0\r\n x: folded\r\n\r\n", b"0\r\nx : a\r\n\r\n"]
        {
            let refused = decode(loose);
            assert_eq!(
                refused,
                Err(WireError::Chunk("malformed trailer field")),
                "{:?}",
                String::from_utf8_lossy(loose)
            );
        }
        assert_eq!(decode(b"0\r\nx-checksum: abc\r\n\r\n"), Ok(Decoded::End), "a field is a trailer");
        let mut many_trailers = b"0\r\n".to_vec();
        for _ in 0..1000 {
            many_trailers.extend_from_slice(b"x-trailer: 12345678\r\n");
        }
        assert_eq!(decode(&many_trailers), Err(WireError::Chunk("trailers too long")));
    }

    /// Leading zeros count for nothing (RFC 9112 allows any number of them): only the
    /// significant digits are held to 16.
    #[test]
    fn chunk_sizes_with_leading_zeros_are_read() {
        let mut decoder = Chunked::default();
        let mut buf = BytesMut::from(&b"000000000000000000005\r\nhello\r\n00000000000000000000\r\n\r\n"[..]);
        assert_eq!(decoder.decode(&mut buf), Ok(Decoded::Data(Bytes::from_static(b"hello"))));
        assert_eq!(decoder.decode(&mut buf), Ok(Decoded::End));
    }

    #[test]
    fn chunk_extensions_and_trailers_within_bounds_are_read_past() {
        for wire in [
            &b"5;name=value\r\nhello\r\n0\r\n\r\n"[..],
            b"5 ;x\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n",
            b"5\t;x\r\nhello\r\n0\r\n\r\n",
        ] {
            let mut decoder = Chunked::default();
            let mut buf = BytesMut::from(wire);
            assert_eq!(decoder.decode(&mut buf), Ok(Decoded::Data(Bytes::from_static(b"hello"))));
            assert_eq!(decoder.decode(&mut buf), Ok(Decoded::End), "{:?}", String::from_utf8_lossy(wire));
        }
    }

    /// A chunked body as a shim might frame it: the chunks, each size line with or without an
    /// extension, and a trailer or not; then, half the time, one byte overwritten.
    fn chunked_wire() -> impl Strategy<Value = Vec<u8>> {
        let chunk = (prop::collection::vec(any::<u8>(), 1..40), any::<bool>());
        (
            prop::collection::vec(chunk, 0..6),
            any::<bool>(),
            prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
        )
            .prop_map(|(chunks, trailer, flip)| {
                let mut wire = Vec::new();
                for (data, extension) in chunks {
                    wire.extend_from_slice(
                        format!("{:x}{}\r\n", data.len(), if extension { ";x=1" } else { "" }).as_bytes(),
                    );
                    wire.extend_from_slice(&data);
                    wire.extend_from_slice(b"\r\n");
                }
                wire.extend_from_slice(if trailer { &b"0\r\nx-sum: 1\r\n\r\n"[..] } else { b"0\r\n\r\n" });
                flipped(wire, flip)
            })
    }

    /// Feeds `pieces` one after another, decoding all it can after each: the body's bytes, and
    /// whether it ended (`Ok(true)`), wants more (`Ok(false)`) or was refused.
    fn decode_pieces(pieces: &[&[u8]]) -> (Vec<u8>, Result<bool, WireError>) {
        let (mut decoder, mut buf, mut body) = (Chunked::default(), BytesMut::new(), Vec::new());
        for piece in pieces {
            buf.extend_from_slice(piece);
            loop {
                match decoder.decode(&mut buf) {
                    Ok(Decoded::Data(data)) => body.extend_from_slice(&data),
                    Ok(Decoded::More) => break,
                    Ok(Decoded::End) => return (body, Ok(true)),
                    Err(error) => return (body, Err(error)),
                }
            }
        }
        (body, Ok(false))
    }

    /// A shim's response head, after as many informational heads, and half the time one byte
    /// overwritten.
    fn response_head() -> impl Strategy<Value = Vec<u8>> {
        let status = prop::sample::select(vec!["200 OK", "204 No Content", "400 Bad Request", "500 Oops", "503 x"]);
        let header = (
            prop::sample::select(vec![
                "content-length",
                "Transfer-Encoding",
                "connection",
                "content-type",
                "x-dynamo-x",
            ]),
            prop::sample::select(vec!["0", "12", "chunked", "gzip", "close", "application/json", ""]),
        );
        let flip = prop::option::of((any::<prop::sample::Index>(), any::<u8>()));
        (0..3usize, status, prop::collection::vec(header, 0..6), flip).prop_map(
            |(informational, status, headers, flip)| {
                let head = "HTTP/1.1 100 Continue\r\n\r\n".repeat(informational);
                flipped(head + &head_text(&format!("HTTP/1.1 {status}"), headers), flip)
            },
        )
    }

    proptest! {
        /// A shim's head read in pieces is never refused for where a read ended, and the body
        /// bytes after it change nothing about it.
        #[test]
        fn a_response_head_parses_the_same_whatever_arrives_with_it(
            head in response_head(),
            after in prop::collection::vec(any::<u8>(), 0..32),
        ) {
            let outcome = |parsed: Result<Option<(Head, usize)>, WireError>| {
                parsed.map(|h| h.map(|(h, n)| format!("{n} {} {:?} {:?} {}", h.status, h.headers, h.framing, h.keep_alive)))
            };
            if let Ok(Some((_, length))) = parse_head(&head) {
                let mut followed = head.clone();
                followed.extend_from_slice(&after);
                prop_assert_eq!(outcome(parse_head(&followed)), outcome(parse_head(&head)));
                for end in 0..length {
                    prop_assert_eq!(outcome(parse_head(&head[..end])), Ok(None), "prefix of {} bytes", end);
                }
            }
        }

        /// However a shim's bytes are split across reads, the decoder reads the same body and
        /// comes to the same end: accepted, incomplete, or refused. It never panics.
        #[test]
        fn a_chunked_body_reads_the_same_whatever_the_split(
            wire in chunked_wire(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        ) {
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([wire.len()]) {
                pieces.push(&wire[from..cut]);
                from = cut;
            }
            let (whole_body, whole_end) = decode_pieces(&[&wire]);
            let (split_body, split_end) = decode_pieces(&pieces);
            prop_assert_eq!(&split_body, &whole_body);
            prop_assert_eq!(split_end.is_ok(), whole_end.is_ok());
            prop_assert_eq!(split_end.ok(), whole_end.ok());
            prop_assert!(whole_body.len() <= wire.len());
        }
    }
}
