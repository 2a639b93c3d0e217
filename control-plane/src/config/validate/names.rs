//! Checks shared by several sections: Dynamo namespaces, Kubernetes names, namespace lists,
//! duplicates and backoff timings.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use super::Report;
use crate::config::discovery::BackoffConfig;

/// Dynamo namespaces one router may watch (`namespaces`, `dynamo_namespaces`).
pub const MAX_DYNAMO_NAMESPACES: usize = 16;

/// What is wrong with a Dynamo namespace (`DYN_NAMESPACE`), if anything.
pub(super) fn namespace_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("must not be empty")
    } else if name.contains('/') {
        Some("must not contain `/` (it is a segment of Dynamo's etcd keys)")
    } else if name.chars().any(char::is_whitespace) {
        Some("must not contain whitespace")
    } else if name.chars().any(char::is_control) {
        Some("must not contain control characters")
    } else {
        None
    }
}

pub(super) fn check_namespace(report: &mut Report, path: &str, name: &str) {
    if let Some(problem) = namespace_problem(name) {
        report.error(path, format!("namespace `{name}` {problem}"));
    }
}

/// A namespace list: bounded, unique, each entry valid by `problem`.
pub(super) fn check_namespace_list(
    report: &mut Report,
    path: &str,
    names: &[String],
    problem: fn(&str) -> Option<String>,
) {
    if names.len() > MAX_DYNAMO_NAMESPACES {
        report.error(path, format!("lists {} namespaces; at most {MAX_DYNAMO_NAMESPACES} are supported", names.len()));
    }
    for (index, name) in names.iter().enumerate() {
        if let Some(problem) = problem(name) {
            report.error(format!("{path}[{index}]"), problem);
        }
    }
    for (index, first) in duplicates(names.iter()) {
        report.error(format!("{path}[{index}]"), format!("duplicates {path}[{first}]"));
    }
}

/// `Some(message)` when `name` is not a valid Dynamo namespace.
pub(super) fn dynamo_namespace_message(name: &str) -> Option<String> {
    namespace_problem(name).map(|problem| format!("namespace `{name}` {problem}"))
}

/// Kubernetes namespace names are RFC 1123 labels.
pub(super) fn dns_label_message(name: &str) -> Option<String> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    (!valid).then(|| {
        format!(
            "`{name}` is not a DNS-1123 label (1-63 lowercase letters, digits or `-`, starting and ending alphanumeric)"
        )
    })
}

/// The `nvidia.com/dynamo-namespace` label carries the Dynamo namespace, so it must be a
/// non-empty Kubernetes label value.
pub(super) fn label_value_message(value: &str) -> Option<String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let valid = !value.is_empty()
        && value.len() <= 63
        && value.chars().all(allowed)
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric());
    (!valid).then(|| {
        format!("`{value}` is not a non-empty Kubernetes label value (1-63 of [A-Za-z0-9._-], starting and ending alphanumeric)")
    })
}

/// `(index, index of the first occurrence)` for every repeated item.
pub(super) fn duplicates<T: Eq + Hash>(items: impl Iterator<Item = T>) -> Vec<(usize, usize)> {
    let mut first_seen = HashMap::new();
    let mut repeats = Vec::new();
    for (index, item) in items.enumerate() {
        if let Some(first) = first_seen.get(&item) {
            repeats.push((index, *first));
        } else {
            first_seen.insert(item, index);
        }
    }
    repeats
}

/// The shortest first reconnect delay: below it a source that drops every watch at once (the
/// seed's etcd proxy) is redialled and re-listed in a hot loop.
const MIN_RECONNECT_BACKOFF: Duration = Duration::from_millis(10);
/// The longest reconnect delay: past it a source that failed a few times in a row is not
/// tried again for hours (and a watch never lasts long enough to reset its backoff).
const MAX_RECONNECT_BACKOFF: Duration = Duration::from_secs(3600);

pub(super) fn check_backoff(report: &mut Report, path: &str, backoff: &BackoffConfig) {
    if backoff.initial < MIN_RECONNECT_BACKOFF {
        report.error(
            format!("{path}.initial"),
            "must be at least 10ms (a shorter backoff redials and re-lists in a hot loop)",
        );
    }
    if backoff.max < backoff.initial {
        report.error(
            format!("{path}.max"),
            format!("must be >= initial ({})", humantime::format_duration(backoff.initial)),
        );
    }
    if backoff.max > MAX_RECONNECT_BACKOFF {
        report.error(
            format!("{path}.max"),
            "must be at most 1h (a longer one leaves a failed source untried for hours, and its watch never lasts long enough to reset it)",
        );
    }
}
