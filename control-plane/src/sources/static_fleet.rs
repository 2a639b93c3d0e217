//! The `static` discovery source: workers listed in the configuration itself. It needs no
//! external service, so the embedded default runs anywhere; validation has already refused
//! duplicates, zero ids and missing roles.

use std::time::SystemTime;

use continuum_proto::model::{Role, Worker, WorkerKey};

use crate::config::StaticDiscoveryConfig;
use crate::discovery::{DiscoveredWorker, Entries, Fleet};

/// The configured workers as discovery publishes them, first seen `now`: a worker `previous`
/// lists already (a reload that kept it) keeps its entry, or, changed, when it was first seen.
pub fn static_fleet(config: &StaticDiscoveryConfig, now: SystemTime, previous: &Fleet) -> Fleet {
    let workers = config
        .workers
        .iter()
        .map(|w| {
            let key = WorkerKey::new(w.namespace.as_str(), w.instance_id);
            let listed = DiscoveredWorker {
                worker: Worker {
                    key: WorkerKey::new(w.namespace.as_str(), w.instance_id),
                    role: w.role.map_or(Role::Unknown, Role::from),
                    model: w.model.clone(),
                    component: w.component().to_string(),
                    endpoint: w.endpoint.clone(),
                    block_size: w.block_size,
                    capacity: w.capacity,
                    dp_start_rank: w.dp_start_rank,
                    dp_size: w.dp_size,
                    disaggregated_endpoint: None,
                    artifacts: None,
                },
                first_seen: now,
                last_updated: now,
                card: None,
                excluded: None,
            };
            let entry = match previous.worker(&key) {
                Some(kept) if kept.worker == listed.worker => kept.clone(),
                Some(changed) => DiscoveredWorker { first_seen: changed.first_seen, ..listed },
                None => listed,
            };
            (key, entry)
        })
        .collect();
    Fleet { workers, publishers: Entries::default() }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{StaticWorkerConfig, WorkerRole};

    fn listed(ids_models: &[(u64, &str)]) -> StaticDiscoveryConfig {
        let worker = |&(instance_id, model): &(u64, &str)| StaticWorkerConfig {
            instance_id,
            role: Some(WorkerRole::Decode),
            model: model.into(),
            endpoint: "generate".into(),
            ..StaticWorkerConfig::default()
        };
        StaticDiscoveryConfig { workers: ids_models.iter().map(worker).collect() }
    }

    /// A reload keeps a worker it did not change as it was, and when a changed one was first
    /// seen: replicas are sent what changed, and the admin API's `first_seen` holds.
    #[test]
    fn a_reload_keeps_what_it_did_not_change() {
        let (t0, t1) = (SystemTime::UNIX_EPOCH, SystemTime::UNIX_EPOCH + Duration::from_secs(60));
        let before = static_fleet(&listed(&[(1, "m"), (2, "m")]), t0, &Fleet::default());
        let after = static_fleet(&listed(&[(1, "m"), (2, "n"), (3, "m")]), t1, &before);
        let at = |id: u64| after.worker(&WorkerKey::new("dynamo", id)).map(|w| (w.first_seen, w.last_updated));
        assert_eq!(after.worker(&WorkerKey::new("dynamo", 1)), before.worker(&WorkerKey::new("dynamo", 1)));
        assert_eq!(at(1), Some((t0, t0)));
        assert_eq!(at(2), Some((t0, t1)), "changed: first seen before, updated now");
        assert_eq!(at(3), Some((t1, t1)));
    }
}
