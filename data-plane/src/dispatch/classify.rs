//! What a shim's non-2xx answer means, per the seed's failure semantics applied to what the
//! real `dynamo.frontend --router-mode direct` 1.6.1 sends. A pure function of the status, the
//! (bounded) body and whether the request streams.
//!
//! | shim answer | verdict |
//! |---|---|
//! | body opens with the refusal of a missing prefill id (any status), buffered or a stream's non-2xx head | `PrefillRefused`: 503, no retry, no fallback |
//! | 4xx other than 408 and 429, on a streaming request, unless it refuses a pin or names the missing prefill id | `Relay`: passed to the client (its body as [`super::disclosure`] allows) |
//! | anything else, 1.6.1's generic 500 and its 404 for a model whose workers left included | `DecodeFailed`: fallback or `disaggregated_decode_failed` |
//!
//! A 404 is the router's stale view of the fleet (it pinned a worker the frontend has dropped),
//! not a model the client named wrongly: the seed's decode arm, like any other shim failure.

use axum::http::StatusCode;

/// The refusal of a direct-mode frontend whose request lacks the prefill pin (the seed's
/// `DIRECT_MODE_PREFILL_ID_ERROR`). 1.6.1 logs it but answers a generic 500 instead.
pub const DIRECT_MODE_PREFILL_ID_ERROR: &str = "Prefill worker ID required in Direct routing mode";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    PrefillRefused,
    Relay,
    DecodeFailed,
}

pub fn classify(status: StatusCode, body: &[u8], stream: bool) -> Verdict {
    if names_missing_prefill(body) {
        // The seed's 503, for a buffered send and a stream's non-2xx head alike ("Direct-mode
        // refusals on buffered sends and non-2xx streaming heads return 503"). Never relayed:
        // the refusal is of the router's pairing, not of the client's request.
        Verdict::PrefillRefused
    } else if stream && status.is_client_error() && !retryable_client_error(status) && !blames_pins(status, body) {
        // The client's own mistake. A refused pin (an id the frontend no longer knows, as
        // when a worker's lease expired before this replica heard) is the router's, and
        // relaying its 400 would tell the client its valid request was invalid.
        Verdict::Relay
    } else {
        Verdict::DecodeFailed
    }
}

/// Whether a pinned non-2xx answer says the pinned workers failed, rather than the client's
/// request or the router's pairing: a 5xx but a gateway's 502 or 504 (which says the shim was
/// not reached); a 404 (the model's workers are gone from the frontend); or 1.6.1's refusal of
/// a pin it cannot serve, a 400 "Invalid request" for an id it no longer knows or a dp rank out
/// of bounds. A 400 about the body is the client's, and a missing prefill pin is the pool's.
pub fn blames_pins(status: StatusCode, body: &[u8]) -> bool {
    if names_missing_prefill(body) {
        return false;
    }
    let refuses_pin = || {
        serde_json::from_slice::<serde_json::Value>(body).ok().is_some_and(|refusal| {
            refusal.get("message").and_then(serde_json::Value::as_str).is_some_and(|message| {
                message == UNKNOWN_PIN_MESSAGE
                    || (message.starts_with("dp_rank ") && message.contains(" out of bounds"))
            })
        })
    };
    let workers_failed = status.is_server_error() && !super::attempt::is_gateway_failure(status);
    workers_failed || status == StatusCode::NOT_FOUND || (status == StatusCode::BAD_REQUEST && refuses_pin())
}

/// 1.6.1's message for a pinned worker id it does not know (`unknown_decode_id`,
/// `unknown_prefill_id`, `agg_unknown_worker_id` in the captures).
const UNKNOWN_PIN_MESSAGE: &str = "Invalid request";

/// 408 and 429 say "not now", not "bad request": they take the failure arm even when streaming.
fn retryable_client_error(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT || status == StatusCode::TOO_MANY_REQUESTS
}

/// Whether the answer is the frontend's own refusal: its text (or, for an OpenAI-shaped error
/// body, its `message`) opens with the refusal, perhaps behind the generic failure's prefix.
/// Anchored, not searched for: a frontend that refuses a client's body quotes the offending
/// value in its message, and a client must not be able to raise the prefill pool's 503 (and
/// skip the fallback) by sending the refusal's words as, say, its `max_tokens`.
fn names_missing_prefill(body: &[u8]) -> bool {
    let json = serde_json::from_slice::<serde_json::Value>(body).ok();
    let text = match json.as_ref().and_then(|refusal| refusal.get("message")) {
        Some(message) => message.as_str().unwrap_or_default(),
        None if json.is_some() => "",
        None => std::str::from_utf8(body).unwrap_or_default().trim_start(),
    };
    let text = text.strip_prefix(GENERIC_FAILURE_PREFIX).unwrap_or(text);
    text.get(..DIRECT_MODE_PREFILL_ID_ERROR.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(DIRECT_MODE_PREFILL_ID_ERROR))
}

