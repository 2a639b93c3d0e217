//! The book's task, and the handle Watch sessions reach it by: reports and departures go over a
//! bounded channel, bounded in bytes too, and the task publishes what moved (see the module
//! above for when).
//!
//! A panic while the task folds or publishes (a bug: no report's content is meant to cause
//! one) would otherwise end it silently and freeze every rank's backlog for good. The task
//! catches it, drops the book, whose state it can no longer trust, for an empty one, withdraws
//! the backlogs it had published and counts the restart; each session opened before it is
//! ended at its next report, so that its replica reconnects and reports its dispatches in
//! flight again. A fault that comes back at once (a report whose content trips the bug,
//! replayed at every reconnect) would make that a loop ending every stream: past
//! [`MAX_RESTARTS`] in [`RESTART_WINDOW`] the book gives up instead, and drops every report
//! unread from then on, the streams left open. Each replica then counts its own dispatches
//! alone, as a single-process router would, until the control plane restarts.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use continuum_proto::pb;
use prometheus::{IntCounter, IntCounterVec};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{BACKLOG_WINDOW, Book, MAX_QUEUED_REPORT_BYTES, Refusal, Refused};
use crate::fleet::{ActiveIndex, FleetChange, FleetPublisher, FleetState};

/// Reports waiting for the book. A report past its session's share is dropped (and counted);
/// one within it waits for room at most `ROOM_WAIT`, so a Watch session stalls no longer.
pub(super) const COMMAND_QUEUE: usize = 4096;
/// The part of the queue one session's reports may hold, in number and in bytes: a replica
/// flooding the book (buggy, or holding the token and hostile) has its own reports refused and
/// its session ended. Honest replicas report every millisecond and come nowhere near it unless
/// the book falls seconds behind. A few sessions may fill the queue within their shares; a
/// session within its own then waits for room (`ROOM_WAIT`) instead of losing its report.
pub(super) const SESSION_SHARE: usize = 4;
/// How long a report within its session's share waits for room in a full queue before it is
/// refused after all: the book is that far behind. The session reads and sends nothing
/// meanwhile, so it is well within the replica's patience with a silent control plane (5 s).
const ROOM_WAIT: Duration = Duration::from_secs(2);
/// Restarts within [`RESTART_WINDOW`] past which the book gives up (see the module's comment).
pub(super) const MAX_RESTARTS: usize = 3;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// Room in the channel beyond the reports' for departures ([`BacklogBook::replica_gone`]),
/// which share it to keep their order behind a session's last reports: a Watch stream ends
/// once and supersedes at most one other, so at most two for each that may be open. Without
/// it, departures queued behind a book running late would take places the reports' count
/// promised, and honest sessions' reports would be refused.
const DEPARTURE_ROOM: usize = 2 * crate::grpc::MAX_WATCH_STREAMS;

/// About what a report holds in memory: its dispatches, their block hashes and namespaces (a
/// replica's to fill, up to the message bound), its ends.
pub(super) fn report_bytes(report: &pb::DispatchReport) -> usize {
    let rank_bytes = |rank: &pb::LoadKey| {
        std::mem::size_of::<pb::LoadKey>()
            + std::mem::size_of::<pb::WorkerKey>()
            + rank.worker.as_ref().map_or(0, |w| w.namespace.len())
    };
    let started = report.started.iter().map(|started| {
        std::mem::size_of::<pb::DispatchStarted>()
            + started.rank.as_ref().map_or(0, rank_bytes)
            + started.block_hashes.len() * std::mem::size_of::<u64>()
    });
    let ranks = report.ranks.iter().map(rank_bytes);
    let ends = (report.ended.len() + report.prefilled.len()) * std::mem::size_of::<u64>();
    std::mem::size_of::<pb::DispatchReport>() + started.sum::<usize>() + ranks.sum::<usize>() + ends
}

enum Command {
    Report {
        replica: u64,
        report: pb::DispatchReport,
        at: Instant,
        bytes: usize,
        share: Arc<QueuedReports>,
        /// The book's generation the session reports to: a report sent before a restart
        /// belongs to a session the restart ends, and is dropped unread.
        generation: u64,
    },
    ReplicaGone {
        replica: u64,
    },
    /// Panics inside the task, as a bug in the book would.
    #[cfg(test)]
    Fault,
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

/// The whole queue's [`QueuedReports`], and its turns for the reports waiting for room.
#[derive(Debug, Default)]
pub(super) struct Queue {
    held: QueuedReports,
    /// Told as the book takes a report, waking the report waiting longest for room (one at a
    /// time, in turn, whatever the number of sessions waiting).
    freed: Notify,
}

impl QueuedReports {
    /// Takes room for one report of `bytes`, if that leaves at most `max_bytes` and
    /// `max_reports` held.
    fn take(&self, bytes: usize, max_bytes: usize, max_reports: usize) -> bool {
        let bytes_fit = self.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes <= max_bytes;
        let reports_fit = self.reports.fetch_add(1, Ordering::AcqRel) < max_reports;
        if !(bytes_fit && reports_fit) {
            // Undone without a word: telling a waiter would wake it (or this one) to no room.
            self.give_back(bytes);
        }
        bytes_fit && reports_fit
    }

