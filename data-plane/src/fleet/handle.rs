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

    /// Marks the link up (an update arrived) or down (the stream ended). Failed reconnects
    /// while down leave the view's age growing from the moment the link was lost.
    pub(crate) fn touch(&self, connected: bool) {
        let mut link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        if connected || link.connected {
            link.current_at = Some(Instant::now());
        }
        link.connected = connected;
    }
}
