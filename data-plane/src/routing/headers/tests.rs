use std::sync::Arc;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use continuum_proto::model::WorkerKey;
use serde_json::{Value, json};

use super::*;
use crate::routing::picker::{Pin, Reason, Selection};

/// Header name and value pairs, as a client or shim sent them.
type Pairs<'a> = &'a [(&'a str, &'a str)];

fn headers(pairs: Pairs<'_>) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("test header name");
        map.append(name, HeaderValue::from_str(value).expect("test header value"));
    }
    map
}

fn names(map: &HeaderMap) -> Vec<String> {
    let mut names: Vec<String> = map.keys().map(|n| n.as_str().to_string()).collect();
    names.sort();
    names
}

fn pin(id: u64, dp_rank: Option<u32>) -> Pin {
    Pin { worker: WorkerKey::new("dynamo", id), dp_rank }
}

fn selection(decode: Pin, prefill: Option<Pin>) -> Selection {
    Selection {
        namespace: Arc::from("dynamo"),
        model: "tiny".into(),
        decode,
        prefill_reason: if prefill.is_some() { Reason::Load } else { Reason::NoPrefillPool },
        prefill,
        decode_reason: Reason::Load,
        cached_tokens: 0,
    }
}

fn value<'a>(map: &'a HeaderMap, name: &str) -> Option<&'a str> {
    map.get(name).map(|v| v.to_str().expect("ascii"))
}

/// The one rule ([`is_routing_header`]) the ingress, the encoder and a shim's response all
/// apply, here through the response's strip. Names as a header map holds them, lowercase:
/// mixed case as a client sends it is the raw bytes' table below
/// (`no_client_routing_header_passes_the_ingress_or_the_encoder`).
#[test]
fn routing_headers_are_stripped_and_others_kept() {
    let cases: &[(&str, Pairs<'_>, &[&str])] = &[
        (
            "canonical pins",
            &[(WORKER_INSTANCE_ID, "1"), (PREFILL_INSTANCE_ID, "2"), (DP_RANK, "0"), (PREFILL_DP_RANK, "1")],
            &[],
        ),
        ("alias worker id", &[("x-worker-instance-id", "1")], &[]),
        ("alias prefill id", &[("x-prefill-instance-id", "1")], &[]),
        ("alias dp rank", &[("x-dp-rank", "1")], &[]),
        ("alias data parallel rank", &[("x-data-parallel-rank", "1")], &[]),
        ("alias prefill dp rank", &[("x-prefill-dp-rank", "1")], &[]),
        ("any x-dynamo- header", &[("x-dynamo-anything-new", "x"), ("x-dynamo-", "x")], &[]),
        (
            "repeated",
            &[(WORKER_INSTANCE_ID, "1"), (WORKER_INSTANCE_ID, "2"), ("x-dp-rank", "0"), ("x-dp-rank", "1")],
            &[],
        ),
        ("hex values", &[(WORKER_INSTANCE_ID, "0x6a6c"), ("x-worker-instance-id", "6a6cdeadbeef")], &[]),
        (
            "mentions dynamo but is not routing",
            &[("x-my-dynamo-id", "1"), ("dynamo-worker", "2"), ("x-dynamo", "3"), ("x-dynamoworker", "4")],
            &["dynamo-worker", "x-dynamo", "x-dynamoworker", "x-my-dynamo-id"],
        ),
        (
            "ordinary headers kept",
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer k"),
                ("x-backend", ""),
                ("x-dynamo-dp-rank", "1"),
            ],
            &["authorization", "content-type", "x-backend"],
        ),
        (
            "near-miss alias kept",
            &[("x-worker-instance", "1"), ("x-dp-ranks", "1")],
            &["x-dp-ranks", "x-worker-instance"],
        ),
    ];
    for (name, sent, kept) in cases {
        let mut map = headers(sent);
        strip_response(&mut map);
        let mut expected: Vec<String> = kept.iter().map(|k| k.to_string()).collect();
        expected.sort();
        assert_eq!(names(&map), expected, "{name}");
    }
}

