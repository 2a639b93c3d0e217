//! Turning a shim's response into the client's: a success is relayed (streams event by event as
//! frames arrive, buffered bodies read whole, bounded and charged to the process's budget), and
//! anything else is read (bounded) and classified; an unpinned backend's server error is not
//! read at all.

use std::convert::Infallible;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::Instant;

use super::breaker::ShimExchange;
use super::classify::{self, Verdict, classify};
use super::disclosure::{RefusalBody, backend_words, relayable};
use super::pool::ShimReplica;
use super::relay::RelayBody;
use super::shim_body::ShimBody;
use super::{DispatchEnd, Dispatcher, Failure};
use crate::ingress::error::ApiError;
use crate::memory::{BUFFERED_ANSWERS, Charge, append_charged, settle};
use crate::metrics::ErrorPhase;
use crate::routing::headers::{disclose, strip_response};
use crate::routing::picker::Selection;

/// The largest buffered completion relayed.
pub const MAX_BUFFERED_RESPONSE_BYTES: usize = 32 << 20;
/// The most of a refusal's body read to classify (and, for relayed 4xx, to pass on).
pub const MAX_ERROR_BODY_BYTES: usize = 64 << 10;
/// Reading a refusal's body.
pub const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(super) enum Answer {
    Relay(Response),
    PrefillRefused,
    Failed(Failure),
}

/// A response's meaning, and whether a non-2xx one blames the pinned workers
/// ([`blames_pins`]): the outlier strikes follow it.
#[derive(Debug)]
pub(super) struct Answered {
    pub answer: Answer,
    pub blames_pins: bool,
    /// For a refusal of the client's request to relay, what became of its body: counted by the
    /// caller once the refusal is the client's answer (a fallback's is not).
    pub refused: Option<RefusalBody>,
}

impl Dispatcher {
    /// What a pinned (or fallback) response means. `dispatch` ends when the relayed body ends,
    /// or here for anything not relayed. `shown` is what to disclose. Not an `async fn`, nor is
    /// [`Self::success`]: an `async fn` keeps its arguments in its future beside the locals it
    /// binds them to, and a response is some 250 bytes.
    pub(super) fn answer<'a>(
        &'a self,
        response: Response<ShimBody>,
        (stream, sent): (bool, Instant),
        dispatch: Option<DispatchEnd>,
        (replica, shown): (&'a ShimReplica, Option<(&'a str, &'a Selection)>),
    ) -> impl Future<Output = Answered> + 'a {
        let status = response.status();
        async move {
            let (mut blames_pins, mut refused) = (false, None);
            let mut answer = if status.is_success() {
                match self.success(response, (stream, sent), dispatch, replica).await {
                    Ok(response) => Answer::Relay(response),
                    Err(failure) => Answer::Failed(failure),
                }
            } else {
                drop(dispatch);
                let (parts, body) = response.into_parts();
                let body = read_error_body(body).await;
                blames_pins = classify::blames_pins(status, &body);
                match classify(status, &body, stream) {
                    Verdict::PrefillRefused => Answer::PrefillRefused,
                    Verdict::Relay => {
                        let (response, fate) = relayed_refusal(status, parts.headers, body);
                        refused = Some(fate);
                        Answer::Relay(response)
                    }
                    Verdict::DecodeFailed => Answer::Failed(Failure::Status(status)),
                }
            };
            if let (Answer::Relay(response), Some((backend, selection))) = (&mut answer, shown) {
                disclose(response.headers_mut(), backend, selection);
            }
            Answered { answer, blames_pins, refused }
        }
    }

    /// A backend's answer to a plain unpinned request: a success or a refusal of the client's
    /// request (4xx) is relayed (the refusal as [`Self::relayed_refusal`] allows). A server
    /// error is the backend's own: its body may name internal hosts or paths, so the client
    /// gets the router's error instead; so does an answer no chat completion should get (an
    /// informational status, a redirect).
    pub(super) async fn pass_through(
        &self,
        response: Response<ShimBody>,
        (stream, sent): (bool, Instant),
        replica: &ShimReplica,
    ) -> Result<Response, Failure> {
        let status = response.status();
        if status.is_success() {
            return self.success(response, (stream, sent), None, replica).await;
        }
        if !status.is_client_error() {
            return Err(Failure::Status(status));
        }
        let (parts, body) = response.into_parts();
        let (response, fate) = relayed_refusal(status, parts.headers, read_error_body(body).await);
        self.metrics.refusal_relayed(fate);
        Ok(response)
    }

    /// A success relayed: a stream as its events come, a buffered answer read whole within
    /// what is left of the exchange's [`super::DispatchSettings::buffered_timeout`] since it
    /// was `sent` (the wait for the head took the rest).
    fn success<'a>(
        &'a self,
        response: Response<ShimBody>,
        (stream, sent): (bool, Instant),
        dispatch: Option<DispatchEnd>,
        replica: &'a ShimReplica,
    ) -> impl Future<Output = Result<Response, Failure>> + 'a {
        let (parts, body) = response.into_parts();
        async move {
            let body = if stream {
                if !is_event_stream(parts.status, &parts.headers) {
                    // The shim's failure: the workers were not asked for this.
                    self.health.of(replica).exchange_ended((sent.into_std(), false));
                    return Err(Failure::NotAnEventStream(parts.status));
                }
                let failures = match dispatch {
                    Some(_) => self.metrics.disaggregated_errors.with_label_values(&[ErrorPhase::Decode.as_str()]),
                    None => self.metrics.unpinned_stream_failures.clone(),
                };
                let shim = ShimExchange::new(&self.health, replica, sent.into_std());
                let counted = (failures, (self.metrics.stream_first_event.clone(), sent));
                Body::new(RelayBody::new(body, self.settings.stream_idle_timeout, (dispatch, shim), counted))
            } else {
                let timeout = self.settings.buffered_timeout;
                let read = read_whole(body, MAX_BUFFERED_RESPONSE_BYTES, (sent + timeout, timeout)).await;
                // The exchange's outcome on the shim's breaker: a body broken after its head (which
                // a buffered answer sends only once generation is done) is the shim's failure, or
                // the network's, not its workers'; one too slow says nothing of the shim.
                let served = match &read {
                    Ok(_) | Err(Failure::TooLarge(_) | Failure::Overloaded) => Some(true),
                    Err(Failure::Body(_)) => Some(false),
                    Err(_) => None,
                };
                if let Some(served) = served {
                    self.health.of(replica).exchange_ended((sent.into_std(), served));
                }
                let (bytes, charge) = read?;
                let ends = dispatch.map(|dispatch| (dispatch, bytes.clone()));
                Body::new(Charged { bytes: Some(bytes), _charge: charge, ends })
            };
            Ok(rebuild(parts.status, parts.headers, body))
        }
    }
}

