//! The kv-events feed: each message from a worker rank's publisher goes through the
//! [`KvIndexer`]'s gates into the shared index, and every result is counted.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};

use continuum_kv_index::{KvResult, Outcome, RankKey};

use super::decode::{KvEvent, KvEventBatch, KvEventData, decode_kv_events};
use super::indexer::{KvIndexer, LiveRanks, LiveWorker, PublisherMapping};
use super::result::{KvCounts, KvEventResult};
use crate::discovery::{Fleet, Publisher, PublisherKey, Topic};
use crate::load::zmtp::{FREE_BUFFER_BYTES, LARGE_MESSAGES, Loan, Message, MessageBudget};
use crate::load::{Dropped, Feed, Refusal, SessionEnds};
use crate::sources::Generation;

/// The index behind one lock: event batches write, `FindMatches` reads.
#[derive(Debug, Clone, Default)]
pub struct SharedKvIndexer(Arc<RwLock<KvIndexer>>);

impl SharedKvIndexer {
    pub fn new(indexer: KvIndexer) -> Self {
        Self(Arc::new(RwLock::new(indexer)))
    }

    /// A panic while holding the lock cannot leave the index half-changed in a way that matters
    /// more than losing it, so a poisoned lock is used as is.
    pub fn read(&self) -> RwLockReadGuard<'_, KvIndexer> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, KvIndexer> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
pub struct KvFeed {
    pub indexer: SharedKvIndexer,
    /// `continuum_dynamo_kv_events_total{result}`.
    pub events: IntCounterVec,
    /// `continuum_dynamo_kv_subscriptions{state, transport}`.
    pub gauge: IntGaugeVec,
    /// `continuum_dynamo_subscriptions_left_out{topic="kv-events"}`.
    pub left_out: IntGauge,
    /// `continuum_dynamo_subscription_sessions_ended_total{topic="kv-events"}`.
    pub session_ends: SessionEnds,
    /// The instance ids last found live in two namespaces, reported when they change.
    pub ambiguous: Mutex<BTreeSet<u64>>,
}

impl KvFeed {
    fn report_ambiguous(&self, ambiguous: BTreeSet<u64>) {
        let mut reported = self.ambiguous.lock().unwrap_or_else(PoisonError::into_inner);
        if !ambiguous.is_empty() && *reported != ambiguous {
            tracing::warn!(
                instance_ids = ?ambiguous,
                "workers of one instance id in two namespaces: none of them is in the KV index until one leaves (their kv-events are refused as identity_mismatch)"
            );
        }
        *reported = ambiguous;
    }

    fn count(&self, counts: &KvCounts) {
        for (result, n) in counts.iter() {
            if n > 0 {
                self.events.with_label_values(&[result.as_str()]).inc_by(u64::from(n));
            }
        }
    }

    fn count_one(&self, result: KvEventResult) {
        self.events.with_label_values(&[result.as_str()]).inc();
    }

    /// A message of `publisher` was lost: its ranks are cleared as on a gap
    /// ([`KvIndexer::message_lost`]), one to a hold of the lock.
    async fn lose_message(&self, publisher: &PublisherKey, counts: &mut KvCounts) {
        let ranks = self.indexer.write().lose_message(publisher, counts);
        clear_each(&self.indexer, ranks).await;
    }

