//! Relaying a shim's SSE stream to the client event by event, as its frames arrive.
//!
//! The relayed body owns the request's [`DispatchEnd`]: the dispatch ends in the ledger when the
//! stream completes, fails, or is dropped because the client went away. A stream that breaks
//! (the shim's connection fails, or no event arrives for the idle timeout: comments are relayed
//! but are no progress) ends with one SSE error event, so the client always sees an end and
//! never a hang.
//!
//! Only whole events reach the client. A frame is relayed up to its last blank line at once,
//! without a copy; what follows (the start of an event the next frame finishes) waits for the
//! rest of its event, [`MAX_PARTIAL_EVENT_BYTES`] at most, and past what a small body holds free
//! charged to the process's budget for buffered answers (`crate::memory`): thousands of streams
//! each holding a large unfinished event would otherwise hold gigabytes that no bound counts. In
//! SSE a blank line delivers whatever
//! data came before it, so a break relayed mid-event could only be followed by the broken
//! event's half, delivered as an event of its own (invalid JSON, which OpenAI's clients fail on
//! before they read the error after it). Held back, the half is never sent.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use continuum_proto::warn_limited;
use http_body::{Body, Frame, SizeHint};
use prometheus::{Histogram, IntCounter};
use serde_json::json;
use tokio::time::{Instant, Sleep};

use super::breaker::ShimExchange;
use super::disclosure::{relayable, text_names_an_address};
use super::ledger::DispatchEnd;
use super::shim_body::ShimBody;
use crate::memory::{BUFFERED_ANSWERS, Charge, append_charged};

/// No event from the shim for this long ends a relayed stream with an error event.
pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The most of one unfinished event held back until its end arrives: an event past it breaks
/// the stream (no engine sends one; the usual are a few hundred bytes).
pub const MAX_PARTIAL_EVENT_BYTES: usize = 1 << 20;

/// How long a stream that sent its closing `[DONE]` may take to end its body (the last chunk,
/// or the close): past it, the client's answer is ended as whole and the shim's connection
/// dropped. Nothing after the marker is for the client, who would otherwise wait the whole
/// idle timeout on a shim (or a proxy in front of it) holding the end back.
pub const AFTER_DONE_GRACE: Duration = Duration::from_secs(1);

/// Whose failure a broken stream is.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// An error event in the stream, or an event past the bound: what the engine behind the
    /// pins did.
    Workers,
    /// No event for the idle timeout: the workers' failure only if they answered nothing else
    /// meanwhile, as for a head that never came ([`DispatchEnd::timed_out`]).
    Silent,
    /// The connection under the stream broke, or closed inside an event: the shim replica's
    /// failure (or the network's). 1.6.1 says a worker's death in band.
    Shim,
    /// The replica had no room to hold an unfinished event: its own load, no one's failure.
    Overloaded,
}

/// The process's budget had no room for an unfinished event's bytes.
#[derive(Debug)]
struct NoRoom;

#[derive(Debug)]
pub struct RelayBody {
    inner: ShimBody,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    /// When the last event came (`None`: none yet).
    last_event: Option<Instant>,
    done: bool,
    /// Where the bytes received so far stand among SSE lines.
    lines: Lines,
    /// The received start of an event not yet ended, held back, and what it is charged.
    partial: BytesMut,
    partial_charge: Charge,
    dispatch: Option<DispatchEnd>,
    /// The shim replica streaming it, told how the exchange ended.
    shim: ShimExchange,
    /// Counts a stream that broke after it started.
    failures: IntCounter,
    /// Observes the time from the send to the first answer event, once.
    first_event: Option<(Histogram, Instant)>,
    /// The stream failed: in band (an error event, as 1.6.1 sends when the decode worker dies
    /// mid-stream, relayed as it came) or here. Counted, and blamed or charged, once, however
    /// it ends.
    failed: bool,
    /// The last event relayed was the closing `data: [DONE]`: a body that ends now ended as an
    /// OpenAI stream does; one that ends short of it was cut off between two events.
    closed: bool,
}

impl RelayBody {
    pub fn new(
        inner: ShimBody,
        idle: Duration,
        (dispatch, shim): (Option<DispatchEnd>, ShimExchange),
        (failures, first_event): (IntCounter, (Histogram, Instant)),
    ) -> Self {
        let deadline = Box::pin(tokio::time::sleep(idle));
        Self {
            inner,
            idle,
            deadline,
            last_event: None,
            done: false,
            lines: Lines::default(),
            partial: BytesMut::new(),
            partial_charge: Charge::default(),
            dispatch,
            shim,
            failures,
            first_event: Some(first_event),
            failed: false,
            closed: false,
        }
    }

