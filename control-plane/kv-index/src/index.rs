//! `KvIndex`: applies a rank's stored / removed / cleared events to the tree under the ceilings.

use crate::hash::Mixer;
use crate::limits::Limits;
use crate::lookup::Probe;
use crate::outcome::{KvResult, Outcome};
use crate::ranks::{RankKey, Ranks};
use crate::tree::{BlockRef, ROOT, Tree};

/// One block of a `stored` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's hash of the block (Dynamo's `ExternalSequenceBlockHash`): how later events
    /// of the same rank name it.
    pub block_hash: u64,
    /// The hash of the block's tokens (Dynamo's `LocalBlockHash`): the tree's key.
    pub tokens_hash: u64,
}

/// Sizes of the index, for metrics and the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Distinct prefix blocks in the tree (bounded by `Limits::max_blocks`).
    pub nodes: usize,
    /// Runs (path-compressed tree nodes) holding those blocks, the root excluded.
    pub runs: usize,
    /// `(rank, engine block hash)` ownerships (bounded by `Limits::max_ownerships`).
    pub ownerships: usize,
    /// Ranks holding at least one block.
    pub ranks: usize,
    /// Heap bytes the index holds, from the capacities of its tables and arenas (allocator
    /// overhead not included): within a few percent of what a counting allocator sees.
    pub heap_bytes: usize,
}

/// The bounded radix index of device-tier KV blocks per rank. See the crate documentation.
#[derive(Debug)]
pub struct KvIndex {
    pub(crate) limits: Limits,
    /// The blocks one rank may hold: [`Limits::max_blocks_per_rank`], or less once the index is
    /// shared among the fleet's ranks ([`KvIndex::share_among`]).
    pub(crate) rank_cap: usize,
    pub(crate) tree: Tree,
    pub(crate) ranks: Ranks,
    pub(crate) mixer: Mixer,
    pub(crate) ownerships: usize,
    /// What the index has done, in blocks' worth ([`KvIndex::work`]).
    work: u64,
}

/// Why one block could not be stored.
struct Refused;

impl Default for KvIndex {
    fn default() -> Self {
        KvIndex::new(Limits::SEED)
    }
}

impl KvIndex {
    /// An empty index enforcing `limits`.
    pub fn new(limits: Limits) -> KvIndex {
        let mixer = Mixer::random();
        let limits = limits.clamped();
        let rank_cap = limits.max_blocks_per_rank;
        KvIndex { limits, rank_cap, tree: Tree::new(mixer), ranks: Ranks::default(), mixer, ownerships: 0, work: 0 }
    }

    /// Shares the index among the fleet's `ranks`: each may hold at most an equal share of its
    /// blocks (nor more than [`Limits::max_blocks_per_rank`]). Without it a few ranks caching a
    /// great deal would fill the index, and every other rank's blocks would be refused for as
    /// long as they stayed: no overlap for them, however much of a prompt they hold. The shares
    /// add up to no more than the index however many ranks there are (a floor under them would
    /// let the first ranks of a fleet past its size fill it). A rank past a new, smaller share
    /// keeps what it holds and adds nothing until its evictions bring it under.
    pub fn share_among(&mut self, ranks: usize) {
        let share = self.limits.max_blocks.checked_div(ranks).unwrap_or(usize::MAX);
        self.rank_cap = share.min(self.limits.max_blocks_per_rank);
    }

    /// The ceilings this index enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The blocks one rank may hold now ([`KvIndex::share_among`]).
    pub fn rank_share(&self) -> usize {
        self.rank_cap
    }

    /// A running count of the work the events applied so far took, in blocks' worth: the
    /// blocks they named, those a clear dropped, and what dropping orphans' subtrees took
    /// (their blocks, and a pass over each owner's lookup). For a caller bounding what it
    /// applies under one hold of a lock: what an event costs is not always what it names.
    pub fn work(&self) -> u64 {
        self.work
    }

