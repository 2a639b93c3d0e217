//! The KV blocks a rank's requests in flight hold, the way Dynamo's KV router counts them
//! (`ActiveSequences`): a block that several requests share (a common system prompt, earlier
//! turns of one conversation) counts once, and keeps counting until the last request holding
//! it ends.
//!
//! Counting each request's blocks separately overstates a rank serving one prefix many times;
//! counting only the blocks a rank did not already cache understates a rank serving many
//! prefixes it cached earlier, which then looks idle while every request lands on it. Both
//! planes keep this same count: the control plane over the whole fleet's dispatches, each
//! replica over its own until the fleet's sum catches up.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Block hashes held for deduplication at once, by the control plane's book and by each
/// replica's ledger. A dispatch that would pass it counts its blocks without deduplication
/// (an overstatement, never a loss), so a flood of long prompts cannot grow memory.
pub const MAX_ACTIVE_BLOCK_HASHES: usize = 1 << 22;

/// One rank's blocks in flight.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActiveBlocks {
    /// Each hashed block, by its [`prefix_hashes`] key, with how many requests in flight hold
    /// it. The keys follow prompts a client can steer, so the map keeps std's keyed hasher
    /// rather than using them as their own hash.
    refs: HashMap<u64, u32>,
    /// Blocks of requests in flight that have no hash: a prompt's partial last block, a chain
    /// cut at its bound, a dispatch reported without its chain.
    unhashed: u64,
}

impl ActiveBlocks {
    /// Adds a request of `blocks` blocks whose leading blocks hash to `hashes` (a prompt's
    /// prefix chain; hashes past `blocks` are not the request's); returns how many blocks the
    /// rank's total grew by.
    pub fn add(&mut self, hashes: &[u64], blocks: u64) -> u64 {
        let (hashes, unhashed) = split(hashes, blocks);
        let mut added = 0;
        for key in prefix_hashes(hashes) {
            let refs = self.refs.entry(key).or_insert(0);
            added += u64::from(*refs == 0);
            *refs = refs.saturating_add(1);
        }
        self.unhashed = self.unhashed.saturating_add(unhashed);
        added + unhashed
    }

    /// Removes a request added with the same `hashes` and `blocks`; returns how many blocks
    /// the rank's total shrank by (those no other request in flight holds).
    pub fn remove(&mut self, hashes: &[u64], blocks: u64) -> u64 {
        let (hashes, unhashed) = split(hashes, blocks);
        let mut freed = 0;
        for key in prefix_hashes(hashes) {
            if let Some(refs) = self.refs.get_mut(&key) {
                *refs -= 1;
                if *refs == 0 {
                    self.refs.remove(&key);
                    freed += 1;
                }
            }
        }
        crate::fast_hash::shrink_when_sparse(&mut self.refs);
        let unhashed = unhashed.min(self.unhashed);
        self.unhashed -= unhashed;
        freed + unhashed
    }

