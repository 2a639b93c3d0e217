//! The kv_metrics feed: each decoded ActiveLoad sample is ordered, checked against the
//! publisher's identity, stored, and coalesced on to the replicas.

use std::collections::HashMap;
use std::ops::Range;

use continuum_proto::model::{LoadKey, LoadSample, WorkerKey};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};

use super::decode::{KvMetrics, decode_kv_metrics};
use super::events::LoadEvent;
use super::store::SharedLoadStore;
use super::subscription::{Dropped, Feed, Refusal};
use super::zmtp::Message;
use crate::discovery::{Fleet, Publisher, PublisherKey, Topic};
use crate::fleet::LoadCoalescer;

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
}

impl LoadFeed {
    fn count(&self, event: LoadEvent) {
        self.events.with_label_values(&[event.as_str()]).inc();
    }

    async fn drop_publisher(&self, publisher: &PublisherKey) {
        let dropped = self.store.lock().drop_publisher(publisher);
        self.sink.remove(dropped).await;
    }
}

/// The highest sequence seen on this connection: at or below it is a duplicate, past the next
/// one is a gap. Reset on every connection, since the stream starts wherever the publisher is.
#[derive(Debug, Default)]
pub struct StreamOrder {
    last: Option<u64>,
}

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

    async fn connected(&self, publisher: &Publisher) {
        self.drop_publisher(&publisher.key()).await;
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
                self.sink.remove(accepted.removed).await;
                if let Some((key, sample)) = accepted.sample {
                    self.sink.submit(key, sample).await;
                }
            }
            Err(event) => self.count(event),
        }
    }

    fn refused(&self, refusal: Refusal) {
        self.count(match refusal {
            Refusal::Transport => LoadEvent::TransportRefused,
            Refusal::NotAllowed => LoadEvent::NotAllowed,
        });
    }

    async fn departed(&self, publisher: &PublisherKey) {
        self.drop_publisher(publisher).await;
    }

    async fn set_live(&self, fleet: &Fleet) {
        let evicted = self.store.lock().set_live_and_retain(live_ranks(fleet));
        self.sink.remove(evicted).await;
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
        // A channel speaks for the worker its record names (its lease, or its event source's
        // worker): one that names none speaks for nobody, or it could set any worker's load.
        if publisher.worker.as_ref().is_none_or(|w| w.instance_id != m.worker_id) {
            return Err(LoadEvent::IdentityMismatch);
        }
        let gap = match order.last {
            Some(last) if m.sequence <= last => return Err(LoadEvent::Duplicate),
            Some(last) => m.sequence > last + 1,
            None => false,
        };
        order.last = Some(m.sequence);
        let load_key = LoadKey { worker: WorkerKey::new(publisher.namespace.clone(), m.worker_id), dp_rank: m.dp_rank };
        let now = std::time::Instant::now();
        let key = publisher.key();
        let mut store = self.store.lock();
        let removed = if gap {
            self.count(LoadEvent::SequenceGap);
            store.drop_publisher(&key)
        } else {
            Vec::new()
        };
        match store.apply(load_key.clone(), &key, m.sequence, m.load, now) {
            Ok(sample) => {
                self.count(LoadEvent::Applied);
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
    use std::time::SystemTime;

    use super::*;
    use crate::config::{StaticDiscoveryConfig, StaticWorkerConfig};
    use crate::sources::static_fleet;

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
        let fleet = static_fleet(&config, SystemTime::now());
        let live = live_ranks(&fleet);
        let ranks = |id| live.get(&WorkerKey::new(crate::config::DEFAULT_DYNAMO_NAMESPACE, id)).cloned();
        // A start rank without a size means nothing: Dynamo serves such a worker as rank 0.
        assert_eq!([ranks(1), ranks(2), ranks(3)], [Some(0..1), Some(2..4), Some(0..1)]);
        for w in fleet.workers.iter() {
            assert_eq!(ranks(w.worker.key.instance_id), Some(w.worker.dp_ranks()));
        }
    }
}