/// Whether a streamed request's success is relayable event by event: a 200 whose content type,
/// if it names one, is `text/event-stream` (parameters such as a charset aside).
fn is_event_stream(status: StatusCode, headers: &HeaderMap) -> bool {
    let is_sse = |value: &HeaderValue| {
        let media_type = value.as_bytes().split(|b| *b == b';').next().unwrap_or_default();
        media_type.trim_ascii().eq_ignore_ascii_case(b"text/event-stream")
    };
    status == StatusCode::OK && headers.get(header::CONTENT_TYPE).is_none_or(is_sse)
}

/// A client response with the shim's status and headers: only the relayable ones were kept
/// when its head was parsed ([`RELAYED_HEADERS`](super::wire::RELAYED_HEADERS)), and no routing
/// header passes even so.
fn rebuild(status: StatusCode, mut shim_headers: HeaderMap, body: Body) -> Response {
    strip_response(&mut shim_headers);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = shim_headers;
    response
}

/// A body read whole, up to `limit` bytes by `deadline` (the end of a `timeout`), and charged to
/// the process's budget of buffered answers as it grows.
async fn read_whole(
    body: ShimBody,
    limit: usize,
    (deadline, timeout): (Instant, Duration),
) -> Result<(Bytes, Charge), Failure> {
    let read = async {
        let mut body = pin!(Limited::new(body, limit));
        // Most answers arrive in one frame, kept as it came; only a second one is copied.
        let (mut first, mut joined, mut charge) = (None::<Bytes>, BytesMut::new(), Charge::default());
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| match error.is::<LengthLimitError>() {
                true => Failure::TooLarge(limit),
                false => Failure::Body(error.to_string()),
            })?;
            let Ok(data) = frame.into_data() else { continue };
            let charged = match first.take() {
                None if joined.is_empty() => {
                    let fits = BUFFERED_ANSWERS.grow(&mut charge, data.len());
                    first = Some(data);
                    fits
                }
                // Charged for the room the joined answer holds, not only its bytes.
                earlier => [earlier.unwrap_or_default(), data]
                    .iter()
                    .all(|part| append_charged(&mut joined, part, limit, (&BUFFERED_ANSWERS, &mut charge))),
            };
            if !charged {
                return Err(Failure::Overloaded);
            }
        }
        Ok(match first {
            Some(only) => (only, charge),
            None => (settle(joined, &mut charge), charge),
        })
    };
    tokio::time::timeout_at(deadline, read).await.unwrap_or(Err(Failure::BodyTimeout(timeout)))
}

/// A refusal's body, or nothing when it is too large or too slow: the status alone decides then.
async fn read_error_body(body: ShimBody) -> Bytes {
    let deadline = (Instant::now() + ERROR_BODY_TIMEOUT, ERROR_BODY_TIMEOUT);
    read_whole(body, MAX_ERROR_BODY_BYTES, deadline).await.map(|(bytes, _)| bytes).unwrap_or_default()
}

/// A buffered answer, holding its charge until it is written, and its dispatch with a handle
/// on its bytes: the dispatch ends when the body is dropped, once written (as a stream's ends
/// with its last event), so that the ledger's and the report's work for the end, and learning
/// from the answer's usage, follow the client's answer rather than hold it back.
struct Charged {
    bytes: Option<Bytes>,
    _charge: Charge,
    ends: Option<(DispatchEnd, Bytes)>,
}

