//! `KvIndexer`: the KV index plus the rules that decide which events may change it.
//!
//! Per event, in order:
//! 1. Identity: the event's worker must be the publisher's (its `v1/event_sources` record), its
//!    rank the publisher's rank when the record names one, and the pair live with the rank in
//!    the worker's declared range (`identity_mismatch`). Refused events move no cursor.
//! 2. Cursor, per (publisher, worker, dp_rank): an event id below it is a `replay`; the same id
//!    again is the same engine step (Dynamo numbers every event converted from one vLLM batch
//!    with the batch's sequence, and may publish them over more than one message); a jump
//!    past the next id clears the rank (`gap`) and the event then applies, so the rank rebuilds
//!    from root-anchored chains (no snapshot recovery: the router stays off Dynamo's request
//!    plane). The first event of a rank sets the cursor. A publisher holds at most
//!    [`MAX_CURSORS_PER_PUBLISHER`] cursors (`over_capacity` past that).
//! 3. Tier: only the worker's device cache is indexed (`other_tier`); the cursor still moves,
//!    since every tier shares the publisher's event ids.
//! 4. The index applies it (`applied`, `duplicate`, `unknown_parent`, `unknown_block`,
//!    `over_capacity`).
//!
//! Cursors survive a session drop and reconnect: events missed meanwhile show up as a gap.
//! A subscription disconnected or pending for [`KV_EVENTS_STALE_AFTER`] loses its ranks
//! ([`KvIndexer::stale`]), and one stopped for good loses them at once
//! ([`KvIndexer::take_publisher`]). Silence alone is not staleness: an idle worker publishes
//! nothing and still holds its cache.
//!
//! Pure: time is an argument, and nothing here blocks or spawns.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_kv_index::{KvIndex, Limits, Matches, Outcome, RankKey};
use continuum_proto::fast_hash::FastMap;

use super::decode::{DecodeError, KvEvent, KvEventBatch, KvEventData, decode_kv_events};
use super::result::{KvCounts, KvEventResult};
use crate::discovery::PublisherKey;

/// Rank cursors one publisher may hold (seed: "4096 (worker, dp_rank) cursors per subscription").
pub const MAX_CURSORS_PER_PUBLISHER: usize = 4_096;
/// How long a kv-events subscription may stay disconnected or pending before its ranks are
/// cleared (seed: `KV_EVENTS_STALE_AFTER`).
pub const KV_EVENTS_STALE_AFTER: Duration = Duration::from_secs(60);

/// Who a kv-events publisher speaks for, from its discovery records.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PublisherMapping {
    /// The channel's namespace and `instance_id` (frames and envelope must carry the id). Its
    /// cursors and health are kept under both: instance ids are etcd lease ids, unique across
    /// namespaces, but a channel is one namespace's record, and one namespace's channel must
    /// not clear another's ranks whatever ids a discovery source hands out.
    pub publisher: PublisherKey,
    /// The worker it publishes for (the channel key's lease, or the event source's `worker_id`).
    pub worker_id: u64,
    /// The event source's `dp_rank`; `None` lets the publisher speak for any declared rank.
    pub dp_rank: Option<u32>,
}

/// Live worker ids, each with its namespace and the dp ranks it declares
/// (`data_parallel_start_rank` .. `+ data_parallel_size`).
pub type LiveRanks = HashMap<u64, LiveWorker>;

/// A live worker as the index's gate reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveWorker {
    /// Only publishers of this namespace speak for it: a channel registered in another (whose
    /// event source names this worker) must not store or clear its blocks.
    pub namespace: Arc<str>,
    pub ranks: Range<u32>,
    /// Of its ranks, those with a `kv-events` channel: the index's room is shared among those
    /// alone (1.6.1's decode workers publish none, and a rank that publishes nothing holds no
    /// blocks).
    pub publishing: usize,
}

#[derive(Debug, Default)]
struct Publisher {
    cursors: HashMap<RankKey, RankCursor>,
    /// Since when the subscription has been down, if it is.
    down_since: Option<Instant>,
    /// The number of its last message: a publisher numbers its messages one by one whether
    /// anyone listens or not, so the first of a new session shows what went unheard.
    sequence: Option<u64>,
    /// No message has come on its current session yet.
    new_session: bool,
}

/// Whether `publisher`'s subscription has been down for at least `stale_after` at `now`.
fn is_stale(publisher: &Publisher, now: Instant, stale_after: Duration) -> bool {
    publisher.down_since.is_some_and(|since| now.saturating_duration_since(since) >= stale_after)
}

