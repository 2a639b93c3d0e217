//! Ties one pinned dispatch's accounting to the life of its request: this replica's
//! [`DispatchLedger`] (read by its picker at once) and the [`DispatchReporter`] (folded by the
//! control plane into the fleet-wide backlogs every replica's picker reads). Each step is one
//! reported operation, recorded in the ledger under its number, so the picker can tell exactly
//! which of its own steps the fleet's sums hold. Lock order: the reporter's, then the ledger's.

use std::sync::Arc;
use std::time::Instant;

use continuum_proto::model::LoadKey;
use continuum_proto::view::FleetView;
use continuum_proto::{MAX_REPORTED_PREFILL_TOKENS, STALL_MIN_BLOCKS};

use crate::fleet::{DispatchReporter, InFlight, MAX_REPLAYED_HASHES, Report};
use crate::routing::picker::{
    DispatchId, DispatchLedger, Few, Pin, PromptChain, Recorded, Selection, dispatch_block_size, pin_block_size,
    reported_blocks, usage_prompt_tokens,
};

/// Ends its dispatch in the ledger and reports the end when dropped: when the response body
/// completes, the request is refused or fails, or the client goes away mid-response.
#[derive(Debug)]
pub struct DispatchEnd {
    ledger: Arc<DispatchLedger>,
    id: DispatchId,
    reporter: Arc<DispatchReporter>,
    /// Reported legs: the prefill rank's (if any) and the decode rank's.
    reported: [Option<u64>; 2],
    /// The pinned ranks, the prefill rank's (if any) and the decode rank's: what its outcome
    /// blames or acquits, however long it ran (the ledger lets a dispatch go once it has been
    /// unanswered for its bound, and a stream may run for minutes).
    ranks: [Option<LoadKey>; 2],
    prefilled: bool,
    /// When it was recorded, as good as sent: what a silent stream's ranks must have answered
    /// something since, to be spared.
    sent: Instant,
    /// What the prompt was sized by, until its answer states the tokens the model counted;
    /// `None` when the prompt was tokenized. Boxed, to keep every request's future small.
    estimated: Option<Box<Estimated>>,
}

/// A prompt sized by the load-only estimate, for calibrating the model's [`PromptSizes`](crate::routing::picker::PromptSizes).
#[derive(Debug)]
struct Estimated {
    model: Box<str>,
    tokens: u64,
}

/// A prompt no longer than a pinned worker's context (which refuses a longer one, however the
/// estimate sized it) nor than the control plane takes: counted at most whole, here and in the
/// report, as the control plane counts it.
fn at_most_whole(view: &FleetView, selection: &Selection, prompt_tokens: u64) -> u64 {
    let pins = selection.prefill.iter().chain(std::iter::once(&selection.decode));
    let contexts = pins.filter_map(|pin| view.worker(&pin.worker)?.capacity.context_length.filter(|n| *n > 0));
    contexts.fold(prompt_tokens.min(MAX_REPORTED_PREFILL_TOKENS), u64::min)
}

