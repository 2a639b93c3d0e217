//! The replica's fleet view as the rest of the data plane reads it: one immutable snapshot
//! behind an `ArcSwap` (lock-free on the request path) and the state of the link that feeds it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use continuum_proto::view::FleetView;
use tokio::sync::watch;

#[derive(Debug)]
pub struct FleetHandle {
    view: ArcSwapOption<FleetView>,
    link: Mutex<Link>,
    /// The version of the view, bumped after each swap; for components that follow changes.
    version_tx: watch::Sender<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Link {
    connected: bool,
    /// When the held view was last known to be current: the last update received, or the
    /// moment the stream was lost.
    current_at: Option<Instant>,
}

/// What `/readyz` and the metrics report about the view.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetStatus {
    pub version: Option<u64>,
    pub workers: usize,
    pub connected: bool,
    /// How long the view has been last-known-good rather than current: zero while the stream
    /// is up, `None` before the first snapshot.
    pub snapshot_age: Option<Duration>,
}

impl Default for FleetHandle {
    fn default() -> Self {
        Self {
            view: ArcSwapOption::empty(),
            link: Mutex::new(Link { connected: false, current_at: None }),
            version_tx: watch::channel(0).0,
        }
    }
}

impl FleetHandle {
    /// The current view; `None` until the first snapshot arrives.
    pub fn view(&self) -> Option<Arc<FleetView>> {
        self.view.load_full()
    }

    /// Follows the view's version; wakes after every swap.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    pub fn status(&self, now: Instant) -> FleetStatus {
        let link = *self.link.lock().unwrap_or_else(PoisonError::into_inner);
        let view = self.view();
        let snapshot_age = match (view.is_some(), link.connected, link.current_at) {
            (false, _, _) | (true, _, None) => None,
            (true, true, Some(_)) => Some(Duration::ZERO),
            (true, false, Some(at)) => Some(now.saturating_duration_since(at)),
        };
        FleetStatus {
            version: view.as_ref().map(|v| v.version()),
            workers: view.as_ref().map_or(0, |v| v.workers().len()),
            connected: link.connected,
            snapshot_age,
        }
    }

    pub(crate) fn store(&self, view: FleetView) {
        let version = view.version();
        self.view.store(Some(Arc::new(view)));
        self.touch(true);
        self.version_tx.send_replace(version);
    }

    /// The version the next stream's Hello names: the held view's. Informational (logs, the
    /// admin API): every stream starts with a full snapshot, which also brings back what
    /// [`Self::detach`] dropped.
    pub(crate) fn resume_from(&self) -> Option<u64> {
        self.view().map(|view| view.version())
    }

    /// The stream is lost: the view becomes last-known-good. Its workers, loads and
    /// configuration stay; its fleet-wide backlogs go, since nothing takes the ends of other
    /// replicas' dispatches out of them any more (frozen, they would keep a worker looking busy
    /// with requests finished long ago). The picker counts this replica's own dispatches until
    /// the stream is back.
    ///
    /// Which of this replica's operations the sums held goes too: it named the old stream's.
    pub(crate) fn detach(&self) {
        let held = |view: &Arc<FleetView>| !view.backlogs().is_empty() || view.reports_folded().is_some();
        if let Some(view) = self.view().filter(held) {
            self.view.store(Some(Arc::new(view.without_backlogs())));
        }
        self.touch(false);
    }

    /// Marks the link up (an update arrived) or down (the stream ended). Failed reconnects
    /// while down leave the view's age growing from the moment the link was lost.
    fn touch(&self, connected: bool) {
        let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        if connected || link.connected {
            link.current_at = Some(Instant::now());
        }
        link.connected = connected;
    }
}

#[cfg(test)]
mod tests {
    use continuum_proto::model::{Backlog, Capacity, LoadKey, Role, Worker, WorkerKey};

    use super::*;

    fn view(version: u64, backlog: Option<Backlog>) -> FleetView {
        let worker = Worker {
            key: WorkerKey::new("dynamo", 7),
            role: Role::Decode,
            model: "tiny".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: Capacity::default(),
            dp_start_rank: 0,
            dp_size: 1,
            disaggregated_endpoint: None,
            artifacts: None,
        };
        let rank = LoadKey { worker: worker.key.clone(), dp_rank: 0 };
        FleetView::new(version, [Arc::new(worker)], [], Arc::default())
            .and_then(|view| view.with_backlogs(backlog.map(|b| (rank, b))))
            .expect("a valid view")
    }

    #[test]
    fn a_lost_stream_drops_the_frozen_backlogs_and_keeps_the_rest() {
        let handle = FleetHandle::default();
        assert_eq!(handle.resume_from(), None, "nothing held");
        let backlog = Backlog { decode_blocks: 40, dispatches: 3, ..Backlog::default() };
        handle.store(view(5, Some(backlog)));
        assert_eq!(handle.resume_from(), Some(5));

        handle.detach();
        let held = handle.view().expect("last-known-good stays");
        assert_eq!((held.version(), held.workers().len()), (5, 1), "workers and version are kept");
        assert!(held.backlogs().is_empty(), "the frozen fleet-wide backlogs are gone");
        assert!(!handle.status(Instant::now()).connected);
        assert_eq!(handle.resume_from(), Some(5), "the Hello names the version held");
    }
}
