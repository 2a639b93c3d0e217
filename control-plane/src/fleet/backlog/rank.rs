//! One rank's dispatches in flight, and what its last sample showed beyond them: the sums the
//! book publishes for it and the times it learns (see the module above for what they mean).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Bound::{Excluded, Unbounded};
use std::sync::Arc;
use std::time::Instant;

use continuum_kv_index::RankKey;
use continuum_proto::STALL_AFTER;
use continuum_proto::fast_hash::{SeededMap, shrink_when_sparse};
use continuum_proto::model::{Backlog, Load, LoadKey, Worker};

use super::timing::Timing;
use super::{BACKLOG_WINDOW, DISPATCH_MAX_AGE, MAX_ENDED_PER_RANK, PROGRESS_STEPS, SAMPLE_LAG};
use crate::fleet::{ActiveIndex, FleetState};

#[derive(Debug, Clone, Copy)]
pub(super) struct Ended {
    pub(super) at: Instant,
    /// The blocks the end freed on the rank.
    pub(super) blocks: u64,
    /// When it was dispatched, and when its prompt stopped queueing on the rank (its first
    /// token, or its end if none came), with the prompt's tokens: a sample received shortly
    /// after may still count them.
    pub(super) started: Instant,
    pub(super) prompt_done: Instant,
    pub(super) prompt_tokens: u64,
}

#[derive(Debug)]
pub(super) struct Dispatch {
    /// Prompt tokens it brought to prefill (see [`Dispatch::prefill_tokens`]).
    pub(super) prompt_tokens: u64,
    pub(super) decode_blocks: u64,
    /// The prompt's prefix chain, for counting shared blocks once; empty past the book's bound.
    pub(super) block_hashes: Vec<u64>,
    /// The blocks it added to its rank's distinct total when it started.
    pub(super) added: u64,
    pub(super) at: Instant,
    /// When its first token was reported, or, for a buffered dispatch, when the book took its
    /// prompt as prefilled.
    pub(super) answered: Option<Instant>,
    /// Its client asked for the answer whole ([`pb::DispatchStarted::buffered`]): no first token
    /// will be reported, so its prompt is taken as prefilled by time ([`Rank::deem_prefilled`]).
    pub(super) buffered: bool,
    /// `answered` is the book's estimate, not a report: no time to learn from.
    pub(super) answer_estimated: bool,
    /// It had tokens to prefill, and no other dispatch on its rank was prefilling when it
    /// started: its time to first token is a prefill's alone.
    pub(super) alone: bool,
    /// Reported again on a new stream ([`pb::DispatchStarted::replayed`]): its times are not
    /// the rank's to learn from.
    pub(super) replayed: bool,
    /// Left unanswered, it may mark the rank stalled ([`pb::DispatchStarted::may_stall`]).
    pub(super) may_stall: bool,
}

impl Dispatch {
    /// Prompt tokens still to prefill on the rank: all of them until its first token, then none.
    pub(super) fn prefill_tokens(&self) -> u64 {
        if self.answered.is_none() { self.prompt_tokens } else { 0 }
    }

    /// A buffered dispatch whose prompt the book has yet to take as prefilled.
    pub(super) fn awaits_estimate(&self) -> bool {
        self.buffered && self.prefill_tokens() > 0
    }

    /// Its prompt is taken as prefilled at `at`: an estimate, not a report.
    pub(super) fn estimate_answered(&mut self, at: Instant) {
        self.answered = Some(at);
        self.answer_estimated = true;
    }
}

/// A rank holding more dispatches than this has its walks over them (measuring a new sample
/// against them, recounting the blocks expected to end) spread out, at most one every
/// `len / WALK_BUDGET` windows: a flood of dispatches on one rank costs the book about this
/// many visits a window, not all of them every window. Its sums are then that much older.
pub(super) const WALK_BUDGET: usize = 4096;
/// The same for the whole book: holding more dispatches than this over all its ranks, it walks
/// each rank at most once every `held / BOOK_WALK_BUDGET` windows (rounded up), and a window's walks stop
/// once they have visited this many (the ranks left are walked in the next). Many ranks each
/// within [`WALK_BUDGET`] would otherwise cost a visit to every dispatch of the fleet every
/// window: 64 replicas with 2,048 requests each in flight, 65 million visits a second.
pub(super) const BOOK_WALK_BUDGET: usize = 4 * WALK_BUDGET;