    /// Applies one message's events in turns of at most [`BLOCKS_PER_HOLD`] blocks, yielding
    /// between them. A message cut short between two turns (its session cancelled, as a reload
    /// of the subscriptions does) stands applied in part, which no gap would show on the next
    /// session: its publisher's ranks are cleared then, as on a gap.
    async fn apply_turns(&self, mapping: &PublisherMapping, events: &[KvEvent], counts: &mut KvCounts) {
        let mut cut_short = CutShort { feed: self, publisher: &mapping.publisher, armed: true };
        let mut turns = turns(events, BLOCKS_PER_HOLD).peekable();
        while let Some(turn) = turns.next() {
            match turn {
                Turn::Events(mut events) => loop {
                    // A turn's events name at most a hold's blocks; those a gap or a clear
                    // drops may take it past, and end the hold early.
                    let applied = self.indexer.write().apply_events_within(mapping, events, BLOCKS_PER_HOLD, counts);
                    events = &events[applied..];
                    if events.is_empty() {
                        break;
                    }
                    tokio::task::yield_now().await;
                },
                Turn::Large(event) => self.apply_large(mapping, event, counts).await,
            }
            if turns.peek().is_some() {
                tokio::task::yield_now().await;
            }
        }
        cut_short.armed = false;
    }

    /// Applies an event of more than [`BLOCKS_PER_HOLD`] blocks in parts, the lock let go and
    /// the task yielding between them, and counts it once, as the whole of its parts. A rank
    /// that leaves the fleet between two parts takes no more of them.
    async fn apply_large(&self, mapping: &PublisherMapping, event: &KvEvent, counts: &mut KvCounts) {
        let rank = match self.indexer.write().admit_event(mapping, event, counts) {
            Ok(rank) => rank,
            Err(refused) => return counts.add(refused),
        };
        let blocks = event.blocks();
        let mut outcome = Outcome::default();
        for part in parts(blocks, BLOCKS_PER_HOLD) {
            let end = part.end;
            let applied = {
                let mut indexer = self.indexer.write();
                if part.start > 0 && !indexer.is_live(rank) {
                    break;
                }
                indexer.apply_part(rank, &event.data, part)
            };
            outcome.merge(&applied);
            if let Some(result) = refuses_rest(&event.data, &applied) {
                outcome.add(result, blocks - end);
                break;
            }
            tokio::task::yield_now().await;
        }
        self.indexer.write().settle();
        counts.blocks.merge(&outcome);
        counts.add(outcome.summary().map_or(KvEventResult::Applied, KvEventResult::from));
    }
}

/// Clears `ranks` one to a hold of the index's lock, lookups between: one rank's clear takes
/// milliseconds at most (`docs/kv.md`), a publisher's every rank in one hold as many times that.
/// Cancelled part way (its subscription stopped by a reload), it clears the rest at once: they
/// were counted as cleared, and a lost message's ranks are marked so, which hides the jump
/// their next event shows.
pub(super) async fn clear_each(indexer: &SharedKvIndexer, ranks: Vec<RankKey>) {
    struct Rest<'a> {
        indexer: &'a SharedKvIndexer,
        ranks: std::vec::IntoIter<RankKey>,
    }
    impl Drop for Rest<'_> {
        fn drop(&mut self) {
            if self.ranks.len() > 0 {
                let mut indexer = self.indexer.write();
                self.ranks.by_ref().for_each(|rank| _ = indexer.clear_rank(rank));
            }
        }
    }
    let mut rest = Rest { indexer, ranks: ranks.into_iter() };
    for rank in rest.ranks.by_ref() {
        indexer.write().clear_rank(rank);
        tokio::task::yield_now().await;
    }
}

/// Clears a publisher's ranks as on a gap when dropped armed: its message was cut short.
struct CutShort<'a> {
    feed: &'a KvFeed,
    publisher: &'a PublisherKey,
    armed: bool,
}

impl Drop for CutShort<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut counts = KvCounts::default();
            self.feed.indexer.write().message_lost(self.publisher, &mut counts);
            self.feed.count(&counts);
        }
    }
}

/// The most blocks applied under one hold of the index's write lock (about 0.4 ms): every
/// lookup waits on it, and a replica waits 2 ms for one, so a message of tens of thousands of
/// blocks is applied in turns, the lock let go and the task yielding between them, and so is
/// an event that large alone, in parts.
const BLOCKS_PER_HOLD: usize = 2048;

