//! `KvIndex`: applies a rank's stored / removed / cleared events to the tree under the ceilings.

use crate::hash::Mixer;
use crate::limits::Limits;
use crate::outcome::{KvResult, Outcome};
use crate::ranks::{RankKey, Ranks};
use crate::tree::{ROOT, Tree};

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
    /// Tree nodes, the root excluded (bounded by `Limits::max_blocks`).
    pub nodes: usize,
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
    pub(crate) tree: Tree,
    pub(crate) ranks: Ranks,
    pub(crate) mixer: Mixer,
    pub(crate) ownerships: usize,
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
        KvIndex { limits: limits.clamped(), tree: Tree::new(mixer), ranks: Ranks::default(), mixer, ownerships: 0 }
    }

    /// The ceilings this index enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Applies a `stored` event: `blocks` form a chain under `parent_hash` (an engine hash the
    /// rank already holds, or `None` for the root). See the crate documentation for results.
    pub fn apply_stored(&mut self, rank: RankKey, parent_hash: Option<u64>, blocks: &[StoredBlock]) -> Outcome {
        let mut outcome = Outcome::default();
        let mut id = self.ranks.id(rank);
        let parent = match parent_hash {
            None => Some(ROOT),
            Some(hash) => id.and_then(|id| self.ranks.get(id)?.node_of(&self.mixer, hash)),
        };
        let Some(mut parent) = parent else {
            outcome.add(KvResult::UnknownParent, blocks.len());
            return outcome;
        };
        for (i, block) in blocks.iter().enumerate() {
            match self.store_block(rank, &mut id, parent, block) {
                Ok((node, result)) => {
                    outcome.add(result, 1);
                    parent = node;
                }
                Err(Refused) => {
                    outcome.add(KvResult::OverCapacity, blocks.len() - i);
                    break;
                }
            }
        }
        outcome
    }

    /// Applies a `removed` event: the rank stops holding each of `block_hashes`.
    pub fn apply_removed(&mut self, rank: RankKey, block_hashes: &[u64]) -> Outcome {
        let mut outcome = Outcome::default();
        let Some(id) = self.ranks.id(rank) else {
            outcome.add(KvResult::UnknownBlock, block_hashes.len());
            return outcome;
        };
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
        for node in held.nodes() {
            // A node reached by several of the rank's hashes appears once per hash; only the
            // first removal finds the rank among its owners.
            self.tree.remove_owner(node, id);
        }
        self.ownerships -= held.len();
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
            nodes: self.tree.len(),
            ownerships: self.ownerships,
            ranks: self.ranks.len(),
            heap_bytes: size_of::<KvIndex>() + self.tree.heap_bytes() + self.ranks.heap_bytes(),
        }
    }

    fn store_block(
        &mut self,
        rank: RankKey,
        id: &mut Option<u32>,
        parent: u32,
        block: &StoredBlock,
    ) -> Result<(u32, KvResult), Refused> {
        let child = self.tree.child(parent, block.tokens_hash);
        let held = id.and_then(|id| self.ranks.get(id)?.node_of(&self.mixer, block.block_hash));
        if let Some(node) = child
            && held == Some(node)
        {
            return Ok((node, KvResult::Duplicate));
        }
        // Every ceiling is checked before anything changes, so a refusal leaves no trace.
        if held.is_none() {
            let rank_len = id.and_then(|id| self.ranks.get(id)).map_or(0, |r| r.len());
            if rank_len >= self.limits.max_blocks_per_rank || self.ownerships >= self.limits.max_ownerships {
                return Err(Refused);
            }
        }
        if child.is_none() && (self.tree.len() >= self.limits.max_blocks || self.limits.max_owners_per_node == 0) {
            return Err(Refused);
        }

        let rank_id = *id.get_or_insert_with(|| self.ranks.intern(rank));
        let node = child.unwrap_or_else(|| self.tree.add_child(parent, block.tokens_hash));
        // Last check, made while adding: the owners-per-node ceiling. A new node cannot be full.
        let Some(added) = self.tree.add_owner(node, rank_id, self.limits.max_owners_per_node) else {
            self.forget_if_empty(rank_id);
            return Err(Refused);
        };
        let Some(state) = self.ranks.get_mut(rank_id) else { return Err(Refused) };
        state.hold(&self.mixer, block.block_hash, node, held);
        if !added {
            // Another of the rank's hashes already names this node.
            state.add_extra_ref(node);
        }
        match held {
            // The hash moved to another prefix: release the old node only after the new one is
            // owned, so pruning the old chain cannot free the new node's ancestors.
            Some(old) => self.drop_reference(rank_id, old),
            None => self.ownerships += 1,
        }
        Ok((node, KvResult::Applied))
    }

    /// Releases a rank interned for a block that was then refused.
    fn forget_if_empty(&mut self, id: u32) {
        if self.ranks.get(id).is_some_and(|r| r.len() == 0) {
            self.ranks.take(id);
        }
    }

    /// Drops one of rank `id`'s references to `node`, and its ownership with the last one.
    fn drop_reference(&mut self, id: u32, node: u32) {
        let had_extra = self.ranks.get_mut(id).is_some_and(|r| r.drop_extra_ref(node));
        if !had_extra {
            self.tree.remove_owner(node, id);
        }
    }
}
