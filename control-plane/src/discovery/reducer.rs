//! The discovery reducer: a pure fold of etcd watch events into the discovered fleet.
//!
//! It holds records by etcd key and joins them by identity read from the value (see
//! [`super::join`]). It never talks to etcd: the effectful shell range-gets, watches, and feeds
//! every event here, including a [`WatchEvent::Resync`] after each reconnect. One reducer lives
//! as long as its watcher, so `first_seen` survives reconnects.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use continuum_proto::model::WorkerKey;
use continuum_proto::warn_limited;

use super::applied::{Applied, EventKind};
use super::duplicates::Conflicts;
use super::fleet::{Fleet, PublisherKey};
use super::join;
use super::keys::{self, Keyspace, ParsedKey};
use super::records::{self, Parsed};
use super::store::{
    Entry, EtcdKey, Identity, MAX_RECORDS_PER_KEYSPACE, MAX_RECORDS_PER_LEASE, MAX_SET_ASIDE_PER_KEYSPACE, Store,
};

/// The largest etcd value parsed; larger values are refused unread. An order of magnitude
/// above etcd's default 1.5 MiB `--max-request-bytes`.
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;
/// The largest value parsed under the keyspaces other than model cards: their records are a
/// few hundred bytes (an id, names, an address), so a larger one is junk, and holding its text
/// as a malformed record would let 16,384 keys pin gigabytes.
pub const MAX_SMALL_RECORD_BYTES: usize = 64 * 1024;

/// The largest value parsed under `keyspace`.
pub fn max_record_bytes(keyspace: Keyspace) -> usize {
    if keyspace == Keyspace::Models { MAX_RECORD_BYTES } else { MAX_SMALL_RECORD_BYTES }
}

/// One etcd key-value pair as the watch or a range get delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The lease the key is attached to (etcd's lease 0 is `None`). For event channels it is
    /// the publishing worker's instance id.
    pub lease: Option<u64>,
}

impl KeyValue {
    pub fn new(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        Self { key: key.into(), value: value.into(), lease: None }
    }

    pub fn with_lease(self, lease: u64) -> Self {
        Self { lease: (lease != 0).then_some(lease), ..self }
    }
}

/// What the etcd shell observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(KeyValue),
    Delete {
        key: Vec<u8>,
    },
    /// The full state from fresh range gets: replaces everything held. Identities that persist
    /// keep `first_seen`, and records whose value is unchanged keep their `last_updated`.
    Resync(Vec<KeyValue>),
}

/// A relist's records as the shell reads them, page by page, held only as far as the resync
/// that ends the listing can use them ([`Reducer::list`]).
#[derive(Debug, Default)]
pub struct Listing {
    /// Keys the reducer holds: all of them, admitted first.
    held: Vec<Read>,
    /// Keys it does not hold, in the order listed, as far as each keyspace has room.
    new: Vec<Read>,
    /// Per keyspace, the new records and set-aside values in `new`.
    records: [usize; Keyspace::ALL.len()],
    set_aside: [usize; Keyspace::ALL.len()],
    /// Per keyspace and lease, the records of `held` and `new` on it.
    per_lease: BTreeMap<(usize, u64), usize>,
    /// What listing refused, counted as the resync's.
    applied: Applied,
    /// Per keyspace, the first new key left out for want of room.
    refused: [Option<EtcdKey>; Keyspace::ALL.len()],
    /// Keys under the watched prefixes that are no Dynamo discovery keys.
    strays: Strays,
    /// The opaque card text held, of the keys held and of the new ones: each within the
    /// cards' budget, so that a relist holds no more than twice it whatever etcd holds (the
    /// resync then fits them, the held first).
    card_bytes: [usize; 2],
    /// The first card listed without its text, to warn of at the resync.
    card_dropped: Option<(EtcdKey, usize)>,
}

