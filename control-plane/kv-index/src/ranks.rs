//! Ranks and what each holds: the lookup from a rank's engine block hashes to tree blocks.
//!
//! A `RankKey` is interned to a dense `u32` so owner lists stay 4 bytes an owner; ids of ranks
//! that hold nothing any more are released and reused. A rank's lookup is a table of 16-byte
//! entries (engine hash, block): see `lookup.rs`. Two engine hashes of one rank may name the same block (the same
//! tokens under another salt, or an engine that re-hashes); the rare extra references are
//! counted on the side so the common entry stays small.

use std::collections::{BTreeSet, HashMap};

use crate::hash::Mixer;
use crate::lookup::{Lookup, Probe};
use crate::tree::BlockRef;

/// One data-parallel rank of one worker: the unit that owns KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    /// The worker's instance id.
    pub worker_id: u64,
    /// The data-parallel rank within the worker (0 without data parallelism).
    pub dp_rank: u32,
}

#[derive(Debug)]
pub(crate) struct Rank {
    pub(crate) key: RankKey,
    held: Lookup,
    /// Blocks (by `BlockRef::key`) this rank reaches through more than one engine hash, and how
    /// many more.
    extra_refs: HashMap<u64, u32>,
}

impl Rank {
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn block_of(&self, mixer: &Mixer, block_hash: u64) -> Option<BlockRef> {
        self.held.get(mixer, block_hash)
    }

    /// Finds `block_hash` or where it would go: see [`Lookup::probe`].
    pub(crate) fn probe(&self, mixer: &Mixer, block_hash: u64) -> Probe {
        self.held.probe(mixer, block_hash)
    }

    /// Points `block_hash` at `block`, where `probe` (with no change since) said it goes.
    pub(crate) fn hold(&mut self, mixer: &Mixer, probe: Probe, block_hash: u64, block: BlockRef) {
        self.held.insert(mixer, probe, block_hash, block);
    }

    /// See [`Lookup::touch`].
    pub(crate) fn touch(&self, mixer: &Mixer, block_hashes: impl Iterator<Item = u64>) {
        self.held.touch(mixer, block_hashes);
    }

    pub(crate) fn release(&mut self, mixer: &Mixer, block_hash: u64) -> Option<BlockRef> {
        self.held.remove(mixer, block_hash)
    }

    pub(crate) fn add_extra_ref(&mut self, block: BlockRef) {
        *self.extra_refs.entry(block.key()).or_default() += 1;
    }

    /// Drops one extra reference to `block`; false when none was left (the rank's last
    /// reference).
    pub(crate) fn drop_extra_ref(&mut self, block: BlockRef) -> bool {
        if self.extra_refs.is_empty() {
            return false;
        }
        let Some(refs) = self.extra_refs.get_mut(&block.key()) else { return false };
        *refs -= 1;
        if *refs == 0 {
            self.extra_refs.remove(&block.key());
            // Like the lookup, the map gives back what it grew to once it is mostly empty.
            if self.extra_refs.len() * 8 < self.extra_refs.capacity() && self.extra_refs.capacity() > 64 {
                self.extra_refs.shrink_to(self.extra_refs.len() * 2);
            }
        }
        true
    }

    /// Drops every engine hash naming a block `dropped` accepts, and their extra references;
    /// how many hashes went.
    pub(crate) fn release_where(&mut self, mixer: &Mixer, dropped: impl Fn(BlockRef) -> bool) -> usize {
        let released = self.held.retain(mixer, |block| !dropped(block));
        if released > 0 && !self.extra_refs.is_empty() {
            self.extra_refs.retain(|key, _| !dropped(BlockRef::from_key(*key)));
        }
        released
    }

    /// The slots of its lookup (what a pass over it reads).
    pub(crate) fn lookup_slots(&self) -> usize {
        self.held.slots()
    }

