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
//! A rank may also be *stalled* (the seed's rule, fleet-wide): a dispatch of two blocks or more
//! that the rank received at once (its replica says so: not the decode leg of a pair, which
//! receives it only after the prefill) has had no first token and no sample since for
//! [`continuum_proto::STALL_AFTER`], and less than [`DISPATCH_MAX_AGE`]. A replica sees its own
//! dispatches' stalls at once; the book's let every replica pass over a worker that hangs on
//! another's request. A sample received up to [`SAMPLE_LAG`] before a dispatch's report came
//! answers it: the worker may have had the request before the book had the report.
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

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;
use continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES;
use continuum_proto::fast_hash::{FastMap, SeededMap, shrink_when_sparse};
use continuum_proto::model::{Backlog, LoadKey, ReportsFolded};
use continuum_proto::pb;

use super::{ActiveIndex, FleetChange, FleetState};

mod prefill_time;
mod rank;
mod task;
mod timing;
use rank::{Dispatch, Rank};
pub use task::{BacklogBook, BookCounters, NotQueued, SessionReports};
#[cfg(test)]
use task::{COMMAND_QUEUE, SESSION_SHARE, report_bytes};
use timing::Timing;

/// A buffered dispatch (whose answer comes whole, so no first token says its prompt is done)
/// adds its prefill tokens this long at most (the seed's 30 seconds), unless its rank's
/// timing says it was done sooner; a streamed one until its first token or its end. A rank's
/// record outlives its last end by at most this long.
pub const DISPATCH_MAX_AGE: Duration = Duration::from_secs(30);
/// A dispatch whose end never arrives stops counting after this long.
pub const IN_FLIGHT_MAX_AGE: Duration = Duration::from_secs(600);
/// Outstanding dispatches (a request's start on one rank) one replica may hold in the book; more
/// are refused and counted. A replica answers one request per client connection at a time, at
/// most 16,384 connections (fewer than [`continuum_proto::MAX_REQUESTS_IN_FLIGHT`]), each
/// request pinned to two ranks at most, and the book holds a dispatch until its end however
/// long it runs: an honest replica never reaches it.
pub const MAX_DISPATCHES_PER_REPLICA: usize = 2 * continuum_proto::MAX_REQUESTS_IN_FLIGHT;
/// Outstanding dispatches the book holds across every replica, first come; past it only a
/// replica holding less than an equal share of it (among the sessions that have reported) may
/// start more, up to twice it in all. A fleet of 64 replicas with 4,096 disaggregated requests
/// (a prefill and a decode worker each) in flight fits.
pub const MAX_DISPATCHES: usize = 1 << 19;
/// Bytes of reports waiting for the book at most (besides the count bound of its queue): past
/// it a report is dropped and its session ended, as when the queue is full.
pub const MAX_QUEUED_REPORT_BYTES: usize = 64 << 20;
pub use continuum_proto::{MAX_REPORTED_DECODE_BLOCKS, MAX_REPORTED_PREFILL_TOKENS};
/// Backlog changes are published at most this often: short, so a burst spreads across replicas.
pub const BACKLOG_WINDOW: Duration = Duration::from_millis(2);
/// A sample received this soon after a dispatch ended may still show its blocks: workers
/// publish on their own schedule (the 1.6.1 mocker every 50–200 ms per rank under load).
pub const SAMPLE_LAG: Duration = Duration::from_millis(250);
/// A prefill under way is credited in steps of one part in this many of its expected time.
pub(super) const PROGRESS_STEPS: u64 = 8;
/// How often the timings of settled ranks are pruned of ranks the fleet no longer has, and
/// dispatches past [`IN_FLIGHT_MAX_AGE`] looked for: a ten-minute bound need not be checked
/// against every dispatch in flight at every window.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Ended dispatches remembered per rank for that, at most.
const MAX_ENDED_PER_RANK: usize = 4096;
/// The most dispatches of ended sessions forgotten in one turn of the book's task (about a
/// millisecond's work): a session that ended holding a hundred thousand is forgotten over
/// many turns, other sessions' reports folded between them.
const DEPARTURE_CHUNK: usize = 2048;
/// Gives back what a vector of block hashes no longer holds once cut, when that is most of it:
/// a dispatch keeps its chain for as long as it is in flight.
pub(crate) fn fit(hashes: &mut Vec<u64>) {
    if hashes.capacity() > 2 * hashes.len() + 16 {
        hashes.shrink_to_fit();
    }
}