impl Listing {
    /// Records kept so far.
    pub fn len(&self) -> usize {
        self.held.len() + self.new.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The opaque card text its reads hold.
    #[cfg(test)]
    pub(super) fn card_text_bytes(&self) -> usize {
        let card = |read: &Read| match &read.value {
            Reading::Parsed(Parsed::Model(record)) => record.card.raw.as_ref().map_or(0, |raw| raw.len()),
            _ => 0,
        };
        self.held.iter().chain(&self.new).map(card).sum()
    }
}

/// One key's value as a put reads it: placed, and parsed unless its size refused it.
#[derive(Debug)]
struct Read {
    key: ParsedKey,
    etcd_key: EtcdKey,
    value: Reading,
    lease: Option<u64>,
}

#[derive(Debug)]
enum Reading {
    Parsed(Parsed),
    /// Refused unread: this many bytes, past [`max_record_bytes`].
    Oversized(usize),
}

/// Counts (and logs) a value refused unread for its size.
fn refuse_oversized(key: &str, bytes: usize, keyspace: Keyspace, applied: &mut Applied) {
    let limit = max_record_bytes(keyspace);
    warn_limited!(key = ?shown(key), bytes, limit, "etcd value refused unread: too large");
    applied.add(EventKind::Oversized);
}

/// The reducer's state. See the module documentation.
#[derive(Clone, Debug)]
pub struct Reducer {
    namespaces: Vec<Arc<str>>,
    store: Store,
    conflicts: Conflicts,
    /// The materialised fleet, kept up to date per identity; `fleet()` hands out a clone.
    fleet: Fleet,
    capacity_warned: [bool; Keyspace::ALL.len()],
    /// Whether a card's opaque form was dropped for the cards' byte budget since one last fitted.
    card_budget_warned: bool,
    /// Keyspaces that refused a key for want of room since they were last listed.
    refused: [bool; Keyspace::ALL.len()],
    /// When stray keys were last warned of, and how many were seen since without a warning.
    stray_warned: Option<SystemTime>,
    /// When a lease's full share was last warned of.
    lease_warned: Option<SystemTime>,
    strays_unwarned: u64,
    /// When the workers of the fleet this reducer succeeds were first seen: a worker its first
    /// resync finds again keeps its `first_seen` across a reload that replaced the watcher.
    handed_over: BTreeMap<WorkerKey, SystemTime>,
}

/// The bookkeeping of one event: counts, and the identities whose claimants changed.
#[derive(Default)]
struct Pass {
    applied: Applied,
    touched: BTreeSet<Identity>,
    strays: Strays,
}

/// Keys under the watched prefixes that are no Dynamo discovery keys, seen in one pass: how
/// many, and the first (cut) with why. Counted as malformed each time; warned of at most once
/// every [`STRAY_WARNING_EVERY`], since nothing in the key changes by its being written or
/// listed again.
#[derive(Debug, Default)]
struct Strays {
    seen: u64,
    first: Option<(String, String)>,
}

impl Strays {
    fn note(&mut self, key: &[u8], error: &dyn std::fmt::Display) {
        self.seen += 1;
        self.first.get_or_insert_with(|| (shown(&String::from_utf8_lossy(key)), error.to_string()));
    }

