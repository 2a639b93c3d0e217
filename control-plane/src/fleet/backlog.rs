//! Fleet-wide dispatch accounting.
//!
//! Every replica reports the requests it pins (and their end) on its Watch stream. The book
//! keeps each dispatch until it ends and publishes per-rank sums as backlogs in the fleet view,
//! so every replica sees the requests all replicas have in flight. Without it N replicas choose
//! the same "least loaded" worker between two samples (Dynamo #589; SGLang's gateway shares the
//! problem).
//!
//! Decode load is tracked the way Dynamo's KV router tracks it, from the requests the router itself
//! sent, because a worker's samples lag in both directions: a sample taken just before a burst of
//! requests finished still shows their blocks (every replica then sends the next burst elsewhere),
//! and a sample taken before a new request reached the engine does not show it yet. The book
//! therefore publishes, per rank, the distinct blocks of every dispatch in flight (a block several
//! dispatches share counts once, while any of them holds it: see [`ActiveIndex`], which
//! `FindMatches` reads too) plus the *foreign* part of the last sample: what it showed beyond the
//! dispatches in flight when it arrived (load the fleet did not send, such as another router's);
//! ends shortly before a sample may still be in it, so they do not count as foreign. Prefill tokens
//! count until the response begins (the replica reports the first token), again as Dynamo's router
//! does. A buffered answer (`stream` false) has no first token the replica could see, only its end,
//! which for a long answer comes seconds after its prompt was done: its prompt is taken as
//! prefilled when the rank's prefills, as learned from the streamed ones (below), say it should be,
//! or a later dispatch's first token comes, and after the seed's 30 seconds at most. Dynamo's
//! frontend streams from the engine even for such a request and sees its first token; counting its
//! prompt to the end would make a rank serving long buffered answers look as if it had a queue of
//! prompts it finished long ago.
//!
//! A decode worker paired with prefill workers receives a request only after its prefill, and
//! the replicas must pin it when they dispatch (direct mode), where Dynamo's frontend picks it
//! at hand-over. Its backlog then should not count the requests that will have ended by the
//! time the new one arrives. Each rank learns how long its requests decode (first token to end)
//! and how long they take to answer (dispatch to first token); a dispatch that has decoded for
//! longer than its expected decode time less about half the time to answer (the prefill's
//! share of it, to the hand-over) is published as *ending* ([`Timing`]). The replicas discount
//! it only when pinning a decode worker that receives the request by hand-over.
//!
//! A rank's prefills run one after another, so a request sent to it waits for the rest of the one
//! under way, not for all of it. The book publishes how far that one should have got: the oldest
//! dispatch still awaiting its first token began prefilling when it was dispatched or when the
//! rank's previous first token came (reported, or estimated for a buffered answer), whichever is
//! later, and a prefill of its size takes about what the rank's dispatches that found nothing else
//! prefilling took to their first token ([`prefill_time::PrefillTime`]: a line through their sizes
//! and times). Its tokens times the elapsed share, in eighths (so the sum moves a few times per
//! prefill, not every window) and at most seven of them, are published as *prefilled*. Without it
//! the seed's formula counts a prefill whole until its first token, and two ranks each prefilling
//! one prompt look alike however near one is to done (`docs/kv.md`).
//!
//! A dispatch leaves the book when it ends, when its replica disconnects, or after
//! [`IN_FLIGHT_MAX_AGE`] (a lost end). A rank's record is removed once nothing is in flight and
//! a sample received [`SAMPLE_LAG`] after the last end shows what the worker holds, or
//! [`DISPATCH_MAX_AGE`] after that end if none comes. Its published backlog is then zero but
//! for its place in the fleet's dispatch order (`last_dispatch`): pickers send ties to the rank
//! idle longest, and a rank that settles within a request's time would otherwise look idle
//! forever, taking every tie of a trickle of requests. What the rank learned of its times is
//! kept aside for its next dispatch, while its worker serves it.
//!
//! One task owns the book (commands over a bounded channel). The first change after a quiet
//! [`BACKLOG_WINDOW`] is published at once; after that, changes are published at most once per
//! window. The task does not wake per window while the book holds nothing.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;
use continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES;
use continuum_proto::fast_hash::{FastMap, SeededMap};
use continuum_proto::model::{Backlog, Load, LoadKey, ReportsFolded, Worker};
use continuum_proto::pb;

use super::{ActiveIndex, FleetChange, FleetState};

mod prefill_time;
mod task;
mod timing;
pub use task::{BacklogBook, BookCounters};
#[cfg(test)]
use task::{COMMAND_QUEUE, report_bytes};
use timing::Timing;