/// A dispatch's place in its rank's prefill order: when it was dispatched, then its key.
pub(super) type Queued = (Instant, (u64, u64));

/// The dispatches a rank has yet to prefill, in order, each with its prompt tokens, and their
/// sum: the one every publication reads, kept as they come and go rather than walked for.
#[derive(Debug, Default)]
pub(super) struct PrefillQueue {
    order: BTreeMap<Queued, u64>,
    tokens: u64,
}

impl PrefillQueue {
    pub(super) fn insert(&mut self, queued: Queued, tokens: u64) {
        if self.order.insert(queued, tokens).is_none() {
            self.tokens = self.tokens.saturating_add(tokens);
        }
    }

    pub(super) fn remove(&mut self, queued: &Queued) {
        if let Some(tokens) = self.order.remove(queued) {
            self.tokens = self.tokens.saturating_sub(tokens);
        }
    }

    pub(super) fn first(&self) -> Option<&Queued> {
        self.order.first_key_value().map(|(queued, _)| queued)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub(super) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The dispatches queued, in order.
    #[cfg(test)]
    pub(super) fn queued(&self) -> std::collections::BTreeSet<Queued> {
        self.order.keys().copied().collect()
    }
}

/// One rank's dispatches in flight and what its last sample showed beyond them.
#[derive(Debug)]
pub(super) struct Rank {
    /// The rank's key in the fleet view (its backlog's, its samples').
    pub(super) key: LoadKey,
    /// By session and the replica's dispatch id.
    pub(super) dispatches: SeededMap<(u64, u64), Dispatch>,
    /// The dispatches still prefilling ([`Dispatch::prefill_tokens`] above 0) in the rank's
    /// prefill order (dispatched, then by id): its head is the prefill under way, and a start
    /// learns whether it prefills alone without a look at every dispatch in flight.
    pub(super) prefill_queue: PrefillQueue,
    /// Those of them that await the estimate of their first token
    /// ([`Dispatch::awaits_estimate`]), in the same order: a first token or a tick takes them
    /// from the front, never walking the rest (a replica's reports could otherwise make every
    /// first token walk the rank's dispatches).
    pub(super) awaiting_estimate: BTreeSet<Queued>,
    /// The distinct decode blocks of `dispatches` (their hashes are in the book's
    /// [`ActiveIndex`]).
    pub(super) active: u64,
    /// When the sample `foreign` was measured against was received.
    pub(super) sampled_at: Option<Instant>,
    /// Decode blocks that sample showed beyond the dispatches in flight when it arrived;
    /// `None` without a sample carrying decode blocks.
    pub(super) foreign: Option<u64>,
    /// Prompt tokens that sample showed beyond the dispatches then awaiting their first token;
    /// `None` without a sample carrying `active_prefill_tokens`.
    pub(super) foreign_prefill: Option<u64>,
    /// When the last dispatch on this rank ended.
    pub(super) last_end: Option<Instant>,
    /// Dispatches ended within [`SAMPLE_LAG`], oldest first.
    pub(super) ended: VecDeque<Ended>,
    /// What was last published (without its time), so an unchanged sum is not streamed again.
    pub(super) published: Option<Backlog>,
    /// The worker as the view held it when last looked at: a new one (the worker removed and
    /// added again, or changed) may hold none of what was published for the old.
    pub(super) worker: Option<Arc<Worker>>,
    /// Marked for the next publish check (its key is in the book's `dirty`).
    pub(super) dirty: bool,
    pub(super) timing: Timing,
    /// The blocks of the dispatches in flight expected to end before a hand-over (see
    /// [`Timing::ending_after`]), as of the last [`Rank::refresh_timed`].
    pub(super) ending: u64,
    /// The tokens of the prefill under way expected to be done, as of the last
    /// [`Rank::refresh_timed`].
    pub(super) prefilled: u64,
    /// When the rank's latest prefill ended (its first token was reported).
    pub(super) last_answered: Option<Instant>,
    /// The book's count of dispatches folded when the rank's newest was (see
    /// [`Backlog::last_dispatch`]).
    pub(super) last_dispatch: u64,
    /// Before this, no walk over the rank's dispatches ([`WALK_BUDGET`]).
    pub(super) walk_after: Option<Instant>,
    /// The dispatches that may stall the rank ([`Dispatch::may_stall`]) and have had no first
    /// token, in dispatch order: a stall is the first of them no sample has answered.
    pub(super) stallable: BTreeSet<Queued>,
    /// Whether one of them has gone unanswered long enough, as of the last [`Rank::restall`].
    pub(super) stalled: bool,
    /// When the newest sample the stall was judged against arrived: a sample the view drops
    /// later (a sequence gap, a resubscription) answered the dispatches before it all the same.
    pub(super) heard_at: Option<Instant>,
}

impl Rank {
    /// Whether the view's worker for this rank is another than the one last seen (it was
    /// removed and added again, or changed); remembers the one seen now.
    pub(super) fn worker_came_back(&mut self, state: &FleetState) -> bool {
        let Some(current) = state.view().worker(&self.key.worker) else { return false };
        let seen = self.worker.replace(Arc::clone(current));
        seen.is_some_and(|seen| !Arc::ptr_eq(&seen, current))
    }

