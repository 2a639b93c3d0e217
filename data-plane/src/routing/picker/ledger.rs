//! The replica's own dispatches in flight, per worker rank.
//!
//! Workers publish load only when it changes, and their samples lag both a request's arrival
//! and its end, so between two samples the picker would send a whole burst to the worker that
//! looked idle. Each dispatch therefore adds to its ranks' backlog: its prompt tokens to the
//! rank that prefills it until the response begins (the first token), and its blocks to the
//! decode rank until it ends, as Dynamo's KV router counts them (blocks that dispatches in
//! flight on a rank share count once: [`ActiveBlocks`]). Decode blocks are also kept
//! apart as "unanswered" until a sample newer than the dispatch arrives, for the seed's rule
//! where the control plane has not measured the rank's foreign load. Nothing counts longer
//! than [`UNANSWERED_FOR`]. A dispatch of [`STALL_MIN_BLOCKS`] or more left unanswered for
//! [`STALL_AFTER`] marks its rank stalled.
//!
//! One mutex guards the state; every critical section is a few map operations, and the picker
//! queries all its candidates under a single acquisition.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::active::{ActiveBlocks, MAX_ACTIVE_BLOCK_HASHES};
use continuum_proto::model::{LoadKey, ReportsFolded};
use prometheus::{GaugeVec, IntCounter};

use super::outliers::Outliers;
use super::sizing::PromptSizes;
use super::{Few, Selection};
use continuum_proto::fast_hash::FastMap;

mod backlog;
mod blocks;
mod changes;
mod replay;

pub use backlog::{LastDispatch, RankBacklog, SinceFleet};
pub use blocks::{PromptChain, dispatch_block_size, pin_block_size, reported_blocks};
use changes::Changes;
pub use replay::{Recorded, ReplayedLeg};

/// A dispatch adds to its ranks' backlog at most this long.
pub const UNANSWERED_FOR: Duration = Duration::from_secs(30);
pub use continuum_proto::{STALL_AFTER, STALL_MIN_BLOCKS};
/// Dispatches held at once; further ones are refused (counted) rather than growing memory.
pub const LEDGER_CAPACITY: usize = continuum_proto::MAX_REQUESTS_IN_FLIGHT;
/// Block size assumed for a worker whose card declares none (Dynamo's and vLLM's default).
pub const FALLBACK_BLOCK_SIZE: u32 = 16;
/// How often recording sweeps out expired dispatches of ranks nobody queries any more.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The operation number of what was never reported (an operation the report queue had no room
/// for, the ledger's own expiry, a test's dispatch): what it changes is not remembered for the
/// fleet join, since the fleet's sums will never show it. Reported operations count from 1.
pub const NOT_REPORTED: u64 = 0;

/// An operation that changes a dispatch recorded earlier (its first token, its end): its
/// number, and the first number of the stream it is reported on. A dispatch recorded before
/// that stream opened is one the control plane never had (it forgot the old stream's), so what
/// happens to it later is not remembered for the join either: it leaves the legs the sums lack
/// as it changes, and the join is right at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub number: u64,
    pub stream_first: u64,
}

impl From<u64> for Op {
    /// An operation on the stream every numbered recording was reported on.
    fn from(number: u64) -> Self {
        Op { number, stream_first: 0 }
    }
}

/// A recorded dispatch, to end when its request finishes, is refused, fails or is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DispatchId(u64);

impl DispatchId {
    /// What a refused record returns; ending it does nothing.
    pub const UNRECORDED: DispatchId = DispatchId(0);

    #[cfg(test)]
    pub fn is_recorded(self) -> bool {
        self != Self::UNRECORDED
    }
}