    fn give_back(&self, bytes: usize) {
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.reports.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Queue {
    /// Gives back the room of a report the book took: the report waiting longest for room
    /// tries again.
    fn free(&self, bytes: usize) {
        self.held.give_back(bytes);
        self.freed.notify_one();
    }

    /// Room for one report of `bytes` within the queue's bounds, waiting up to `ROOM_WAIT`
    /// for it while `open`.
    async fn take_within(&self, bytes: usize, open: impl Fn() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + ROOM_WAIT;
        loop {
            // Listening before the attempt: room given back between the two is not missed.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.held.take(bytes, MAX_QUEUED_REPORT_BYTES, COMMAND_QUEUE) {
                return true;
            }
            if !open() || tokio::time::timeout_at(deadline, freed).await.is_err() {
                return false;
            }
        }
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
    /// Times the book was dropped for an empty one after a panic in its task.
    pub restarts: IntCounter,
}

/// The handle the Watch service holds; each session reports through a [`SessionReports`].
#[derive(Debug, Clone)]
pub struct BacklogBook {
    tx: mpsc::Sender<Command>,
    /// What the reports in the queue hold, estimated; the book's task gives it back.
    queued: Arc<Queue>,
    /// How many times the task restarted the book (see the module's comment).
    generation: Arc<AtomicU64>,
}

/// One session's way to the book, holding at most a `SESSION_SHARE`th of its queue.
#[derive(Debug)]
pub struct SessionReports {
    book: BacklogBook,
    share: Arc<QueuedReports>,
    /// The book's generation when the session opened: the book it reports to.
    generation: u64,
}

/// Why a report was not queued for the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotQueued {
    /// The session's share of the book's queue is full, or the whole queue stayed full for
    /// `ROOM_WAIT` (or the book has ended).
    Full,
    /// The book restarted after a fault since the session opened: it holds none of the
    /// session's dispatches.
    Restarted,
}

impl SessionReports {
    /// Queues a replica's report for the book: refused when this session's share of the
    /// book's queue is full (in number, or in [`MAX_QUEUED_REPORT_BYTES`]), or when the book is
    /// no longer the one the session's earlier reports went to. Within its share, a report
    /// waits for room in a full queue (sessions flooding it up to their shares cannot end the
    /// others'), refused only when none comes within `ROOM_WAIT`.
    pub async fn report(&self, replica: u64, report: pb::DispatchReport) -> Result<(), NotQueued> {
        let generation = self.book.generation.load(Ordering::Acquire);
        if generation != self.generation {
            return Err(NotQueued::Restarted);
        }
        let bytes = report_bytes(&report);
        let (queued, share) = (&self.book.queued, &self.share);
        if !share.take(bytes, MAX_QUEUED_REPORT_BYTES / SESSION_SHARE, COMMAND_QUEUE / SESSION_SHARE) {
            return Err(NotQueued::Full);
        }
        // Given back if the wait ends without room, or is dropped.
        let held = Held { share, bytes };
        let open = || !self.book.tx.is_closed();
        if !queued.take_within(bytes, open).await {
            return Err(NotQueued::Full);
        }
        std::mem::forget(held);
        let command =
            Command::Report { replica, report, at: Instant::now(), bytes, share: Arc::clone(share), generation };
        // The count bound above is the channel's capacity less the departures' room: this
        // fails only as the book ends, or behind more departures than sessions could send.
        self.book.tx.try_send(command).map_err(|_| {
            queued.free(bytes);
            share.give_back(bytes);
            NotQueued::Full
        })
    }
}

/// Room a session's share holds for a report not yet queued.
struct Held<'a> {
    share: &'a QueuedReports,
    bytes: usize,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.share.give_back(self.bytes);
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
        let (queued, generation) = (Arc::clone(&book.queued), Arc::clone(&book.generation));
        tokio::spawn(run(publisher, Book { active, ..Book::default() }, (rx, queued, generation), counters, cancel));
        book
    }