    /// A new record starts from the sample the view holds now, so that sample's whole backlog
    /// counts as foreign until the next one.
    pub(super) fn new(key: LoadKey, state: &FleetState) -> Self {
        let sample = state.view().loads().get(&key);
        let worker = state.view().worker(&key.worker).cloned();
        let mut rank = Rank {
            key,
            dispatches: SeededMap::default(),
            prefill_queue: PrefillQueue::default(),
            awaiting_estimate: BTreeSet::new(),
            active: 0,
            sampled_at: None,
            foreign: None,
            foreign_prefill: None,
            last_end: None,
            ended: VecDeque::new(),
            published: None,
            worker,
            dirty: false,
            timing: Timing::default(),
            ending: 0,
            prefilled: 0,
            last_answered: None,
            last_dispatch: 0,
            walk_after: None,
            stallable: BTreeSet::new(),
            stalled: false,
            heard_at: None,
        };
        rank.sampled(sample.map(|s| s.received_at), sample.map(|s| &s.load));
        rank
    }

    pub(super) fn backlog(&self) -> Backlog {
        let mut backlog = Backlog {
            foreign_decode_blocks: self.foreign,
            foreign_prefill_tokens: self.foreign_prefill,
            decode_blocks: self.active,
            ending_decode_blocks: self.ending.min(self.active),
            last_dispatch: self.last_dispatch,
            stalled: self.stalled,
            ..Backlog::default()
        };
        backlog.prefill_tokens = self.prefill_queue.tokens();
        backlog.dispatches = u32::try_from(self.dispatches.len()).unwrap_or(u32::MAX);
        backlog.prefilled_tokens = self.prefilled.min(backlog.prefill_tokens);
        backlog
    }

    /// A dispatch's prompt tokens and decode blocks, each at most what one request can hold on
    /// the rank: its worker's context length and KV blocks, when its card declares them. A
    /// request the rank could never hold would otherwise weigh on it, for every replica,
    /// beyond full until it ended (or for [`IN_FLIGHT_MAX_AGE`] if its end were lost).
    pub(super) fn at_most_whole(&self, prompt_tokens: u64, decode_blocks: u64) -> (u64, u64) {
        let Some(capacity) = self.worker.as_ref().map(|w| &w.capacity) else { return (prompt_tokens, decode_blocks) };
        let at_most = |n: u64, limit: Option<u64>| limit.filter(|l| *l > 0).map_or(n, |l| n.min(l));
        (at_most(prompt_tokens, capacity.context_length), at_most(decode_blocks, capacity.total_kv_blocks))
    }