/// A dispatch no sample has answered adds its prefill tokens this long at most (the seed's 30
/// seconds); a rank's record outlives its last end by at most this long.
pub const DISPATCH_MAX_AGE: Duration = Duration::from_secs(30);
/// A dispatch whose end never arrives stops counting after this long.
pub const IN_FLIGHT_MAX_AGE: Duration = Duration::from_secs(600);
/// Outstanding dispatches one replica may hold in the book; more are refused and counted.
pub const MAX_DISPATCHES_PER_REPLICA: usize = 65_536;
/// Outstanding dispatches the book holds across every replica, first come; past it only a
/// replica holding less than an equal share of it may start more, up to twice it in all (see
/// [`Book::full_for`]). A fleet of 64 replicas with 4,096 requests in flight each fits.
pub const MAX_DISPATCHES: usize = 1 << 18;
/// Bytes of reports waiting for the book at most (besides the count bound of its queue): past
/// it a report is dropped and its session ended, as when the queue is full.
pub const MAX_QUEUED_REPORT_BYTES: usize = 64 << 20;
/// A dispatch reported with more decode blocks than this (16 Mi tokens at 16 a block) is
/// refused: no request is that long, and sums of it would drown every real one on its rank.
pub const MAX_REPORTED_DECODE_BLOCKS: u64 = 1 << 20;
/// A dispatch reported with more prompt tokens to prefill than this is refused, likewise.
pub const MAX_REPORTED_PREFILL_TOKENS: u64 = 1 << 24;
/// Backlog changes are published at most this often: short, so a burst spreads across replicas.
pub const BACKLOG_WINDOW: Duration = Duration::from_millis(2);
/// A sample received this soon after a dispatch ended may still show its blocks: workers
/// publish on their own schedule (the 1.6.1 mocker every 50–200 ms per rank under load).
pub const SAMPLE_LAG: Duration = Duration::from_millis(250);
/// A prefill under way is credited in steps of one part in this many of its expected time.
pub(super) const PROGRESS_STEPS: u64 = 8;
/// How often the timings of settled ranks are pruned of ranks the fleet no longer has.
const PRUNE_LEARNED_EVERY: Duration = Duration::from_secs(1);
/// Ended dispatches remembered per rank for that, at most.
const MAX_ENDED_PER_RANK: usize = 4096;
/// Gives back what a vector of block hashes no longer holds once cut, when that is most of it:
/// a dispatch keeps its chain for as long as it is in flight.
pub(crate) fn fit(hashes: &mut Vec<u64>) {
    if hashes.capacity() > 2 * hashes.len() + 16 {
        hashes.shrink_to_fit();
    }
}

#[derive(Debug, Clone, Copy)]
struct Ended {
    at: Instant,
    /// The blocks the end freed on the rank.
    blocks: u64,
    /// When it was dispatched, and when its prompt stopped queueing on the rank (its first
    /// token, or its end if none came), with the prompt's tokens: a sample received shortly
    /// after may still count them.
    started: Instant,
    prompt_done: Instant,
    prompt_tokens: u64,
}

#[derive(Debug)]
struct Dispatch {
    /// Prompt tokens it brought to prefill (see [`Dispatch::prefill_tokens`]).
    prompt_tokens: u64,
    decode_blocks: u64,
    /// The prompt's prefix chain, for counting shared blocks once; empty past the book's bound.
    block_hashes: Vec<u64>,
    /// The blocks it added to its rank's distinct total when it started.
    added: u64,
    at: Instant,
    /// When its first token was reported, or, for a buffered dispatch, when the book took its
    /// prompt as prefilled.
    answered: Option<Instant>,
    /// Its client asked for the answer whole ([`pb::DispatchStarted::buffered`]): no first token
    /// will be reported, so its prompt is taken as prefilled by time ([`Rank::deem_prefilled`]).
    buffered: bool,
    /// `answered` is the book's estimate, not a report: no time to learn from.
    answer_estimated: bool,
    /// It had tokens to prefill, and no other dispatch on its rank was prefilling when it
    /// started: its time to first token is a prefill's alone.
    alone: bool,
    /// Reported again on a new stream ([`pb::DispatchStarted::replayed`]): its times are not
    /// the rank's to learn from.
    replayed: bool,
}

impl Dispatch {
    /// Prompt tokens still to prefill on the rank: all of them until its first token, then none.
    fn prefill_tokens(&self) -> u64 {
        if self.answered.is_none() { self.prompt_tokens } else { 0 }
    }

    /// A buffered dispatch whose prompt the book has yet to take as prefilled.
    fn awaits_estimate(&self) -> bool {
        self.buffered && self.prefill_tokens() > 0
    }

    /// Its prompt is taken as prefilled at `at`: an estimate, not a report.
    fn estimate_answered(&mut self, at: Instant) {
        self.answered = Some(at);
        self.answer_estimated = true;
    }
}

