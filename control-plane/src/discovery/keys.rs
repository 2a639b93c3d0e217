//! Where an etcd key belongs: one of the four keyspaces Dynamo registers under, one of the
//! watched Dynamo namespaces, and the path parts after the namespace.
//!
//! The namespace is only ever read here, from the key: payload fields naming a namespace are
//! fleet-authored and never decide which graph a record belongs to.

use std::fmt;
use std::sync::Arc;

/// One of Dynamo's discovery buckets under `v1/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Keyspace {
    /// `v1/instances/{ns}/{component}/{endpoint}/{instance hex}`: Endpoint records.
    Instances,
    /// `v1/mdc/{ns}/{component}/{endpoint}/{instance hex}[/{suffix}]`: Model records.
    Models,
    /// `v1/event_channels/namespace/{ns}/…/topic/{topic}/{publisher hex}`: EventChannel records.
    EventChannels,
    /// `v1/event_sources/namespace/{ns}/…/topic/{topic}/{publisher hex}`: EventSource records.
    EventSources,
}

impl Keyspace {
    pub const ALL: [Keyspace; 4] =
        [Keyspace::Instances, Keyspace::Models, Keyspace::EventChannels, Keyspace::EventSources];

    /// The bucket prefix, with its trailing slash.
    pub fn prefix(self) -> &'static str {
        match self {
            Keyspace::Instances => "v1/instances/",
            Keyspace::Models => "v1/mdc/",
            Keyspace::EventChannels => "v1/event_channels/",
            Keyspace::EventSources => "v1/event_sources/",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Keyspace::Instances => "instances",
            Keyspace::Models => "mdc",
            Keyspace::EventChannels => "event_channels",
            Keyspace::EventSources => "event_sources",
        }
    }

    pub(super) fn index(self) -> usize {
        match self {
            Keyspace::Instances => 0,
            Keyspace::Models => 1,
            Keyspace::EventChannels => 2,
            Keyspace::EventSources => 3,
        }
    }

    /// The record `type` Dynamo writes under this bucket.
    pub fn record_type(self) -> &'static str {
        match self {
            Keyspace::Instances => "Endpoint",
            Keyspace::Models => "Model",
            Keyspace::EventChannels => "EventChannel",
            Keyspace::EventSources => "EventSource",
        }
    }
}

impl fmt::Display for Keyspace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A key inside a watched namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedKey {
    pub keyspace: Keyspace,
    pub namespace: Arc<str>,
    pub path: KeyPath,
    /// The key's last segment where Dynamo writes the record's id, in hex (`…/{id:x}`); absent
    /// on keys without one (legacy card keys).
    pub id: Option<String>,
}

/// The key's parts after the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyPath {
    /// Instances and model cards: `{component}/{endpoint}/…`, verbatim (Dynamo does not encode
    /// these). Absent when the key has fewer segments, as legacy card keys do.
    Registry { component: Option<String>, endpoint: Option<String> },
    /// Event channels and sources, percent-decoded. Component and endpoint are absent for
    /// namespace- and component-scoped publishers.
    Event { component: Option<String>, endpoint: Option<String>, topic: String },
}

/// A key under a watched namespace that does not have the shape Dynamo writes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key is not UTF-8")]
    NotUtf8,
    #[error("key is {0} bytes long, more than any Dynamo key ({MAX_KEY_BYTES})")]
    TooLong(usize),
    #[error("event key `{0}` is not namespace/…/topic/{{topic}}/{{publisher hex}}")]
    EventShape(String),
    #[error("key segment `{0}` has an invalid percent escape")]
    Escape(String),
}

/// The longest key read. Dynamo's are a few hundred bytes (names past
/// [`super::MAX_NAME_BYTES`] exclude a worker anyway); a longer one is junk, and the reducer
/// holds each key it reads, so without a bound 16,384 held keys could pin gigabytes.
pub const MAX_KEY_BYTES: usize = 8 << 10;

