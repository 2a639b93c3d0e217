//! The book's task, and the handle Watch sessions reach it by: reports and departures go over a
//! bounded channel, bounded in bytes too, and the task publishes what moved (see the module
//! above for when).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use continuum_proto::pb;
use prometheus::{IntCounter, IntCounterVec};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{BACKLOG_WINDOW, Book, MAX_QUEUED_REPORT_BYTES, Refusal, Refused};
use crate::fleet::{ActiveIndex, FleetPublisher, FleetState};

/// Reports waiting for the book; a full queue drops the report (and counts it) rather than
/// stalling a Watch session.
pub(super) const COMMAND_QUEUE: usize = 4096;
/// The part of the queue one session's reports may hold, in number and in bytes: a replica
/// flooding the book (buggy, or holding the token and hostile) has its own reports refused and
/// its session ended, while the others' still find room. Honest replicas report every
/// millisecond and come nowhere near it unless the book falls seconds behind.
pub(super) const SESSION_SHARE: usize = 4;
/// Room in the channel beyond the reports' for departures ([`BacklogBook::replica_gone`]),
/// which share it to keep their order behind a session's last reports: a Watch stream ends
/// once and supersedes at most one other, so at most two for each that may be open. Without
/// it, departures queued behind a book running late would take places the reports' count
/// promised, and honest sessions' reports would be refused.
const DEPARTURE_ROOM: usize = 2 * crate::grpc::MAX_WATCH_STREAMS;

/// About what a report holds in memory: its dispatches, their block hashes and namespaces (a
/// replica's to fill, up to the message bound), its ends.
pub(super) fn report_bytes(report: &pb::DispatchReport) -> usize {
    let started = report.started.iter().map(|started| {
        let namespace = started.rank.as_ref().and_then(|rank| rank.worker.as_ref()).map_or(0, |w| w.namespace.len());
        std::mem::size_of::<pb::DispatchStarted>()
            + std::mem::size_of::<pb::WorkerKey>()
            + namespace
            + started.block_hashes.len() * std::mem::size_of::<u64>()
    });
    let ends = (report.ended.len() + report.prefilled.len()) * std::mem::size_of::<u64>();
    std::mem::size_of::<pb::DispatchReport>() + started.sum::<usize>() + ends
}

enum Command {
    Report { replica: u64, report: pb::DispatchReport, at: Instant, bytes: usize, share: Arc<QueuedReports> },
    ReplicaGone { replica: u64 },
}

/// What reports in the queue hold, estimated: all of them, or one session's.
#[derive(Debug, Default)]
pub(super) struct QueuedReports {
    bytes: AtomicUsize,
    reports: AtomicUsize,
    /// A session's: it ended, so its reports still queued are dropped unread. The book forgets
    /// its dispatches as it learns the session ended, so folding them first would change
    /// nothing, and a replica that floods the queue, is refused and reconnects leaves behind
    /// only what the book can discard at once, not a share the others' reports wait behind.
    ended: AtomicBool,
}

impl QueuedReports {
    /// Takes room for one report of `bytes`, if that leaves at most `max_bytes` and
    /// `max_reports` held.
    fn take(&self, bytes: usize, max_bytes: usize, max_reports: usize) -> bool {
        let bytes_fit = self.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes <= max_bytes;
        let reports_fit = self.reports.fetch_add(1, Ordering::AcqRel) < max_reports;
        if !(bytes_fit && reports_fit) {
            self.give_back(bytes);
        }
        bytes_fit && reports_fit
    }

