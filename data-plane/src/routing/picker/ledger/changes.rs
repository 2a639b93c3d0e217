//! What one rank's reported operations did to its load, in operation order, with running
//! totals: the part of them that sums holding operations up to `last_op` lack is two lookups,
//! however far the sums trail.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::SinceFleet;

/// How long a change is remembered: the control plane's sums trail this replica's reports by a
/// few milliseconds…
pub(super) const CHANGE_MEMORY: Duration = Duration::from_secs(1);
/// …and how many per rank at most.
pub(super) const CHANGES_PER_RANK: usize = 1024;
/// Past that bound the oldest are dropped this many at once. Dropping reads only the last of
/// them (for the totals it leaves behind): a rank recording at the bound, as every busy one
/// does, would otherwise read its oldest entry, long out of the cache, at every record.
const FORGET_CHUNK: usize = 64;
const _: () = assert!(FORGET_CHUNK < CHANGES_PER_RANK);

#[derive(Debug, Default)]
pub(super) struct Changes {
    /// In operation order; each holds the totals up to and including it.
    entries: VecDeque<Change>,
    /// The totals up to the first entry, exclusive (of the changes already forgotten).
    forgotten: SinceFleet,
    /// The operation of the last change forgotten (0: none): sums that hold no later one
    /// lack a change no longer known.
    forgotten_through: u64,
    /// The totals through the operation last asked about. The sums stand still between two
    /// updates of the view while every pick asks, and what happened through an operation
    /// never changes (later operations only add entries after it).
    asked: Option<(u64, SinceFleet)>,
    /// When the first entry is forgotten (`None`: never, or no entry): kept here because every
    /// pick asks, and the entry itself lies a thousand changes back, out of the cache.
    first_expires: Option<Instant>,
}

#[derive(Clone, Copy, Debug)]
struct Change {
    op: u64,
    at: Instant,
    totals: SinceFleet,
}

impl Changes {
    /// Operation `op` (no older than the last recorded) changed the rank by `change`.
    pub(super) fn record(&mut self, op: u64, at: Instant, change: SinceFleet) {
        let before = self.entries.back().map_or(self.forgotten, |last| last.totals);
        let totals = before.plus(change);
        match self.entries.back_mut() {
            // One operation's effects on a rank (a prompt queued and its blocks held) are one entry.
            Some(last) if last.op == op => last.totals = totals,
            _ => {
                if self.entries.is_empty() {
                    self.first_expires = at.checked_add(CHANGE_MEMORY);
                }
                self.entries.push_back(Change { op, at, totals });
            }
        }
        if self.entries.len() > CHANGES_PER_RANK {
            self.drop_first(self.entries.len() - (CHANGES_PER_RANK - FORGET_CHUNK));
        }
    }

    /// What the operations after `last_op` did; `None` when some of them are forgotten (sums
    /// that trail by more than the memory), which the caller must take as unknown rather than
    /// as nothing.
    pub(super) fn after(&mut self, last_op: u64) -> Option<SinceFleet> {
        if last_op < self.forgotten_through {
            return None;
        }
        let Some(last) = self.entries.back().map(|change| change.totals) else { return Some(SinceFleet::default()) };
        let through = match self.asked {
            Some((asked, through)) if asked == last_op => through,
            _ => {
                let through = match self.first_after(last_op).checked_sub(1) {
                    Some(index) => self.entries[index].totals,
                    None => self.forgotten,
                };
                self.asked = Some((last_op, through));
                through
            }
        };
        Some(last.minus(through))
    }

