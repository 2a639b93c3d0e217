//! The blocks every rank's dispatches in flight hold, fleet-wide: written by the backlog book
//! as reports arrive, read by `FindMatches`.
//!
//! A request routed to a rank adds to that rank's active KV memory only the blocks no request
//! in flight there already holds. The book counts each rank's distinct blocks for its backlog;
//! this index lets `FindMatches` also say, per rank, how much of a new request's prefix those
//! requests share (Dynamo's router charges a worker's decode term with exactly these new
//! blocks: `ActiveSequences` overlap depth). A rank that merely caches the prefix still has to
//! make all of it active again, so the cached overlap alone would understate its cost.
//!
//! Bounded by the book: it holds at most [`MAX_ACTIVE_BLOCK_HASHES`] hashes in all, and a
//! rank's entry goes when its last block does.
//!
//! [`MAX_ACTIVE_BLOCK_HASHES`]: continuum_proto::active::MAX_ACTIVE_BLOCK_HASHES

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use continuum_kv_index::RankKey;
use continuum_proto::active::ActiveBlocks;
use continuum_proto::fast_hash::FastMap;

#[derive(Debug, Clone, Default)]
pub struct ActiveIndex {
    ranks: Arc<Mutex<FastMap<RankKey, ActiveBlocks>>>,
}

impl ActiveIndex {
    /// Adds a request of `blocks` blocks hashing to `hashes` on `rank`; returns how many
    /// blocks the rank's distinct total grew by (see [`ActiveBlocks::add`]).
    pub(super) fn add(&self, rank: RankKey, hashes: &[u64], blocks: u64) -> u64 {
        self.lock().entry(rank).or_default().add(hashes, blocks)
    }

    /// Removes a request added with the same arguments; returns how many blocks the rank's
    /// distinct total shrank by.
    pub(super) fn remove(&self, rank: RankKey, hashes: &[u64], blocks: u64) -> u64 {
        let mut ranks = self.lock();
        let Some(held) = ranks.get_mut(&rank) else { return 0 };
        let freed = held.remove(hashes, blocks);
        if held.is_empty() {
            ranks.remove(&rank);
        }
        freed
    }

    /// For each of `ranks`, how many leading blocks of `hashes`, up to its own count of them, its
    /// requests in flight hold. Looked up no further than that count (a rank's cached overlap:
    /// its active share is part of it), so a long query costs what the ranks hold of it, not
    /// its length once per rank under the index's lock.
    pub fn depths(&self, hashes: &[u64], ranks: impl IntoIterator<Item = (RankKey, u32)>) -> Vec<u32> {
        // Folded once, before the lock the book's reports take too; then a binary search a
        // rank, not a walk down its share of the chain.
        let ranks: Vec<(RankKey, u32)> = ranks.into_iter().collect();
        let deepest = ranks.iter().map(|(_, up_to)| *up_to as usize).max().unwrap_or(0).min(hashes.len());
        let folded: Vec<u64> = continuum_proto::active::prefix_hashes(&hashes[..deepest]).collect();
        let held = self.lock();
        ranks
            .into_iter()
            .map(|(rank, up_to)| {
                let prefix = folded.get(..up_to as usize).unwrap_or(&folded);
                held.get(&rank).map_or(0, |blocks| blocks.depth_of_folded(prefix))
            })
            .collect()
    }

    /// Forgets every rank's blocks, as the book does when it starts over.
    pub(super) fn clear(&self) {
        self.lock().clear();
    }

    /// Ranks with blocks in flight.
    #[cfg(test)]
    pub(super) fn ranks(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, FastMap<RankKey, ActiveBlocks>> {
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: RankKey = RankKey { worker_id: 1, dp_rank: 0 };
    const B: RankKey = RankKey { worker_id: 1, dp_rank: 1 };

    #[test]
    fn depths_are_per_rank_and_end_with_their_requests() {
        let index = ActiveIndex::default();
        assert_eq!(index.add(A, &[1, 2, 3], 4), 4);
        assert_eq!(index.add(B, &[1, 9], 2), 2);
        let other = RankKey { worker_id: 2, dp_rank: 0 };
        assert_eq!(index.depths(&[1, 2, 3, 4], [(A, 4), (B, 4), (other, 4)]), vec![3, 1, 0]);
        assert_eq!(index.depths(&[1, 2, 3, 4], [(A, 2), (B, 0)]), vec![2, 0], "no deeper than asked");
        assert_eq!(index.remove(A, &[1, 2, 3], 4), 4);
        assert_eq!(index.depths(&[1, 2], [(A, 2), (B, 2)]), vec![0, 1]);
        assert_eq!(index.ranks(), 1, "a rank with nothing in flight leaves the index");
        assert_eq!(index.remove(A, &[1, 2, 3], 4), 0, "a second removal frees nothing");
    }
}