    pub(crate) fn blocks(&self) -> impl Iterator<Item = BlockRef> + '_ {
        self.held.iter()
    }

    fn heap_bytes(&self) -> usize {
        self.held.heap_bytes() + self.extra_refs.capacity() * (size_of::<(u64, u32)>() + 1)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Ranks {
    ids: HashMap<RankKey, u32>,
    slots: Vec<Option<Rank>>,
    /// Released ids below the highest in use, the lowest handed out first: ids stay as dense
    /// as the ranks held now, not as the most ever held, so an owner set's bitset, and the
    /// bound a match walks, shrink back after a crowd of ranks leaves.
    free: BTreeSet<u32>,
}

impl Ranks {
    pub(crate) fn id(&self, key: RankKey) -> Option<u32> {
        self.ids.get(&key).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `key`, interning it if new. Ids are bounded by the ownership ceiling: a rank
    /// is interned only to hold a block and released when it holds none.
    pub(crate) fn intern(&mut self, key: RankKey) -> u32 {
        if let Some(id) = self.id(key) {
            return id;
        }
        let rank = Rank { key, held: Lookup::default(), extra_refs: HashMap::new() };
        let id = match self.free.pop_first() {
            Some(id) => {
                self.slots[id as usize] = Some(rank);
                id
            }
            None => {
                self.slots.push(Some(rank));
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        self.ids.insert(key, id);
        id
    }

    /// Forgets `id` and hands back what it held. Released ids at the top are let go whole.
    pub(crate) fn take(&mut self, id: u32) -> Option<Rank> {
        let rank = self.slots.get_mut(id as usize)?.take()?;
        self.ids.remove(&rank.key);
        self.free.insert(id);
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
            self.free.remove(&u32::try_from(self.slots.len()).unwrap_or(u32::MAX));
        }
        if self.slots.len() * 4 <= self.slots.capacity() && self.slots.capacity() > 64 {
            self.slots.shrink_to(self.slots.len() * 2);
        }
        Some(rank)
    }

    /// One more than the highest id in use (ids are dense, reused after release).
    pub(crate) fn id_bound(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn get(&self, id: u32) -> Option<&Rank> {
        self.slots.get(id as usize)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> Option<&mut Rank> {
        self.slots.get_mut(id as usize)?.as_mut()
    }

    pub(crate) fn key(&self, id: u32) -> Option<RankKey> {
        self.get(id).map(|r| r.key)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Rank)> {
        self.slots.iter().enumerate().filter_map(|(id, r)| Some((id as u32, r.as_ref()?)))
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.ids.capacity() * (size_of::<(RankKey, u32)>() + 1)
            + self.slots.capacity() * size_of::<Option<Rank>>()
            // A B-tree set's nodes hold up to 11 keys and their links: about twice its keys.
            + 2 * self.free.len() * size_of::<u32>()
            + self.iter().map(|(_, r)| r.heap_bytes()).sum::<usize>()
    }
}

#[cfg(test)]
impl Rank {
    pub(crate) fn extra_refs(&self, block: BlockRef) -> u32 {
        self.extra_refs.get(&block.key()).copied().unwrap_or(0)
    }

    pub(crate) fn extra_refs_total(&self) -> usize {
        self.extra_refs.values().map(|n| *n as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(worker_id: u64) -> RankKey {
        RankKey { worker_id, dp_rank: 0 }
    }

    /// Ids are handed out lowest first and the bound shrinks as the top ones go: after a crowd
    /// of ranks leaves, the next ranks take the low ids, not the crowd's highest.
    #[test]
    fn released_ids_are_reused_lowest_first_and_the_bound_shrinks_back() {
        let mut ranks = Ranks::default();
        let ids: Vec<u32> = (0..100).map(|w| ranks.intern(key(w))).collect();
        assert_eq!(ids, (0..100).collect::<Vec<u32>>());
        for id in [3, 7, 50] {
            assert!(ranks.take(id).is_some());
        }
        assert_eq!(ranks.id_bound(), 100, "ids below the top in use keep the bound");
        assert_eq!([ranks.intern(key(1000)), ranks.intern(key(1001))], [3, 7], "the lowest first");
        for id in (0..100).filter(|id| ![3, 7, 50].contains(id)) {
            ranks.take(id);
        }
        ranks.take(3);
        ranks.take(7);
        assert_eq!((ranks.id_bound(), ranks.len()), (0, 0), "every rank gone: no bound left");
        assert_eq!(ranks.intern(key(2000)), 0);
        assert_eq!(ranks.id_bound(), 1);
    }
}
