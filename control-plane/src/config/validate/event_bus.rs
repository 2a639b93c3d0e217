//! `dynamo.event_bus`: the listener's TLS, broker credentials and grants, and session limits.

use super::Report;
use super::names::{check_namespace, duplicates};
use crate::config::Config;
use crate::config::event_bus::{BrokerConfig, BrokerRole, EventBusConfig};

/// Each stream's per-direction buffer is carved out of `max_session_buffer_bytes`; below this
/// much per stream the four reservations per stream cannot all fit.
pub const MIN_SESSION_BUFFER_BYTES_PER_STREAM: u64 = 64 * 1024;

const BASE: &str = "dynamo.event_bus";

/// The longest heartbeat interval or idle timeout: a session silent for an hour is gone, and
/// a bound keeps a deadline computed from them within what a clock can add.
const MAX_SESSION_TIMING: std::time::Duration = std::time::Duration::from_secs(3600);

pub(super) fn check(config: &Config, report: &mut Report) {
    let bus = &config.dynamo.event_bus;
    if bus.enabled {
        report.warning(
            format!("{BASE}.enabled"),
            "is true, but this build has no event-bus listener yet: these keys are validated and nothing listens",
        );
        check_tls(bus, report);
        if bus.brokers.is_empty() {
            report.warning(format!("{BASE}.brokers"), "is empty: no broker or KV listener can authenticate");
        }
    }
    check_limits(bus, report);
    for (index, broker) in bus.brokers.iter().enumerate() {
        check_broker(&format!("{BASE}.brokers[{index}]"), broker, bus, report);
    }
    for (index, first) in duplicates(bus.brokers.iter().map(|b| b.id.as_str()).filter(|id| !id.is_empty())) {
        report.error(format!("{BASE}.brokers[{index}].id"), format!("duplicates {BASE}.brokers[{first}].id"));
    }
}

fn check_tls(bus: &EventBusConfig, report: &mut Report) {
    if bus.tls.cert.is_none() {
        report.error(format!("{BASE}.tls.cert"), "is required: the listener serves TLS 1.3 only");
    }
    if bus.tls.key.is_none() {
        report.error(format!("{BASE}.tls.key"), "is required: the listener serves TLS 1.3 only");
    }
}

fn check_limits(bus: &EventBusConfig, report: &mut Report) {
    if bus.max_sessions == 0 {
        report.error(format!("{BASE}.max_sessions"), "must be at least 1");
    }
    if bus.max_streams_per_session == 0 {
        report.error(format!("{BASE}.max_streams_per_session"), "must be at least 1");
    }
    let floor = u64::from(bus.max_streams_per_session) * MIN_SESSION_BUFFER_BYTES_PER_STREAM;
    if bus.max_session_buffer_bytes < floor {
        report.error(
            format!("{BASE}.max_session_buffer_bytes"),
            format!("must be at least max_streams_per_session x 64 KiB = {floor} bytes"),
        );
    }
    if bus.heartbeat_interval.is_zero() {
        report.error(format!("{BASE}.heartbeat_interval"), "must be greater than zero");
    }
    for (key, value) in [("heartbeat_interval", bus.heartbeat_interval), ("idle_timeout", bus.idle_timeout)] {
        if value > MAX_SESSION_TIMING {
            report.error(format!("{BASE}.{key}"), format!("must be at most {MAX_SESSION_TIMING:?}"));
        }
    }
    if bus.idle_timeout <= bus.heartbeat_interval {
        report.error(
            format!("{BASE}.idle_timeout"),
            "must be longer than heartbeat_interval, or healthy sessions are cut between heartbeats",
        );
    }
}

fn check_broker(path: &str, broker: &BrokerConfig, bus: &EventBusConfig, report: &mut Report) {
    let id = &broker.id;
    if id.is_empty() {
        report.error(format!("{path}.id"), "must not be empty");
    } else if id.chars().any(|c| c.is_ascii_uppercase() || c.is_whitespace() || c.is_control() || c == '*') {
        report.error(
            format!("{path}.id"),
            format!(
                "`{id}` must be lowercase without wildcards or whitespace (it is matched against a certificate DNS SAN)"
            ),
        );
    }
    match &broker.token_hash {
        Some(hash) if !is_sha256_hash(hash) => report.error(
            format!("{path}.token_hash"),
            "must be sha256: followed by 64 lowercase hex digits (printf %s \"$TOKEN\" | sha256sum), never the token",
        ),
        None if bus.tls.client_ca.is_none() => report.error(
            format!("{path}.token_hash"),
            "is required unless dynamo.event_bus.tls.client_ca authenticates brokers by certificate",
        ),
        _ => {}
    }
    match broker.role {
        BrokerRole::Broker => check_broker_grant(path, broker, report),
        BrokerRole::KvListener => check_listener_grant(path, broker, report),
    }
}

fn check_broker_grant(path: &str, broker: &BrokerConfig, report: &mut Report) {
    if !broker.backends.is_empty() {
        report.error(format!("{path}.backends"), "applies only to role: kv_listener; a broker is granted namespaces");
    }
    if broker.namespaces.is_empty() {
        report.warning(format!("{path}.namespaces"), "is empty, so this broker may cover any Dynamo namespace");
    }
    for (index, namespace) in broker.namespaces.iter().enumerate() {
        check_namespace(report, &format!("{path}.namespaces[{index}]"), namespace);
    }
}

fn check_listener_grant(path: &str, broker: &BrokerConfig, report: &mut Report) {
    if !broker.namespaces.is_empty() {
        report.error(format!("{path}.namespaces"), "applies only to role: broker; a kv_listener is granted backends");
    }
    if broker.backends.is_empty() {
        report.warning(format!("{path}.backends"), "is empty, so this kv_listener may announce no source");
    }
    for (index, backend) in broker.backends.iter().enumerate() {
        if backend.is_empty() {
            report.error(format!("{path}.backends[{index}]"), "must not be empty");
        }
    }
}

fn is_sha256_hash(hash: &str) -> bool {
    hash.strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)))
}