#[derive(Debug)]
pub struct DispatchLedger {
    capacity: usize,
    state: Mutex<State>,
    refused: AtomicU64,
    /// The replica's registered metric for refusals, when it has one.
    refused_metric: Option<IntCounter>,
    /// Ranks whose pinned dispatches keep failing.
    outliers: Outliers,
    /// How the load-only estimate compares with the tokens each model counts.
    prompt_sizes: PromptSizes,
    /// Held from a pick's read of the ledger to its record ([`Self::pick_turn`]).
    picking: Mutex<()>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// Legs per rank, in dispatch order.
    ranks: FastMap<LoadKey, Rank>,
    /// The ranks each live dispatch has legs on.
    dispatches: FastMap<DispatchId, [Option<LoadKey>; 2]>,
    /// Block hashes the legs hold, at most [`MAX_ACTIVE_BLOCK_HASHES`].
    held_hashes: usize,
    last_sweep: Option<Instant>,
}

/// One rank's legs, with their sums kept up to date so that the common query (every leg
/// unanswered, none old enough to stall) costs no walk over them.
#[derive(Debug, Default)]
struct Rank {
    /// In recording order, which is id order.
    legs: VecDeque<Leg>,
    prefill_tokens: u64,
    /// The legs' distinct decode blocks.
    active: ActiveBlocks,
    /// No leg is older than this; exact except after expiry pops, which recompute it.
    oldest: Option<Instant>,
    /// What the reported operations did to the rank lately, for the fleet join.
    changes: Changes,
    /// What the legs recorded unreported hold: the fleet's sums never will.
    unreported: Unreported,
    /// The newest leg's recording (operation, time), kept after it ends for as long as the
    /// rank is: a request may end before the fleet's sums hold its start.
    newest: Option<(u64, Instant)>,
    /// When the newest sample the rank's legs were judged against arrived. A sample the
    /// control plane drops later (a sequence gap, a resubscription) did answer the legs before
    /// it: without this, each would count as unanswered again, and stall the rank.
    heard_at: Option<Instant>,
}

/// The load of legs whose recording was never reported (its operation found the report queue
/// full): the join adds it whatever the sums hold, and their first tokens and ends change
/// nothing the sums show.
#[derive(Clone, Copy, Debug, Default)]
struct Unreported {
    decode_blocks: u64,
    prefill_tokens: u64,
}

