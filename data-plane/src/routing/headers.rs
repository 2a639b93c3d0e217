//! Header and body hygiene around a shim dispatch.
//!
//! Clients never choose workers. Every header the Dynamo 1.6.1 frontend reads as a pin (the
//! whole `x-dynamo-*` family and its unprefixed aliases) and every `nvext` routing field is kept
//! from the shim twice over: at the ingress, the server carries none of a chat completion's
//! headers past its head (nor, for any other endpoint, a routing header: [`is_routing_header`])
//! and the body's routing fields are stripped ([`strip_body_routing`]); just before dispatch,
//! the encoder writes no routing header ([`is_routing_header`]) but the picker's [`pins`]. Responses never carry a pin back
//! ([`strip_response`]), nor does the frontend's echo of them unless asked: the chosen backend
//! and workers are disclosed only to a client that asks with `x-backend`.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use crate::routing::picker::{Reason, Selection};

/// Every header whose name starts with this belongs to Dynamo, whatever follows.
pub const DYNAMO_PREFIX: &str = "x-dynamo-";

/// Unprefixed pin aliases the 1.6.1 frontend also honours.
pub const PIN_ALIASES: [&str; 5] =
    ["x-worker-instance-id", "x-prefill-instance-id", "x-dp-rank", "x-data-parallel-rank", "x-prefill-dp-rank"];

/// The decode (or aggregated) worker's instance id, decimal.
pub const WORKER_INSTANCE_ID: &str = "x-dynamo-worker-instance-id";
/// The prefill worker's instance id, decimal.
pub const PREFILL_INSTANCE_ID: &str = "x-dynamo-prefill-instance-id";
/// The decode worker's dp rank. The frontend also applies it to prefill when no prefill rank is sent.
pub const DP_RANK: &str = "x-dynamo-dp-rank";
/// The prefill worker's dp rank.
pub const PREFILL_DP_RANK: &str = "x-dynamo-prefill-dp-rank";

/// `nvext` request fields that choose workers or ranks, restrict which may serve
/// (`routing_constraints`, 1.6.1's required worker taints: the router picks, and a frontend
/// refusing its pins for a client's constraint would read as the workers' failure), or
/// replace the prompt the picker estimated (`token_data` skips tokenization). `worker_id` is
/// the frontend's echo field; a client has no reason to send it. Every other `nvext` field
/// (`extra_fields`, `agent_hints`, sampling switches) is the client's to send.
pub const NVEXT_ROUTING_FIELDS: [&str; 10] = [
    "backend_instance_id",
    "prefill_worker_id",
    "decode_worker_id",
    "dp_rank",
    "prefill_dp_rank",
    "decode_dp_rank",
    "data_parallel_rank",
    "token_data",
    "worker_id",
    "routing_constraints",
];

/// A client asks for disclosure with this request header, even blank.
pub const DISCLOSURE_REQUEST: &str = "x-backend";
pub const DISCLOSED_BACKEND: &str = "x-continuum-backend";
pub const DISCLOSED_DECODE_WORKER: &str = "x-continuum-decode-worker";
pub const DISCLOSED_DECODE_DP_RANK: &str = "x-continuum-decode-dp-rank";
pub const DISCLOSED_PREFILL_WORKER: &str = "x-continuum-prefill-worker";
pub const DISCLOSED_PREFILL_DP_RANK: &str = "x-continuum-prefill-dp-rank";
/// Disclosed as `unified` when conditional disaggregation let the decode worker prefill the
/// request itself (the seed's name and value for a bypass).
pub const DISCLOSED_ROUTING_PATH: &str = "x-continuum-routing-path";

/// Whether the frontend could read this header name as routing. Names in a `HeaderMap` are
/// already lowercase, so this is case-insensitive for every header a client can send.
pub fn is_routing_header(name: &str) -> bool {
    name.starts_with(DYNAMO_PREFIX) || PIN_ALIASES.contains(&name)
}

/// The `nvext.extra_fields` entry that makes the frontend echo the pins it used
/// (`nvext.worker_id` in every answer): a disclosure, so only for a client that asked.
const ECHO_PINS_FIELD: &str = "worker_id";

