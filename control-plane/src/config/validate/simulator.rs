//! `dynamo.discovery.simulator`: the embedded simulated fleet's size and shape.

use continuum_proto::model::{MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};

use super::Report;
use super::names::check_namespace;
use crate::config::Config;
use crate::config::discovery::DiscoverySource;

/// Most simulated workers per role: each holds a loopback listener and its tasks.
pub const MAX_SIMULATED_WORKERS: u32 = 64;

const BASE: &str = "dynamo.discovery.simulator";

/// KV blocks one simulated worker may declare (and cache the hashes of): a real worker's
/// order of magnitude, and a bound on what the demo holds.
pub const MAX_SIMULATED_KV_BLOCKS: u64 = 1 << 20;

pub(super) fn check(config: &Config, report: &mut Report) {
    if config.dynamo.discovery.source != DiscoverySource::Simulator {
        return;
    }
    let simulator = &config.dynamo.discovery.simulator;
    check_namespace(report, &format!("{BASE}.namespace"), &simulator.namespace);
    if simulator.model.is_empty() {
        report.error(format!("{BASE}.model"), "must name the model the simulated workers serve");
    }
    for (key, count) in [("prefill", simulator.prefill), ("decode", simulator.decode)] {
        if count > MAX_SIMULATED_WORKERS {
            report.error(format!("{BASE}.{key}"), format!("is {count}; at most {MAX_SIMULATED_WORKERS} are supported"));
        }
    }
    if simulator.decode == 0 {
        report.error(format!("{BASE}.decode"), "must be at least 1: decode (or aggregated) workers answer requests");
    }
    // What replicas hash prompts for: outside it the simulated fleet would route on load alone.
    if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&simulator.block_size) {
        report.error(
            format!("{BASE}.block_size"),
            format!(
                "is {}; must be {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, the block sizes replicas hash prompts for",
                simulator.block_size
            ),
        );
    }
    if simulator.total_kv_blocks == 0 {
        report.error(format!("{BASE}.total_kv_blocks"), "must be greater than zero");
    }
    // Each simulated worker caches up to this many blocks' hashes.
    if simulator.total_kv_blocks > MAX_SIMULATED_KV_BLOCKS {
        report.error(
            format!("{BASE}.total_kv_blocks"),
            format!("is {}; at most {MAX_SIMULATED_KV_BLOCKS} are simulated", simulator.total_kv_blocks),
        );
    }
    if simulator.lease_ttl.is_zero() {
        report.error(format!("{BASE}.lease_ttl"), "must be greater than zero");
    }
    if simulator.shim_listen.port() == 0 {
        report.error(
            format!("{BASE}.shim_listen"),
            "must name a port: the backends' URL has to say where the simulated shim listens",
        );
    }
    if !simulator.shim_listen.ip().is_loopback() {
        report.warning(
            format!("{BASE}.shim_listen"),
            "is not a loopback address: the simulated shim and its unauthenticated \
             POST /simulator/workers/{id}/kill are reachable off-host",
        );
    }
    let shim = format!("http://{}", simulator.shim_listen);
    if !config.backends.iter().any(|b| b.url.trim_end_matches('/') == shim) {
        report.warning(
            format!("{BASE}.shim_listen"),
            format!("no entry of `backends` has url {shim}: the data plane will not reach the simulated shim"),
        );
    }
}
