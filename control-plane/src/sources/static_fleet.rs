//! The `static` discovery source: workers listed in the configuration itself. It needs no
//! external service, so the embedded default runs anywhere; validation has already refused
//! duplicates, zero ids and missing roles.

use std::time::SystemTime;

use continuum_proto::model::{Role, Worker, WorkerKey};

use crate::config::StaticDiscoveryConfig;
use crate::discovery::{DiscoveredWorker, Entries, Fleet};

/// The configured workers as discovery publishes them, first seen `now`.
pub fn static_fleet(config: &StaticDiscoveryConfig, now: SystemTime) -> Fleet {
    let workers = config
        .workers
        .iter()
        .map(|w| {
            (
                WorkerKey::new(w.namespace.as_str(), w.instance_id),
                DiscoveredWorker {
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
                },
            )
        })
        .collect();
    Fleet { workers, publishers: Entries::default() }
}
