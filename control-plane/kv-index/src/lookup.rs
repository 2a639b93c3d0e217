//! One rank's lookup from engine block hash to block: an open-addressing table with linear
//! probing and the entries inline.
//!
//! Every stored block costs one probe of its rank's lookup, and the tables together are far
//! larger than the caches, so that probe is the index's hottest cache miss. A table with separate
//! control bytes (hashbrown) touches two cache lines per probe (the control group, then the
//! entry); here the probe reads the 16-byte entries themselves, so a miss or an insert usually
//! touches one line, and a removal shifts its cluster back instead of leaving tombstones. The
//! keys come from the fleet but are spread by the index's keyed mixer, so a worker cannot build
//! long clusters without knowing the seed.

use crate::hash::Mixer;
use crate::tree::BlockRef;

/// Marks an empty slot: no live segment has this id (arena ids stay below `u32::MAX`).
const EMPTY: u32 = u32::MAX;
const MIN_SLOTS: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Slot {
    block_hash: u64,
    block: BlockRef,
}

const VACANT: Slot = Slot { block_hash: 0, block: BlockRef { segment: EMPTY, offset: 0 } };

impl Slot {
    #[inline]
    fn is_empty(&self) -> bool {
        self.block.segment == EMPTY
    }
}

#[derive(Debug, Default)]
pub(crate) struct Lookup {
    /// A power of two in length (or empty), at most three quarters full.
    slots: Vec<Slot>,
    len: usize,
}

/// Where a probe ended: the entry for the hash, or the empty slot where it would go.
pub(crate) enum Probe {
    Found(usize, BlockRef),
    Vacant(usize),
}

impl Lookup {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn home(&self, mixer: &Mixer, block_hash: u64) -> usize {
        (mixer.one(block_hash) as usize) & (self.slots.len() - 1)
    }

    #[inline]
    pub(crate) fn get(&self, mixer: &Mixer, block_hash: u64) -> Option<BlockRef> {
        match self.probe(mixer, block_hash) {
            Probe::Found(_, block) => Some(block),
            Probe::Vacant(_) => None,
        }
    }