/// The same table on the request path, as the bytes a client sends: the ingress's head parser
/// keeps none of a chat completion's headers and no routing header for any other endpoint
/// (names as sent, mixed case and repeats included), and the encoder writes, of any headers
/// handed to it, only the picker's pins as routing headers.
#[test]
fn no_client_routing_header_passes_the_ingress_or_the_encoder() {
    use axum::http::{Method, Uri};

    use crate::dispatch::wire::encode_request;
    use crate::server::head::parse_request;

    let sent: Pairs<'_> = &[
        ("X-Dynamo-Worker-Instance-Id", "1"),
        ("x-dynamo-prefill-instance-id", "0x2"),
        ("X-DYNAMO-DP-RANK", "0"),
        ("x-dynamo-prefill-dp-rank", "1"),
        ("x-dynamo-anything-new", "x"),
        ("X-Worker-Instance-Id", "3"),
        ("x-worker-instance-id", "4"),
        ("X-PREFILL-INSTANCE-ID", "5"),
        ("x-dp-rank", "1"),
        ("X-Data-Parallel-Rank", "1"),
        ("x-prefill-dp-rank", "0"),
        ("accept", "application/json"),
    ];
    let raw = |target: &str| {
        let lines: String = sent.iter().map(|(name, value)| format!("{name}: {value}\r\n")).collect();
        format!("{target} HTTP/1.1\r\nhost: x\r\n{lines}content-length: 2\r\n\r\n{{}}")
    };
    let (chat, _) = parse_request(raw("POST /v1/chat/completions").as_bytes()).expect("a head").expect("whole");
    assert!(chat.headers.is_empty(), "a chat completion carries no header of the client's: {:?}", chat.headers);
    let (other, _) = parse_request(raw("GET /v1/models").as_bytes()).expect("a head").expect("whole");
    assert_eq!(names(&other.headers), ["accept", "content-length", "host"], "only the routing headers went");

    let mut out = Vec::new();
    let uri: Uri = "http://shim:8000/v1/chat/completions".parse().expect("uri");
    let pins = pins(&selection(pin(7, Some(1)), Some(pin(8, None))));
    encode_request(&mut out, &Method::POST, &uri, &headers(sent), pins, b"{}");
    let out = String::from_utf8(out).expect("ascii");
    let routing: Vec<&str> = out.lines().filter(|line| line.split(':').next().is_some_and(is_routing_header)).collect();
    assert_eq!(
        routing,
        [
            "x-dynamo-worker-instance-id: 7",
            "x-dynamo-dp-rank: 1",
            "x-dynamo-prefill-instance-id: 8",
            "x-dynamo-prefill-dp-rank: 0"
        ],
        "{out}"
    );
    assert!(out.contains("accept: application/json"), "{out}");
}

#[test]
fn kept_headers_keep_every_value() {
    let mut map = headers(&[("accept", "a"), ("accept", "b"), ("x-dynamo-dp-rank", "1")]);
    strip_response(&mut map);
    let values: Vec<&str> = map.get_all("accept").iter().map(|v| v.to_str().expect("ascii")).collect();
    assert_eq!(values, ["a", "b"]);
}