    fn give_back(&self, bytes: usize) {
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.reports.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the book counts on the control plane's registry.
#[derive(Debug, Clone)]
pub struct BookCounters {
    /// Dispatches the book would not hold, by `reason` ([`Refusal`]).
    pub refused: IntCounterVec,
    /// Prefix chains not held past [`continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES`].
    pub chains_dropped: IntCounter,
    /// Dispatches reported again on a new stream.
    pub replayed: IntCounter,
}

/// The handle the Watch service holds; each session reports through a [`SessionReports`].
#[derive(Debug, Clone)]
pub struct BacklogBook {
    tx: mpsc::Sender<Command>,
    /// What the reports in the queue hold, estimated; the book's task gives it back.
    queued: Arc<QueuedReports>,
}

/// One session's way to the book, holding at most a [`SESSION_SHARE`]th of its queue.
#[derive(Debug)]
pub struct SessionReports {
    book: BacklogBook,
    share: Arc<QueuedReports>,
}

impl SessionReports {
    /// Records a replica's report; `false` when the book's queue, or this session's share of
    /// it, is full (in number, or in [`MAX_QUEUED_REPORT_BYTES`]).
    pub fn report(&self, replica: u64, report: pb::DispatchReport) -> bool {
        let bytes = report_bytes(&report);
        let (queued, share) = (&self.book.queued, &self.share);
        if !share.take(bytes, MAX_QUEUED_REPORT_BYTES / SESSION_SHARE, COMMAND_QUEUE / SESSION_SHARE) {
            return false;
        }
        if !queued.take(bytes, MAX_QUEUED_REPORT_BYTES, COMMAND_QUEUE) {
            share.give_back(bytes);
            return false;
        }
        let command = Command::Report { replica, report, at: Instant::now(), bytes, share: Arc::clone(share) };
        // The count bound above is the channel's capacity less the departures' room: this
        // fails only as the book ends, or behind more departures than sessions could send.
        let sent = self.book.tx.try_send(command).is_ok();
        if !sent {
            queued.give_back(bytes);
            share.give_back(bytes);
        }
        sent
    }
}

impl Drop for SessionReports {
    fn drop(&mut self) {
        self.share.ended.store(true, Ordering::Release);
    }
}

impl BacklogBook {
    /// Starts the book's task, which keeps the blocks in flight in `active`.
    pub fn spawn(
        publisher: FleetPublisher,
        active: ActiveIndex,
        counters: BookCounters,
        cancel: CancellationToken,
    ) -> Self {
        let (book, rx) = Self::unstarted();
        let queued = Arc::clone(&book.queued);
        tokio::spawn(run(publisher, Book { active, ..Book::default() }, (rx, queued), counters, cancel));
        book
    }

    /// The handle, and the queue its task will read.
    fn unstarted() -> (Self, mpsc::Receiver<Command>) {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE + DEPARTURE_ROOM);
        (Self { tx, queued: Arc::default() }, rx)
    }

    /// A new session's way to report, with a share of the queue of its own.
    pub fn session(&self) -> SessionReports {
        SessionReports { book: self.clone(), share: Arc::default() }
    }

    /// Forgets `replica`'s dispatches; waits for room in the queue, since a replica gone
    /// unnoticed would weigh on its ranks until its dispatches aged out.
    pub async fn replica_gone(&self, replica: u64) {
        // The book's task ends only with the control plane, when nothing is left to forget.
        let _ = self.tx.send(Command::ReplicaGone { replica }).await;
    }
}

async fn run(
    publisher: FleetPublisher,
    mut book: Book,
    (mut rx, queued): (mpsc::Receiver<Command>, Arc<QueuedReports>),
    counters: BookCounters,
    cancel: CancellationToken,
) {
    // What the counters already hold of the book's totals.
    let (mut refused, mut chains_dropped, mut replayed) = (Refused::default(), 0, 0);
    let mut states: watch::Receiver<Arc<FleetState>> = publisher.subscribe();
    let mut tick = tokio::time::interval(BACKLOG_WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // On the runtime's clock, as the tick is.
    let mut last_published: Option<tokio::time::Instant> = None;
    loop {
        // With nothing held, nothing to publish and no count to export, the book sleeps until a
        // report comes instead of waking every window.
        let busy = !book.ranks.is_empty()
            || !book.dirty.is_empty()
            || (book.refused, book.chains_dropped, book.replayed) != (refused, chains_dropped, replayed);
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            command = rx.recv() => {
                match command {
                    Some(Command::Report { replica, report, at, bytes, share }) => {
                        queued.give_back(bytes);
                        share.give_back(bytes);
                        if share.ended.load(Ordering::Acquire) {
                            continue;
                        }
                        // The state itself, not the watch's guard: folding a report of a
                        // thousand dispatches must not hold off the fleet's next version (and
                        // every session reading the current one behind it).
                        let state = Arc::clone(&states.borrow());
                        book.report(replica, report, at, &state);
                    }
                    Some(Command::ReplicaGone { replica }) => book.replica_gone(replica, Instant::now()),
                    None => return,
                }
                // Leading edge: the first change after a quiet window goes out at once, so the
                // other replicas learn of a lone dispatch or end without waiting up to a window
                // for the tick (requests arriving a millisecond apart through different replicas
                // otherwise pile onto the worker that looked free); a stream of reports is paced
                // by the tick, one publication per window.
                let paced = tokio::time::Instant::now();
                if last_published.is_none_or(|at| paced.saturating_duration_since(at) >= BACKLOG_WINDOW)
                    && publish(&mut book, &publisher, &mut states, Instant::now())
                {
                    last_published = Some(paced);
                    // The next publication waits a whole window from this one.
                    tick.reset();
                }
            }
            _ = tick.tick(), if busy => {
                if publish(&mut book, &publisher, &mut states, Instant::now()) {
                    last_published = Some(tokio::time::Instant::now());
                }
                for reason in Refusal::ALL {
                    let counted = book.refused.of(reason) - refused.of(reason);
                    counters.refused.with_label_values(&[reason.as_str()]).inc_by(counted);
                }
                counters.chains_dropped.inc_by(book.chains_dropped - chains_dropped);
                counters.replayed.inc_by(book.replayed - replayed);
                (refused, chains_dropped, replayed) = (book.refused, book.chains_dropped, book.replayed);
            }
        }
    }
}

/// Brings the book up to date with the newest samples and time, and publishes the sums that
/// moved; `true` when it published.
fn publish(
    book: &mut Book,
    publisher: &FleetPublisher,
    states: &mut watch::Receiver<Arc<FleetState>>,
    now: Instant,
) -> bool {
    if !book.ranks.is_empty() {
        let state = Arc::clone(&states.borrow_and_update());
        book.expire(&state, now);
    }
    if book.dirty.is_empty() {
        return false;
    }
    let change = book.take_change(now);
    let changed = !change.backlogs.is_empty();
    if changed {
        publisher.apply(change);
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Departures waiting in the queue of a book running late take none of the places the
    /// reports' count promised: every session still reports its share.
    #[tokio::test]
    async fn departures_take_no_report_places() {
        let (book, _unread) = BacklogBook::unstarted();
        for replica in 0..64 {
            book.replica_gone(replica).await;
        }
        let sessions: Vec<SessionReports> = (0..SESSION_SHARE).map(|_| book.session()).collect();
        for session in &sessions {
            for _ in 0..COMMAND_QUEUE / SESSION_SHARE {
                assert!(session.report(1, pb::DispatchReport::default()), "a place the count promised");
            }
            assert!(!session.report(1, pb::DispatchReport::default()), "past the session's share");
        }
    }
}