/// Whether a reported start is one a replica could have made: its prompt and blocks within
/// what a replica reports at most. The book refuses others, and they credit no prefix.
pub(crate) fn plausible(started: &pb::DispatchStarted) -> bool {
    started.decode_blocks <= MAX_REPORTED_DECODE_BLOCKS && started.prefill_tokens <= MAX_REPORTED_PREFILL_TOKENS
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
    /// The book is full for its replica: past [`MAX_DISPATCHES`], holding an equal share.
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
    /// A report was folded since the last change taken: published even when no sum moved
    /// (starts refused, or a start and its end in one report), since a replica that hears
    /// nothing after reporting a start takes the control plane for stuck and leaves.
    folded_moved: bool,
    /// Sessions a start of which the book refused for want of room: the sums lack it, so their
    /// range would tell the replica they hold it and it would count it nowhere. They publish
    /// no range from then on, and the replica joins the sums the cautious way (the larger of
    /// its own and the fleet's).
    lossy: HashSet<u64>,
    /// Dispatches admitted since the book started: each rank's newest is stamped with the
    /// count, which orders ranks by how recently the fleet sent them one.
    dispatched: u64,
    /// What settled ranks had learned, for when they take dispatches again: a rank settles
    /// whenever it idles, and would otherwise start every burst knowing nothing of its prefill
    /// and decode times, and (taking a replay first) with no place in the dispatch order. Only
    /// ranks the fleet still has are kept.
    learned: FastMap<RankKey, Learned>,
    /// When `learned` was last pruned of ranks the fleet no longer has, and stale dispatches
    /// looked for.
    swept: Option<Instant>,
    /// Sessions that ended with dispatches still to forget, in the order they ended.
    departing: VecDeque<u64>,
}

/// What a settled rank keeps for its next dispatch.
#[derive(Debug)]
struct Learned {
    key: LoadKey,
    timing: Timing,
    /// Its place in the dispatch order ([`Rank::last_dispatch`]): published while it idles, and
    /// not to go back to none when a replay, which stamps no place, brings it back.
    last_dispatch: u64,
}