/// Where one rank's events stand on one publisher.
#[derive(Clone, Copy, Debug)]
struct RankCursor {
    /// The last event id applied or skipped.
    last: u64,
    /// Cleared for a lost message and counted as its gap: the jump the rank's next event shows
    /// is that same gap, on a rank nothing was applied to since.
    cleared_for_loss: bool,
    /// Events in a row numbered more than [`FAR_BEHIND`] below `last`.
    far_behind: u32,
}

impl RankCursor {
    fn at(last: u64) -> Self {
        Self { last, cleared_for_loss: false, far_behind: 0 }
    }
}

/// How far below a rank's last event id an event must be numbered to count as no replay: a
/// publisher sends each event once, so a stream replayed (a duplicated channel) lags by the
/// events of a moment, while a counter that started over, or one id far ahead of its order,
/// leaves every later event this far behind.
/// Message numbers take the same distance ([`lost_before`]).
const FAR_BEHIND: u64 = 1 << 20;

/// Whether a message numbered `sequence` comes after lost ones, where the last was `last`
/// (a publisher numbers its messages one by one, the captures show); records it. Event ids
/// cannot tell: the events of one engine step share an id and may span messages, so a lost
/// message in the middle of a step leaves no hole in them.
///
/// Within a session, a number far below the last (more than [`FAR_BEHIND`]) is where the count
/// stands: the last was out of its order (one message numbered far ahead), and keeping it
/// would turn off loss detection for the rest of the session. The first message of a session
/// numbered at or below the last says the count started over (the publisher restarted, its
/// cache with it), and what it published before the session went unheard.
fn lost_before(last: &mut Option<u64>, sequence: u64, first_of_session: bool) -> bool {
    let lost = match *last {
        None => false,
        Some(last) if first_of_session => last.checked_add(1) != Some(sequence),
        Some(last) => sequence > last.saturating_add(1),
    };
    *last = Some(match *last {
        Some(last) if !first_of_session && last.saturating_sub(sequence) <= FAR_BEHIND => last.max(sequence),
        _ => sequence,
    });
    lost
}

/// Events in a row [`FAR_BEHIND`] that make the rank start over from the next (cleared, as
/// after a gap): refusing them all would freeze its blocks, removals included, until the
/// publisher left. The load feed's rule for its messages (`BEHIND_BEFORE_RESTART`).
const FAR_BEHIND_BEFORE_RESTART: u32 = 8;

/// The device-tier KV index and the per-publisher state that guards it.
#[derive(Debug, Default)]
pub struct KvIndexer {
    index: KvIndex,
    live: LiveRanks,
    publishers: HashMap<PublisherKey, Publisher>,
    /// Live ranks whose blocks were cleared since the provisional credit last looked
    /// ([`Self::take_cleared`]): what it credited them before no longer stands either. Behind
    /// its own lock, so a lookup holding the index's read lock can take it.
    cleared: Mutex<Cleared>,
}

/// Most ranks [`Cleared`] lists; past it, it says "every rank, until now".
pub(crate) const MAX_CLEARED_LISTED: usize = 4096;

/// Ranks cleared (a gap, a `cleared` event, a lost message, a stale publisher), each with when
/// it was last.
#[derive(Debug, Default)]
pub struct Cleared {
    /// One entry a rank, however often it was cleared: a publisher clearing its own rank over
    /// and over must not fill the list and void every other rank's credit through `all_at`.
    pub ranks: FastMap<RankKey, Instant>,
    /// More ranks were cleared than are listed: every rank counts as cleared at this instant.
    pub all_at: Option<Instant>,
}

/// Clears a live rank's blocks from `index`, noting it in `cleared` for the provisional
/// credit (fields apart, so a caller iterating its publishers can clear). Returns what
/// [`KvIndex::clear_rank`] does.
fn clear_live(index: &mut KvIndex, cleared: &Mutex<Cleared>, rank: RankKey) -> usize {
    let mut noted = cleared.lock().unwrap_or_else(PoisonError::into_inner);
    let now = Instant::now();
    if noted.ranks.len() >= MAX_CLEARED_LISTED && !noted.ranks.contains_key(&rank) {
        noted.ranks.clear();
        noted.all_at = Some(now);
    } else {
        noted.ranks.insert(rank, now);
    }
    index.clear_rank(rank)
}

impl KvIndexer {
    /// An empty indexer whose index enforces `limits`; nothing is live until [`Self::set_live`].
    pub fn new(limits: Limits) -> Self {
        KvIndexer { index: KvIndex::new(limits), ..KvIndexer::default() }
    }

