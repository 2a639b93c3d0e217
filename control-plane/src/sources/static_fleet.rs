//! The `static` discovery source: workers listed in the configuration itself. It needs no
//! external service, so the embedded default runs anywhere; validation has already refused
//! duplicates, zero ids and missing roles.

use std::sync::Arc;

use continuum_proto::model::{Role, Worker, WorkerKey};

use crate::config::StaticDiscoveryConfig;

/// The configured workers as the fleet publishes them.
pub fn static_workers(config: &StaticDiscoveryConfig) -> Vec<Arc<Worker>> {
    config
        .workers
        .iter()
        .map(|w| {
            Arc::new(Worker {
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
            })
        })
        .collect()
}
