//! The store's rules as a table of moves, with explicit instants instead of a clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use continuum_proto::model::{Load, LoadKey, WorkerKey};

use super::*;
use crate::discovery::PublisherKey;
use crate::load::LoadGauges;

fn key(worker: u64, rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new("dynamo", worker), dp_rank: rank }
}

fn publisher(id: u64) -> PublisherKey {
    PublisherKey { namespace: "dynamo".into(), publisher_id: id }
}

fn used(blocks: u64) -> Load {
    Load { kv_used_blocks: Some(blocks), ..Load::default() }
}

/// Workers 1 (ranks 0..2) and 2 (rank 0) are live.
fn store() -> LoadStore {
    let mut store = LoadStore::new(None);
    store
        .set_live_and_retain(HashMap::from([(WorkerKey::new("dynamo", 1), 0..2), (WorkerKey::new("dynamo", 2), 0..1)]));
    store
}

#[test]
fn a_sample_at_or_below_the_held_sequence_of_its_publisher_is_a_duplicate() {
    let (mut store, now) = (store(), Instant::now());
    assert!(store.apply(key(1, 0), &publisher(10), 5, used(3), now).is_ok());
    assert_eq!(store.apply(key(1, 0), &publisher(10), 5, used(4), now), Err(LoadEvent::Duplicate));
    assert_eq!(store.apply(key(1, 0), &publisher(10), 4, used(4), now), Err(LoadEvent::Duplicate));
    assert!(store.apply(key(1, 1), &publisher(10), 4, used(4), now).is_ok(), "sequences are per (worker, rank)");
    assert!(store.apply(key(1, 0), &publisher(10), 6, used(5), now).is_ok());
    assert_eq!(store.get(&key(1, 0)).map(|h| (h.sequence, h.sample.load)), Some((6, used(5))));
}

#[test]
fn a_restarted_publisher_replaces_the_held_sample_whatever_its_sequence() {
    let (mut store, now) = (store(), Instant::now());
    store.apply(key(1, 0), &publisher(10), 900, used(3), now).unwrap();
    store.apply(key(1, 0), &publisher(11), 0, used(1), now).unwrap();
    assert_eq!(store.get(&key(1, 0)).map(|h| (h.publisher_id, h.sequence)), Some((11, 0)));
    assert!(store.drop_publisher(&publisher(10)).is_empty(), "the old incarnation holds nothing any more");
    assert_eq!(store.drop_publisher(&publisher(11)), vec![key(1, 0)]);
}

#[test]
fn only_live_workers_and_ranks_are_admitted() {
    let (mut store, now) = (store(), Instant::now());
    assert_eq!(store.apply(key(3, 0), &publisher(10), 0, used(1), now), Err(LoadEvent::IdentityMismatch));
    assert_eq!(
        store.apply(key(2, 1), &publisher(10), 0, used(1), now),
        Err(LoadEvent::IdentityMismatch),
        "rank 1 of a dp=1 worker"
    );
    assert!(store.is_empty());
}

#[test]
fn the_store_refuses_new_keys_at_capacity_but_updates_held_ones() {
    let mut store = LoadStore::with_capacity(2, None);
    store.set_live_and_retain(HashMap::from([(WorkerKey::new("dynamo", 1), 0..3)]));
    let now = Instant::now();
    store.apply(key(1, 0), &publisher(10), 0, used(1), now).unwrap();
    store.apply(key(1, 1), &publisher(10), 1, used(1), now).unwrap();
    assert_eq!(store.apply(key(1, 2), &publisher(10), 2, used(1), now), Err(LoadEvent::OverCapacity));
    assert!(store.apply(key(1, 0), &publisher(10), 3, used(2), now).is_ok());
    assert_eq!(MAX_LOAD_ENTRIES, 65_536);
}

/// Workers whose cards claim many ranks cannot shut a later worker out of a full store: it
/// makes room by giving up an entry of the worker holding the most, an idle-reading one first,
/// until each holds its share; a worker already holding as much as the others is refused.
#[test]
fn a_full_store_makes_room_for_a_worker_holding_less_than_its_share() {
    let mut store = LoadStore::with_capacity(4, None);
    let live = |id| (WorkerKey::new("dynamo", id), 0..8);
    store.set_live_and_retain(HashMap::from([live(1), live(2), live(3)]));
    let (t0, later) = (Instant::now(), Instant::now() + DEFAULT_MAX_STALENESS * 2);
    let idle = Load::default();
    for rank in 0..4 {
        let load = if rank == 1 { idle } else { used(1) };
        store.apply(key(1, rank), &publisher(10), u64::from(rank), load, t0).unwrap();
    }
    let made_room = store.apply(key(2, 0), &publisher(20), 0, used(1), later).expect("room made");
    assert_eq!(made_room.evicted, Some(key(1, 1)), "worker 1's stale idle rank reads as no sample would");
    let made_room = store.apply(key(2, 1), &publisher(20), 1, used(1), later).expect("room made");
    assert_eq!(made_room.evicted, Some(key(1, 3)), "then its highest rank");
    assert_eq!(store.len(), 4);
    assert_eq!(store.apply(key(2, 2), &publisher(20), 2, used(1), later), Err(LoadEvent::OverCapacity), "2 and 2");
    assert!(store.apply(key(3, 0), &publisher(30), 0, used(1), later).is_ok_and(|a| a.evicted.is_some()));
    assert_eq!(store.apply(key(3, 1), &publisher(30), 1, used(1), later), Err(LoadEvent::OverCapacity), "2, 1, 1");
    let held_by_1 = (0..8).filter(|rank| store.get(&key(1, *rank)).is_some()).count();
    assert_eq!(store.drop_publisher(&publisher(10)).len(), held_by_1, "the publisher index follows what went");
    assert!(store.apply(key(3, 1), &publisher(30), 1, used(1), later).is_ok_and(|a| a.evicted.is_none()));
}