    /// The ranks cleared since the last call ([`Cleared`]).
    pub fn take_cleared(&self) -> Cleared {
        std::mem::take(&mut *self.cleared.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Decodes one message from `publisher` and applies its events.
    pub fn apply_message<'a>(
        &mut self,
        publisher: &PublisherMapping,
        frames: impl IntoIterator<Item = &'a [u8]>,
    ) -> KvCounts {
        self.apply_decoded(publisher, decode_kv_events(frames, publisher.publisher.publisher_id))
    }

    /// Applies one message from `publisher` as [`decode_kv_events`] read it, so that a caller
    /// sharing the indexer decodes (up to a megabyte of msgpack) before taking its lock.
    pub fn apply_decoded(
        &mut self,
        publisher: &PublisherMapping,
        decoded: Result<KvEventBatch, DecodeError>,
    ) -> KvCounts {
        match decoded {
            Ok(batch) => self.apply_events(publisher, &batch.events),
            Err(refused) => {
                let mut counts = KvCounts::default();
                counts.add(refused.into());
                if refused.loses_events() {
                    self.message_lost(&publisher.publisher, &mut counts);
                }
                counts
            }
        }
    }

    /// A kv-events message of `publisher_id` was refused: its events, removals perhaps among
    /// them, are lost. Every rank it speaks for is cleared as on a gap (counted as one), rather
    /// than credited with blocks it may no longer hold until its next event shows the gap.
    /// Cursors stay, so a replay is still skipped; the jump the next event shows is this gap,
    /// not another.
    pub fn message_lost(&mut self, publisher: &PublisherKey, counts: &mut KvCounts) {
        for rank in self.lose_message(publisher, counts) {
            self.clear_rank(rank);
        }
    }

    /// [`Self::message_lost`] but for the clearing: the ranks to clear, counted as gaps, for a
    /// caller to clear one to a hold of its lock ([`Self::clear_rank`]). A publisher may speak
    /// for a worker's every rank, and all their blocks cleared in one hold would keep every
    /// lookup waiting for as long.
    pub fn lose_message(&mut self, publisher: &PublisherKey, counts: &mut KvCounts) -> Vec<RankKey> {
        let Some(publisher) = self.publishers.get_mut(publisher) else { return Vec::new() };
        let mut lost = Vec::new();
        for (rank, cursor) in &mut publisher.cursors {
            if !cursor.cleared_for_loss {
                lost.push(*rank);
                counts.add(KvEventResult::Gap);
                cursor.cleared_for_loss = true;
            }
        }
        lost
    }

    /// Clears one rank's blocks, noted for the provisional credit; how many it held.
    pub fn clear_rank(&mut self, rank: RankKey) -> usize {
        clear_live(&mut self.index, &self.cleared, rank)
    }

    /// Applies decoded events from `publisher`, in order.
    pub fn apply_events(&mut self, publisher: &PublisherMapping, events: &[KvEvent]) -> KvCounts {
        let mut counts = KvCounts::default();
        let mut rest = events;
        while !rest.is_empty() {
            let applied = self.apply_events_within(publisher, rest, usize::MAX, &mut counts);
            rest = &rest[applied..];
        }
        counts
    }

    /// Applies the first of `events` from `publisher`, in order, until they have done `blocks`
    /// blocks' worth of work ([`KvIndex::work`]: those they name, those a clear or a gap
    /// dropped, what dropping orphaned blocks took): how many it applied, one at least. What
    /// one hold of the lock does: a gap clears a rank's every block, so a run of events each
    /// gapping another rank is work of their ranks' size, not of the blocks they name.
    pub fn apply_events_within(
        &mut self,
        publisher: &PublisherMapping,
        events: &[KvEvent],
        blocks: usize,
        counts: &mut KvCounts,
    ) -> usize {
        let mut touched = 0usize;
        for (i, event) in events.iter().enumerate() {
            if i > 0 && touched >= blocks {
                return i;
            }
            let before = self.index.work();
            let result = self.apply_event(publisher, event, counts);
            counts.add(result);
            // An event refused before the index (one naming no block) costs one all the same.
            let work = usize::try_from(self.index.work() - before).unwrap_or(usize::MAX);
            touched = touched.saturating_add(work.max(1));
        }
        events.len()
    }

    fn apply_event(&mut self, publisher: &PublisherMapping, event: &KvEvent, counts: &mut KvCounts) -> KvEventResult {
        let rank = match self.admit_event(publisher, event, counts) {
            Ok(rank) => rank,
            Err(refused) => return refused,
        };
        let outcome = self.apply_part(rank, &event.data, 0..event.blocks());
        self.settle();
        counts.blocks.merge(&outcome);
        outcome.summary().map_or(KvEventResult::Applied, KvEventResult::from)
    }

    /// Admits `event` from `publisher` and moves its rank's cursor: the rank to apply its data
    /// to ([`Self::apply_part`]), or the result that refuses it. A gap the cursor shows clears
    /// the rank first (counted).
    pub fn admit_event(
        &mut self,
        publisher: &PublisherMapping,
        event: &KvEvent,
        counts: &mut KvCounts,
    ) -> Result<RankKey, KvEventResult> {
        let rank = RankKey { worker_id: event.worker_id, dp_rank: event.dp_rank };
        if !self.admits(publisher, rank) {
            return Err(KvEventResult::IdentityMismatch);
        }
        match self.advance_cursor(&publisher.publisher, rank, event.event_id) {
            Cursor::Next => {}
            Cursor::Gap => {
                clear_live(&mut self.index, &self.cleared, rank);
                counts.add(KvEventResult::Gap);
            }
            Cursor::Replay => return Err(KvEventResult::Replay),
            Cursor::Full => return Err(KvEventResult::OverCapacity),
        }
        if !event.is_worker_device() {
            return Err(KvEventResult::OtherTier);
        }
        Ok(rank)
    }

    /// Applies the `blocks` of an admitted event's `data` to `rank` (a clear names none, and
    /// clears the rank): the whole event at once, or a large one in parts, each under a hold
    /// of its own, in order. A stored part hangs under the block before it. What the event's
    /// blocks leave without owners keeps what lies under it until [`Self::settle`], once the
    /// event is applied, so that its parts end as the whole would.
    pub fn apply_part(&mut self, rank: RankKey, data: &KvEventData, blocks: Range<usize>) -> Outcome {
        match data {
            KvEventData::Stored(stored) => {
                let parent = match blocks.start.checked_sub(1) {
                    None => stored.parent_hash,
                    Some(before) => stored.blocks.get(before).map(|block| block.block_hash),
                };
                let part = stored.blocks.get(blocks).unwrap_or_default();
                self.index.apply_stored_part(rank, parent, part)
            }
            KvEventData::Removed(hashes) => self.index.apply_removed_part(rank, hashes.get(blocks).unwrap_or_default()),
            KvEventData::Cleared => {
                clear_live(&mut self.index, &self.cleared, rank);
                Outcome::default()
            }
        }
    }

    /// Drops what lies under the blocks an event left without owners ([`KvIndex::drop_orphans`]):
    /// after the last of its parts.
    pub fn settle(&mut self) {
        self.index.drop_orphans();
    }

    fn admits(&self, publisher: &PublisherMapping, rank: RankKey) -> bool {
        rank.worker_id == publisher.worker_id
            && publisher.dp_rank.is_none_or(|r| r == rank.dp_rank)
            && self.live.get(&rank.worker_id).is_some_and(|worker| {
                worker.namespace == publisher.publisher.namespace && worker.ranks.contains(&rank.dp_rank)
            })
    }

    /// Whether `rank` belongs to a live worker that declares it.
    pub fn is_live(&self, rank: RankKey) -> bool {
        declares(&self.live, rank)
    }

    fn advance_cursor(&mut self, publisher: &PublisherKey, rank: RankKey, event_id: u64) -> Cursor {
        let cursors = &mut self.publishers.entry(publisher.clone()).or_default().cursors;
        let full = cursors.len() >= MAX_CURSORS_PER_PUBLISHER;
        match cursors.get_mut(&rank) {
            Some(cursor) if event_id < cursor.last => {
                cursor.far_behind = if cursor.last - event_id > FAR_BEHIND { cursor.far_behind + 1 } else { 0 };
                if cursor.far_behind < FAR_BEHIND_BEFORE_RESTART {
                    return Cursor::Replay;
                }
                *cursor = RankCursor::at(event_id);
                Cursor::Gap
            }
            Some(cursor) if event_id == cursor.last => {
                // Applied from here: a loss after it clears the rank again.
                cursor.cleared_for_loss = false;
                cursor.far_behind = 0;
                Cursor::Next
            }
            Some(cursor) => {
                let gap = event_id > cursor.last.saturating_add(1) && !cursor.cleared_for_loss;
                *cursor = RankCursor::at(event_id);
                if gap { Cursor::Gap } else { Cursor::Next }
            }
            None if full => Cursor::Full,
            None => {
                cursors.insert(rank, RankCursor::at(event_id));
                Cursor::Next
            }
        }
    }

    /// Replaces the live workers and their declared ranks at once; ranks no longer live lose
    /// their blocks and cursors, and the index is shared among the ranks that publish. Returns
    /// how many ranks were cleared from the index.
    pub fn set_live(&mut self, live: LiveRanks) -> usize {
        self.live = live;
        let ranks = self.live.values().map(|worker| worker.publishing.min(worker.ranks.len())).sum();
        self.index.share_among(ranks);
        let live = &self.live;
        for publisher in self.publishers.values_mut() {
            publisher.cursors.retain(|rank, _| declares(live, *rank));
        }
        self.index.retain_ranks(|rank| declares(live, rank))
    }

    /// The publisher's subscription stopped for good: it loses its cursors, and its ranks, handed
    /// back, are for the caller to clear one to a hold of its lock ([`Self::clear_rank`]).
    pub fn take_publisher(&mut self, publisher: &PublisherKey) -> Vec<RankKey> {
        self.publishers.remove(publisher).map(|publisher| publisher.cursors.into_keys().collect()).unwrap_or_default()
    }

    /// The ranks the index holds blocks for that `live` does not declare: what
    /// [`Self::set_live`] would clear, for a caller to clear one at a time first
    /// ([`Self::clear_departed`]) rather than all under one hold of the lock.
    pub fn departed(&self, live: &LiveRanks) -> Vec<RankKey> {
        self.index.ranks().filter(|rank| !declares(live, *rank)).collect()
    }

    /// Clears one rank's blocks ahead of [`Self::set_live`] (see [`Self::departed`]); whether
    /// it held any.
    pub fn clear_departed(&mut self, rank: RankKey) -> bool {
        self.index.clear_rank(rank) > 0
    }

    /// The publishers down for at least `stale_after` (normally [`KV_EVENTS_STALE_AFTER`]), for
    /// a caller to drop one at a time ([`Self::take_if_stale`]), each to a hold of the lock.
    pub fn stale(&self, now: Instant, stale_after: Duration) -> Vec<PublisherKey> {
        self.publishers.iter().filter(|(_, p)| is_stale(p, now, stale_after)).map(|(key, _)| key.clone()).collect()
    }

    /// [`Self::take_publisher`] if `publisher` is still down for at least `stale_after`: between
    /// the listing of [`Self::stale`] and this hold of the lock it may have come back, and what
    /// it published since must stand.
    pub fn take_if_stale(
        &mut self,
        publisher: &PublisherKey,
        now: Instant,
        stale_after: Duration,
    ) -> Option<Vec<RankKey>> {
        let stale = self.publishers.get(publisher).is_some_and(|p| is_stale(p, now, stale_after));
        stale.then(|| self.take_publisher(publisher))
    }

    /// The publisher's session ended (or is pending); cursors are kept. Calling it again while
    /// down keeps the first instant.
    pub fn publisher_down(&mut self, publisher: &PublisherKey, now: Instant) {
        if let Some(publisher) = self.publishers.get_mut(publisher) {
            publisher.down_since.get_or_insert(now);
        }
    }

    /// The publisher's session is up (again).
    pub fn publisher_up(&mut self, publisher: &PublisherKey) {
        let publisher = self.publishers.entry(publisher.clone()).or_default();
        publisher.down_since = None;
        publisher.new_session = true;
    }

    /// `publisher`'s message numbered `sequence` arrived: the ranks to clear (counted as gaps,
    /// see [`Self::lose_message`]) if messages were lost before it, on this session or while
    /// none was up.
    pub fn numbered(&mut self, publisher: &PublisherKey, sequence: u64, counts: &mut KvCounts) -> Vec<RankKey> {
        let entry = self.publishers.entry(publisher.clone()).or_default();
        let first_of_session = std::mem::take(&mut entry.new_session);
        if lost_before(&mut entry.sequence, sequence, first_of_session) {
            self.lose_message(publisher, counts)
        } else {
            Vec::new()
        }
    }

    /// Each rank's longest contiguous prefix of a request's block tokens hashes.
    pub fn find_matches(&self, tokens_hashes: &[u64]) -> Matches {
        self.index.find_matches(tokens_hashes)
    }

    /// The index, for stats and the admin API.
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// The cursor of one rank on one publisher, if it has one.
    pub fn cursor(&self, publisher: &PublisherKey, rank: RankKey) -> Option<u64> {
        self.publishers.get(publisher)?.cursors.get(&rank).map(|cursor| cursor.last)
    }
}

fn declares(live: &LiveRanks, rank: RankKey) -> bool {
    live.get(&rank.worker_id).is_some_and(|worker| worker.ranks.contains(&rank.dp_rank))
}

enum Cursor {
    /// The next id, or the rank's first.
    Next,
    /// Ids were skipped: the cursor moved past them.
    Gap,
    Replay,
    /// A new rank, but the publisher has no cursor left.
    Full,
}

#[cfg(test)]
mod tests;
