//! What applying an event did, block by block, under a closed set of results so the caller can
//! count `continuum_dynamo_kv_events_total{result}` without inventing labels.

/// The result of applying one block of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvResult {
    /// The block's ownership was added (stored), moved to a new node (stored again under a
    /// different prefix) or dropped (removed).
    Applied,
    /// The rank already held this engine hash at this node: nothing changed.
    Duplicate,
    /// A ceiling of [`crate::Limits`] refused the block (and the rest of its chain).
    OverCapacity,
    /// The stored event's parent hash is not held by the rank: the whole event was refused.
    UnknownParent,
    /// A removed hash the rank does not hold: nothing changed.
    UnknownBlock,
}

impl KvResult {
    /// Every result, in label order.
    pub const ALL: [KvResult; 5] = [
        KvResult::Applied,
        KvResult::Duplicate,
        KvResult::OverCapacity,
        KvResult::UnknownParent,
        KvResult::UnknownBlock,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            KvResult::Applied => "applied",
            KvResult::Duplicate => "duplicate",
            KvResult::OverCapacity => "over_capacity",
            KvResult::UnknownParent => "unknown_parent",
            KvResult::UnknownBlock => "unknown_block",
        }
    }

    const fn slot(self) -> usize {
        self as usize
    }
}

/// Blocks per [`KvResult`] for one applied event (or a sum of several: see [`Outcome::merge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    counts: [u32; KvResult::ALL.len()],
}

impl Outcome {
    /// Blocks that ended with `result`.
    pub fn get(&self, result: KvResult) -> u32 {
        self.counts[result.slot()]
    }

    /// Blocks counted under any result.
    pub fn blocks(&self) -> u32 {
        self.counts.iter().fold(0u32, |sum, n| sum.saturating_add(*n))
    }

    /// The results with a non-zero count, in label order.
    pub fn iter(&self) -> impl Iterator<Item = (KvResult, u32)> + '_ {
        KvResult::ALL.into_iter().map(|r| (r, self.get(r))).filter(|(_, n)| *n > 0)
    }

    /// One label for the whole event: the most severe result any of its blocks had
    /// (`unknown_parent` > `over_capacity` > `unknown_block` > `applied` > `duplicate`), or
    /// `None` for an event without blocks. An event is a `duplicate` only when it changed
    /// nothing: one that re-stores held blocks and adds a new one is `applied`.
    pub fn summary(&self) -> Option<KvResult> {
        const SEVERITY: [KvResult; 5] = [
            KvResult::UnknownParent,
            KvResult::OverCapacity,
            KvResult::UnknownBlock,
            KvResult::Applied,
            KvResult::Duplicate,
        ];
        SEVERITY.into_iter().find(|r| self.get(*r) > 0)
    }

    /// Adds `other`'s counts to this one.
    pub fn merge(&mut self, other: &Outcome) {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts) {
            *mine = mine.saturating_add(theirs);
        }
    }

    /// Counts `blocks` more under `result`.
    pub fn add(&mut self, result: KvResult, blocks: usize) {
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        let slot = &mut self.counts[result.slot()];
        *slot = slot.saturating_add(blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_snake_case() {
        let labels: Vec<_> = KvResult::ALL.iter().map(|r| r.as_str()).collect();
        let mut unique = labels.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), labels.len());
        assert!(labels.iter().all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
    }

    #[test]
    fn summary_names_the_most_severe_result() {
        let mut outcome = Outcome::default();
        assert_eq!(outcome.summary(), None);
        outcome.add(KvResult::Duplicate, 2);
        assert_eq!(outcome.summary(), Some(KvResult::Duplicate), "nothing changed");
        outcome.add(KvResult::Applied, 3);
        assert_eq!(outcome.summary(), Some(KvResult::Applied), "held blocks and a new one");
        outcome.add(KvResult::OverCapacity, 1);
        assert_eq!(outcome.summary(), Some(KvResult::OverCapacity));
        assert_eq!(outcome.blocks(), 6);
        assert_eq!(
            outcome.iter().collect::<Vec<_>>(),
            vec![(KvResult::Applied, 3), (KvResult::Duplicate, 2), (KvResult::OverCapacity, 1)]
        );
    }
}