impl Rank {
    fn push(&mut self, mut leg: Leg) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(leg.prefill_tokens);
        leg.added = self.active.add(&leg.block_hashes, leg.decode_blocks);
        if leg.op == NOT_REPORTED {
            self.unreported.decode_blocks = self.unreported.decode_blocks.saturating_add(leg.added);
            self.unreported.prefill_tokens = self.unreported.prefill_tokens.saturating_add(leg.prefill_tokens);
        }
        let started =
            SinceFleet { decode_started: leg.added, prefill_started: leg.prefill_tokens, ..Default::default() };
        self.changed(leg.op, leg.at, started);
        self.oldest = Some(self.oldest.map_or(leg.at, |oldest| oldest.min(leg.at)));
        self.newest = Some((leg.op, leg.at));
        self.legs.push_back(leg);
    }

    /// This replica's newest leg on the rank, ended or not, when sums holding operations
    /// `folded` lack it. One numbered before the sums' stream (a leg a new stream did not
    /// replay: over, or its prefill done) is theirs to order as they know it: read as local,
    /// it would sort ahead of every rank the sums order, as if dispatched to just now.
    fn last_dispatch(&self, folded: Option<ReportsFolded>) -> LastDispatch {
        let Some((op, at)) = self.newest else { return LastDispatch::default() };
        let held = folded.is_some_and(|f| op != NOT_REPORTED && op <= f.last_op);
        if held { LastDispatch::default() } else { LastDispatch::Local(at) }
    }

    /// Where dispatch `id`'s leg is.
    fn position(&self, id: DispatchId) -> Option<usize> {
        match self.legs.binary_search_by_key(&id.0, |leg| leg.id.0) {
            Ok(index) => Some(index),
            // Ids only leave order if the counter wrapped; look the slow way then.
            Err(_) => self.legs.iter().position(|leg| leg.id == id),
        }
    }

    fn prefilled(&mut self, id: DispatchId, now: Instant, op: Op) {
        let Some(leg) = self.position(id).and_then(|index| self.legs.get_mut(index)) else { return };
        // Its first token came: the worker answered it, so it no longer counts toward a stall
        // (a prefill leg stays recorded until the decode ends).
        leg.stall_blocks = 0;
        leg.answered = true;
        let (recorded_by, tokens) = (leg.op, std::mem::take(&mut leg.prefill_tokens));
        self.prefill_tokens = self.prefill_tokens.saturating_sub(tokens);
        if recorded_by == NOT_REPORTED {
            self.unreported.prefill_tokens = self.unreported.prefill_tokens.saturating_sub(tokens);
        }
        let op = reported_for(recorded_by, op);
        self.changed(op, now, SinceFleet { prefill_done: tokens, ..Default::default() });
    }

    /// Operation `op` changed the rank by `change`. What was not reported is not remembered:
    /// the fleet's sums will not show it, so the join must not make up for it.
    fn changed(&mut self, op: u64, at: Instant, change: SinceFleet) {
        if op != NOT_REPORTED && change != SinceFleet::default() {
            self.changes.record(op, at, change);
        }
    }

    /// Ends dispatch `id`'s leg by operation `op`; returns the hashes it held.
    fn take(&mut self, id: DispatchId, now: Instant, op: Op) -> usize {
        let Some(leg) = self.position(id).and_then(|index| self.legs.remove(index)) else { return 0 };
        // A prompt still queued when its dispatch ends stops loading the rank now. A buffered
        // answer's is the exception for the join: no first token marks its prompt done, so the
        // control plane deems it done by the rank's prefill time, perhaps long before the end,
        // and taking it off sums that no longer hold it would read the rank idler than it is.
        // Left to the end's fold, it reads busier for as long, at most.
        let tokens = if leg.buffered { 0 } else { leg.prefill_tokens };
        let freed = self.forget(&leg);
        let op = reported_for(leg.op, op);
        self.changed(op, now, SinceFleet { decode_ended: freed, prefill_done: tokens, ..Default::default() });
        if self.oldest.is_none_or(|oldest| leg.at <= oldest) {
            // Legs are held in the order they were recorded.
            self.oldest = self.legs.front().map(|leg| leg.at);
        }
        leg.block_hashes.len()
    }

    /// Drops the oldest leg if it has expired; returns its dispatch and the hashes it held.
    fn pop_expired(&mut self, now: Instant) -> Option<(DispatchId, usize)> {
        self.legs.front().filter(|leg| now.saturating_duration_since(leg.at) >= UNANSWERED_FOR)?;
        let leg = self.legs.pop_front()?;
        self.forget(&leg);
        Some((leg.id, leg.block_hashes.len()))
    }

    fn is_empty(&self) -> bool {
        self.legs.is_empty() && self.changes.is_empty()
    }

    /// Whether its oldest leg is past [`UNANSWERED_FOR`] ([`State::expire`] drops it).
    fn expires(&self, now: Instant) -> bool {
        self.oldest.is_some_and(|oldest| now.saturating_duration_since(oldest) >= UNANSWERED_FOR)
    }

    /// What the rank's legs add to its last sample (received at `sampled_at`) now.
    fn backlog(&mut self, sampled_at: Option<Instant>, now: Instant) -> RankBacklog {
        let mut backlog = RankBacklog::default();
        self.heard_at = self.heard_at.max(sampled_at);
        let sampled_at = self.heard_at;
        // Every leg is younger than the stall age and no sample answers any: the sums are it.
        if let Some(oldest) = self.oldest
            && now.saturating_duration_since(oldest) < STALL_AFTER
            && sampled_at.is_none_or(|at| at <= oldest)
        {
            backlog.prefill_tokens = self.prefill_tokens;
            backlog.unanswered_prefill_tokens = self.prefill_tokens;
            backlog.decode_blocks = self.active.total();
            backlog.in_flight_decode_blocks = self.active.total();
            return backlog;
        }
        backlog.in_flight_decode_blocks = self.active.total();
        backlog.prefill_tokens = self.prefill_tokens;
        let unanswered = |leg: &&Leg| {
            sampled_at.is_none_or(|at| at <= leg.at) && now.saturating_duration_since(leg.at) < UNANSWERED_FOR
        };
        for leg in self.legs.iter().filter(unanswered) {
            backlog.decode_blocks = backlog.decode_blocks.saturating_add(leg.added).saturating_add(leg.inherited);
            backlog.unanswered_prefill_tokens = backlog.unanswered_prefill_tokens.saturating_add(leg.prefill_tokens);
            let waited = now.saturating_duration_since(leg.at);
            backlog.stalled |= leg.stall_blocks >= STALL_MIN_BLOCKS && waited >= STALL_AFTER;
        }
        backlog
    }

    /// What this replica's operations did to the rank that sums holding operations `folded`
    /// lack: those after the range, and the legs still in flight from before it (recorded
    /// before this stream's first report: the control plane never had them). What happens to
    /// such a leg on this stream is not remembered ([`reported_for`]): it leaves these legs as
    /// its response begins or it ends, and the join follows at once.
    ///
    /// Sums that trail by more than the changes remembered (a stalled stream, a control plane
    /// far behind) lack changes no longer known: the dispatches they lack that are still in
    /// flight are known from the legs, and counted; the ends they lack are not, and go
    /// uncounted, so the rank reads busier than it is rather than idler.
    fn since(&mut self, folded: ReportsFolded) -> SinceFleet {
        let after = self.changes.after(folded.last_op).unwrap_or_else(|| {
            let missing = self.legs.iter().filter(|leg| leg.op > folded.last_op);
            missing.fold(SinceFleet::default(), |since, leg| SinceFleet {
                decode_started: since.decode_started.saturating_add(leg.added),
                prefill_started: since.prefill_started.saturating_add(leg.prefill_tokens),
                ..since
            })
        });
        let mut since = SinceFleet {
            decode_started: after.decode_started.saturating_add(self.unreported.decode_blocks),
            prefill_started: after.prefill_started.saturating_add(self.unreported.prefill_tokens),
            ..after
        };
        let before_range = self.legs.iter().take_while(|leg| leg.op < folded.first_op);
        for leg in before_range.filter(|leg| leg.op != NOT_REPORTED) {
            since.decode_started = since.decode_started.saturating_add(leg.added);
            since.prefill_started = since.prefill_started.saturating_add(leg.prefill_tokens);
        }
        since
    }

    /// Takes a leg's load off the rank; returns the decode blocks that freed.
    fn forget(&mut self, leg: &Leg) -> u64 {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(leg.prefill_tokens);
        if leg.op == NOT_REPORTED {
            self.unreported.decode_blocks = self.unreported.decode_blocks.saturating_sub(leg.added);
            self.unreported.prefill_tokens = self.unreported.prefill_tokens.saturating_sub(leg.prefill_tokens);
        }
        let freed = self.active.remove(&leg.block_hashes, leg.decode_blocks);
        self.bequeath(leg, freed);
        freed
    }

    /// The blocks `ended` counted that stay held go to a leg holding all of them: they are the
    /// longest prefix of its chain another leg shares (chains are prefix-closed).
    fn bequeath(&mut self, ended: &Leg, freed: u64) {
        let left = ended.added.saturating_add(ended.inherited).saturating_sub(freed);
        let held = if left == 0 { 0 } else { self.active.depth(&ended.block_hashes) as usize };
        let Some(prefix) = ended.block_hashes.get(..held).filter(|prefix| !prefix.is_empty()) else { return };
        // From the newest: the leg most likely to go on holding the prefix longest.
        if let Some(heir) = self.legs.iter_mut().rev().find(|leg| leg.block_hashes.starts_with(prefix)) {
            heir.inherited = heir.inherited.saturating_add(left);
        }
    }
}

