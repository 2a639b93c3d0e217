//! Unknown keys: every one is an error at its key path, with a did-you-mean suggestion when a
//! known sibling key is a small edit away (`endpoint` → `endpoints`).
//!
//! The known keys are read off a fully populated example configuration serialized to YAML, so
//! they can never drift from the structs.

use std::collections::BTreeSet;

use serde_yaml_ng::Value;

use super::Config;
use super::diagnostic::Diagnostic;
use super::discovery::{EtcdAuthConfig, EtcdTlsConfig, KubernetesModelConfig, StaticWorkerConfig, WorkerRole};
use super::event_bus::BrokerConfig;
use super::path::{KeyPath, Segment};
use super::signals::ShimPoolConfig;
use super::types::{BackendConfig, ListenerTlsConfig};

/// The largest edit distance still worth suggesting.
const MAX_SUGGESTION_DISTANCE: usize = 2;

pub(super) fn describe(unknown: &BTreeSet<KeyPath>) -> Vec<Diagnostic> {
    if unknown.is_empty() {
        return Vec::new();
    }
    let schema = schema();
    unknown.iter().map(|path| describe_one(&schema, path)).collect()
}

fn describe_one(schema: &Value, path: &KeyPath) -> Diagnostic {
    let Some((parent, Segment::Key(key))) = path.split_last() else {
        return Diagnostic::error(path.to_string(), "unexpected value");
    };
    let siblings = known_keys(schema, &parent);
    let message = match suggest(key, &siblings) {
        Some(known) => format!("unknown key `{key}`; did you mean `{known}`?"),
        None if siblings.is_empty() => format!("unknown key `{key}`"),
        None => format!("unknown key `{key}`; known keys here: {}", siblings.join(", ")),
    };
    Diagnostic::error(path.to_string(), message)
}

/// The keys the configuration accepts under `parent` (every sequence index reads item 0).
fn known_keys(schema: &Value, parent: &KeyPath) -> Vec<String> {
    let mut node = schema;
    for segment in &parent.0 {
        let next = match (segment, node) {
            (Segment::Key(key), Value::Mapping(map)) => map.get(key.as_str()),
            (Segment::Index(_), Value::Sequence(items)) => items.first(),
            _ => None,
        };
        match next {
            Some(next) => node = next,
            None => return Vec::new(),
        }
    }
    match node {
        Value::Mapping(map) => map.keys().filter_map(Value::as_str).map(str::to_owned).collect(),
        _ => Vec::new(),
    }
}

fn suggest<'a>(key: &str, known: &'a [String]) -> Option<&'a str> {
    let key = key.to_ascii_lowercase();
    known
        .iter()
        .map(|candidate| (edit_distance(&key, candidate), candidate))
        .filter(|(distance, candidate)| *distance <= MAX_SUGGESTION_DISTANCE.min(candidate.len().div_ceil(3)))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate.as_str())
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// Every optional section present and every list holding one item, so that serializing it
/// names every key the configuration accepts.
fn schema() -> Value {
    let mut config = Config::default();
    let discovery = &mut config.dynamo.discovery;
    discovery.etcd.tls = Some(EtcdTlsConfig::default());
    discovery.etcd.auth = Some(EtcdAuthConfig::default());
    discovery.kubernetes.models = vec![KubernetesModelConfig::default()];
    discovery.static_fleet.workers = vec![StaticWorkerConfig { role: Some(WorkerRole::Decode), ..Default::default() }];
    config.dynamo.shim.pools = vec![ShimPoolConfig::default()];
    config.dynamo.event_bus.brokers = vec![BrokerConfig::default()];
    config.backends = vec![BackendConfig::default()];
    config.control_plane.tls = Some(ListenerTlsConfig::default());
    serde_yaml_ng::to_value(&config).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::edit_distance;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        let cases = [("endpoint", "endpoints", 1), ("namepsace", "namespace", 2), ("", "abc", 3), ("same", "same", 0)];
        for (a, b, expected) in cases {
            assert_eq!(edit_distance(a, b), expected, "{a} vs {b}");
        }
    }
}
