//! The records held by etcd key, one map per keyspace, and the index from each identity read
//! from a value to the keys that claim it. Two keys claiming one identity is a conflict the
//! reducer refuses; the index is what makes that visible.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use continuum_proto::MAX_DATA_PARALLEL_SIZE;
use continuum_proto::model::WorkerKey;

use super::card::MAX_RETAINED_CARDS_BYTES;
use super::fleet::PublisherKey;
use super::keys::Keyspace;
use super::records::Parsed;

/// The most distinct keys held per keyspace (instances, cards, channels and sources each).
/// At the bound, held keys still update so live workers keep heartbeating; new keys are refused.
pub const MAX_RECORDS_PER_KEYSPACE: usize = 16_384;
/// The most records keys on one etcd lease (one worker process) hold per keyspace. A Dynamo
/// 1.6.1 process writes a handful (an instance per endpoint, a card per model), and a channel
/// and an event source per topic and dp rank: as many as a worker of the most ranks routed
/// ([`MAX_DATA_PARALLEL_SIZE`]) writes, and a margin. One writing keys by the thousand under
/// its lease (a bug, or a hostile writer) would otherwise fill the keyspace, and every worker
/// registering after it, in any namespace, would be refused until its lease expired. Keys with
/// no lease (static registrations, tools) are bounded by the keyspace alone.
pub const MAX_RECORDS_PER_LEASE: usize = MAX_DATA_PARALLEL_SIZE as usize + 64;
// A worker of the most ranks routed holds its channel a rank and its kv_metrics channel.
const _: () = assert!(MAX_RECORDS_PER_LEASE > MAX_DATA_PARALLEL_SIZE as usize + 1);
/// Keys a keyspace holds only so that their refusal is logged once (a value that is malformed,
/// or of a kind the router cannot use), at most. They take none of the keyspace's room for
/// records, so junk cannot refuse a real worker; past this many, a new one is counted but not
/// held.
pub const MAX_SET_ASIDE_PER_KEYSPACE: usize = 1_024;

pub(super) type EtcdKey = Arc<str>;

/// One held etcd value.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Entry {
    pub namespace: Arc<str>,
    pub parsed: Parsed,
    pub updated: SystemTime,
    /// The etcd lease the key hangs on (`None`: none).
    pub lease: Option<u64>,
}

/// Which base card a Model record is: scoped to a component and endpoint, or legacy (both
/// empty), which joins on the instance id alone.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum CardScope {
    Scoped { component: String, endpoint: String },
    Legacy,
}

/// The identity a record claims; upstream derives exactly one key from each.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Identity {
    Instance(WorkerKey),
    Card(WorkerKey, CardScope),
    Channel(PublisherKey),
    Source(PublisherKey),
}

impl Identity {
    pub fn keyspace(&self) -> Keyspace {
        match self {
            Identity::Instance(_) => Keyspace::Instances,
            Identity::Card(..) => Keyspace::Models,
            Identity::Channel(_) => Keyspace::EventChannels,
            Identity::Source(_) => Keyspace::EventSources,
        }
    }

    pub fn worker(&self) -> Option<&WorkerKey> {
        match self {
            Identity::Instance(worker) | Identity::Card(worker, _) => Some(worker),
            Identity::Channel(_) | Identity::Source(_) => None,
        }
    }

    pub fn publisher(&self) -> Option<&PublisherKey> {
        match self {
            Identity::Channel(publisher) | Identity::Source(publisher) => Some(publisher),
            Identity::Instance(_) | Identity::Card(..) => None,
        }
    }

    pub fn record_kind(&self) -> &'static str {
        match self {
            Identity::Instance(_) => "generate instance",
            Identity::Card(..) => "base model card",
            Identity::Channel(_) => "event channel publisher",
            Identity::Source(_) => "event source publisher",
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Instance(worker) => write!(f, "{worker}"),
            Identity::Card(worker, CardScope::Legacy) => write!(f, "{worker} (legacy)"),
            Identity::Card(worker, CardScope::Scoped { component, endpoint }) => {
                write!(f, "{worker} ({component}/{endpoint})")
            }
            Identity::Channel(publisher) | Identity::Source(publisher) => write!(f, "{publisher}"),
        }
    }
}