/// One rank's dispatches in flight and what its last sample showed beyond them.
#[derive(Debug)]
struct Rank {
    /// The rank's key in the fleet view (its backlog's, its samples').
    key: LoadKey,
    /// By session and the replica's dispatch id.
    dispatches: SeededMap<(u64, u64), Dispatch>,
    /// How many of `dispatches` await the estimate of their first token
    /// ([`Dispatch::awaits_estimate`]): with none, the book spends nothing on them.
    buffered_waiting: usize,
    /// How many of `dispatches` are still prefilling ([`Dispatch::prefill_tokens`] above 0): a
    /// start learns whether it prefills alone without a look at every dispatch in flight.
    prefilling: usize,
    /// The distinct decode blocks of `dispatches` (their hashes are in the book's
    /// [`ActiveIndex`]).
    active: u64,
    /// When the sample `foreign` was measured against was received.
    sampled_at: Option<Instant>,
    /// Decode blocks that sample showed beyond the dispatches in flight when it arrived;
    /// `None` without a sample carrying decode blocks.
    foreign: Option<u64>,
    /// Prompt tokens that sample showed beyond the dispatches then awaiting their first token;
    /// `None` without a sample carrying `active_prefill_tokens`.
    foreign_prefill: Option<u64>,
    /// When the last dispatch on this rank ended.
    last_end: Option<Instant>,
    /// Dispatches ended within [`SAMPLE_LAG`], oldest first.
    ended: VecDeque<Ended>,
    /// What was last published (without its time), so an unchanged sum is not streamed again.
    published: Option<Backlog>,
    /// The worker as the view held it when last looked at: a new one (the worker removed and
    /// added again, or changed) may hold none of what was published for the old.
    worker: Option<Arc<Worker>>,
    /// Marked for the next publish check (its key is in the book's `dirty`).
    dirty: bool,
    timing: Timing,
    /// The blocks of the dispatches in flight expected to end before a hand-over (see
    /// [`Timing::ending_after`]), as of the last [`Rank::refresh_timed`].
    ending: u64,
    /// The tokens of the prefill under way expected to be done, as of the last
    /// [`Rank::refresh_timed`].
    prefilled: u64,
    /// When the rank's latest prefill ended (its first token was reported).
    last_answered: Option<Instant>,
    /// The book's count of dispatches folded when the rank's newest was (see
    /// [`Backlog::last_dispatch`]).
    last_dispatch: u64,
}

impl Rank {
    /// Whether the view's worker for this rank is another than the one last seen (it was
    /// removed and added again, or changed); remembers the one seen now.
    fn worker_came_back(&mut self, state: &FleetState) -> bool {
        let Some(current) = state.view().worker(&self.key.worker) else { return false };
        let seen = self.worker.replace(Arc::clone(current));
        seen.is_some_and(|seen| !Arc::ptr_eq(&seen, current))
    }

    /// A new record starts from the sample the view holds now, so that sample's whole backlog
    /// counts as foreign until the next one.
    fn new(key: LoadKey, state: &FleetState) -> Self {
        let sample = state.view().loads().get(&key);
        let worker = state.view().worker(&key.worker).cloned();
        let mut rank = Rank {
            key,
            dispatches: SeededMap::default(),
            buffered_waiting: 0,
            prefilling: 0,
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
        };
        rank.sampled(sample.map(|s| s.received_at), sample.map(|s| &s.load));
        rank
    }

    fn backlog(&self) -> Backlog {
        let mut backlog = Backlog {
            foreign_decode_blocks: self.foreign,
            foreign_prefill_tokens: self.foreign_prefill,
            decode_blocks: self.active,
            ending_decode_blocks: self.ending.min(self.active),
            last_dispatch: self.last_dispatch,
            ..Backlog::default()
        };
        for dispatch in self.dispatches.values() {
            backlog.prefill_tokens = backlog.prefill_tokens.saturating_add(dispatch.prefill_tokens());
            backlog.dispatches = backlog.dispatches.saturating_add(1);
        }
        backlog.prefilled_tokens = self.prefilled.min(backlog.prefill_tokens);
        backlog
    }

    /// A dispatch's prompt tokens and decode blocks, each at most what one request can hold on
    /// the rank: its worker's context length and KV blocks, when its card declares them. A
    /// request the rank could never hold would otherwise weigh on it, for every replica,
    /// beyond full until it ended (or for [`IN_FLIGHT_MAX_AGE`] if its end were lost).
    fn at_most_whole(&self, prompt_tokens: u64, decode_blocks: u64) -> (u64, u64) {
        let Some(capacity) = self.worker.as_ref().map(|w| &w.capacity) else { return (prompt_tokens, decode_blocks) };
        let at_most = |n: u64, limit: Option<u64>| limit.filter(|l| *l > 0).map_or(n, |l| n.min(l));
        (at_most(prompt_tokens, capacity.context_length), at_most(decode_blocks, capacity.total_kv_blocks))
    }

