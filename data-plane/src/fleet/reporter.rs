//! Reports this replica's dispatches to the control plane, on the Watch stream it already holds.
//!
//! The control plane sums every replica's dispatches in flight per rank and streams them back
//! as backlogs, so replicas spread a burst between two load samples. Reporting never blocks a
//! request: operations go into a bounded queue, and while no stream is open they are performed
//! unnumbered.
//!
//! Each operation (a dispatch recorded, its first token, its end) is numbered, and queued whole
//! in number order: the replica's ledger records it under the same number, and the control
//! plane says which numbers its sums hold, so the replica adds exactly its own operations the
//! sums lack ([`continuum_proto::model::ReportsFolded`]).
//!
//! One the queue has no room for (the control plane reads too slowly) is counted and goes
//! unnumbered, and the reporter detaches: the stream's reports can no longer be whole (a lost
//! end would weigh on its rank, for every replica, until the control plane aged it out), so
//! the fleet client ends the stream ([`Reports::attached`]), the control plane forgets its
//! dispatches, and the next stream hears first of every dispatch still in flight
//! ([`InFlight`]), as after a control-plane restart.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use continuum_proto::fast_hash::FastMap;
use continuum_proto::model::LoadKey;
use continuum_proto::{MAX_DISPATCH_BLOCK_HASHES, MAX_REPORT_BLOCK_HASHES, pb};
use prometheus::IntCounter;
use tokio::sync::{Notify, mpsc};

use crate::routing::picker::{DispatchId, NOT_REPORTED, Op, ReplayedLeg};

/// Operations waiting to be reported; one batch per stream turn drains them.
pub const REPORT_QUEUE: usize = 8192;
/// Block hashes the queued operations may carry (33 MiB): with a control plane reading slowly,
/// 8,192 operations of two 4,096-hash chains would hold half a gigabyte. As many as the ledger
/// holds, and one report's more; past it the queue counts as full. A replay's operations are
/// not charged to it: what they carry is a copy of the ledger's chains, which the ledger
/// bounds (4 Mi), and charged here they would leave the operations after a large replay no
/// room until the stream had drained it, ending the stream, whose next one replays it all again.
pub const MAX_QUEUED_BLOCK_HASHES: usize = continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES + MAX_REPORT_BLOCK_HASHES;
/// Block hashes one operation other than a replay's carries at most: two chains.
const MAX_OPERATION_HASHES: usize = 2 * MAX_DISPATCH_BLOCK_HASHES;
/// Events folded into one `DispatchReport` at most (a report never splits an operation, so it
/// may hold one more).
pub const MAX_REPORT_BATCH: usize = 512;
// An operation starts at most two dispatches, and a report may hold one past the batch.
const _: () = assert!(MAX_REPORT_BATCH + 2 <= continuum_proto::MAX_REPORT_STARTED);
const _: () = assert!(MAX_REPORT_BATCH + 2 <= continuum_proto::MAX_REPORT_ENDS);
/// Dispatches one replay operation reports again at most: two legs each, each started and
/// perhaps answered, so a report holding one past its batch still fits the control plane's
/// bound on starts.
pub const MAX_REPLAYED_PER_OPERATION: usize = 128;
const _: () = assert!(MAX_REPORT_BATCH + 2 * MAX_REPLAYED_PER_OPERATION <= continuum_proto::MAX_REPORT_STARTED);
// A whole replay operation fits the queue a stream starts with, however many it takes.
const _: () = assert!(crate::routing::picker::LEDGER_CAPACITY / MAX_REPLAYED_PER_OPERATION < REPORT_QUEUE);

