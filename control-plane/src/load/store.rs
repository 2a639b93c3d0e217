//! The load store: the latest ActiveLoad sample per (worker, dp rank), with when it was
//! received and which publisher incarnation and sequence it came from.
//!
//! Pure: every method takes the time it needs (`now`), so the staleness rules are tested
//! without clocks. The shell shares it behind one mutex ([`SharedLoadStore`]); every
//! operation is a few map lookups, except [`LoadStore::retain_live_at`] (once per registry
//! generation), and none is held across an await.
//!
//! * Admission: only ranks of live workers (the registry's current generation) are held, and
//!   at most [`MAX_LOAD_ENTRIES`] of them. A full store makes room for a new rank of a worker
//!   by giving up an entry of the worker holding the most, while that one holds at least two
//!   more: each worker keeps a fair share, whatever ranks other workers' cards claim.
//! * Order: a sample at or below the held sequence of the same publisher is a duplicate; a
//!   sample from another publisher id (the worker's publisher restarted) replaces the held one
//!   whatever its sequence.
//! * Staleness: [`LoadStore::fresh`] returns a sample only while it is at most `max_age` old;
//!   [`LoadStore::reading`] tells a picker how to read a rank without a fresh sample.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::model::{Load, LoadKey, LoadSample, WorkerKey};

use super::events::LoadEvent;
use super::gauges::LoadGauges;
use crate::discovery::PublisherKey;

mod shares;

use shares::Shares;

/// The most (worker, dp rank) samples held.
pub const MAX_LOAD_ENTRIES: usize = 65_536;
/// `dynamo.load.max_staleness` when the configuration does not say.
pub const DEFAULT_MAX_STALENESS: Duration = Duration::from_secs(3);

/// A held sample and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldSample {
    pub sample: LoadSample,
    pub publisher_id: u64,
    pub sequence: u64,
}

/// A sample the store took, and the entry it gave up to make room for it, if any.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    pub sample: LoadSample,
    pub evicted: Option<LoadKey>,
}

/// How a picker reads a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    /// A sample younger than `max_staleness`.
    Fresh(Load),
    /// Never published, or the last sample reported no backlog: counts as idle, because a
    /// worker that goes idle publishes zero and then falls silent.
    Quiet,
    /// The last sample, now stale, reported a backlog: maybe a stalled engine, so no cost.
    SilentUnderLoad,
}

impl Reading {
    /// The reading of `held` at `now` under `max_age`.
    pub fn of(held: Option<&LoadSample>, now: Instant, max_age: Duration) -> Self {
        match held {
            Some(s) if s.age(now) <= max_age => Reading::Fresh(s.load),
            Some(s) if s.load.reports_backlog() => Reading::SilentUnderLoad,
            _ => Reading::Quiet,
        }
    }
}

#[derive(Debug)]
pub struct LoadStore {
    entries: HashMap<LoadKey, HeldSample>,
    /// The keys each publisher's samples are held under, to drop them on a reconnect or gap.
    /// A set: a worker with many ranks leaving, or two channels of one worker taking a rank in
    /// turn, must cost a lookup per key under the store's lock, not a scan.
    by_publisher: HashMap<PublisherKey, HashSet<LoadKey>>,
    /// Entries each worker holds.
    shares: Shares,
    /// Live workers and the ranks they serve: the admission gate.
    live: HashMap<WorkerKey, Range<u32>>,
    /// The registry generation the gate is of, when one said (see [`Self::open_gate`]).
    live_generation: u64,
    max_staleness: Duration,
    capacity: usize,
    gauges: Option<LoadGauges>,
}

impl LoadStore {
    pub fn new(gauges: Option<LoadGauges>) -> Self {
        Self::with_capacity(MAX_LOAD_ENTRIES, gauges)
    }

    /// A store holding at most `capacity` samples (tests use a small one).
    pub fn with_capacity(capacity: usize, gauges: Option<LoadGauges>) -> Self {
        Self {
            entries: HashMap::new(),
            by_publisher: HashMap::new(),
            shares: Shares::default(),
            live: HashMap::new(),
            live_generation: 0,
            max_staleness: DEFAULT_MAX_STALENESS,
            capacity,
            gauges,
        }
    }

    /// Holds `load` for `key`, received at `now` from `publisher` at `sequence`.
    pub fn apply(
        &mut self,
        key: LoadKey,
        publisher: &PublisherKey,
        sequence: u64,
        load: Load,
        now: Instant,
    ) -> Result<Applied, LoadEvent> {
        if !self.live.get(&key.worker).is_some_and(|ranks| ranks.contains(&key.dp_rank)) {
            return Err(LoadEvent::IdentityMismatch);
        }
        match self.entries.get(&key) {
            Some(held) if held.publisher_id == publisher.publisher_id && sequence <= held.sequence => {
                return Err(LoadEvent::Duplicate);
            }
            Some(held) if held.publisher_id != publisher.publisher_id => {
                let previous =
                    PublisherKey { namespace: key.worker.namespace.clone(), publisher_id: held.publisher_id };
                self.unindex(&previous, &key);
            }
            _ => {}
        }
        let evicted = if self.entries.contains_key(&key) || self.entries.len() < self.capacity {
            None
        } else {
            Some(self.make_room_for(&key.worker, now).ok_or(LoadEvent::OverCapacity)?)
        };
        let sample = LoadSample { load, received_at: now };
        let replaced =
            self.entries.insert(key.clone(), HeldSample { sample, publisher_id: publisher.publisher_id, sequence });
        if replaced.is_none() {
            self.shares.add(&key.worker);
        }
        let indexed = self.by_publisher.entry(publisher.clone()).or_default();
        if replaced.is_none_or(|held| held.publisher_id != publisher.publisher_id) {
            indexed.insert(key.clone());
        }
        if let Some(gauges) = &self.gauges {
            gauges.set(&key, &load);
        }
        Ok(Applied { sample, evicted })
    }