#[test]
fn body_routing_fields_are_stripped_and_other_nvext_fields_kept() {
    let cases: &[(&str, Value, Value)] = &[
        (
            "fixture body ids beside extra_fields",
            json!({"model": "tiny", "nvext": {"extra_fields": ["worker_id"], "backend_instance_id": 7668682560356784121_u64, "prefill_worker_id": 7668682560356784106_u64}}),
            json!({"model": "tiny", "nvext": {"extra_fields": ["worker_id"]}}),
        ),
        (
            "every routing field",
            json!({"nvext": {"backend_instance_id": 1, "prefill_worker_id": 2, "decode_worker_id": 3, "dp_rank": 0,
                "prefill_dp_rank": 1, "decode_dp_rank": 1, "data_parallel_rank": 1, "token_data": [1, 2, 3],
                "worker_id": {"decode_worker_id": 3}, "routing_constraints": {"required_taints": ["gpu-a"]},
                "greed_sampling": true}}),
            json!({"nvext": {"greed_sampling": true}}),
        ),
        (
            "only routing fields: nvext removed",
            json!({"model": "m", "nvext": {"token_data": [1]}}),
            json!({"model": "m"}),
        ),
        ("client's empty nvext forwarded", json!({"nvext": {}}), json!({"nvext": {}})),
        ("null nvext forwarded", json!({"nvext": null}), json!({"nvext": null})),
        ("nvext as an array, read field by field, removed", json!({"nvext": [null, null, null, 7]}), json!({})),
        ("nvext as a scalar removed", json!({"m": 1, "nvext": "7"}), json!({"m": 1})),
        (
            "hex string ids stripped too",
            json!({"nvext": {"backend_instance_id": "0x1f", "annotations": ["a"]}}),
            json!({"nvext": {"annotations": ["a"]}}),
        ),
        (
            "query-only annotations removed, the client's others kept",
            json!({"nvext": {"annotations": ["query_instance_id:", "formatted_prompt", "query_instance_id:decode", 7]}}),
            json!({"nvext": {"annotations": ["formatted_prompt", 7]}}),
        ),
        (
            "only query-only annotations: nvext removed",
            json!({"model": "m", "nvext": {"annotations": ["query_instance_id:prefill"]}}),
            json!({"model": "m"}),
        ),
        ("no nvext", json!({"model": "m", "backend_instance_id": 1}), json!({"model": "m", "backend_instance_id": 1})),
        ("not an object", json!([1, 2]), json!([1, 2])),
    ];
    for (name, sent, expected) in cases {
        // For a client that asked for disclosure: only the routing fields go.
        let mut body = sent.clone();
        strip_body_routing(&mut body, true);
        assert_eq!(&body, expected, "{name}");
    }
}

/// The frontend's echo of the pins is a disclosure: asked for without `x-backend`, it is not
/// asked for at all; the client's other extra fields stay.
#[test]
fn the_pins_echo_is_requested_only_for_a_client_that_asked_for_disclosure() {
    let cases = [
        (json!({"nvext": {"extra_fields": ["worker_id"]}}), json!({})),
        (
            json!({"nvext": {"extra_fields": ["timing", "worker_id", "worker_id"]}}),
            json!({"nvext": {"extra_fields": ["timing"]}}),
        ),
        (
            json!({"nvext": {"extra_fields": ["worker_id"], "greed_sampling": true}}),
            json!({"nvext": {"greed_sampling": true}}),
        ),
        (json!({"nvext": {"extra_fields": []}}), json!({})),
    ];
    for (sent, hidden) in cases {
        let mut body = sent.clone();
        strip_body_routing(&mut body, false);
        assert_eq!(body, hidden, "without x-backend: {sent}");
        let mut body = sent.clone();
        strip_body_routing(&mut body, true);
        assert_eq!(body, sent, "with x-backend, as sent");
    }
}