    /// Starts dispatch `id` (new to the book) on `rank`, whose blocks `active` holds.
    pub(super) fn start(&mut self, id: (u64, u64), mut dispatch: Dispatch, active: &ActiveIndex, rank: RankKey) {
        let prefills = dispatch.prefill_tokens() > 0;
        dispatch.alone = !dispatch.replayed && prefills && self.prefill_queue.is_empty();
        if prefills {
            self.prefill_queue.insert((dispatch.at, id), dispatch.prefill_tokens());
        }
        dispatch.added = active.add(rank, &dispatch.block_hashes, dispatch.decode_blocks);
        self.active = self.active.saturating_add(dispatch.added);
        // Reported before the rank's last sample arrived but folded after it was measured (the
        // report waited in the book's queue): the measure read it as foreign, as `sampled`
        // would not have.
        if self.sampled_at.is_some_and(|sampled| dispatch.at < sampled) {
            self.foreign = self.foreign.map(|f| f.saturating_sub(dispatch.added));
            self.foreign_prefill = self.foreign_prefill.map(|f| f.saturating_sub(dispatch.prompt_tokens));
        }
        if dispatch.awaits_estimate() {
            self.awaiting_estimate.insert((dispatch.at, id));
        }
        if dispatch.may_stall {
            self.stallable.insert((dispatch.at, id));
        }
        self.dispatches.insert(id, dispatch);
    }

    /// Measures a new sample against the dispatches in flight before it arrived, and those
    /// that ended (or, for its prefill queue, were answered) too shortly before it for the
    /// worker to have published it.
    pub(super) fn sampled(&mut self, received_at: Option<Instant>, load: Option<&Load>) {
        self.sampled_at = received_at;
        let Some(at) = received_at else {
            self.foreign = None;
            self.foreign_prefill = None;
            return;
        };
        // An engine that counts its queued prompts (SGLang, TensorRT-LLM) counts the fleet's
        // dispatches it had received: those are the fleet's to count until their first token,
        // so only the rest of what the sample shows is added to them.
        let queued_then = |started: Instant, done: Option<Instant>, tokens: u64| {
            let queued = started < at && done.is_none_or(|t| at.saturating_duration_since(t) < SAMPLE_LAG);
            if queued { tokens } else { 0 }
        };
        let in_flight = self.dispatches.values().map(|d| queued_then(d.at, d.answered, d.prompt_tokens));
        // A prefill leg ends with its first token: its prompt may still be in the sample too.
        let ended = self.ended.iter().map(|e| queued_then(e.started, Some(e.prompt_done), e.prompt_tokens));
        let queued = in_flight.chain(ended).fold(0u64, u64::saturating_add);
        self.foreign_prefill = load.and_then(|l| l.active_prefill_tokens).map(|shown| shown.saturating_sub(queued));
        // What was in flight when it arrived: everything less what started since.
        let since = self.dispatches.values().filter(|d| d.at >= at).map(|d| d.added).fold(0u64, u64::saturating_add);
        let in_flight = self.active.saturating_sub(since);
        let lately = self.ended.iter().filter(|e| at.saturating_duration_since(e.at) < SAMPLE_LAG).map(|e| e.blocks);
        let own = lately.fold(in_flight, u64::saturating_add);
        self.foreign = load.and_then(decode_blocks).map(|shown| shown.saturating_sub(own));
    }