    /// Applies a `stored` event: `blocks` form a chain under `parent_hash` (an engine hash the
    /// rank already holds, or `None` for the root). See the crate documentation for results.
    pub fn apply_stored(&mut self, rank: RankKey, parent_hash: Option<u64>, blocks: &[StoredBlock]) -> Outcome {
        let outcome = self.apply_stored_part(rank, parent_hash, blocks);
        self.drop_orphans();
        outcome
    }

    /// [`KvIndex::apply_stored`] for one part of an event applied in parts: a block its moves
    /// leave without owners keeps what lies under it until the event's last part has been
    /// applied and [`KvIndex::drop_orphans`] called, so the parts end as the whole event would
    /// (an event applied in between may drop them first: the tree ends the same, only the
    /// results of the later parts' blocks under them differ).
    pub fn apply_stored_part(&mut self, rank: RankKey, parent_hash: Option<u64>, blocks: &[StoredBlock]) -> Outcome {
        self.work += blocks.len() as u64;
        let mut outcome = Outcome::default();
        let mut id = self.ranks.id(rank);
        let at = match parent_hash {
            None => Some(Position { run: ROOT, end: 0 }),
            Some(hash) => id.and_then(|id| self.ranks.get(id)?.block_of(&self.mixer, hash)).map(|b| self.position(b)),
        };
        let Some(at) = at else {
            outcome.add(KvResult::UnknownParent, blocks.len());
            return outcome;
        };
        if let Some(rank) = id.and_then(|id| self.ranks.get(id)) {
            rank.touch(&self.mixer, blocks.iter().map(|b| b.block_hash));
        }
        let mut walk = Walk { at, pending: None };
        let mut i = 0;
        while let Some(block) = blocks.get(i) {
            if let Some(rank_id) = id {
                let taken = match walk.pending {
                    None => self.extend_leaf(rank_id, &mut walk, &blocks[i..]),
                    Some(_) => self.take_shared(rank_id, &mut walk, &blocks[i..]),
                };
                if taken > 0 {
                    outcome.add(KvResult::Applied, taken);
                    i += taken;
                    continue;
                }
            }
            match self.store_block(rank, &mut id, &mut walk, block, blocks.len() - i) {
                Ok(result) => {
                    outcome.add(result, 1);
                    i += 1;
                }
                Err(Refused) => {
                    outcome.add(KvResult::OverCapacity, blocks.len() - i);
                    // A segment started for this chain made room for all of it.
                    self.tree.trim(walk.at.run);
                    break;
                }
            }
        }
        if let Some(id) = id {
            self.commit(&mut walk, id);
        }
        outcome
    }

    /// Applies a `removed` event: the rank stops holding each of `block_hashes`.
    pub fn apply_removed(&mut self, rank: RankKey, block_hashes: &[u64]) -> Outcome {
        let outcome = self.apply_removed_part(rank, block_hashes);
        // It forgets every owner it leaves holding nothing.
        self.drop_orphans();
        outcome
    }

    /// [`KvIndex::apply_removed`] for one part of an event applied in parts: see
    /// [`KvIndex::apply_stored_part`].
    pub fn apply_removed_part(&mut self, rank: RankKey, block_hashes: &[u64]) -> Outcome {
        self.work += block_hashes.len() as u64;
        let mut outcome = Outcome::default();
        let Some(id) = self.ranks.id(rank) else {
            outcome.add(KvResult::UnknownBlock, block_hashes.len());
            return outcome;
        };
        if let Some(rank) = self.ranks.get(id) {
            rank.touch(&self.mixer, block_hashes.iter().copied());
        }
        for &hash in block_hashes {
            let released = self.ranks.get_mut(id).and_then(|r| r.release(&self.mixer, hash));
            match released {
                Some(node) => {
                    self.ownerships -= 1;
                    self.drop_reference(id, node);
                    outcome.add(KvResult::Applied, 1);
                }
                None => outcome.add(KvResult::UnknownBlock, 1),
            }
        }
        self.forget_if_empty(id);
        outcome
    }

