//! Dynamo worker discovery from etcd: the pure part.
//!
//! [`Reducer`] folds the events of a read-only etcd watch (range gets as
//! [`WatchEvent::Resync`], then puts and deletes) into a [`Fleet`] of workers and event
//! publishers. It does no I/O; the etcd shell that feeds it owns connections and backoff.
//!
//! * [`keys`]: which keyspace and watched namespace a key belongs to.
//! * [`records`] and [`card`]: etcd values as typed records, tolerant across Dynamo's N-2 window.
//! * `store`: records held by key, indexed by the identity each claims.
//! * `join`: the rules that turn held records into workers and publishers.
//! * `duplicates`: reporting identities claimed by several keys (all of which are refused).
//! * [`Reducer`]: the fold, with the memory bounds [`MAX_RECORD_BYTES`],
//!   [`MAX_RETAINED_CARD_BYTES`], [`MAX_RETAINED_CARDS_BYTES`], [`MAX_RECORDS_PER_KEYSPACE`],
//!   [`MAX_RECORDS_PER_LEASE`] and [`MAX_SET_ASIDE_PER_KEYSPACE`].

mod applied;
pub mod card;
mod duplicates;
mod entries;
mod fleet;
mod join;
pub mod keys;
pub mod records;
mod reducer;
mod store;
mod wire_id;

#[cfg(test)]
mod tests;

pub use applied::{Applied, EventKind};
pub use card::{MAX_RETAINED_CARD_BYTES, MAX_RETAINED_CARDS_BYTES};
pub use entries::{Change, Entries};
pub use fleet::{
    DiscoveredWorker, Exclusion, Fleet, MAX_DATA_PARALLEL_SIZE, MAX_NAME_BYTES, MAX_PATH_BYTES, Publisher,
    PublisherKey, Topic,
};
pub use join::{component_role, resolve_role};
pub use reducer::{KeyValue, Listing, MAX_RECORD_BYTES, MAX_SMALL_RECORD_BYTES, Reducer, WatchEvent, max_record_bytes};
pub use store::{MAX_RECORDS_PER_KEYSPACE, MAX_RECORDS_PER_LEASE, MAX_SET_ASIDE_PER_KEYSPACE};
pub use wire_id::parse_hex;

/// A discovered worker `id` of `namespace` with `role`, serving `model`, for tests.
#[cfg(test)]
pub(crate) fn test_worker(
    namespace: &str,
    id: u64,
    role: continuum_proto::model::Role,
    model: &str,
) -> (continuum_proto::model::WorkerKey, DiscoveredWorker) {
    let key = continuum_proto::model::WorkerKey::new(namespace, id);
    let worker = continuum_proto::model::Worker {
        key: key.clone(),
        role,
        model: model.into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: continuum_proto::model::Capacity::default(),
        dp_start_rank: 0,
        dp_size: 0,
        disaggregated_endpoint: None,
        artifacts: None,
    };
    let now = std::time::SystemTime::now();
    (key, DiscoveredWorker { worker, first_seen: now, last_updated: now, card: None, excluded: None })
}

/// A direct kv_metrics publisher `id` in namespace `dynamo`, speaking for `worker`, for tests.
#[cfg(test)]
pub(crate) fn test_publisher(id: u64, worker: Option<continuum_proto::model::WorkerKey>) -> Publisher {
    Publisher {
        publisher_id: id,
        namespace: "dynamo".into(),
        component: None,
        endpoint: None,
        topic: Topic::KvMetrics,
        worker,
        dp_rank: None,
        address: "tcp://127.0.0.1:1".into(),
    }
}