    /// The stream ended on the end of an event: the shim served it (an error event of the
    /// engine's included), and, unless it failed, its workers are acquitted.
    fn finish(&mut self) {
        self.done = true;
        self.shim.ended(true);
        if let Some(dispatch) = self.dispatch.take().filter(|_| !self.failed) {
            dispatch.acquit();
        }
    }

    /// The stream failed (in band, or broken here): counted once, and blamed on its workers
    /// or, for a `Fault::Shim`, charged to the shim replica.
    fn count_failure(&mut self, fault: Fault) {
        if std::mem::replace(&mut self.failed, true) {
            // Counted already, by an error event, which charged the shim nothing: a break
            // after it is the shim's failure (or the network's) all the same.
            if matches!(fault, Fault::Shim) {
                self.shim.ended(false);
            }
            return;
        }
        match (fault, &self.dispatch) {
            (Fault::Shim, _) => self.shim.ended(false),
            (Fault::Workers, Some(dispatch)) => dispatch.blame(),
            (Fault::Silent, Some(dispatch)) => dispatch.timed_out(self.last_event.map(Instant::into_std)),
            (Fault::Workers | Fault::Silent, None) | (Fault::Overloaded, _) => {}
        }
        self.failures.inc();
    }

    fn fail(
        &mut self,
        fault: Fault,
        code: &'static str,
        message: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.done = true;
        self.count_failure(fault);
        self.dispatch = None;
        // The unfinished event is not sent: the client has seen only whole events.
        self.partial = BytesMut::new();
        self.partial_charge = Charge::default();
        Poll::Ready(Some(Ok(Frame::data(sse_error_event(code, message)))))
    }

    /// The whole events `data` ends (with the held start of the first), or `None` while they
    /// are all still unfinished; the rest is held back.
    fn whole_events(&mut self, data: Bytes) -> Result<Option<Bytes>, NoRoom> {
        let Some(end) = self.lines.feed(&data) else {
            self.hold(&data)?;
            return Ok(None);
        };
        let mut data = data;
        let rest = data.split_off(end);
        let events = if self.partial.is_empty() {
            data
        } else {
            self.hold(&data)?;
            // Handed on to be written: no longer held here, nor charged.
            self.partial_charge = Charge::default();
            std::mem::take(&mut self.partial).freeze()
        };
        self.hold(&rest)?;
        Ok(Some(events))
    }

    /// Holds `data` behind the unfinished event's start, charged past what is free.
    fn hold(&mut self, data: &[u8]) -> Result<(), NoRoom> {
        let budget = (&BUFFERED_ANSWERS, &mut self.partial_charge);
        append_charged(&mut self.partial, data, MAX_PARTIAL_EVENT_BYTES, budget).then_some(()).ok_or(NoRoom)
    }
}

impl RelayBody {
    /// Whether the idle deadline has passed, though the shim's body was never pending.
    fn past_deadline(&self) -> bool {
        Instant::now() >= self.deadline.deadline()
    }

