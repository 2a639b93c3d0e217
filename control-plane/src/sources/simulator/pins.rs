//! How the simulated shim reads a request's worker pins, the way `dynamo.frontend
//! --router-mode direct` 1.6.1 does (the fixtures' `http-exchanges.jsonl`): decimal ids from
//! the `x-dynamo-*` headers, their aliases or the `nvext` body fields (hex is silently
//! ignored), and its refusals. Pure: a function of the request and the simulated fleet.

use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;

const DECODE_ID: [&str; 2] = ["x-dynamo-worker-instance-id", "x-worker-instance-id"];
const PREFILL_ID: [&str; 2] = ["x-dynamo-prefill-instance-id", "x-prefill-instance-id"];
const DECODE_RANK: [&str; 3] = ["x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank"];
const PREFILL_RANK: [&str; 2] = ["x-dynamo-prefill-dp-rank", "x-prefill-dp-rank"];

/// Every simulated worker serves one rank.
pub const DP_SIZE: u32 = 1;

/// The workers a request runs on. In an aggregated fleet the prefill worker is the decode one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pins {
    pub prefill: u64,
    pub decode: u64,
    pub prefill_dp_rank: Option<u32>,
    pub decode_dp_rank: Option<u32>,
}

/// A refusal with 1.6.1's status and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    pub fn invalid() -> Self {
        Self::new(StatusCode::BAD_REQUEST, "Invalid request")
    }

    /// 1.6.1's answer for a worker that died while its lease lives.
    pub fn unavailable() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "Service temporarily unavailable")
    }
}

/// The ids the simulated fleet holds.
#[derive(Clone, Copy, Debug)]
pub struct Known<'a> {
    pub prefill: &'a [u64],
    pub decode: &'a [u64],
}

/// A request's pins, in the order 1.6.1 checks them. The prefill pin is checked before any
/// worker is touched; the decode pin only once the prefill ran (the fixtures: a request
/// refused for its decode pin took a prefill's time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// The worker that prefills: the decode worker itself in an aggregated fleet.
    pub prefill: u64,
    /// Every pin, or the refusal of the decode pin.
    pub pins: Result<Pins, Refusal>,
}

/// Reads and checks the pins of a request; an `Err` is refused before any worker runs.
pub fn resolve(headers: &HeaderMap, body: &Value, known: Known<'_>) -> Result<Resolution, Refusal> {
    let decode = header(headers, &DECODE_ID).or_else(|| nvext(body, "backend_instance_id"));
    let prefill = header(headers, &PREFILL_ID).or_else(|| nvext(body, "prefill_worker_id"));
    // The ranks are checked after the prefill id, as 1.6.1's prefill router checks them in its
    // output (and before the decode id, which is refused only once the prefill ran).
    let ranks = || Ok::<_, Refusal>((rank(headers, &PREFILL_RANK)?, rank(headers, &DECODE_RANK)?));
    if known.prefill.is_empty() {
        // Aggregated: the decode worker does both phases; a prefill pin must name it.
        let decode = decode.filter(|d| known.decode.contains(d)).ok_or_else(Refusal::invalid)?;
        if prefill.is_some_and(|p| p != decode) {
            return Err(Refusal::invalid());
        }
        let (prefill_dp_rank, decode_dp_rank) = ranks()?;
        let pins = Pins { prefill: decode, decode, prefill_dp_rank, decode_dp_rank };
        return Ok(Resolution { prefill: decode, pins: Ok(pins) });
    }
    // 1.6.1 fails a missing prefill pin with a generic 500 before touching any worker.
    let prefill = prefill.ok_or_else(failed)?;
    if !known.prefill.contains(&prefill) {
        return Err(Refusal::invalid());
    }
    let (prefill_dp_rank, decode_dp_rank) = ranks()?;
    let pins = match decode {
        Some(decode) if known.decode.contains(&decode) => Ok(Pins { prefill, decode, prefill_dp_rank, decode_dp_rank }),
        _ => Err(Refusal::invalid()),
    };
    Ok(Resolution { prefill, pins })
}

fn failed() -> Refusal {
    Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, "Failed to generate completions")
}

fn header(headers: &HeaderMap, names: &[&str]) -> Option<u64> {
    names.iter().find_map(|name| headers.get(*name)?.to_str().ok()?.trim().parse().ok())
}

fn nvext(body: &Value, field: &str) -> Option<u64> {
    body.get("nvext")?.get(field)?.as_u64()
}