/// How 1.6.1 words a failed generation, which a frontend naming its cause would extend.
const GENERIC_FAILURE_PREFIX: &str = "Failed to generate completions: ";

#[cfg(test)]
mod tests {
    use super::*;

    const GENERIC_500: &str =
        r#"{"message":"Failed to generate completions","type":"Internal Server Error","code":500}"#;
    const INVALID_400: &str = r#"{"message":"Invalid request","type":"Bad Request","code":400}"#;
    const DP_RANK_400: &str =
        r#"{"message":"dp_rank 5 is out of bounds for dp_size 1","type":"Bad Request","code":400}"#;
    const DEAD_503: &str = r#"{"message":"Service temporarily unavailable","type":"Service Unavailable","code":503}"#;
    const NAMED_REFUSAL: &str = "Prefill worker ID required in Direct routing mode but none found in request.";

    #[test]
    fn only_refusals_of_the_pins_or_the_frontends_server_errors_blame_the_pinned_workers() {
        let body_refused = r#"{"message":"Failed to deserialize the JSON body into the target type: key must be a string at line 1 column 2","type":"Bad Request","code":400}"#;
        let rows: [(u16, &str, bool); 12] = [
            (500, GENERIC_500, true),
            // A gateway in front of the shim: the shim was not reached, the workers never asked.
            (502, "<html>502 Bad Gateway</html>", false),
            (504, "", false),
            (503, DEAD_503, true),
            (404, "", true),
            (400, INVALID_400, true),
            (400, DP_RANK_400, true),
            (400, body_refused, false),
            (422, r#"{"message":"Invalid request"}"#, false),
            (400, "Invalid request", false),
            (429, "", false),
            (500, NAMED_REFUSAL, false),
        ];
        for (status, body, blamed) in rows {
            let status = StatusCode::from_u16(status).expect("status");
            assert_eq!(blames_pins(status, body.as_bytes()), blamed, "{status} {body}");
        }
    }

    #[test]
    fn verdicts_follow_the_seed_table() {
        use Verdict::*;
        let client_400 = r#"{"message":"Failed to deserialize the JSON body into the target type: messages: missing field","type":"Bad Request","code":400}"#;
        let rows: [(u16, &str, bool, Verdict); 22] = [
            (500, GENERIC_500, false, DecodeFailed),
            (500, GENERIC_500, true, DecodeFailed),
            (500, NAMED_REFUSAL, false, PrefillRefused),
            (503, NAMED_REFUSAL, true, PrefillRefused),
            (400, &NAMED_REFUSAL.to_ascii_lowercase(), false, PrefillRefused),
            (400, NAMED_REFUSAL, true, PrefillRefused),
            (
                500,
                &format!(r#"{{"message":"{NAMED_REFUSAL}","type":"Internal Server Error","code":500}}"#),
                false,
                PrefillRefused,
            ),
            (
                500,
                &format!(r#"{{"message":"Failed to generate completions: {NAMED_REFUSAL}","code":500}}"#),
                false,
                PrefillRefused,
            ),
            // A client's value quoted back in a refusal of its body is the client's mistake.
            (
                400,
                &format!(
                    r#"{{"message":"Failed to deserialize the JSON body into the target type: max_tokens: invalid type: string \"{NAMED_REFUSAL}\", expected u32","type":"Bad Request","code":400}}"#
                ),
                true,
                Relay,
            ),
            (400, &format!(r#"{{"message":"Invalid request","detail":"{NAMED_REFUSAL}"}}"#), false, DecodeFailed),
            (400, INVALID_400, false, DecodeFailed),
            (400, INVALID_400, true, DecodeFailed),
            (400, DP_RANK_400, true, DecodeFailed),
            (400, client_400, true, Relay),
            (422, "", true, Relay),
            (408, "", true, DecodeFailed),
            (429, "", true, DecodeFailed),
            (503, DEAD_503, false, DecodeFailed),
            (503, DEAD_503, true, DecodeFailed),
            (404, "", false, DecodeFailed),
            (404, r#"{"message":"Model not found","type":"Not Found","code":404}"#, true, DecodeFailed),
            (502, "", true, DecodeFailed),
        ];
        for (status, body, stream, expected) in rows {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT);
            assert_eq!(classify(status, body.as_bytes(), stream), expected, "{status} {body:?} stream={stream}");
        }
    }
}