    /// Gives up an entry of the worker holding the most, if it holds at least two more than
    /// `worker`: one that reads as idle when it can (stale with no backlog, which reads as no
    /// sample would), else its highest rank. The key given up, if any.
    fn make_room_for(&mut self, worker: &WorkerKey, now: Instant) -> Option<LoadKey> {
        let (largest, holds) = self.shares.largest()?;
        if holds <= self.shares.of(worker).saturating_add(1) {
            return None;
        }
        let ranks = self.live.get(largest)?.clone();
        let held = ranks.rev().map(|dp_rank| LoadKey { worker: largest.clone(), dp_rank });
        let held: Vec<LoadKey> = held.filter(|key| self.entries.contains_key(key)).collect();
        let idle = held.iter().find(|key| self.reading(key, now) == Reading::Quiet);
        let key = idle.or(held.first())?.clone();
        self.remove(&key);
        Some(key)
    }

    /// Drops `key`'s sample, its place in its publisher's index, its share and its gauges.
    fn remove(&mut self, key: &LoadKey) {
        let Some(held) = self.entries.remove(key) else { return };
        let publisher = PublisherKey { namespace: key.worker.namespace.clone(), publisher_id: held.publisher_id };
        self.unindex(&publisher, key);
        self.shares.remove(&key.worker);
        if let Some(gauges) = &self.gauges {
            gauges.remove(key);
        }
    }

    /// Drops every sample held from `publisher` (it reconnected, or skipped a sequence, or
    /// stopped); returns their keys.
    pub fn drop_publisher(&mut self, publisher: &PublisherKey) -> Vec<LoadKey> {
        let keys: Vec<LoadKey> = self.by_publisher.get(publisher).into_iter().flatten().cloned().collect();
        for key in &keys {
            self.remove(key);
        }
        keys
    }

    /// Makes registry generation `generation`'s `live` ranks the admission gate, unless a
    /// newer generation's already is. The registry opens it as it publishes, under the store's
    /// lock: a sample for a rank that generation made live (a worker whose card grew, or whose
    /// record came after its channel) is held from then on, not refused while the load
    /// supervisor, which drops what left ([`Self::retain_live_at`]), has yet to get to it.
    pub fn open_gate(&mut self, generation: u64, live: HashMap<WorkerKey, Range<u32>>) {
        if generation > self.live_generation {
            self.live = live;
            self.live_generation = generation;
        }
    }

    /// Makes `live` the admission gate, unless the registry opened it to a newer generation
    /// already, and drops samples for anything outside the gate (departed workers, ranks a
    /// worker no longer serves), with their gauge series; returns their keys.
    pub fn retain_live_at(&mut self, generation: u64, live: HashMap<WorkerKey, Range<u32>>) -> Vec<LoadKey> {
        self.open_gate(generation, live);
        self.retain_live()
    }

    /// [`Self::retain_live_at`] whatever the generation.
    #[cfg(test)]
    pub fn set_live_and_retain(&mut self, live: HashMap<WorkerKey, Range<u32>>) -> Vec<LoadKey> {
        self.live = live;
        self.retain_live()
    }

    fn retain_live(&mut self) -> Vec<LoadKey> {
        let live = &self.live;
        let gone: Vec<LoadKey> = self
            .entries
            .keys()
            .filter(|k| !live.get(&k.worker).is_some_and(|ranks| ranks.contains(&k.dp_rank)))
            .cloned()
            .collect();
        for key in &gone {
            self.remove(key);
        }
        gone
    }

    fn unindex(&mut self, publisher: &PublisherKey, key: &LoadKey) {
        if let Some(keys) = self.by_publisher.get_mut(publisher) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_publisher.remove(publisher);
            }
        }
    }

    /// The sample for `key` if it is at most `max_age` old at `now`.
    pub fn fresh(&self, key: &LoadKey, max_age: Duration, now: Instant) -> Option<&LoadSample> {
        self.entries.get(key).map(|held| &held.sample).filter(|s| s.age(now) <= max_age)
    }

    /// [`Self::fresh`] under `dynamo.load.max_staleness`.
    pub fn fresh_default(&self, key: &LoadKey, now: Instant) -> Option<&LoadSample> {
        self.fresh(key, self.max_staleness, now)
    }

    /// How a picker should read `key` at `now`.
    pub fn reading(&self, key: &LoadKey, now: Instant) -> Reading {
        Reading::of(self.entries.get(key).map(|held| &held.sample), now, self.max_staleness)
    }

    pub fn max_staleness(&self) -> Duration {
        self.max_staleness
    }

    /// Takes effect on the next freshness check.
    pub fn set_max_staleness(&mut self, max_staleness: Duration) {
        self.max_staleness = max_staleness;
    }

    pub fn get(&self, key: &LoadKey) -> Option<&HeldSample> {
        self.entries.get(key)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every held sample, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&LoadKey, &HeldSample)> {
        self.entries.iter()
    }
}

/// The store shared by the subscriptions, the supervisor and the admin API.
#[derive(Debug, Clone)]
pub struct SharedLoadStore(Arc<Mutex<LoadStore>>);

impl SharedLoadStore {
    pub fn new(store: LoadStore) -> Self {
        Self(Arc::new(Mutex::new(store)))
    }

    /// The store; a panic elsewhere while holding it leaves plain data, so poisoning is ignored.
    pub fn lock(&self) -> MutexGuard<'_, LoadStore> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