fn rank(headers: &HeaderMap, names: &[&str]) -> Result<Option<u32>, Refusal> {
    match header(headers, names) {
        Some(rank) if rank >= u64::from(DP_SIZE) => {
            Err(Refusal::new(StatusCode::BAD_REQUEST, format!("dp_rank {rank} is out of bounds for dp_size {DP_SIZE}")))
        }
        rank => Ok(rank.and_then(|r| u32::try_from(r).ok())),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use serde_json::json;

    use super::*;

    const DISAGG: Known<'static> = Known { prefill: &[1, 2], decode: &[3, 4] };
    const AGG: Known<'static> = Known { prefill: &[], decode: &[3, 4] };

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    /// Name, headers, body, fleet and the expected outcome.
    type Case<'a> = (&'static str, HeaderMap, &'a Value, Known<'static>, Result<Resolution, Refusal>);

    fn pins(prefill: u64, decode: u64) -> Result<Resolution, Refusal> {
        Ok(Resolution { prefill, pins: Ok(Pins { prefill, decode, prefill_dp_rank: None, decode_dp_rank: None }) })
    }

    /// The prefill runs on `prefill`, then the decode pin is refused.
    fn decode_refused(prefill: u64) -> Result<Resolution, Refusal> {
        Ok(Resolution { prefill, pins: Err(Refusal::invalid()) })
    }

    #[test]
    #[rustfmt::skip]
    fn pins_and_refusals_follow_the_real_frontend() {
        let none = json!({});
        let body_ids = json!({"nvext": {"backend_instance_id": 4, "prefill_worker_id": 2}});
        let invalid = Err(Refusal::invalid());
        let cases: Vec<Case<'_>> = vec![
            ("both pins", headers(&[("x-dynamo-worker-instance-id", "3"), ("x-dynamo-prefill-instance-id", "1")]), &none, DISAGG, pins(1, 3)),
            ("aliases", headers(&[("x-worker-instance-id", "4"), ("x-prefill-instance-id", "2")]), &none, DISAGG, pins(2, 4)),
            ("nvext body ids", HeaderMap::new(), &body_ids, DISAGG, pins(2, 4)),
            ("no pins", HeaderMap::new(), &none, DISAGG, Err(failed())),
            ("decode only", headers(&[("x-dynamo-worker-instance-id", "3")]), &none, DISAGG, Err(failed())),
            ("prefill only", headers(&[("x-dynamo-prefill-instance-id", "1")]), &none, DISAGG, decode_refused(1)),
            ("hex ignored", headers(&[("x-dynamo-worker-instance-id", "0x3"), ("x-dynamo-prefill-instance-id", "1")]), &none, DISAGG, decode_refused(1)),
            ("unknown decode", headers(&[("x-dynamo-worker-instance-id", "9"), ("x-dynamo-prefill-instance-id", "1")]), &none, DISAGG, decode_refused(1)),
            ("unknown prefill", headers(&[("x-dynamo-worker-instance-id", "3"), ("x-dynamo-prefill-instance-id", "9")]), &none, DISAGG, invalid.clone()),
            ("aggregated", headers(&[("x-dynamo-worker-instance-id", "4")]), &none, AGG, pins(4, 4)),
            ("aggregated without pin", HeaderMap::new(), &none, AGG, invalid.clone()),
            ("aggregated unknown", headers(&[("x-dynamo-worker-instance-id", "9")]), &none, AGG, invalid.clone()),
        ];
        for (name, headers, body, known, want) in cases {
            assert_eq!(resolve(&headers, body, known), want, "{name}");
        }
    }

    #[test]
    fn dp_ranks_beyond_the_workers_size_are_refused() {
        let base = [("x-dynamo-worker-instance-id", "3"), ("x-dynamo-prefill-instance-id", "1")];
        let ok = resolve(&headers(&[base[0], base[1], ("x-dynamo-dp-rank", "0")]), &json!({}), DISAGG);
        assert_eq!(ok.map(|r| r.pins.map(|p| p.decode_dp_rank)), Ok(Ok(Some(0))));
        let refused = resolve(&headers(&[base[0], base[1], ("x-dynamo-prefill-dp-rank", "5")]), &json!({}), DISAGG);
        assert_eq!(refused.map_err(|r| r.message), Err("dp_rank 5 is out of bounds for dp_size 1".to_owned()));
        // Only once the ids passed: a missing or unknown prefill id is refused as such.
        let missing = resolve(&headers(&[base[0], ("x-dynamo-dp-rank", "5")]), &json!({}), DISAGG);
        assert_eq!(missing, Err(failed()));
        let unknown = [base[0], ("x-dynamo-prefill-instance-id", "9"), ("x-dynamo-prefill-dp-rank", "5")];
        assert_eq!(resolve(&headers(&unknown), &json!({}), DISAGG), Err(Refusal::invalid()));
    }
}
