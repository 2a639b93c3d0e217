//! The fleet the control plane publishes to its data-plane replicas.
//!
//! Discovery, load subscriptions and configuration reloads each submit [`FleetChange`]s to the
//! one [`FleetPublisher`]; it commits them into a new immutable [`FleetState`] and publishes it
//! on a `watch` channel that every Watch session follows. Load samples go through the
//! [`LoadCoalescer`] first, so a busy fleet produces one delta per window, not one per sample.

mod active;
mod backlog;
mod coalesce;
mod state;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use continuum_proto::model::DataPlaneConfig;
use tokio::sync::watch;

pub use active::ActiveIndex;
pub use backlog::{
    BACKLOG_WINDOW, BacklogBook, BookCounters, DISPATCH_MAX_AGE, IN_FLIGHT_MAX_AGE, MAX_DISPATCHES,
    MAX_DISPATCHES_PER_REPLICA, MAX_QUEUED_REPORT_BYTES, NotQueued, Refusal, SAMPLE_LAG, SessionReports,
};
pub(crate) use backlog::{fit, plausible};
pub use coalesce::{LOAD_COALESCE_WINDOW, LoadCoalescer};
pub use state::{Catchup, DELTA_LOG_CAPACITY, FleetChange, FleetState};

/// The single writer of the published fleet state.
#[derive(Debug, Clone)]
pub struct FleetPublisher {
    tx: watch::Sender<Arc<FleetState>>,
    /// Held while a change is committed: one writer at a time, outside the watch's lock.
    writer: Arc<Mutex<()>>,
}

impl FleetPublisher {
    /// A publisher whose first version is the wall clock in microseconds, so that versions keep
    /// increasing across a control-plane restart (replicas log a version that goes backwards).
    pub fn new(config: Arc<DataPlaneConfig>) -> Self {
        let start = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros()).unwrap_or(0);
        Self::starting_at(u64::try_from(start).unwrap_or(0), config)
    }

    pub fn starting_at(version: u64, config: Arc<DataPlaneConfig>) -> Self {
        let (tx, _) = watch::channel(Arc::new(FleetState::new(version, config)));
        Self { tx, writer: Arc::default() }
    }

    pub fn current(&self) -> Arc<FleetState> {
        Arc::clone(&self.tx.borrow())
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<FleetState>> {
        self.tx.subscribe()
    }

    /// Commits `change`; returns the new version, or `None` when nothing differed.
    pub fn apply(&self, change: FleetChange) -> Option<u64> {
        if change.is_empty() {
            return None;
        }
        // Committed against the current state outside the watch's lock, which readers (every
        // session, the book, the gauges) would otherwise wait on for as long as a commit of
        // thousands of workers or samples takes; the writers take turns on their own lock.
        let _writing = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let (next, _delta) = self.current().commit(change)?;
        let version = next.version();
        self.tx.send_replace(Arc::new(next));
        Some(version)
    }
}

/// A decode worker `id` of namespace `dynamo` serving `tiny` with `dp_size` ranks (0: one), for
/// tests of what the fleet holds.
#[cfg(test)]
pub(crate) fn test_worker(id: u64, dp_size: u32) -> Arc<continuum_proto::model::Worker> {
    use continuum_proto::model::{Capacity, Role, Worker, WorkerKey};
    Arc::new(Worker {
        key: WorkerKey::new("dynamo", id),
        role: Role::Decode,
        model: "tiny".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity::default(),
        dp_start_rank: 0,
        dp_size,
        disaggregated_endpoint: None,
        artifacts: None,
    })
}
