//! The fleet view and its deltas: the pure core of the Fleet stream.
//!
//! The control plane holds the authoritative [`FleetView`] and appends one [`FleetDelta`] per
//! change; every data-plane replica holds a copy and applies the same deltas. Both sides use
//! [`FleetView::apply`], so "converged" means equal views. The maps are persistent (structural
//! sharing), so a new version costs `O(log n)` and readers keep old versions for free.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use imbl::OrdMap;

use crate::model::{Backlog, DataPlaneConfig, LoadKey, LoadSample, ReportsFolded, Worker, WorkerKey};

/// Values derived from a fleet's workers (a model's candidates, its parsed cards), kept while
/// views share one workers map: load-only updates keep the map's persistent root, so one
/// pointer comparison tells whether the values still hold. Holding the map keeps a new one from
/// reusing its address.
#[derive(Debug, Default)]
pub struct WorkersMemo<V> {
    workers: OrdMap<WorkerKey, Arc<Worker>>,
    values: V,
}

impl<V: Default> WorkersMemo<V> {
    /// The values derived from `view`'s workers: those held, or new ones if its workers changed.
    pub fn for_view(&mut self, view: &FleetView) -> &mut V {
        if !self.workers.ptr_eq(&view.workers) {
            self.workers = view.workers.clone();
            self.values = V::default();
        }
        &mut self.values
    }
}

/// An immutable, versioned view of the fleet.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    version: u64,
    workers: OrdMap<WorkerKey, Arc<Worker>>,
    loads: OrdMap<LoadKey, LoadSample>,
    backlogs: OrdMap<LoadKey, Backlog>,
    /// On a replica: which of its own reported operations `backlogs` hold (the control plane
    /// says with each update; `None` until it has summed one, and on the control plane).
    reports_folded: Option<ReportsFolded>,
    config: Arc<DataPlaneConfig>,
}

/// One change from `base_version` to `version`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetDelta {
    pub base_version: u64,
    pub version: u64,
    pub upserted: Vec<Arc<Worker>>,
    pub removed: Vec<WorkerKey>,
    pub loads: Vec<(LoadKey, LoadSample)>,
    pub loads_removed: Vec<LoadKey>,
    pub config: Option<Arc<DataPlaneConfig>>,
    pub backlogs: Vec<(LoadKey, Backlog)>,
    pub backlogs_removed: Vec<LoadKey>,
}

/// Why a delta cannot be applied to a view. The replica refuses (NACKs) it and keeps its state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApplyError {
    #[error("delta is based on version {base} but this view is at version {held}")]
    BaseMismatch { base: u64, held: u64 },
    #[error("delta version {version} does not advance past its base {base}")]
    NotAdvancing { base: u64, version: u64 },
    #[error("load sample for {key} rank {dp_rank}: no such worker in the view")]
    LoadForUnknownWorker { key: WorkerKey, dp_rank: u32 },
    #[error("load sample for {key} rank {dp_rank}: the worker serves ranks {first}..{end}")]
    RankOutOfRange { key: WorkerKey, dp_rank: u32, first: u32, end: u32 },
}

impl FleetView {
    /// A view built whole, as from a full snapshot.
    pub fn new(
        version: u64,
        workers: impl IntoIterator<Item = Arc<Worker>>,
        loads: impl IntoIterator<Item = (LoadKey, LoadSample)>,
        config: Arc<DataPlaneConfig>,
    ) -> Result<Self, ApplyError> {
        let view = Self {
            version,
            workers: workers.into_iter().map(|w| (w.key.clone(), w)).collect(),
            loads: OrdMap::new(),
            backlogs: OrdMap::new(),
            reports_folded: None,
            config,
        };
        view.with_loads(loads)
    }

    /// The same view with these backlogs (from a full snapshot).
    pub fn with_backlogs(mut self, backlogs: impl IntoIterator<Item = (LoadKey, Backlog)>) -> Result<Self, ApplyError> {
        for (key, backlog) in backlogs {
            self.check_load_key(&key)?;
            self.backlogs.insert(key, backlog);
        }
        Ok(self)
    }

    /// The same view without the fleet-wide backlogs: what a replica keeps once its stream is
    /// lost. The control plane stops adding other replicas' dispatches and taking out their
    /// ends then, so the sums would freeze with requests that finished long ago in them.
    pub fn without_backlogs(&self) -> Self {
        Self { backlogs: OrdMap::new(), reports_folded: None, ..self.clone() }
    }