impl Drop for Charged {
    fn drop(&mut self) {
        if let Some((mut dispatch, answer)) = self.ends.take() {
            dispatch.observe(&answer);
        }
    }
}

impl http_body::Body for Charged {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.bytes.take().map(|bytes| Ok(Frame::data(bytes))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |bytes| bytes.len() as u64))
    }
}

/// A backend's refusal of the client's request (4xx), relayed when [`super::disclosure`]
/// allows (as it came, or its words put in OpenAI's shape); otherwise its status with the
/// router's words. Whichever words, the pace it asked for (`Retry-After`, a 429's) goes with
/// it: an OpenAI client waits that long instead of its own half second.
fn relayed_refusal(status: StatusCode, shim_headers: HeaderMap, body: Bytes) -> (Response, RefusalBody) {
    let retry_after = shim_headers.get(header::RETRY_AFTER).cloned();
    let (mut response, fate) = refusal_in_words(status, shim_headers, body);
    if let Some(retry_after) = retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, retry_after);
    }
    (response, fate)
}

fn refusal_in_words(status: StatusCode, shim_headers: HeaderMap, body: Bytes) -> (Response, RefusalBody) {
    match relayable(&body) {
        Ok(value) => {
            let response = match backend_words(&value) {
                // Re-encoded from the JSON read: JSON is what the client gets, whatever type
                // the backend said its body had.
                None => {
                    let mut response = rebuild(status, shim_headers, Body::from(value.to_string()));
                    let json = HeaderValue::from_static("application/json");
                    response.headers_mut().insert(header::CONTENT_TYPE, json);
                    response
                }
                Some(words) => ApiError::reworded(status, &words).into_response(),
            };
            (response, RefusalBody::Relayed)
        }
        Err(fate) => (ApiError::refused(status, fate).into_response(), fate),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer of many frames is joined in room it is charged for: the doubling of a joined
    /// buffer held up to twice what was charged, past the process's budget of answers.
    #[tokio::test]
    async fn an_answer_of_many_frames_holds_no_more_room_than_it_is_charged_for() -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt;

        use super::super::connections::Conn;
        use super::super::wire::Framing;
        use crate::memory::{FILLING, FREE_BYTES};

        let _turn = FILLING.lock().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(listener.local_addr()?), listener.accept());
        let (mut server, _) = accepted?;
        // Just past a power of two, in pieces: each read of the body is one frame.
        let len = (3 << 20) + 1000;
        let writer = tokio::spawn(async move {
            for piece in vec![b'x'; len].chunks(16 << 10) {
                server.write_all(piece).await?;
            }
            server.shutdown().await
        });
        let body = ShimBody::new(Conn::new(client?), Framing::UntilClose, None);
        let deadline = (Instant::now() + Duration::from_secs(30), Duration::from_secs(30));
        let (answer, charge) = read_whole(body, 32 << 20, deadline).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        writer.await??;
        assert_eq!(answer.len(), len);
        let charged = BUFFERED_ANSWERS.charged();
        let held = answer.try_into_mut().map(|joined| joined.capacity()).map_err(|_| anyhow::anyhow!("shared"))?;
        assert!(held <= charged && charged <= len + FREE_BYTES, "{held} held, {charged} charged for {len}");
        drop(charge);
        assert_eq!(BUFFERED_ANSWERS.charged(), 0);
        Ok(())
    }

    /// A refusal relayed in OpenAI's shape is JSON the router re-encoded: it goes out as JSON
    /// whatever type the backend named (a browser must not render the client's own input that
    /// a refusal quotes as markup).
    #[test]
    fn a_relayed_refusal_is_json_whatever_type_its_backend_named() {
        let mut shim_headers = HeaderMap::new();
        shim_headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
        let body = Bytes::from_static(br#"{"error":{"message":"<script>x</script> is not a model"}}"#);
        let (response, fate) = relayed_refusal(StatusCode::BAD_REQUEST, shim_headers, body);
        assert_eq!(fate, RefusalBody::Relayed);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            response.headers().get(header::CONTENT_TYPE).map(HeaderValue::as_bytes),
            Some(&b"application/json"[..])
        );
    }

    /// A refusal's `Retry-After` goes to the client whether its words are relayed as they came,
    /// put in OpenAI's shape, or withheld.
    #[test]
    fn a_refusals_retry_after_is_relayed_whatever_becomes_of_its_words() {
        let bodies: [&[u8]; 3] = [
            br#"{"error":{"message":"slow down","type":"rate_limit"}}"#,
            br#"{"detail":"slow down"}"#,
            b"<html>upstream 10.0.0.7:8000 is busy</html>",
        ];
        for body in bodies {
            let mut shim_headers = HeaderMap::new();
            shim_headers.insert(header::RETRY_AFTER, HeaderValue::from_static("30"));
            let (response, _) = relayed_refusal(StatusCode::TOO_MANY_REQUESTS, shim_headers, Bytes::from_static(body));
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            let retry_after = response.headers().get(header::RETRY_AFTER).map(HeaderValue::as_bytes);
            assert_eq!(retry_after, Some(&b"30"[..]), "{}", String::from_utf8_lossy(body));
        }
    }
}
