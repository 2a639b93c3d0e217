//! The HTTP edge for errors: every failure a client can see becomes an OpenAI-shaped body
//! `{"error":{"message","type","param","code"}}` with a stable `code`, a message that says what
//! happened and what to do, and never an internal address. Where the router knows better than an
//! OpenAI client's default (which retries 408, 409, 429 and every 5xx twice), the answer says
//! so: `Retry-After` for a cause that passes in a second, `x-should-retry: false` (which both
//! OpenAI SDKs obey) for one a retry would only repeat.

use axum::Json;
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::request::RequestError;
use super::select::SelectError;
use crate::dispatch::disclosure::RefusalBody;
use crate::dispatch::{DispatchError, Failure, SendError};
use crate::server::head::HeadError;

/// Client-supplied model names are echoed in messages, cut to this many characters.
const MAX_ECHOED_MODEL_CHARS: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry: Retry,
}

/// What an answer tells a client about trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Nothing: the client's own policy decides.
    AsItSees,
    /// The router itself refused for want of room, a view or a worker, causes that pass in
    /// seconds: retry after `RETRY_AFTER_SECONDS`. Not when a backend said no (429, 503),
    /// whose own pace a fixed second would override.
    Soon,
    /// A retry would bring the same answer (an answer too large to hold, a request the model
    /// server refused unpinned too): `x-should-retry: false`, though the status is a 5xx.
    Never,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry: Retry::AsItSees }
    }

    /// The router's own 503, for a cause that passes in seconds.
    fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self { retry: Retry::Soon, ..Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message) }
    }

    fn not_to_retry(self) -> Self {
        Self { retry: Retry::Never, ..self }
    }

    /// A request for a path this replica does not serve (404), or not with this method (405).
    pub fn no_endpoint(status: StatusCode, method: &Method, path: &str) -> Self {
        // The path and method are the client's own; only a bounded, printable part is echoed
        // (a method is any token, up to the head's 64 KiB).
        let path: String = path.chars().take(128).filter(|c| !c.is_control()).collect();
        let message = match status {
            StatusCode::METHOD_NOT_ALLOWED => {
                let method: String = method.as_str().chars().take(MAX_ECHOED_METHOD_CHARS).collect();
                format!(
                    "{method} is not served at {path}. Chat completions are POST /v1/chat/completions; models are GET /v1/models."
                )
            }
            _ => format!(
                "No endpoint at {path}. This router serves POST /v1/chat/completions, GET /v1/models and GET /v1/models/{{id}}."
            ),
        };
        let code = if status == StatusCode::METHOD_NOT_ALLOWED { "method_not_allowed" } else { "not_found" };
        ApiError::new(status, code, message)
    }

    /// A backend refused the request (a 4xx) with a body the client does not get as it came
    /// ([`RefusalBody`]): the status is relayed, with words of the router's own.
    pub fn refused(status: StatusCode, body: RefusalBody) -> Self {
        let why = match body {
            RefusalBody::Withheld => {
                "its explanation is not passed on: it was not a JSON error, or it named an internal address"
            }
            RefusalBody::Unreadable | RefusalBody::Relayed => "its explanation could not be read",
        };
        let message = format!("The model server refused the request ({}); {why}.", status.as_u16());
        ApiError::new(status, "backend_refused", message)
    }

    /// A backend refused the request (a 4xx) in words fit to relay, but not in OpenAI's shape:
    /// its status and its words, in that shape.
    pub fn reworded(status: StatusCode, words: &str) -> Self {
        let message = format!("The model server refused the request ({}): {words}", status.as_u16());
        ApiError::new(status, "backend_refused", message)
    }

    /// The OpenAI `type`: the client's mistake, or ours.
    fn kind(&self) -> &'static str {
        if self.status.is_client_error() { "invalid_request_error" } else { "server_error" }
    }
}

/// What a 503 of the router's own asks a client to wait before it tries again: its causes (no
/// room for a large body, breakers open, a fleet without workers or a view) pass in seconds or
/// need another replica, and OpenAI's clients honour the header over their own backoff.
const RETRY_AFTER_SECONDS: &str = "1";

