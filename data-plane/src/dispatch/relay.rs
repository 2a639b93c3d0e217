//! Relaying a shim's SSE stream to the client frame by frame, never buffering it.
//!
//! The relayed body owns the request's [`DispatchEnd`]: the dispatch ends in the ledger when the
//! stream completes, fails, or is dropped because the client went away. A stream that breaks
//! (the shim's connection fails, or no event arrives for the idle timeout: comments are relayed
//! but are no progress) ends with one SSE error event, so the client always sees an end and
//! never a hang. Frames are relayed as they arrive, so a break can fall inside an event: the
//! error event then starts with a blank line, which ends the broken event first (an extra blank
//! line is no event in SSE), so the error always reaches the client as an event of its own.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use prometheus::IntCounter;
use serde_json::json;
use tokio::time::{Instant, Sleep};

use super::ledger::DispatchEnd;
use super::shim_body::ShimBody;

/// No event from the shim for this long ends a relayed stream with an error event.
pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct RelayBody {
    inner: ShimBody,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    done: bool,
    /// Whether the bytes relayed so far end between two events.
    between_events: bool,
    dispatch: Option<DispatchEnd>,
    /// Counts a stream that broke after it started.
    failures: Option<IntCounter>,
}

impl RelayBody {
    pub fn new(inner: ShimBody, idle: Duration, dispatch: Option<DispatchEnd>, failures: Option<IntCounter>) -> Self {
        let deadline = Box::pin(tokio::time::sleep(idle));
        Self { inner, idle, deadline, done: false, between_events: true, dispatch, failures }
    }

    fn finish(&mut self) {
        self.done = true;
        self.dispatch.take();
    }

    fn fail(&mut self, code: &'static str, message: &str) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.finish();
        if let Some(failures) = &self.failures {
            failures.inc();
        }
        let event = sse_error_event(code, message);
        let event = if self.between_events { event } else { Bytes::from([&b"\n\n"[..], &event].concat()) };
        Poll::Ready(Some(Ok(Frame::data(event))))
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref().filter(|data| !data.is_empty()) {
                    this.between_events = ends_event(data);
                }
                // A keep-alive comment is relayed but is no progress: a stalled engine behind a
                // frontend that sends them would otherwise hold the stream (and its dispatch)
                // forever, and its first one would end the prefill before the first token.
                if frame.data_ref().is_some_and(|data| carries_event(data)) {
                    if let Some(dispatch) = &mut this.dispatch {
                        dispatch.prefilled();
                        if let Some(data) = frame.data_ref() {
                            dispatch.observe(data);
                        }
                    }
                    let next = Instant::now() + this.idle;
                    this.deadline.as_mut().reset(next);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                tracing::warn!(%error, "shim stream failed mid-way");
                this.fail(
                    "stream_interrupted",
                    "The response stream from the model server broke off before it finished. Retry the request.",
                )
            }
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
            Poll::Pending => {
                ready!(this.deadline.as_mut().poll(cx));
                tracing::warn!(idle = ?this.idle, "shim stream idle too long; ending it");
                this.fail(
                    "stream_timeout",
                    "The model server sent nothing for too long and the stream was ended. Retry the request.",
                )
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Whether SSE bytes hold anything but comments (`:` lines) and the blank lines between events.
/// An event split across frames counts in each of its pieces.
fn carries_event(data: &[u8]) -> bool {
    data.split(|b| *b == b'\n').any(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        line.first().is_some_and(|first| *first != b':')
    })
}

/// Whether SSE bytes end with the blank line that closes an event. Unsure (a line ending split
/// across frames) reads as not: the error event's leading blank line is harmless either way.
fn ends_event(data: &[u8]) -> bool {
    [&b"\n\n"[..], b"\r\n\r\n", b"\n\r\n", b"\r\r"].iter().any(|end| data.ends_with(end))
}

/// One SSE event carrying an OpenAI-shaped error, as streaming clients expect mid-stream.
pub fn sse_error_event(code: &str, message: &str) -> Bytes {
    let error = json!({"error": {"message": message, "type": "server_error", "code": code}});
    Bytes::from(format!("data: {error}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::{carries_event, ends_event};

    #[test]
    fn an_event_ends_at_a_blank_line_and_nowhere_else() {
        for closed in [&b"data: {}\n\n"[..], b"data: {}\r\n\r\n", b":\n\n", b"\n\n", b"data: x\r\r"] {
            assert!(ends_event(closed), "{:?}", String::from_utf8_lossy(closed));
        }
        for open in [&b"data: {\"choices\":[{\"ind"[..], b"data: {}\n", b"data: {}\r\n", b"\n", b"data: {}\r"] {
            assert!(!ends_event(open), "{:?}", String::from_utf8_lossy(open));
        }
    }

    #[test]
    fn only_comments_and_blank_lines_are_no_event() {
        for quiet in [&b":\n\n"[..], b": keep-alive\r\n\r\n", b"", b"\n", b":\n\n:\n\n"] {
            assert!(!carries_event(quiet), "{:?}", String::from_utf8_lossy(quiet));
        }
        for event in [&b"data: {}\n\n"[..], b":\n\ndata: [DONE]\n\n", b"\"}]}\n\n", b"event: error\r\n"] {
            assert!(carries_event(event), "{:?}", String::from_utf8_lossy(event));
        }
    }
}