    /// Drops every block `rank` holds (a `cleared` event, a gap, a departed rank). Returns how
    /// many ownerships were dropped.
    pub fn clear_rank(&mut self, rank: RankKey) -> usize {
        let Some(held) = self.ranks.id(rank).and_then(|id| Some((id, self.ranks.take(id)?))) else {
            return 0;
        };
        let (id, held) = held;
        // The rank owns every block of each run it holds one of, and loses them all: drop it
        // from each run once. Runs are found before any is freed (a freed run's segment may be
        // truncated), and none is freed before its turn since the rank still owns it.
        let mut runs: Vec<u32> = held.blocks().map(|block| self.tree.locate(block).0).collect();
        runs.sort_unstable();
        runs.dedup();
        for run in runs {
            self.tree.remove_owner(run, id);
        }
        self.ownerships -= held.len();
        self.work += held.len() as u64;
        self.drop_orphans();
        held.len()
    }

    /// Clears every rank for which `keep` returns false. Returns how many ranks were cleared.
    pub fn retain_ranks(&mut self, mut keep: impl FnMut(RankKey) -> bool) -> usize {
        let gone: Vec<RankKey> = self.ranks.iter().map(|(_, r)| r.key).filter(|k| !keep(*k)).collect();
        for rank in &gone {
            self.clear_rank(*rank);
        }
        gone.len()
    }

    /// Blocks (engine hashes) `rank` holds.
    pub fn rank_blocks(&self, rank: RankKey) -> usize {
        self.ranks.id(rank).and_then(|id| self.ranks.get(id)).map_or(0, |r| r.len())
    }

