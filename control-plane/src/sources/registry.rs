//! The discovery registry: the latest discovered fleet with a generation, and the bridge from
//! it to the fleet the data plane sees.
//!
//! Publishing swaps the fleet and bumps the generation in one `watch` send, so a reader never
//! sees a new generation with an old fleet; a fleet equal to the current one (an idempotent
//! resync) changes neither.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use continuum_proto::model::{LoadKey, Role, WorkerKey};

use crate::discovery::{Change, Fleet};
use crate::fleet::{FleetChange, FleetPublisher};
use crate::load::{LoadStore, SharedLoadStore, live_ranks};

use super::mixing::{self, Mixing};

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
    /// The load samples held for discovered workers, routable or not.
    loads: Option<SharedLoadStore>,
    /// Which (namespace, model) pairs mix aggregated workers with prefill or decode ones.
    mixing: Arc<Mutex<Mixing>>,
}

impl Registry {
    pub fn new(publisher: FleetPublisher) -> Self {
        let tx = watch::channel(Arc::new(Generation::default())).0;
        Self { tx, publisher, loads: None, mixing: Arc::default() }
    }

    /// Workers entering the view bring the samples `store` holds for them (see
    /// [`Self::publish`]).
    pub fn with_loads(self, store: SharedLoadStore) -> Self {
        Self { loads: Some(store), ..self }
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
    /// the data plane's view (routable ones upserted, the rest removed). A worker entering the
    /// view (new, or routable again after an exclusion or a missing card) comes with the load
    /// samples the store holds for it: the view keeps samples of its own workers only, so they
    /// were not published while it was out, and a worker silent since (constant, or stalled
    /// under load) would otherwise read as one that never published, which is idle.
    pub fn publish(&self, fleet: Fleet) {
        let mut replaced = None;
        let mut mixed = Vec::new();
        self.tx.send_if_modified(|current| {
            if current.fleet == fleet {
                return false;
            }
            let next = Arc::new(Generation { generation: current.generation + 1, fleet });
            // Followed here, in generation order: a removal counted before its addition would
            // be lost to the counts' floor.
            mixed = self.mixing.lock().unwrap_or_else(PoisonError::into_inner).update(&current.fleet, &next.fleet);
            replaced = Some(std::mem::replace(current, next));
            true
        });
        mixing::warn(&mixed);
        if let Some(previous) = replaced {
            let current = self.current();
            let mut change = worker_changes(&previous.fleet, &current.fleet);
            // Worked out before the store's lock is taken: every subscription waits on it.
            let live = self.loads.is_some().then(|| live_ranks(&current.fleet));
            // Held until the change is committed: a newer sample stored meanwhile would be
            // published before its worker is in the view, dropped, and then overtaken by the
            // older one read here.
            let mut store = self.loads.as_ref().map(SharedLoadStore::lock);
            if let (Some(store), Some(live)) = (store.as_mut(), live) {
                store.open_gate(current.generation, live);
                self.add_held_samples(store, &mut change);
            }
            self.publisher.apply(change);
        }
    }

    /// Every rank entering the view brings the sample held for it: a new worker's, and one a
    /// worker already in the view gains (its card's ranks grew back, or arrived after a sample
    /// for them). The store drops a rank's sample before its removal is queued, so what it
    /// holds is never for a rank on its way out.
    ///
    /// It runs under the store's lock, which every subscription waits on: so it takes whichever
    /// is fewer, a lookup per rank upserted or one pass over the samples held (a first load of a
    /// large fleet, or cards claiming a thousand ranks each, upsert millions of ranks).
    fn add_held_samples(&self, store: &LoadStore, change: &mut FleetChange) {
        let state = self.publisher.current();
        let entering = |key: &LoadKey| state.view().loads().get(key).is_none();
        let ranks: usize = change.upsert.iter().map(|worker| worker.dp_ranks().len()).sum();
        let held: Vec<_> = if ranks <= store.len() {
            let keys = change
                .upsert
                .iter()
                .flat_map(|worker| worker.dp_ranks().map(|dp_rank| LoadKey { worker: worker.key.clone(), dp_rank }));
            keys.filter(|key| entering(key)).filter_map(|key| Some((key.clone(), store.get(&key)?.sample))).collect()
        } else {
            let upserted: HashMap<&WorkerKey, Range<u32>> =
                change.upsert.iter().map(|worker| (&worker.key, worker.dp_ranks())).collect();
            let serves = |key: &LoadKey| upserted.get(&key.worker).is_some_and(|ranks| ranks.contains(&key.dp_rank));
            let held = store.iter().filter(|(key, _)| serves(key) && entering(key));
            held.map(|(key, held)| (key.clone(), held.sample)).collect()
        };
        change.loads.extend(held);
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
    use std::time::{Duration, Instant};

    use continuum_proto::model::{DataPlaneConfig, Load, WorkerKey};

    use super::*;
    use crate::discovery::{DiscoveredWorker, Exclusion, PublisherKey};

    fn discovered(id: u64, role: Role, model: &str) -> (WorkerKey, DiscoveredWorker) {
        crate::discovery::test_worker("dynamo", id, role, model)
    }

    /// A registry publishing to a view of its own, with a load store.
    fn with_loads() -> (FleetPublisher, SharedLoadStore, Registry) {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        let store = SharedLoadStore::new(LoadStore::new(None));
        let registry = Registry::new(publisher.clone()).with_loads(store.clone());
        (publisher, store, registry)
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

    /// A rank a generation makes live is let into the store as the generation is published,
    /// before the load supervisor gets to it (it may be busy stopping subscriptions for
    /// seconds): its samples are held, not refused and lost. The supervisor, behind, does not
    /// close the gate again.
    #[test]
    fn a_rank_a_generation_makes_live_is_admitted_as_it_is_published() {
        let (_, store, registry) = with_loads();
        let (k1, mut worker) = discovered(1, Role::Decode, "m");
        let mut fleet = Fleet::default();
        fleet.workers.insert(k1.clone(), worker.clone());
        registry.publish(fleet.clone());
        let first = registry.current();
        let source = PublisherKey { namespace: "dynamo".into(), publisher_id: 1 };
        let rank1 = LoadKey { worker: k1.clone(), dp_rank: 1 };
        let apply = |sequence| store.lock().apply(rank1.clone(), &source, sequence, Load::default(), Instant::now());
        assert!(apply(1).is_err(), "rank 1 is not live yet");

        worker.worker.dp_size = 2;
        fleet.workers.insert(k1, worker);
        registry.publish(fleet);
        assert!(apply(2).is_ok(), "live as its generation is published");
        let behind = crate::load::live_ranks(&first.fleet);
        assert!(store.lock().retain_live_at(first.generation, behind).is_empty(), "kept");
        assert!(apply(3).is_ok(), "a supervisor behind the registry leaves the gate open");
    }

    /// A worker with more ranks than the store holds samples brings them all the same (found
    /// by one pass over the store rather than a lookup per rank).
    #[test]
    fn a_worker_with_more_ranks_than_samples_held_brings_those_held() {
        let (publisher, store, registry) = with_loads();
        let (k1, mut worker) = discovered(1, Role::Decode, "m");
        worker.worker.dp_size = 64;
        worker.excluded = Some(Exclusion::RoleDisagreement { component: Role::Prefill, card: Role::Decode });
        let mut fleet = Fleet::default();
        fleet.workers.insert(k1.clone(), worker.clone());
        registry.publish(fleet.clone());
        let received = Instant::now() - Duration::from_secs(30);
        let source = PublisherKey { namespace: "dynamo".into(), publisher_id: 1 };
        for (sequence, dp_rank) in [(1, 3), (2, 40)] {
            let rank = LoadKey { worker: k1.clone(), dp_rank };
            store.lock().apply(rank, &source, sequence, Load::default(), received).expect("stored");
        }

        worker.excluded = None;
        fleet.workers.insert(k1.clone(), worker);
        registry.publish(fleet);
        let view = publisher.current();
        let held: Vec<(u32, Instant)> =
            view.view().loads().iter().map(|(key, s)| (key.dp_rank, s.received_at)).collect();
        assert_eq!(held, [(3, received), (40, received)]);
    }

    /// Samples the store took while a worker was out of the view (excluded, or without its
    /// card) reach the view as it enters, with the time they were received: a worker silent
    /// since must not read as never published.
    #[test]
    fn a_worker_entering_the_view_brings_the_samples_held_for_it() {
        let (publisher, store, registry) = with_loads();
        let (k1, mut worker) = discovered(1, Role::Decode, "m");
        let (k2, unknown) = discovered(2, Role::Unknown, "m");
        worker.excluded = Some(Exclusion::RoleDisagreement { component: Role::Prefill, card: Role::Decode });
        let mut fleet = Fleet::default();
        fleet.workers.insert(k1.clone(), worker.clone());
        fleet.workers.insert(k2.clone(), unknown);
        registry.publish(fleet.clone());
        assert!(view_ids(&publisher).is_empty());

        let received = Instant::now() - Duration::from_secs(30);
        let mut held = store.lock();
        held.set_live_and_retain([(k1.clone(), 0..1), (k2.clone(), 0..1)].into());
        for key in [&k1, &k2] {
            let load = Load { kv_used_blocks: Some(800), ..Load::default() };
            let rank = LoadKey { worker: key.clone(), dp_rank: 0 };
            let publisher = PublisherKey { namespace: "dynamo".into(), publisher_id: key.instance_id };
            held.apply(rank, &publisher, 1, load, received).expect("stored");
        }
        drop(held);
        let sample = |id: u64| {
            let key = LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank: 0 };
            publisher.current().view().loads().get(&key).map(|s| (s.load.kv_used_blocks, s.received_at))
        };

        worker.excluded = None;
        fleet.workers.insert(k1, worker);
        registry.publish(fleet.clone());
        assert_eq!(view_ids(&publisher), [1]);
        assert_eq!(sample(1), Some((Some(800), received)), "routable again, with its last sample");
        assert_eq!(sample(2), None, "still without a card");

        let (k2, carded) = discovered(2, Role::Decode, "m");
        fleet.workers.insert(k2, carded);
        registry.publish(fleet);
        assert_eq!(sample(2), Some((Some(800), received)), "its card arrived after its sample");
    }

    /// A worker already in the view whose ranks shrink and grow back (the load supervisor,
    /// which drops a rank's sample from the store, may not have seen the shrink) brings back
    /// the sample the store still holds for the rank that returned.
    #[test]
    fn a_rank_returning_to_a_worker_in_the_view_brings_the_sample_held_for_it() {
        let (publisher, store, registry) = with_loads();
        let (key, mut worker) = discovered(1, Role::Decode, "m");
        worker.worker.dp_size = 2;
        let mut fleet = Fleet::default();
        fleet.workers.insert(key.clone(), worker.clone());
        registry.publish(fleet.clone());
        let received = Instant::now() - Duration::from_secs(30);
        let mut held = store.lock();
        held.set_live_and_retain([(key.clone(), 0..2)].into());
        let rank = LoadKey { worker: key.clone(), dp_rank: 1 };
        let load = Load { kv_used_blocks: Some(800), ..Load::default() };
        held.apply(rank.clone(), &PublisherKey { namespace: "dynamo".into(), publisher_id: 1 }, 1, load, received)
            .expect("stored");
        drop(held);
        let sample = || publisher.current().view().loads().get(&rank).map(|s| (s.load.kv_used_blocks, s.received_at));
        // The sample reaches the view through the load feed, not the registry: put it there.
        publisher.apply(FleetChange {
            loads: vec![(rank.clone(), store.lock().get(&rank).expect("held").sample)],
            ..FleetChange::default()
        });
        assert_eq!(sample(), Some((Some(800), received)));

        worker.worker.dp_size = 1;
        fleet.workers.insert(key.clone(), worker.clone());
        registry.publish(fleet.clone());
        assert_eq!(sample(), None, "the rank left the view");
        worker.worker.dp_size = 2;
        fleet.workers.insert(key, worker);
        registry.publish(fleet);
        assert_eq!(sample(), Some((Some(800), received)), "the rank came back with its last sample");
    }
}
