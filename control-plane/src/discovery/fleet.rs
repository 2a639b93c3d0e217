//! What discovery publishes: the workers and the load and KV-event publishers, as folded from
//! etcd so far. Everything here is a value; the reducer builds a fresh [`Fleet`] on request.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use continuum_proto::model::{Role, Worker, WorkerKey};

use super::entries::Entries;

/// The discovered fleet, both maps ordered by identity. Persistent: cloning it is `O(1)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fleet {
    pub workers: Entries<WorkerKey, DiscoveredWorker>,
    pub publishers: Entries<PublisherKey, Publisher>,
}

impl Fleet {
    pub fn worker(&self, key: &WorkerKey) -> Option<&DiscoveredWorker> {
        self.workers.get(key)
    }

    /// Workers a picker may route to: not excluded and with a known role.
    pub fn routable(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().filter(|w| w.excluded.is_none() && w.worker.role != Role::Unknown).map(|w| &w.worker)
    }
}

/// A worker and what discovery knows about it.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscoveredWorker {
    pub worker: Worker,
    /// When this identity first materialised; survives resyncs while the identity persists.
    pub first_seen: SystemTime,
    /// The latest put of the worker's instance or card record.
    pub last_updated: SystemTime,
    /// The model card verbatim, when it had one no larger than the retention bound.
    pub card: Option<Arc<str>>,
    /// Why the worker is visible but never routed to.
    pub excluded: Option<Exclusion>,
}

/// Why a discovered worker is excluded from routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Exclusion {
    /// The component name and the card's `worker_type` claim different roles.
    RoleDisagreement { component: Role, card: Role },
    /// The card declares more data-parallel ranks than [`MAX_DATA_PARALLEL_SIZE`].
    TooManyRanks { declared: u32 },
    /// The card's ranks would run past the last rank number (`u32::MAX`).
    RanksOutOfRange { start: u32, size: u32 },
    /// A name or path in the records is longer than any real one ([`MAX_NAME_BYTES`],
    /// [`MAX_PATH_BYTES`]).
    OversizedField { field: &'static str, bytes: usize },
}

pub use continuum_proto::MAX_DATA_PARALLEL_SIZE;
/// A model, component or endpoint name, or a disaggregated endpoint, longer than this is not
/// believed: every worker's names travel in every snapshot to every replica.
pub const MAX_NAME_BYTES: usize = 512;
/// An artifact's path or checksum longer than this is not believed.
pub const MAX_PATH_BYTES: usize = 4096;

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exclusion::RoleDisagreement { component, card } => {
                write!(f, "component claims {} but the card claims {}", component.as_str(), card.as_str())
            }
            Exclusion::TooManyRanks { declared } => {
                write!(f, "the card declares {declared} data-parallel ranks, more than {MAX_DATA_PARALLEL_SIZE}")
            }
            Exclusion::RanksOutOfRange { start, size } => {
                write!(f, "the card's {size} data-parallel ranks from {start} run past the last rank number")
            }
            Exclusion::OversizedField { field, bytes } => write!(f, "its {field} is {bytes} bytes long"),
        }
    }
}

/// The event-plane topics the router subscribes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Topic {
    /// `kv_metrics`: ActiveLoad samples, one channel per worker for all its ranks.
    KvMetrics,
    /// `kv-events`: block stored/removed events, one channel per dp rank.
    KvEvents,
}

impl Topic {
    pub fn parse(topic: &str) -> Option<Self> {
        match topic {
            "kv_metrics" => Some(Topic::KvMetrics),
            "kv-events" => Some(Topic::KvEvents),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Topic::KvMetrics => "kv_metrics",
            Topic::KvEvents => "kv-events",
        }
    }
}

/// A direct-ZMQ publisher to subscribe to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publisher {
    /// The publisher incarnation's id (the channel's `instance_id`), not a worker id.
    pub publisher_id: u64,
    pub namespace: Arc<str>,
    /// Absent for namespace-scoped channels.
    pub component: Option<String>,
    /// Absent for namespace- and component-scoped channels.
    pub endpoint: Option<String>,
    pub topic: Topic,
    /// The worker it speaks for: the key's etcd lease, else the event source's `worker_id`.
    pub worker: Option<WorkerKey>,
    /// The rank a `kv-events` publisher serves, from its event source.
    pub dp_rank: Option<u32>,
    /// `tcp://host:port`. Internal: never exported in metrics or admin responses.
    pub address: String,
}

/// A publisher's identity: publisher ids are unique per namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PublisherKey {
    pub namespace: Arc<str>,
    pub publisher_id: u64,
}

impl Publisher {
    pub fn key(&self) -> PublisherKey {
        PublisherKey { namespace: self.namespace.clone(), publisher_id: self.publisher_id }
    }
}

impl fmt::Display for PublisherKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{:x}", self.namespace, self.publisher_id)
    }
}