    /// The idle deadline passed: the stream ends, whole when its closing marker was relayed.
    fn expired(&mut self) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        // Nothing after the closing marker is for the client, a fragment included.
        if self.closed {
            tracing::debug!("shim stream held its end back past the closing [DONE]; ended");
            self.finish();
            return Poll::Ready(None);
        }
        warn_limited!(idle = ?self.idle, "shim stream idle too long; ending it");
        self.fail(
            Fault::Silent,
            "stream_timeout",
            "The model server sent nothing for too long and the stream was ended. Retry the request.",
        )
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
        loop {
            let data = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                // After the closing `[DONE]` and nothing since, the client has the whole
                // stream: a connection that breaks before its last chunk cuts nothing.
                Poll::Ready(Some(Err(error))) if this.closed && !carries_event(&this.partial) => {
                    tracing::debug!(%error, "shim stream broke after its closing [DONE]");
                    this.finish();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(error))) => {
                    warn_limited!(%error, "shim stream failed mid-way");
                    return this.fail(
                        Fault::Shim,
                        "stream_interrupted",
                        "The response stream from the model server broke off before it finished. Retry the request.",
                    );
                }
                Poll::Ready(None) => {
                    // The body ended inside an event. Comments alone are nothing to lose, and
                    // the closing `[DONE]` short of its blank line is completed. Any other
                    // event cut short (a close-delimited answer whose connection dropped looks
                    // just so) is a break, said as one: SSE would silently drop the half.
                    // After the engine's error event, an end without `[DONE]` is how the
                    // frontend ends a failed stream: the client has its error already.
                    let unfinished = std::mem::take(&mut this.partial);
                    if !carries_event(&unfinished) && (this.closed || this.failed) {
                        this.finish();
                        return Poll::Ready(None);
                    }
                    if !carries_event(&unfinished) {
                        // Between two events, short of the closing marker: a close-delimited
                        // answer whose connection dropped there, or a proxy's cut. The client
                        // would take the stream for whole.
                        warn_limited!("shim stream ended before its closing [DONE]");
                        return this.fail(
                            Fault::Shim,
                            "stream_interrupted",
                            "The response stream from the model server ended before it finished. Retry the request.",
                        );
                    }
                    if is_done_marker(&unfinished) {
                        this.finish();
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))));
                    }
                    warn_limited!("shim stream ended in the middle of an event");
                    return this.fail(
                        Fault::Shim,
                        "stream_interrupted",
                        "The response stream from the model server ended in the middle of an event. Retry the request.",
                    );
                }
                Poll::Pending => {
                    ready!(this.deadline.as_mut().poll(cx));
                    return this.expired();
                }
            };
            let whole = match this.whole_events(data) {
                Ok(whole) => whole,
                Err(NoRoom) => {
                    return this.fail(
                        Fault::Overloaded,
                        "server_busy",
                        "The router holds as many unfinished stream events as it may, and the stream was ended. Retry shortly.",
                    );
                }
            };
            let Some(events) = whole else {
                if this.partial.len() > MAX_PARTIAL_EVENT_BYTES {
                    warn_limited!(limit = MAX_PARTIAL_EVENT_BYTES, "shim stream sent an event too large to relay");
                    return this.fail(
                        Fault::Workers,
                        "stream_interrupted",
                        "The model server sent an event too large to relay, and the stream was ended. Retry the request.",
                    );
                }
                if this.past_deadline() {
                    return this.expired();
                }
                continue;
            };
            // Progress is a whole event. A keep-alive comment is relayed but is none: a stalled
            // engine behind a frontend that sends them would otherwise hold the stream (and its
            // dispatch) forever, and its first one would end the prefill before the first
            // token. Nor is a piece of an event that never ends, a byte now and then.
            if carries_event(&events) {
                // An error event is no first token: the prompt may never have been prefilled,
                // and its prefill rank is as much a suspect as the decode rank.
                if carries_answer(&events) {
                    if let Some(dispatch) = this.dispatch.as_mut() {
                        dispatch.prefilled();
                    }
                    if let Some((histogram, sent)) = this.first_event.take() {
                        histogram.observe(sent.elapsed().as_secs_f64());
                    }
                }
                let now = Instant::now();
                this.last_event = Some(now);
                this.closed = ends_with_done_marker(&events);
                let wait = if this.closed { AFTER_DONE_GRACE.min(this.idle) } else { this.idle };
                this.deadline.as_mut().reset(now + wait);
            } else if this.past_deadline() {
                // Comments that keep coming as fast as they are relayed never leave the shim's
                // body pending, where the deadline is otherwise polled.
                return this.expired();
            }
            if let Some(dispatch) = &mut this.dispatch {
                dispatch.observe(&events);
            }
            if !carries_error_event(&events) {
                return Poll::Ready(Some(Ok(Frame::data(events))));
            }
            if !this.failed {
                warn_limited!("the shim's stream carried an error event; relayed");
                this.count_failure(Fault::Workers);
            }
            return Poll::Ready(Some(Ok(Frame::data(with_error_data(withhold_addresses(events))))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Whether whole SSE events hold an error event ([`is_error_event`]). Every error event has
/// `error` in it, so most frames are ruled out by one search.
fn carries_error_event(data: &[u8]) -> bool {
    memchr::memmem::find(data, b"error").is_some() && events_of(&lines_by_event(data)).any(is_error_event)
}

/// Whether an event is an error event: one whose data (its `data:` values joined, as a client
/// reads them) is a JSON object whose first member is `error`, the shape an OpenAI stream, and
/// Dynamo 1.6.1's frontend, carry errors in; or one named `error`, as later frontends send a
/// stream's failure (its words in comment lines, `event: error` then `: <why>`). Only the
/// data's start is looked at: a token's text is inside a string there, never at the start.
fn is_error_event(event: &[EventLine<'_>]) -> bool {
    event.first().is_some_and(|line| line.in_named_error) || opens_with_error_member(data_values(event))
}

/// The events of [`lines_by_event`]'s lines, each its lines.
fn events_of<'l, 'a>(lines: &'l [EventLine<'a>]) -> impl Iterator<Item = &'l [EventLine<'a>]> {
    lines.chunk_by(|a, b| a.event == b.event)
}

/// Whether a line (its ending cut) is a `data` field: `data`, or `data:` and its value. A field
/// is named up to its first colon, so `data ` or `dataX:` is none.
fn is_data_line(content: &[u8]) -> bool {
    content == b"data" || content.starts_with(b"data:")
}

/// The values of an event's `data` fields, in order: each after `data:` and the one space a
/// value may start with.
fn data_values<'l>(event: &'l [EventLine<'_>]) -> impl Iterator<Item = &'l [u8]> + Clone {
    event.iter().map(|line| line.text.trim_ascii_end()).filter(|content| is_data_line(content)).map(|content| {
        let value = content.strip_prefix(b"data:").unwrap_or_default();
        value.strip_prefix(b" ").unwrap_or(value)
    })
}

/// Whether data values, joined, are a JSON object whose first member is `error`, white space
/// allowed where JSON allows it (the line breaks between values among it).
fn opens_with_error_member<'v>(values: impl Iterator<Item = &'v [u8]>) -> bool {
    const OPENING: &[u8] = b"{\"error\"";
    let mut opening = values.flat_map(|value| value.iter().copied()).filter(|b| !b.is_ascii_whitespace());
    OPENING.iter().all(|expected| opening.next() == Some(*expected))
}

/// Each error event's data checked whole (its `data:` values joined, as a client reads them):
/// one opening with an `error` member goes out as the router read it, re-encoded on one line (a
/// key written twice as the copy that was checked), or in the router's words when it names an
/// address, a path or a worker (as a refusal's body may not, `disclosure`); of an event named
/// `error`, whose data is its words whatever their shape, data naming one goes in the router's
/// words. Comments naming one are left out; every other line goes as it came (and `events`
/// itself, uncopied, when nothing changed). Called only on events that carry an error.
fn withhold_addresses(events: Bytes) -> Bytes {
    let lines = lines_by_event(&events);
    let mut out = BytesMut::with_capacity(events.len());
    let mut changed = false;
    for event in events_of(&lines) {
        let values = data_values(event);
        let data = || values.clone().collect::<Vec<_>>().join(&b'\n');
        let instead: Option<Vec<u8>> = if opens_with_error_member(values.clone()) {
            Some(match relayable(&data()) {
                Ok(value) => format!("data: {value}").into_bytes(),
                Err(_) => WITHHELD_ERROR_EVENT.as_bytes().to_vec(),
            })
        } else if event.first().is_some_and(|line| line.in_named_error)
            && text_names_an_address(&String::from_utf8_lossy(&data()))
        {
            Some(WITHHELD_ERROR_EVENT.as_bytes().to_vec())
        } else {
            None
        };
        // One data line that reads as its replacement already (compact JSON, each key once).
        let instead = instead.filter(|instead| {
            let mut data = event.iter().map(|line| line.text.trim_ascii_end()).filter(|content| is_data_line(content));
            !(data.next() == Some(instead.as_slice()) && data.next().is_none())
        });
        let (mut said, mut lf_of_dropped_crlf) = (false, false);
        for line in event {
            // The LF of a CRLF ending a data line left out goes with it.
            if std::mem::take(&mut lf_of_dropped_crlf) && line.text == b"\n" {
                continue;
            }
            let content = line.text.trim_ascii_end();
            let ending = &line.text[content.len()..];
            let names_an_address = |comment: &[u8]| text_names_an_address(&String::from_utf8_lossy(comment));
            match &instead {
                // The event's data, all its lines, as one line in their place.
                Some(instead) if is_data_line(content) => {
                    changed = true;
                    if said {
                        lf_of_dropped_crlf = ending == b"\r";
                    } else {
                        out.extend_from_slice(instead);
                        out.extend_from_slice(ending);
                        said = true;
                    }
                }
                _ if content.strip_prefix(b":").is_some_and(names_an_address) => {
                    changed = true;
                    out.extend_from_slice(WITHHELD_COMMENT.as_bytes());
                    out.extend_from_slice(ending);
                }
                _ => out.extend_from_slice(line.text),
            }
        }
    }
    if changed { out.freeze() } else { events }
}

/// Whether an `event:` field's value is `error`.
fn names_error(name: &[u8]) -> bool {
    name.strip_prefix(b" ").unwrap_or(name) == b"error"
}

/// A line of whole SSE events, its ending kept: which event it belongs to (counted from 0) and
/// whether that event is named `error`.
struct EventLine<'a> {
    text: &'a [u8],
    event: usize,
    in_named_error: bool,
}

