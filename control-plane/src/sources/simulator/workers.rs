//! The simulated workers. Each holds its `kv_used_blocks` and publishes a kv_metrics message
//! as a 1.6.1 mocker does: its first (sequence 0) with its first request, then one whenever the
//! load changes, none while idle, and none replayed to a subscriber that joins late (a ZMQ PUB
//! socket keeps nothing). Each also keeps a prefix cache of the prompts it prefilled and
//! publishes what it stores and evicts as kv-events, in the same wire format (see
//! `crate::load::decode` and `crate::kv::decode` for the layouts).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};

use serde::Serialize;
use tokio::sync::broadcast;

use super::prefix_cache::{Block, PrefixCache};
use super::wire::{self, Message};
use crate::kv::decode::{KV_EVENTS_TOPIC, MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH};
use crate::load::decode::KV_METRICS_TOPIC;

/// Messages a slow subscriber may fall behind by. Past it, older ones are skipped: for
/// kv_metrics the latest load wins; kv-events start over (see [`SimulatedWorker::clear_kv`]).
pub const PUBLISH_BACKLOG: usize = 64;

#[derive(Debug)]
struct Published {
    kv_used_blocks: u64,
    /// The next message's sequence number; 0 until the first is published.
    sequence: u64,
}

/// The kv-events publisher's side: the cache, and the numbering of its messages and events.
#[derive(Debug)]
struct Events {
    cache: PrefixCache,
    /// The next message's sequence number.
    sequence: u64,
    /// The last event's id; the first is 1.
    event_id: u64,
}

/// Blocks one stored or removed event carries, so a message of [`EVENTS_PER_MESSAGE`] of them
/// stays within the control plane's batch bounds.
const BLOCKS_PER_EVENT: usize = 512;
const EVENTS_PER_MESSAGE: usize = 8;
const _: () = assert!(BLOCKS_PER_EVENT * EVENTS_PER_MESSAGE <= MAX_BLOCKS_PER_BATCH);
const _: () = assert!(EVENTS_PER_MESSAGE <= MAX_EVENTS_PER_BATCH);

/// Where a worker is in its life, as a Dynamo worker that is SIGKILLed goes through it: serving;
/// killed while its etcd lease lives on (still discovered, silent, refused by the frontend);
/// and gone from discovery once the lease expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Life {
    Serving,
    Killed,
    Gone,
}

/// A simulated worker rank 0 and its two publishers.
#[derive(Debug)]
pub struct SimulatedWorker {
    pub worker_id: u64,
    /// The kv_metrics publisher's id.
    pub publisher_id: u64,
    pub kv_events_publisher_id: u64,
    pub total_kv_blocks: u64,
    state: Mutex<Published>,
    events: Mutex<Events>,
    kv_metrics: broadcast::Sender<Message>,
    kv_events: broadcast::Sender<Message>,
    life: AtomicU8,
}

impl SimulatedWorker {
    /// A worker whose publishers are `publisher_id` (kv_metrics) and `kv_events_publisher_id`.
    pub fn new(worker_id: u64, (publisher_id, kv_events_publisher_id): (u64, u64), total_kv_blocks: u64) -> Self {
        let capacity = usize::try_from(total_kv_blocks).unwrap_or(usize::MAX);
        Self {
            worker_id,
            publisher_id,
            kv_events_publisher_id,
            total_kv_blocks,
            state: Mutex::new(Published { kv_used_blocks: 0, sequence: 0 }),
            events: Mutex::new(Events { cache: PrefixCache::new(capacity), sequence: 0, event_id: 0 }),
            kv_metrics: broadcast::channel(PUBLISH_BACKLOG).0,
            kv_events: broadcast::channel(PUBLISH_BACKLOG).0,
            life: AtomicU8::new(Life::Serving as u8),
        }
    }

    pub fn life(&self) -> Life {
        match self.life.load(Ordering::Acquire) {
            0 => Life::Serving,
            1 => Life::Killed,
            _ => Life::Gone,
        }
    }