    /// Its first token came at `at`: it is now decoding.
    pub(super) fn answered(&mut self, id: (u64, u64), at: Instant) {
        let Some(dispatch) = self.dispatches.get_mut(&id) else { return };
        let tokens = dispatch.prefill_tokens();
        let dispatched = dispatch.at;
        // The worker answered it: it stalls nothing now, whatever the samples say.
        self.stallable.remove(&(dispatched, id));
        if dispatch.answered.is_none() {
            // A buffered dispatch is not expected to be answered; if it is, the report wins.
            self.prefill_queue.remove(&(dispatched, id));
            self.awaiting_estimate.remove(&(dispatched, id));
            dispatch.answered = Some(at);
            let waited = at.saturating_duration_since(dispatch.at);
            // A report's events share its instant: a first token in the report that started
            // its dispatch measures nothing (a wait of 0 would drag every estimate down, and
            // one replica's reports would skew what every replica is told).
            let measured = !dispatch.replayed && at > dispatch.at;
            if measured {
                Timing::observe(&mut self.timing.first_token, waited);
            }
            if measured && dispatch.alone {
                self.timing.prefill.observe(tokens, waited);
            }
        }
        if tokens > 0 {
            // The next prefill on the rank begins no earlier.
            self.last_answered = self.last_answered.max(Some(at));
            // And the rank prefills in order: the buffered prompts dispatched before this one
            // are done too.
            while let Some(earlier) = self.awaiting_estimate.first().copied().filter(|e| *e < (dispatched, id)) {
                self.estimated(earlier, at);
            }
        }
    }

    /// Whether the rank is stalled at `now`, its newest sample received at `sampled_at` (the
    /// seed's rule, fleet-wide): one of its stallable dispatches has waited [`STALL_AFTER`]
    /// unanswered, and less than [`DISPATCH_MAX_AGE`]. A sample answers the dispatches reported
    /// up to [`SAMPLE_LAG`] after it arrived: the report of a dispatch reaches the book after the
    /// request itself may have reached the worker, and the worker's sample the book before it.
    /// A stall the lag hides is still its replica's to see. Whether that changed.
    pub(super) fn restall(&mut self, sampled_at: Option<Instant>, now: Instant) -> bool {
        self.heard_at = self.heard_at.max(sampled_at);
        let answered_until = self.heard_at.and_then(|at| at.checked_add(SAMPLE_LAG));
        let from = answered_until.into_iter().chain(now.checked_sub(DISPATCH_MAX_AGE)).max();
        // The first dispatched after `from`, without a walk over those answered before it.
        let first = match from {
            Some(from) => self.stallable.range((Excluded((from, (u64::MAX, u64::MAX))), Unbounded)).next(),
            None => self.stallable.first(),
        };
        let stalled = first.is_some_and(|(at, _)| now.saturating_duration_since(*at) >= STALL_AFTER);
        std::mem::replace(&mut self.stalled, stalled) != stalled
    }

    /// Whether the rank's dispatches may be walked at `now` ([`WALK_BUDGET`]); if so, when
    /// they may be next: no sooner than `book_windows` windows on ([`BOOK_WALK_BUDGET`]).
    pub(super) fn walk_due(&mut self, now: Instant, book_windows: u32) -> bool {
        if self.walk_after.is_some_and(|after| now < after) {
            return false;
        }
        let windows = u32::try_from(self.dispatches.len() / WALK_BUDGET).unwrap_or(u32::MAX).max(book_windows);
        self.walk_after = (windows > 0).then(|| now + BACKLOG_WINDOW.saturating_mul(windows));
        true
    }

    /// Recounts what moves with time alone: the blocks expected to end before a hand-over
    /// (when the rank may be `walk`ed) and the tokens of the prefill under way expected to be
    /// done; whether either moved.
    pub(super) fn refresh_timed(&mut self, now: Instant, walk: bool) -> bool {
        let deemed = self.deem_prefilled(now);
        let prefilled = self.prefill_progress(now);
        let prefilled_moved = std::mem::replace(&mut self.prefilled, prefilled) != prefilled;
        let ending = match self.timing.ending_after() {
            _ if !walk => self.ending,
            Some(after) => self
                .dispatches
                .values()
                .filter(|d| d.answered.is_some_and(|at| now.saturating_duration_since(at) >= after))
                .map(|d| d.added)
                .fold(0u64, u64::saturating_add),
            None => 0,
        };
        let ending_moved = std::mem::replace(&mut self.ending, ending) != ending;
        deemed || prefilled_moved || ending_moved
    }