/// Each line of `events`, its ending kept, and whether its event is named `error` (an event's
/// `event:` field may follow its `data:` lines). Lines end at LF, CRLF or CR; an event at a
/// blank line.
fn lines_by_event(events: &[u8]) -> Vec<EventLine<'_>> {
    let (mut lines, mut event_start, mut event, mut named, mut after_cr) = (Vec::new(), 0, 0, false, false);
    for text in events.split_inclusive(|b| *b == b'\n' || *b == b'\r') {
        let content = text.trim_ascii_end();
        // The LF of a CRLF ends the line before it; it is no blank line of its own.
        let blank = content.is_empty() && !(after_cr && text == b"\n");
        after_cr = text.ends_with(b"\r");
        named |= content.strip_prefix(b"event:").is_some_and(names_error);
        lines.push(EventLine { text, event, in_named_error: false });
        if blank {
            lines[event_start..].iter_mut().for_each(|line: &mut EventLine<'_>| line.in_named_error = named);
            (event_start, event, named) = (lines.len(), event + 1, false);
        }
    }
    lines[event_start..].iter_mut().for_each(|line| line.in_named_error = named);
    lines
}

/// What a stream's error event naming an address becomes.
const WITHHELD_ERROR_EVENT: &str = r#"data: {"error":{"message":"The model server failed the request; its own words named internal hosts or workers and are not relayed. Retry the request.","type":"server_error","param":null,"code":"backend_failed"}}"#;
/// What a comment naming an address becomes.
const WITHHELD_COMMENT: &str = ": withheld";