/// The operation to remember a change to a leg recorded by `recorded_by` under: none when the
/// recording went unreported, or was reported on an earlier stream, since the control plane
/// ignores what happens to a dispatch it does not have.
fn reported_for(recorded_by: u64, op: Op) -> u64 {
    if recorded_by == NOT_REPORTED || recorded_by < op.stream_first { NOT_REPORTED } else { op.number }
}

#[derive(Clone, Debug)]
struct Leg {
    id: DispatchId,
    at: Instant,
    /// The operation that recorded it (or that reported it again on a new stream).
    op: u64,
    /// Its report's id (0: none).
    report: u64,
    /// Its response began.
    answered: bool,
    /// Its client takes the answer whole and it is the leg that prefills, for a replay to say again.
    buffered: bool,
    prefill_tokens: u64,
    decode_blocks: u64,
    /// The prompt's prefix chain on the decode leg, for counting shared blocks once.
    block_hashes: Box<[u64]>,
    /// The blocks it added to its rank's distinct total.
    added: u64,
    /// Blocks ended legs counted that this one still holds: counted with `added` while it is
    /// unanswered (apart from `added`, which the fleet's sums follow).
    inherited: u64,
    /// Blocks that count toward a stall: zero for the decode leg of a prefill+decode pair,
    /// which receives the request only after the prefill finishes.
    stall_blocks: u64,
}

