//! The discovery registry: the latest discovered fleet with a generation, and the bridge from
//! it to the fleet the data plane sees.
//!
//! Publishing swaps the fleet and bumps the generation in one `watch` send, so a reader never
//! sees a new generation with an old fleet; a fleet equal to the current one (an idempotent
//! resync) changes neither.

use std::sync::Arc;

use tokio::sync::watch;

use continuum_proto::model::Role;

use crate::discovery::{Change, Fleet};
use crate::fleet::{FleetChange, FleetPublisher};

/// One published generation of the discovered fleet.
#[derive(Debug, Default)]
pub struct Generation {
    pub generation: u64,
    pub fleet: Fleet,
}

#[derive(Debug, Clone)]
pub struct Registry {
    tx: watch::Sender<Arc<Generation>>,
    publisher: FleetPublisher,
}

impl Registry {
    pub fn new(publisher: FleetPublisher) -> Self {
        Self { tx: watch::channel(Arc::new(Generation::default())).0, publisher }
    }

    pub fn current(&self) -> Arc<Generation> {
        Arc::clone(&self.tx.borrow())
    }

    /// Follows generations (a slow reader skips to the newest; old fleets are not pinned).
    pub fn subscribe(&self) -> watch::Receiver<Arc<Generation>> {
        self.tx.subscribe()
    }

    /// Drops every worker and publisher outside `keep` (a namespace removed on reload), keeping
    /// the rest routable without interruption.
    pub fn prune_namespaces(&self, keep: &[String]) {
        let current = self.current();
        let kept = |ns: &str| keep.iter().any(|k| k == ns);
        let mut fleet = current.fleet.clone();
        fleet.workers.retain(|key, _| kept(&key.namespace));
        fleet.publishers.retain(|key, _| kept(&key.namespace));
        self.publish(fleet);
    }

    /// Publishes `fleet` if it differs from the current one; the workers that changed go on to
    /// the data plane's view (routable ones upserted, the rest removed).
    pub fn publish(&self, fleet: Fleet) {
        let mut previous = None;
        self.tx.send_if_modified(|current| {
            if current.fleet == fleet {
                return false;
            }
            let next = Arc::new(Generation { generation: current.generation + 1, fleet });
            previous = Some(std::mem::replace(current, next));
            true
        });
        if let Some(previous) = previous {
            self.publisher.apply(worker_changes(&previous.fleet, &self.current().fleet));
        }
    }
}

/// The fleet-view change from one discovered fleet to the next.
fn worker_changes(older: &Fleet, newer: &Fleet) -> FleetChange {
    let mut change = FleetChange::default();
    for difference in newer.workers.changes_since(&older.workers) {
        match difference {
            Change::Upserted(w) if w.excluded.is_none() && w.worker.role != Role::Unknown => {
                change.upsert.push(Arc::new(w.worker.clone()));
            }
            Change::Upserted(w) => change.remove.push(w.worker.key.clone()),
            Change::Removed(key) => change.remove.push(key.clone()),
        }
    }
    change
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use continuum_proto::model::{Capacity, DataPlaneConfig, Worker, WorkerKey};

    use super::*;
    use crate::discovery::{DiscoveredWorker, Exclusion};

    fn discovered(id: u64, role: Role, model: &str) -> (WorkerKey, DiscoveredWorker) {
        let key = WorkerKey::new("dynamo", id);
        let worker = Worker {
            key: key.clone(),
            role,
            model: model.into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: Capacity::default(),
            dp_start_rank: 0,
            dp_size: 0,
            disaggregated_endpoint: None,
            artifacts: None,
        };
        let now = SystemTime::now();
        (key, DiscoveredWorker { worker, first_seen: now, last_updated: now, card: None, excluded: None })
    }

    fn view_ids(publisher: &FleetPublisher) -> Vec<u64> {
        publisher.current().view().workers().keys().map(|k| k.instance_id).collect()
    }

    #[test]
    fn only_routable_workers_reach_the_view_and_changes_follow_generations() {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        let registry = Registry::new(publisher.clone());
        let (k3, mut excluded) = discovered(3, Role::Decode, "m");
        excluded.excluded = Some(Exclusion::RoleDisagreement { component: Role::Prefill, card: Role::Decode });
        let mut fleet = Fleet::default();
        for (key, worker) in [discovered(1, Role::Prefill, "m"), discovered(2, Role::Unknown, "m"), (k3, excluded)] {
            fleet.workers.insert(key, worker);
        }
        registry.publish(fleet.clone());
        assert_eq!(registry.current().generation, 1);
        assert_eq!(view_ids(&publisher), [1], "unknown and excluded workers are listed, never routed");

        let version = publisher.current().version();
        registry.publish(fleet.clone());
        assert_eq!(registry.current().generation, 1, "an identical fleet is not a new generation");
        assert_eq!(publisher.current().version(), version);

        let (k1, changed) = discovered(1, Role::Prefill, "other-model");
        fleet.workers.insert(k1, changed);
        let (k4, added) = discovered(4, Role::Decode, "m");
        fleet.workers.insert(k4, added);
        registry.publish(fleet.clone());
        assert_eq!(view_ids(&publisher), [1, 4]);
        let model = publisher.current().view().worker(&WorkerKey::new("dynamo", 1)).map(|w| w.model.clone());
        assert_eq!(model.as_deref(), Some("other-model"));

        fleet.workers.remove(&WorkerKey::new("dynamo", 1));
        registry.publish(fleet);
        assert_eq!(view_ids(&publisher), [4]);
        assert_eq!(registry.current().generation, 3);
    }
}