/// An event named `error` that carries no `data:` line opening with an `error` member goes
/// whole, an unnamed error event of the router's in its place, which says the engine's words
/// (its `data:` values and comments, addresses already withheld) if it had any. OpenAI's
/// clients cannot read it as it came: openai-python parses the data of an event named `error`
/// as JSON, failing on words in comments (no data at all) or in plain text, and takes a JSON
/// object without an `error` member for a chunk; none of them reads comments.
fn with_error_data(events: Bytes) -> Bytes {
    let lines = lines_by_event(&events);
    // In the order of the events, so sorted.
    let unread: Vec<usize> = events_of(&lines)
        .filter(|event| event[0].in_named_error && !opens_with_error_member(data_values(event)))
        .map(|event| event[0].event)
        .collect();
    if unread.is_empty() {
        return events;
    }
    let mut out = BytesMut::with_capacity(events.len() + 256);
    let mut replaced = false;
    for event in lines.chunk_by(|a, b| a.event == b.event) {
        // The LF of the CRLF that ended the event before comes as this one's first line: it
        // goes with that event, kept or replaced.
        let rest = match event {
            [first, rest @ ..] if first.text == b"\n" => {
                if !replaced {
                    out.extend_from_slice(first.text);
                }
                rest
            }
            whole => whole,
        };
        replaced = unread.binary_search(&event[0].event).is_ok();
        if replaced {
            out.extend_from_slice(&sse_error_event("backend_failed", &engine_error(&engine_words(rest))));
        } else {
            rest.iter().for_each(|line| out.extend_from_slice(line.text));
        }
    }
    out.freeze()
}

/// The most of an engine's words about its error that the router's error event repeats.
const MAX_ENGINE_WORDS_CHARS: usize = 512;

