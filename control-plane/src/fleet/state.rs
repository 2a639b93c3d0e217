//! The published fleet state: the authoritative view plus a bounded log of the deltas that led
//! to it. Pure: committing a change returns a new state and never touches the old one, so
//! every Watch session reads a consistent pair without locks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use continuum_proto::fast_hash::FastMap;
use continuum_proto::model::{Backlog, DataPlaneConfig, LoadKey, LoadSample, ReportsFolded, Worker, WorkerKey};
use continuum_proto::view::{FleetDelta, FleetView};
use imbl::Vector;

/// Deltas kept for replicas that are catching up. A replica further behind than this gets a
/// full snapshot instead, so a slow replica never costs the control plane unbounded memory.
pub const DELTA_LOG_CAPACITY: usize = 256;

/// One version of the fleet as the control plane publishes it.
#[derive(Clone, Debug, Default)]
pub struct FleetState {
    view: FleetView,
    /// Consecutive deltas ending at `view.version()`, oldest first.
    log: Vector<Arc<FleetDelta>>,
    /// Per Watch session, which of its replica's reported operations the view's backlogs hold.
    reports_folded: Arc<FastMap<u64, ReportsFolded>>,
}

/// A change the control plane wants published. It may contain no-ops (an upsert of an
/// identical worker, a removal of an absent one); committing filters them out, so idempotent
/// resyncs do not bump the version.
#[derive(Clone, Debug, Default)]
pub struct FleetChange {
    pub upsert: Vec<Arc<Worker>>,
    pub remove: Vec<WorkerKey>,
    pub loads: Vec<(LoadKey, LoadSample)>,
    pub loads_removed: Vec<LoadKey>,
    pub config: Option<Arc<DataPlaneConfig>>,
    pub backlogs: Vec<(LoadKey, Backlog)>,
    pub backlogs_removed: Vec<LoadKey>,
    /// Which reported operations the backlogs now hold, per session (replaces the map whole;
    /// it goes out with the change it came with, or alone as a version that changes nothing
    /// else when reports were folded that moved no sum).
    pub reports_folded: Option<Arc<FastMap<u64, ReportsFolded>>>,
}

/// What a replica should be sent to bring it from the version it holds to the current one.
#[derive(Clone, Debug)]
pub enum Catchup {
    UpToDate,
    Delta(FleetDelta),
    Snapshot(FleetView),
}

impl FleetState {
    pub fn new(version: u64, config: Arc<DataPlaneConfig>) -> Self {
        let view = FleetView::new(version, [], [], config).unwrap_or_default();
        Self { view, log: Vector::new(), reports_folded: Arc::default() }
    }

    pub fn view(&self) -> &FleetView {
        &self.view
    }

    pub fn version(&self) -> u64 {
        self.view.version()
    }

    /// Which of session `session`'s reported operations this version's backlogs hold.
    pub fn reports_folded(&self, session: u64) -> Option<ReportsFolded> {
        self.reports_folded.get(&session).copied()
    }

    /// The state after `change`, and the delta that was published, or `None` when the change
    /// is a no-op against this state (the version does not move).
    pub fn commit(&self, mut change: FleetChange) -> Option<(FleetState, Arc<FleetDelta>)> {
        let folded_moved = change.reports_folded.as_ref().is_some_and(|folded| *folded != self.reports_folded);
        let reports_folded = change.reports_folded.take().unwrap_or_else(|| Arc::clone(&self.reports_folded));
        let delta = Arc::new(self.effective_delta(change));
        if delta.is_empty() && !folded_moved {
            return None;
        }
        // The effective delta only names known workers and ranks, so it always applies.
        let view = self.view.apply(&delta).ok()?;
        let mut log = self.log.clone();
        log.push_back(Arc::clone(&delta));
        while log.len() > DELTA_LOG_CAPACITY {
            log.pop_front();
        }
        Some((FleetState { view, log, reports_folded }, delta))
    }

    /// Whether a replica that holds `held` can only be caught up with a full snapshot: it
    /// holds nothing yet, or a version the delta log no longer reaches. (A cheap test: it
    /// merges nothing.)
    pub fn needs_snapshot(&self, held: Option<u64>) -> bool {
        match (held, self.log.front()) {
            (None, _) => true,
            (Some(held), _) if held == self.version() => false,
            (Some(_), None) => true,
            (Some(held), Some(first)) => held < first.base_version || held > self.version(),
        }
    }