    /// Kills a serving worker; false if it was not serving.
    pub fn kill(&self) -> bool {
        let (serving, killed) = (Life::Serving as u8, Life::Killed as u8);
        self.life.compare_exchange(serving, killed, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Its lease expired: discovery no longer holds it.
    pub fn expire(&self) {
        self.life.store(Life::Gone as u8, Ordering::Release);
    }

    /// The kv_metrics channel: a receiver gets every message published after it subscribed.
    pub fn kv_metrics(&self) -> broadcast::Sender<Message> {
        self.kv_metrics.clone()
    }

    /// The kv-events channel.
    pub fn kv_events(&self) -> broadcast::Sender<Message> {
        self.kv_events.clone()
    }

    /// How many leading blocks of `blocks` the worker holds now.
    pub fn held(&self, blocks: &[Block]) -> usize {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).cache.held(blocks)
    }

    /// Forgets every cached block and says so (`cleared`): a kv-events subscriber that joined
    /// or fell behind holds nothing of what came before, and a cache the index no longer
    /// mirrors would never be announced again.
    pub fn clear_kv(&self) {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events.cache.clear();
        self.publish_events(&mut events, &[EventData::Cleared]);
    }

    /// The worker prefilled a prompt of `blocks`: it stores
    /// them, publishing what it stored and evicted, and returns how many it already held.
    pub fn store_prompt(&self, blocks: &[Block]) -> usize {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let stored = events.cache.store(blocks);
        let mut data: Vec<EventData> = stored
            .evicted
            .chunks(BLOCKS_PER_EVENT)
            .map(|hashes| EventData::Removed { block_hashes: hashes.to_vec() })
            .collect();
        let mut parent = stored.parent;
        for chunk in stored.new.chunks(BLOCKS_PER_EVENT) {
            let blocks = chunk.iter().map(|b| StoredBlock {
                block_hash: b.sequence,
                tokens_hash: b.tokens,
                mm_extra_info: None,
            });
            data.push(EventData::Stored { parent_hash: parent, start_position: None, blocks: blocks.collect() });
            parent = chunk.last().map(|b| b.sequence);
        }
        self.publish_events(&mut events, &data);
        stored.cached
    }

    /// Publishes `data` as events numbered on from the last, in messages within the bounds.
    fn publish_events(&self, events: &mut Events, data: &[EventData]) {
        for batch in data.chunks(EVENTS_PER_MESSAGE) {
            let payload: Vec<RouterEvent> = batch
                .iter()
                .map(|data| {
                    events.event_id += 1;
                    RouterEvent::new(self.worker_id, events.event_id, data)
                })
                .collect();
            // Integers, strings and options into a Vec: serializing cannot fail.
            let payload = rmp_serde::to_vec_named(&payload).unwrap_or_default();
            let message = wire::message(KV_EVENTS_TOPIC, self.kv_events_publisher_id, events.sequence, &payload);
            events.sequence += 1;
            let _ = self.kv_events.send(message);
        }
    }

    /// A request reached the worker: its first one publishes the worker's load for the first
    /// time, changed or not.
    pub fn touch(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.sequence == 0 {
            let used = state.kv_used_blocks;
            self.publish(&mut state, used);
        }
    }

    #[cfg(test)]
    pub fn kv_used_blocks(&self) -> u64 {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).kv_used_blocks
    }

    /// Takes `blocks`, as many as the worker's capacity leaves, and publishes the new load;
    /// returns how many it took (what to give back).
    pub fn add(&self, blocks: u64) -> u64 {
        let mut taken = 0;
        self.update(|used, total| {
            let after = used.saturating_add(blocks).min(total);
            taken = after.saturating_sub(used);
            after
        });
        taken
    }

    /// Gives `blocks` back and publishes the new load.
    pub fn release(&self, blocks: u64) {
        self.update(|used, _| used.saturating_sub(blocks));
    }

    fn update(&self, change: impl FnOnce(u64, u64) -> u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let used = change(state.kv_used_blocks, self.total_kv_blocks);
        if used == state.kv_used_blocks {
            return;
        }
        self.publish(&mut state, used);
    }

    fn publish(&self, state: &mut Published, used: u64) {
        state.kv_used_blocks = used;
        let message = encode(self.publisher_id, state.sequence, self.worker_id, used);
        state.sequence += 1;
        // No subscriber is fine: a PUB socket drops what nobody subscribed to.
        let _ = self.kv_metrics.send(message);
    }
}

/// Dynamo's ActiveLoad: the scheduler fields are nil in 1.6.1's direct mode.
#[derive(Serialize)]
struct ActiveLoad {
    worker_id: u64,
    dp_rank: u32,
    active_decode_blocks: Option<u64>,
    active_prefill_tokens: Option<u64>,
    kv_used_blocks: u64,
}

