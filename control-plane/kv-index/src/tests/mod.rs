//! Behaviour of the index: examples for each rule and ceiling, and a property test against a
//! naive model (`model.rs`).

mod cases;
mod model;

use std::collections::HashMap;

use crate::tree::BlockRef;
use crate::{KvIndex, Limits, RankKey, StoredBlock};

pub(crate) fn rank(worker_id: u64) -> RankKey {
    RankKey { worker_id, dp_rank: 0 }
}

/// A chain whose engine hash is derived from the tokens hash, as real engines' sequence hashes are.
pub(crate) fn chain(tokens: &[u64]) -> Vec<StoredBlock> {
    tokens.iter().map(|&t| StoredBlock { block_hash: engine(t), tokens_hash: t }).collect()
}

pub(crate) fn engine(tokens_hash: u64) -> u64 {
    tokens_hash.wrapping_mul(31).wrapping_add(7)
}

pub(crate) fn tiny(max_blocks: usize, per_rank: usize, ownerships: usize, owners: usize) -> Limits {
    Limits { max_blocks, max_blocks_per_rank: per_rank, max_ownerships: ownerships, max_owners_per_node: owners }
}

pub(crate) fn sorted(index: &KvIndex, query: &[u64]) -> Vec<(RankKey, u32)> {
    let mut scores = index.find_matches(query).into_vec();
    scores.sort();
    scores
}

impl KvIndex {
    /// Asserts every structural invariant: the tree's own (see `Tree::check`), every owner of a
    /// node holds a hash naming it and every held hash names a node it owns, reference counts
    /// match, ownerships equal the sum of the ranks' lookups, no ceiling is exceeded, and the
    /// matches come out in ascending score order.
    pub(crate) fn check_invariants(&self) {
        let live = self.tree.check();
        let mut refs: HashMap<(u32, BlockRef), u32> = HashMap::new();
        let mut total = 0;
        for (id, r) in self.ranks.iter() {
            assert!(r.len() > 0, "empty rank kept");
            assert!(r.len() <= self.limits.max_blocks_per_rank);
            assert_eq!(self.ranks.id(r.key), Some(id));
            total += r.len();
            for block in r.blocks() {
                *refs.entry((id, block)).or_default() += 1;
            }
            let extra: usize = refs.iter().filter(|((i, _), _)| *i == id).map(|(_, n)| (*n - 1) as usize).sum();
            assert_eq!(extra, r.extra_refs_total(), "extra refs of rank {id}");
        }
        assert_eq!(total, self.ownerships);
        assert_eq!(self.ranks.len(), self.ranks.iter().count());
        let mut owned = 0;
        for (block, owners) in &live {
            assert!(owners.len() <= self.limits.max_owners_per_node);
            for id in owners {
                let n = refs.get(&(*id, *block)).copied().unwrap_or(0);
                assert!(n > 0, "rank {id} owns block {block:?} through no hash");
                let rank = self.ranks.get(*id).map(|r| r.extra_refs(*block));
                assert_eq!(rank, Some(n - 1));
                owned += 1;
            }
        }
        assert_eq!(owned, refs.len(), "a held hash names a node its rank does not own");
        let stats = self.stats();
        assert_eq!(stats.nodes, live.len());
        assert!(stats.nodes <= self.limits.max_blocks);
        assert!(stats.ownerships <= self.limits.max_ownerships);
    }
}