    /// The ranks holding at least one block, in no particular order.
    pub fn ranks(&self) -> impl Iterator<Item = RankKey> + '_ {
        self.ranks.iter().map(|(_, r)| r.key)
    }

    /// Current sizes.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            nodes: self.tree.blocks(),
            runs: self.tree.runs(),
            ownerships: self.ownerships,
            ranks: self.ranks.len(),
            heap_bytes: size_of::<KvIndex>() + self.tree.heap_bytes() + self.ranks.heap_bytes(),
        }
    }

    /// The position just after `block`.
    fn position(&self, block: BlockRef) -> Position {
        let (run, index) = self.tree.locate(block);
        Position { run, end: index + 1 }
    }

    /// Stores one block of a chain at the walk's position and advances it; `left` counts this
    /// block and the rest of the chain (a new segment makes room for them).
    fn store_block(
        &mut self,
        rank: RankKey,
        id: &mut Option<u32>,
        walk: &mut Walk,
        block: &StoredBlock,
        left: usize,
    ) -> Result<KvResult, Refused> {
        let Position { run, end } = walk.at;
        let tokens_hash = block.tokens_hash;
        // Where the block already is in the tree: next in the current run, or a child run.
        let target = if end < self.tree.len(run) {
            (self.tree.hash_at(run, end) == tokens_hash).then_some(Position { run, end: end + 1 })
        } else {
            self.tree.child(run, tokens_hash).map(|child| Position { run: child, end: 1 })
        };
        let probe = match *id {
            Some(id) => self.ranks.get(id).map(|r| r.probe(&self.mixer, block.block_hash)),
            None => None,
        };
        let held = match probe {
            Some(Probe::Found(_, block)) => Some(block),
            _ => None,
        };
        let target_block = target.map(|t| self.tree.block_ref(t.run, t.end - 1));
        if let Some(t) = target
            && held.is_some()
            && held == target_block
        {
            // The rank owns the target's run, so no range of it is pending.
            if t.run != run
                && let Some(id) = *id
            {
                self.commit(walk, id);
            }
            walk.at = t;
            return Ok(KvResult::Duplicate);
        }
        // Every ceiling is checked before anything changes, so a refusal leaves no trace.
        if held.is_none() {
            let rank_len = id.and_then(|id| self.ranks.get(id)).map_or(0, |r| r.len());
            if rank_len >= self.rank_cap || self.ownerships >= self.limits.max_ownerships {
                return Err(Refused);
            }
        }
        match target {
            None if self.tree.blocks() >= self.limits.max_blocks || self.limits.max_owners_per_node == 0 => {
                return Err(Refused);
            }
            Some(t) if !(t.run == run && walk.pending.is_some()) => {
                let owners = self.tree.owners(t.run);
                let owner = id.is_some_and(|id| owners.contains(id));
                if !owner && owners.len() >= self.limits.max_owners_per_node {
                    return Err(Refused);
                }
            }
            _ => {}
        }

        let rank_id = *id.get_or_insert_with(|| self.ranks.intern(rank));
        let moved = held.is_some();
        let stored = match (target, target_block) {
            (Some(mut t), Some(stored)) => {
                if t.run != run || moved {
                    // Leaving the run (or about to release a block): own its pending range now.
                    self.commit(walk, rank_id);
                }
                if moved {
                    // The commit may have split the target's run: find it by its stable identity.
                    t = self.position(stored);
                }
                walk.at = t;
                if self.tree.owners(t.run).contains(rank_id) {
                    // Another of the rank's hashes already names this block.
                    if let Some(state) = self.ranks.get_mut(rank_id) {
                        state.add_extra_ref(stored);
                    }
                } else if walk.pending.is_none() {
                    walk.pending = Some(t.end - 1);
                }
                if moved {
                    self.commit(walk, rank_id);
                }
                stored
            }
            _ => {
                self.commit(walk, rank_id);
                let Position { run, end } = walk.at;
                if end == self.tree.len(run) && self.tree.try_extend(run, rank_id, tokens_hash) {
                    walk.at.end += 1;
                } else {
                    let parent = if end < self.tree.len(run) { self.tree.split(run, end) } else { run };
                    let child = self.tree.add_run(parent, tokens_hash, left, rank_id);
                    walk.at = Position { run: child, end: 1 };
                }
                self.tree.block_ref(walk.at.run, walk.at.end - 1)
            }
        };
        let Some(state) = self.ranks.get_mut(rank_id) else { return Err(Refused) };
        // The probe is still good: only the tree and the extra references changed since.
        let probe = match probe {
            Some(probe) => probe,
            None => state.probe(&self.mixer, block.block_hash),
        };
        state.hold(&self.mixer, probe, block.block_hash, stored);
        match held {
            // The hash moved to another prefix: release the old block only after the new one is
            // owned, so pruning the old chain cannot free the new block's ancestors; then find
            // the walk's position again, as releasing may have split its run.
            Some(old) => {
                self.drop_reference(rank_id, old);
                walk.at = self.position(stored);
            }
            None => self.ownerships += 1,
        }
        Ok(KvResult::Applied)
    }

    /// The common case of a stored chain, done block after block without the general checks:
    /// the walk is at the end of a leaf run rank `id` alone owns and the blocks are new to the
    /// rank, so each one only appends to the run and to the rank's lookup. Stops (returning how
    /// many it stored) at the first block that needs more: one the rank holds, or a ceiling.
    fn extend_leaf(&mut self, id: u32, walk: &mut Walk, blocks: &[StoredBlock]) -> usize {
        let Some(state) = self.ranks.get_mut(id) else { return 0 };
        let mut stored = 0;
        for block in blocks {
            let Position { run, end } = walk.at;
            if end != self.tree.len(run)
                || state.len() >= self.rank_cap
                || self.ownerships >= self.limits.max_ownerships
                || self.tree.blocks() >= self.limits.max_blocks
            {
                break;
            }
            let probe = state.probe(&self.mixer, block.block_hash);
            if matches!(probe, Probe::Found(..)) || !self.tree.try_extend(run, id, block.tokens_hash) {
                break;
            }
            state.hold(&self.mixer, probe, block.block_hash, self.tree.block_ref(run, end));
            self.ownerships += 1;
            walk.at.end += 1;
            stored += 1;
        }
        stored
    }

    /// The other common case, done the same way: the walk is inside a run another rank owns
    /// (a shared prefix) and has begun taking it, so each next block the chain shares with the
    /// run, new to the rank, only extends the pending range and the rank's lookup.
    fn take_shared(&mut self, id: u32, walk: &mut Walk, blocks: &[StoredBlock]) -> usize {
        let Some(state) = self.ranks.get_mut(id) else { return 0 };
        let run = walk.at.run;
        let hashes = self.tree.hashes(run);
        let mut taken = 0;
        for block in blocks {
            let end = walk.at.end;
            if hashes.get(end as usize) != Some(&block.tokens_hash)
                || state.len() >= self.rank_cap
                || self.ownerships >= self.limits.max_ownerships
            {
                break;
            }
            let probe = state.probe(&self.mixer, block.block_hash);
            if matches!(probe, Probe::Found(..)) {
                break;
            }
            state.hold(&self.mixer, probe, block.block_hash, self.tree.block_ref(run, end));
            self.ownerships += 1;
            walk.at.end += 1;
            taken += 1;
        }
        taken
    }

    /// Makes rank `id` an owner of the walk's pending range (blocks it took in the current run,
    /// which it did not own), splitting the run so the range is a run of its own.
    fn commit(&mut self, walk: &mut Walk, id: u32) {
        if let Some(from) = walk.pending.take() {
            let run = self.tree.add_owner_range(walk.at.run, from, walk.at.end, id);
            walk.at = Position { run, end: self.tree.len(run) };
        }
    }

    /// Drops what lies under each block left without owners while it had descendants, for every
    /// rank holding any of it, as Dynamo's router does (its `children.clear()` when a block's
    /// last worker goes): no match can reach past a block no rank holds, and kept, such a block
    /// would be owned and counted by no rank, so a rank that removed the heads of its chains
    /// while storing under their tails could fill the index past its share. The engine hashes
    /// naming what was dropped are unknown from then on (later events naming them count
    /// `unknown_parent` or `unknown_block`), as to Dynamo's router they lead nowhere.
    pub fn drop_orphans(&mut self) {
        for orphan in self.tree.take_orphans() {
            let below = self.tree.descendants(orphan);
            // The dropped blocks, by segment: one range of each, since a segment's runs form a
            // chain and so the subtree holds all of a segment's runs from its first one there.
            let mut dropped: std::collections::HashMap<u32, std::ops::Range<u32>> = std::collections::HashMap::new();
            let mut owners: Vec<u32> = Vec::new();
            for &run in &below {
                let (segment, offsets) = self.tree.blocks_of(run);
                self.work += offsets.len() as u64;
                let range = dropped.entry(segment).or_insert(offsets.clone());
                *range = range.start.min(offsets.start)..range.end.max(offsets.end);
                self.tree.owners(run).for_each(|owner| owners.push(owner));
            }
            owners.sort_unstable();
            owners.dedup();
            let is_dropped =
                |block: BlockRef| dropped.get(&block.segment).is_some_and(|range| range.contains(&block.offset));
            for owner in owners {
                let Some(rank) = self.ranks.get_mut(owner) else { continue };
                // A pass over its lookup's slots: some 16 of them a block's worth.
                self.work += (rank.lookup_slots() / 16) as u64;
                self.ownerships -= rank.release_where(&self.mixer, is_dropped);
                self.forget_if_empty(owner);
            }
            self.tree.free_subtree(orphan, &below);
        }
    }

    /// Releases a rank interned for a block that was then refused.
    fn forget_if_empty(&mut self, id: u32) {
        if self.ranks.get(id).is_some_and(|r| r.len() == 0) {
            self.ranks.take(id);
        }
    }

    /// Drops one of rank `id`'s references to `block`, and its ownership with the last one.
    fn drop_reference(&mut self, id: u32, block: BlockRef) {
        let had_extra = self.ranks.get_mut(id).is_some_and(|r| r.drop_extra_ref(block));
        if !had_extra {
            self.tree.remove_block_owner(block, id);
        }
    }
}

/// A place in the tree: just after the first `end` blocks of `run`.
#[derive(Debug, Clone, Copy)]
struct Position {
    run: u32,
    end: u32,
}

/// A stored chain's walk: where it is, and from which block of the current run the rank takes
/// ownership (it did not own the run). Owners are per run, so those blocks become owned in one
/// step when the walk leaves the run ([`KvIndex::commit`]) rather than one block at a time.
struct Walk {
    at: Position,
    pending: Option<u32>,
}