    /// The handle, and the queue its task will read.
    fn unstarted() -> (Self, mpsc::Receiver<Command>) {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE + DEPARTURE_ROOM);
        (Self { tx, queued: Arc::default(), generation: Arc::default() }, rx)
    }

    /// A new session's way to report, with a share of the queue of its own.
    pub fn session(&self) -> SessionReports {
        let generation = self.generation.load(Ordering::Acquire);
        SessionReports { book: self.clone(), share: Arc::default(), generation }
    }

    /// Makes the book's task panic, as a bug in the book would.
    #[cfg(test)]
    pub async fn fault(&self) {
        let _ = self.tx.send(Command::Fault).await;
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
    (mut rx, queued, generation): (mpsc::Receiver<Command>, Arc<Queue>, Arc<AtomicU64>),
    counters: BookCounters,
    cancel: CancellationToken,
) {
    // What the counters already hold of the book's totals.
    let mut exported: (Refused, u64, u64) = Default::default();
    let mut faults = Faults { generation, recent: VecDeque::new(), given_up: false };
    let mut states: watch::Receiver<Arc<FleetState>> = publisher.subscribe();
    let mut tick = tokio::time::interval(BACKLOG_WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // On the runtime's clock, as the tick is.
    let mut last_published: Option<tokio::time::Instant> = None;
    loop {
        // A session that ended holding many dispatches is forgotten a chunk a turn, the
        // runtime's other tasks and the book's other commands between.
        if book.departing() {
            if guarded(|| book.forget_departed(Instant::now())).is_none() {
                faults.restart(&mut book, &publisher, &counters, &mut exported);
            }
            tokio::task::yield_now().await;
        }
        // With nothing held and nothing to publish, the book sleeps until a command comes
        // instead of waking every window.
        let busy = !book.ranks.is_empty() || !book.dirty.is_empty() || book.folded_moved;
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            command = rx.recv() => {
                let folded = match command {
                    Some(Command::Report { replica, report, at, bytes, share, generation: sent_to }) => {
                        queued.free(bytes);
                        share.give_back(bytes);
                        if share.ended.load(Ordering::Acquire)
                            || sent_to != faults.generation.load(Ordering::Acquire)
                            || faults.given_up
                        {
                            continue;
                        }
                        // The state itself, not the watch's guard: folding a report of a
                        // thousand dispatches must not hold off the fleet's next version (and
                        // every session reading the current one behind it).
                        let state = Arc::clone(&states.borrow());
                        guarded(|| book.report(replica, report, at, &state))
                    }
                    Some(Command::ReplicaGone { .. }) if faults.given_up => continue,
                    Some(Command::ReplicaGone { replica }) => guarded(|| book.replica_gone(replica, Instant::now())),
                    #[cfg(test)]
                    Some(Command::Fault) => guarded(|| panic!("a fault injected by a test")),
                    None => return,
                };
                if folded.is_none() {
                    faults.restart(&mut book, &publisher, &counters, &mut exported);
                    continue;
                }
                // Leading edge: the first change after a quiet window goes out at once, so the
                // other replicas learn of a lone dispatch or end without waiting up to a window
                // for the tick (requests arriving a millisecond apart through different replicas
                // otherwise pile onto the worker that looked free); a stream of reports is paced
                // by the tick, one publication per window.
                let paced = tokio::time::Instant::now();
                if last_published.is_none_or(|at| paced.saturating_duration_since(at) >= BACKLOG_WINDOW) {
                    match guarded(|| publish(&mut book, &publisher, &mut states, Instant::now())) {
                        Some(true) => {
                            last_published = Some(paced);
                            // The next publication waits a whole window from this one.
                            tick.reset();
                        }
                        Some(false) => {}
                        None => {
                            faults.restart(&mut book, &publisher, &counters, &mut exported);
                        }
                    }
                }
            }
            _ = tick.tick(), if busy => {
                match guarded(|| publish(&mut book, &publisher, &mut states, Instant::now())) {
                    Some(true) => last_published = Some(tokio::time::Instant::now()),
                    Some(false) => {}
                    None => {
                        faults.restart(&mut book, &publisher, &counters, &mut exported);
                        continue;
                    }
                }
            }
            // Departures left, and neither a command nor the tick waiting: on to the next chunk.
            () = std::future::ready(()), if book.departing() => continue,
        }
        // Every turn, not only the tick's: a book kept busy by reports (its queue never empty,
        // so the biased select never reaches the tick) counts its refusals as it makes them.
        export(&book, &counters, &mut exported);
    }
}

/// What a book's counts have added since `exported`, added to its counters.
fn export(book: &Book, counters: &BookCounters, exported: &mut (Refused, u64, u64)) {
    let (refused, chains_dropped, replayed) = *exported;
    if (book.refused, book.chains_dropped, book.replayed) == (refused, chains_dropped, replayed) {
        return;
    }
    for reason in Refusal::ALL {
        let counted = book.refused.of(reason) - refused.of(reason);
        if counted > 0 {
            counters.refused.with_label_values(&[reason.as_str()]).inc_by(counted);
        }
    }
    counters.chains_dropped.inc_by(book.chains_dropped - chains_dropped);
    counters.replayed.inc_by(book.replayed - replayed);
    *exported = (book.refused, book.chains_dropped, book.replayed);
}

