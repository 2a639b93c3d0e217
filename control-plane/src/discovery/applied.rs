//! What one event did, counted by kind for `continuum_dynamo_discovery_events_total{kind}`.

use std::fmt;

/// The closed set of discovery event kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventKind {
    /// A put that became a record.
    Put,
    /// A delete of a key in a watched keyspace and namespace.
    Delete,
    /// A full state replacement from range gets.
    Resync,
    /// A put set aside because its key or value is not a Dynamo record.
    Malformed,
    /// A put refused before parsing: larger than `MAX_RECORD_BYTES`.
    Oversized,
    /// A new key refused because its keyspace holds `MAX_RECORDS_PER_KEYSPACE` keys.
    OverCapacity,
    /// A newly seen set of keys claiming one identity.
    Duplicate,
    /// A channel the router cannot subscribe to (broker, NATS, non-tcp, unknown scope).
    Unsupported,
    /// A key outside the watched namespaces, or a record not for the router (other endpoints,
    /// adapter cards, other topics).
    Skipped,
}

impl EventKind {
    pub const ALL: [EventKind; 9] = [
        EventKind::Put,
        EventKind::Delete,
        EventKind::Resync,
        EventKind::Malformed,
        EventKind::Oversized,
        EventKind::OverCapacity,
        EventKind::Duplicate,
        EventKind::Unsupported,
        EventKind::Skipped,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Put => "put",
            EventKind::Delete => "delete",
            EventKind::Resync => "resync",
            EventKind::Malformed => "malformed",
            EventKind::Oversized => "oversized",
            EventKind::OverCapacity => "over_capacity",
            EventKind::Duplicate => "duplicate",
            EventKind::Unsupported => "unsupported",
            EventKind::Skipped => "skipped",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts by kind for one applied event, and whether the published fleet changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    counts: [u64; EventKind::ALL.len()],
    changed: bool,
    relist: bool,
}

impl Applied {
    pub fn count(&self, kind: EventKind) -> u64 {
        self.counts[kind.index()]
    }

    /// The kinds that occurred, with their counts.
    pub fn iter(&self) -> impl Iterator<Item = (EventKind, u64)> + '_ {
        EventKind::ALL.into_iter().map(|k| (k, self.count(k))).filter(|(_, n)| *n > 0)
    }

    /// Whether [`super::Reducer::fleet`] differs from before the event.
    pub fn fleet_changed(&self) -> bool {
        self.changed
    }

    /// Whether keys once refused for a full keyspace may fit now: Dynamo writes a key once, so
    /// they come back only by listing the keyspaces again.
    pub fn relist_wanted(&self) -> bool {
        self.relist
    }

    pub(super) fn want_relist(&mut self) {
        self.relist = true;
    }

    pub(super) fn add(&mut self, kind: EventKind) {
        self.counts[kind.index()] += 1;
    }

    /// Adds `other`'s counts to these.
    pub(super) fn merge(&mut self, other: &Applied) {
        for (count, more) in self.counts.iter_mut().zip(other.counts) {
            *count += more;
        }
        self.changed |= other.changed;
        self.relist |= other.relist;
    }

    pub(super) fn mark_changed(&mut self, changed: bool) {
        self.changed |= changed;
    }
}