/// What one hold of the lock applies: a run of events, or a part of one too large for a hold.
#[derive(Debug, PartialEq)]
enum Turn<'e> {
    Events(&'e [KvEvent]),
    Large(&'e KvEvent),
}

/// `events` in order, in runs of at most `max_blocks` blocks; an event larger than that is a
/// turn of its own, which [`KvFeed::apply_large`] applies in parts.
fn turns(events: &[KvEvent], max_blocks: usize) -> impl Iterator<Item = Turn<'_>> {
    let mut rest = events;
    std::iter::from_fn(move || {
        let (first, _) = rest.split_first()?;
        if first.blocks() > max_blocks {
            rest = &rest[1..];
            return Some(Turn::Large(first));
        }
        let mut blocks = 0;
        let over = rest.iter().position(|event| {
            // A clear names no blocks: one here; what it drops ends its hold early
            // (`KvIndexer::apply_events_within`).
            blocks += event.blocks().max(1);
            blocks > max_blocks
        });
        let (turn, later) = rest.split_at(over.map_or(rest.len(), |at| at.max(1)));
        rest = later;
        Some(Turn::Events(turn))
    })
}

/// Of an event's `blocks`, the parts of at most `max_blocks` applied one to a hold.
fn parts(blocks: usize, max_blocks: usize) -> impl Iterator<Item = Range<usize>> {
    let step = max_blocks.max(1);
    (0..blocks).step_by(step).map(move |start| start..blocks.min(start + step))
}

/// Whether a stored part refused the rest of its chain (its parent unknown, or the index
/// full): the blocks after it would only find their parent missing, so they are counted under
/// the same result without being applied, as one hold would have counted them.
fn refuses_rest(data: &KvEventData, part: &Outcome) -> Option<KvResult> {
    let KvEventData::Stored(_) = data else { return None };
    [KvResult::UnknownParent, KvResult::OverCapacity].into_iter().find(|result| part.get(*result) > 0)
}

impl Feed for KvFeed {
    /// Nothing: message numbers and event-id cursors live in the indexer, since they must
    /// outlive a reconnect for a loss spanning it to be seen.
    type Session = ();

    fn topic(&self) -> Topic {
        Topic::KvEvents
    }

    fn gauge(&self) -> &IntGaugeVec {
        &self.gauge
    }

    fn left_out(&self) -> &IntGauge {
        &self.left_out
    }

    fn session_ends(&self) -> &SessionEnds {
        &self.session_ends
    }

    async fn connected(&self, publisher: &Publisher) {
        self.indexer.write().publisher_up(&publisher.key());
    }

    async fn message(&self, publisher: &Publisher, _: &mut (), message: Result<Message<'_>, Dropped>) {
        let message = match message {
            Ok(message) => message,
            Err(reason @ (Dropped::Oversized | Dropped::OverBudget | Dropped::TooManyFrames)) => {
                // Too large to read, or to read now, or framed wrong (a malformed message, as
                // one the decoder refuses): a batch of this publisher's events, lost.
                let mut counts = KvCounts::default();
                counts.add(match reason {
                    Dropped::OverBudget => KvEventResult::OverBudget,
                    Dropped::TooManyFrames => KvEventResult::Malformed,
                    _ => KvEventResult::Oversized,
                });
                self.lose_message(&publisher.key(), &mut counts).await;
                return self.count(&counts);
            }
            Err(Dropped::TopicTooLong) => return self.count_one(KvEventResult::TopicMismatch),
        };
        // A channel whose worker discovery could not name speaks for nobody.
        let Some(worker) = &publisher.worker else {
            return self.count_one(KvEventResult::IdentityMismatch);
        };
        let mapping =
            PublisherMapping { publisher: publisher.key(), worker_id: worker.instance_id, dp_rank: publisher.dp_rank };
        let frames = || (0..message.len()).filter_map(|i| message.frame(i));
        let wire_bytes = frames().map(<[u8]>::len).sum::<usize>();
        // Decoded before the lock: it is the whole index's, and every lookup waits on it.
        let counts = match decode_kv_events(frames(), publisher.publisher_id) {
            Ok(batch) => {
                let mut counts = KvCounts::default();
                let Some(_loan) = decoded_loan(&batch, wire_bytes, worker.instance_id, &LARGE_MESSAGES) else {
                    counts.add(KvEventResult::OverBudget);
                    self.lose_message(&mapping.publisher, &mut counts).await;
                    return self.count(&counts);
                };
                // Messages lost before it (their removals among them, perhaps): the ranks are
                // cleared as on a gap.
                let lost = self.indexer.write().numbered(&mapping.publisher, batch.sequence, &mut counts);
                clear_each(&self.indexer, lost).await;
                self.apply_turns(&mapping, &batch.events, &mut counts).await;
                counts
            }
            Err(refused) => {
                let mut counts = KvCounts::default();
                counts.add(refused.into());
                if refused.loses_events() {
                    self.lose_message(&mapping.publisher, &mut counts).await;
                }
                counts
            }
        };
        self.count(&counts);
    }