#[test]
fn pins_are_decimal_with_ranks_only_when_declared() {
    let big = 7_668_682_560_356_784_121_u64;
    let cases: &[(&str, Selection, Pairs<'_>)] = &[
        ("aggregated, no dp", selection(pin(big, None), None), &[(WORKER_INSTANCE_ID, "7668682560356784121")]),
        (
            "aggregated, dp rank 0 is sent",
            selection(pin(5, Some(0)), None),
            &[(WORKER_INSTANCE_ID, "5"), (DP_RANK, "0")],
        ),
        (
            "disaggregated, no dp",
            selection(pin(5, None), Some(pin(6, None))),
            &[(WORKER_INSTANCE_ID, "5"), (PREFILL_INSTANCE_ID, "6")],
        ),
        (
            "disaggregated, both ranked",
            selection(pin(5, Some(1)), Some(pin(6, Some(0)))),
            &[(WORKER_INSTANCE_ID, "5"), (DP_RANK, "1"), (PREFILL_INSTANCE_ID, "6"), (PREFILL_DP_RANK, "0")],
        ),
        (
            "ranked decode beside unranked prefill sends prefill rank 0",
            selection(pin(5, Some(1)), Some(pin(6, None))),
            &[(WORKER_INSTANCE_ID, "5"), (DP_RANK, "1"), (PREFILL_INSTANCE_ID, "6"), (PREFILL_DP_RANK, "0")],
        ),
        (
            "unranked decode beside ranked prefill",
            selection(pin(5, None), Some(pin(6, Some(3)))),
            &[(WORKER_INSTANCE_ID, "5"), (PREFILL_INSTANCE_ID, "6"), (PREFILL_DP_RANK, "3")],
        ),
    ];
    for (name, selection, expected) in cases {
        let got: Vec<(String, String)> = pins(selection).iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        let want: Vec<(String, String)> = expected.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn responses_never_echo_dynamo_headers() {
    let mut map = headers(&[
        ("content-type", "text/event-stream"),
        ("x-dynamo-worker-instance-id", "5"),
        ("X-Dynamo-Request-Id", "r"),
        ("x-worker-instance-id", "5"),
        ("x-request-id", "kept"),
    ]);
    strip_response(&mut map);
    assert_eq!(names(&map), ["content-type", "x-request-id"]);
}

#[test]
fn disclosure_is_asked_for_by_x_backend_even_blank() {
    assert!(asks_disclosure("x-backend"));
    assert!(asks_disclosure("X-Backend"));
    assert!(!asks_disclosure("x-backends") && !asks_disclosure("backend"));
}

#[test]
fn disclosure_names_backend_and_decimal_workers() {
    let mut map = HeaderMap::new();
    disclose(&mut map, "shim-a", &selection(pin(5, Some(1)), Some(pin(6, None))));
    assert_eq!(value(&map, DISCLOSED_BACKEND), Some("shim-a"));
    assert_eq!(value(&map, DISCLOSED_DECODE_WORKER), Some("5"));
    assert_eq!(value(&map, DISCLOSED_DECODE_DP_RANK), Some("1"));
    assert_eq!(value(&map, DISCLOSED_PREFILL_WORKER), Some("6"));
    assert_eq!(value(&map, DISCLOSED_PREFILL_DP_RANK), None);

    disclose(&mut map, "bad\nname", &selection(pin(7, None), None));
    assert_eq!(value(&map, DISCLOSED_BACKEND), None, "an invalid name is left out");
    assert_eq!(value(&map, DISCLOSED_DECODE_WORKER), Some("7"));
    assert_eq!(value(&map, DISCLOSED_DECODE_DP_RANK), None);
    assert_eq!(value(&map, DISCLOSED_PREFILL_WORKER), None, "no prefill worker is disclosed without one");

    // A shim's answer naming its pins, as a relayed answer's headers go out: stripped, then
    // disclosed. No `x-dynamo-*` header is echoed, asked for or not.
    let mut shim = headers(&[
        ("content-type", "application/json"),
        (WORKER_INSTANCE_ID, "5"),
        ("x-dynamo-anything", "x"),
        ("x-prefill-instance-id", "6"),
    ]);
    strip_response(&mut shim);
    disclose(&mut shim, "shim-a", &selection(pin(5, None), Some(pin(6, None))));
    assert!(shim.keys().all(|n| !n.as_str().starts_with(DYNAMO_PREFIX) && n != "x-prefill-instance-id"), "{shim:?}");
    assert_eq!(value(&shim, "content-type"), Some("application/json"));
    assert_eq!(value(&shim, DISCLOSED_DECODE_WORKER), Some("5"));
}

#[test]
fn a_conditional_bypass_is_marked_as_the_unified_routing_path_without_disclosing_workers() {
    let bypass = Selection { prefill_reason: Reason::ConditionalBypass, ..selection(pin(5, None), None) };
    let mut map = HeaderMap::new();
    mark_routing_path(&mut map, &bypass);
    assert_eq!(value(&map, DISCLOSED_ROUTING_PATH), Some("unified"));
    assert_eq!(map.len(), 1, "a routing path names no worker: {map:?}");

    // A shim's answer may carry the header itself: only a bypass's answer keeps one.
    mark_routing_path(&mut map, &selection(pin(5, None), Some(pin(6, None))));
    assert_eq!(value(&map, DISCLOSED_ROUTING_PATH), None, "only a bypass names its routing path");
}

#[test]
fn the_tenant_is_the_last_visible_non_blank_value_trimmed_as_the_frontend_reads_it() {
    // (case, the header's values in order, the tenant)
    type Case<'a> = (&'a str, &'a [&'a [u8]], Option<&'a str>);
    let cases: &[Case<'_>] = &[
        ("none", &[], None),
        ("one", &[b"tenant-a"], Some("tenant-a")),
        ("trimmed", &[b"  tenant-a\t"], Some("tenant-a")),
        ("the last wins", &[b"tenant-a", b"tenant-b"], Some("tenant-b")),
        ("a blank last value is skipped", &[b"tenant-a", b"   "], Some("tenant-a")),
        ("a value that is no header string is skipped", &[b"tenant-a", "t\u{e9}nant".as_bytes()], Some("tenant-a")),
        ("only blanks", &[b"", b" \t "], None),
    ];
    for (case, values, expected) in cases {
        assert_eq!(tenant(values.iter().copied()).as_deref(), *expected, "{case}");
    }
}

#[test]
fn tracing_headers_sent_once_and_valid_are_carried_on_as_they_came() {
    let long = "t".repeat(MAX_TRACE_VALUE_BYTES + 1);
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    // (case, the request's headers, what is carried on)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a [u8])>, Vec<(&'a str, &'a str)>);
    let cases: Vec<Case<'_>> = vec![
        ("none", vec![("content-type", b"application/json")], vec![]),
        (
            "each once, any case",
            vec![("X-Request-Id", b"req-1"), ("TRACEPARENT", parent.as_bytes()), ("tracestate", b"k=v")],
            vec![("x-request-id", "req-1"), ("traceparent", parent), ("tracestate", "k=v")],
        ),
        ("trimmed", vec![("x-request-id", b"  req-1 ")], vec![("x-request-id", "req-1")]),
        (
            "twice is left out",
            vec![("x-request-id", b"a"), ("X-REQUEST-ID", b"b"), ("tracestate", b"k=v")],
            vec![("tracestate", "k=v")],
        ),
        ("too long", vec![("x-request-id", long.as_bytes())], vec![]),
        ("blank", vec![("x-request-id", b"  ")], vec![]),
        ("no header string", vec![("x-request-id", b"a\x01b")], vec![]),
        (
            "the frontend's own id is routing, not tracing",
            vec![("x-dynamo-request-id", b"0af76519-16cd-43dd-8448-eb211c80319c")],
            vec![],
        ),
    ];
    for (case, headers, expected) in cases {
        let carried = trace(headers.iter().map(|(name, value)| (*name, *value)));
        let carried: Vec<(&str, &str)> =
            carried.iter().map(|(name, value)| (name.as_str(), value.to_str().unwrap_or("?"))).collect();
        assert_eq!(carried, expected, "{case}");
    }
}

#[test]
fn the_routers_tokens_are_attached_whatever_nvext_the_body_kept() {
    let attached = |body: Value| -> Value {
        let bytes = with_token_data(&body, &[1, 2]).unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or(Value::Null)
    };
    let kept = attached(json!({"model": "m", "nvext": {"extra_fields": ["worker_id"]}, "stream": true}));
    assert_eq!(
        kept,
        json!({"model": "m", "nvext": {"extra_fields": ["worker_id"], "token_data": [1, 2]}, "stream": true})
    );
    let keys: Vec<&String> = kept.as_object().map(|m| m.keys().collect()).unwrap_or_default();
    assert_eq!(keys, ["model", "nvext", "stream"], "nvext keeps its place");
    assert_eq!(attached(json!({"model": "m"}))["nvext"], json!({"token_data": [1, 2]}));
    // `"nvext": null` passes the ingress; the router's tokens still get through.
    assert_eq!(attached(json!({"model": "m", "nvext": null}))["nvext"], json!({"token_data": [1, 2]}));
    // Only the router's tokens go, whatever else reached here.
    let replaced = attached(json!({"model": "m", "nvext": {"token_data": [9, 9, 9]}}));
    assert_eq!(replaced["nvext"], json!({"token_data": [1, 2]}));
}