    /// Takes the prompts of buffered dispatches as prefilled when they should be, since no
    /// first token will say so: one at the head of the rank's prefill queue once its expected
    /// prefill time has passed since it began (its dispatch, or the previous first token), and
    /// the next one then begins; and any once [`DISPATCH_MAX_AGE`] has passed since its
    /// dispatch, which is all a rank with no prefill time learned yet has (the seed's bound on
    /// an unanswered dispatch). A first token reported for a later dispatch takes them too
    /// ([`Rank::answered`]). Whether any was taken.
    pub(super) fn deem_prefilled(&mut self, now: Instant) -> bool {
        let mut deemed = false;
        // Oldest first, so the first one younger than the bound ends the walk.
        while let Some(first) = self.awaiting_estimate.first().copied() {
            let Some(expired) = first.0.checked_add(DISPATCH_MAX_AGE).filter(|at| *at <= now) else { break };
            self.estimated(first, expired);
            deemed = true;
        }
        // The prefill queue in order: several at its head may be done by now (a replay, or a
        // tick that came late).
        while let Some(head) = self.prefill_queue.first().copied() {
            let Some(done) = self.due(head.1, now) else { break };
            self.estimated(head, done);
            // A replayed one was dispatched before the estimates that moved `last_answered`.
            if self.dispatches.get(&head.1).is_some_and(|d| !d.replayed) {
                self.last_answered = Some(done);
            }
            deemed = true;
        }
        deemed
    }

    /// Takes the prompt of buffered dispatch `queued` as prefilled at `at`, out of the queues.
    fn estimated(&mut self, queued: Queued, at: Instant) {
        self.prefill_queue.remove(&queued);
        self.awaiting_estimate.remove(&queued);
        if let Some(dispatch) = self.dispatches.get_mut(&queued.1) {
            dispatch.estimate_answered(at);
        }
    }

    /// The rank's oldest dispatch still prefilling: the head of its prefill queue.
    pub(super) fn prefill_head(&self) -> Option<(&(u64, u64), &Dispatch)> {
        let (_, id) = self.prefill_queue.first()?;
        self.dispatches.get_key_value(id)
    }

    /// When buffered dispatch `id`, at the head of the rank's prefill queue, should have been
    /// prefilled, if by `now`. A replayed one began at its dispatch at the latest: the prompts
    /// estimated since may have been queued behind it.
    pub(super) fn due(&self, id: (u64, u64), now: Instant) -> Option<Instant> {
        let dispatch = self.dispatches.get(&id).filter(|d| d.awaits_estimate())?;
        let expected = self.timing.prefill.expected(dispatch.prompt_tokens)?;
        let began = match self.last_answered {
            Some(answered) if !dispatch.replayed => answered.max(dispatch.at),
            _ => dispatch.at,
        };
        began.checked_add(expected).filter(|done| *done <= now)
    }

    /// The tokens of the rank's oldest dispatch still prefilling that should be
    /// prefilled by `now`: it began when it was dispatched or when the rank's previous first
    /// token came (it waited for that prefill), whichever is later.
    pub(super) fn prefill_progress(&self, now: Instant) -> u64 {
        let Some((_, head)) = self.prefill_head() else { return 0 };
        let began = self.last_answered.map_or(head.at, |answered| answered.max(head.at));
        let tokens = head.prefill_tokens();
        let steps = self.timing.progress_steps(tokens, now.saturating_duration_since(began));
        tokens.saturating_mul(steps) / PROGRESS_STEPS
    }