/// `step`'s result, or `None` when it panicked: the book it was changing can no longer be
/// trusted (the panic itself is logged by the process's hook, with its place).
fn guarded<T>(step: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(AssertUnwindSafe(step)).ok()
}

/// The book's panics so far (see the module's comment).
struct Faults {
    /// Moved on at each restart: the sessions opened before it are ended.
    generation: Arc<AtomicU64>,
    /// When the restarts within [`RESTART_WINDOW`] came.
    recent: VecDeque<Instant>,
    /// Past [`MAX_RESTARTS`] of them: every report is dropped unread from then on.
    given_up: bool,
}

impl Faults {
    /// Drops a book a panic left in an unknown state for an empty one: its published backlogs
    /// are withdrawn (every rank's, whoever published it) and so are the ranges of operations
    /// they held, the blocks in flight forgotten, its counts (as `exported` holds them) started
    /// over, and the generation moved on, which ends each session opened before at its next
    /// report (see [`NotQueued::Restarted`]); or, past [`MAX_RESTARTS`] in
    /// [`RESTART_WINDOW`], the sessions are left open and the book gives up.
    fn restart(
        &mut self,
        book: &mut Book,
        publisher: &FleetPublisher,
        counters: &BookCounters,
        exported: &mut (Refused, u64, u64),
    ) {
        counters.restarts.inc();
        *exported = Default::default();
        let now = Instant::now();
        self.recent.retain(|at| now.saturating_duration_since(*at) < RESTART_WINDOW);
        self.recent.push_back(now);
        if self.recent.len() > MAX_RESTARTS {
            self.given_up = true;
            tracing::error!(
                restarts = self.recent.len(),
                "the dispatch book's task panicked again and again; it gives up: reports are dropped unread, and each replica counts its own dispatches alone until the control plane restarts"
            );
        } else {
            self.generation.fetch_add(1, Ordering::AcqRel);
            tracing::error!(
                "the dispatch book's task panicked; it starts over empty, and every replica reports its dispatches in flight again on a new stream"
            );
        }
        book.active.clear();
        *book = Book { active: book.active.clone(), ..Book::default() };
        let published: Vec<_> = publisher.current().view().backlogs().keys().cloned().collect();
        publisher.apply(FleetChange {
            backlogs_removed: published,
            reports_folded: Some(Arc::default()),
            ..FleetChange::default()
        });
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
    if book.dirty.is_empty() && !book.folded_moved {
        return false;
    }
    let change = book.take_change(now);
    let changed = !change.backlogs.is_empty() || change.reports_folded.is_some();
    // A publication only when the fleet's version moved (ranges already out are no news).
    changed && publisher.apply(change).is_some()
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
                let queued = session.report(1, pb::DispatchReport::default()).await;
                assert_eq!(queued, Ok(()), "a place the count promised");
            }
            assert_eq!(
                session.report(1, pb::DispatchReport::default()).await,
                Err(NotQueued::Full),
                "past the session's share"
            );
        }
    }

    /// Sessions that fill the queue within their shares (flooding it, or reporting to a book
    /// running late) cannot make another session lose a report: it waits for room, and is
    /// refused only past its own share.
    #[tokio::test(start_paused = true)]
    async fn a_report_within_its_share_waits_for_room_in_a_full_queue() {
        let (book, mut queue) = BacklogBook::unstarted();
        let flooders: Vec<SessionReports> = (0..SESSION_SHARE).map(|_| book.session()).collect();
        for session in &flooders {
            for _ in 0..COMMAND_QUEUE / SESSION_SHARE {
                assert_eq!(session.report(1, pb::DispatchReport::default()).await, Ok(()));
            }
        }
        let honest = book.session();
        let report = honest.report(2, pb::DispatchReport::default());
        tokio::pin!(report);
        let waited = tokio::time::timeout(ROOM_WAIT / 2, report.as_mut()).await;
        assert!(waited.is_err(), "it waits for room: {waited:?}");
        // The book takes a report, as its task does, giving its room back.
        let Some(Command::Report { bytes, share, .. }) = queue.recv().await else { panic!("a report") };
        book.queued.free(bytes);
        share.give_back(bytes);
        assert_eq!(report.await, Ok(()), "queued in the room given back");

        // With no room given back in time, it is refused after all.
        let late = honest.report(2, pb::DispatchReport::default());
        assert_eq!(late.await, Err(NotQueued::Full));
        assert_eq!(honest.share.reports.load(Ordering::Acquire), 1, "the refused report's share given back");
    }
}