    /// Finds `block_hash`, or the slot where it would go, so [`Lookup::insert`] need not probe
    /// again.
    #[inline]
    pub(crate) fn probe(&self, mixer: &Mixer, block_hash: u64) -> Probe {
        if self.slots.is_empty() {
            return Probe::Vacant(usize::MAX);
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(mixer, block_hash);
        loop {
            let slot = &self.slots[i];
            if slot.is_empty() {
                return Probe::Vacant(i);
            }
            if slot.block_hash == block_hash {
                return Probe::Found(i, slot.block);
            }
            i = (i + 1) & mask;
        }
    }

    /// Points `block_hash` at `block`; `probe` is what [`Lookup::probe`] said, with no change
    /// to the table since.
    #[inline]
    pub(crate) fn insert(&mut self, mixer: &Mixer, probe: Probe, block_hash: u64, block: BlockRef) {
        let index = match probe {
            Probe::Found(index, _) => {
                self.slots[index].block = block;
                return;
            }
            Probe::Vacant(_) if (self.len + 1) * 4 > self.slots.len() * 3 => {
                self.grow(mixer);
                match self.probe(mixer, block_hash) {
                    Probe::Vacant(index) | Probe::Found(index, _) => index,
                }
            }
            Probe::Vacant(index) => index,
        };
        self.slots[index] = Slot { block_hash, block };
        self.len += 1;
    }

    /// Reads the home slot of each hash, so the probes that follow find them cached: the loads
    /// are independent, so the core overlaps their misses instead of taking them one by one.
    pub(crate) fn touch(&self, mixer: &Mixer, block_hashes: impl Iterator<Item = u64>) {
        if self.slots.is_empty() {
            return;
        }
        let mut sum = 0u64;
        for block_hash in block_hashes {
            sum ^= self.slots[self.home(mixer, block_hash)].block_hash;
        }
        std::hint::black_box(sum);
    }

    pub(crate) fn remove(&mut self, mixer: &Mixer, block_hash: u64) -> Option<BlockRef> {
        let Probe::Found(mut hole, block) = self.probe(mixer, block_hash) else { return None };
        self.len -= 1;
        // Backward shift: pull later entries of the cluster into the hole when their home slot
        // allows it, so probes never need tombstones.
        let mask = self.slots.len() - 1;
        let mut next = hole;
        loop {
            next = (next + 1) & mask;
            let slot = self.slots[next];
            if slot.is_empty() {
                break;
            }
            let home = self.home(mixer, slot.block_hash);
            // The entry at `next` may move to `hole` unless its home lies cyclically in (hole, next].
            let stays = if hole <= next { hole < home && home <= next } else { hole < home || home <= next };
            if !stays {
                self.slots[hole] = slot;
                hole = next;
            }
        }
        self.slots[hole] = VACANT;
        // A table an eighth full gives back what it grew to: a rank that once held many blocks
        // and now holds few keeps no more than twice its entries. Growth waits for three
        // quarters full, so a rank moving around either bound does not resize on every change.
        if self.len * 8 < self.slots.len() && self.slots.len() > MIN_SLOTS {
            self.resize(mixer, (self.len * 2).next_power_of_two().max(MIN_SLOTS));
        }
        Some(block)
    }

    /// Keeps the entries whose block `keep` accepts; how many it dropped. One pass over the
    /// table and one rebuild of it: for dropping many entries at once.
    pub(crate) fn retain(&mut self, mixer: &Mixer, mut keep: impl FnMut(BlockRef) -> bool) -> usize {
        let before = self.len;
        let kept: Vec<Slot> = self.slots.iter().filter(|s| !s.is_empty() && keep(s.block)).copied().collect();
        if kept.len() == before {
            return 0;
        }
        self.len = kept.len();
        let slots = (self.len * 2).next_power_of_two().max(MIN_SLOTS).min(self.slots.len());
        self.slots = vec![VACANT; slots];
        let mask = slots - 1;
        for slot in kept {
            let mut i = self.home(mixer, slot.block_hash);
            while !self.slots[i].is_empty() {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
        }
        before - self.len
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockRef> + '_ {
        self.slots.iter().filter(|s| !s.is_empty()).map(|s| s.block)
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * size_of::<Slot>()
    }

    fn grow(&mut self, mixer: &Mixer) {
        self.resize(mixer, (self.slots.len() * 2).max(MIN_SLOTS));
    }

    /// Moves every entry into a table of `slots` (a power of two, more than `len`).
    fn resize(&mut self, mixer: &Mixer, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![VACANT; slots]);
        let mask = slots - 1;
        for slot in old.into_iter().filter(|s| !s.is_empty()) {
            let mut i = self.home(mixer, slot.block_hash);
            while !self.slots[i].is_empty() {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Inserts and removals of a few colliding keys agree with a `HashMap`.
        #[test]
        fn agrees_with_a_map(ops in prop::collection::vec((any::<bool>(), 0u64..40), 0..300)) {
            let mixer = Mixer::random();
            let mut table = Lookup::default();
            let mut model = HashMap::new();
            for (n, (insert, key)) in ops.into_iter().enumerate() {
                let block = BlockRef { segment: n as u32, offset: 0 };
                if insert {
                    table.insert(&mixer, table.probe(&mixer, key), key, block);
                    model.insert(key, block);
                } else {
                    prop_assert_eq!(table.remove(&mixer, key), model.remove(&key));
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert!(table.len() * 4 <= table.slots.len() * 3, "at most three quarters full");
                for k in 0..40 {
                    prop_assert_eq!(table.get(&mixer, k), model.get(&k).copied());
                }
            }
        }
    }

    #[test]
    fn a_table_emptied_of_most_entries_gives_back_its_slots() {
        let mixer = Mixer::random();
        let mut table = Lookup::default();
        for key in 0..100_000u64 {
            table.insert(&mixer, table.probe(&mixer, key), key, BlockRef { segment: key as u32, offset: 0 });
        }
        let grown = table.heap_bytes();
        for key in 1..100_000u64 {
            assert!(table.remove(&mixer, key).is_some());
        }
        assert_eq!(table.get(&mixer, 0), Some(BlockRef { segment: 0, offset: 0 }), "the entry left is still found");
        assert_eq!(table.len(), 1);
        assert_eq!(table.heap_bytes(), MIN_SLOTS * size_of::<Slot>(), "{grown} bytes while full");
    }
}