#[test]
fn the_production_store_holds_65536_entries_and_refuses_the_next() {
    let mut store = LoadStore::new(None);
    let ranks = u32::try_from(MAX_LOAD_ENTRIES).unwrap() + 1;
    store.set_live_and_retain(HashMap::from([(WorkerKey::new("dynamo", 1), 0..ranks)]));
    let now = Instant::now();
    for rank in 0..ranks - 1 {
        store.apply(key(1, rank), &publisher(10), u64::from(rank), used(1), now).unwrap();
    }
    assert_eq!(store.len(), MAX_LOAD_ENTRIES);
    assert_eq!(
        store.apply(key(1, ranks - 1), &publisher(10), u64::from(ranks), used(1), now),
        Err(LoadEvent::OverCapacity)
    );
}

#[test]
fn freshness_follows_max_age_and_the_reloadable_max_staleness() {
    let (mut store, t0) = (store(), Instant::now());
    store.apply(key(1, 0), &publisher(10), 0, used(3), t0).unwrap();
    let at = |ms| t0 + Duration::from_millis(ms);
    assert!(store.fresh(&key(1, 0), Duration::from_secs(1), at(1000)).is_some(), "age equal to max_age is fresh");
    assert!(store.fresh(&key(1, 0), Duration::from_secs(1), at(1001)).is_none());
    assert!(store.fresh_default(&key(1, 0), at(3000)).is_some(), "default max_staleness is 3 s");
    assert!(store.fresh_default(&key(1, 0), at(3001)).is_none());
    store.set_max_staleness(Duration::from_millis(100));
    assert!(store.fresh_default(&key(1, 0), at(101)).is_none(), "a reload applies on the next check");
    store.set_max_staleness(Duration::from_secs(300));
    assert!(store.fresh_default(&key(1, 0), at(200_000)).is_some());
}

#[test]
fn quiet_and_silent_under_load_readings() {
    let (mut store, t0) = (store(), Instant::now());
    let stale = t0 + Duration::from_secs(4);
    assert_eq!(store.reading(&key(1, 0), t0), Reading::Quiet, "never published");
    store.apply(key(1, 0), &publisher(10), 0, used(0), t0).unwrap();
    store.apply(key(1, 1), &publisher(10), 1, used(7), t0).unwrap();
    store.apply(key(2, 0), &publisher(20), 0, Load::default(), t0).unwrap();
    assert_eq!(store.reading(&key(1, 1), t0), Reading::Fresh(used(7)));
    assert_eq!(store.reading(&key(1, 0), stale), Reading::Quiet, "last sample had no backlog");
    assert_eq!(store.reading(&key(1, 1), stale), Reading::SilentUnderLoad, "last sample had a backlog");
    assert_eq!(store.reading(&key(2, 0), stale), Reading::Quiet, "all-nil sample");
    store.drop_publisher(&publisher(10));
    assert_eq!(store.reading(&key(1, 1), stale), Reading::Quiet, "a dropped sample reads as never published");
}

#[test]
fn set_live_and_retain_evicts_departed_workers_and_ranks_with_their_gauges() {
    let gauges = LoadGauges::new().unwrap();
    let registry = prometheus::Registry::new();
    registry.register(Box::new(gauges.kv_used_blocks.clone())).unwrap();
    registry.register(Box::new(gauges.active_decode_blocks.clone())).unwrap();
    let mut store = LoadStore::new(Some(gauges.clone()));
    store.set_live_and_retain(HashMap::from([
        (WorkerKey::new("dynamo", 0xab), 0..2),
        (WorkerKey::new("dynamo", 2), 0..1),
    ]));
    let now = Instant::now();
    store.apply(key(0xab, 0), &publisher(10), 0, used(3), now).unwrap();
    store.apply(key(0xab, 1), &publisher(10), 1, used(4), now).unwrap();
    store.apply(key(2, 0), &publisher(20), 0, used(5), now).unwrap();
    assert_eq!(gauges.kv_used_blocks.with_label_values(&["dynamo", "ab", "1"]).get(), 4, "worker label is hex");
    assert_eq!(series(&registry, "continuum_dynamo_worker_active_decode_blocks"), 0, "nil fields export no series");
    assert_eq!(series(&registry, "continuum_dynamo_worker_kv_used_blocks"), 3);

    let evicted = store.set_live_and_retain(HashMap::from([(WorkerKey::new("dynamo", 0xab), 0..1)]));
    let mut evicted: Vec<_> = evicted.into_iter().map(|k| (k.worker.instance_id, k.dp_rank)).collect();
    evicted.sort();
    assert_eq!(evicted, vec![(2, 0), (0xab, 1)]);
    assert_eq!(series(&registry, "continuum_dynamo_worker_kv_used_blocks"), 1, "departed series are removed");
    assert_eq!(store.drop_publisher(&publisher(10)), vec![key(0xab, 0)], "the publisher index forgot evicted keys");
    assert_eq!(series(&registry, "continuum_dynamo_worker_kv_used_blocks"), 0);
}

fn series(registry: &prometheus::Registry, name: &str) -> usize {
    registry.gather().iter().filter(|f| f.name() == name).map(|f| f.get_metric().len()).sum()
}
