//! Reports this replica's dispatches to the control plane, on the Watch stream it already holds.
//!
//! The control plane sums every replica's unanswered dispatches per rank and streams them back
//! as backlogs, so replicas spread a burst between two load samples. Reporting never blocks a
//! request: events go into a bounded queue and are dropped (and counted) when it is full or the
//! stream is down; a dropped report only makes the fleet-wide view briefly less complete.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use continuum_proto::model::LoadKey;
use continuum_proto::pb;
use prometheus::IntCounter;
use tokio::sync::mpsc;

/// Events waiting to be reported; one batch per stream turn drains them.
pub const REPORT_QUEUE: usize = 8192;
/// Events folded into one `DispatchReport` at most.
pub const MAX_REPORT_BATCH: usize = 512;

#[derive(Debug)]
pub enum DispatchEvent {
    Started { id: u64, rank: LoadKey, prefill_tokens: u64, decode_blocks: u64 },
    Ended(u64),
}

#[derive(Debug)]
pub struct DispatchReporter {
    tx: mpsc::Sender<DispatchEvent>,
    rx: Mutex<Option<mpsc::Receiver<DispatchEvent>>>,
    next_id: AtomicU64,
    dropped: IntCounter,
}

impl DispatchReporter {
    pub fn new(dropped: IntCounter) -> Self {
        let (tx, rx) = mpsc::channel(REPORT_QUEUE);
        Self { tx, rx: Mutex::new(Some(rx)), next_id: AtomicU64::new(1), dropped }
    }

    /// Reports a dispatch pinned to `rank`; returns its id for [`DispatchReporter::ended`].
    pub fn started(&self, rank: &LoadKey, prefill_tokens: u64, decode_blocks: u64) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.send(DispatchEvent::Started { id, rank: rank.clone(), prefill_tokens, decode_blocks });
        id
    }

    pub fn ended(&self, id: u64) {
        self.send(DispatchEvent::Ended(id));
    }

    fn send(&self, event: DispatchEvent) {
        if self.tx.try_send(event).is_err() {
            self.dropped.inc();
        }
    }

    /// The receiving end, for the fleet client (taken once).
    pub(crate) fn take_receiver(&self) -> Option<mpsc::Receiver<DispatchEvent>> {
        self.rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// Folds `first` and whatever else is queued (up to the batch bound) into one report.
pub(crate) fn batch(first: DispatchEvent, rx: &mut mpsc::Receiver<DispatchEvent>) -> pb::DispatchReport {
    let mut report = pb::DispatchReport::default();
    let mut add = |event| match event {
        DispatchEvent::Started { id, rank, prefill_tokens, decode_blocks } => {
            report.started.push(pb::DispatchStarted { id, rank: Some((&rank).into()), prefill_tokens, decode_blocks });
        }
        DispatchEvent::Ended(id) => report.ended.push(id),
    };
    add(first);
    for _ in 1..MAX_REPORT_BATCH {
        match rx.try_recv() {
            Ok(event) => add(event),
            Err(_) => break,
        }
    }
    report
}

/// Discards what queued up while the stream was down: the control plane forgot this
/// replica's dispatches when its session ended, so ends for them would name nothing.
pub(crate) fn discard(rx: &mut mpsc::Receiver<DispatchEvent>) {
    while rx.try_recv().is_ok() {}
}