impl Default for DispatchLedger {
    fn default() -> Self {
        Self::new()
    }
}

impl DispatchLedger {
    pub fn new() -> Self {
        Self::with_capacity(LEDGER_CAPACITY)
    }

    /// One pick at a time, from its read of the ledger to the record of what it chose: two
    /// requests picked at once on the runtime's threads would each read the ledger without the
    /// other's dispatch and land on the same worker, the burst the ledger is here to spread.
    /// Held for microseconds (the pick and the record; no await between them).
    pub fn pick_turn(&self) -> MutexGuard<'_, ()> {
        self.picking.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ranks this replica's pinned dispatches keep failing on; pickers skip them.
    pub fn outliers(&self) -> &Outliers {
        &self.outliers
    }

    /// The load-only prompt estimate, calibrated per model by the answers to dispatches
    /// recorded here.
    pub fn prompt_sizes(&self) -> &PromptSizes {
        &self.prompt_sizes
    }

    /// A ledger whose refusals count on `refused` and whose learnt prompt-size ratios show on
    /// `ratios` (the replica's registered metrics).
    pub fn with_metrics(refused: IntCounter, ratios: GaugeVec) -> Self {
        Self { refused_metric: Some(refused), prompt_sizes: PromptSizes::showing_on(ratios), ..Self::new() }
    }

    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity,
            state: Mutex::new(State::default()),
            refused: AtomicU64::new(0),
            refused_metric: None,
            outliers: Outliers::default(),
            prompt_sizes: PromptSizes::default(),
            picking: Mutex::default(),
        }
    }

    /// Records a dispatch of `prompt_tokens` pinned as `selection`, by operation `op` (its
    /// report's number: operations are recorded in number order). `block_size` is the decode
    /// worker's (see [`dispatch_block_size`]); 0 counts as 1. `block_hashes` is the prompt's
    /// prefix chain at that block size (empty when unknown): the blocks the decode rank shares
    /// with its other requests in flight. An aggregated rank computes them into its prefix
    /// cache; a decode worker of a pair keeps the KV it receives in its own (the 1.6.1 mocker's
    /// decode workers answer a prompt whose prefix an earlier request brought with
    /// `cached_tokens`), so on both a block several requests hold counts once.
    pub fn record(
        &self,
        selection: &Selection,
        prompt_tokens: u64,
        block_size: u32,
        block_hashes: &[u64],
        now: Instant,
        recorded: impl Into<Recorded>,
    ) -> DispatchId {
        let Recorded { op, legs: [first_report, second_report], buffered } = recorded.into();
        let blocks = reported_blocks(prompt_tokens, block_size);
        let mut state = self.lock();
        state.sweep_unless_within(now, SWEEP_EVERY);
        if state.dispatches.len() >= self.capacity {
            drop(state);
            self.refused.fetch_add(1, Ordering::Relaxed);
            if let Some(metric) = &self.refused_metric {
                metric.inc();
            }
            return DispatchId::UNRECORDED;
        }
        state.next_id = state.next_id.wrapping_add(1).max(1);
        let id = DispatchId(state.next_id);
        let block_hashes: Box<[u64]> = if state.held_hashes + block_hashes.len() <= MAX_ACTIVE_BLOCK_HASHES {
            block_hashes.iter().copied().take(usize::try_from(blocks).unwrap_or(usize::MAX)).collect()
        } else {
            Box::default()
        };
        state.held_hashes += block_hashes.len();
        // `buffered` goes on the leg that prefills, whose prompt waits on a first token.
        let leg = |report, prefill_tokens, decode_blocks, stall_blocks, block_hashes, buffered| Leg {
            id,
            at: now,
            op,
            report,
            answered: false,
            buffered,
            prefill_tokens,
            decode_blocks,
            block_hashes,
            added: 0,
            inherited: 0,
            stall_blocks,
        };
        let prefill_tokens = selection.uncached_prompt_tokens(prompt_tokens);
        let legs = match &selection.prefill {
            Some(prefill) => {
                state.push(prefill.rank_key(), leg(first_report, prefill_tokens, 0, blocks, Box::default(), buffered));
                // The decode leg receives the request only after the prefill: no stall.
                state.push(selection.decode.rank_key(), leg(second_report, 0, blocks, 0, block_hashes, false));
                [Some(prefill.rank_key()), Some(selection.decode.rank_key())]
            }
            None => {
                // An aggregated rank prefills the request itself.
                let leg = leg(first_report, prefill_tokens, blocks, blocks, block_hashes, buffered);
                state.push(selection.decode.rank_key(), leg);
                [Some(selection.decode.rank_key()), None]
            }
        };
        state.dispatches.insert(id, legs);
        id
    }

    /// Ends a dispatch by operation `op`: its request finished, was refused, failed or was
    /// cancelled, so it no longer loads its workers nor counts toward a stall. Ending twice
    /// does nothing.
    pub fn end(&self, id: DispatchId, now: Instant, op: impl Into<Op>) {
        let mut state = self.lock();
        state.remove(id, now, op.into());
        state.sweep_unless_within(now, SWEEP_EVERY);
    }

    /// The dispatch's response began (operation `op`): its prompt no longer loads the rank that
    /// prefilled it.
    pub fn prefilled(&self, id: DispatchId, now: Instant, op: impl Into<Op>) {
        let op = op.into();
        let mut state = self.lock();
        let State { dispatches, ranks, .. } = &mut *state;
        let Some(keys) = dispatches.get(&id) else {
            return;
        };
        for key in keys.iter().flatten() {
            if let Some(rank) = ranks.get_mut(key) {
                rank.prefilled(id, now, op);
            }
        }
    }

    /// The backlog of each rank, given when its last sample was received (`None`: never), and
    /// which of this replica's operations the fleet's sums hold (`None`: unknown).
    #[cfg(test)]
    pub fn backlogs<K: std::borrow::Borrow<LoadKey>>(
        &self,
        ranks: &[(K, Option<Instant>)],
        folded: Option<ReportsFolded>,
        now: Instant,
    ) -> Few<RankBacklog> {
        self.backlogs_with(ranks.iter().map(|(key, sampled_at)| (key.borrow(), *sampled_at)), folded, now, |_, b| b)
    }

    /// What `each` makes of the backlog of each rank (given its position among `ranks`), under
    /// one acquisition of the ledger: its own legs, given when the rank's last sample was
    /// received (`None`: never), and which of this replica's operations the fleet's sums hold
    /// (`folded`; `None`: unknown). Pickers keep what they need of every candidate in one small
    /// vector instead of moving a vector of backlogs into another.
    pub fn backlogs_with<'k, T>(
        &self,
        ranks: impl IntoIterator<Item = (&'k LoadKey, Option<Instant>)>,
        folded: Option<ReportsFolded>,
        now: Instant,
        mut each: impl FnMut(usize, RankBacklog) -> T,
    ) -> Few<T> {
        let mut state = self.lock();
        ranks
            .into_iter()
            .enumerate()
            .map(|(i, (key, sampled_at))| {
                let backlog = match state.current(key, now) {
                    Some(rank) => {
                        let backlog = rank.backlog(sampled_at, now);
                        let since_fleet = folded.map(|folded| rank.since(folded));
                        RankBacklog { last_dispatch: rank.last_dispatch(folded), since_fleet, ..backlog }
                    }
                    None => {
                        RankBacklog { since_fleet: folded.map(|_| SinceFleet::default()), ..RankBacklog::default() }
                    }
                };
                each(i, backlog)
            })
            .collect()
    }

    /// Dispatches refused because the ledger was full.
    pub fn refused_total(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Dispatches held.
    pub fn len(&self) -> usize {
        self.lock().dispatches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn push(&mut self, key: LoadKey, leg: Leg) {
        self.ranks.entry(key).or_default().push(leg);
    }

    fn remove(&mut self, id: DispatchId, now: Instant, op: Op) {
        self.remove_except(id, None, now, op);
    }

    /// Drops dispatch `id` from its ranks, but for `gone_from`, whose leg of it is gone already
    /// (an expired one: looking for it there would scan the whole rank).
    fn remove_except(&mut self, id: DispatchId, gone_from: Option<&LoadKey>, now: Instant, op: Op) {
        let Some(keys) = self.dispatches.remove(&id) else {
            return;
        };
        for key in keys.into_iter().flatten().filter(|key| Some(key) != gone_from) {
            if let Some(rank) = self.ranks.get_mut(&key) {
                self.held_hashes -= rank.take(id, now, op);
                if rank.is_empty() {
                    self.ranks.remove(&key);
                }
            }
        }
    }

    /// Rank `key` as a pick reads it, once [`Self::expire`] has dropped what it no longer
    /// holds; `None` if nothing is left of it.
    fn current(&mut self, key: &LoadKey, now: Instant) -> Option<&mut Rank> {
        let rank = self.ranks.get_mut(key)?;
        rank.changes.forget(now);
        if rank.expires(now) || rank.is_empty() {
            self.expire(key, now);
        }
        // Looked up again: the borrow checker cannot yet see that the first borrow ends in
        // the branch above.
        self.ranks.get_mut(key)
    }

    /// Drops a rank's legs older than [`UNANSWERED_FOR`], with their dispatches, and the ended
    /// legs it no longer needs to remember.
    fn expire(&mut self, key: &LoadKey, now: Instant) {
        let Some(rank) = self.ranks.get_mut(key) else {
            return;
        };
        rank.changes.forget(now);
        if rank.expires(now) {
            let mut expired = Vec::new();
            let mut freed_hashes = 0;
            while let Some((id, hashes)) = rank.pop_expired(now) {
                expired.push(id);
                freed_hashes += hashes;
            }
            rank.oldest = rank.legs.front().map(|leg| leg.at);
            self.held_hashes -= freed_hashes;
            for id in expired {
                self.remove_except(id, Some(key), now, NOT_REPORTED.into());
            }
        }
        if self.ranks.get(key).is_some_and(Rank::is_empty) {
            self.ranks.remove(key);
        }
    }

    /// [`Self::sweep`], unless the last one was less than `within` before `now`.
    fn sweep_unless_within(&mut self, now: Instant, within: Duration) {
        if self.last_sweep.is_none_or(|at| now.saturating_duration_since(at) >= within) {
            self.sweep(now);
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.last_sweep = Some(now);
        let keys: Vec<LoadKey> = self.ranks.keys().cloned().collect();
        for key in &keys {
            self.expire(key, now);
        }
    }
}

#[cfg(test)]
mod tests;