/// Classifies `key`: `Ok(None)` when it is outside every keyspace or watched namespace.
pub fn classify(namespaces: &[Arc<str>], key: &[u8]) -> Result<Option<ParsedKey>, KeyError> {
    let Some(keyspace) = Keyspace::ALL.into_iter().find(|k| key.starts_with(k.prefix().as_bytes())) else {
        return Ok(None);
    };
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong(key.len()));
    }
    let key = std::str::from_utf8(key).map_err(|_| KeyError::NotUtf8)?;
    let rest = &key[keyspace.prefix().len()..];
    match keyspace {
        Keyspace::Instances | Keyspace::Models => Ok(registry_key(namespaces, keyspace, rest)),
        Keyspace::EventChannels | Keyspace::EventSources => event_key(namespaces, keyspace, rest),
    }
}

fn watched(namespaces: &[Arc<str>], candidate: &str) -> Option<Arc<str>> {
    namespaces.iter().find(|ns| &***ns == candidate).cloned()
}

fn registry_key(namespaces: &[Arc<str>], keyspace: Keyspace, rest: &str) -> Option<ParsedKey> {
    let (namespace, path) = rest.split_once('/')?;
    let namespace = watched(namespaces, namespace)?;
    let segments: Vec<&str> = path.split('/').collect();
    let (component, endpoint, id) = match segments.as_slice() {
        [component, endpoint, id, ..] => {
            (Some((*component).to_owned()), Some((*endpoint).to_owned()), Some((*id).to_owned()))
        }
        _ => (None, None, None),
    };
    Some(ParsedKey { keyspace, namespace, path: KeyPath::Registry { component, endpoint }, id })
}

fn event_key(namespaces: &[Arc<str>], keyspace: Keyspace, rest: &str) -> Result<Option<ParsedKey>, KeyError> {
    let parts: Vec<&str> = rest.split('/').collect();
    let ["namespace", namespace, scoped @ ..] = parts.as_slice() else {
        return Ok(None);
    };
    let Some(namespace) = watched(namespaces, &decode_segment(namespace)?) else {
        return Ok(None);
    };
    let shape = || KeyError::EventShape(super::records::excerpt(rest));
    let (component, endpoint, topic, id) = match scoped {
        ["topic", topic, id] => (None, None, topic, id),
        ["component", component, "topic", topic, id] => (Some(decode_segment(component)?), None, topic, id),
        ["component", component, "endpoint", endpoint, "topic", topic, id] => {
            (Some(decode_segment(component)?), Some(decode_segment(endpoint)?), topic, id)
        }
        _ => return Err(shape()),
    };
    let topic = decode_segment(topic)?;
    let path = KeyPath::Event { component, endpoint, topic };
    Ok(Some(ParsedKey { keyspace, namespace, path, id: Some((*id).to_owned()) }))
}

/// Reverses Dynamo's segment encoding: ASCII alphanumerics, `-` and `_` pass, other bytes are
/// `%XX`. Lenient about which bytes arrive unescaped; strict about malformed escapes.
pub fn decode_segment(segment: &str) -> Result<String, KeyError> {
    let bad = || KeyError::Escape(super::records::excerpt(segment));
    let bytes = segment.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        if byte != b'%' {
            decoded.push(byte);
            at += 1;
            continue;
        }
        let hex = bytes.get(at + 1..at + 3).and_then(|h| std::str::from_utf8(h).ok()).ok_or_else(bad)?;
        decoded.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
        at += 3;
    }
    String::from_utf8(decoded).map_err(|_| bad())
}