/// The header OpenAI's SDKs read before their own retry policy: `false` stops a retry of a 5xx.
const SHOULD_RETRY: &str = "x-should-retry";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind(), "param": null, "code": self.code}});
        let mut response = (self.status, Json(body)).into_response();
        let headers = response.headers_mut();
        match self.retry {
            Retry::AsItSees => {}
            Retry::Soon => {
                headers.insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECONDS));
            }
            Retry::Never => {
                headers.insert(HeaderName::from_static(SHOULD_RETRY), HeaderValue::from_static("false"));
            }
        }
        response
    }
}

impl From<RequestError> for ApiError {
    fn from(error: RequestError) -> Self {
        match error {
            RequestError::Busy => {
                ApiError::unavailable("server_busy", format!("The router is busy: {error}. Retry shortly."))
            }
            RequestError::Grows { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!("The request is too large: {error}."),
            ),
            error => ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", format!("Invalid request: {error}.")),
        }
    }
}

impl From<HeadError> for ApiError {
    fn from(error: HeadError) -> Self {
        let (code, advice) = match error {
            HeadError::BodyTooLarge => ("request_too_large", " Shorten the prompt or send large content by reference."),
            HeadError::TooLarge => ("request_head_too_large", " Send fewer or shorter headers."),
            HeadError::TargetTooLong => ("request_target_too_long", " Send a shorter path and query."),
            HeadError::FieldTooLong(_) => ("request_header_too_large", " Send a shorter value."),
            HeadError::Version => ("http_version_not_supported", " Send HTTP/1.1."),
            HeadError::UnsupportedCoding => {
                ("unsupported_transfer_coding", " Send the body plain, with Content-Length or chunked alone.")
            }
            HeadError::Timeout => {
                let message = format!("Request timed out: {error}. Send the whole request at once.");
                return ApiError::new(error.status(), "request_timeout", message);
            }
            HeadError::Busy => {
                return ApiError::unavailable("server_busy", format!("The router is busy: {error}. Retry shortly."));
            }
            HeadError::Malformed(_) | HeadError::Framing(_) | HeadError::Body(_) => ("invalid_request", ""),
        };
        let refused = ApiError::new(error.status(), code, format!("Invalid HTTP request: {error}.{advice}"));
        // A 501 (RFC 9112 §6.1: a transfer coding the server does not know) is no failure a
        // retry of the same request mends.
        if refused.status.is_server_error() { refused.not_to_retry() } else { refused }
    }
}

impl From<SelectError> for ApiError {
    fn from(error: SelectError) -> Self {
        match error {
            SelectError::NoFleetView => ApiError::unavailable(
                "fleet_unavailable",
                "This router has not yet received the fleet from its control plane. Retry in a few seconds.",
            ),
            SelectError::ModelNotFound { model } => ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!(
                    "The model {} is not served by any worker. List the available models with GET /v1/models.",
                    echo(&model)
                ),
            ),
            SelectError::ShimUnavailable { model } => ApiError::unavailable(
                "shim_unavailable",
                format!(
                    "No Dynamo frontend replica is available for the workers serving {}: every replica is failing or none is configured. Retry shortly.",
                    echo(&model)
                ),
            ),
            SelectError::NoWorkers { model } => ApiError::unavailable(
                "no_workers",
                format!("No worker serving {} can take a request right now. Retry shortly.", echo(&model)),
            ),
        }
    }
}

impl From<DispatchError> for ApiError {
    fn from(error: DispatchError) -> Self {
        match error {
            DispatchError::PrefillRefused { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "disaggregated_prefill_decode_unavailable",
                "The model server refused the request because no prefill worker was assigned to it. Retry shortly; if it persists, the fleet's prefill workers may be unavailable.",
            ),
            DispatchError::DecodeFailed { cause, fallback, stale_pins } => {
                decode_failed(&cause, fallback.as_ref(), stale_pins)
            }
            DispatchError::Overloaded => server_busy(),
            DispatchError::NoShim => ApiError::unavailable(
                "shim_unavailable",
                "No Dynamo frontend replica is available for the workers this request was assigned to: every replica \
                 is failing or recovering. Retry shortly.",
            ),
            DispatchError::UnifiedFailed(cause) => unified_failed(&cause),
        }
    }
}

/// A failure's status: 503 when it says "not now", 504 for a timeout, else 502.
fn failure_status(cause: &Failure) -> StatusCode {
    if cause.is_unavailable() {
        StatusCode::SERVICE_UNAVAILABLE
    } else if cause.is_timeout() {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::BAD_GATEWAY
    }
}