/// What an event says in its `data:` values and comments, one space between lines, a comment
/// withheld for an address left out.
fn engine_words(event: &[EventLine<'_>]) -> String {
    let words = event.iter().filter_map(|line| {
        let content = line.text.trim_ascii_end();
        let said = content.strip_prefix(b"data:").or_else(|| content.strip_prefix(b":"))?;
        (content != WITHHELD_COMMENT.as_bytes()).then(|| String::from_utf8_lossy(said.trim_ascii()).into_owned())
    });
    let joined = words.filter(|said| !said.is_empty()).collect::<Vec<_>>().join(" ");
    joined.chars().take(MAX_ENGINE_WORDS_CHARS).collect()
}

/// The router's words for an engine's error event, with the engine's if any.
fn engine_error(words: &str) -> String {
    match words {
        "" => "The model server reported an error in the stream. Retry the request.".to_string(),
        words => format!("The model server reported an error in the stream: {words}. Retry the request."),
    }
}

/// Whether whole SSE events hold an event a client is given: one with data, or one named
/// `error` (which goes as the router's error event if it has none). Comments (`:` lines),
/// and blocks of other fields alone (`id:`, `retry:`, `event: ping`), which a client's reader
/// dispatches nothing for, are none. Lines end at LF, CRLF or CR.
fn carries_event(data: &[u8]) -> bool {
    let event = |line: &[u8]| is_data_line(line) || line.strip_prefix(b"event:").is_some_and(names_error);
    data.split(|b| *b == b'\n' || *b == b'\r').any(event)
}

/// The `data` lines of `data`.
fn data_lines(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    data.split(|b| *b == b'\n' || *b == b'\r').filter(|line| is_data_line(line))
}

/// Whether whole SSE events hold an event other than an error event or the closing marker
/// (1.6.1 closes a failed stream with it): something the engine answered, which for the first
/// one means the prompt was prefilled.
fn carries_answer(data: &[u8]) -> bool {
    // Without an error event among them, any data but the marker is an answer.
    if memchr::memmem::find(data, b"error").is_none() {
        return data_lines(data).any(|line| !is_done_line(line));
    }
    let lines = lines_by_event(data);
    events_of(&lines)
        .any(|event| !is_error_event(event) && data_values(event).any(|value| value.trim_ascii() != b"[DONE]"))
}

/// Whether the last data line of whole events (other lines after it aside) is the closing
/// `data: [DONE]`.
fn ends_with_done_marker(events: &[u8]) -> bool {
    data_lines(events).last().is_some_and(is_done_line)
}

/// Whether an unfinished event is the stream's closing `data: [DONE]`: its one data line.
fn is_done_marker(unfinished: &[u8]) -> bool {
    let mut lines = data_lines(unfinished);
    lines.next().is_some_and(is_done_line) && lines.next().is_none()
}

fn is_done_line(line: &[u8]) -> bool {
    line.strip_prefix(b"data:").is_some_and(|value| value.trim_ascii() == b"[DONE]")
}

/// Where a stream stands among SSE lines, which end at LF, CRLF or CR; an event ends at a blank
/// line.
#[derive(Debug, Clone, Copy)]
struct Lines {
    /// Nothing has come since the last line ended (or the stream began).
    line_empty: bool,
    /// The last byte was a CR, whose line ended there: an LF next is the rest of a CRLF.
    after_cr: bool,
}

impl Default for Lines {
    fn default() -> Self {
        Self { line_empty: true, after_cr: false }
    }
}

impl Lines {
    /// Takes in `data`; the length of its longest prefix that ends an event, if any does.
    fn feed(&mut self, data: &[u8]) -> Option<usize> {
        let mut end = None;
        for (at, byte) in data.iter().enumerate() {
            let after_cr = std::mem::replace(&mut self.after_cr, *byte == b'\r');
            match byte {
                // The LF of a CRLF: its CR ended the line, and the event if it did.
                b'\n' if after_cr => {
                    if end == Some(at) {
                        end = Some(at + 1);
                    }
                }
                b'\n' | b'\r' => {
                    if self.line_empty {
                        end = Some(at + 1);
                    }
                    self.line_empty = true;
                }
                _ => self.line_empty = false,
            }
        }
        end
    }
}

/// One SSE event carrying an OpenAI-shaped error, as streaming clients expect mid-stream.
pub fn sse_error_event(code: &str, message: &str) -> Bytes {
    let error = json!({"error": {"message": message, "type": "server_error", "param": null, "code": code}});
    Bytes::from(format!("data: {error}\n\n"))
}

#[cfg(test)]
mod tests;