    /// Starts dispatch `id` (new to the book) on `rank`, whose blocks `active` holds.
    fn start(&mut self, id: (u64, u64), mut dispatch: Dispatch, active: &ActiveIndex, rank: RankKey) {
        let prefills = dispatch.prefill_tokens() > 0;
        dispatch.alone = !dispatch.replayed && prefills && self.prefilling == 0;
        self.prefilling += usize::from(prefills);
        dispatch.added = active.add(rank, &dispatch.block_hashes, dispatch.decode_blocks);
        self.active = self.active.saturating_add(dispatch.added);
        // Reported before the rank's last sample arrived but folded after it was measured (the
        // report waited in the book's queue): the measure read it as foreign, as `sampled`
        // would not have.
        if self.sampled_at.is_some_and(|sampled| dispatch.at < sampled) {
            self.foreign = self.foreign.map(|f| f.saturating_sub(dispatch.added));
            self.foreign_prefill = self.foreign_prefill.map(|f| f.saturating_sub(dispatch.prompt_tokens));
        }
        self.buffered_waiting += usize::from(dispatch.awaits_estimate());
        self.dispatches.insert(id, dispatch);
    }

    /// Measures a new sample against the dispatches in flight before it arrived, and those
    /// that ended (or, for its prefill queue, were answered) too shortly before it for the
    /// worker to have published it.
    fn sampled(&mut self, received_at: Option<Instant>, load: Option<&Load>) {
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
    fn answered(&mut self, id: (u64, u64), at: Instant) {
        let Some(dispatch) = self.dispatches.get_mut(&id) else { return };
        let tokens = dispatch.prefill_tokens();
        let dispatched = dispatch.at;
        if dispatch.answered.is_none() {
            // A buffered dispatch is not expected to be answered; if it is, the report wins.
            self.buffered_waiting = self.buffered_waiting.saturating_sub(usize::from(dispatch.awaits_estimate()));
            self.prefilling = self.prefilling.saturating_sub(usize::from(tokens > 0));
            dispatch.answered = Some(at);
            let waited = at.saturating_duration_since(dispatch.at);
            if !dispatch.replayed {
                Timing::observe(&mut self.timing.first_token, waited);
            }
            if dispatch.alone {
                self.timing.prefill.observe(tokens, waited);
            }
        }
        if tokens > 0 {
            // The next prefill on the rank begins no earlier.
            self.last_answered = self.last_answered.max(Some(at));
            // And the rank prefills in order: the buffered prompts dispatched before this one
            // are done too.
            if self.buffered_waiting > 0 {
                let before = |key: &(u64, u64), d: &Dispatch| d.awaits_estimate() && (d.at, *key) < (dispatched, id);
                for (_, earlier) in self.dispatches.iter_mut().filter(|(key, d)| before(key, d)) {
                    earlier.estimate_answered(at);
                    self.buffered_waiting = self.buffered_waiting.saturating_sub(1);
                    self.prefilling = self.prefilling.saturating_sub(1);
                }
            }
        }
    }

    /// Recounts what moves with time alone: the blocks expected to end before a hand-over and
    /// the tokens of the prefill under way expected to be done; whether either moved.
    fn refresh_timed(&mut self, now: Instant) -> bool {
        let deemed = self.deem_prefilled(now);
        let prefilled = self.prefill_progress(now);
        let prefilled_moved = std::mem::replace(&mut self.prefilled, prefilled) != prefilled;
        let ending = match self.timing.ending_after() {
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
    fn deem_prefilled(&mut self, now: Instant) -> bool {
        if self.buffered_waiting == 0 {
            return false;
        }
        let mut deemed = false;
        for dispatch in self.dispatches.values_mut().filter(|d| d.awaits_estimate()) {
            if let Some(expired) = dispatch.at.checked_add(DISPATCH_MAX_AGE).filter(|at| *at <= now) {
                dispatch.estimate_answered(expired);
                self.buffered_waiting = self.buffered_waiting.saturating_sub(1);
                self.prefilling = self.prefilling.saturating_sub(1);
                deemed = true;
            }
        }
        if self.prefill_head().is_none_or(|(id, _)| self.due(*id, now).is_none()) {
            return deemed;
        }
        // The prefill queue in order, sorted only when its head is done: several may be by
        // now (a replay, or a tick that came late).
        let mut queue: Vec<(Instant, (u64, u64))> =
            self.dispatches.iter().filter(|(_, d)| d.prefill_tokens() > 0).map(|(id, d)| (d.at, *id)).collect();
        queue.sort_unstable();
        for (_, id) in queue {
            let Some(done) = self.due(id, now) else { break };
            let Some(head) = self.dispatches.get_mut(&id) else { break };
            head.estimate_answered(done);
            self.buffered_waiting = self.buffered_waiting.saturating_sub(1);
            self.prefilling = self.prefilling.saturating_sub(1);
            // A replayed one was dispatched before the estimates that moved `last_answered`.
            if !head.replayed {
                self.last_answered = Some(done);
            }
            deemed = true;
        }
        deemed
    }

    /// The rank's oldest dispatch still prefilling: the head of its prefill queue.
    fn prefill_head(&self) -> Option<(&(u64, u64), &Dispatch)> {
        if self.prefilling == 0 {
            return None;
        }
        self.dispatches.iter().filter(|(_, d)| d.prefill_tokens() > 0).min_by_key(|(id, d)| (d.at, **id))
    }

    /// When buffered dispatch `id`, at the head of the rank's prefill queue, should have been
    /// prefilled, if by `now`. A replayed one began at its dispatch at the latest: the prompts
    /// estimated since may have been queued behind it.
    fn due(&self, id: (u64, u64), now: Instant) -> Option<Instant> {
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
    fn prefill_progress(&self, now: Instant) -> u64 {
        let Some((_, head)) = self.prefill_head() else { return 0 };
        let began = self.last_answered.map_or(head.at, |answered| answered.max(head.at));
        let tokens = head.prefill_tokens();
        let steps = self.timing.progress_steps(tokens, now.saturating_duration_since(began));
        tokens.saturating_mul(steps) / PROGRESS_STEPS
    }

    /// Ends dispatch `id` on `rank`, as its replica reported; returns the hashes it held.
    fn end(&mut self, id: (u64, u64), now: Instant, active: &ActiveIndex, rank: RankKey) -> usize {
        let Some((dispatch, freed)) = self.remove(id, active, rank) else { return 0 };
        if let Some(answered) = dispatch.answered.filter(|_| !dispatch.replayed && !dispatch.answer_estimated) {
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
    fn forget(&mut self, id: (u64, u64), now: Instant, active: &ActiveIndex, rank: RankKey) -> usize {
        let Some((dispatch, _)) = self.remove(id, active, rank) else { return 0 };
        self.last_end = Some(now);
        dispatch.block_hashes.len()
    }

    /// Takes dispatch `id` out, giving back the blocks only it held; returns it and them.
    fn remove(&mut self, id: (u64, u64), active: &ActiveIndex, rank: RankKey) -> Option<(Dispatch, u64)> {
        let dispatch = self.dispatches.remove(&id)?;
        self.buffered_waiting = self.buffered_waiting.saturating_sub(usize::from(dispatch.awaits_estimate()));
        self.prefilling = self.prefilling.saturating_sub(usize::from(dispatch.prefill_tokens() > 0));
        let freed = active.remove(rank, &dispatch.block_hashes, dispatch.decode_blocks);
        self.active = self.active.saturating_sub(freed);
        Some((dispatch, freed))
    }

    /// Nothing in flight, and a sample shows the worker as it is: one received [`SAMPLE_LAG`]
    /// after the last dispatch ended or was forgotten (an earlier one may still show the ended
    /// requests, and without the sums a picker would read them as load).
    fn settled(&self, now: Instant) -> bool {
        self.dispatches.is_empty()
            && self.last_end.is_none_or(|end| {
                self.sampled_at.is_some_and(|at| at.saturating_duration_since(end) >= SAMPLE_LAG)
                    || now.saturating_duration_since(end) >= DISPATCH_MAX_AGE
            })
    }
}

/// A sample's decode backlog, as the pickers read it: `active_decode_blocks`, else
/// `kv_used_blocks` (dynamo.vllm and the mocker fill only the latter).
fn decode_blocks(load: &Load) -> Option<u64> {
    load.active_decode_blocks.or(load.kv_used_blocks)
}

/// Marks `rank` (kept under `key`) for the next publish check, once however often it moves.
fn mark(dirty: &mut Vec<RankKey>, key: RankKey, rank: &mut Rank) {
    if !rank.dirty {
        rank.dirty = true;
        dirty.push(key);
    }
}

/// The book's key for a reported rank, the one a `FindMatches` answer names, read without
/// allocating; `None` without a worker. Instance ids are Dynamo lease ids, unique across
/// namespaces, so two integers stand for the rank's [`LoadKey`] without its namespace to hash,
/// compare or allocate for every dispatch reported.
fn reported_rank(key: &pb::LoadKey) -> Option<RankKey> {
    let worker = key.worker.as_ref()?;
    Some(RankKey { worker_id: worker.instance_id, dp_rank: key.dp_rank })
}

/// Why the book refused a reported start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It named no rank, or one the fleet does not have (the replica's view was behind).
    UnknownRank,
    /// More prompt tokens or decode blocks than any request could have.
    Implausible,
    /// Its replica holds [`MAX_DISPATCHES_PER_REPLICA`] already.
    ReplicaFull,
    /// The book is full for its replica ([`Book::full_for`]).
    BookFull,
}

impl Refusal {
    pub const ALL: [Refusal; 4] = [Refusal::UnknownRank, Refusal::Implausible, Refusal::ReplicaFull, Refusal::BookFull];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::UnknownRank => "unknown_rank",
            Refusal::Implausible => "implausible",
            Refusal::ReplicaFull => "replica_full",
            Refusal::BookFull => "book_full",
        }
    }
}

/// Refused starts, by [`Refusal`] (in [`Refusal::ALL`]'s order).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Refused([u64; Refusal::ALL.len()]);

impl Refused {
    fn count(&mut self, refusal: Refusal) {
        self.0[refusal as usize] += 1;
    }

    pub fn of(&self, refusal: Refusal) -> u64 {
        self.0[refusal as usize]
    }

    #[cfg(test)]
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// Whether the fleet view has `key`'s worker, with that dp rank.
fn in_fleet(state: &FleetState, key: &LoadKey) -> bool {
    state.view().worker(&key.worker).is_some_and(|w| w.serves_rank(key.dp_rank))
}

/// The book itself, driven by the task below: pure but for the [`ActiveIndex`] it shares.
#[derive(Debug, Default)]
struct Book {
    ranks: FastMap<RankKey, Rank>,
    /// The hashes of every dispatch in flight, per rank.
    active: ActiveIndex,
    /// Per session, the rank of each of its dispatches in flight, by the replica's id: a
    /// session's go with it ([`Book::replica_gone`]) without a look at any other's.
    where_is: FastMap<u64, SeededMap<u64, RankKey>>,
    /// Dispatches in flight, across every session.
    held: usize,
    /// Ranks whose sums may have moved since the last publish check, each once.
    dirty: Vec<RankKey>,
    /// Block hashes the dispatches in flight hold, at most [`MAX_ACTIVE_BLOCK_HASHES`].
    held_hashes: usize,
    /// Dispatches refused, by [`Refusal`].
    refused: Refused,
    /// Chains not held past the hash bound.
    chains_dropped: u64,
    /// Dispatches replicas reported again on a new stream.
    replayed: u64,
    /// Per replica (session), the operations its reports brought into the sums.
    folded: FastMap<u64, ReportsFolded>,
    /// Dispatches admitted since the book started: each rank's newest is stamped with the
    /// count, which orders ranks by how recently the fleet sent them one.
    dispatched: u64,
    /// What settled ranks had learned ([`Timing`]), for when they take dispatches again: a rank
    /// settles whenever it idles, and would otherwise start every burst knowing nothing of its
    /// prefill and decode times. Only ranks the fleet still has are kept.
    learned: FastMap<RankKey, (LoadKey, Timing)>,
    /// When `learned` was last pruned of ranks the fleet no longer has.
    learned_pruned: Option<Instant>,
}

impl Book {
    fn report(&mut self, replica: u64, report: pb::DispatchReport, at: Instant, state: &FleetState) {
        // A session's reports arrive in the order its replica numbered them.
        if report.last_op > 0 {
            let (first_op, last_op) = (report.first_op, report.last_op);
            let folded = self.folded.entry(replica).or_insert(ReportsFolded { first_op, last_op });
            folded.last_op = folded.last_op.max(last_op);
        }
        // In the replica's order: each start after the first tokens and ends it performed
        // before it, the rest after the last start (a dispatch may start, begin answering and
        // end within one report).
        let (mut prefilled, mut ended) = (report.prefilled.into_iter(), report.ended.into_iter());
        let (mut prefilled_taken, mut ended_taken) = (0, 0);
        for started in report.started {
            while prefilled_taken < started.after_prefilled
                && let Some(id) = prefilled.next()
            {
                self.prefilled((replica, id), at);
                prefilled_taken += 1;
            }
            while ended_taken < started.after_ended
                && let Some(id) = ended.next()
            {
                self.end((replica, id), at);
                ended_taken += 1;
            }
            self.start(replica, started, at, state);
        }
        for id in prefilled {
            self.prefilled((replica, id), at);
        }
        for id in ended {
            self.end((replica, id), at);
        }
    }

    /// One reported start: admitted onto its rank, or refused and counted.
    fn start(&mut self, replica: u64, started: pb::DispatchStarted, at: Instant, state: &FleetState) {
        if let Err(refusal) = self.admit_start(replica, &started, state) {
            self.refused.count(refusal);
            return;
        }
        let Some(key) = started.rank.as_ref().and_then(reported_rank) else { return };
        let id = (replica, started.id);
        // A repeated id replaces its dispatch, which did not end.
        self.forget(id, at);
        // Admitted, so held: ends never remove a record.
        let Some(rank) = self.ranks.get_mut(&key) else { return };
        let (prompt_tokens, decode_blocks) = rank.at_most_whole(started.prefill_tokens, started.decode_blocks);
        let mut block_hashes = started.block_hashes;
        // Only the leading `decode_blocks` are the rank's to hold (none on a prefill leg).
        block_hashes.truncate(usize::try_from(decode_blocks).unwrap_or(usize::MAX));
        fit(&mut block_hashes);
        if self.held_hashes + block_hashes.len() > MAX_ACTIVE_BLOCK_HASHES {
            block_hashes = Vec::new();
            self.chains_dropped += 1;
        }
        self.held_hashes += block_hashes.len();
        let replayed = started.replayed;
        // A replayed dispatch began before its report, by the replica's clock of how long.
        let age = Duration::from_millis(started.age_ms).min(IN_FLIGHT_MAX_AGE);
        let began = if replayed { at.checked_sub(age).unwrap_or(at) } else { at };
        let dispatch = Dispatch {
            prompt_tokens,
            decode_blocks,
            block_hashes,
            added: 0,
            at: began,
            answered: None,
            buffered: started.buffered,
            answer_estimated: false,
            alone: false,
            replayed,
        };
        if replayed {
            self.replayed += 1;
        } else {
            self.dispatched += 1;
            rank.last_dispatch = self.dispatched;
        }
        rank.start(id, dispatch, &self.active, key);
        mark(&mut self.dirty, key, rank);
        self.where_is.entry(replica).or_default().insert(started.id, key);
        self.held += 1;
    }

    /// Whether `replica` may start `started`: a plausible dispatch, on a rank the fleet has
    /// (given its record here), within the replica's bound and the book's.
    fn admit_start(&mut self, replica: u64, started: &pb::DispatchStarted, state: &FleetState) -> Result<(), Refusal> {
        let Some((reported, key)) = started.rank.as_ref().and_then(|r| Some((r, reported_rank(r)?))) else {
            return Err(Refusal::UnknownRank);
        };
        if started.decode_blocks > MAX_REPORTED_DECODE_BLOCKS || started.prefill_tokens > MAX_REPORTED_PREFILL_TOKENS {
            return Err(Refusal::Implausible);
        }
        let held = self.where_is.get(&replica).map_or(0, |session| session.len());
        if held >= MAX_DISPATCHES_PER_REPLICA {
            return Err(Refusal::ReplicaFull);
        }
        if self.full_for(replica, held) {
            return Err(Refusal::BookFull);
        }
        if !self.admit(key, reported, state) {
            return Err(Refusal::UnknownRank);
        }
        Ok(())
    }

    /// Whether the book has no room for one more dispatch of `replica`, which holds `held`.
    /// Room is first come up to [`MAX_DISPATCHES`]; past it a replica holding less than an
    /// equal share of that (among the sessions that have reported) may still start, so that
    /// replicas filling the book, by load or by malice, cannot lock the others out of it; and
    /// none past twice it.
    fn full_for(&self, replica: u64, held: usize) -> bool {
        if self.held < MAX_DISPATCHES {
            return false;
        }
        let sessions = self.where_is.len() + usize::from(!self.where_is.contains_key(&replica));
        self.held >= 2 * MAX_DISPATCHES || held >= MAX_DISPATCHES / sessions
    }

    /// Whether `key`, reported as `reported`, is a rank the fleet has: a report cannot make the
    /// book grow with invented keys. A rank new to the book gets its record here; one the book
    /// holds is looked up by its integers, and the namespace only compared.
    fn admit(&mut self, key: RankKey, reported: &pb::LoadKey, state: &FleetState) -> bool {
        if let Some(rank) = self.ranks.get(&key) {
            let namespace = reported.worker.as_ref().map_or("", |w| w.namespace.as_str());
            return *rank.key.worker.namespace == *namespace && in_fleet(state, &rank.key);
        }
        let Ok(load_key) = LoadKey::try_from(reported.clone()) else { return false };
        if !in_fleet(state, &load_key) {
            return false;
        }
        let mut rank = Rank::new(load_key, state);
        // What it learned before it last settled still holds for its engine.
        if let Some((_, timing)) = self.learned.remove(&key).filter(|(known, _)| *known == rank.key) {
            rank.timing = timing;
        }
        self.ranks.insert(key, rank);
        true
    }

    fn prefilled(&mut self, id: (u64, u64), at: Instant) {
        let Some(&key) = self.where_is.get(&id.0).and_then(|session| session.get(&id.1)) else { return };
        let Some(rank) = self.ranks.get_mut(&key) else { return };
        rank.answered(id, at);
        mark(&mut self.dirty, key, rank);
    }

    fn end(&mut self, id: (u64, u64), now: Instant) {
        self.take(id, |rank, active, key| rank.end(id, now, active, key));
    }

    /// Drops dispatch `id` without an end ([`Rank::forget`]).
    fn forget(&mut self, id: (u64, u64), now: Instant) {
        self.take(id, |rank, active, key| rank.forget(id, now, active, key));
    }

    /// Takes dispatch `id` off its rank with `off`, which returns the hashes it held.
    fn take(&mut self, id: (u64, u64), off: impl FnOnce(&mut Rank, &ActiveIndex, RankKey) -> usize) {
        let Some(key) = self.where_is.get_mut(&id.0).and_then(|session| session.remove(&id.1)) else { return };
        self.take_from(key, off);
    }

    /// Takes a dispatch no longer in `where_is` off rank `key` with `off`.
    fn take_from(&mut self, key: RankKey, off: impl FnOnce(&mut Rank, &ActiveIndex, RankKey) -> usize) {
        self.held = self.held.saturating_sub(1);
        if let Some(rank) = self.ranks.get_mut(&key) {
            self.held_hashes -= off(rank, &self.active, key);
            mark(&mut self.dirty, key, rank);
        }
    }

    fn replica_gone(&mut self, replica: u64, now: Instant) {
        for (id, key) in self.where_is.remove(&replica).unwrap_or_default() {
            self.take_from(key, |rank, active, key| rank.forget((replica, id), now, active, key));
        }
        self.folded.remove(&replica);
    }

    /// Measures new samples, drops dispatches whose end never came, and marks the ranks whose
    /// sums may have moved for a publish check (unchanged sums are not streamed).
    fn expire(&mut self, state: &FleetState, now: Instant) {
        // The timings of settled ranks are kept while their workers serve them, and no longer.
        if !self.learned.is_empty()
            && self.learned_pruned.is_none_or(|at| now.saturating_duration_since(at) >= PRUNE_LEARNED_EVERY)
        {
            self.learned.retain(|_, (key, _)| in_fleet(state, key));
            self.learned_pruned = Some(now);
        }
        let mut lost = Vec::new();
        for (&key, rank) in &mut self.ranks {
            let sample = state.view().loads().get(&rank.key);
            let received_at = sample.map(|s| s.received_at);
            // A sum changes with a new sample (its foreign part) or an end (marked by `end`);
            // a rank with nothing in flight may also settle with time.
            if received_at != rank.sampled_at {
                rank.sampled(received_at, sample.map(|s| &s.load));
                mark(&mut self.dirty, key, rank);
            } else if rank.dispatches.is_empty() {
                mark(&mut self.dirty, key, rank);
            }
            // Dispatches become "ending", and prefills progress, with time alone.
            if rank.refresh_timed(now) {
                mark(&mut self.dirty, key, rank);
            }
            // A worker removed and added again comes back without the backlog published for
            // it (the view drops a departed worker's): publish it anew, changed or not.
            if rank.worker_came_back(state) {
                rank.published = None;
                mark(&mut self.dirty, key, rank);
            }
            let stale =
                rank.dispatches.iter().filter(|(_, d)| now.saturating_duration_since(d.at) >= IN_FLIGHT_MAX_AGE);
            lost.extend(stale.map(|(id, _)| *id));
        }
        for id in lost {
            self.forget(id, now);
        }
    }

    /// The published change for every rank whose sum moved; a settled rank's record goes, and
    /// its sums with it.
    fn take_change(&mut self, now: Instant) -> FleetChange {
        let mut change = FleetChange::default();
        for key in std::mem::take(&mut self.dirty) {
            let Some(rank) = self.ranks.get_mut(&key) else { continue };
            rank.dirty = false;
            if rank.settled(now) {
                let idle = Backlog { last_dispatch: rank.last_dispatch, ..Backlog::default() };
                if rank.published != Some(idle) {
                    change.backlogs.push((rank.key.clone(), idle));
                }
                if let Some(rank) = self.ranks.remove(&key) {
                    self.learned.insert(key, (rank.key, rank.timing));
                }
                continue;
            }
            let backlog = rank.backlog();
            if rank.published != Some(backlog) {
                rank.published = Some(backlog);
                change.backlogs.push((rank.key.clone(), backlog));
            }
        }
        // Every report received so far is in the sums; the ranges go out with them, or not at all.
        if !change.backlogs.is_empty() {
            change.reports_folded = Some(Arc::new(self.folded.clone()));
        }
        change
    }
}

#[cfg(test)]
mod tests;