impl DispatchEnd {
    /// Records a dispatch of `prompt_tokens` pinned as `selection`: the prompt tokens the rank
    /// that prefills it does not hold, and its blocks on the decode rank, as the ledger counts
    /// them. The prompt's `chain` (empty without the KV term) goes with each pin, at that
    /// worker's block size: the control plane credits it to the rank provisionally (a decode
    /// worker keeps the KV it receives, as a prefilling rank keeps what it computes) and, on
    /// the rank that decodes, counts blocks its requests share once. A `buffered` request (its
    /// client asked for the answer whole) is reported as such: this replica will see its end
    /// but no first token.
    pub fn record(
        ledger: &Arc<DispatchLedger>,
        reporter: &Arc<DispatchReporter>,
        view: &FleetView,
        selection: &Selection,
        prompt_tokens: u64,
        chain: &PromptChain,
        buffered: bool,
    ) -> Self {
        let prompt_tokens = at_most_whole(view, selection, prompt_tokens);
        let block_size = dispatch_block_size(view, selection);
        let hashes = chain.at_block_size(block_size);
        let blocks = reported_blocks(prompt_tokens, block_size);
        let tokens = selection.uncached_prompt_tokens(prompt_tokens);
        let sent = Instant::now();
        let (id, reported) = reporter.operation(|report| {
            let prefill = selection.prefill.as_ref().map(|pin| {
                report.started(&pin.rank_key(), tokens, 0, chain.at_block_size(pin_block_size(view, pin)).to_vec())
            });
            // Without a prefill pin the decode rank prefills the request itself.
            let decode_tokens = if prefill.is_some() { 0 } else { tokens };
            let decode = report.started(&selection.decode.rank_key(), decode_tokens, blocks, hashes.to_vec());
            if chain.lookup != 0 {
                report.prefills_for_lookup(prefill.unwrap_or(decode), chain.lookup);
            }
            if buffered {
                // The leg whose prompt waits on a first token; the decode leg of a pair has none.
                report.buffered(prefill.unwrap_or(decode));
            }
            if blocks >= STALL_MIN_BLOCKS {
                // As the ledger counts stalls: on the rank that receives the request at once.
                report.may_stall(prefill.unwrap_or(decode));
            }
            // The ledger's legs, prefill rank's first, keep their report ids for a replay.
            let legs = match prefill {
                Some(prefill) => [prefill, decode],
                None => [decode, 0],
            };
            let recorded = Recorded { op: report.op(), legs, buffered };
            let id = ledger.record(selection, prompt_tokens, block_size, hashes, sent, recorded);
            (id, [prefill, Some(decode)])
        });
        Self {
            ledger: Arc::clone(ledger),
            id,
            reporter: Arc::clone(reporter),
            reported,
            ranks: [selection.prefill.as_ref().map(Pin::rank_key), Some(selection.decode.rank_key())],
            prefilled: false,
            sent,
            estimated: None,
        }
    }

    /// The prompt was sized by the load-only `estimate` for `model`: its answer's usage
    /// calibrates later estimates.
    pub fn sized_by_estimate(&mut self, model: &str, estimate: u64) {
        self.estimated = Some(Box::new(Estimated { model: model.into(), tokens: estimate }));
    }

    /// Part or all of the answer's body: the first `usage.prompt_tokens` in it teaches the
    /// ledger's [`PromptSizes`](crate::routing::picker::PromptSizes) how far the estimate was off.
    pub fn observe(&mut self, body: &[u8]) {
        let Some(estimated) = &self.estimated else {
            return;
        };
        if let Some(counted) = usage_prompt_tokens(body) {
            self.ledger.prompt_sizes().learn(&estimated.model, estimated.tokens, counted);
            self.estimated = None;
        }
    }

    /// The response began (its first token): the prompt no longer loads the rank that
    /// prefilled it. A prefill worker's leg is over then (one report says it prefilled, so the
    /// control plane learns the rank's prefill time, and ends it); the rank that decodes keeps
    /// its blocks until the end. Only the first call counts.
    pub fn prefilled(&mut self) {
        if std::mem::replace(&mut self.prefilled, true) {
            return;
        }
        // Its workers answer: a timeout of a request sent before now says nothing of them.
        let now = Instant::now();
        self.ledger.outliers().answered(self.ranks.iter().flatten(), now);
        let [prefill, decode] = &mut self.reported;
        self.reporter.operation(|report| {
            self.ledger.prefilled(self.id, now, report.change());
            if let Some(id) = prefill.take() {
                report.prefilled(id);
                report.ended(id);
            }
            if let Some(id) = decode {
                report.prefilled(*id);
            }
        });
    }
}

impl DispatchEnd {
    /// The ledger the dispatch is recorded in (and whose outlier record its outcome feeds).
    pub fn ledger(&self) -> &Arc<DispatchLedger> {
        &self.ledger
    }

    /// Its answer broke off (a stream that failed after its head): its workers are suspects,
    /// as for a buffered answer whose body broke. Once its first token came, the prefill
    /// worker's leg is proven done: only the rank decoding it is a suspect (one dead decode
    /// worker would otherwise eject every prefill rank that paired with it); before, of the
    /// pair, the rank that answered nothing else since it was sent ([`Outliers::failed_since`]).
    ///
    /// [`Outliers::failed_since`]: crate::routing::picker::Outliers::failed_since
    pub fn blame(&self) {
        self.ledger.outliers().failed_since(&self.owing(), self.sent, Instant::now());
    }