/// A plain unpinned request's failure, said without the backend's own words (which may name
/// its hosts): unreachable, too slow, too large, or failed.
fn unified_failed(cause: &Failure) -> ApiError {
    let status = failure_status(cause);
    let (code, message) = match cause {
        _ if cause.is_unavailable() => {
            let message = "No backend serving this model could take the request. Retry shortly.";
            return match cause {
                // The backend's own 503 or 429: its pace is not the router's to set.
                Failure::Status(_) => ApiError::new(status, "shim_unavailable", message),
                // No backend would take it, or none could be reached: the router's own 503.
                _ => ApiError::unavailable("shim_unavailable", message),
            };
        }
        Failure::TooLarge(limit) => {
            let message = format!(
                "The answer is larger than the {limit} bytes relayed unstreamed. Ask for it with \"stream\": true."
            );
            return ApiError::new(status, "response_too_large", message).not_to_retry();
        }
        _ if cause.is_timeout() => {
            ("backend_timeout", "The backend serving this model did not answer in time.".to_string())
        }
        Failure::Status(backend) => (
            "backend_failed",
            format!("The backend serving this model failed the request (it answered {}).", backend.as_u16()),
        ),
        Failure::NotAnEventStream(backend) => (
            "backend_failed",
            format!(
                "The backend serving this model answered the streamed request with {} but no event stream.",
                backend.as_u16()
            ),
        ),
        _ => ("backend_failed", "The exchange with the backend serving this model broke off.".to_string()),
    };
    ApiError::new(status, code, message)
}

/// This replica had no room to hold a buffered answer.
fn server_busy() -> ApiError {
    ApiError::unavailable(
        "server_busy",
        "The router holds as many buffered answers as it may. Retry shortly, or ask for a streamed answer.",
    )
}

/// The decode arm's answer, sorted as [`failure_status`] sorts. `stale_pins`: the frontend
/// refused the workers themselves, which no check of the request would mend.
fn decode_failed(cause: &Failure, fallback: Option<&Failure>, stale_pins: bool) -> ApiError {
    let status = failure_status(cause);
    let what = match cause {
        Failure::Status(shim_status) => format!("the Dynamo frontend answered {}", shim_status.as_u16()),
        Failure::NotAnEventStream(shim_status) => {
            format!("the Dynamo frontend answered {} but no event stream", shim_status.as_u16())
        }
        _ if cause.is_unavailable() => "no Dynamo frontend replica could be reached".to_string(),
        _ if cause.is_timeout() => "the Dynamo frontend did not answer in time".to_string(),
        _ => "the exchange with the Dynamo frontend broke off".to_string(),
    };
    let retried = if fallback.is_some() { " and the retry without worker pins also failed" } else { "" };
    let message = match cause {
        // The answer came; retrying would bring it again, as large.
        Failure::TooLarge(limit) => format!(
            "The request's answer is larger than the {limit} bytes relayed unstreamed{retried}. Ask for it with \"stream\": true."
        ),
        // The unpinned backend refused the request itself: retrying would be refused again.
        _ if let Some(Failure::Status(refused)) = fallback
            && refuses_request(*refused) =>
        {
            format!(
                "The request failed on its assigned workers: {what}, and the retry without worker pins was refused \
                 ({}). Check the request: the model server may not accept it.",
                refused.as_u16()
            )
        }
        Failure::Status(_) if stale_pins => format!(
            "The request failed on its assigned workers: {what}, refusing the workers this router chose (its view of \
             the fleet was behind the frontend's){retried}. Retry the request: the router is told of the change."
        ),
        // A refusal that may be of the request itself (the frontend checks some of it only once
        // it is pinned): retrying an invalid request would fail the same way.
        Failure::Status(shim_status) if refuses_request(*shim_status) => {
            format!(
                "The request failed on its assigned workers: {what}{retried}. If it fails again, check the request: \
                 the frontend may have refused it (a streamed request is shown the frontend's reason)."
            )
        }
        // Nothing was sent to the workers: saying they failed would send the reader after them.
        Failure::NoReplica | Failure::BudgetSpent(_) | Failure::Send(_) if cause.is_unavailable() => format!(
            "No Dynamo frontend replica could be reached, so the request never reached the workers assigned to \
             it{retried}. Retry shortly."
        ),
        // The frontend fell silent, or the connection to it broke: the router charges the
        // frontend (its breaker), not the workers, and so does its message.
        Failure::Send(SendError::ShimSilent(_) | SendError::Exchange(_)) | Failure::Body(_) => format!(
            "The request failed between this router and the Dynamo frontend: {what}{retried}. Retry the request."
        ),
        _ => format!(
            "The request failed on its assigned workers: {what}{retried}. Retry the request; if it keeps failing, the workers may be restarting."
        ),
    };
    let error = ApiError::new(status, "disaggregated_decode_failed", message);
    // The answer would be as large again; the model server refused the request unpinned too.
    let same_again = matches!(cause, Failure::TooLarge(_))
        || matches!(fallback, Some(Failure::TooLarge(_)))
        || matches!(fallback, Some(Failure::Status(refused)) if refuses_request(*refused));
    if same_again { error.not_to_retry() } else { error }
}

