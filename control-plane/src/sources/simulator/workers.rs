//! The simulated workers' load: each holds its `kv_used_blocks` and publishes a kv_metrics
//! message in Dynamo 1.6.1's exact wire format (see `crate::load::decode` for the layout) as a
//! 1.6.1 mocker does: its first (sequence 0) with its first request, then one whenever the
//! load changes, none while idle, and none replayed to a subscriber that joins late (a ZMQ
//! PUB socket keeps nothing).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Serialize, Serializer};
use tokio::sync::broadcast;

use crate::load::decode::{FRAME_VERSION, KV_METRICS_TOPIC};

/// Messages a slow subscriber may fall behind by; older ones are skipped (latest load wins).
pub const PUBLISH_BACKLOG: usize = 64;

/// One encoded kv_metrics message: its four frames.
pub type Message = Arc<[Vec<u8>; 4]>;

#[derive(Debug)]
struct Published {
    kv_used_blocks: u64,
    /// The next message's sequence number; 0 until the first is published.
    sequence: u64,
}

/// A simulated worker rank 0 and its kv_metrics publisher.
#[derive(Debug)]
pub struct SimulatedWorker {
    pub worker_id: u64,
    pub publisher_id: u64,
    pub total_kv_blocks: u64,
    state: Mutex<Published>,
    messages: broadcast::Sender<Message>,
}

impl SimulatedWorker {
    pub fn new(worker_id: u64, publisher_id: u64, total_kv_blocks: u64) -> Self {
        let (messages, _) = broadcast::channel(PUBLISH_BACKLOG);
        Self {
            worker_id,
            publisher_id,
            total_kv_blocks,
            state: Mutex::new(Published { kv_used_blocks: 0, sequence: 0 }),
            messages,
        }
    }

    /// Every message published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Message> {
        self.messages.subscribe()
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
        let _ = self.messages.send(message);
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

struct Bin<'a>(&'a [u8]);

impl Serialize for Bin<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    topic: &'a str,
    payload: Bin<'a>,
}

/// The four frames of one message: topic, publisher id, sequence, and the versioned envelope.
pub fn encode(publisher_id: u64, sequence: u64, worker_id: u64, kv_used_blocks: u64) -> Message {
    let load =
        ActiveLoad { worker_id, dp_rank: 0, active_decode_blocks: None, active_prefill_tokens: None, kv_used_blocks };
    // Serializing plain integers, options and a byte string into a Vec cannot fail.
    let payload = rmp_serde::to_vec_named(&load).unwrap_or_default();
    let published_at =
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
    let envelope = Envelope { publisher_id, sequence, published_at, topic: KV_METRICS_TOPIC, payload: Bin(&payload) };
    let envelope = rmp_serde::to_vec_named(&envelope).unwrap_or_default();
    let mut frame = Vec::with_capacity(5 + envelope.len());
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&u32::try_from(envelope.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend(envelope);
    Arc::new([
        KV_METRICS_TOPIC.as_bytes().to_vec(),
        publisher_id.to_be_bytes().to_vec(),
        sequence.to_be_bytes().to_vec(),
        frame,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::decode::decode_kv_metrics;

    #[test]
    fn published_frames_decode_as_dynamo_kv_metrics() {
        let worker = SimulatedWorker::new(0x6a6c_a228_814c_9742, 0x5a00_0001, 1024);
        let mut rx = worker.subscribe();
        assert_eq!(worker.add(5000), 1024);
        let message = rx.try_recv().unwrap_or_else(|e| panic!("{e}"));
        let sample =
            decode_kv_metrics(message.iter().map(Vec::as_slice), 0x5a00_0001).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((sample.worker_id, sample.dp_rank, sample.sequence), (0x6a6c_a228_814c_9742, 0, 0));
        assert_eq!(sample.load.kv_used_blocks, Some(1024), "capped at capacity");
        assert_eq!(sample.load.active_decode_blocks, None);
    }

    #[test]
    fn a_request_past_the_capacity_gives_back_only_what_it_took() {
        let worker = SimulatedWorker::new(1, 2, 16);
        assert_eq!(worker.add(10), 10);
        assert_eq!(worker.add(10), 6, "the capacity left");
        worker.release(6);
        assert_eq!(worker.kv_used_blocks(), 10, "the first request still holds its blocks");
    }

    /// As a 1.6.1 mocker: nothing while idle, the first message (sequence 0) with the first
    /// request, then one per change.
    #[test]
    fn the_first_request_publishes_the_load_then_only_changes_do() {
        let worker = SimulatedWorker::new(1, 2, 16);
        let mut rx = worker.subscribe();
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