    /// The same view, whose backlogs hold these of the replica's reported operations.
    pub fn with_reports_folded(self, reports_folded: Option<ReportsFolded>) -> Self {
        Self { reports_folded, ..self }
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn workers(&self) -> &OrdMap<WorkerKey, Arc<Worker>> {
        &self.workers
    }

    pub fn worker(&self, key: &WorkerKey) -> Option<&Arc<Worker>> {
        self.workers.get(key)
    }

    pub fn loads(&self) -> &OrdMap<LoadKey, LoadSample> {
        &self.loads
    }

    pub fn config(&self) -> &Arc<DataPlaneConfig> {
        &self.config
    }

    /// Dispatches in flight per rank, fleet-wide.
    pub fn backlogs(&self) -> &OrdMap<LoadKey, Backlog> {
        &self.backlogs
    }

    /// Which of this replica's reported operations [`Self::backlogs`] hold.
    pub fn reports_folded(&self) -> Option<ReportsFolded> {
        self.reports_folded
    }

    /// The view after `delta`, or why it does not fit this view. `self` is never changed.
    pub fn apply(&self, delta: &FleetDelta) -> Result<FleetView, ApplyError> {
        if delta.base_version != self.version {
            return Err(ApplyError::BaseMismatch { base: delta.base_version, held: self.version });
        }
        if delta.version <= delta.base_version {
            return Err(ApplyError::NotAdvancing { base: delta.base_version, version: delta.version });
        }
        let mut next = self.clone();
        next.version = delta.version;
        for key in &delta.removed {
            next.remove_worker(key);
        }
        for worker in &delta.upserted {
            next.upsert_worker(worker);
        }
        for key in &delta.loads_removed {
            next.loads.remove(key);
        }
        if let Some(config) = &delta.config {
            next.config = Arc::clone(config);
        }
        for key in &delta.backlogs_removed {
            next.backlogs.remove(key);
        }
        next.with_loads(delta.loads.iter().cloned())?.with_backlogs(delta.backlogs.iter().cloned())
    }

    /// Same workers, loads and configuration, ignoring versions and receipt times: what
    /// "a replica converged to the control plane" means.
    pub fn same_content(&self, other: &FleetView) -> bool {
        self.workers == other.workers
            && self.config == other.config
            && self.backlogs == other.backlogs
            && self.loads.len() == other.loads.len()
            && self.loads.iter().zip(other.loads.iter()).all(|((ka, a), (kb, b))| ka == kb && a.load == b.load)
    }

    fn remove_worker(&mut self, key: &WorkerKey) {
        if let Some(worker) = self.workers.remove(key) {
            for dp_rank in worker.dp_ranks() {
                let rank = LoadKey { worker: key.clone(), dp_rank };
                self.loads.remove(&rank);
                self.backlogs.remove(&rank);
            }
        }
    }

    fn upsert_worker(&mut self, worker: &Arc<Worker>) {
        // A worker whose ranks shrank keeps no samples for the ranks it gave up.
        if let Some(old) = self.workers.get(&worker.key).cloned() {
            for dp_rank in old.dp_ranks().filter(|r| !worker.serves_rank(*r)) {
                let rank = LoadKey { worker: worker.key.clone(), dp_rank };
                self.loads.remove(&rank);
                self.backlogs.remove(&rank);
            }
        }
        self.workers.insert(worker.key.clone(), Arc::clone(worker));
    }

    fn with_loads(mut self, loads: impl IntoIterator<Item = (LoadKey, LoadSample)>) -> Result<Self, ApplyError> {
        for (key, sample) in loads {
            self.check_load_key(&key)?;
            self.loads.insert(key, sample);
        }
        Ok(self)
    }

    fn check_load_key(&self, key: &LoadKey) -> Result<(), ApplyError> {
        let Some(worker) = self.workers.get(&key.worker) else {
            return Err(ApplyError::LoadForUnknownWorker { key: key.worker.clone(), dp_rank: key.dp_rank });
        };
        if worker.serves_rank(key.dp_rank) {
            return Ok(());
        }
        // The ranks it serves as pickers read them: a start rank without a size is rank 0.
        let ranks = worker.dp_ranks();
        Err(ApplyError::RankOutOfRange {
            key: key.worker.clone(),
            dp_rank: key.dp_rank,
            first: ranks.start,
            end: ranks.end,
        })
    }
}

impl FleetDelta {
    /// Whether applying this delta would change nothing but the version.
    pub fn is_empty(&self) -> bool {
        self.upserted.is_empty()
            && self.removed.is_empty()
            && self.loads.is_empty()
            && self.loads_removed.is_empty()
            && self.config.is_none()
            && self.backlogs.is_empty()
            && self.backlogs_removed.is_empty()
    }

