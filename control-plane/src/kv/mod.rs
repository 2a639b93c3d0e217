//! KV cache events: which prompt-prefix blocks each worker rank holds in device memory, from the
//! block stored/removed events its `kv-events` publisher sends.
//!
//! * [`decode`]: Dynamo's 4-frame message and its batch of RouterEvents.
//! * [`indexer`]: the radix index (`continuum-kv-index`) behind the identity gate, per-rank
//!   event-id cursors, the device-tier filter and the staleness cut-off.
//! * [`result`]: what each event did, under a closed label set.
//!
//! * [`feed`]: the subscription feed (ZMTP sessions under `ZmtpLimits::KV_EVENTS`, shared with
//!   kv_metrics) that applies each message to the shared index.
//! * [`provisional`]: prefixes credited to the rank a request was pinned to, until its
//!   kv-events confirm them or `dynamo.kv.provisional_ttl` passes.
//! * [`recent_lookups`]: the ranks the last few milliseconds' lookups went to, from which
//!   `FindMatches` suggests a rank to picks made at once through different replicas.
//! * [`service`]: subscriptions on and off with `dynamo.kv.enabled`, the staleness sweep, and
//!   the handle `FindMatches` reads.

pub mod decode;
pub mod feed;
pub mod indexer;
pub mod provisional;
pub mod recent_lookups;
pub mod result;
pub mod service;

pub use indexer::{
    KV_EVENTS_STALE_AFTER, KvIndexer, LiveRanks, LiveWorker, MAX_CURSORS_PER_PUBLISHER, PublisherMapping,
};
pub use provisional::{Folded, ProvisionalCounts, ProvisionalIndex, ProvisionalResult};
pub use recent_lookups::{LookupKey, RecentLookups, Suggestion};
pub use result::{KvCounts, KvEventResult};
pub use service::{KvHandle, KvSupervisor, KvView, kv_options};

#[cfg(test)]
pub(crate) mod fixtures;