/// Top-level request fields with which an engine's own OpenAI server (vLLM's, SGLang's,
/// TensorRT-LLM's) lets a request choose where its KV comes from or which rank serves it:
/// vLLM's `kv_transfer_params` (a remote host and port to pull the prompt's KV from), SGLang's
/// disaggregation bootstrap (and its pairing key), its data-parallel rank (`routed_dp_rank`,
/// and the deprecated `data_parallel_rank`) and the prefill rank a decode server is told holds
/// the KV, and TensorRT-LLM's `disaggregated_params` (a `generation_only` request decodes from
/// the context phase a `ctx_request_id` names, as Dynamo's TensorRT-LLM worker takes it). A unified
/// backend may be such a server rather than a Dynamo frontend; no client chooses them through
/// the router.
pub const ENGINE_ROUTING_FIELDS: [&str; 9] = [
    "kv_transfer_params",
    "disaggregated_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
];

/// `nvext.annotations` starting with this ask a Dynamo frontend for the Gateway API inference
/// extension's query-only first stage: the frontend's own router picks workers and answers with
/// their ids (and the prompt's tokens) instead of a completion. A client of this router never
/// gets to: such annotations are always removed, the client's others kept.
const QUERY_INSTANCE_ANNOTATION: &str = "query_instance_id";

/// Removes the `nvext` routing fields of a request body and its query-only annotations, keeping
/// every other `nvext` field, and the engines' own routing fields ([`ENGINE_ROUTING_FIELDS`]);
/// and, unless the client asked for disclosure (`disclose`), the
/// request for the pins' echo from `nvext.extra_fields`.
///
/// An `nvext` object that held only routing fields is removed whole, so the frontend sees the
/// request as if the client had sent no extension; an `nvext` the client sent empty or null is
/// forwarded as sent, since it chooses nothing. Any other `nvext` is removed: a frontend reads
/// an array as its fields in order, routing fields among them (the ingress refuses one first).
pub fn strip_body_routing(body: &mut Value, disclose: bool) {
    let Some(request) = body.as_object_mut() else {
        return;
    };
    request.retain(|field, _| !ENGINE_ROUTING_FIELDS.contains(&field.as_str()));
    let nvext = match request.get_mut("nvext") {
        Some(Value::Object(nvext)) => nvext,
        None | Some(Value::Null) => return,
        Some(_) => {
            request.remove("nvext");
            return;
        }
    };
    let sent = nvext.len();
    nvext.retain(|field, _| !NVEXT_ROUTING_FIELDS.contains(&field.as_str()));
    if let Some(Value::Array(annotations)) = nvext.get_mut("annotations") {
        annotations.retain(|a| !a.as_str().is_some_and(|a| a.starts_with(QUERY_INSTANCE_ANNOTATION)));
        if annotations.is_empty() {
            nvext.remove("annotations");
        }
    }
    if !disclose && let Some(Value::Array(extra)) = nvext.get_mut("extra_fields") {
        extra.retain(|field| field != ECHO_PINS_FIELD);
        if extra.is_empty() {
            nvext.remove("extra_fields");
        }
    }
    if sent > 0 && nvext.is_empty() {
        request.remove("nvext");
    }
}

/// The body, serialized, with the router's rendered prompt as `nvext.token_data`, so the
/// frontend skips tokenizing again (`kv.send_token_data`). Only after [`strip_body_routing`]: a
/// client's own `token_data` never reaches a shim. The tokens are written as they are read
/// (a JSON value a token would take 32 bytes each, a million tokens 32 MiB), and `nvext` keeps
/// its place among the body's members (absent or null, the only other shapes it can have past
/// the ingress, it becomes an object at the end).
pub fn with_token_data(body: &Value, tokens: &[u32]) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&WithTokens { body, tokens })
}

struct WithTokens<'a> {
    body: &'a Value,
    tokens: &'a [u32],
}