/// Dynamo's segment encoding: ASCII alphanumerics, `-` and `_` pass, other bytes `%XX`.
pub fn encode_segment(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(names: &[&str]) -> Vec<Arc<str>> {
        names.iter().map(|n| Arc::from(*n)).collect()
    }

    fn event(component: Option<&str>, endpoint: Option<&str>, topic: &str) -> KeyPath {
        KeyPath::Event {
            component: component.map(str::to_owned),
            endpoint: endpoint.map(str::to_owned),
            topic: topic.into(),
        }
    }

    fn registry(component: &str, endpoint: &str) -> KeyPath {
        KeyPath::Registry { component: Some(component.into()), endpoint: Some(endpoint.into()) }
    }

    #[test]
    fn keys_classify_by_keyspace_and_watched_namespace() {
        let watched = ns(&["dynamo", "ns.one"]);
        type Want = Option<(Keyspace, &'static str, KeyPath, Option<&'static str>)>;
        let cases: Vec<(&str, Want)> = vec![
            (
                "v1/instances/dynamo/backend/generate/6a6c",
                Some((Keyspace::Instances, "dynamo", registry("backend", "generate"), Some("6a6c"))),
            ),
            (
                "v1/mdc/dynamo/prefill/generate/6a6c",
                Some((Keyspace::Models, "dynamo", registry("prefill", "generate"), Some("6a6c"))),
            ),
            (
                "v1/mdc/dynamo/prefill/generate/6a6c/lora-a",
                Some((Keyspace::Models, "dynamo", registry("prefill", "generate"), Some("6a6c"))),
            ),
            (
                "v1/mdc/dynamo/tiny",
                Some((Keyspace::Models, "dynamo", KeyPath::Registry { component: None, endpoint: None }, None)),
            ),
            (
                "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv_metrics/149f",
                Some((
                    Keyspace::EventChannels,
                    "dynamo",
                    event(Some("backend"), Some("generate"), "kv_metrics"),
                    Some("149f"),
                )),
            ),
            (
                "v1/event_sources/namespace/ns%2Eone/component/prefill/topic/kv-events/1ee8",
                Some((Keyspace::EventSources, "ns.one", event(Some("prefill"), None, "kv-events"), Some("1ee8"))),
            ),
            (
                "v1/event_channels/namespace/dynamo/topic/kv_metrics/1",
                Some((Keyspace::EventChannels, "dynamo", event(None, None, "kv_metrics"), Some("1"))),
            ),
            ("v1/instances/dynamo2/backend/generate/1", None),
            ("v1/instances/dyn/backend/generate/1", None),
            ("v1/event_channels/namespace/other/component/x/topic/kv_metrics/1", None),
            ("v1/other/dynamo/backend/generate/1", None),
            ("v2/instances/dynamo/backend/generate/1", None),
        ];
        for (key, want) in cases {
            let got = classify(&watched, key.as_bytes());
            let want = want.map(|(keyspace, namespace, path, id)| ParsedKey {
                keyspace,
                namespace: Arc::from(namespace),
                path,
                id: id.map(str::to_owned),
            });
            assert_eq!(got, Ok(want), "{key}");
        }
    }

    #[test]
    fn malformed_event_keys_in_a_watched_namespace_are_errors() {
        let watched = ns(&["dynamo"]);
        let cases = [
            "v1/event_channels/namespace/dynamo/component/backend/kv_metrics/1",
            "v1/event_channels/namespace/dynamo/topic/kv%2/1",
            "v1/event_sources/namespace/dynamo/component/b%ZZ/topic/kv-events/1",
        ];
        for key in cases {
            assert!(classify(&watched, key.as_bytes()).is_err(), "{key}");
        }
        assert_eq!(classify(&watched, b"v1/instances/\xff/x"), Err(KeyError::NotUtf8));
        // The error quotes a fleet-authored key, and is logged: only its start.
        let long = format!("v1/event_channels/namespace/dynamo/{}", "x/".repeat(1 << 20));
        let Err(error) = classify(&watched, long.as_bytes()) else { panic!("a malformed key") };
        assert!(error.to_string().len() < 512, "{} bytes", error.to_string().len());
    }

    #[test]
    fn segments_round_trip_through_dynamo_encoding() {
        for raw in ["dynamo", "ns.one", "a/b c", "kv-events", "kv_metrics", "é"] {
            assert_eq!(decode_segment(&encode_segment(raw)).as_deref(), Ok(raw), "{raw}");
        }
        assert_eq!(encode_segment("ns.one"), "ns%2Eone");
    }
}