/// Where the dispatches in flight are kept (the replica's ledger), to report them again when a
/// stream opens: the control plane forgot them with the last stream, or restarted.
pub trait InFlight: Send + Sync + std::fmt::Debug {
    /// The dispatches the stream whose operations start at `stream_first` does not hold.
    fn to_replay(&self, stream_first: u64) -> Vec<DispatchId>;
    /// Reports the first of `ids` again in `report` ([`Report::replayed`]), recording that it
    /// did: as many as carry at most [`MAX_REPLAYED_HASHES`] block hashes (one at least).
    /// Returns how many of `ids` it took, and how many legs it reported.
    fn replay(&self, ids: &[DispatchId], report: &mut Report<'_>) -> (usize, usize);
}

/// Block hashes one replay operation carries at most: half a report's, so that a report, which
/// stops taking operations past half its hashes, never drops a replayed chain.
pub const MAX_REPLAYED_HASHES: usize = MAX_REPORT_BLOCK_HASHES / 2;

#[derive(Debug)]
enum DispatchEvent {
    Started {
        id: u64,
        rank: LoadKey,
        prefill_tokens: u64,
        decode_blocks: u64,
        block_hashes: Vec<u64>,
        lookup: u64,
        /// How long ago a dispatch reported again on a new stream began; `None` for a new one.
        replayed_age_ms: Option<u64>,
        /// Its client takes the answer whole: no first token will be reported.
        buffered: bool,
        /// Left unanswered, it may mark its rank stalled fleet-wide.
        may_stall: bool,
    },
    Ended(u64),
    Prefilled(u64),
}

impl DispatchEvent {
    fn hashes(&self) -> usize {
        match self {
            DispatchEvent::Started { block_hashes, .. } => block_hashes.len(),
            DispatchEvent::Ended(_) | DispatchEvent::Prefilled(_) => 0,
        }
    }
}

/// One numbered operation and the events it reports.
#[derive(Debug)]
pub struct Operation {
    number: u64,
    events: Vec<DispatchEvent>,
    /// The block hashes its events carry, charged to [`MAX_QUEUED_BLOCK_HASHES`] while queued
    /// (none for a replay's: the ledger bounds those).
    hashes: usize,
}

/// What an operation's block hashes are charged to: [`MAX_QUEUED_BLOCK_HASHES`], or (a
/// replay's) the ledger's own bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Charge {
    Hashes,
    Replay,
}

/// The numbers handed out so far; held while an operation is performed and queued.
#[derive(Debug)]
struct Numbers {
    next_op: u64,
    next_dispatch: u64,
    /// The first number an operation took on the stream attached now (set as it attaches).
    stream_first: u64,
}

#[derive(Debug)]
pub struct DispatchReporter {
    tx: mpsc::Sender<Operation>,
    rx: Mutex<Option<Reports>>,
    numbers: Mutex<Numbers>,
    /// Whether a stream to the control plane is open to take the queue, and every operation
    /// since it opened is in the queue: otherwise operations are performed unnumbered.
    attached: Arc<AtomicBool>,
    /// Woken when an operation finds the queue full and detaches the stream.
    detached: Arc<Notify>,
    /// The block hashes the queued operations carry.
    queued_hashes: Arc<AtomicUsize>,
    dropped: IntCounter,
    /// What is reported again when a stream opens.
    in_flight: OnceLock<Arc<dyn InFlight>>,
}

/// The receiving end of the queue.
#[derive(Debug)]
pub struct Reports {
    rx: mpsc::Receiver<Operation>,
    attached: Arc<AtomicBool>,
    detached: Arc<Notify>,
    queued_hashes: Arc<AtomicUsize>,
}

/// What the fleet client waits on beside the queue, to end a stream as soon as its reports are
/// no longer whole (see [`Reports::detached`]).
#[derive(Debug, Clone)]
pub struct Detached {
    attached: Arc<AtomicBool>,
    detached: Arc<Notify>,
}

impl Detached {
    /// Resolves once an operation has found the queue full: the stream must end, whatever else
    /// it is waiting on (a send to a control plane that reads slowly, which is how the queue
    /// filled, may wait seconds).
    pub async fn wait(&self) {
        loop {
            // A wake-up given before this wait began is kept for it (`notify_one`), and one left
            // from an earlier stream finds this one still attached and waits again.
            if !self.attached.load(Ordering::Acquire) {
                return;
            }
            self.detached.notified().await;
        }
    }
}

impl Reports {
    /// Whether the stream still takes every operation: false once one found the queue full,
    /// and the stream must end.
    pub fn attached(&self) -> bool {
        self.attached.load(Ordering::Acquire)
    }