    /// Its stream went silent for its idle timeout, its last event (if any) `last_event`: as
    /// for a head that never came, a failure only of the ranks still owing an answer that
    /// answered nothing else since (a prompt merely long, or a burst timing out together on a
    /// busy rank, must not eject a rank that serves other requests meanwhile).
    pub fn timed_out(&self, last_event: Option<Instant>) {
        let since = last_event.unwrap_or(self.sent);
        self.ledger.outliers().failed_unless_answering(&self.owing(), since, Instant::now());
    }

    /// The ranks its answer still waits on: both until its first token, then the decode rank.
    fn owing(&self) -> Few<LoadKey> {
        let [prefill, decode] = &self.ranks;
        let prefill = prefill.as_ref().filter(|_| !self.prefilled);
        prefill.into_iter().chain(decode).cloned().collect()
    }

    /// Its answer ended whole (a stream that finished): its workers' failures start over.
    pub fn acquit(&self) {
        self.ledger.outliers().succeeded(self.ranks.iter().flatten(), Instant::now());
    }
}

/// The ledger's dispatches are what a new stream reports again.
impl InFlight for DispatchLedger {
    fn to_replay(&self, stream_first: u64) -> Vec<DispatchId> {
        self.dispatches_before(stream_first)
    }

    fn replay(&self, ids: &[DispatchId], report: &mut Report<'_>) -> (usize, usize) {
        let (op, stream_first) = (report.op(), report.stream_first());
        let (taken, legs) = self.replay_legs(ids, MAX_REPLAYED_HASHES, op, stream_first, Instant::now());
        let replayed = legs.len();
        for leg in legs {
            report.replayed(leg);
        }
        (taken, replayed)
    }
}