    /// What to send a replica that holds `held` (None: nothing yet).
    pub fn catchup(&self, held: Option<u64>) -> Catchup {
        let Some(held) = held else { return Catchup::Snapshot(self.view.clone()) };
        if held == self.version() {
            return Catchup::UpToDate;
        }
        let Some(first) = self.log.front() else { return Catchup::Snapshot(self.view.clone()) };
        if held < first.base_version || held > self.version() {
            return Catchup::Snapshot(self.view.clone());
        }
        // Versions in the log are consecutive, so the delta based on `held` sits at this index.
        let start = usize::try_from(held - first.base_version).unwrap_or(usize::MAX);
        // `Vector::skip` splits the tree in O(log n); an iterator's `skip` would step through
        // every delta before `start`, the whole log for a replica one version behind.
        let pending = self.log.skip(start);
        match FleetDelta::merge(pending.iter().map(Arc::as_ref)) {
            Some(delta) => Catchup::Delta(delta),
            None => Catchup::Snapshot(self.view.clone()),
        }
    }

    /// The change reduced to what actually differs from this state, as a delta on top of it.
    fn effective_delta(&self, change: FleetChange) -> FleetDelta {
        let FleetChange { upsert, remove, loads, mut loads_removed, config, backlogs, mut backlogs_removed, .. } =
            change;
        let view = &self.view;
        let version = view.version();
        // Sorted, and the lookups below are by key: a change naming thousands of workers and
        // samples costs a lookup each, not a scan of one list per entry of another.
        let removed: Vec<WorkerKey> = dedup(remove.into_iter().filter(|k| view.worker(k).is_some()));
        let is_removed = |key: &WorkerKey| removed.binary_search(key).is_ok();
        // The last upsert of a key wins, and only then is it compared with the worker held.
        let last_upserts: BTreeMap<WorkerKey, Arc<Worker>> = upsert.into_iter().map(|w| (w.key.clone(), w)).collect();
        let upserted: Vec<Arc<Worker>> = last_upserts
            .into_values()
            .filter(|w| view.worker(&w.key).is_none_or(|held| held != w) || is_removed(&w.key))
            .collect();
        let upserted_by_key: BTreeMap<&WorkerKey, &Arc<Worker>> = upserted.iter().map(|w| (&w.key, w)).collect();
        let serves = |key: &LoadKey| {
            let worker = match upserted_by_key.get(&key.worker) {
                Some(worker) => Some(*worker),
                None if is_removed(&key.worker) => None,
                None => view.worker(&key.worker),
            };
            worker.is_some_and(|w| w.serves_rank(key.dp_rank))
        };
        // Ranks an upserted worker gives up lose their samples and backlogs explicitly, so that
        // a merged delta (for a replica catching up) drops them as the sequence did.
        let given_up = given_up_ranks(view, &upserted);
        loads_removed.extend(given_up.iter().cloned());
        backlogs_removed.extend(given_up);
        let loads: Vec<(LoadKey, LoadSample)> = loads.into_iter().filter(|(k, _)| serves(k)).collect();
        let sampled: BTreeSet<&LoadKey> = loads.iter().map(|(k, _)| k).collect();
        let loads_removed =
            dedup(loads_removed.into_iter().filter(|k| view.loads().contains_key(k) && !sampled.contains(k)));
        // A worker removed and upserted again loses what it held, so its backlogs go whatever
        // the view held for them.
        let backlogs: Vec<(LoadKey, Backlog)> = backlogs
            .into_iter()
            .filter(|(k, b)| serves(k) && (is_removed(&k.worker) || view.backlogs().get(k) != Some(b)))
            .collect();
        let summed: BTreeSet<&LoadKey> = backlogs.iter().map(|(k, _)| k).collect();
        let backlogs_removed =
            dedup(backlogs_removed.into_iter().filter(|k| view.backlogs().contains_key(k) && !summed.contains(k)));
        FleetDelta {
            base_version: version,
            version: version + 1,
            upserted,
            removed,
            loads,
            loads_removed,
            config: config.filter(|c| c != view.config()),
            backlogs,
            backlogs_removed,
        }
    }
}

/// The ranks that workers held in `view` no longer serve once `upserted`.
fn given_up_ranks(view: &FleetView, upserted: &[Arc<Worker>]) -> Vec<LoadKey> {
    let mut given_up = Vec::new();
    for worker in upserted {
        let Some(held) = view.worker(&worker.key) else { continue };
        for dp_rank in held.dp_ranks().filter(|r| !worker.serves_rank(*r)) {
            given_up.push(LoadKey { worker: worker.key.clone(), dp_rank });
        }
    }
    given_up
}

fn dedup<T: Ord>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut items: Vec<T> = items.collect();
    items.sort();
    items.dedup();
    items
}

impl FleetChange {
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty()
            && self.remove.is_empty()
            && self.loads.is_empty()
            && self.loads_removed.is_empty()
            && self.config.is_none()
            && self.backlogs.is_empty()
            && self.backlogs_removed.is_empty()
            && self.reports_folded.is_none()
    }
}

#[cfg(test)]
mod tests;