    /// A handle apart from the queue that resolves when the stream detaches.
    pub fn detached(&self) -> Detached {
        Detached { attached: Arc::clone(&self.attached), detached: Arc::clone(&self.detached) }
    }

    /// The next operation; cancel-safe.
    pub async fn recv(&mut self) -> Option<Operation> {
        let operation = self.rx.recv().await?;
        Some(self.taken(operation))
    }

    /// The next operation if one is queued.
    pub fn try_recv(&mut self) -> Option<Operation> {
        let operation = self.rx.try_recv().ok()?;
        Some(self.taken(operation))
    }

    /// `operation`, out of the queue and its hashes with it.
    fn taken(&self, operation: Operation) -> Operation {
        self.queued_hashes.fetch_sub(operation.hashes, Ordering::AcqRel);
        operation
    }
}

/// What an operation reports, while it is performed.
#[derive(Debug)]
pub struct Report<'a> {
    op: u64,
    /// The first operation number of the stream this one is reported on.
    stream_first: u64,
    /// The next dispatch id.
    next_dispatch: &'a mut u64,
    events: Vec<DispatchEvent>,
}

impl Report<'_> {
    /// The operation's number, to record it under: [`NOT_REPORTED`] when the queue has no
    /// room for it.
    pub fn op(&self) -> u64 {
        self.op
    }

    /// The operation as it changes a dispatch recorded earlier, perhaps on an earlier stream.
    pub fn change(&self) -> Op {
        Op { number: self.op, stream_first: self.stream_first }
    }

    /// The first operation number of the stream this operation is reported on.
    pub fn stream_first(&self) -> u64 {
        self.stream_first
    }

    /// Reports a leg of a dispatch in flight again, under the id its first report gave it (see
    /// [`InFlight`]), with its first token if it came.
    pub fn replayed(&mut self, leg: ReplayedLeg) {
        let mut block_hashes = leg.block_hashes;
        block_hashes.truncate(MAX_DISPATCH_BLOCK_HASHES);
        self.events.push(DispatchEvent::Started {
            id: leg.report,
            rank: leg.rank,
            prefill_tokens: leg.prefill_tokens,
            decode_blocks: leg.decode_blocks,
            block_hashes,
            lookup: 0,
            replayed_age_ms: Some(u64::try_from(leg.age.as_millis()).unwrap_or(u64::MAX)),
            buffered: leg.buffered,
            may_stall: leg.may_stall,
        });
        if leg.answered {
            self.events.push(DispatchEvent::Prefilled(leg.report));
        }
    }

    /// Reports a dispatch pinned to `rank`, whose prompt hashes to `block_hashes` (empty when
    /// unknown; cut to [`MAX_DISPATCH_BLOCK_HASHES`]): the control plane credits that prefix
    /// to the rank provisionally, fleet-wide, and counts decode blocks dispatches share once.
    /// Returns its id for [`Report::ended`].
    pub fn started(
        &mut self,
        rank: &LoadKey,
        prefill_tokens: u64,
        decode_blocks: u64,
        mut block_hashes: Vec<u64>,
    ) -> u64 {
        let id = *self.next_dispatch;
        *self.next_dispatch += 1;
        block_hashes.truncate(MAX_DISPATCH_BLOCK_HASHES);
        self.events.push(DispatchEvent::Started {
            id,
            rank: rank.clone(),
            prefill_tokens,
            decode_blocks,
            block_hashes,
            lookup: 0,
            replayed_age_ms: None,
            buffered: false,
            may_stall: false,
        });
        id
    }

    /// Dispatch `id`, started in this operation, prefills a request for which this replica
    /// made its lookup number `lookup`: the report tells the control plane which rank that
    /// lookup's request went to.
    pub fn prefills_for_lookup(&mut self, id: u64, lookup: u64) {
        if let Some(DispatchEvent::Started { lookup: at, .. }) = self.started_event(id) {
            *at = lookup;
        }
    }

    /// Dispatch `id`, started in this operation, answers its client whole (`stream` false):
    /// this replica will see no first token to report, only the end, and the control plane
    /// takes its prompt as prefilled by the rank's prefill times instead.
    pub fn buffered(&mut self, id: u64) {
        if let Some(DispatchEvent::Started { buffered, .. }) = self.started_event(id) {
            *buffered = true;
        }
    }

    /// Dispatch `id`, started in this operation, reaches its rank at once and is large enough
    /// to stall it ([`pb::DispatchStarted::may_stall`]).
    pub fn may_stall(&mut self, id: u64) {
        if let Some(DispatchEvent::Started { may_stall, .. }) = self.started_event(id) {
            *may_stall = true;
        }
    }

    fn started_event(&mut self, id: u64) -> Option<&mut DispatchEvent> {
        self.events
            .iter_mut()
            .rev()
            .find(|event| matches!(event, DispatchEvent::Started { id: started, .. } if *started == id))
    }

    pub fn ended(&mut self, id: u64) {
        self.events.push(DispatchEvent::Ended(id));
    }

    /// The dispatch's response began: its prompt is prefilled.
    pub fn prefilled(&mut self, id: u64) {
        self.events.push(DispatchEvent::Prefilled(id));
    }
}

