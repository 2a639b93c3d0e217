//! A shim response's body, read off its connection as the consumer polls it (frame by frame for
//! a stream, never buffered here). Once the body has been read to its end the connection goes
//! back to the idle set for reuse; a body dropped before its end closes its connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::http::uri::Authority;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio_util::io::poll_read_buf;

use super::connections::{Conn, IdleConnections, READ_CHUNK};
use super::wire::{Chunked, Decoded, Framing, WireError};

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("reading the shim's response body failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the shim closed the connection {0} bytes short of the response body")]
    Truncated(u64),
    #[error("the shim closed the connection in the middle of a chunked response body")]
    ChunkedTruncated,
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Where a connection returns once its body is read. The authority is the request URI's own,
/// shared: naming it costs no allocation.
#[derive(Debug)]
pub struct Return {
    pub idle: Arc<IdleConnections>,
    pub authority: Authority,
}

#[derive(Debug)]
enum Left {
    Length(u64),
    Chunked(Chunked),
    UntilClose,
    Done,
}

#[derive(Debug)]
pub struct ShimBody {
    conn: Option<Conn>,
    left: Left,
    /// `None` once the connection may not be reused (the shim asked to close it).
    back: Option<Return>,
}

impl ShimBody {
    /// The body that follows a head framed as `framing` on `conn`, whose read buffer holds the
    /// bytes already read past the head.
    pub fn new(conn: Conn, framing: Framing, back: Option<Return>) -> Self {
        let left = match framing {
            Framing::Length(0) => Left::Done,
            Framing::Length(length) => Left::Length(length),
            Framing::Chunked => Left::Chunked(Chunked::default()),
            Framing::UntilClose => Left::UntilClose,
        };
        let back = back.filter(|_| framing != Framing::UntilClose);
        let mut body = Self { conn: Some(conn), left, back };
        if matches!(body.left, Left::Done) {
            body.finish();
        }
        body
    }

    /// The body has been read to its end: its connection is kept for reuse when it may be.
    fn finish(&mut self) {
        self.left = Left::Done;
        if let (Some(conn), Some(back)) = (self.conn.take(), self.back.take()) {
            back.idle.put(back.authority.as_str(), conn, Instant::now());
        }
    }

    /// Reads more of the body into the connection's buffer; `Ready(Ok(0))` at the close.
    fn poll_more(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, BodyError>> {
        let Some(conn) = self.conn.as_mut() else { return Poll::Ready(Ok(0)) };
        if conn.read.capacity() - conn.read.len() < READ_CHUNK / 4 {
            conn.read.reserve(READ_CHUNK);
        }
        poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.read).map_err(BodyError::Io)
    }

    fn next_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            let Some(conn) = self.conn.as_mut() else { return Poll::Ready(None) };
            match &mut self.left {
                Left::Done => return Poll::Ready(None),
                Left::Length(left) if !conn.read.is_empty() => {
                    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(conn.read.len());
                    let data = conn.read.split_to(n).freeze();
                    *left -= n as u64;
                    if *left == 0 {
                        self.finish();
                    }
                    return Poll::Ready(Some(Ok(data)));
                }
                Left::UntilClose if !conn.read.is_empty() => {
                    return Poll::Ready(Some(Ok(conn.read.split().freeze())));
                }
                Left::Chunked(decoder) => match decoder.decode(&mut conn.read) {
                    Err(error) => return Poll::Ready(Some(Err(error.into()))),
                    Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(data))),
                    Ok(Decoded::End) => {
                        // Anything past the body's end makes the connection unusable.
                        if !conn.read.is_empty() {
                            self.back = None;
                        }
                        self.finish();
                        return Poll::Ready(None);
                    }
                    Ok(Decoded::More) => {}
                },
                Left::Length(_) | Left::UntilClose => {}
            }
            let read = std::task::ready!(self.poll_more(cx));
            match (read, &self.left) {
                (Err(error), _) => return Poll::Ready(Some(Err(error))),
                (Ok(0), Left::UntilClose) => {
                    self.left = Left::Done;
                    self.conn = None;
                    return Poll::Ready(None);
                }
                (Ok(0), Left::Length(left)) => return Poll::Ready(Some(Err(BodyError::Truncated(*left)))),
                (Ok(0), Left::Chunked(_)) => return Poll::Ready(Some(Err(BodyError::ChunkedTruncated))),
                (Ok(_), _) => {}
            }
        }
    }
}

impl Body for ShimBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let frame = std::task::ready!(this.next_frame(cx));
        if let Some(Err(_)) = &frame {
            // A body that failed leaves its connection in an unknown state.
            this.left = Left::Done;
            this.conn = None;
            this.back = None;
        }
        Poll::Ready(frame.map(|f| f.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.left, Left::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.left {
            Left::Length(left) => SizeHint::with_exact(left),
            Left::Done => SizeHint::with_exact(0),
            Left::Chunked(_) | Left::UntilClose => SizeHint::default(),
        }
    }
}
