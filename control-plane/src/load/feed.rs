//! The kv_metrics feed: each decoded ActiveLoad sample is ordered, checked against the
//! publisher's identity, stored, and coalesced on to the replicas.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};

use continuum_proto::model::{LoadKey, LoadSample, WorkerKey};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};

use super::decode::{KvMetrics, decode_kv_metrics};
use super::events::LoadEvent;
use super::store::{Applied, SharedLoadStore};
use super::subscription::{Dropped, Feed, Refusal, SessionEnds};
use super::zmtp::Message;
use crate::discovery::{Fleet, Publisher, PublisherKey, Topic};
use crate::fleet::LoadCoalescer;
use crate::sources::Generation;

#[derive(Debug)]
pub struct LoadFeed {
    pub store: SharedLoadStore,
    pub sink: LoadCoalescer,
    /// `continuum_dynamo_load_events_total{result}`.
    pub events: IntCounterVec,
    /// `continuum_dynamo_load_subscriptions{state, transport}`.
    pub gauge: IntGaugeVec,
    /// `continuum_dynamo_subscriptions_left_out{topic="kv_metrics"}`.
    pub left_out: IntGauge,
    /// `continuum_dynamo_subscription_sessions_ended_total{topic="kv_metrics"}`.
    pub session_ends: SessionEnds,
    /// Removals the store has made but the replicas may not have heard of: a session cancelled
    /// while it waited for room in the coalescer's queue would otherwise leave those samples in
    /// every replica's view until the rank publishes again, which an idle worker never does.
    /// They go out again with the worker's next session, which starts by removing its samples.
    pub unsent: Mutex<HashSet<LoadKey>>,
}

impl LoadFeed {
    fn count(&self, event: LoadEvent) {
        self.events.with_label_values(&[event.as_str()]).inc();
    }

    /// Drops the publisher's samples, and removes them from the replicas' views with whatever
    /// an earlier, cancelled session of the same worker left unsent.
    async fn drop_publisher(&self, publisher: &PublisherKey, worker: Option<&WorkerKey>) {
        let dropped = {
            let mut store = self.store.lock();
            let mut dropped = store.drop_publisher(publisher);
            if let Some(worker) = worker {
                // Only those the store still lacks: another channel of the worker may hold a
                // newer sample for the rank by now, which the replicas must keep. A key also
                // among `dropped` is removed twice, which changes nothing.
                let unsent = self.unsent();
                dropped.extend(unsent.iter().filter(|k| k.worker == *worker && store.get(k).is_none()).cloned());
            }
            dropped
        };
        self.remove(dropped).await;
    }

    /// Queues the removal of `keys`, remembering them as unsent until the queue takes them.
    async fn remove(&self, keys: Vec<LoadKey>) {
        if keys.is_empty() {
            return;
        }
        self.unsent().extend(keys.iter().cloned());
        self.sink.remove(keys.iter().cloned()).await;
        let mut unsent = self.unsent();
        for key in &keys {
            unsent.remove(key);
        }
    }

    fn unsent(&self) -> MutexGuard<'_, HashSet<LoadKey>> {
        self.unsent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The highest sequence seen on this connection: at or below it is a duplicate, past the next
/// one is a gap. Reset on every connection, since the stream starts wherever the publisher is.
#[derive(Debug, Default)]
pub struct StreamOrder {
    last: Option<u64>,
    /// Messages after `last` that went unread (malformed, of an unknown version, too large):
    /// each took a sequence number, so after two the next one is `last + 3`, and only a later
    /// one shows a gap.
    unread: u64,
    /// Messages in a row numbered at or below `last`.
    behind: u32,
}

/// Messages in a row at or below the highest number seen that make the stream start over from
/// the next, as after a gap. A publisher numbers its messages one by one and sends each once,
/// so a run of them is no duplicate: the highest was out of its order (one message numbered
/// far ahead, a counter that restarted), and refusing every message below it would freeze the
/// worker's load at that one until the connection ended.
const BEHIND_BEFORE_RESTART: u32 = 8;

impl Feed for LoadFeed {
    type Session = StreamOrder;

    fn topic(&self) -> Topic {
        Topic::KvMetrics
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
        self.drop_publisher(&publisher.key(), publisher.worker.as_ref()).await;
    }