impl Entry {
    /// The bytes of opaque card this entry holds.
    fn retained_card_bytes(&self) -> usize {
        retained_card_bytes(&self.parsed)
    }

    /// Held only to log its refusal once: no record the router reads.
    pub fn set_aside(&self) -> bool {
        matches!(self.parsed, Parsed::Unsupported(_) | Parsed::Malformed(_))
    }

    /// The identity this entry claims; set-aside values claim none.
    pub fn identity(&self) -> Option<Identity> {
        let worker = |id| WorkerKey::new(self.namespace.clone(), id);
        let publisher = |publisher_id| PublisherKey { namespace: self.namespace.clone(), publisher_id };
        match &self.parsed {
            Parsed::Endpoint(record) => Some(Identity::Instance(worker(record.instance_id))),
            Parsed::Model(record) => {
                let scope = if record.component.is_empty() && record.endpoint.is_empty() {
                    CardScope::Legacy
                } else {
                    CardScope::Scoped { component: record.component.clone(), endpoint: record.endpoint.clone() }
                };
                Some(Identity::Card(worker(record.instance_id), scope))
            }
            Parsed::Channel(record) => Some(Identity::Channel(publisher(record.publisher_id))),
            Parsed::Source(record) => Some(Identity::Source(publisher(record.publisher_id))),
            Parsed::Skipped(_) | Parsed::Unsupported(_) | Parsed::Malformed(_) => None,
        }
    }
}

/// Who claims an identity.
#[derive(Debug)]
pub(super) enum Claim<'a> {
    Unclaimed,
    Unique(&'a Entry),
    /// Two or more keys: all of them are refused.
    Contested,
}

fn retained_card_bytes(parsed: &Parsed) -> usize {
    match parsed {
        Parsed::Model(record) => record.card.raw.as_ref().map_or(0, |raw| raw.len()),
        _ => 0,
    }
}

/// Held entries and the identity index.
#[derive(Clone, Debug)]
pub(super) struct Store {
    keyspaces: [BTreeMap<EtcdKey, Entry>; 4],
    claims: BTreeMap<Identity, BTreeSet<EtcdKey>>,
    /// Per keyspace, how many of its entries are set aside ([`Entry::set_aside`]).
    set_aside: [usize; 4],
    /// Per keyspace and lease, the records (not set aside) its keys hold.
    per_lease: BTreeMap<(usize, u64), usize>,
    /// Bytes of opaque cards held, and the most there may be.
    card_bytes: usize,
    card_budget: usize,
}

impl Default for Store {
    fn default() -> Self {
        Self::with_card_budget(MAX_RETAINED_CARDS_BYTES)
    }
}

impl Store {
    pub fn with_card_budget(card_budget: usize) -> Self {
        Self {
            keyspaces: Default::default(),
            claims: BTreeMap::new(),
            set_aside: [0; 4],
            per_lease: BTreeMap::new(),
            card_bytes: 0,
            card_budget,
        }
    }

    /// An empty store with this one's budgets.
    pub fn emptied(&self) -> Self {
        Self::with_card_budget(self.card_budget)
    }

    /// Drops the opaque card of `parsed` (a model record) when holding it would take the
    /// cards held past their budget; how many bytes it had, if so. The caller removes what the
    /// key held first, so a card replacing itself fits where it fitted.
    pub fn fit_card(&self, parsed: &mut Parsed) -> Option<usize> {
        // Counted by the insert, not here.
        self.fit_listed_card(parsed, &mut self.card_bytes.clone())
    }

    /// Drops the opaque card of `parsed` when holding it would take `used` (the card bytes of
    /// a listing, or of the store) past the cards' budget, returning how many bytes it had;
    /// otherwise counts it in `used`.
    pub fn fit_listed_card(&self, parsed: &mut Parsed, used: &mut usize) -> Option<usize> {
        let bytes = retained_card_bytes(parsed);
        let Parsed::Model(record) = parsed else { return None };
        if used.saturating_add(bytes) <= self.card_budget {
            *used += bytes;
            return None;
        }
        record.card.raw = None;
        Some(bytes)
    }