impl DispatchReporter {
    pub fn new(dropped: IntCounter) -> Self {
        let (tx, rx) = mpsc::channel(REPORT_QUEUE);
        let numbers = Numbers { next_op: 1, next_dispatch: 1, stream_first: 1 };
        let (attached, detached, queued_hashes) = (Arc::default(), Arc::default(), Arc::default());
        let reports = Reports {
            rx,
            attached: Arc::clone(&attached),
            detached: Arc::clone(&detached),
            queued_hashes: Arc::clone(&queued_hashes),
        };
        let (rx, numbers, in_flight) = (Mutex::new(Some(reports)), Mutex::new(numbers), OnceLock::new());
        Self { tx, rx, numbers, attached, detached, queued_hashes, dropped, in_flight }
    }

    /// Reports `in_flight`'s dispatches again whenever a stream opens (set once; later calls
    /// change nothing).
    pub fn replay_from(&self, in_flight: Arc<dyn InFlight>) {
        let _ = self.in_flight.set(in_flight);
    }

    /// Performs one operation: `perform` records it under its number ([`Report::op`]) and says
    /// what it reports; then it is queued whole. One operation at a time, so the queue holds
    /// them in number order, and a record `perform` keeps (the ledger's) in the same order.
    /// Its place in the queue is taken first: an operation the queue has no room for is
    /// performed unnumbered, so the record knows the fleet's sums will never hold it.
    pub fn operation<R>(&self, perform: impl FnOnce(&mut Report<'_>) -> R) -> R {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        if !self.attached.load(Ordering::Acquire) {
            // No stream, or one whose reports are no longer whole and is ending: nothing is
            // reported on it, and the next stream reports again what is in flight.
            let mut report = Report {
                op: NOT_REPORTED,
                stream_first: numbers.stream_first,
                next_dispatch: &mut numbers.next_dispatch,
                events: Vec::new(),
            };
            return perform(&mut report);
        }
        self.numbered(&mut numbers, Charge::Hashes, perform)
    }

