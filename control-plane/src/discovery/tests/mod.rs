//! Reducer tests: the real Dynamo 1.6.1 captures, then crafted records for each rule and bound.
//! Everything runs without etcd: the reducer is a pure fold of its events.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use continuum_proto::model::{Role, WorkerKey};
use serde_json::{Value, json};

use super::{Applied, DiscoveredWorker, EventKind, Fleet, KeyValue, Publisher, Reducer, WatchEvent};

mod bounds_tests;
mod channels_tests;
mod duplicates_tests;
mod fixture_tests;
mod fixtures;
mod namespaces_tests;
mod rules_tests;

const NS: &str = "dynamo";

/// A test clock: `t(n)` is `n` seconds after the epoch.
fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn instance_key(ns: &str, component: &str, endpoint: &str, id: u64) -> String {
    format!("v1/instances/{ns}/{component}/{endpoint}/{id:x}")
}

fn card_key(ns: &str, component: &str, id: u64) -> String {
    format!("v1/mdc/{ns}/{component}/generate/{id:x}")
}

fn channel_key(ns: &str, component: &str, topic: &str, publisher: u64) -> String {
    let ns = super::keys::encode_segment(ns);
    format!("v1/event_channels/namespace/{ns}/component/{component}/endpoint/generate/topic/{topic}/{publisher:x}")
}

fn source_key(ns: &str, component: &str, topic: &str, publisher: u64) -> String {
    channel_key(ns, component, topic, publisher).replacen("v1/event_channels/", "v1/event_sources/", 1)
}

fn endpoint_value(component: &str, endpoint: &str, id: Value) -> Value {
    json!({
        "type": "Endpoint", "namespace": NS, "component": component, "endpoint": endpoint, "instance_id": id,
        "transport": {"tcp": "127.0.0.1:1/x"}, "device_type": "cuda", "request_plane_codec": "msgpack"
    })
}

fn card_value(component: &str, id: Value, card: Value) -> Value {
    json!({
        "type": "Model", "namespace": NS, "component": component, "endpoint": "generate",
        "instance_id": id, "card_json": card
    })
}

/// A card as the 1.6.1 mocker writes it, trimmed to the fields the router reads.
fn card_json(worker_type: &str) -> Value {
    json!({
        "display_name": "tiny", "worker_type": worker_type, "kv_cache_block_size": 16,
        "runtime_config": {"total_kv_blocks": 1024, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                           "context_length": 0, "data_parallel_start_rank": 0, "data_parallel_size": 1}
    })
}

fn channel_value(topic: &str, publisher: u64, transport: Value) -> Value {
    json!({
        "type": "EventChannel",
        "scope": {"kind": "endpoint", "endpoint": {"namespace": NS, "component": "backend", "name": "generate"}},
        "topic": topic, "instance_id": publisher, "transport": transport
    })
}

fn zmq(endpoint: &str) -> Value {
    json!({"kind": "Zmq", "config": {"endpoint": endpoint}})
}

fn source_value(publisher: u64, worker: u64, dp_rank: u32) -> Value {
    json!({"type": "EventSource", "topic": "kv-events", "publisher_id": publisher,
           "metadata": {"worker": {"worker_id": worker, "dp_rank": dp_rank}, "publisher_id": publisher}})
}

fn kv(key: impl Into<String>, value: &Value) -> KeyValue {
    KeyValue::new(key.into(), value.to_string())
}

/// A reducer and a clock that ticks one second per event.
struct Sim {
    reducer: Reducer,
    clock: u64,
}

impl Sim {
    fn new() -> Self {
        Self::watching(&[NS])
    }

    fn watching(namespaces: &[&str]) -> Self {
        Self { reducer: Reducer::new(namespaces.iter().map(|n| (*n).to_owned()).collect()), clock: 0 }
    }

    fn apply(&mut self, event: WatchEvent) -> Applied {
        self.clock += 1;
        self.reducer.apply(event, t(self.clock))
    }

    fn put(&mut self, key: impl Into<String>, value: &Value) -> Applied {
        self.apply(WatchEvent::Put(kv(key, value)))
    }

    fn put_raw(&mut self, key: impl Into<String>, value: impl Into<Vec<u8>>) -> Applied {
        self.apply(WatchEvent::Put(KeyValue::new(key.into(), value)))
    }

    fn delete(&mut self, key: impl Into<String>) -> Applied {
        self.apply(WatchEvent::Delete { key: key.into().into_bytes() })
    }

    fn fleet(&self) -> Fleet {
        self.reducer.fleet()
    }

    fn worker(&self, id: u64) -> Option<DiscoveredWorker> {
        self.worker_in(NS, id)
    }

    fn worker_in(&self, ns: &str, id: u64) -> Option<DiscoveredWorker> {
        self.fleet().worker(&WorkerKey::new(ns, id)).cloned()
    }

    fn publisher(&self, id: u64) -> Option<Publisher> {
        self.fleet().publishers.into_iter().find(|p| p.publisher_id == id)
    }

    fn worker_ids(&self) -> Vec<u64> {
        self.fleet().workers.iter().map(|w| w.worker.key.instance_id).collect()
    }

    /// Registers a worker as 1.6.1 does: card first, then its generate instance.
    fn register(&mut self, component: &str, id: u64, worker_type: &str) {
        self.put(card_key(NS, component, id), &card_value(component, json!(id), card_json(worker_type)));
        self.put(instance_key(NS, component, "generate", id), &endpoint_value(component, "generate", json!(id)));
    }
}

/// The counts an event produced, as `(kind, count)` pairs, for compact assertions.
fn counts(applied: &Applied) -> Vec<(EventKind, u64)> {
    applied.iter().collect()
}

fn role_of(worker: &DiscoveredWorker) -> Role {
    worker.worker.role
}