impl serde::Serialize for WithTokens<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Some(members) = self.body.as_object() else { return self.body.serialize(serializer) };
        let tokens = self.tokens;
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in members {
            match key.as_str() {
                "nvext" => map.serialize_entry(key, &Nvext { kept: value.as_object(), tokens })?,
                _ => map.serialize_entry(key, value)?,
            }
        }
        if !members.contains_key("nvext") {
            map.serialize_entry("nvext", &Nvext { kept: None, tokens })?;
        }
        map.end()
    }
}

/// An `nvext` object's members, and the router's tokens in place of any `token_data`.
struct Nvext<'a> {
    kept: Option<&'a serde_json::Map<String, Value>>,
    tokens: &'a [u32],
}

impl serde::Serialize for Nvext<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in self.kept.into_iter().flatten().filter(|(key, _)| *key != "token_data") {
            map.serialize_entry(key, value)?;
        }
        map.serialize_entry("token_data", self.tokens)?;
        map.end()
    }
}

/// The picker's pins as headers: (name, decimal value) pairs, the only routing headers a
/// request to a shim carries (the encoder drops any other; see `dispatch::wire`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pins([Option<(&'static str, u64)>; 4]);

impl Pins {
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.0.iter().flatten().copied()
    }
}

/// The pins of a selection.
///
/// Instance ids are decimal (the frontend treats hex as absent). A rank is sent, 0 included,
/// whenever the worker declares data parallelism. The frontend applies `x-dynamo-dp-rank` to
/// the prefill worker too when no prefill rank is sent, so a ranked decode pin beside an
/// unranked prefill pin sends prefill rank 0 explicitly. No prefill header is written without
/// a prefill pin, and the picker never pairs one with an aggregated worker.
pub fn pins(selection: &Selection) -> Pins {
    let decode = &selection.decode;
    let prefill = selection.prefill.as_ref();
    Pins([
        Some((WORKER_INSTANCE_ID, decode.worker.instance_id)),
        decode.dp_rank.map(|rank| (DP_RANK, rank.into())),
        prefill.map(|p| (PREFILL_INSTANCE_ID, p.worker.instance_id)),
        prefill.and_then(|p| p.dp_rank.or(decode.dp_rank.map(|_| 0))).map(|rank| (PREFILL_DP_RANK, rank.into())),
    ])
}

/// Removes every routing header (all values of each) from a shim response: no `x-dynamo-*`
/// header (nor an alias, which would name a worker just the same) reaches the client. A
/// client's are dropped as its request head is read ([`is_routing_header`]).
pub fn strip_response(headers: &mut HeaderMap) {
    let routing: Vec<HeaderName> = headers.keys().filter(|name| is_routing_header(name.as_str())).cloned().collect();
    for name in routing {
        headers.remove(name);
    }
}

/// The header dynamo.frontend reads a request's cache salt from, over the body's.
pub const TENANT_ID: &str = "x-tenant-id";

/// The client's tracing headers a chat completion carries on to the shim, whose frontend joins
/// its logs and spans on them (`x-request-id`, W3C `traceparent` and `tracestate`). Not
/// routing: they pin nothing, and the frontend takes a request id of its own only from
/// `x-dynamo-request-id`, which is stripped.
pub const TRACE_HEADERS: [&str; 3] = [REQUEST_ID, "traceparent", "tracestate"];
/// The tracing header a client's answer carries back.
pub const REQUEST_ID: &str = "x-request-id";
/// The longest tracing header value carried on.
pub const MAX_TRACE_VALUE_BYTES: usize = 512;

/// A request's tracing context: each of [`TRACE_HEADERS`] it sends exactly once, in visible
/// ASCII, of at most [`MAX_TRACE_VALUE_BYTES`], sent on as it came. One sent twice is
/// left out: which of the two a hop behind would read is anyone's guess.
pub fn trace<'a, 'h>(headers: impl Iterator<Item = (&'a str, &'h [u8])> + Clone) -> Vec<(HeaderName, HeaderValue)> {
    TRACE_HEADERS
        .iter()
        .filter_map(|name| {
            let mut values = headers.clone().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v);
            let value = values.next().filter(|_| values.next().is_none())?;
            let value =
                HeaderValue::from_bytes(value.trim_ascii()).ok().filter(|v| !v.is_empty() && v.to_str().is_ok())?;
            (value.len() <= MAX_TRACE_VALUE_BYTES).then(|| (HeaderName::from_static(name), value))
        })
        .collect()
}