impl Book {
    fn report(&mut self, replica: u64, report: pb::DispatchReport, at: Instant, state: &FleetState) {
        // A replay is a reconnected replica's dispatches again, under its new session: the
        // sessions that ended are forgotten first, whatever is left of them, or the replayed
        // dispatches would count twice (and take the room the old ones still hold) meanwhile.
        if self.departing() && report.started.iter().any(|started| started.replayed) {
            while self.forget_departed(at) {}
        }
        // A session's reports arrive in the order its replica numbered them.
        if report.last_op > 0 && !self.lossy.contains(&replica) {
            let (first_op, last_op) = (report.first_op, report.last_op);
            let folded = self.folded.entry(replica).or_insert(ReportsFolded { first_op, last_op });
            folded.last_op = folded.last_op.max(last_op);
            self.folded_moved = true;
        }
        // In the replica's order: each start after the first tokens and ends it performed
        // before it, the rest after the last start (a dispatch may start, begin answering and
        // end within one report).
        let (mut prefilled, mut ended) = (report.prefilled.into_iter(), report.ended.into_iter());
        let (mut prefilled_taken, mut ended_taken) = (0, 0);
        let ranks = report.ranks;
        // The table's entries the fleet does not have, each found out once: a thousand starts
        // naming one entry must not look it up (and copy its namespace) a thousand times.
        let mut unknown = vec![false; ranks.len()];
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
            self.start(replica, started, (&ranks, &mut unknown), at, state);
        }
        for id in prefilled {
            self.prefilled((replica, id), at);
        }
        for id in ended {
            self.end((replica, id), at);
        }
    }

    /// One reported start: admitted onto its rank, or refused and counted.
    fn start(
        &mut self,
        replica: u64,
        started: pb::DispatchStarted,
        (ranks, unknown): (&[pb::LoadKey], &mut [bool]),
        at: Instant,
        state: &FleetState,
    ) {
        // Named by its place in the table (not by a rank of its own): one found unknown before.
        let entry = started.rank.is_none().then(|| usize::try_from(started.rank_index).ok()).flatten();
        if entry.is_some_and(|entry| unknown.get(entry).copied().unwrap_or(false)) {
            return self.refused.count(Refusal::UnknownRank);
        }
        let key = match self.admit_start(replica, &started, ranks, state) {
            Ok(key) => key,
            Err(refusal) => {
                if refusal == Refusal::UnknownRank
                    && let Some(seen) = entry.and_then(|entry| unknown.get_mut(entry))
                {
                    *seen = true;
                }
                if matches!(refusal, Refusal::ReplicaFull | Refusal::BookFull) && self.lossy.insert(replica) {
                    self.folded.remove(&replica);
                }
                return self.refused.count(refusal);
            }
        };
        let id = (replica, started.id);
        // A repeated id (no replica sends one: ids are per stream) replaces its dispatch as if
        // it had never been. Forgotten as at a stream's end, it would stay on as foreign load
        // beside the new one, the rank counted twice until its next sample.
        self.take(id, |rank, active, key| {
            rank.remove(id, active, key).map_or(0, |(dispatch, _)| dispatch.block_hashes.len())
        });
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
            may_stall: started.may_stall,
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

    /// The rank `replica` may start `started` on (named by it or by its place in its report's
    /// `ranks`): a plausible dispatch, on a rank the fleet has (given its record here), within
    /// the replica's bound and the book's.
    fn admit_start(
        &mut self,
        replica: u64,
        started: &pb::DispatchStarted,
        ranks: &[pb::LoadKey],
        state: &FleetState,
    ) -> Result<RankKey, Refusal> {
        let Some((reported, key)) = started.rank_in(ranks).and_then(|r| Some((r, reported_rank(r)?))) else {
            return Err(Refusal::UnknownRank);
        };
        if !plausible(started) {
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
        Ok(key)
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
        if let Some(learned) = self.learned.remove(&key).filter(|learned| learned.key == rank.key) {
            rank.timing = learned.timing;
            rank.last_dispatch = learned.last_dispatch;
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
        let Some(session) = self.where_is.get_mut(&id.0) else { return };
        let Some(key) = session.remove(&id.1) else { return };
        // A session past a flood gives the room back, as each rank's map does.
        shrink_when_sparse(session);
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

    /// Forgets a session's dispatches: at most [`DEPARTURE_CHUNK`] of them at once, the rest
    /// by [`Book::forget_departed`] between the book's later turns. A session may hold a
    /// hundred thousand, and every other session's reports wait while the book works.
    fn replica_gone(&mut self, replica: u64, now: Instant) {
        self.folded.remove(&replica);
        self.lossy.remove(&replica);
        // Said twice, a session is queued twice: its second turn finds nothing left.
        if self.where_is.contains_key(&replica) {
            self.departing.push_back(replica);
        }
        self.forget_departed(now);
    }

    /// Whether sessions that ended still have dispatches to forget.
    fn departing(&self) -> bool {
        !self.departing.is_empty()
    }

    /// Forgets at most [`DEPARTURE_CHUNK`] dispatches of the sessions that ended, the first
    /// to end first; whether some are left.
    fn forget_departed(&mut self, now: Instant) -> bool {
        let mut left = DEPARTURE_CHUNK;
        while left > 0
            && let Some(&session) = self.departing.front()
        {
            let ids: Vec<u64> =
                self.where_is.get(&session).map_or_else(Vec::new, |held| held.keys().take(left).copied().collect());
            if ids.is_empty() {
                self.where_is.remove(&session);
                self.departing.pop_front();
                continue;
            }
            left -= ids.len();
            for id in ids {
                self.forget((session, id), now);
            }
        }
        !self.departing.is_empty()
    }

    /// Measures new samples, drops dispatches whose end never came, and marks the ranks whose
    /// sums may have moved for a publish check (unchanged sums are not streamed).
    fn expire(&mut self, state: &FleetState, now: Instant) {
        let sweep = self.swept.is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY);
        if sweep {
            // The timings of settled ranks are kept while their workers serve them, and no longer.
            self.learned.retain(|_, learned| in_fleet(state, &learned.key));
            self.swept = Some(now);
        }
        let mut lost = Vec::new();
        // Past the budget, every rank waits as many windows as the budget takes to visit the
        // whole book (rounded up: a rank walked at every window would take the budget first
        // every time, and the ranks after it would never be walked).
        let book_windows = match self.held > rank::BOOK_WALK_BUDGET {
            true => u32::try_from(self.held.div_ceil(rank::BOOK_WALK_BUDGET)).unwrap_or(u32::MAX),
            false => 0,
        };
        let mut visits_left = rank::BOOK_WALK_BUDGET;
        for (&key, rank) in &mut self.ranks {
            let sample = state.view().loads().get(&rank.key);
            let received_at = sample.map(|s| s.received_at);
            // A sum changes with a new sample (its foreign part) or an end (marked by `end`);
            // a rank with nothing in flight may also settle with time. A new sample is
            // measured once the rank may be walked.
            let walk = visits_left > 0 && rank.walk_due(now, book_windows);
            if walk {
                visits_left = visits_left.saturating_sub(rank.dispatches.len());
            }
            if walk && received_at != rank.sampled_at {
                rank.sampled(received_at, sample.map(|s| &s.load));
                mark(&mut self.dirty, key, rank);
            } else if rank.dispatches.is_empty() {
                mark(&mut self.dirty, key, rank);
            }
            // Dispatches become "ending", prefills progress, and ranks stall, with time alone;
            // a sample clears a stall at once, not at the rank's pace.
            if rank.refresh_timed(now, walk) | rank.restall(received_at, now) {
                mark(&mut self.dirty, key, rank);
            }
            // A worker removed and added again comes back without the backlog published for
            // it (the view drops a departed worker's): publish it anew, changed or not.
            if rank.worker_came_back(state) {
                rank.published = None;
                mark(&mut self.dirty, key, rank);
            }
            if sweep {
                let stale =
                    rank.dispatches.iter().filter(|(_, d)| now.saturating_duration_since(d.at) >= IN_FLIGHT_MAX_AGE);
                lost.extend(stale.map(|(id, _)| *id));
            }
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
                    let Rank { key: load_key, timing, last_dispatch, .. } = rank;
                    self.learned.insert(key, Learned { key: load_key, timing, last_dispatch });
                }
                continue;
            }
            let backlog = rank.backlog();
            if rank.published != Some(backlog) {
                rank.published = Some(backlog);
                change.backlogs.push((rank.key.clone(), backlog));
            }
        }
        // Every report received so far is in the sums; the ranges go out with them, or alone
        // when reports were folded that moved no sum.
        let folded_moved = std::mem::take(&mut self.folded_moved);
        if !change.backlogs.is_empty() || folded_moved {
            change.reports_folded = Some(Arc::new(self.folded.clone()));
        }
        change
    }
}

#[cfg(test)]
mod tests;