    /// One delta equivalent to applying `deltas` in order. They must be consecutive, and each
    /// that shrinks a worker's ranks must name the samples and backlogs of the ranks it gave
    /// up in its removals, as the control plane's effective deltas do: the merge keeps a
    /// worker's last upsert, which alone does not say what an earlier, narrower one dropped.
    pub fn merge<'a>(deltas: impl IntoIterator<Item = &'a FleetDelta>) -> Option<FleetDelta> {
        let mut deltas = deltas.into_iter();
        let first = deltas.next()?;
        let mut merged = Merge::default();
        merged.add(first);
        let mut version = first.version;
        for delta in deltas {
            debug_assert_eq!(delta.base_version, version, "merged deltas must be consecutive");
            merged.add(delta);
            version = delta.version;
        }
        Some(merged.finish(first.base_version, version))
    }
}

/// Drops the entries of `worker`'s ranks that `doomed` picks. Keys order by worker first, so
/// they are one range: a delta naming thousands of workers costs a lookup each, not a pass
/// over every sample per worker.
fn drop_ranks<V>(map: &mut BTreeMap<LoadKey, V>, worker: &WorkerKey, doomed: impl Fn((&LoadKey, &V)) -> bool) {
    let ranks = LoadKey { worker: worker.clone(), dp_rank: 0 }..=LoadKey { worker: worker.clone(), dp_rank: u32::MAX };
    let gone: Vec<LoadKey> = map.range(ranks).filter(|entry| doomed(*entry)).map(|(k, _)| k.clone()).collect();
    for key in gone {
        map.remove(&key);
    }
}

/// Folds consecutive deltas: the last word on each key wins. A worker removed anywhere in the
/// run stays listed as removed (a re-upsert follows it), since its removal also dropped samples
/// the base view holds.
#[derive(Default)]
struct Merge {
    removed: BTreeSet<WorkerKey>,
    upserted: BTreeMap<WorkerKey, Arc<Worker>>,
    loads: BTreeMap<LoadKey, Option<LoadSample>>,
    backlogs: BTreeMap<LoadKey, Option<Backlog>>,
    config: Option<Arc<DataPlaneConfig>>,
}

impl Merge {
    /// Folds one delta in the order [`FleetView::apply`] uses.
    fn add(&mut self, delta: &FleetDelta) {
        for key in &delta.removed {
            self.upserted.remove(key);
            self.removed.insert(key.clone());
            drop_ranks(&mut self.loads, key, |_| true);
            drop_ranks(&mut self.backlogs, key, |_| true);
        }
        for worker in &delta.upserted {
            // Samples carried for ranks the worker gave up would not fit it any more. Their
            // removals stay: the base view may still hold what they remove.
            let gave_up = |k: &LoadKey| !worker.serves_rank(k.dp_rank);
            drop_ranks(&mut self.loads, &worker.key, |(k, sample)| sample.is_some() && gave_up(k));
            drop_ranks(&mut self.backlogs, &worker.key, |(k, backlog)| backlog.is_some() && gave_up(k));
            self.upserted.insert(worker.key.clone(), Arc::clone(worker));
        }
        for key in &delta.loads_removed {
            self.loads.insert(key.clone(), None);
        }
        for (key, sample) in &delta.loads {
            self.loads.insert(key.clone(), Some(*sample));
        }
        if let Some(config) = &delta.config {
            self.config = Some(Arc::clone(config));
        }
        for key in &delta.backlogs_removed {
            self.backlogs.insert(key.clone(), None);
        }
        for (key, backlog) in &delta.backlogs {
            self.backlogs.insert(key.clone(), Some(*backlog));
        }
    }

    fn finish(self, base_version: u64, version: u64) -> FleetDelta {
        let mut delta = FleetDelta {
            base_version,
            version,
            upserted: self.upserted.into_values().collect(),
            removed: self.removed.into_iter().collect(),
            config: self.config,
            ..FleetDelta::default()
        };
        for (key, sample) in self.loads {
            match sample {
                Some(sample) => delta.loads.push((key, sample)),
                None => delta.loads_removed.push(key),
            }
        }
        for (key, backlog) in self.backlogs {
            match backlog {
                Some(backlog) => delta.backlogs.push((key, backlog)),
                None => delta.backlogs_removed.push(key),
            }
        }
        delta
    }
}

#[cfg(test)]
mod tests;
