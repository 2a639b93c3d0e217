//! Reports this replica's dispatches to the control plane, on the Watch stream it already holds.
//!
//! The control plane sums every replica's dispatches in flight per rank and streams them back
//! as backlogs, so replicas spread a burst between two load samples. Reporting never blocks a
//! request: events go into a bounded queue and are dropped (and counted) when it is full or the
//! stream is down; a dropped report only makes the fleet-wide view briefly less complete.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use continuum_proto::model::LoadKey;
use continuum_proto::{MAX_DISPATCH_BLOCK_HASHES, MAX_REPORT_BLOCK_HASHES, pb};
use prometheus::IntCounter;
use tokio::sync::mpsc;

/// Events waiting to be reported; one batch per stream turn drains them.
pub const REPORT_QUEUE: usize = 8192;
/// Events folded into one `DispatchReport` at most.
pub const MAX_REPORT_BATCH: usize = 512;

#[derive(Debug)]
pub enum DispatchEvent {
    Started { id: u64, rank: LoadKey, prefill_tokens: u64, decode_blocks: u64, block_hashes: Vec<u64> },
    Ended(u64),
    Prefilled(u64),
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

    /// Reports a dispatch pinned to `rank`, whose prompt hashes to `block_hashes` (empty when
    /// unknown; cut to [`MAX_DISPATCH_BLOCK_HASHES`]): the control plane credits that prefix
    /// to the rank provisionally, fleet-wide, and counts decode blocks dispatches share once.
    /// Returns its id for [`DispatchReporter::ended`].
    pub fn started(&self, rank: &LoadKey, prefill_tokens: u64, decode_blocks: u64, mut block_hashes: Vec<u64>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        block_hashes.truncate(MAX_DISPATCH_BLOCK_HASHES);
        self.send(DispatchEvent::Started { id, rank: rank.clone(), prefill_tokens, decode_blocks, block_hashes });
        id
    }

    pub fn ended(&self, id: u64) {
        self.send(DispatchEvent::Ended(id));
    }

    /// The dispatch's response began: its prompt is prefilled.
    pub fn prefilled(&self, id: u64) {
        self.send(DispatchEvent::Prefilled(id));
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

/// Folds `first` and whatever else is queued (up to the batch bound) into one report. Past
/// [`MAX_REPORT_BLOCK_HASHES`] in the report, dispatches go without their block hashes: the
/// backlog still counts them, only their provisional credit is lost.
pub(crate) fn batch(first: DispatchEvent, rx: &mut mpsc::Receiver<DispatchEvent>) -> pb::DispatchReport {
    let mut report = pb::DispatchReport::default();
    let mut hashes_left = MAX_REPORT_BLOCK_HASHES;
    let mut add = |event| match event {
        DispatchEvent::Started { id, rank, prefill_tokens, decode_blocks, mut block_hashes } => {
            if block_hashes.len() > hashes_left {
                block_hashes = Vec::new();
            }
            hashes_left -= block_hashes.len();
            let rank = Some((&rank).into());
            report.started.push(pb::DispatchStarted { id, rank, prefill_tokens, decode_blocks, block_hashes });
        }
        DispatchEvent::Ended(id) => report.ended.push(id),
        DispatchEvent::Prefilled(id) => report.prefilled.push(id),
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

#[cfg(test)]
mod tests {
    use continuum_proto::model::WorkerKey;

    use super::*;

    fn rank() -> LoadKey {
        LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 }
    }

    #[test]
    fn a_dispatch_carries_at_most_its_bound_of_block_hashes() {
        let reporter = DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter"));
        let mut rx = reporter.take_receiver().expect("receiver");
        reporter.started(&rank(), 64, 0, (0..MAX_DISPATCH_BLOCK_HASHES as u64 + 9).collect());
        let first = rx.try_recv().expect("queued");
        let report = batch(first, &mut rx);
        assert_eq!(report.started[0].block_hashes.len(), MAX_DISPATCH_BLOCK_HASHES);
        assert_eq!(report.started[0].block_hashes[..3], [0, 1, 2], "the chain is cut at its end");
    }

    #[test]
    fn past_the_report_bound_dispatches_go_without_their_hashes_but_are_still_reported() {
        let reporter = DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter"));
        let mut rx = reporter.take_receiver().expect("receiver");
        let per = MAX_DISPATCH_BLOCK_HASHES;
        let fit = MAX_REPORT_BLOCK_HASHES / per;
        for _ in 0..=fit {
            reporter.started(&rank(), 64, 0, vec![1; per]);
        }
        reporter.started(&rank(), 0, 4, Vec::new());
        let first = rx.try_recv().expect("queued");
        let report = batch(first, &mut rx);
        assert_eq!(report.started.len(), fit + 2);
        let carried: Vec<usize> = report.started.iter().map(|s| s.block_hashes.len()).collect();
        assert!(carried[..fit].iter().all(|n| *n == per));
        assert_eq!(carried[fit..], [0, 0]);
        assert_eq!(carried.iter().sum::<usize>(), MAX_REPORT_BLOCK_HASHES);
    }
}