    async fn message(&self, publisher: &Publisher, order: &mut StreamOrder, message: Result<Message<'_>, Dropped>) {
        let decoded = match message {
            Err(reason) => Err(dropped_event(reason)),
            Ok(message) => {
                decode_kv_metrics((0..message.len()).filter_map(|i| message.frame(i)), publisher.publisher_id)
            }
        };
        match decoded.and_then(|m| self.accept(publisher, order, m)) {
            Ok(accepted) => {
                self.remove(accepted.removed).await;
                if let Some((key, sample)) = accepted.sample {
                    self.sink.submit(key, sample).await;
                }
            }
            Err(event) => {
                self.count(event);
                // The publisher's own message, unread: it may have held a change (the last
                // before an idle worker falls silent, say), so its samples go as on a gap rather
                // than stand until a later sequence shows one. Not a duplicate, nor one naming
                // another publisher, which was never this stream's.
                if matches!(event, LoadEvent::Malformed | LoadEvent::UnknownVersion | LoadEvent::Oversized) {
                    order.unread = order.unread.saturating_add(1);
                    self.drop_publisher(&publisher.key(), None).await;
                }
            }
        }
    }

    fn refused(&self, refusal: Refusal) {
        self.count(match refusal {
            Refusal::Transport => LoadEvent::TransportRefused,
            Refusal::NotAllowed => LoadEvent::NotAllowed,
        });
    }

    async fn departed(&self, publisher: &Publisher) {
        // With what a cancelled session of its worker left unsent: no later session of this
        // publisher will send it, and the worker may stay in the fleet.
        self.drop_publisher(&publisher.key(), publisher.worker.as_ref()).await;
    }