    /// Whether `keyspace` holds [`MAX_RECORDS_PER_KEYSPACE`] records, so a new key must be
    /// refused (keys set aside are not counted).
    pub fn is_full(&self, keyspace: Keyspace) -> bool {
        self.map(keyspace).len() - self.set_aside[keyspace.index()] >= MAX_RECORDS_PER_KEYSPACE
    }

    /// Whether keys on `lease` hold [`MAX_RECORDS_PER_LEASE`] records in `keyspace`, so a new
    /// one must be refused (never for keys with no lease).
    pub fn lease_is_full(&self, keyspace: Keyspace, lease: Option<u64>) -> bool {
        lease.is_some_and(|lease| {
            self.per_lease.get(&(keyspace.index(), lease)).is_some_and(|held| *held >= MAX_RECORDS_PER_LEASE)
        })
    }

    /// Whether `keyspace` sets aside [`MAX_SET_ASIDE_PER_KEYSPACE`] keys, so a new refused
    /// value is not held.
    pub fn set_aside_full(&self, keyspace: Keyspace) -> bool {
        self.set_aside[keyspace.index()] >= MAX_SET_ASIDE_PER_KEYSPACE
    }

    /// Whether any keyspace holds `key`, as etcd spells it.
    pub fn holds(&self, key: &[u8]) -> bool {
        let Ok(key) = std::str::from_utf8(key) else { return false };
        self.keyspaces.iter().any(|map| map.contains_key(key))
    }

    /// Holds `entry` at `key`, which the caller has removed first.
    pub fn insert(&mut self, keyspace: Keyspace, key: EtcdKey, entry: Entry) {
        if let Some(identity) = entry.identity() {
            self.claims.entry(identity).or_default().insert(key.clone());
        }
        self.set_aside[keyspace.index()] += usize::from(entry.set_aside());
        if let Some(lease) = entry.lease.filter(|_| !entry.set_aside()) {
            *self.per_lease.entry((keyspace.index(), lease)).or_default() += 1;
        }
        self.card_bytes += entry.retained_card_bytes();
        self.keyspaces[keyspace.index()].insert(key, entry);
    }

    pub fn remove(&mut self, keyspace: Keyspace, key: &str) -> Option<Entry> {
        let entry = self.keyspaces[keyspace.index()].remove(key)?;
        let set_aside = &mut self.set_aside[keyspace.index()];
        *set_aside = set_aside.saturating_sub(usize::from(entry.set_aside()));
        if let Some(lease) = entry.lease.filter(|_| !entry.set_aside())
            && let Some(held) = self.per_lease.get_mut(&(keyspace.index(), lease))
        {
            *held = held.saturating_sub(1);
            if *held == 0 {
                self.per_lease.remove(&(keyspace.index(), lease));
            }
        }
        self.card_bytes = self.card_bytes.saturating_sub(entry.retained_card_bytes());
        if let Some(identity) = entry.identity()
            && let Some(keys) = self.claims.get_mut(&identity)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.claims.remove(&identity);
            }
        }
        Some(entry)
    }

    pub fn claimants(&self, identity: &Identity) -> Option<&BTreeSet<EtcdKey>> {
        self.claims.get(identity)
    }

    pub fn claim(&self, identity: &Identity) -> Claim<'_> {
        let Some(keys) = self.claims.get(identity) else {
            return Claim::Unclaimed;
        };
        match (keys.len(), keys.first()) {
            (1, Some(key)) => self.map(identity.keyspace()).get(key).map_or(Claim::Unclaimed, Claim::Unique),
            _ => Claim::Contested,
        }
    }

    /// Every identity claimed by at least one held entry.
    pub fn identities(&self) -> impl Iterator<Item = &Identity> {
        self.claims.keys()
    }

    fn map(&self, keyspace: Keyspace) -> &BTreeMap<EtcdKey, Entry> {
        &self.keyspaces[keyspace.index()]
    }
}