/// Whether a backend's 4xx may refuse the request itself, rather than say "not now" (408,
/// 429) or "not here" (404: the model's workers are gone).
fn refuses_request(status: StatusCode) -> bool {
    status.is_client_error()
        && ![StatusCode::NOT_FOUND, StatusCode::REQUEST_TIMEOUT, StatusCode::TOO_MANY_REQUESTS].contains(&status)
}

/// The most of a client's method a 405 echoes: real ones are a few letters.
const MAX_ECHOED_METHOD_CHARS: usize = 16;

fn echo(model: &str) -> String {
    let cut: String = model.chars().take(MAX_ECHOED_MODEL_CHARS).collect();
    format!("{cut:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_routers_own_503s_ask_the_client_to_retry_after_a_second_and_a_backends_do_not() {
        let retry_after = |error: ApiError| {
            let response = error.into_response();
            response.headers().get("retry-after").map(|v| v.to_str().unwrap_or("?").to_owned())
        };
        assert_eq!(retry_after(RequestError::Busy.into()).as_deref(), Some("1"));
        assert_eq!(retry_after(DispatchError::NoShim.into()).as_deref(), Some("1"));
        // Unified routing's own: no backend would take the request, or none could be reached.
        let refused = || SendError::Connect(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        for own in [Failure::NoReplica, Failure::BudgetSpent(refused()), Failure::Send(refused())] {
            assert_eq!(retry_after(DispatchError::UnifiedFailed(own).into()).as_deref(), Some("1"));
        }
        assert_eq!(retry_after(SelectError::NoFleetView.into()).as_deref(), Some("1"));
        let model = "m".to_string();
        assert_eq!(retry_after(SelectError::NoWorkers { model }.into()).as_deref(), Some("1"));
        // A backend's 503 becomes the router's 503 too, without the header: its own pace is
        // not the router's to set.
        let refused = DispatchError::UnifiedFailed(Failure::Status(StatusCode::SERVICE_UNAVAILABLE));
        let answer: ApiError = refused.into();
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry_after(answer), None);
        let slow_down = DispatchError::UnifiedFailed(Failure::Status(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(retry_after(slow_down.into()), None);
        let bad = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "x");
        assert_eq!(retry_after(bad), None);
        assert_eq!(retry_after(HeadError::Busy.into()).as_deref(), Some("1"), "the server's own busy too");
        let unknown_coding = ApiError::from(HeadError::UnsupportedCoding);
        assert_eq!(unknown_coding.status, StatusCode::NOT_IMPLEMENTED);
        assert_eq!(unknown_coding.retry, Retry::Never, "a 501 an OpenAI client would otherwise retry");
    }

    /// An OpenAI client retries every 5xx twice unless told not to: the answers a retry would
    /// only repeat say so, the others leave it to the client. Every body has OpenAI's four
    /// fields.
    #[tokio::test]
    async fn answers_a_retry_would_repeat_tell_the_client_not_to_retry() {
        let should_retry = |error: ApiError| {
            let response = error.into_response();
            response.headers().get("x-should-retry").map(|v| v.to_str().unwrap_or("?").to_owned())
        };
        let too_large = Failure::TooLarge(32 << 20);
        assert_eq!(should_retry(decode_failed(&too_large, None, false)).as_deref(), Some("false"));
        assert_eq!(
            should_retry(DispatchError::UnifiedFailed(Failure::TooLarge(32 << 20)).into()).as_deref(),
            Some("false")
        );
        let server_error = Failure::Status(StatusCode::INTERNAL_SERVER_ERROR);
        let bad_request = Failure::Status(StatusCode::BAD_REQUEST);
        assert_eq!(should_retry(decode_failed(&server_error, Some(&bad_request), false)).as_deref(), Some("false"));
        assert_eq!(should_retry(decode_failed(&server_error, Some(&too_large), false)).as_deref(), Some("false"));
        // Pins the frontend no longer knows, and the resend without them refused as a bad
        // request too: the body says to check the request, as the header does.
        let refused = decode_failed(&bad_request, Some(&bad_request), true);
        assert!(refused.message.contains("Check the request"), "{}", refused.message);
        assert_eq!(should_retry(refused).as_deref(), Some("false"));
        // A failure a retry may mend: the workers, or pins the frontend no longer knows.
        assert_eq!(should_retry(decode_failed(&server_error, None, false)), None);
        assert_eq!(should_retry(decode_failed(&bad_request, None, true)), None);
        let overloaded = Failure::Status(StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(should_retry(decode_failed(&server_error, Some(&overloaded), false)), None);

        let body = ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", "x").into_response().into_body();
        let bytes = http_body_util::BodyExt::collect(body).await.expect("a body").to_bytes();
        let value: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let mut fields: Vec<&str> = value["error"].as_object().expect("an error").keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(fields, ["code", "message", "param", "type"]);
        assert!(value["error"]["param"].is_null());
    }

    #[test]
    fn a_405_echoes_only_the_start_of_a_method_however_long() {
        let long = Method::from_bytes("A".repeat(60 << 10).as_bytes()).expect("a token");
        let error = ApiError::no_endpoint(StatusCode::METHOD_NOT_ALLOWED, &long, "/v1/models");
        assert!(
            error.message.starts_with(&format!("{} is not served at /v1/models.", "A".repeat(16))),
            "{}",
            error.message
        );
        assert!(error.message.len() < 200, "{} bytes", error.message.len());
    }

    /// A fallback the unified backend refused as a bad request (a prompt past its context)
    /// would be refused again: the client is told to check the request, not to retry it.
    #[test]
    fn a_fallback_refused_as_a_bad_request_says_to_check_the_request_not_to_retry() {
        let server_error = Failure::Status(StatusCode::INTERNAL_SERVER_ERROR);
        let refused = decode_failed(&server_error, Some(&Failure::Status(StatusCode::BAD_REQUEST)), false);
        assert_eq!((refused.status, refused.code), (StatusCode::BAD_GATEWAY, "disaggregated_decode_failed"));
        assert!(
            refused.message.contains("refused (400)") && refused.message.contains("Check the request"),
            "{}",
            refused.message
        );
        assert!(!refused.message.contains("Retry"), "{}", refused.message);
        let busy = decode_failed(&server_error, Some(&Failure::Status(StatusCode::TOO_MANY_REQUESTS)), false);
        assert!(busy.message.contains("Retry"), "429 says not now: {}", busy.message);
    }

    #[test]
    fn an_answer_too_large_to_relay_says_to_stream_it_not_to_retry() {
        let error = decode_failed(&Failure::TooLarge(32 << 20), None, false);
        assert_eq!((error.status, error.code), (StatusCode::BAD_GATEWAY, "disaggregated_decode_failed"));
        assert!(error.message.contains("\"stream\": true") && !error.message.contains("Retry"), "{}", error.message);
        let broke = decode_failed(&Failure::Status(StatusCode::INTERNAL_SERVER_ERROR), None, false);
        assert!(broke.message.contains("answered 500") && broke.message.contains("Retry"), "{}", broke.message);
    }

    #[test]
    fn a_long_client_model_is_echoed_cut_short() {
        let model = "m".repeat(10 * MAX_ECHOED_MODEL_CHARS);
        let error = ApiError::from(SelectError::ModelNotFound { model });
        assert_eq!((error.status, error.code), (StatusCode::NOT_FOUND, "model_not_found"));
        assert!(error.message.contains(&"m".repeat(MAX_ECHOED_MODEL_CHARS)));
        assert!(!error.message.contains(&"m".repeat(MAX_ECHOED_MODEL_CHARS + 1)));
    }

    #[test]
    fn decode_failures_say_unavailable_timeout_or_bad_gateway() {
        let status = |cause: Failure| decode_failed(&cause, None, false).status;
        assert_eq!(status(Failure::NoReplica), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(Failure::Status(StatusCode::TOO_MANY_REQUESTS)), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status(Failure::Status(StatusCode::INTERNAL_SERVER_ERROR)), StatusCode::BAD_GATEWAY);
        assert_eq!(status(Failure::BodyTimeout(std::time::Duration::from_secs(1))), StatusCode::GATEWAY_TIMEOUT);
        // Unreachable shims: the workers were never contacted, and the message says so.
        let refused = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        for unreached in [
            Failure::NoReplica,
            Failure::BudgetSpent(SendError::Connect(refused())),
            Failure::Send(SendError::Connect(refused())),
        ] {
            let error = decode_failed(&unreached, None, false);
            assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE);
            assert!(
                error.message.contains("never reached the workers") && !error.message.contains("failed on its"),
                "{unreached}: {}",
                error.message
            );
        }
        // The frontend fell silent or its connection broke: the router blames it, not the workers.
        for frontends in [
            Failure::Send(SendError::ShimSilent(std::time::Duration::from_secs(300))),
            Failure::Send(SendError::Exchange(crate::dispatch::ExchangeError::Closed)),
            Failure::Body("connection reset".into()),
        ] {
            let error = decode_failed(&frontends, None, false);
            assert!(
                error.message.contains("between this router and the Dynamo frontend")
                    && !error.message.contains("workers may be restarting"),
                "{frontends}: {}",
                error.message
            );
        }
        let both = decode_failed(&Failure::Status(StatusCode::BAD_REQUEST), Some(&Failure::NoReplica), false);
        assert!(both.message.contains("answered 400") && both.message.contains("without worker pins also failed"));
        // A refusal that may be the request's own says to check it, not only to retry.
        assert!(both.message.contains("check the request"), "{}", both.message);
        for retry in [StatusCode::INTERNAL_SERVER_ERROR, StatusCode::NOT_FOUND, StatusCode::TOO_MANY_REQUESTS] {
            let failed = decode_failed(&Failure::Status(retry), None, false);
            assert!(failed.message.contains("Retry the request"), "{retry}: {}", failed.message);
        }
        // 1.6.1's 400 "Invalid request" for a worker id it no longer knows: the router's stale
        // view, never the client's request to check.
        let stale = decode_failed(&Failure::Status(StatusCode::BAD_REQUEST), None, true);
        assert_eq!(stale.status, StatusCode::BAD_GATEWAY);
        assert!(
            stale.message.contains("Retry the request") && !stale.message.contains("check the request"),
            "{}",
            stale.message
        );
    }

    #[test]
    fn unified_failures_say_what_happened_and_never_that_a_backend_that_answered_was_unreachable() {
        let answer = |cause: Failure| {
            let error = unified_failed(&cause);
            (error.status.as_u16(), error.code)
        };
        assert_eq!(answer(Failure::NoReplica), (503, "shim_unavailable"));
        assert_eq!(answer(Failure::Status(StatusCode::SERVICE_UNAVAILABLE)), (503, "shim_unavailable"));
        assert_eq!(answer(Failure::Status(StatusCode::INTERNAL_SERVER_ERROR)), (502, "backend_failed"));
        assert_eq!(answer(Failure::BodyTimeout(std::time::Duration::from_secs(1))), (504, "backend_timeout"));
        assert_eq!(answer(Failure::TooLarge(1 << 25)), (502, "response_too_large"));
        assert_eq!(answer(Failure::Body("reset".into())), (502, "backend_failed"));
        assert_eq!(answer(Failure::NotAnEventStream(StatusCode::NO_CONTENT)), (502, "backend_failed"));
        let not_a_stream = unified_failed(&Failure::NotAnEventStream(StatusCode::OK));
        assert!(not_a_stream.message.contains("200 but no event stream"), "{}", not_a_stream.message);
        let failed = unified_failed(&Failure::Status(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(failed.message.contains("answered 500"), "{}", failed.message);
    }
}