    async fn set_live(&self, generation: &Generation) {
        let live = live_ranks(&generation.fleet);
        // A departed worker's unsent removals need no sending: its samples leave with it.
        self.unsent().retain(|k| live.get(&k.worker).is_some_and(|ranks| ranks.contains(&k.dp_rank)));
        let evicted = self.store.lock().retain_live_at(generation.generation, live);
        self.remove(evicted).await;
    }
}

fn dropped_event(reason: Dropped) -> LoadEvent {
    match reason {
        // A kv_metrics message fits a buffer's free part, so it never waits on the budget.
        Dropped::Oversized | Dropped::OverBudget => LoadEvent::Oversized,
        Dropped::TooManyFrames => LoadEvent::Malformed,
        Dropped::TopicTooLong => LoadEvent::TopicMismatch,
    }
}

struct Accepted {
    /// Keys whose samples the store dropped (a gap), for the replicas.
    removed: Vec<LoadKey>,
    sample: Option<(LoadKey, LoadSample)>,
}

impl LoadFeed {
    /// Orders, checks and stores one decoded sample; an `Err` is the label it is counted under.
    fn accept(&self, publisher: &Publisher, order: &mut StreamOrder, m: KvMetrics) -> Result<Accepted, LoadEvent> {
        // The decoder checked the message is this publisher's, so its sequence is this stream's
        // whatever worker it names: a refused one still counts in the order, or the next
        // message would read as a gap and drop the publisher's samples for nothing.
        let gap = match order.last {
            Some(last) if m.sequence <= last => {
                order.behind += 1;
                if order.behind < BEHIND_BEFORE_RESTART {
                    return Err(LoadEvent::Duplicate);
                }
                true
            }
            Some(last) => m.sequence > last.saturating_add(1).saturating_add(order.unread),
            None => false,
        };
        *order = StreamOrder { last: Some(m.sequence), unread: 0, behind: 0 };
        let key = publisher.key();
        let mut store = self.store.lock();
        let mut removed = if gap {
            self.count(LoadEvent::SequenceGap);
            store.drop_publisher(&key)
        } else {
            Vec::new()
        };
        // A channel speaks for the worker its record names (its lease, or its event source's
        // worker): one that names none speaks for nobody, or it could set any worker's load.
        if publisher.worker.as_ref().is_none_or(|w| w.instance_id != m.worker_id) {
            self.count(LoadEvent::IdentityMismatch);
            return Ok(Accepted { removed, sample: None });
        }
        let load_key = LoadKey { worker: WorkerKey::new(publisher.namespace.clone(), m.worker_id), dp_rank: m.dp_rank };
        let now = std::time::Instant::now();
        match store.apply(load_key.clone(), &key, m.sequence, m.load, now) {
            Ok(Applied { sample, evicted }) => {
                self.count(LoadEvent::Applied);
                if let Some(evicted) = evicted {
                    // The store was full, and the entry it gave up is lost like a refused one.
                    self.count(LoadEvent::OverCapacity);
                    removed.push(evicted);
                }
                Ok(Accepted { removed, sample: Some((load_key, sample)) })
            }
            Err(event) => {
                self.count(event);
                Ok(Accepted { removed, sample: None })
            }
        }
    }
}

/// The ranks each discovered worker serves: the store's admission gate.
pub fn live_ranks(fleet: &Fleet) -> HashMap<WorkerKey, Range<u32>> {
    fleet
        .workers
        .iter()
        // The same ranks the replicas pick among: a start rank without a size is rank 0.
        .map(|w| (w.worker.key.clone(), w.worker.dp_ranks()))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::SystemTime;

    use continuum_proto::model::{DataPlaneConfig, Load};
    use futures::FutureExt;
    use prometheus::Opts;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::{StaticDiscoveryConfig, StaticWorkerConfig};
    use crate::fleet::{FleetChange, FleetPublisher, LOAD_COALESCE_WINDOW, test_worker};
    use crate::load::store::LoadStore;
    use crate::sources::static_fleet;

    /// A feed storing into `store` and coalescing on to `publisher`, with counters of its own.
    fn feed(publisher: &FleetPublisher, store: &SharedLoadStore) -> LoadFeed {
        LoadFeed {
            store: store.clone(),
            sink: LoadCoalescer::spawn(publisher.clone(), LOAD_COALESCE_WINDOW, CancellationToken::new()),
            events: IntCounterVec::new(Opts::new("events", "test"), &["result"]).expect("counter"),
            gauge: IntGaugeVec::new(Opts::new("gauge", "test"), &["state", "transport"]).expect("gauge"),
            left_out: IntGauge::new("left_out", "test").expect("gauge"),
            session_ends: SessionEnds::unregistered(Topic::KvMetrics),
            unsent: Mutex::default(),
        }
    }

    /// Worker 1's kv_metrics channel.
    fn channel() -> Publisher {
        crate::discovery::test_publisher(0xaa, Some(WorkerKey::new("dynamo", 1)))
    }

    /// A session cancelled while its removals waited for room in a full queue: the replicas
    /// keep those samples (the store no longer holds them, so nothing else would remove them).
    /// Returns the feed, worker 1's channel and the publisher the replicas follow.
    async fn cancelled_session() -> (LoadFeed, Publisher, FleetPublisher) {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        publisher.apply(FleetChange { upsert: vec![test_worker(1, 2), test_worker(2, 0)], ..FleetChange::default() });
        let store = SharedLoadStore::new(LoadStore::new(None));
        let live = [(WorkerKey::new("dynamo", 1), 0..2), (WorkerKey::new("dynamo", 2), 0..1)];
        store.lock().set_live_and_retain(live.into_iter().collect());
        let feed = feed(&publisher, &store);
        let channel = channel();
        let load = Load { kv_used_blocks: Some(5), ..Load::default() };
        for dp_rank in 0..2 {
            let key = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank };
            let sample = store.lock().apply(key.clone(), &channel.key(), 1, load, std::time::Instant::now());
            feed.sink.submit(key, sample.expect("applied").sample).await;
        }
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        assert_eq!(held(&publisher), 2);

        // The queue full (the coalescer does not run meanwhile), a new session starts and is
        // cancelled while its removals wait.
        let other = LoadKey { worker: WorkerKey::new("dynamo", 2), dp_rank: 0 };
        let sample = LoadSample { load, received_at: std::time::Instant::now() };
        while feed.sink.submit(other.clone(), sample).now_or_never().is_some() {}
        assert!(feed.connected(&channel).now_or_never().is_none(), "waits for room");
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        assert_eq!(held(&publisher), 2, "the replicas still hold what the store dropped");
        (feed, channel, publisher)
    }

