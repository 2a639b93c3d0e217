//! The discovery registry: the latest discovered fleet with a generation, and the bridge from
//! it to the fleet the data plane sees.
//!
//! Publishing swaps the fleet and bumps the generation in one `watch` send, so a reader never
//! sees a new generation with an old fleet; a fleet equal to the current one (an idempotent
//! resync) changes neither.

use std::sync::Arc;

use tokio::sync::watch;

use crate::discovery::Fleet;
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
        fleet.workers.retain(|w| kept(&w.worker.key.namespace));
        fleet.publishers.retain(|p| kept(&p.namespace));
        self.publish(fleet);
    }

    /// Publishes `fleet` if it differs from the current one; routable workers go on to the
    /// data plane's view.
    pub fn publish(&self, fleet: Fleet) {
        let changed = self.tx.send_if_modified(|current| {
            if current.fleet == fleet {
                return false;
            }
            *current = Arc::new(Generation { generation: current.generation + 1, fleet });
            true
        });
        if changed {
            let current = self.current();
            let workers = current.fleet.routable().map(|w| Arc::new(w.clone()));
            self.publisher.apply(FleetChange::replace_workers(self.publisher.current().view(), workers));
        }
    }
}