    /// Performs one operation under the next number, and queues it whole (see
    /// [`Self::operation`]); the caller holds the numbers.
    fn numbered<R>(&self, numbers: &mut Numbers, charge: Charge, perform: impl FnOnce(&mut Report<'_>) -> R) -> R {
        let room = charge == Charge::Replay
            || self.queued_hashes.load(Ordering::Acquire) + MAX_OPERATION_HASHES <= MAX_QUEUED_BLOCK_HASHES;
        let place = self.tx.try_reserve().ok().filter(|_| room).ok_or(());
        if place.is_err() {
            // The stream's reports can no longer be whole: detached at once, while the queue the
            // fleet client will read it beside is still full, until the next stream replays
            // what is in flight.
            self.dropped.inc();
            self.attached.store(false, Ordering::Release);
            self.detached.notify_one();
        }
        let op = if place.is_ok() { numbers.next_op } else { NOT_REPORTED };
        let mut report = Report {
            op,
            stream_first: numbers.stream_first,
            next_dispatch: &mut numbers.next_dispatch,
            events: Vec::with_capacity(2),
        };
        let result = perform(&mut report);
        let Report { events, .. } = report;
        if let Ok(place) = place {
            numbers.next_op += 1;
            // An operation that reports nothing gives its place back.
            if !events.is_empty() {
                let hashes = match charge {
                    Charge::Hashes => events.iter().map(DispatchEvent::hashes).sum(),
                    Charge::Replay => 0,
                };
                self.queued_hashes.fetch_add(hashes, Ordering::AcqRel);
                place.send(Operation { number: op, events, hashes });
            }
        }
        result
    }

    /// A stream is open: operations are queued for it from now on, numbered from the next.
    /// What queued before is discarded: the control plane forgot this replica's dispatches when
    /// its last session ended, so ends for them would name nothing. Instead, every dispatch in
    /// flight it does not hold is reported again ([`InFlight`]), in as many operations as it
    /// takes, before any other operation takes a number on the stream, so the control plane
    /// counts what was sent before it (re)started, and the ledger's legs stay in number order.
    /// Returns how many legs were reported again.
    pub(crate) fn attach(&self, reports: &mut Reports) -> usize {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        discard(reports);
        self.attached.store(true, Ordering::Release);
        numbers.stream_first = numbers.next_op;
        let Some(in_flight) = self.in_flight.get() else { return 0 };
        let ids = in_flight.to_replay(numbers.stream_first);
        let (mut left, mut legs) = (&ids[..], 0);
        while !left.is_empty() {
            let chunk = &left[..left.len().min(MAX_REPLAYED_PER_OPERATION)];
            let (taken, replayed) =
                self.numbered(&mut numbers, Charge::Replay, |report| in_flight.replay(chunk, report));
            left = &left[taken.clamp(1, chunk.len())..];
            legs += replayed;
        }
        legs
    }

    /// The receiving end, for the fleet client (taken once).
    pub(crate) fn take_receiver(&self) -> Option<Reports> {
        self.rx.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// The receiving end with a stream attached, as the fleet client holds it once connected.
    #[cfg(test)]
    pub(crate) fn attached_receiver(&self) -> Option<Reports> {
        let mut reports = self.take_receiver()?;
        self.attach(&mut reports);
        Some(reports)
    }
}

/// Folds `first` and whatever else is queued (up to the batch bound, in whole operations) into
/// one report. Past half of [`MAX_REPORT_BLOCK_HASHES`] the report
/// takes no more operations, so the next (at most half of it: two chains of 4,096, or a
/// replay operation's [`MAX_REPLAYED_HASHES`]) always fits; should one not, its dispatches go
/// without their block hashes: the backlog still counts them, only their shared blocks and
/// provisional credit are lost.
pub(crate) fn batch(first: Operation, reports: &mut Reports) -> pb::DispatchReport {
    let mut report = pb::DispatchReport { first_op: first.number, ..pb::DispatchReport::default() };
    // Each rank's place in `report.ranks`, which names it once for all its starts.
    let mut ranks: FastMap<LoadKey, u32> = FastMap::default();
    let mut hashes_left = MAX_REPORT_BLOCK_HASHES;
    let mut events = 0;
    let mut next = Some(first);
    while let Some(operation) = next.take() {
        report.last_op = operation.number;
        events += operation.events.len();
        for event in operation.events {
            match event {
                DispatchEvent::Started {
                    id,
                    rank,
                    prefill_tokens,
                    decode_blocks,
                    mut block_hashes,
                    lookup,
                    replayed_age_ms,
                    buffered,
                    may_stall,
                } => {
                    if block_hashes.len() > hashes_left {
                        block_hashes = Vec::new();
                    }
                    hashes_left -= block_hashes.len();
                    let rank_index = *ranks.entry(rank).or_insert_with_key(|rank| {
                        report.ranks.push(rank.into());
                        // At most one rank for each start, and a report's starts are bounded.
                        u32::try_from(report.ranks.len() - 1).unwrap_or(u32::MAX)
                    });
                    report.started.push(pb::DispatchStarted {
                        id,
                        rank: None,
                        rank_index,
                        prefill_tokens,
                        decode_blocks,
                        block_hashes,
                        lookup,
                        replayed: replayed_age_ms.is_some(),
                        age_ms: replayed_age_ms.unwrap_or(0),
                        after_prefilled: u32::try_from(report.prefilled.len()).unwrap_or(u32::MAX),
                        after_ended: u32::try_from(report.ended.len()).unwrap_or(u32::MAX),
                        buffered,
                        may_stall,
                    });
                }
                DispatchEvent::Ended(id) => report.ended.push(id),
                DispatchEvent::Prefilled(id) => report.prefilled.push(id),
            }
        }
        // Past half its hashes a report takes no more operations: the next one's (at most
        // half, replayed or not) always fits.
        if events < MAX_REPORT_BATCH && hashes_left >= MAX_REPORT_BLOCK_HASHES / 2 {
            next = reports.try_recv();
        }
    }
    report
}

/// The stream ended: operations are performed unnumbered until the next one opens, and what
/// is queued is discarded.
pub(crate) fn detach(reports: &mut Reports) {
    reports.attached.store(false, Ordering::Release);
    discard(reports);
}

fn discard(reports: &mut Reports) {
    while reports.try_recv().is_some() {}
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use continuum_proto::model::WorkerKey;

    use super::*;

    fn rank() -> LoadKey {
        LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 }
    }

    fn reporter() -> (DispatchReporter, Reports) {
        let reporter = DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter"));
        let rx = reporter.attached_receiver().expect("receiver");
        (reporter, rx)
    }

    fn start(reporter: &DispatchReporter, prefill_tokens: u64, decode_blocks: u64, hashes: Vec<u64>) -> u64 {
        reporter.operation(|report| report.started(&rank(), prefill_tokens, decode_blocks, hashes))
    }

    fn next_report(rx: &mut Reports) -> pb::DispatchReport {
        let first = rx.try_recv().expect("queued");
        batch(first, rx)
    }

    #[test]
    fn a_dispatch_carries_at_most_its_bound_of_block_hashes() {
        let (reporter, mut rx) = reporter();
        start(&reporter, 64, 0, (0..MAX_DISPATCH_BLOCK_HASHES as u64 + 9).collect());
        let report = next_report(&mut rx);
        assert_eq!(report.started[0].block_hashes.len(), MAX_DISPATCH_BLOCK_HASHES);
        assert_eq!(report.started[0].block_hashes[..3], [0, 1, 2], "the chain is cut at its end");
    }

    #[test]
    fn a_report_takes_no_more_operations_past_half_its_hashes_so_no_chain_is_dropped() {
        let (reporter, mut rx) = reporter();
        let per = MAX_DISPATCH_BLOCK_HASHES;
        let fit = MAX_REPORT_BLOCK_HASHES / per;
        for _ in 0..=fit {
            start(&reporter, 64, 0, vec![1; per]);
        }
        start(&reporter, 0, 4, Vec::new());
        let mut carried: Vec<Vec<usize>> = Vec::new();
        while let Some(first) = rx.try_recv() {
            carried.push(batch(first, &mut rx).started.iter().map(|s| s.block_hashes.len()).collect());
        }
        // Nine chains of 4,096 pass half of 65,536: the report closes, the next takes the rest.
        let half = MAX_REPORT_BLOCK_HASHES / 2 / per + 1;
        assert_eq!(carried.iter().map(Vec::len).collect::<Vec<_>>(), [half, fit + 2 - half]);
        assert_eq!(carried.concat().iter().sum::<usize>(), (fit + 1) * per, "every chain carried whole");
    }

    #[test]
    fn operations_are_numbered_in_order_and_a_report_never_splits_one() {
        let (reporter, mut rx) = reporter();
        // Operation 1 starts a pair's two legs; the operations after it start and end one each.
        let (numbered, ids) = reporter.operation(|report| {
            let ids = (report.started(&rank(), 64, 0, Vec::new()), report.started(&rank(), 0, 4, Vec::new()));
            (report.op(), ids)
        });
        assert_eq!(numbered, 1);
        // MAX_REPORT_BATCH - 1 events so far, then two more in one operation: past the bound.
        for _ in 0..MAX_REPORT_BATCH - 3 {
            start(&reporter, 16, 1, Vec::new());
        }
        let last = reporter.operation(|report| {
            report.ended(ids.0);
            report.ended(ids.1);
            report.op()
        });
        start(&reporter, 16, 1, Vec::new());

        let report = next_report(&mut rx);
        assert_eq!((report.first_op, report.last_op), (1, last), "the ending pair went whole");
        assert_eq!(report.started.len() + report.ended.len(), MAX_REPORT_BATCH + 1);
        assert_eq!(report.ended, [ids.0, ids.1]);
        let rest = next_report(&mut rx);
        assert_eq!((rest.first_op, rest.last_op), (last + 1, last + 1));
    }

    /// A report names each rank once, in `ranks`, and each start names its rank by its place
    /// there: a thousand dispatches to four ranks carry four keys.
    #[test]
    fn a_report_names_each_rank_once_and_its_starts_by_their_place() {
        let (reporter, mut rx) = reporter();
        let other = LoadKey { worker: WorkerKey::new("other", 9), dp_rank: 1 };
        for rank in [rank(), other.clone(), rank(), rank(), other.clone()] {
            reporter.operation(|report| report.started(&rank, 64, 0, Vec::new()));
        }
        let report = next_report(&mut rx);
        assert_eq!(report.ranks, [pb::LoadKey::from(&rank()), pb::LoadKey::from(&other)]);
        assert!(report.started.iter().all(|started| started.rank.is_none()), "no start carries its key");
        let named: Vec<Option<LoadKey>> = report
            .started
            .iter()
            .map(|started| started.rank_in(&report.ranks).cloned().and_then(|key| key.try_into().ok()))
            .collect();
        assert_eq!(named, [rank(), other.clone(), rank(), rank(), other].map(Some));
        let second = {
            reporter.operation(|report| report.started(&rank(), 64, 0, Vec::new()));
            next_report(&mut rx)
        };
        assert_eq!(second.ranks.len(), 1, "each report's table is its own");
        assert_eq!(second.started[0].rank_index, 0);
    }

    /// Each start says how many of the report's first tokens and ends came before it, so the
    /// control plane folds them in the order they happened.
    #[test]
    fn a_start_counts_the_first_tokens_and_ends_performed_before_it() {
        let (reporter, mut rx) = reporter();
        let first = start(&reporter, 64, 0, Vec::new());
        let second = start(&reporter, 64, 0, Vec::new());
        reporter.operation(|report| report.prefilled(first));
        start(&reporter, 64, 0, Vec::new());
        reporter.operation(|report| report.ended(second));
        reporter.operation(|report| report.ended(first));
        start(&reporter, 64, 0, Vec::new());
        let report = next_report(&mut rx);
        let order: Vec<(u32, u32)> = report.started.iter().map(|s| (s.after_prefilled, s.after_ended)).collect();
        assert_eq!(order, [(0, 0), (0, 0), (1, 0), (1, 2)]);
    }

    /// A queue that holds its share of block hashes is full however few operations it holds:
    /// chains waiting on a control plane that reads slowly take tens of megabytes, not half a
    /// gigabyte. What is taken out of it gives its hashes back.
    #[test]
    fn a_queue_holding_its_share_of_block_hashes_is_full() {
        let (reporter, mut rx) = reporter();
        let chain = || (0..MAX_DISPATCH_BLOCK_HASHES as u64).collect::<Vec<_>>();
        start(&reporter, 16, 1, chain());
        let first = rx.try_recv().expect("queued");
        assert_eq!(reporter.queued_hashes.load(Ordering::Acquire), 0, "taken out, its hashes with it");
        let mut queued = 0;
        while rx.attached() {
            start(&reporter, 16, 1, chain());
            queued += 1;
        }
        assert!(queued * MAX_DISPATCH_BLOCK_HASHES <= MAX_QUEUED_BLOCK_HASHES, "{queued} chains queued");
        assert!(queued < REPORT_QUEUE / 4, "full on hashes, not operations ({queued})");
        assert_eq!(reporter.dropped.get(), 1);
        drop(first);
        reporter.attach(&mut rx);
        assert!(rx.attached());
        assert_eq!(reporter.queued_hashes.load(Ordering::Acquire), 0, "a new stream starts empty");
    }

    #[test]
    fn an_operation_the_queue_has_no_room_for_goes_unnumbered_counted_and_detaches_the_stream() {
        let (reporter, mut rx) = reporter();
        let started = start(&reporter, 16, 1, Vec::new());
        for _ in 1..REPORT_QUEUE {
            start(&reporter, 16, 1, Vec::new());
        }
        assert!(rx.attached());
        // The fleet client waits on the stream beside its queue (a send that may take seconds).
        let detached = rx.detached();
        let mut waiting = std::pin::pin!(detached.wait());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waiting.as_mut().poll(&mut cx).is_pending(), "full, but every operation queued");
        let op = reporter.operation(|report| {
            report.ended(started);
            report.op()
        });
        assert_eq!(op, NOT_REPORTED, "a full queue");
        assert_eq!(reporter.dropped.get(), 1);
        assert!(waiting.as_mut().poll(&mut cx).is_ready(), "the waiting client is woken at once");
        // The end is lost to this stream, which must end: the next one replays what is in
        // flight, so no start it held waits for an end that never comes.
        assert!(!rx.attached(), "the stream's reports are no longer whole");
        assert_eq!(start_op(&reporter), NOT_REPORTED, "nothing more is numbered on it");
        assert_eq!(reporter.dropped.get(), 1, "nor counted as dropped: nothing was sent");
        reporter.attach(&mut rx);
        assert!(rx.attached());
        assert!(rx.try_recv().is_none(), "the old stream's queue went with it");
        assert_eq!(start_op(&reporter), REPORT_QUEUE as u64 + 1, "numbers stay consecutive over what was dropped");
    }