    /// The first entry of an operation after `last_op`. The sums trail by a few milliseconds,
    /// so it is near the newest end: galloping back from there touches a few recent (cached)
    /// entries, where a binary search over the whole memory would miss the cache at each step.
    fn first_after(&self, last_op: u64) -> usize {
        let len = self.entries.len();
        let mut back = 1;
        while back <= len && self.entries[len - back].op > last_op {
            back *= 2;
        }
        // Entries from `high` on are after `last_op`; the one at `low` (if any) is not.
        let (mut low, mut high) = (len.saturating_sub(back), len - back / 2);
        while low < high {
            let middle = low + (high - low) / 2;
            if self.entries[middle].op <= last_op {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        low
    }

    /// Drops changes older than [`CHANGE_MEMORY`] ([`Self::record`] keeps the count bound).
    pub(super) fn forget(&mut self, now: Instant) {
        while self.first_expires.is_some_and(|expires| now >= expires) {
            self.drop_first(1);
        }
    }

    /// Drops the `count` oldest changes, reading only the last of them.
    fn drop_first(&mut self, count: usize) {
        let count = count.min(self.entries.len());
        if let Some(last) = count.checked_sub(1).and_then(|index| self.entries.get(index)) {
            self.forgotten = last.totals;
            self.forgotten_through = last.op;
        }
        self.entries.drain(..count);
        self.first_expires = self.entries.front().and_then(|first| first.at.checked_add(CHANGE_MEMORY));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl SinceFleet {
    /// Running totals wrap rather than saturate, so that differences of two stay exact.
    fn plus(self, other: Self) -> Self {
        Self {
            decode_started: self.decode_started.wrapping_add(other.decode_started),
            decode_ended: self.decode_ended.wrapping_add(other.decode_ended),
            prefill_started: self.prefill_started.wrapping_add(other.prefill_started),
            prefill_done: self.prefill_done.wrapping_add(other.prefill_done),
        }
    }

    fn minus(self, other: Self) -> Self {
        Self {
            decode_started: self.decode_started.wrapping_sub(other.decode_started),
            decode_ended: self.decode_ended.wrapping_sub(other.decode_ended),
            prefill_started: self.prefill_started.wrapping_sub(other.prefill_started),
            prefill_done: self.prefill_done.wrapping_sub(other.prefill_done),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(blocks: u64) -> SinceFleet {
        SinceFleet { decode_started: blocks, ..SinceFleet::default() }
    }

    fn ended(blocks: u64) -> SinceFleet {
        SinceFleet { decode_ended: blocks, ..SinceFleet::default() }
    }

    /// What the operations after `last_op` did, known.
    fn known(changes: &mut Changes, last_op: u64) -> SinceFleet {
        changes.after(last_op).expect("nothing after it forgotten")
    }

    #[test]
    fn what_operations_after_a_point_did_is_the_difference_of_two_totals() {
        let mut changes = Changes::default();
        let t0 = Instant::now();
        changes.record(1, t0, started(10));
        changes.record(2, t0, started(5));
        changes.record(2, t0, SinceFleet { prefill_started: 80, ..SinceFleet::default() });
        changes.record(4, t0, ended(10));
        assert_eq!(
            known(&mut changes, 0),
            SinceFleet { decode_started: 15, decode_ended: 10, prefill_started: 80, prefill_done: 0 }
        );
        assert_eq!(
            known(&mut changes, 1),
            SinceFleet { decode_started: 5, decode_ended: 10, prefill_started: 80, prefill_done: 0 }
        );
        assert_eq!(known(&mut changes, 3), ended(10), "operation 3 changed nothing here");
        assert_eq!(known(&mut changes, 4), SinceFleet::default());
        assert_eq!(known(&mut changes, u64::MAX), SinceFleet::default());
        // Asked again about the same point (as every pick between two updates does), after more
        // operations: they count too.
        assert_eq!(known(&mut changes, 3), ended(10));
        changes.record(5, t0, started(7));
        assert_eq!(known(&mut changes, 3), SinceFleet { decode_started: 7, decode_ended: 10, ..SinceFleet::default() });
    }

    #[test]
    fn the_first_change_after_a_point_is_found_from_any_point() {
        let t0 = Instant::now();
        for len in 0..40u64 {
            let mut changes = Changes::default();
            // Operations 2, 4, 6…: points between, on and around them.
            for op in 1..=len {
                changes.record(2 * op, t0, started(1));
            }
            for point in 0..=2 * len + 2 {
                let expected = changes.entries.partition_point(|c| c.op <= point);
                assert_eq!(changes.first_after(point), expected, "{len} entries, after {point}");
            }
        }
    }

    #[test]
    fn forgotten_changes_leave_the_totals_of_the_rest_exact() {
        let mut changes = Changes::default();
        let t0 = Instant::now();
        changes.record(1, t0, started(10));
        let later = t0 + CHANGE_MEMORY;
        changes.record(2, later, ended(3));
        changes.forget(later);
        assert_eq!(changes.entries.len(), 1, "the first is forgotten a memory later");
        assert_eq!(changes.after(0), None, "sums without operation 1 lack a change no longer known");
        assert_eq!(known(&mut changes, 1), ended(3));
        // Operation 2 and the next up to the bound are all kept…
        let top = 2 + CHANGES_PER_RANK as u64;
        for op in 3..top {
            changes.record(op, later, started(1));
        }
        assert_eq!(changes.entries.len(), CHANGES_PER_RANK, "up to the bound, nothing is dropped");
        assert_eq!(known(&mut changes, 1), SinceFleet { decode_started: CHANGES_PER_RANK as u64 - 1, ..ended(3) });
        // …and one more drops a chunk of the oldest: operations 2 to 2 + FORGET_CHUNK.
        changes.record(top, later, started(1));
        assert_eq!(changes.entries.len(), CHANGES_PER_RANK - FORGET_CHUNK);
        let last_forgotten = 2 + FORGET_CHUNK as u64;
        assert_eq!(changes.after(last_forgotten - 1), None, "sums without operation {last_forgotten} lack it");
        let kept = top - last_forgotten;
        assert_eq!(known(&mut changes, last_forgotten), started(kept), "the totals of the rest are exact");
        assert_eq!(known(&mut changes, top - 1), started(1));
        // The age rule follows the first entry the bound left, not the ones it dropped.
        let newest = later + Duration::from_millis(10);
        changes.record(top + 1, newest, started(1));
        changes.forget(later + CHANGE_MEMORY - Duration::from_millis(1));
        assert_eq!(changes.entries.len(), CHANGES_PER_RANK - FORGET_CHUNK + 1, "nothing is a memory old yet");
        changes.forget(later + CHANGE_MEMORY);
        assert_eq!(changes.entries.len(), 1, "all but the newest are a memory old");
        changes.forget(newest + CHANGE_MEMORY);
        assert!(changes.is_empty());
        changes.record(top + 2, newest + CHANGE_MEMORY, started(1));
        changes.forget(newest + CHANGE_MEMORY + Duration::from_millis(999));
        assert_eq!(changes.entries.len(), 1, "a change recorded into an empty memory is kept its whole memory");
    }
}