    fn disconnected(&self, publisher: &Publisher) {
        self.indexer.write().publisher_down(&publisher.key(), Instant::now());
    }

    fn refused(&self, refusal: Refusal) {
        self.count_one(match refusal {
            Refusal::Transport => KvEventResult::TransportRefused,
            Refusal::NotAllowed => KvEventResult::NotAllowed,
        });
    }

    async fn departed(&self, publisher: &Publisher) {
        let ranks = self.indexer.write().take_publisher(&publisher.key());
        clear_each(&self.indexer, ranks).await;
    }

    async fn set_live(&self, generation: &Generation) {
        // Gathered before the lock: lookups wait on it.
        let (live, ambiguous) = live_ranks(&generation.fleet);
        self.report_ambiguous(ambiguous);
        // Departed ranks are cleared one to a hold of the lock, lookups between (they are not
        // answered for a rank no longer live): a node's workers leaving together would
        // otherwise hold the whole index for all their clears in a row, milliseconds each.
        let departed = self.indexer.read().departed(&live);
        for rank in departed {
            self.indexer.write().clear_departed(rank);
            tokio::task::yield_now().await;
        }
        self.indexer.write().set_live(live);
    }
}

/// Decoded, a hash takes 8 bytes however short its encoding: a frame of one-byte hashes holds
/// eight times its size. Past its frames (or the free buffer), a batch borrows from the budget
/// its frames do, for as long as it is applied; `None` (to be dropped as an over-budget frame
/// is) when the budget, or the worker's share of it, has no room.
fn decoded_loan(batch: &KvEventBatch, wire_bytes: usize, worker: u64, budget: &'static MessageBudget) -> Option<Loan> {
    let held = batch.events.iter().map(KvEvent::held_bytes).sum::<usize>();
    budget.loan(held.saturating_sub(wire_bytes.max(FREE_BUFFER_BYTES)), worker)
}

