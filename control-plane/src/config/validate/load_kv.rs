//! `dynamo.load` (staleness, the direct-dial allow-list, the transport) and `dynamo.kv` (pins
//! and picker parameters).

use std::time::Duration;

use super::Report;
use crate::config::Config;
use crate::config::discovery::DiscoverySource;
use crate::config::signals::{KvConfig, LoadTransport};
use crate::config::values::Cidr;

/// Bounds of `dynamo.load.max_staleness`.
pub const MIN_MAX_STALENESS: Duration = Duration::from_millis(100);
pub const MAX_MAX_STALENESS: Duration = continuum_proto::MAX_STALENESS;
/// Networks `dynamo.load.direct_allow_cidrs` may list.
pub const MAX_DIRECT_ALLOW_CIDRS: usize = 64;
/// Longest `dynamo.kv.provisional_ttl`: past it a pin the worker never honoured would keep
/// attracting its prefix long after the kv-events should have answered.
pub const MAX_PROVISIONAL_TTL: Duration = Duration::from_secs(60);

const LOAD: &str = "dynamo.load";
const KV: &str = "dynamo.kv";

pub(super) fn check(config: &Config, report: &mut Report) {
    check_load(config, report);
    check_kv(&config.dynamo.kv, report);
}

fn check_load(config: &Config, report: &mut Report) {
    let load = &config.dynamo.load;
    if !(MIN_MAX_STALENESS..=MAX_MAX_STALENESS).contains(&load.max_staleness) {
        report.error(format!("{LOAD}.max_staleness"), "must be between 100ms and 5m");
    } else if !load.max_staleness.subsec_nanos().is_multiple_of(1_000_000) {
        // Replicas are sent it in whole milliseconds: a finer part would make the two planes
        // read a sample's staleness differently.
        report.error(format!("{LOAD}.max_staleness"), "must be a whole number of milliseconds");
    }
    // Static workers have no publishers, so the dial policy and transport do not apply.
    let subscribes = config.dynamo.enabled && config.dynamo.discovery.source != DiscoverySource::Static;
    let path = format!("{LOAD}.direct_allow_cidrs");
    match &load.direct_allow_cidrs {
        None if subscribes && load.transport == LoadTransport::Direct => report.warning(
            &path,
            "is unset, so load publishers are dialled at any address they announce; list the worker Pod CIDRs (e.g. 10.0.0.0/8)",
        ),
        None => {}
        Some(cidrs) => check_cidrs(&path, cidrs, report),
    }
    // An error, not a warning: the router would start, read ready, and route blind.
    if subscribes && load.transport == LoadTransport::Broker {
        report.error(
            format!("{LOAD}.transport"),
            "is broker, which this build cannot carry (it has no event-bus listener nor event-broker yet): every \
             subscription would stay pending and routing would run without load samples or kv-events; use direct",
        );
    }
}

fn check_cidrs(path: &str, cidrs: &[String], report: &mut Report) {
    if cidrs.len() > MAX_DIRECT_ALLOW_CIDRS {
        report.error(path, format!("lists {} networks; at most {MAX_DIRECT_ALLOW_CIDRS} are supported", cidrs.len()));
    }
    if cidrs.is_empty() {
        report
            .warning(path, "is empty, so every direct-mode publisher is refused; omit it or list the worker Pod CIDRs");
    }
    for (index, cidr) in cidrs.iter().enumerate() {
        if let Err(problem) = cidr.parse::<Cidr>() {
            report.error(format!("{path}[{index}]"), problem);
        }
    }
}

fn check_kv(kv: &KvConfig, report: &mut Report) {
    for (index, pin) in kv.pinned_artifacts.iter().enumerate() {
        if !is_blake3_pin(pin) {
            report.error(
                format!("{KV}.pinned_artifacts[{index}]"),
                format!("`{pin}` must be blake3: followed by 64 lowercase hex digits (b3sum output)"),
            );
        }
    }
    if kv.enabled && kv.pinned_artifacts.is_empty() {
        report.warning(
            format!("{KV}.pinned_artifacts"),
            "is empty: no tokenizer is loaded until its blake3 checksum is pinned, so selection never gets the KV term",
        );
    }
    if kv.artifact_cache_dir.as_os_str().is_empty() {
        report.error(format!("{KV}.artifact_cache_dir"), "must not be empty");
    }
    let weights = [
        ("overlap_score_credit", kv.overlap_score_credit),
        ("prefill_load_scale", kv.prefill_load_scale),
        ("router_temperature", kv.router_temperature),
    ];
    for (key, value) in weights {
        if !value.is_finite() || value < 0.0 {
            report.error(format!("{KV}.{key}"), format!("must be a finite number >= 0 (got {value})"));
        }
    }
    if kv.provisional_ttl > MAX_PROVISIONAL_TTL {
        report.error(format!("{KV}.provisional_ttl"), "must be at most 60s (0s turns the provisional credit off)");
    }
    let conditional = &kv.conditional_disaggregation;
    if conditional.enabled {
        report.warning(
            format!("{KV}.conditional_disaggregation.enabled"),
            "on Dynamo 1.5.x, dynamo.frontend --router-mode direct rejects requests without a prefill id whenever prefill \
             workers are registered, so a conditional bypass answers 503 disaggregated_prefill_decode_unavailable; \
             enable it only for frontends that accept a decode-only pin",
        );
    }
    // `contains` is false for NaN, so a NaN threshold is refused too.
    if let Some(threshold) = conditional.decode_busy_threshold
        && !(0.0..=1.0).contains(&threshold)
    {
        report.error(
            format!("{KV}.conditional_disaggregation.decode_busy_threshold"),
            format!("must be a fraction of total_kv_blocks between 0.0 and 1.0 (got {threshold})"),
        );
    }
}

fn is_blake3_pin(pin: &str) -> bool {
    pin.strip_prefix("blake3:")
        .is_some_and(|hex| hex.len() == 64 && hex.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)))
}
