//! etcd values as typed records. Every value is fleet-authored and untrusted: a value either
//! becomes a record, or is set aside with the reason (skipped, unsupported, malformed).
//!
//! Identity fields come from the value; namespace, scope and topic come from the key.

use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::card::{Card, MAX_RETAINED_CARD_BYTES};
use super::fleet::{MAX_NAME_BYTES, Topic};
use super::keys::{KeyPath, Keyspace, ParsedKey};
use super::wire_id;

/// The one endpoint that describes a routable worker.
pub const GENERATE_ENDPOINT: &str = "generate";

/// What an etcd value is, once read.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    Endpoint(EndpointRecord),
    /// Boxed: a card is much larger than the other records.
    Model(Box<ModelRecord>),
    Channel(ChannelRecord),
    Source(SourceRecord),
    /// Valid but not for the router (other endpoints, adapter cards, other topics): silent.
    Skipped(Skip),
    /// Valid but of a kind the router cannot use (broker or NATS transports…): logged once.
    Unsupported(String),
    /// Not a record at all: logged once.
    Malformed(RecordError),
}

impl Parsed {
    /// Whether it is a record the router holds (and bounds), not a value skipped or set aside.
    pub fn is_record(&self) -> bool {
        matches!(self, Parsed::Endpoint(_) | Parsed::Model(_) | Parsed::Channel(_) | Parsed::Source(_))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    NotGenerate,
    AdapterCard,
    OtherTopic,
}

/// Why a value is not a record.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("value is not a JSON {expected} record: {reason}")]
    Json { expected: &'static str, reason: String },
    #[error("value is a {found:?} record, but keys under {keyspace} hold {expected} records")]
    WrongType { found: String, keyspace: Keyspace, expected: &'static str },
    #[error("{expected} record has no {field}")]
    Missing { expected: &'static str, field: &'static str },
    #[error("event channel transport is {0}")]
    Transport(&'static str),
    #[error("{expected} record names id {id:x}, but its key ends in `{segment}`")]
    KeyId { expected: &'static str, segment: String, id: u64 },
    #[error("{expected} record's key has no id segment (Dynamo keys it `…/{{component}}/{{endpoint}}/{{id:x}}`)")]
    KeyWithoutId { expected: &'static str },
    #[error("{expected} record names {field} `{value}`, but its key says `{segment}`")]
    KeyPath { expected: &'static str, field: &'static str, value: String, segment: String },
    #[error("{expected} record names id {id:x}, but its key is attached to lease {lease:x}")]
    Lease { expected: &'static str, id: u64, lease: u64 },
    #[error("{expected} record's {field} is {len} bytes long, more than any name ({most} at most)")]
    NameTooLong { expected: &'static str, field: &'static str, len: usize, most: usize },
}

/// An Endpoint record under `v1/instances/`; only `generate` endpoints become one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointRecord {
    pub instance_id: u64,
    pub component: String,
    pub endpoint: String,
}

/// A base-model Model record under `v1/mdc/`. Empty component and endpoint mark a legacy card.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRecord {
    pub instance_id: u64,
    pub component: String,
    pub endpoint: String,
    pub card: Card,
}

/// A direct-ZMQ `kv_metrics` or `kv-events` publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelRecord {
    pub publisher_id: u64,
    pub topic: Topic,
    pub component: Option<String>,
    pub endpoint: Option<String>,
    /// The `tcp://` endpoint: internal, never exported.
    pub address: String,
    /// The etcd lease the key is attached to: the worker's instance id.
    pub lease: Option<u64>,
}

/// An EventSource record: which worker rank a publisher speaks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceRecord {
    pub publisher_id: u64,
    pub topic: Topic,
    pub worker_id: Option<u64>,
    pub dp_rank: Option<u32>,
}

/// Reads the value stored at `key`. `lease` is the etcd lease the key is attached to.
pub fn parse(key: &ParsedKey, value: &[u8], lease: Option<u64>) -> Parsed {
    let result = match key.keyspace {
        Keyspace::Instances => endpoint(key, value).and_then(|parsed| on_own_lease(key, parsed, lease)),
        Keyspace::Models => model(key, value).and_then(|parsed| on_own_lease(key, parsed, lease)),
        Keyspace::EventChannels => channel(key, value, lease),
        Keyspace::EventSources => source(key, value),
    };
    result.unwrap_or_else(Parsed::Malformed)
}

/// A worker's instance and card keys hang on its own lease, whose id is its instance id: one
/// attached to another lease is another process's claim to the worker (or, kept alive by that
/// lease, would outlive it). A key with no lease is taken as written (static registrations
/// and tools write so).
fn on_own_lease(key: &ParsedKey, parsed: Parsed, lease: Option<u64>) -> Result<Parsed, RecordError> {
    let id = match &parsed {
        Parsed::Endpoint(record) => record.instance_id,
        Parsed::Model(record) => record.instance_id,
        _ => return Ok(parsed),
    };
    match lease {
        Some(lease) if lease != id => Err(RecordError::Lease { expected: key.keyspace.record_type(), id, lease }),
        _ => Ok(parsed),
    }
}

fn json_error(keyspace: Keyspace) -> impl Fn(serde_json::Error) -> RecordError {
    move |e| RecordError::Json { expected: keyspace.record_type(), reason: excerpt(&e.to_string()) }
}

/// The most of a value's own text a held record keeps to say why it was set aside.
pub const MAX_EXCERPT_CHARS: usize = 160;

/// `text` cut to [`MAX_EXCERPT_CHARS`]: serde's errors quote the offending value, and a key
/// held as malformed or unsupported must not keep a megabyte of it.
pub(crate) fn excerpt(text: &str) -> String {
    match text.char_indices().nth(MAX_EXCERPT_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// Parses the value as an object and checks its `type` tag, which may be absent.
fn object(keyspace: Keyspace, value: &[u8]) -> Result<Value, RecordError> {
    let json: Value = serde_json::from_slice(value).map_err(json_error(keyspace))?;
    match json.get("type") {
        Some(Value::String(found)) if found != keyspace.record_type() => {
            Err(RecordError::WrongType { found: excerpt(found), keyspace, expected: keyspace.record_type() })
        }
        _ => Ok(json),
    }
}

fn typed<T: for<'de> Deserialize<'de>>(keyspace: Keyspace, json: Value) -> Result<T, RecordError> {
    serde_json::from_value(json).map_err(json_error(keyspace))
}

fn missing(keyspace: Keyspace, field: &'static str) -> RecordError {
    RecordError::Missing { expected: keyspace.record_type(), field }
}

/// Dynamo keys a record by its id (`…/{id:x}`): a value naming another id is not the record its
/// key says, and would claim, or contest, another worker's or publisher's identity.
fn keyed_by(key: &ParsedKey, id: u64) -> Result<u64, RecordError> {
    match &key.id {
        Some(segment) if wire_id::parse_hex(segment) != Some(id) => {
            Err(RecordError::KeyId { expected: key.keyspace.record_type(), segment: excerpt(segment), id })
        }
        _ => Ok(id),
    }
}

#[derive(Deserialize)]
struct EndpointWire {
    #[serde(default, deserialize_with = "wire_id::optional")]
    instance_id: Option<u64>,
    component: Option<String>,
    endpoint: Option<String>,
}

fn endpoint(key: &ParsedKey, value: &[u8]) -> Result<Parsed, RecordError> {
    let wire: EndpointWire = typed(key.keyspace, object(key.keyspace, value)?)?;
    let instance_id = keyed_by(key, wire.instance_id.ok_or_else(|| missing(key.keyspace, "instance_id"))?)?;
    // Unlike a legacy card's, an instance's key always names its id.
    if key.id.is_none() {
        return Err(RecordError::KeyWithoutId { expected: key.keyspace.record_type() });
    }
    filed_where_it_says(key, wire.component.as_deref(), wire.endpoint.as_deref())?;
    let (key_component, key_endpoint) = registry_scope(key);
    let component = wire.component.filter(|c| !c.is_empty()).or(key_component).unwrap_or_default();
    let endpoint = wire.endpoint.filter(|e| !e.is_empty()).or(key_endpoint).unwrap_or_default();
    if endpoint != GENERATE_ENDPOINT {
        return Ok(Parsed::Skipped(Skip::NotGenerate));
    }
    Ok(Parsed::Endpoint(EndpointRecord { instance_id, component, endpoint }))
}

/// The component and endpoint a registry key (an instance's, a card's) files its record under.
fn registry_scope(key: &ParsedKey) -> (Option<String>, Option<String>) {
    match &key.path {
        KeyPath::Registry { component, endpoint } => (component.clone(), endpoint.clone()),
        KeyPath::Event { .. } => (None, None),
    }
}

/// A Model record's value, its card borrowed as written. Its `type` is borrowed too: the check
/// of it ignores a tag that is not a string, as every record's does.
#[derive(Deserialize)]
struct ModelWire<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<&'a RawValue>,
    #[serde(default, deserialize_with = "wire_id::optional")]
    instance_id: Option<u64>,
    #[serde(default)]
    component: Option<String>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    model_suffix: Option<String>,
    #[serde(default, borrow)]
    card_json: Option<&'a RawValue>,
}

/// Whether the record's component and endpoint, where its value names them, are its key's: a
/// record filed under another path than its own would claim, or contest, the identity of the
/// worker it names beside that worker's own record.
fn filed_where_it_says(key: &ParsedKey, component: Option<&str>, endpoint: Option<&str>) -> Result<(), RecordError> {
    // Kept with the record, and again as its identity: a key naming neither (a legacy card's)
    // leaves nothing else to bound them by.
    for (field, value) in [("component", component), ("endpoint", endpoint)] {
        if let Some(len) = value.map(str::len).filter(|len| *len > MAX_NAME_BYTES) {
            let expected = key.keyspace.record_type();
            return Err(RecordError::NameTooLong { expected, field, len, most: MAX_NAME_BYTES });
        }
    }
    let KeyPath::Registry { component: key_component, endpoint: key_endpoint } = &key.path else {
        return Ok(());
    };
    let check = |field: &'static str, value: Option<&str>, segment: &Option<String>| {
        let (Some(value), Some(segment)) = (value.filter(|v| !v.is_empty()), segment.as_deref()) else {
            return Ok(());
        };
        let same = value == segment || super::keys::decode_segment(segment).is_ok_and(|decoded| decoded == value);
        if same {
            return Ok(());
        }
        let expected = key.keyspace.record_type();
        Err(RecordError::KeyPath { expected, field, value: excerpt(value), segment: excerpt(segment) })
    };
    check("component", component, key_component)?;
    check("endpoint", endpoint, key_endpoint)
}

/// A Model record, read without a JSON tree of the whole value: as a tree, a card of small
/// values (an array of numbers) takes some eighty times its text, and a value may be 16 MiB. A
/// card small enough to keep is read as a tree ([`Card::parse`]); a larger one keeps its typed
/// subset, read strictly from its text ([`Card::unretained`]).
fn model(key: &ParsedKey, value: &[u8]) -> Result<Parsed, RecordError> {
    let keyspace = Keyspace::Models;
    let wire: ModelWire<'_> = serde_json::from_slice(value).map_err(json_error(keyspace))?;
    if let Some(found) = wire.kind.and_then(|kind| serde_json::from_str::<String>(kind.get()).ok())
        && found != keyspace.record_type()
    {
        return Err(RecordError::WrongType { found: excerpt(&found), keyspace, expected: keyspace.record_type() });
    }
    let instance_id = keyed_by(key, wire.instance_id.ok_or_else(|| missing(keyspace, "instance_id"))?)?;
    if wire.model_suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Ok(Parsed::Skipped(Skip::AdapterCard));
    }
    let card = match wire.card_json.map(RawValue::get) {
        None => Card::parse(Value::Null),
        Some(text) if text.len() <= MAX_RETAINED_CARD_BYTES => {
            serde_json::from_str(text).map_or_else(|_| Card::unretained(text), Card::parse)
        }
        Some(text) => Card::unretained(text),
    };
    if card.is_adapter() {
        return Ok(Parsed::Skipped(Skip::AdapterCard));
    }
    filed_where_it_says(key, wire.component.as_deref(), wire.endpoint.as_deref())?;
    let named = |field: Option<String>| field.filter(|f| !f.is_empty());
    let (component, endpoint) = match (named(wire.component), named(wire.endpoint)) {
        // Both left empty: a legacy card, which joins on the instance id alone (the seed's rule).
        (None, None) => (String::new(), String::new()),
        // One of them named: a scoped card, the other as its key files it (every field of a
        // record is optional across Dynamo's N-2 window), as an instance record's are.
        (component, endpoint) => {
            let (key_component, key_endpoint) = registry_scope(key);
            (component.or(key_component).unwrap_or_default(), endpoint.or(key_endpoint).unwrap_or_default())
        }
    };
    Ok(Parsed::Model(Box::new(ModelRecord { instance_id, component, endpoint, card })))
}

/// The key's scope and topic, or `None` for topics the router does not follow.
fn event_scope(key: &ParsedKey) -> Option<(Topic, Option<String>, Option<String>)> {
    match &key.path {
        KeyPath::Event { component, endpoint, topic } => {
            Some((Topic::parse(topic)?, component.clone(), endpoint.clone()))
        }
        KeyPath::Registry { .. } => None,
    }
}

#[derive(Deserialize)]
struct ChannelWire {
    #[serde(default, deserialize_with = "wire_id::optional")]
    instance_id: Option<u64>,
    scope: Option<ScopeWire>,
    transport: Option<TransportWire>,
}

#[derive(Deserialize)]
struct ScopeWire {
    kind: Option<String>,
}

#[derive(Deserialize)]
struct TransportWire {
    kind: Option<String>,
    config: Option<Value>,
}

const SCOPE_KINDS: [&str; 3] = ["namespace", "component", "endpoint"];

fn channel(key: &ParsedKey, value: &[u8], lease: Option<u64>) -> Result<Parsed, RecordError> {
    let Some((topic, component, endpoint)) = event_scope(key) else {
        return Ok(Parsed::Skipped(Skip::OtherTopic));
    };
    let wire: ChannelWire = typed(key.keyspace, object(key.keyspace, value)?)?;
    let publisher_id = keyed_by(key, wire.instance_id.ok_or_else(|| missing(key.keyspace, "instance_id"))?)?;
    if let Some(kind) = wire.scope.and_then(|s| s.kind).filter(|k| !SCOPE_KINDS.contains(&k.as_str())) {
        return Ok(Parsed::Unsupported(excerpt(&format!("scope kind {kind:?}"))));
    }
    let transport = wire.transport.ok_or_else(|| missing(key.keyspace, "transport"))?;
    let address = match zmq_address(transport)? {
        Ok(address) => address,
        Err(unsupported) => return Ok(Parsed::Unsupported(excerpt(&unsupported))),
    };
    Ok(Parsed::Channel(ChannelRecord { publisher_id, topic, component, endpoint, address, lease }))
}

/// The `tcp://` endpoint of a direct ZMQ transport; `Ok(Err(_))` for transports the router
/// does not dial (broker, NATS, unknown, non-tcp).
fn zmq_address(transport: TransportWire) -> Result<Result<String, String>, RecordError> {
    let kind = transport.kind.ok_or(RecordError::Transport("missing its kind"))?;
    if kind != "Zmq" {
        return Ok(Err(format!("transport kind {kind:?}")));
    }
    let endpoint = transport.config.as_ref().and_then(|c| c.get("endpoint")).and_then(Value::as_str);
    let endpoint = endpoint.ok_or(RecordError::Transport("Zmq without a config.endpoint"))?;
    match endpoint.strip_prefix("tcp://") {
        Some(rest) if !rest.is_empty() && rest.len() <= MAX_ENDPOINT_HOST_PORT => Ok(Ok(endpoint.to_owned())),
        Some(rest) if !rest.is_empty() => Ok(Err(format!("Zmq endpoint of {} bytes, past any host:port", rest.len()))),
        _ => Ok(Err(format!("Zmq endpoint {endpoint:?}, not tcp://host:port"))),
    }
}

/// The longest `host:port` of a channel's endpoint: a DNS name (253) or a bracketed IPv6
/// address with a zone, and a port. Every publisher holds its address, so a record's room (64
/// KiB) is not what bounds it.
const MAX_ENDPOINT_HOST_PORT: usize = 320;

#[derive(Deserialize)]
struct SourceWire {
    #[serde(default, deserialize_with = "wire_id::optional")]
    publisher_id: Option<u64>,
    metadata: Option<SourceMetadata>,
}

#[derive(Deserialize)]
struct SourceMetadata {
    worker: Option<SourceWorker>,
}

#[derive(Deserialize)]
struct SourceWorker {
    #[serde(default, deserialize_with = "wire_id::optional")]
    worker_id: Option<u64>,
    dp_rank: Option<u32>,
}

fn source(key: &ParsedKey, value: &[u8]) -> Result<Parsed, RecordError> {
    let Some((topic, _, _)) = event_scope(key) else {
        return Ok(Parsed::Skipped(Skip::OtherTopic));
    };
    let wire: SourceWire = typed(key.keyspace, object(key.keyspace, value)?)?;
    let publisher_id = keyed_by(key, wire.publisher_id.ok_or_else(|| missing(key.keyspace, "publisher_id"))?)?;
    let worker = wire.metadata.and_then(|m| m.worker);
    let (worker_id, dp_rank) = worker.map_or((None, None), |w| (w.worker_id, w.dp_rank));
    Ok(Parsed::Source(SourceRecord { publisher_id, topic, worker_id, dp_rank }))
}