impl Drop for DispatchEnd {
    fn drop(&mut self) {
        self.reporter.operation(|report| {
            self.ledger.end(self.id, Instant::now(), report.change());
            for id in self.reported.iter().flatten() {
                report.ended(*id);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use continuum_proto::MAX_REPORTED_DECODE_BLOCKS;
    use continuum_proto::model::{DataPlaneConfig, WorkerKey};
    use prometheus::IntCounter;

    use super::*;
    use crate::fleet::batch;
    use crate::routing::picker::{Pin, Reason};

    /// An estimate past a pinned worker's context (which refuses such a prompt) counts at most
    /// that context, in the ledger and in the report; with no context known, at most what the
    /// control plane takes.
    #[tokio::test]
    async fn a_prompt_is_counted_at_most_as_long_as_the_pinned_workers_take() {
        use continuum_proto::model::{Capacity, Role, Worker};
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let mut rx = reporter.attached_receiver().expect("receiver");
        let ledger = Arc::new(DispatchLedger::new());
        let worker = |id, role, context_length| {
            Arc::new(Worker {
                key: WorkerKey::new("dynamo", id),
                role,
                model: "tiny".into(),
                component: "backend".into(),
                endpoint: "generate".into(),
                // Worker 3's blocks are small: its longest prompt has more than the control
                // plane takes from one start.
                block_size: Some(if id == 3 { 8 } else { 16 }),
                capacity: Capacity { context_length, ..Capacity::default() },
                dp_start_rank: 0,
                dp_size: 0,
                disaggregated_endpoint: None,
                artifacts: None,
            })
        };
        let pin = |id| Pin { worker: WorkerKey::new("dynamo", id), dp_rank: None };
        let selection = |prefill: Option<u64>, decode| Selection {
            namespace: "dynamo".into(),
            model: "tiny".into(),
            decode: pin(decode),
            prefill: prefill.map(pin),
            decode_reason: Reason::Load,
            prefill_reason: Reason::Load,
            cached_tokens: 0,
        };
        let workers = [
            worker(1, Role::Prefill, Some(8192)),
            worker(2, Role::Decode, Some(4096)),
            worker(3, Role::Aggregated, None),
        ];
        let view = FleetView::new(1, workers, [], Arc::new(DataPlaneConfig::default())).expect("view");
        let mut reported = |selection: &Selection| {
            let _end =
                DispatchEnd::record(&ledger, &reporter, &view, selection, 50_000_000, &PromptChain::default(), false);
            let first = rx.try_recv().expect("an operation");
            let started = batch(first, &mut rx).started;
            started.iter().map(|s| (s.prefill_tokens, s.decode_blocks)).collect::<Vec<_>>()
        };
        assert_eq!(reported(&selection(Some(1), 2)), [(4096, 0), (0, 256)], "the shorter context of the pair");
        let unknown = reported(&selection(None, 3));
        assert_eq!(unknown, [(MAX_REPORTED_PREFILL_TOKENS, MAX_REPORTED_DECODE_BLOCKS)]);
        // And the ledger holds what the report said: a replay says it again, not more.
        let held = DispatchEnd::record(
            &ledger,
            &reporter,
            &view,
            &selection(None, 3),
            50_000_000,
            &PromptChain::default(),
            false,
        );
        let ids = ledger.dispatches_before(u64::MAX);
        let (_, legs) = ledger.replay_legs(&ids, usize::MAX, 1000, u64::MAX, Instant::now());
        assert!(!legs.is_empty());
        for leg in legs {
            assert!(leg.decode_blocks <= MAX_REPORTED_DECODE_BLOCKS, "{leg:?}");
            assert!(leg.prefill_tokens <= MAX_REPORTED_PREFILL_TOKENS, "{leg:?}");
        }
        drop(held);
    }

    /// A paired dispatch's prefill leg is reported as prefilled, then ended, at the first token:
    /// the control plane learns the prefill worker's prefill time from it (and when its next
    /// prefill may begin), which an end alone does not tell.
    #[tokio::test]
    async fn a_prefill_leg_is_reported_prefilled_then_ended_at_the_first_token() {
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let mut rx = reporter.attached_receiver().expect("receiver");
        let ledger = Arc::new(DispatchLedger::new());
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let pin = |id| Pin { worker: WorkerKey::new("dynamo", id), dp_rank: None };
        let selection = Selection {
            namespace: "dynamo".into(),
            model: "tiny".into(),
            decode: pin(2),
            prefill: Some(pin(1)),
            decode_reason: Reason::Load,
            prefill_reason: Reason::Load,
            cached_tokens: 0,
        };
        // Each step's report, folded alone.
        let mut next = || {
            let first = rx.try_recv().expect("an operation");
            batch(first, &mut rx)
        };
        let chain = PromptChain { lookup: 42, ..PromptChain::default() };
        let mut end = DispatchEnd::record(&ledger, &reporter, &view, &selection, 160, &chain, false);
        let started = next();
        end.prefilled();
        let prefilled = next();
        drop(end);
        let ended = next();
        let legs: Vec<(u64, u64)> = started.started.iter().map(|s| (s.id, s.prefill_tokens)).collect();
        let [(prefill_leg, 160), (decode_leg, 0)] = legs.as_slice() else { panic!("two legs: {legs:?}") };
        assert_eq!(prefilled.prefilled, [*prefill_leg, *decode_leg], "both legs' first token");
        assert_eq!(prefilled.ended, [*prefill_leg], "and the prefill leg is over");
        assert_eq!(ended.ended, [*decode_leg]);
        let lookups: Vec<u64> = started.started.iter().map(|s| s.lookup).collect();
        assert_eq!(lookups, [42, 0], "the leg that prefills names the lookup that scored the pick");

        // Without a prefill pin the decode rank prefills, and its leg names the lookup.
        let aggregated = Selection { prefill: None, prefill_reason: Reason::NoPrefillPool, ..selection };
        let _end = DispatchEnd::record(&ledger, &reporter, &view, &aggregated, 160, &chain, false);
        let lookups: Vec<u64> = next().started.iter().map(|s| s.lookup).collect();
        assert_eq!(lookups, [42]);
    }

    /// A stream that breaks after its first token blames only the rank decoding it; one that
    /// breaks before blames both its workers.
    #[tokio::test]
    async fn after_the_first_token_a_broken_stream_blames_only_its_decode_rank() {
        use std::time::Duration;

        use crate::routing::picker::{EJECT_AFTER, UNANSWERED_FOR};
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let _rx = reporter.attached_receiver().expect("receiver");
        let ledger = Arc::new(DispatchLedger::new());
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let pin = |id| Pin { worker: WorkerKey::new("dynamo", id), dp_rank: None };
        let paired = |prefill, decode| Selection {
            namespace: "dynamo".into(),
            model: "tiny".into(),
            decode: pin(decode),
            prefill: Some(pin(prefill)),
            decode_reason: Reason::Load,
            prefill_reason: Reason::Load,
            cached_tokens: 0,
        };
        let chain = PromptChain::default();
        let ejected = |id| ledger.outliers().ejected(&pin(id).rank_key(), Instant::now());
        for _ in 0..EJECT_AFTER {
            let mut end = DispatchEnd::record(&ledger, &reporter, &view, &paired(1, 2), 160, &chain, false);
            end.prefilled();
            end.blame();
        }
        assert!(ejected(2), "the decode rank is out");
        assert!(!ejected(1), "the prefill rank finished its leg");
        for _ in 0..EJECT_AFTER {
            let end = DispatchEnd::record(&ledger, &reporter, &view, &paired(3, 4), 160, &chain, false);
            end.blame();
        }
        assert!(ejected(3) && ejected(4), "before a first token, both are suspects");

        // A stream runs past the ledger's bound on an unanswered dispatch, which then lets it
        // go: its outcome still blames the ranks it was pinned to.
        let t0 = Instant::now();
        for _ in 0..EJECT_AFTER {
            let mut end = DispatchEnd::record(&ledger, &reporter, &view, &paired(5, 6), 160, &chain, false);
            end.prefilled();
            let ranks = [(pin(5).rank_key(), None), (pin(6).rank_key(), None)];
            ledger.backlogs(&ranks, None, t0 + UNANSWERED_FOR + Duration::from_secs(1));
            end.blame();
        }
        assert!(ledger.is_empty(), "the ledger let them go");
        assert!(ejected(6), "the decode rank of streams past the bound is out all the same");
    }

    /// The leg that prefills a request says two things in its report, and again in a replay on
    /// a new stream: that its answer comes whole (no first token will say its prompt is done,
    /// so the control plane does not count the prompt until the end), and that it may stall its
    /// rank (it receives the request at once, and the request has two blocks or more: the stall
    /// rule, fleet-wide). A pair's decode leg says neither: it has no prompt to wait on, and
    /// receives the request only after the prefill.
    #[tokio::test]
    async fn the_leg_that_prefills_says_whether_its_answer_comes_whole_and_whether_it_may_stall() {
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let mut rx = reporter.attached_receiver().expect("receiver");
        let ledger = Arc::new(DispatchLedger::new());
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let paired =
            Selection { prefill: Some(Pin { worker: WorkerKey::new("dynamo", 1), dp_rank: None }), ..aggregated() };
        let mut record = |selection: &Selection, prompt_tokens, buffered| {
            let chain = PromptChain::default();
            let end = DispatchEnd::record(&ledger, &reporter, &view, selection, prompt_tokens, &chain, buffered);
            let first = rx.try_recv().expect("an operation");
            let started = batch(first, &mut rx).started;
            let flags: Vec<(bool, bool)> = started.iter().map(|s| (s.buffered, s.may_stall)).collect();
            (end, flags)
        };
        let (_paired, flags) = record(&paired, 160, true);
        assert_eq!(flags, [(true, true), (false, false)], "the prefill worker's leg only");
        let (_aggregated, flags) = record(&aggregated(), 160, true);
        assert_eq!(flags, [(true, true)]);
        let (_streamed, flags) = record(&aggregated(), 32, false);
        assert_eq!(flags, [(false, true)]);
        let (_small, flags) = record(&aggregated(), 16, false);
        assert_eq!(flags, [(false, false)], "one block never stalls");

        let ids = ledger.dispatches_before(u64::MAX);
        let (_, replayed) = ledger.replay_legs(&ids, usize::MAX, 1000, u64::MAX, Instant::now());
        let flags: Vec<(bool, bool)> = replayed.iter().map(|leg| (leg.buffered, leg.may_stall)).collect();
        let again = [(true, true), (false, false), (true, true), (false, true), (false, false)];
        assert_eq!(flags, again, "a replay says it again");
    }

    /// After a new stream opens, a rank whose newest leg was not replayed (its prefill over, its
    /// decode elsewhere still running) reads as the new sums have it, not as dispatched to just
    /// now, which would lose it every tie broken by the longest idle.
    #[tokio::test]
    async fn a_rank_whose_newest_leg_was_not_replayed_is_not_read_as_just_dispatched() {
        use continuum_proto::model::{LoadKey, ReportsFolded};

        use crate::routing::picker::LastDispatch;
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let ledger = Arc::new(DispatchLedger::new());
        reporter.replay_from(Arc::clone(&ledger) as Arc<dyn InFlight>);
        let mut rx = reporter.attached_receiver().expect("receiver");
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let paired =
            Selection { prefill: Some(Pin { worker: WorkerKey::new("dynamo", 1), dp_rank: None }), ..aggregated() };
        let mut end = DispatchEnd::record(&ledger, &reporter, &view, &paired, 160, &PromptChain::default(), false);
        end.prefilled();
        while rx.try_recv().is_some() {}
        reporter.attach(&mut rx);
        let replayed = batch(rx.try_recv().expect("the replay"), &mut rx);
        assert_eq!(replayed.started.len(), 1, "the decode leg alone: the prefill is over");
        let folded = Some(ReportsFolded { first_op: replayed.first_op, last_op: replayed.last_op });
        let rank = |id| (LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank: 0 }, None);
        let backlogs = ledger.backlogs(&[rank(1), rank(2)], folded, Instant::now());
        let last: Vec<LastDispatch> = backlogs.iter().map(|b| b.last_dispatch).collect();
        assert_eq!(last, [LastDispatch::default(); 2], "both as the sums hold them");
    }

    /// A replay as large as the ledger holds leaves the operations after it their room: they
    /// are reported while the new stream drains the replay, not refused, which would end the
    /// stream and replay it all again on the next, and so on.
    #[tokio::test]
    async fn operations_after_a_replay_of_a_full_ledger_still_find_room() {
        use continuum_proto::MAX_DISPATCH_BLOCK_HASHES;
        use continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES;
        let dropped = IntCounter::new("dropped", "dropped").expect("counter");
        let reporter = Arc::new(DispatchReporter::new(dropped.clone()));
        let ledger = Arc::new(DispatchLedger::new());
        reporter.replay_from(Arc::clone(&ledger) as Arc<dyn InFlight>);
        let mut rx = reporter.attached_receiver().expect("receiver");
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let long = MAX_DISPATCH_BLOCK_HASHES as u64;
        let chain = |n: u64| PromptChain { block_size: 16, hashes: (n * long..(n + 1) * long).collect(), lookup: 0 };
        let in_flight: Vec<DispatchEnd> = (0..(MAX_ACTIVE_BLOCK_HASHES / MAX_DISPATCH_BLOCK_HASHES) as u64)
            .map(|n| DispatchEnd::record(&ledger, &reporter, &view, &aggregated(), long * 16, &chain(n), false))
            .collect();
        while rx.try_recv().is_some() {}
        // The stream is lost; the next one opens with every chain the ledger holds replayed,
        // all of it queued until the stream drains it.
        assert!(reporter.attach(&mut rx) >= MAX_ACTIVE_BLOCK_HASHES / MAX_DISPATCH_BLOCK_HASHES, "every leg");
        let after: Vec<DispatchEnd> = (0..64)
            .map(|n| DispatchEnd::record(&ledger, &reporter, &view, &aggregated(), long * 16, &chain(1000 + n), false))
            .collect();
        assert!(rx.attached(), "64 dispatches of the longest chains after the replay, all reported");
        assert_eq!(dropped.get(), 0);
        drop((in_flight, after));
    }

    /// A dispatch to an aggregated worker (no prefill pin).
    fn aggregated() -> Selection {
        Selection {
            namespace: "dynamo".into(),
            model: "tiny".into(),
            decode: Pin { worker: WorkerKey::new("dynamo", 2), dp_rank: None },
            prefill: None,
            decode_reason: Reason::Load,
            prefill_reason: Reason::NoPrefillPool,
            cached_tokens: 0,
        }
    }

    /// A stream that opens hears first of the dispatches already in flight: each leg under the
    /// id its first report gave it, marked replayed, in operations small enough for a report,
    /// numbered before anything else on the stream. Their ends are then reported as usual.
    #[tokio::test]
    async fn a_new_stream_first_hears_again_of_the_dispatches_in_flight() {
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let ledger = Arc::new(DispatchLedger::new());
        reporter.replay_from(Arc::clone(&ledger) as Arc<dyn InFlight>);
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let selection = aggregated();
        // Dispatched while no stream was open.
        let count = crate::fleet::MAX_REPLAYED_PER_OPERATION + 72;
        let mut ends: Vec<DispatchEnd> = (0..count)
            .map(|_| DispatchEnd::record(&ledger, &reporter, &view, &selection, 160, &PromptChain::default(), false))
            .collect();
        ends[0].prefilled();
        let mut rx = reporter.take_receiver().expect("receiver");
        assert_eq!(reporter.attach(&mut rx), count);

        let mut reports = Vec::new();
        while let Some(first) = rx.try_recv() {
            reports.push(batch(first, &mut rx));
        }
        let ops: Vec<(u64, u64)> = reports.iter().map(|r| (r.first_op, r.last_op)).collect();
        assert_eq!(ops, [(1, 2)], "two operations, numbered first on the stream, in one report");
        let started = &reports[0].started;
        assert_eq!(started.len(), count);
        assert!(started.iter().all(|s| s.replayed && s.decode_blocks == 10 && s.lookup == 0), "{:?}", started[0]);
        let first_id = ends[0].reported[1].expect("the decode leg");
        assert_eq!(started[0].id, first_id, "under the id its first report gave it");
        assert_eq!(started[0].prefill_tokens, 0, "its response began");
        assert_eq!(reports[0].prefilled, [first_id]);
        assert_eq!(started[1].prefill_tokens, 160);

        let after = DispatchEnd::record(&ledger, &reporter, &view, &selection, 160, &PromptChain::default(), false);
        let next = batch(rx.try_recv().expect("queued"), &mut rx);
        assert_eq!((next.first_op, next.started.len(), next.started[0].replayed), (3, 1, false));
        drop(after);
        ends.truncate(1);
        drop(ends);
        let mut ended = Vec::new();
        while let Some(first) = rx.try_recv() {
            ended.extend(batch(first, &mut rx).ended);
        }
        assert!(ended.contains(&first_id), "ended under its first id too");
        assert_eq!(ended.len(), count + 1);
    }

    /// A prompt sized by the load-only estimate calibrates the model's later estimates by its
    /// answer's usage, once; a tokenized prompt's answer teaches nothing.
    #[tokio::test]
    async fn an_estimated_prompts_answer_calibrates_the_models_estimates() {
        let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
        let _rx = reporter.take_receiver().expect("receiver");
        let ledger = Arc::new(DispatchLedger::new());
        let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
        let selection = aggregated();
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":1500,"completion_tokens":16}}"#;

        let mut tokenized =
            DispatchEnd::record(&ledger, &reporter, &view, &selection, 1500, &PromptChain::default(), false);
        tokenized.observe(usage);
        assert_eq!(ledger.prompt_sizes().factor("tiny"), 1.0);

        let mut estimated =
            DispatchEnd::record(&ledger, &reporter, &view, &selection, 750, &PromptChain::default(), false);
        estimated.sized_by_estimate("tiny", 750);
        estimated.observe(br#"data: {"choices":[{"delta":{"content":"hi"}}]}"#);
        assert_eq!(ledger.prompt_sizes().factor("tiny"), 1.0, "no usage in this chunk");
        estimated.observe(usage);
        let learnt = ledger.prompt_sizes().factor("tiny");
        assert!(learnt > 1.0, "counted twice the estimate: {learnt}");
        estimated.observe(usage);
        assert_eq!(ledger.prompt_sizes().factor("tiny"), learnt, "one answer counts once");
        assert!(ledger.prompt_sizes().tokens("tiny", 750) > 750);
    }
}