    #[test]
    fn without_a_stream_operations_go_unnumbered_and_queue_nothing() {
        let reporter = DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter"));
        let mut rx = reporter.take_receiver().expect("receiver");
        for _ in 0..REPORT_QUEUE * 2 {
            let op = reporter.operation(|report| {
                report.started(&rank(), 16, 1, vec![7; MAX_DISPATCH_BLOCK_HASHES]);
                report.op()
            });
            assert_eq!(op, NOT_REPORTED);
        }
        assert!(rx.try_recv().is_none(), "nothing held for a stream that is not there");
        assert_eq!(reporter.dropped.get(), 0, "not counted as dropped: there was nowhere to send it");
        reporter.attach(&mut rx);
        assert_eq!(start_op(&reporter), 1, "numbered from where the numbers stood");
        detach(&mut rx);
        assert!(rx.try_recv().is_none(), "what was queued for the stream that ended is gone");
        assert_eq!(start_op(&reporter), NOT_REPORTED);
    }

    fn start_op(reporter: &DispatchReporter) -> u64 {
        reporter.operation(|report| {
            report.started(&rank(), 16, 1, Vec::new());
            report.op()
        })
    }

    #[test]
    fn an_operation_that_reports_nothing_still_takes_its_number() {
        let (reporter, mut rx) = reporter();
        assert_eq!(reporter.operation(|report| report.op()), 1);
        start(&reporter, 16, 1, Vec::new());
        let report = next_report(&mut rx);
        assert_eq!((report.first_op, report.last_op), (2, 2));
        assert!(rx.try_recv().is_none(), "the silent operation queued nothing");
    }

    #[test]
    fn each_operation_knows_the_first_number_of_the_stream_it_is_reported_on() {
        let (reporter, mut rx) = reporter();
        let change = |reporter: &DispatchReporter| reporter.operation(|report| report.change());
        start(&reporter, 16, 1, Vec::new());
        assert_eq!(change(&reporter), Op { number: 2, stream_first: 1 });
        // The stream is lost and another opens, with no operation in between: the next
        // operation still starts the new stream's numbers.
        detach(&mut rx);
        reporter.attach(&mut rx);
        assert_eq!(change(&reporter), Op { number: 3, stream_first: 3 });
        assert_eq!(change(&reporter), Op { number: 4, stream_first: 3 });
        // While detached, operations go unnumbered, and the next stream starts past them.
        detach(&mut rx);
        assert_eq!(change(&reporter).number, NOT_REPORTED);
        reporter.attach(&mut rx);
        assert_eq!(change(&reporter), Op { number: 5, stream_first: 5 });
    }
}