    /// Worker 1's samples in the replicas' view.
    fn held(publisher: &FleetPublisher) -> usize {
        publisher.current().view().loads().keys().filter(|k| k.worker.instance_id == 1).count()
    }

    #[tokio::test(start_paused = true)]
    async fn removals_a_cancelled_session_never_sent_go_out_with_the_next() {
        let (feed, channel, publisher) = cancelled_session().await;
        feed.connected(&channel).await;
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        assert_eq!(held(&publisher), 0, "the next session sent them");
        assert!(feed.unsent().is_empty());
    }

    /// A rank another channel of the worker has published for since is not among them: its
    /// newer sample stays in the replicas' view.
    #[tokio::test(start_paused = true)]
    async fn an_unsent_removal_spares_a_rank_another_channel_published_for_since() {
        let (feed, channel, publisher) = cancelled_session().await;
        let other = crate::discovery::test_publisher(0xbb, Some(WorkerKey::new("dynamo", 1)));
        let rank0 = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 0 };
        let load = Load { kv_used_blocks: Some(9), ..Load::default() };
        let sample = feed.store.lock().apply(rank0.clone(), &other.key(), 1, load, std::time::Instant::now());
        feed.sink.submit(rank0.clone(), sample.expect("applied").sample).await;
        feed.connected(&channel).await;
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        let view = publisher.current();
        let held: Vec<_> = view.view().loads().iter().filter(|(k, _)| k.worker.instance_id == 1).collect();
        assert_eq!(held.len(), 1, "rank 1's removal went out, rank 0's did not");
        assert_eq!(held[0].0, &rank0);
        assert_eq!(held[0].1.load.kv_used_blocks, Some(9), "the other channel's sample");
    }

    /// No next session comes when the subscription stops for good (the publisher benched, or
    /// pushed past the cap) while the worker stays: its departure sends them.
    #[tokio::test(start_paused = true)]
    async fn removals_a_cancelled_session_never_sent_go_out_when_its_publisher_departs() {
        let (feed, channel, publisher) = cancelled_session().await;
        feed.departed(&channel).await;
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        assert_eq!(held(&publisher), 0, "the departure sent them");
        assert!(feed.unsent().is_empty());
    }

    /// A feed holding worker 1's rank 0, its event counter, and a message of publisher 0xaa.
    fn ordered_feed() -> (LoadFeed, FleetPublisher, Publisher, impl Fn(&str) -> u64) {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        let store = SharedLoadStore::new(LoadStore::new(None));
        store.lock().set_live_and_retain([(WorkerKey::new("dynamo", 1), 0..1)].into_iter().collect());
        let feed = feed(&publisher, &store);
        let events = feed.events.clone();
        (feed, publisher, channel(), move |label: &str| events.with_label_values(&[label]).get())
    }

    fn message(sequence: u64, worker_id: u64) -> KvMetrics {
        KvMetrics {
            publisher_id: 0xaa,
            sequence,
            published_at: 0,
            worker_id,
            dp_rank: 0,
            load: Load { kv_used_blocks: Some(sequence), ..Load::default() },
        }
    }

    /// A message naming another worker is refused, yet it is the publisher's own (the decoder
    /// checked its publisher id), so it takes its place in the stream's order: the next message
    /// is no gap, and the publisher's held samples stay.
    #[tokio::test]
    async fn a_message_naming_another_worker_keeps_its_place_in_the_order() {
        let (feed, _publisher, channel, count) = ordered_feed();
        let mut order = StreamOrder::default();
        let held = |accepted: Result<Accepted, LoadEvent>| accepted.map(|a| (a.removed.len(), a.sample.is_some()));

        assert_eq!(held(feed.accept(&channel, &mut order, message(1, 1))), Ok((0, true)));
        assert_eq!(held(feed.accept(&channel, &mut order, message(2, 9))), Ok((0, false)));
        assert_eq!(count("identity_mismatch"), 1);
        assert_eq!(held(feed.accept(&channel, &mut order, message(3, 1))), Ok((0, true)), "no gap: nothing dropped");
        assert_eq!(count("sequence_gap"), 0);
        // A refused message past a real gap still drops what the gap may have changed.
        assert_eq!(held(feed.accept(&channel, &mut order, message(5, 9))), Ok((1, false)));
        assert_eq!((count("sequence_gap"), count("identity_mismatch")), (1, 2));
        assert_eq!(feed.accept(&channel, &mut order, message(5, 1)).err(), Some(LoadEvent::Duplicate));
    }

    /// One message numbered far ahead of its stream (a bit flipped, a hostile publisher) does
    /// not freeze the worker's load there: a run of messages behind it starts the stream over,
    /// its held samples dropped as after a gap.
    #[tokio::test]
    async fn a_run_of_messages_behind_the_highest_number_starts_the_stream_over() {
        let (feed, _publisher, channel, count) = ordered_feed();
        let mut order = StreamOrder::default();
        let held = |accepted: Result<Accepted, LoadEvent>| accepted.map(|a| (a.removed.len(), a.sample.is_some()));
        assert_eq!(held(feed.accept(&channel, &mut order, message(1, 1))), Ok((0, true)));
        assert_eq!(held(feed.accept(&channel, &mut order, message(u64::MAX, 1))), Ok((1, true)), "a gap");
        for sequence in 2..u64::from(BEHIND_BEFORE_RESTART) + 1 {
            assert_eq!(held(feed.accept(&channel, &mut order, message(sequence, 1))), Err(LoadEvent::Duplicate));
        }
        let next = u64::from(BEHIND_BEFORE_RESTART) + 1;
        assert_eq!(held(feed.accept(&channel, &mut order, message(next, 1))), Ok((1, true)), "taken up again");
        assert_eq!(held(feed.accept(&channel, &mut order, message(next + 1, 1))), Ok((0, true)));
        assert_eq!(count("sequence_gap"), 2);
    }

    /// A message left unread (too large, say) took a sequence number: the one after it is no
    /// gap, counted once as what it was; one further on still is.
    #[tokio::test]
    async fn a_message_left_unread_takes_its_place_in_the_order() {
        let (feed, _publisher, channel, count) = ordered_feed();
        let mut order = StreamOrder::default();
        assert!(feed.accept(&channel, &mut order, message(1, 1)).is_ok());
        feed.message(&channel, &mut order, Err(Dropped::Oversized)).await;
        assert!(feed.accept(&channel, &mut order, message(3, 1)).is_ok());
        assert_eq!((count("oversized"), count("sequence_gap")), (1, 0), "one message lost, counted once");
        feed.message(&channel, &mut order, Err(Dropped::Oversized)).await;
        assert!(feed.accept(&channel, &mut order, message(6, 1)).is_ok());
        assert_eq!((count("oversized"), count("sequence_gap")), (2, 1), "5 never came");
        // Two unread in a row take two numbers: the one after them is no gap either.
        feed.message(&channel, &mut order, Err(Dropped::Oversized)).await;
        feed.message(&channel, &mut order, Err(Dropped::Oversized)).await;
        assert!(feed.accept(&channel, &mut order, message(9, 1)).is_ok());
        assert_eq!((count("oversized"), count("sequence_gap")), (4, 1), "two messages lost, each counted once");
    }

    #[test]
    fn the_ranks_admitted_are_the_ranks_replicas_pick_among() {
        let worker = |instance_id, dp_start_rank, dp_size| StaticWorkerConfig {
            instance_id,
            model: "tiny".into(),
            dp_start_rank,
            dp_size,
            ..StaticWorkerConfig::default()
        };
        let config = StaticDiscoveryConfig { workers: vec![worker(1, 2, 0), worker(2, 2, 2), worker(3, 0, 0)] };
        let fleet = static_fleet(&config, SystemTime::now(), &Fleet::default());
        let live = live_ranks(&fleet);
        let ranks = |id| live.get(&WorkerKey::new(crate::config::DEFAULT_DYNAMO_NAMESPACE, id)).cloned();
        // A start rank without a size means nothing: Dynamo serves such a worker as rank 0.
        assert_eq!([ranks(1), ranks(2), ranks(3)], [Some(0..1), Some(2..4), Some(0..1)]);
        for w in fleet.workers.iter() {
            assert_eq!(ranks(w.worker.key.instance_id), Some(w.worker.dp_ranks()));
        }
    }
}
