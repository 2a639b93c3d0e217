//! `dynamo.discovery.static.workers`: Continuum's fixed fleet for demos and the embedded
//! default. Identity is (namespace, instance_id), as for discovered workers.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use super::Report;
use super::names::{MAX_DYNAMO_NAMESPACES, check_namespace};
use crate::config::Config;
use crate::config::discovery::{DiscoverySource, StaticWorkerConfig};
use crate::discovery::MAX_DATA_PARALLEL_SIZE;

/// The same ceiling the discovery reducer puts on records per keyspace.
pub const MAX_STATIC_WORKERS: usize = 16_384;

const BASE: &str = "dynamo.discovery.static.workers";

pub(super) fn check(config: &Config, report: &mut Report) {
    let workers = &config.dynamo.discovery.static_fleet.workers;
    let source = config.dynamo.discovery.source;
    if source == DiscoverySource::Static && config.dynamo.enabled && workers.is_empty() {
        report.warning(BASE, "source is static but no workers are listed: nothing can be routed");
    }
    if source != DiscoverySource::Static && !workers.is_empty() {
        report.warning(BASE, "are ignored: dynamo.discovery.source is not static");
    }
    if workers.len() > MAX_STATIC_WORKERS {
        report.error(BASE, format!("lists {} workers; at most {MAX_STATIC_WORKERS} are supported", workers.len()));
    }
    for (index, worker) in workers.iter().enumerate() {
        check_worker(&format!("{BASE}[{index}]"), worker, report);
    }
    check_identities(workers, report);
    check_namespace_count(workers, report);
}

/// The workers' namespaces are the configured ones (each gets a shim pool, and metrics carry
/// them as labels), under the same ceiling as a list of namespaces to watch.
fn check_namespace_count(workers: &[StaticWorkerConfig], report: &mut Report) {
    let mut seen = HashSet::new();
    for (index, worker) in workers.iter().enumerate() {
        if seen.insert(worker.namespace.as_str()) && seen.len() == MAX_DYNAMO_NAMESPACES + 1 {
            report.error(
                format!("{BASE}[{index}].namespace"),
                format!("is a namespace past the first {MAX_DYNAMO_NAMESPACES}; at most {MAX_DYNAMO_NAMESPACES} are supported"),
            );
        }
    }
}

/// An instance id names one worker in the whole fleet, as Dynamo's lease ids do: the
/// control plane's backlogs and KV index key ranks by instance id alone. Zero ids are already
/// refused on their own.
fn check_identities(workers: &[StaticWorkerConfig], report: &mut Report) {
    let mut first_index = HashMap::new();
    for (index, worker) in workers.iter().enumerate().filter(|(_, w)| w.instance_id != 0) {
        match first_index.entry(worker.instance_id) {
            Entry::Occupied(first) => report.error(
                format!("{BASE}[{index}].instance_id"),
                format!(
                    "duplicates {BASE}[{}] (instance_id {:#x}); instance ids are unique across namespaces, as \
                     Dynamo's lease ids are",
                    first.get(),
                    worker.instance_id
                ),
            ),
            Entry::Vacant(slot) => {
                slot.insert(index);
            }
        }
    }
}

fn check_worker(path: &str, worker: &StaticWorkerConfig, report: &mut Report) {
    check_namespace(report, &format!("{path}.namespace"), &worker.namespace);
    if worker.instance_id == 0 {
        report.error(format!("{path}.instance_id"), "is required and must not be 0");
    }
    if worker.role.is_none() {
        report.error(format!("{path}.role"), "is required: prefill, decode or aggregated");
    }
    if worker.model.is_empty() {
        report.error(format!("{path}.model"), "must name the model the worker serves");
    }
    if worker.component.as_deref() == Some("") {
        report.error(format!("{path}.component"), "must not be empty; omit it for the role's default");
    }
    if worker.endpoint.is_empty() {
        report.error(format!("{path}.endpoint"), "must not be empty");
    }
    if worker.block_size == Some(0) {
        report.error(format!("{path}.block_size"), "must be greater than zero");
    }
    if worker.dp_size > MAX_DATA_PARALLEL_SIZE {
        report.error(format!("{path}.dp_size"), format!("is {}; at most {MAX_DATA_PARALLEL_SIZE}", worker.dp_size));
    } else if worker.dp_start_rank.checked_add(worker.dp_size.max(1)).is_none() {
        report.error(format!("{path}.dp_start_rank"), "leaves its ranks past the last rank number (4294967295)");
    }
}