/// Live worker ids and the ranks each declares: the index's identity gate. Instance ids are
/// etcd lease ids, unique across namespaces. With each, how many of its ranks have a
/// `kv-events` channel (one channel a rank). An id live in two namespaces (a record written
/// without a lease, or forged) is left out, and returned: the index keeps blocks by id, and
/// which namespace's worker is genuine cannot be told, as discovery refuses a contested
/// identity whole.
fn live_ranks(fleet: &Fleet) -> (LiveRanks, BTreeSet<u64>) {
    // A channel whose event source names no rank may speak for any of the worker's ranks (the
    // indexer admits its events for each), so it shares the index as all of them: counted as
    // one, a worker declaring 64 ranks could hold 64 ranks' shares for one.
    let mut publishing: HashSet<(u64, Option<u32>)> = HashSet::new();
    for publisher in fleet.publishers.iter().filter(|p| p.topic == Topic::KvEvents) {
        if let Some(worker) = &publisher.worker {
            publishing.insert((worker.instance_id, publisher.dp_rank));
        }
    }
    let (mut live, mut ambiguous) = (HashMap::with_capacity(fleet.workers.len()), BTreeSet::new());
    for w in fleet.workers.iter() {
        // The same ranks the replicas pick among: a start rank without a size is rank 0.
        let (id, ranks) = (w.worker.key.instance_id, w.worker.dp_ranks());
        let publishing = if publishing.contains(&(id, None)) {
            ranks.len()
        } else {
            ranks.clone().filter(|rank| publishing.contains(&(id, Some(*rank)))).count()
        };
        let namespace = &w.worker.key.namespace;
        if live.get(&id).is_some_and(|other: &LiveWorker| other.namespace != *namespace) {
            ambiguous.insert(id);
        }
        live.insert(id, LiveWorker { namespace: Arc::clone(namespace), ranks, publishing });
    }
    live.retain(|id, _| !ambiguous.contains(id));
    (live, ambiguous)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::decode::{KvEventData, ResidencyDomain, StorageTier};

    fn removed(event_id: u64, blocks: usize) -> KvEvent {
        KvEvent {
            worker_id: 1,
            dp_rank: 0,
            event_id,
            storage_tier: StorageTier::Device,
            residency_domain: ResidencyDomain::Unspecified,
            data: KvEventData::Removed((0..blocks as u64).collect()),
        }
    }

    /// The index's room is shared among the ranks with a `kv-events` channel: a decode worker
    /// of 1.6.1 (no channel) and a worker's silent ranks take none of it.
    #[test]
    fn only_ranks_that_publish_kv_events_share_the_index() {
        use crate::discovery::{test_publisher, test_worker};
        use continuum_proto::model::Role;
        let mut fleet = Fleet::default();
        for (id, role) in [(1, Role::Prefill), (2, Role::Decode)] {
            let (key, mut worker) = test_worker("dynamo", id, role, "tiny");
            worker.worker.dp_size = 4;
            fleet.workers.insert(key, worker);
        }
        // Worker 1 publishes for ranks 0 and 2, once for rank 2 again; worker 2 only load.
        let prefill = Some(continuum_proto::model::WorkerKey::new("dynamo", 1));
        for (publisher, rank) in [(10, 0), (11, 2), (12, 2)] {
            let channel =
                Publisher { topic: Topic::KvEvents, dp_rank: Some(rank), ..test_publisher(publisher, prefill.clone()) };
            fleet.publishers.insert(channel.key(), channel);
        }
        let load = test_publisher(20, Some(continuum_proto::model::WorkerKey::new("dynamo", 2)));
        fleet.publishers.insert(load.key(), load);
        let (live, _) = live_ranks(&fleet);
        let publishing: Vec<(u64, usize, usize)> =
            [1, 2].iter().map(|id| (*id, live[id].ranks.len(), live[id].publishing)).collect();
        assert_eq!(publishing, [(1, 4, 2), (2, 4, 0)]);
        let mut indexer = KvIndexer::default();
        indexer.set_live(live);
        use continuum_kv_index::{MAX_BLOCKS_PER_RANK, MAX_INDEX_BLOCKS};
        assert_eq!(indexer.index().rank_share(), (MAX_INDEX_BLOCKS / 2).min(MAX_BLOCKS_PER_RANK), "two ranks publish");
        assert!(indexer.index().rank_share() > MAX_INDEX_BLOCKS / 8, "not an eighth, for all eight ranks");

        // A channel naming no rank may store for any of worker 2's ranks: it shares as all four.
        let rankless = Publisher {
            topic: Topic::KvEvents,
            dp_rank: None,
            ..test_publisher(21, Some(continuum_proto::model::WorkerKey::new("dynamo", 2)))
        };
        fleet.publishers.insert(rankless.key(), rankless);
        let (live, _) = live_ranks(&fleet);
        assert_eq!([live[&1].publishing, live[&2].publishing], [2, 4]);
        indexer.set_live(live);
        assert_eq!(indexer.index().rank_share(), (MAX_INDEX_BLOCKS / 6).min(MAX_BLOCKS_PER_RANK), "six ranks");
    }

    /// The index keeps blocks by instance id: an id live in two namespaces (a lease-less or
    /// forged record beside the genuine worker) is no one's, so neither namespace's channel
    /// stores or clears blocks under it; the other workers stay.
    #[test]
    fn an_instance_id_live_in_two_namespaces_is_left_out_of_the_index() {
        use crate::discovery::test_worker;
        use continuum_proto::model::Role;
        let mut fleet = Fleet::default();
        for (namespace, id) in [("dynamo", 7), ("zz", 7), ("dynamo", 8)] {
            let (key, worker) = test_worker(namespace, id, Role::Prefill, "tiny");
            fleet.workers.insert(key, worker);
        }
        let (live, ambiguous) = live_ranks(&fleet);
        assert_eq!(ambiguous, BTreeSet::from([7]));
        assert_eq!(live.keys().copied().collect::<Vec<_>>(), [8]);
        fleet.workers.retain(|key, _| key.namespace.as_ref() != "zz");
        let (live, ambiguous) = live_ranks(&fleet);
        assert!(ambiguous.is_empty());
        assert_eq!(live.keys().copied().collect::<BTreeSet<_>>(), BTreeSet::from([7, 8]), "once one leaves");
        assert_eq!(live[&7].namespace.as_ref(), "dynamo");
    }

    #[test]
    fn a_large_message_is_applied_in_turns_in_order() {
        let sizes = [1000, 1000, 100, 3000, 2048, 1, 0];
        let events: Vec<KvEvent> = sizes.iter().enumerate().map(|(i, n)| removed(i as u64, *n)).collect();
        let turns: Vec<(bool, Vec<u64>)> = turns(&events, 2048)
            .map(|turn| match turn {
                Turn::Events(events) => (false, events.iter().map(|e| e.event_id).collect()),
                Turn::Large(event) => (true, vec![event.event_id]),
            })
            .collect();
        // 1000 + 1000 + 100 would pass 2048; 3000 alone is over it, applied in parts; 2048 is at it.
        let expected = [(false, vec![0, 1]), (false, vec![2]), (true, vec![3]), (false, vec![4]), (false, vec![5, 6])];
        assert_eq!(turns, expected);
        assert_eq!(super::turns(&[], 2048).count(), 0);
        let parts: Vec<Range<usize>> = parts(5000, 2048).collect();
        assert_eq!(parts, [0..2048, 2048..4096, 4096..5000]);
        assert_eq!(super::parts(2048, 2048).count(), 1);
    }

    fn chain(event_id: u64, parent: Option<u64>, hashes: Range<u64>) -> KvEvent {
        use continuum_kv_index::StoredBlock;
        let blocks = hashes.map(|h| StoredBlock { block_hash: h, tokens_hash: h + (1 << 32) }).collect();
        let data = KvEventData::Stored(crate::kv::decode::Stored { parent_hash: parent, start_position: None, blocks });
        KvEvent { data, ..removed(event_id, 0) }
    }

    fn one_rank() -> (KvIndexer, PublisherMapping) {
        let mut indexer = KvIndexer::default();
        let worker = LiveWorker { namespace: "dynamo".into(), ranks: 0..1, publishing: 1 };
        indexer.set_live(LiveRanks::from([(1, worker)]));
        let publisher = crate::discovery::PublisherKey { namespace: "dynamo".into(), publisher_id: 5 };
        (indexer, PublisherMapping { publisher, worker_id: 1, dp_rank: Some(0) })
    }

    fn feed(indexer: KvIndexer) -> KvFeed {
        let events = IntCounterVec::new(prometheus::Opts::new("e", "e"), &["result"]).unwrap();
        let gauge = IntGaugeVec::new(prometheus::Opts::new("g", "g"), &["state", "transport"]).unwrap();
        let (left_out, session_ends) = (IntGauge::new("l", "l").unwrap(), SessionEnds::unregistered(Topic::KvEvents));
        KvFeed {
            indexer: SharedKvIndexer::new(indexer),
            events,
            gauge,
            left_out,
            session_ends,
            ambiguous: Mutex::default(),
        }
    }

    /// A batch of short-encoded hashes holds more decoded than its frames did: what it holds
    /// past them is lent from the frames' budget while it is applied, within the worker's share;
    /// one encoded as Dynamo does (nine bytes a hash) borrows nothing.
    #[test]
    fn a_batch_decoded_past_its_frames_borrows_the_difference() {
        static BUDGET: MessageBudget = MessageBudget::with_share(1 << 20, 1 << 19);
        let hashes = 65_536;
        let batch = |n: u64| KvEventBatch {
            publisher_id: 5,
            sequence: 1,
            published_at: 0,
            events: vec![KvEvent { data: KvEventData::Removed((0..n).collect()), ..removed(1, 0) }],
        };
        let fixints = batch(hashes);
        let held = fixints.events[0].held_bytes();
        assert!(held >= 8 * hashes as usize);
        let loan = decoded_loan(&fixints, hashes as usize, 1, &BUDGET).expect("within the share");
        assert_eq!(BUDGET.lent_to(1), held - FREE_BUFFER_BYTES, "past the free buffer");
        assert!(decoded_loan(&fixints, hashes as usize, 1, &BUDGET).is_none(), "a second is past the share");
        assert!(decoded_loan(&fixints, hashes as usize, 2, &BUDGET).is_some(), "another worker's share");
        drop(loan);
        assert_eq!(BUDGET.lent_to(1), 0, "repaid");
        let as_dynamo = batch(hashes);
        let _free = decoded_loan(&as_dynamo, 9 * hashes as usize, 3, &BUDGET).expect("nothing to borrow");
        assert_eq!(BUDGET.lent_to(3), 0);
        // A small batch holding more than its few frames, but no more than the free buffer a
        // subscription has anyway, borrows nothing.
        let small = batch(4_096);
        let held = small.events[0].held_bytes();
        assert!(held > 4_096 && held <= FREE_BUFFER_BYTES, "{held}");
        let _free = decoded_loan(&small, 4_096, 4, &BUDGET).expect("nothing to borrow");
        assert_eq!(BUDGET.lent_to(4), 0, "within the free buffer");
    }

    /// A message cut short between two turns (its session cancelled by a reload) clears its
    /// publisher's ranks as on a gap, since the next session could not tell; one applied whole
    /// does not.
    #[tokio::test]
    async fn a_message_cut_short_between_two_turns_clears_its_ranks_as_on_a_gap() {
        let (_, mapping) = one_rank();
        let feed = feed(one_rank().0);
        let blocks = 3 * BLOCKS_PER_HOLD as u64;
        let events = [chain(1, None, 0..blocks)];
        let mut counts = KvCounts::default();
        {
            let applying = feed.apply_turns(&mapping, &events, &mut counts);
            tokio::pin!(applying);
            // One poll: the first part is applied, then the task yields, and is dropped.
            assert!(futures::poll!(applying.as_mut()).is_pending());
            let held = feed.indexer.read().index().stats().ownerships;
            assert_eq!(held, BLOCKS_PER_HOLD, "a part was applied");
        }
        assert_eq!(feed.indexer.read().index().stats().ownerships, 0, "cleared as on a gap");
        assert_eq!(feed.events.with_label_values(&["gap"]).get(), 1);

        feed.apply_turns(&mapping, &[chain(2, None, 0..blocks)], &mut counts).await;
        assert_eq!(feed.indexer.read().index().stats().ownerships, blocks as usize, "whole");
        assert_eq!(feed.events.with_label_values(&["gap"]).get(), 1, "no gap");
    }

    /// Ranks handed out to clear one to a hold are cleared, all of them, even when the task
    /// clearing them is cancelled between two: a lost message marks them cleared, and a rank
    /// so marked but not cleared would keep its blocks past the next gap.
    #[tokio::test]
    async fn ranks_to_clear_are_cleared_even_when_the_clearing_is_cancelled() {
        let mut indexer = KvIndexer::default();
        indexer.set_live(LiveRanks::from([(1, LiveWorker { namespace: "dynamo".into(), ranks: 0..3, publishing: 3 })]));
        let publisher = crate::discovery::PublisherKey { namespace: "dynamo".into(), publisher_id: 5 };
        let mapping = PublisherMapping { publisher: publisher.clone(), worker_id: 1, dp_rank: None };
        let events: Vec<KvEvent> = (0..3).map(|r| KvEvent { dp_rank: r, ..chain(1, None, 0..4) }).collect();
        indexer.apply_events(&mapping, &events);
        let feed = feed(indexer);
        let ranks = feed.indexer.write().lose_message(&publisher, &mut KvCounts::default());
        {
            let clearing = clear_each(&feed.indexer, ranks);
            tokio::pin!(clearing);
            assert!(futures::poll!(clearing.as_mut()).is_pending(), "one rank cleared, then a yield");
            assert_eq!(feed.indexer.read().index().stats().ownerships, 8, "two ranks still hold theirs");
        }
        assert_eq!(feed.indexer.read().index().stats().ownerships, 0, "the rest cleared as it was dropped");
    }

    /// An event past one hold's blocks is applied in parts, the lock let go between them: the
    /// index and the counts end as one hold would have left them.
    #[tokio::test]
    async fn an_event_too_large_for_one_hold_is_applied_in_parts_as_if_whole() {
        let blocks = 4 * BLOCKS_PER_HOLD as u64 + 5;
        let tokens: Vec<u64> = (0..blocks).map(|h| h + (1 << 32)).collect();
        let events = [
            chain(1, None, 0..blocks),
            // Its parent is nowhere: every block refused, once as an event.
            chain(2, Some(u64::MAX), blocks..2 * blocks),
            // The chain's second half goes, then the rest of it, in one more part.
            KvEvent { data: KvEventData::Removed((blocks / 2..blocks).collect()), ..removed(3, 0) },
        ];
        let (mut whole, mapping) = one_rank();
        let feed = feed(one_rank().0);
        // Between two parts the lock is free: a lookup then sees the chain's first parts.
        let (mut first, mut seen) = (KvCounts::default(), Vec::new());
        let watch = async {
            for _ in 0..3 {
                tokio::task::yield_now().await;
                seen.push(feed.indexer.read().index().stats().ownerships);
            }
        };
        tokio::join!(feed.apply_large(&mapping, &events[0], &mut first), watch);
        let partial = |held: &usize| *held > 0 && held.is_multiple_of(BLOCKS_PER_HOLD) && *held < blocks as usize;
        assert!(seen.iter().all(partial), "every look between two parts sees whole parts: {seen:?}");
        let feed = self::feed(one_rank().0);
        for (i, event) in events.iter().enumerate() {
            let at_once = whole.apply_events(&mapping, std::slice::from_ref(event));
            let mut in_parts = KvCounts::default();
            feed.apply_large(&mapping, event, &mut in_parts).await;
            assert_eq!(in_parts, at_once, "event {i}");
            let parts = feed.indexer.read();
            assert_eq!(parts.find_matches(&tokens).as_slice(), whole.find_matches(&tokens).as_slice(), "event {i}");
            assert_eq!(parts.index().stats().ownerships, whole.index().stats().ownerships, "event {i}");
        }
        let whole = whole.find_matches(&tokens);
        assert_eq!(whole.as_slice(), [(continuum_kv_index::RankKey { worker_id: 1, dp_rank: 0 }, blocks as u32 / 2)]);
    }
}
