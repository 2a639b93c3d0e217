//! What happened to each kv-events event (or refused message), as counted by
//! `continuum_dynamo_kv_events_total{result}`. The label set is closed.

use continuum_kv_index::{KvResult, Outcome};

use super::decode::DecodeError;

/// The result of one event, or of one message refused whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvEventResult {
    /// The event changed the index (or was a `cleared`, or named no blocks).
    Applied,
    /// Every block was already held where the event puts it: nothing changed.
    Duplicate,
    /// A removed hash the rank did not hold (typical right after a gap or a fresh subscription).
    UnknownBlock,
    /// A stored chain whose parent the rank does not hold: refused whole (the rank rebuilds from
    /// root-anchored chains).
    UnknownParent,
    /// An index ceiling refused blocks, or the publisher already has its 4,096 rank cursors.
    OverCapacity,
    /// An event id below the rank's cursor: skipped. (One equal to it is the same engine
    /// step's next event, and applied.)
    Replay,
    /// An event id past the next expected one: the rank was cleared before the event was
    /// applied. Counted in addition to the event's own result.
    Gap,
    /// The event's worker is not live or not the publisher's, or its rank is not declared.
    IdentityMismatch,
    /// A tier or residency other than the worker's device cache: not indexed.
    OtherTier,
    /// Message-level refusals (see [`DecodeError`]); one count per message.
    Malformed,
    UnknownVersion,
    TopicMismatch,
    Oversized,
    TooManyEvents,
    TooManyBlocks,
    /// A message within the ceilings that the process-wide budget for large ZMTP messages could
    /// not hold just then: read through and lost, its ranks cleared as on a gap.
    OverBudget,
    /// The publisher broke ZMTP or a transport bound; the session was closed.
    TransportRefused,
    /// The publisher's address resolves only outside the allowed CIDRs.
    NotAllowed,
}

impl KvEventResult {
    pub const ALL: [KvEventResult; 18] = [
        KvEventResult::Applied,
        KvEventResult::Duplicate,
        KvEventResult::UnknownBlock,
        KvEventResult::UnknownParent,
        KvEventResult::OverCapacity,
        KvEventResult::Replay,
        KvEventResult::Gap,
        KvEventResult::IdentityMismatch,
        KvEventResult::OtherTier,
        KvEventResult::Malformed,
        KvEventResult::UnknownVersion,
        KvEventResult::TopicMismatch,
        KvEventResult::Oversized,
        KvEventResult::TooManyEvents,
        KvEventResult::TooManyBlocks,
        KvEventResult::OverBudget,
        KvEventResult::TransportRefused,
        KvEventResult::NotAllowed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            KvEventResult::Applied => "applied",
            KvEventResult::Duplicate => "duplicate",
            KvEventResult::UnknownBlock => "unknown_block",
            KvEventResult::UnknownParent => "unknown_parent",
            KvEventResult::OverCapacity => "over_capacity",
            KvEventResult::Replay => "replay",
            KvEventResult::Gap => "gap",
            KvEventResult::IdentityMismatch => "identity_mismatch",
            KvEventResult::OtherTier => "other_tier",
            KvEventResult::Malformed => "malformed",
            KvEventResult::UnknownVersion => "unknown_version",
            KvEventResult::TopicMismatch => "topic_mismatch",
            KvEventResult::Oversized => "oversized",
            KvEventResult::TooManyEvents => "too_many_events",
            KvEventResult::TooManyBlocks => "too_many_blocks",
            KvEventResult::OverBudget => "over_budget",
            KvEventResult::TransportRefused => "transport_refused",
            KvEventResult::NotAllowed => "not_allowed",
        }
    }

    const fn slot(self) -> usize {
        self as usize
    }
}

impl From<DecodeError> for KvEventResult {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Malformed => KvEventResult::Malformed,
            DecodeError::UnknownVersion => KvEventResult::UnknownVersion,
            DecodeError::TopicMismatch => KvEventResult::TopicMismatch,
            DecodeError::Oversized => KvEventResult::Oversized,
            DecodeError::IdentityMismatch => KvEventResult::IdentityMismatch,
            DecodeError::TooManyEvents => KvEventResult::TooManyEvents,
            DecodeError::TooManyBlocks => KvEventResult::TooManyBlocks,
        }
    }
}

impl From<KvResult> for KvEventResult {
    fn from(r: KvResult) -> Self {
        match r {
            KvResult::Applied => KvEventResult::Applied,
            KvResult::Duplicate => KvEventResult::Duplicate,
            KvResult::OverCapacity => KvEventResult::OverCapacity,
            KvResult::UnknownParent => KvEventResult::UnknownParent,
            KvResult::UnknownBlock => KvEventResult::UnknownBlock,
        }
    }
}

/// Events per [`KvEventResult`] for one message (or a sum of several), and what the index did
/// block by block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvCounts {
    events: [u32; KvEventResult::ALL.len()],
    /// Blocks per index result, for events that reached the index.
    pub blocks: Outcome,
}

impl KvCounts {
    /// Events counted under `result`.
    pub fn get(&self, result: KvEventResult) -> u32 {
        self.events[result.slot()]
    }

    /// The results with a non-zero count, in label order: what to add to the counter.
    pub fn iter(&self) -> impl Iterator<Item = (KvEventResult, u32)> + '_ {
        KvEventResult::ALL.into_iter().map(|r| (r, self.get(r))).filter(|(_, n)| *n > 0)
    }

    pub fn add(&mut self, result: KvEventResult) {
        let slot = &mut self.events[result.slot()];
        *slot = slot.saturating_add(1);
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &KvCounts) {
        for (mine, theirs) in self.events.iter_mut().zip(other.events) {
            *mine = mine.saturating_add(theirs);
        }
        self.blocks.merge(&other.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_snake_case_and_cover_every_refusal() {
        let mut labels: Vec<_> = KvEventResult::ALL.iter().map(|r| r.as_str()).collect();
        assert!(labels.iter().all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), KvEventResult::ALL.len());
        for e in DecodeError::ALL {
            assert_eq!(KvEventResult::from(e).as_str(), e.as_str(), "one label per refusal, shared");
        }
        for r in KvResult::ALL {
            assert_eq!(KvEventResult::from(r).as_str(), r.as_str());
        }
    }

    #[test]
    fn counts_add_and_merge_per_label() {
        let mut one = KvCounts::default();
        one.add(KvEventResult::Replay);
        one.add(KvEventResult::Replay);
        let mut two = KvCounts::default();
        two.add(KvEventResult::Gap);
        two.merge(&one);
        assert_eq!(two.iter().collect::<Vec<_>>(), [(KvEventResult::Replay, 2), (KvEventResult::Gap, 1)]);
    }
}