    /// Ends dispatch `id` on `rank`, as its replica reported; returns the hashes it held.
    pub(super) fn end(&mut self, id: (u64, u64), now: Instant, active: &ActiveIndex, rank: RankKey) -> usize {
        let Some((dispatch, freed)) = self.remove(id, active, rank) else { return 0 };
        // Nor does an end in the report of its first token (see `answered`).
        let measured = |answered: &Instant| !dispatch.replayed && !dispatch.answer_estimated && now > *answered;
        if let Some(answered) = dispatch.answered.filter(measured) {
            Timing::observe(&mut self.timing.decode, now.saturating_duration_since(answered));
        }
        self.last_end = Some(now);
        self.ended.push_back(Ended {
            at: now,
            blocks: freed,
            started: dispatch.at,
            prompt_done: dispatch.answered.unwrap_or(now),
            prompt_tokens: dispatch.prompt_tokens,
        });
        // `ending` is recounted by the publish check (`Book::expire`) before any sum is taken,
        // not here: recounting walks every dispatch of the rank, and ends come one by one.
        while self.ended.len() > MAX_ENDED_PER_RANK
            || self.ended.front().is_some_and(|e| now.saturating_duration_since(e.at) >= SAMPLE_LAG)
        {
            self.ended.pop_front();
        }
        dispatch.block_hashes.len()
    }

    /// Drops dispatch `id` without its end: its replica's stream ended (the next one reports
    /// it again if it is still in flight), or its end never came. Its time is no decode time.
    /// The rank does not settle before a sample after it, as after an end: a replay on the
    /// replica's next stream finds the rank's timings and its place in the dispatch order
    /// still there. Returns the hashes it held.
    pub(super) fn forget(&mut self, id: (u64, u64), now: Instant, active: &ActiveIndex, rank: RankKey) -> usize {
        let Some((dispatch, freed)) = self.remove(id, active, rank) else { return 0 };
        // The last sample, measured with it in flight, took it for the fleet's own: it runs on
        // (its replica's stream ended, not its request), so that sample's share of it is
        // foreign now, as `sampled` would count it, until the next sample or its replay (whose
        // start takes it back). Else the rank would read lighter by it meanwhile, twice over
        // once replayed.
        if let Some(sampled) = self.sampled_at.filter(|sampled| dispatch.at < *sampled) {
            self.foreign = self.foreign.map(|f| f.saturating_add(freed));
            if dispatch.answered.is_none_or(|t| sampled.saturating_duration_since(t) < SAMPLE_LAG) {
                self.foreign_prefill = self.foreign_prefill.map(|f| f.saturating_add(dispatch.prompt_tokens));
            }
        }
        self.last_end = Some(now);
        dispatch.block_hashes.len()
    }

    /// Takes dispatch `id` out, giving back the blocks only it held; returns it and them.
    pub(super) fn remove(&mut self, id: (u64, u64), active: &ActiveIndex, rank: RankKey) -> Option<(Dispatch, u64)> {
        let dispatch = self.dispatches.remove(&id)?;
        // A rank kept by one dispatch after a flood of them must not keep the flood's room.
        shrink_when_sparse(&mut self.dispatches);
        self.prefill_queue.remove(&(dispatch.at, id));
        self.awaiting_estimate.remove(&(dispatch.at, id));
        self.stallable.remove(&(dispatch.at, id));
        let freed = active.remove(rank, &dispatch.block_hashes, dispatch.decode_blocks);
        self.active = self.active.saturating_sub(freed);
        Some((dispatch, freed))
    }

    /// Nothing in flight, and a sample shows the worker as it is: one received [`SAMPLE_LAG`]
    /// after the last dispatch ended or was forgotten (an earlier one may still show the ended
    /// requests, and without the sums a picker would read them as load).
    pub(super) fn settled(&self, now: Instant) -> bool {
        self.dispatches.is_empty()
            && self.last_end.is_none_or(|end| {
                self.sampled_at.is_some_and(|at| at.saturating_duration_since(end) >= SAMPLE_LAG)
                    || now.saturating_duration_since(end) >= DISPATCH_MAX_AGE
            })
    }
}

/// A sample's decode backlog, as the pickers read it: `active_decode_blocks`, else
/// `kv_used_blocks` (dynamo.vllm and the mocker fill only the latter).
pub(super) fn decode_blocks(load: &Load) -> Option<u64> {
    load.active_decode_blocks.or(load.kv_used_blocks)
}