    /// How many leading blocks of a prompt hashing to `hashes` are held: the blocks a request
    /// for it would share with the requests in flight instead of adding (Dynamo's
    /// `ActiveSequences` overlap depth).
    pub fn depth(&self, hashes: &[u64]) -> u32 {
        let held = prefix_hashes(hashes).take_while(|key| self.refs.contains_key(key)).count();
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    /// [`Self::depth`] of a prompt whose chain is already folded ([`prefix_hashes`]): a
    /// caller asking for many ranks folds it once. A binary search, since the blocks held are
    /// closed under prefixes (a request adds every leading block of its chain), so whether a
    /// fold is held goes from true to false once along a chain.
    pub fn depth_of_folded(&self, folded: &[u64]) -> u32 {
        let held = folded.partition_point(|key| self.refs.contains_key(key));
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    /// Distinct blocks held.
    pub fn total(&self) -> u64 {
        (self.refs.len() as u64).saturating_add(self.unhashed)
    }

    /// Hashes held (what [`MAX_ACTIVE_BLOCK_HASHES`] bounds).
    pub fn hashes(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }
}

/// Each block hash of a prompt's chain folded with all before it. A block hash alone (Dynamo's
/// `tokens_hash`) names a block's tokens, not its place: a block repeated within a prompt, or
/// the same text at another place in another prompt, would count as one block held. Two
/// chains' folds agree at a position exactly when the chains agree up to it (but for a 2^-64
/// chance).
pub fn prefix_hashes(hashes: &[u64]) -> impl Iterator<Item = u64> + '_ {
    hashes.iter().scan(0, |folded, hash| {
        *folded = xxh3_64_with_seed(&hash.to_le_bytes(), *folded);
        Some(*folded)
    })
}

/// A request's hashed blocks and how many more it has.
fn split(hashes: &[u64], blocks: u64) -> (&[u64], u64) {
    let hashed = hashes.get(..usize::try_from(blocks).unwrap_or(usize::MAX)).unwrap_or(hashes);
    (hashed, blocks - hashed.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_whose_long_requests_ended_gives_their_room_back() {
        let mut rank = ActiveBlocks::default();
        let long: Vec<u64> = (0..100_000).collect();
        rank.add(&long, 100_000);
        rank.add(&[7], 1);
        rank.remove(&long, 100_000);
        assert_eq!(rank.total(), 1);
        assert!(rank.refs.capacity() <= 2048, "room for {} hashes kept", rank.refs.capacity());
    }

    #[test]
    fn a_shared_prefix_counts_once_until_its_last_holder_ends() {
        let mut rank = ActiveBlocks::default();
        // Two turns of one conversation: 3 blocks shared, the second adds 2 hashed + 1 partial.
        assert_eq!(rank.add(&[1, 2, 3], 4), 4, "3 hashed blocks and a partial one");
        assert_eq!(rank.add(&[1, 2, 3, 4, 5], 6), 3, "only blocks 4, 5 and the partial are new");
        assert_eq!(rank.total(), 7);
        assert_eq!(rank.depth(&[1, 2, 3, 4, 9, 5]), 4, "contiguous from the first block");
        assert_eq!(rank.depth(&[9, 1, 2]), 0);
        for query in [&[1, 2, 3, 4, 9, 5][..], &[9, 1, 2], &[1, 2, 3, 4, 5, 6, 7], &[1], &[]] {
            let folded: Vec<u64> = prefix_hashes(query).collect();
            assert_eq!(rank.depth_of_folded(&folded), rank.depth(query), "{query:?}");
        }
        assert_eq!(rank.remove(&[1, 2, 3], 4), 1, "the shared blocks stay: the second turn holds them");
        assert_eq!(rank.total(), 6);
        assert_eq!(rank.remove(&[1, 2, 3, 4, 5], 6), 6);
        assert!(rank.is_empty());
        assert_eq!(rank.hashes(), 0, "nothing is left behind");
        assert_eq!(rank.depth(&[1, 2]), 0, "an ended request shares nothing");
    }

    /// A block's hash names its tokens, not its place: the same block twice in one prompt,
    /// or at another place in another, is another block held.
    #[test]
    fn a_block_counts_as_shared_only_at_the_same_place_in_the_same_prefix() {
        let mut rank = ActiveBlocks::default();
        assert_eq!(rank.add(&[7, 7, 7, 7], 4), 4, "four blocks of the same tokens");
        assert_eq!(rank.add(&[1, 7], 2), 2, "the same block after another prefix");
        assert_eq!(rank.depth(&[7, 7, 9]), 2);
        assert_eq!(rank.depth(&[7, 1]), 1);
        assert_eq!(rank.remove(&[7, 7, 7, 7], 4), 4);
        assert_eq!(rank.total(), 2);
    }

    #[test]
    fn requests_without_chains_count_whole() {
        let mut rank = ActiveBlocks::default();
        assert_eq!(rank.add(&[], 10), 10);
        assert_eq!(rank.add(&[], 10), 10, "without hashes nothing can be known to be shared");
        assert_eq!(rank.total(), 20);
        assert_eq!(rank.remove(&[], 10), 10);
        assert_eq!(rank.total(), 10);
    }

    #[test]
    fn a_removal_that_was_never_added_cannot_go_below_zero() {
        let mut rank = ActiveBlocks::default();
        rank.add(&[7], 2);
        assert_eq!(rank.remove(&[8, 9], 5), 1, "unknown hashes free nothing; the unhashed part is capped");
        assert_eq!(rank.total(), 1);
        assert_eq!(rank.add(&[1, 2, 3], 1), 1, "hashes past the request's blocks are not its own");
        assert_eq!(rank.add(&[4, 5], 0), 0, "a prefill leg holds no decode blocks");
        assert_eq!(rank.total(), 2);
    }
}