/// Dynamo's RouterEvent, with the fields a 1.6.1 mocker writes.
#[derive(Serialize)]
struct RouterEvent<'a> {
    worker_id: u64,
    storage_tier: &'static str,
    residency_domain: &'static str,
    event: KvCacheEvent<'a>,
}

#[derive(Serialize)]
struct KvCacheEvent<'a> {
    event_id: u64,
    data: &'a EventData,
    dp_rank: u32,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum EventData {
    Stored { parent_hash: Option<u64>, start_position: Option<u32>, blocks: Vec<StoredBlock> },
    Removed { block_hashes: Vec<u64> },
    Cleared,
}

#[derive(Serialize)]
struct StoredBlock {
    block_hash: u64,
    tokens_hash: u64,
    mm_extra_info: Option<()>,
}

impl<'a> RouterEvent<'a> {
    fn new(worker_id: u64, event_id: u64, data: &'a EventData) -> Self {
        let event = KvCacheEvent { event_id, data, dp_rank: 0 };
        Self { worker_id, storage_tier: "device", residency_domain: "worker", event }
    }
}

/// A kv_metrics message: the four frames around the worker's load.
pub fn encode(publisher_id: u64, sequence: u64, worker_id: u64, kv_used_blocks: u64) -> Message {
    let load =
        ActiveLoad { worker_id, dp_rank: 0, active_decode_blocks: None, active_prefill_tokens: None, kv_used_blocks };
    // Integers and options into a Vec: serializing cannot fail.
    let payload = rmp_serde::to_vec_named(&load).unwrap_or_default();
    wire::message(KV_METRICS_TOPIC, publisher_id, sequence, &payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::decode::decode_kv_metrics;

    /// The frames 1.6.1's mocker publishes, byte for byte, `published_at` (a clock reading)
    /// aside: the first kv_metrics message of the prefill worker in
    /// fixtures/dynamo-1.6.1/disagg/zmq-messages.jsonl.
    #[test]
    fn kv_metrics_frames_are_the_real_mockers_byte_for_byte() {
        const CAPTURED: [&str; 4] = [
            "6b765f6d657472696373",
            "0008a4ab3feb5855",
            "0000000000000000",
            "01000000ac85ac7075626c69736865725f6964cf0008a4ab3feb5855a873657175656e636500ac7075626c69736865645f6174\
             cf000001a2288408aca5746f706963aa6b765f6d657472696373a77061796c6f6164c45a85a9776f726b65725f6964cf6a6c\
             a228814c9742a764705f72616e6b00b46163746976655f6465636f64655f626c6f636b73c0b56163746976655f7072656669\
             6c6c5f746f6b656e73c0ae6b765f757365645f626c6f636b7300",
        ];
        let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let mut frames: Vec<Vec<u8>> =
            encode(0x8_a4ab_3feb_5855, 0, 7_668_682_560_356_783_938, 0).iter().cloned().collect();
        let marker = b"published_at\xcf";
        let at = frames[3].windows(marker.len()).position(|w| w == marker).map(|i| i + marker.len());
        let at = at.unwrap_or_else(|| panic!("no published_at in {}", hex(&frames[3])));
        frames[3][at..at + 8].copy_from_slice(&0x0000_01a2_2884_08ac_u64.to_be_bytes());
        let encoded: Vec<String> = frames.iter().map(|f| hex(f)).collect();
        assert_eq!(encoded, CAPTURED);
    }

    #[test]
    fn published_frames_decode_as_dynamo_kv_metrics() {
        let worker = SimulatedWorker::new(0x6a6c_a228_814c_9742, (0x5a00_0001, 0x5a00_0002), 1024);
        let mut rx = worker.kv_metrics().subscribe();
        assert_eq!(worker.add(5000), 1024);
        let message = rx.try_recv().unwrap_or_else(|e| panic!("{e}"));
        let sample =
            decode_kv_metrics(message.iter().map(Vec::as_slice), 0x5a00_0001).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((sample.worker_id, sample.dp_rank, sample.sequence), (0x6a6c_a228_814c_9742, 0, 0));
        assert_eq!(sample.load.kv_used_blocks, Some(1024), "capped at capacity");
        assert_eq!(sample.load.active_decode_blocks, None);
    }

    #[test]
    fn stored_and_evicted_blocks_go_out_as_kv_events_the_control_plane_decodes() {
        use crate::kv::decode::{KvEventData, decode_kv_events};
        use crate::sources::simulator::prefix_cache::blocks;

        let worker = SimulatedWorker::new(7, (2, 3), 4);
        let mut rx = worker.kv_events().subscribe();
        let mut next = || {
            let message = rx.try_recv().expect("a kv-events message");
            decode_kv_events(message.iter().map(Vec::as_slice), 3).expect("decodes")
        };
        let first = blocks(&(0..12).collect::<Vec<u32>>(), 4);
        assert_eq!(worker.store_prompt(&first), 0);
        let batch = next();
        assert_eq!((batch.publisher_id, batch.sequence, batch.events.len()), (3, 0, 1));
        let event = &batch.events[0];
        assert_eq!((event.worker_id, event.dp_rank, event.event_id), (7, 0, 1));
        let KvEventData::Stored(stored) = &event.data else { panic!("{:?}", event.data) };
        assert_eq!(stored.parent_hash, None);
        let hashes: Vec<(u64, u64)> = stored.blocks.iter().map(|b| (b.block_hash, b.tokens_hash)).collect();
        assert_eq!(hashes, first.iter().map(|b| (b.sequence, b.tokens)).collect::<Vec<_>>());

        // Past the capacity of 4 the least recently used go, a chain's tail first: another
        // prompt's two blocks evict the first prompt's third, and a prompt extending the first
        // two then evicts the other's.
        let other = blocks(&(100..108).collect::<Vec<u32>>(), 4);
        assert_eq!(worker.store_prompt(&other), 0);
        let KvEventData::Removed(removed) = &next().events[0].data else { panic!("an eviction") };
        assert_eq!(removed, &[first[2].sequence]);
        let longer = blocks(&(0..16).collect::<Vec<u32>>(), 4);
        assert_eq!(worker.store_prompt(&longer), 2, "its first two blocks were still held");
        let batch = next();
        assert_eq!(batch.sequence, 2);
        let ids: Vec<u64> = batch.events.iter().map(|e| e.event_id).collect();
        assert_eq!(ids, [4, 5], "removed, then stored, numbered on");
        let KvEventData::Removed(removed) = &batch.events[0].data else { panic!() };
        assert_eq!(removed, &[other[1].sequence, other[0].sequence]);
        let KvEventData::Stored(stored) = &batch.events[1].data else { panic!() };
        assert_eq!(stored.parent_hash, Some(longer[1].sequence));
        assert_eq!(stored.blocks.len(), 2);

        // A subscriber that joins or falls behind: the cache starts over, and says so.
        assert_eq!(worker.held(&longer), 4);
        worker.clear_kv();
        let batch = next();
        assert_eq!((batch.sequence, batch.events[0].event_id), (3, 6));
        assert!(matches!(batch.events[0].data, KvEventData::Cleared), "{:?}", batch.events[0].data);
        assert_eq!(worker.held(&longer), 0);
    }

    #[test]
    fn a_request_past_the_capacity_gives_back_only_what_it_took() {
        let worker = SimulatedWorker::new(1, (2, 3), 16);
        assert_eq!(worker.add(10), 10);
        assert_eq!(worker.add(10), 6, "the capacity left");
        worker.release(6);
        assert_eq!(worker.kv_used_blocks(), 10, "the first request still holds its blocks");
    }

    /// As a 1.6.1 mocker: nothing while idle, the first message (sequence 0) with the first
    /// request, then one per change.
    #[test]
    fn the_first_request_publishes_the_load_then_only_changes_do() {
        let worker = SimulatedWorker::new(1, (2, 3), 16);
        let mut rx = worker.kv_metrics().subscribe();
        let sequence = |rx: &mut broadcast::Receiver<Message>| rx.try_recv().map(|m| m[2].clone()).ok();
        worker.release(3);
        assert_eq!(sequence(&mut rx), None, "idle: nothing");
        worker.touch();
        assert_eq!(sequence(&mut rx), Some(0u64.to_be_bytes().to_vec()), "the first request");
        worker.touch();
        assert_eq!(sequence(&mut rx), None, "only the first");
        assert_eq!(worker.add(4), 4);
        worker.release(4);
        assert_eq!(sequence(&mut rx), Some(1u64.to_be_bytes().to_vec()));
        assert_eq!(sequence(&mut rx), Some(2u64.to_be_bytes().to_vec()));
        assert_eq!(worker.kv_used_blocks(), 0);
    }
}