/// A client's tenant as dynamo.frontend 1.6.1 reads it from `values` (every `x-tenant-id` the
/// request carries, in order): the last that is a valid header string (visible ASCII) and not
/// blank, trimmed. It salts the request's KV blocks, over any salt in the body. Reads every
/// value, whichever it keeps (the server measures them as it reads).
pub fn tenant<'a>(values: impl Iterator<Item = &'a [u8]>) -> Option<String> {
    let visible = |b: &u8| *b == b'\t' || (0x20..0x7f).contains(b);
    values
        .filter(|value| value.iter().all(visible))
        .map(<[u8]>::trim_ascii)
        .filter(|value| !value.is_empty())
        .last()
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// Whether a request header (by its name as sent, any case) asks to see the chosen backend and
/// workers; its value does not matter.
pub fn asks_disclosure(name: &str) -> bool {
    name.eq_ignore_ascii_case(DISCLOSURE_REQUEST)
}

/// Writes the chosen backend and workers (decimal ids, ranks when declared) on a response.
/// Call it only when the request [`asks_disclosure`]. A backend name that is not a
/// valid header value (names come from configuration) is left out rather than mangled.
pub fn disclose(headers: &mut HeaderMap, backend: &str, selection: &Selection) {
    disclose_backend(headers, backend);
    insert_decimal(headers, DISCLOSED_DECODE_WORKER, selection.decode.worker.instance_id);
    if let Some(rank) = selection.decode.dp_rank {
        insert_decimal(headers, DISCLOSED_DECODE_DP_RANK, rank.into());
    }
    if let Some(prefill) = &selection.prefill {
        insert_decimal(headers, DISCLOSED_PREFILL_WORKER, prefill.worker.instance_id);
        if let Some(rank) = prefill.dp_rank {
            insert_decimal(headers, DISCLOSED_PREFILL_DP_RANK, rank.into());
        }
    }
}

/// Writes the backend that answered an unpinned request (plain unified routing, or the
/// fallback of a failed pinned one), and no worker: none was chosen. Call it only when the
/// request [`asks_disclosure`]; [`disclose`] writes the workers of a pinned one besides.
pub fn disclose_backend(headers: &mut HeaderMap, backend: &str) {
    for name in [DISCLOSED_DECODE_WORKER, DISCLOSED_DECODE_DP_RANK, DISCLOSED_PREFILL_WORKER, DISCLOSED_PREFILL_DP_RANK]
    {
        headers.remove(name);
    }
    match HeaderValue::from_str(backend) {
        Ok(value) => {
            headers.insert(DISCLOSED_BACKEND, value);
        }
        Err(_) => {
            headers.remove(DISCLOSED_BACKEND);
        }
    }
}

/// Marks a pinned answer `x-continuum-routing-path: unified` when conditional disaggregation
/// let the decode worker prefill the request itself (the seed's bypass contract). A routing
/// path names no worker, so every client sees it, whether or not it asked for disclosure.
pub fn mark_routing_path(headers: &mut HeaderMap, selection: &Selection) {
    // A name made once: given as a string, the map would check and parse it for every answer.
    const ROUTING_PATH: HeaderName = HeaderName::from_static(DISCLOSED_ROUTING_PATH);
    if selection.prefill_reason == Reason::ConditionalBypass {
        headers.insert(ROUTING_PATH, HeaderValue::from_static("unified"));
    } else {
        headers.remove(ROUTING_PATH);
    }
}

fn insert_decimal(headers: &mut HeaderMap, name: &'static str, value: u64) {
    headers.insert(HeaderName::from_static(name), HeaderValue::from(value));
}

#[cfg(test)]
mod tests;