    fn merge(&mut self, other: Strays) {
        self.seen += other.seen;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

/// The least time between two warnings of stray keys.
pub const STRAY_WARNING_EVERY: Duration = Duration::from_secs(60);

impl Pass {
    fn touch(&mut self, entry: &Entry) {
        self.touched.extend(entry.identity());
    }
}

impl Reducer {
    /// A reducer for the Dynamo namespaces watched (`DYN_NAMESPACE` values).
    pub fn new(namespaces: Vec<String>) -> Self {
        let mut watched: Vec<Arc<str>> = Vec::with_capacity(namespaces.len());
        for namespace in namespaces {
            if !watched.iter().any(|w| **w == *namespace) {
                watched.push(Arc::from(namespace));
            }
        }
        Self {
            namespaces: watched,
            store: Store::default(),
            conflicts: Conflicts::default(),
            fleet: Fleet::default(),
            capacity_warned: [false; Keyspace::ALL.len()],
            card_budget_warned: false,
            refused: [false; Keyspace::ALL.len()],
            stray_warned: None,
            lease_warned: None,
            strays_unwarned: 0,
            handed_over: BTreeMap::new(),
        }
    }

    /// A reducer taking over from the one that folded `previous`: the workers its first resync
    /// finds again keep when they were first seen.
    pub fn succeeding(namespaces: Vec<String>, previous: &Fleet) -> Self {
        let handed_over = previous.workers.iter().map(|w| (w.worker.key.clone(), w.first_seen)).collect();
        Self { handed_over, ..Self::new(namespaces) }
    }

    /// The same reducer holding at most `bytes` of opaque cards (the budget is 256 MiB).
    #[cfg(test)]
    pub(super) fn with_card_budget(self, bytes: usize) -> Self {
        Self { store: Store::with_card_budget(bytes), ..self }
    }

    pub fn namespaces(&self) -> &[Arc<str>] {
        &self.namespaces
    }

    /// Folds one event in.
    pub fn apply(&mut self, event: WatchEvent, now: SystemTime) -> Applied {
        let mut pass = Pass::default();
        match event {
            WatchEvent::Put(kv) => self.put(kv, now, None, &mut pass),
            WatchEvent::Delete { key } => self.delete(&key, &mut pass),
            WatchEvent::Resync(kvs) => {
                let mut listing = Listing::default();
                for kv in kvs {
                    self.list(&mut listing, kv);
                }
                return self.resync(listing, now);
            }
        }
        self.warn_strays(std::mem::take(&mut pass.strays), now);
        self.refresh(pass, now)
    }

    /// Warns of the stray keys seen, unless it did within [`STRAY_WARNING_EVERY`]; those go
    /// into the next warning's count.
    fn warn_strays(&mut self, strays: Strays, now: SystemTime) {
        self.strays_unwarned += strays.seen;
        let Some((key, error)) = strays.first else { return };
        let due =
            self.stray_warned.is_none_or(|at| now.duration_since(at).is_ok_and(|since| since >= STRAY_WARNING_EVERY));
        if !due {
            return;
        }
        tracing::warn!(
            key = ?key,
            // Escaped: the error quotes the key.
            error = ?error.to_string(),
            strays = self.strays_unwarned,
            "etcd keys under the watched prefixes are not Dynamo discovery keys (counted as malformed; warned of at most once a minute)"
        );
        self.stray_warned = Some(now);
        self.strays_unwarned = 0;
    }

    /// Adds `kv`, one record of a relist, to `listing`, as far as the resync that ends the
    /// listing could use it: every key held goes in (they go first, and the store bounds
    /// them); of the keys not held, only as many records and set-aside values as a keyspace has
    /// room for, and none that is refused whatever the room (unread for its size, or skipped).
    /// What is left out is counted as the resync would have, so a listing holds what the
    /// reducer's bounds allow, not what etcd holds.
    pub fn list(&self, listing: &mut Listing, kv: KeyValue) {
        let mut pass = Pass::default();
        let read = self.read(kv, &mut pass);
        listing.applied.merge(&pass.applied);
        listing.strays.merge(pass.strays);
        let Some(mut read) = read else { return };
        let held = self.store.holds(read.etcd_key.as_bytes());
        if let Reading::Parsed(parsed) = &mut read.value
            && let Some(bytes) = self.store.fit_listed_card(parsed, &mut listing.card_bytes[usize::from(!held)])
        {
            listing.card_dropped.get_or_insert_with(|| (read.etcd_key.clone(), bytes));
        }
        let keyspace = read.key.keyspace;
        let index = keyspace.index();
        let is_record = matches!(&read.value, Reading::Parsed(parsed) if parsed.is_record());
        let lease_held =
            read.lease.filter(|_| is_record).map(|lease| listing.per_lease.entry((index, lease)).or_default());
        if held {
            if let Some(lease_held) = lease_held {
                *lease_held += 1;
            }
            listing.held.push(read);
            return;
        }
        if let Some(lease_held) = lease_held {
            // As the resync would refuse it: the lease's share is taken.
            if *lease_held >= MAX_RECORDS_PER_LEASE {
                listing.applied.add(EventKind::OverCapacity);
                return;
            }
            *lease_held += 1;
        }
        match &read.value {
            Reading::Oversized(bytes) => refuse_oversized(&read.etcd_key, *bytes, keyspace, &mut listing.applied),
            Reading::Parsed(Parsed::Skipped(_)) => listing.applied.add(EventKind::Skipped),
            Reading::Parsed(parsed @ (Parsed::Malformed(_) | Parsed::Unsupported(_))) => {
                if listing.set_aside[index] < MAX_SET_ASIDE_PER_KEYSPACE {
                    listing.set_aside[index] += 1;
                    listing.new.push(read);
                } else {
                    listing.applied.add(kind_of(parsed));
                }
            }
            Reading::Parsed(_) if listing.records[index] < MAX_RECORDS_PER_KEYSPACE => {
                listing.records[index] += 1;
                listing.new.push(read);
            }
            Reading::Parsed(_) => {
                listing.applied.add(EventKind::OverCapacity);
                listing.refused[index].get_or_insert(read.etcd_key);
            }
        }
    }

    /// Replaces everything held by what `listing` holds (see [`WatchEvent::Resync`]).
    pub fn resync(&mut self, mut listing: Listing, now: SystemTime) -> Applied {
        let mut pass = Pass::default();
        pass.applied.add(EventKind::Resync);
        pass.applied.merge(&listing.applied);
        self.warn_strays(std::mem::take(&mut listing.strays), now);
        let card_dropped = listing.card_dropped.take();
        self.refused = [false; Keyspace::ALL.len()];
        let emptied = self.store.emptied();
        let mut prior = std::mem::replace(&mut self.store, emptied);
        pass.touched.extend(prior.identities().cloned());
        // Keys held before go first: a full keyspace keeps the workers it had, and new keys
        // take only the room left.
        for read in listing.held.into_iter().chain(listing.new) {
            self.admit(read, now, Some(&mut prior), &mut pass);
        }
        // A card the listing kept without its text is warned of as one the admission dropped.
        if let Some((key, bytes)) = card_dropped {
            self.warn_card_budget(&key, bytes);
        }
        for (keyspace, refused) in Keyspace::ALL.into_iter().zip(listing.refused) {
            if let Some(key) = refused {
                self.refused[keyspace.index()] = true;
                self.warn_full(keyspace, &key);
            }
        }
        let applied = self.refresh(pass, now);
        // Only the first resync finds the predecessor's workers again.
        self.handed_over.clear();
        applied
    }

    /// Whether `key` is held, as a record or set aside.
    #[cfg(test)]
    pub(super) fn holds(&self, key: &str) -> bool {
        self.store.holds(key.as_bytes())
    }

    /// The fleet as folded so far.
    pub fn fleet(&self) -> Fleet {
        self.fleet.clone()
    }

    /// Holds `kv`, replacing what its key held.
    fn put(&mut self, kv: KeyValue, now: SystemTime, prior: Option<&mut Store>, pass: &mut Pass) {
        if let Some(read) = self.read(kv, pass) {
            self.admit(read, now, prior, pass);
        }
    }

    /// `kv` placed and parsed, unless its size refuses it unread; `None` (counted) when its key
    /// is not ours or not well-formed.
    fn read(&self, kv: KeyValue, pass: &mut Pass) -> Option<Read> {
        let (key, etcd_key) = self.classify(&kv.key, pass)?;
        let value = match kv.value.len() {
            bytes if bytes > max_record_bytes(key.keyspace) => Reading::Oversized(bytes),
            _ => Reading::Parsed(records::parse(&key, &kv.value, kv.lease)),
        };
        Some(Read { key, etcd_key, value, lease: kv.lease })
    }

    /// Holds what `read` found, replacing what its key held. During a resync `prior` is the
    /// state before it, so unchanged values keep their timestamps and set-aside values are not
    /// logged again.
    fn admit(&mut self, read: Read, now: SystemTime, mut prior: Option<&mut Store>, pass: &mut Pass) {
        let Read { key, etcd_key, value, lease } = read;
        let keyspace = key.keyspace;
        let held = self.store.remove(keyspace, &etcd_key);
        // Whether the key took room in its keyspace until now: a set-aside value takes none,
        // so replacing one frees nothing to list again for.
        let held_room = held.as_ref().is_some_and(|entry| !entry.set_aside());
        let previous = match held {
            Some(entry) => {
                pass.touch(&entry);
                Some(entry)
            }
            None => prior.as_deref_mut().and_then(|p| p.remove(keyspace, &etcd_key)),
        };
        let mut parsed = match value {
            Reading::Parsed(parsed) => parsed,
            Reading::Oversized(bytes) => {
                refuse_oversized(&etcd_key, bytes, keyspace, &mut pass.applied);
                if held_room {
                    self.gave_room_back(keyspace, pass);
                }
                return;
            }
        };
        // Endpoints and topics the router does not read take no room: a Dynamo 1.6.1 worker
        // writes three to five channel keys and two or three instance keys, of which routing
        // reads two, so holding the rest would fill a keyspace at a third of its workers.
        if let Parsed::Skipped(_) = parsed {
            pass.applied.add(EventKind::Skipped);
            if held_room {
                self.gave_room_back(keyspace, pass);
            }
            return;
        }
        if matches!(parsed, Parsed::Malformed(_) | Parsed::Unsupported(_)) {
            // Set aside, not a record: it takes none of the keyspace's room (junk must not refuse
            // a real worker), but has a bound of its own.
            if held_room {
                self.gave_room_back(keyspace, pass);
            }
            // Only a key already set aside keeps its place past the bound: a record turned to
            // junk takes a new one, or a writer could turn records to junk and write new ones,
            // round after round, with nothing held in check.
            if !previous.as_ref().is_some_and(Entry::set_aside) && self.store.set_aside_full(keyspace) {
                pass.applied.add(kind_of(&parsed));
                tracing::debug!(key = ?shown(&etcd_key), "etcd value refused and not held: too many are set aside");
                return;
            }
        } else if !held_room && !self.has_room(keyspace, &etcd_key) {
            // A key already held gave its room back above; during a resync nothing is held yet,
            // so every key, one held before included, must fit.
            pass.applied.add(EventKind::OverCapacity);
            self.refused[keyspace.index()] = true;
            return;
        } else if !held_room && self.store.lease_is_full(keyspace, lease) {
            // Its lease's share is taken: the rest of the keyspace is for other processes. Only
            // its own keys' deletes give the room back, and its writer keeps writing them, so
            // no relist is wanted for it.
            pass.applied.add(EventKind::OverCapacity);
            self.warn_lease_full(keyspace, lease, &etcd_key, now);
            return;
        }
        let dropped = self.store.fit_card(&mut parsed);
        self.note_card_budget(&etcd_key, &parsed, dropped);
        pass.applied.add(kind_of(&parsed));
        log_record(&etcd_key, &parsed, previous.as_ref().map(|p| &p.parsed));
        let updated = match previous {
            Some(previous) if prior.is_some() && previous.parsed == parsed => previous.updated,
            _ => now,
        };
        let entry = Entry { namespace: key.namespace, parsed, updated, lease };
        pass.touch(&entry);
        self.store.insert(keyspace, etcd_key, entry);
    }

    fn delete(&mut self, key: &[u8], pass: &mut Pass) {
        let Some((key, etcd_key)) = self.classify(key, pass) else {
            return;
        };
        pass.applied.add(EventKind::Delete);
        if let Some(entry) = self.store.remove(key.keyspace, &etcd_key) {
            pass.touch(&entry);
            if !entry.set_aside() {
                self.gave_room_back(key.keyspace, pass);
            }
        }
    }

    /// A held key left `keyspace` (deleted, or replaced by a value that is not held): if the
    /// keyspace refused keys while full, they may fit now, and since Dynamo writes a key once
    /// they come back only by listing again.
    fn gave_room_back(&mut self, keyspace: Keyspace, pass: &mut Pass) {
        if std::mem::take(&mut self.refused[keyspace.index()]) {
            pass.applied.want_relist();
        }
    }

    /// The key's place, or `None` (counted) when it is not ours or not well-formed.
    fn classify(&self, key: &[u8], pass: &mut Pass) -> Option<(ParsedKey, EtcdKey)> {
        match keys::classify(&self.namespaces, key) {
            Ok(Some(parsed)) => Some((parsed, Arc::from(String::from_utf8_lossy(key).as_ref()))),
            Ok(None) => {
                pass.applied.add(EventKind::Skipped);
                None
            }
            Err(error) => {
                pass.strays.note(key, &error);
                pass.applied.add(EventKind::Malformed);
                None
            }
        }
    }

    /// Whether a new key fits in `keyspace`; warns once each time the keyspace fills up.
    fn has_room(&mut self, keyspace: Keyspace, key: &str) -> bool {
        if !self.store.is_full(keyspace) {
            self.capacity_warned[keyspace.index()] = false;
            return true;
        }
        self.warn_full(keyspace, key);
        false
    }

    /// Warns that `lease` holds its share of `keyspace`, at most once a minute across leases:
    /// one process writing keys by the thousand would otherwise warn for each.
    fn warn_lease_full(&mut self, keyspace: Keyspace, lease: Option<u64>, key: &str, now: SystemTime) {
        let due =
            self.lease_warned.is_none_or(|at| now.duration_since(at).is_ok_and(|since| since >= STRAY_WARNING_EVERY));
        if !due {
            return;
        }
        self.lease_warned = Some(now);
        tracing::warn!(
            %keyspace,
            lease = ?lease.map(|lease| format!("{lease:x}")),
            limit = MAX_RECORDS_PER_LEASE,
            key = ?shown(key),
            "one etcd lease's keys hold as many records as a lease may; its new keys are refused (warned of at most once a minute)"
        );
    }

    /// Warns that `keyspace` refused `key` for want of room, once until it has room again.
    fn warn_full(&mut self, keyspace: Keyspace, key: &str) {
        let warned = &mut self.capacity_warned[keyspace.index()];
        if !*warned {
            tracing::warn!(
                %keyspace,
                limit = MAX_RECORDS_PER_KEYSPACE,
                key = ?shown(key),
                "discovery keyspace is full; new keys are refused until held keys are deleted"
            );
            *warned = true;
        }
    }

    /// Warns that a card's opaque form was dropped for the cards' byte budget, once until a
    /// card fits again.
    fn note_card_budget(&mut self, key: &str, parsed: &Parsed, dropped: Option<usize>) {
        match dropped {
            Some(bytes) => self.warn_card_budget(key, bytes),
            None if matches!(parsed, Parsed::Model(record) if record.card.raw.is_some()) => {
                self.card_budget_warned = false
            }
            None => {}
        }
    }

    fn warn_card_budget(&mut self, key: &str, bytes: usize) {
        if std::mem::replace(&mut self.card_budget_warned, true) {
            return;
        }
        tracing::warn!(
            key = ?shown(key),
            bytes,
            budget = super::card::MAX_RETAINED_CARDS_BYTES,
            "model cards held fill their byte budget; new cards keep only their typed fields"
        );
    }

    /// Reports new conflicts and re-materialises every worker and publisher touched.
    fn refresh(&mut self, pass: Pass, now: SystemTime) -> Applied {
        let mut applied = pass.applied;
        let mut workers = BTreeSet::new();
        let mut publishers = BTreeSet::new();
        for identity in &pass.touched {
            if self.conflicts.check(&self.store, identity) {
                applied.add(EventKind::Duplicate);
            }
            workers.extend(identity.worker().cloned());
            publishers.extend(identity.publisher().cloned());
        }
        for key in workers {
            applied.mark_changed(self.refresh_worker(key, now));
        }
        for key in publishers {
            applied.mark_changed(self.refresh_publisher(key));
        }
        applied
    }

    fn refresh_worker(&mut self, key: WorkerKey, now: SystemTime) -> bool {
        let previous = self.fleet.workers.get(&key);
        let mut next = join::worker(&self.store, &key, previous, now);
        if previous.is_none()
            && let (Some(worker), Some(seen)) = (next.as_mut(), self.handed_over.get(&key))
        {
            worker.first_seen = *seen;
        }
        if next.as_ref() == previous {
            return false;
        }
        if let Some(exclusion) = next.as_ref().and_then(|w| w.excluded)
            && previous.and_then(|p| p.excluded) != Some(exclusion)
        {
            // Budgeted: a fleet that deletes and re-puts a bad card would warn on each put.
            // Escaped: the namespace and the card's words are the fleet's.
            warn_limited!(
                worker = ?key.to_string(),
                exclusion = ?exclusion.to_string(),
                "Dynamo worker excluded from routing"
            );
        }
        match next {
            Some(worker) => self.fleet.workers.insert(key, worker),
            None => self.fleet.workers.remove(&key),
        };
        true
    }

    fn refresh_publisher(&mut self, key: PublisherKey) -> bool {
        let next = join::publisher(&self.store, &key);
        if next.as_ref() == self.fleet.publishers.get(&key) {
            return false;
        }
        match next {
            Some(publisher) => self.fleet.publishers.insert(key, publisher),
            None => self.fleet.publishers.remove(&key),
        };
        true
    }
}

fn kind_of(parsed: &Parsed) -> EventKind {
    match parsed {
        Parsed::Endpoint(_) | Parsed::Model(_) | Parsed::Channel(_) | Parsed::Source(_) => EventKind::Put,
        Parsed::Skipped(_) => EventKind::Skipped,
        Parsed::Unsupported(_) => EventKind::Unsupported,
        Parsed::Malformed(_) => EventKind::Malformed,
    }
}

/// Logs what a put deserves, once per key: a value is only logged when it differs in kind (or,
/// for cards, in content) from what the key held before; and a few a minute of each warning, so
/// that a key rewritten in a loop with a good value and a bad one does not flood the log.
fn log_record(key: &str, parsed: &Parsed, previous: Option<&Parsed>) {
    match (parsed, previous) {
        (Parsed::Malformed(_), Some(Parsed::Malformed(_))) | (Parsed::Unsupported(_), Some(Parsed::Unsupported(_))) => {
        }
        (Parsed::Malformed(error), _) => {
            // Escaped: the error quotes what the record says.
            warn_limited!(key = ?shown(key), error = ?error.to_string(), "discovery record set aside: malformed")
        }
        (Parsed::Unsupported(what), _) => {
            warn_limited!(
                key = ?shown(key),
                unsupported = ?what.to_string(),
                "event channel set aside: the router subscribes only to direct ZMQ over tcp://"
            );
        }
        (Parsed::Model(model), previous) if previous != Some(parsed) => {
            if let Some(error) = &model.card.typed_error {
                warn_limited!(key = ?shown(key), error = ?error.to_string(), "model card fields unreadable; the worker is kept with its raw card");
            }
            if let Some(bytes) = model.card.dropped_bytes {
                warn_limited!(
                    key = ?shown(key),
                    bytes,
                    limit = super::card::MAX_RETAINED_CARD_BYTES,
                    "model card too large to keep; only its typed fields are used"
                );
            }
            if let Some(release) = model.card.release.as_deref() {
                tracing::debug!(key = ?shown(key), release, instance_id = model.instance_id, "model card release");
            }
        }
        _ => {}
    }
}

/// A key as logs show it: cut, and quoted (a key is fleet-authored, so it may be long or hold
/// line breaks that would forge log lines).
fn shown(key: &str) -> String {
    records::excerpt(key)
}
