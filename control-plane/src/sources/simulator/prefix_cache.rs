//! A simulated worker's prefix cache: the full blocks of the prompts it prefilled, by sequence
//! hash, the least recently used evicted beyond its capacity, as an engine's prefix cache is.
//! Pure: the worker publishes what [`PrefixCache::store`] reports as kv-events.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dynamo's seed for both a block's tokens hash and each step of the sequence hash chain.
const SEED: u64 = 1337;

/// One full block of a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// The chain of every block up to this one (a kv-event's `block_hash`): the first block's
    /// tokens hash, then XXH3-64 of the parent's sequence hash and this block's tokens hash.
    pub sequence: u64,
    /// XXH3-64 of the block's token ids as little-endian u32 (a kv-event's `tokens_hash`),
    /// unsalted: a 1.6.1 mocker stores the unsalted chain whatever the request's salt.
    pub tokens: u64,
}

/// The full blocks of `tokens` (a trailing partial block is not cached).
pub fn blocks(tokens: &[u32], block_size: usize) -> Vec<Block> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            let tokens = xxh3_64_with_seed(&bytes, SEED);
            let sequence = parent.map_or(tokens, |parent| next_sequence(parent, tokens));
            parent = Some(sequence);
            Block { sequence, tokens }
        })
        .collect()
}

/// The sequence hash of a block whose parent's is `parent`.
fn next_sequence(parent: u64, tokens: u64) -> u64 {
    let mut pair = [0u8; 16];
    pair[..8].copy_from_slice(&parent.to_le_bytes());
    pair[8..].copy_from_slice(&tokens.to_le_bytes());
    xxh3_64_with_seed(&pair, SEED)
}

/// What storing one prompt changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// Leading blocks the cache already held: the prompt's cached part.
    pub cached: usize,
    /// The sequence hash of the block the new ones follow (`None`: they start the prompt).
    pub parent: Option<u64>,
    /// Blocks newly stored, in prompt order.
    pub new: Vec<Block>,
    /// Sequence hashes evicted to make room, least recently used first.
    pub evicted: Vec<u64>,
}

#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    clock: u64,
    /// Sequence hash → when it was last used.
    used: HashMap<u64, u64>,
    /// When → sequence hash: the eviction order.
    order: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, clock: 0, used: HashMap::new(), order: BTreeMap::new() }
    }

    /// The leading blocks of `prompt` held now: what a request arriving now finds cached.
    pub fn held(&self, prompt: &[Block]) -> usize {
        prompt.iter().take_while(|block| self.used.contains_key(&block.sequence)).count()
    }

    pub fn clear(&mut self) {
        self.used.clear();
        self.order.clear();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.used.len()
    }

    /// Stores `prompt`'s blocks (at most the capacity's first): those held already count as
    /// cached, the rest are stored after them, and all become the most recently used. A parent
    /// is marked used after its children, so eviction takes a chain's tail first and never
    /// leaves a block whose parent is gone.
    pub fn store(&mut self, prompt: &[Block]) -> Stored {
        let prompt = &prompt[..prompt.len().min(self.capacity)];
        let cached = self.held(prompt);
        let parent = cached.checked_sub(1).map(|last| prompt[last].sequence);
        let new = prompt[cached..].to_vec();
        for block in prompt.iter().rev() {
            self.clock += 1;
            if let Some(before) = self.used.insert(block.sequence, self.clock) {
                self.order.remove(&before);
            }
            self.order.insert(self.clock, block.sequence);
        }
        let mut evicted = Vec::new();
        while self.used.len() > self.capacity {
            let Some((_, sequence)) = self.order.pop_first() else { break };
            self.used.remove(&sequence);
            evicted.push(sequence);
        }
        Stored { cached, parent, new, evicted }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(first: u32, blocks_of_4: u32) -> Vec<Block> {
        let tokens: Vec<u32> = (first..first + 4 * blocks_of_4).collect();
        blocks(&tokens, 4)
    }

    /// Every stored event the real aggregated 1.6.1 mocker published under load: each block's
    /// `block_hash` chains from its parent's (or is its own `tokens_hash` at a prompt's start).
    #[test]
    fn sequence_hashes_chain_as_the_real_mocker_chains_them() {
        let path = format!("{}/agg/zmq-messages-under-load-evictions.jsonl", crate::kv::fixtures::FIXTURES);
        let text = std::fs::read_to_string(&path).expect("the capture");
        let mut checked = 0;
        for line in text.lines() {
            let record: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            for event in record["decoded"]["payload"].as_array().into_iter().flatten() {
                let stored = &event["event"]["data"]["stored"];
                let Some(blocks) = stored["blocks"].as_array() else { continue };
                let mut parent = stored["parent_hash"].as_u64();
                for block in blocks {
                    let (sequence, tokens) = (block["block_hash"].as_u64(), block["tokens_hash"].as_u64());
                    let (Some(sequence), Some(tokens)) = (sequence, tokens) else { panic!("{block}") };
                    assert_eq!(parent.map_or(tokens, |parent| next_sequence(parent, tokens)), sequence);
                    parent = Some(sequence);
                    checked += 1;
                }
            }
        }
        assert!(checked > 100, "{checked} blocks checked");
    }

    #[test]
    fn a_shared_prefix_is_cached_and_only_the_rest_is_stored_after_it() {
        let mut cache = PrefixCache::new(100);
        let first = prompt(0, 3);
        let stored = cache.store(&first);
        assert_eq!((stored.cached, stored.parent, stored.new.len()), (0, None, 3));
        assert_eq!(first[0].sequence, first[0].tokens, "the chain starts at the first block's own hash");
        let mut second = first[..2].to_vec();
        second.extend(
            blocks(&(0..12).map(|t| if t < 8 { t } else { t + 100 }).collect::<Vec<_>>(), 4).into_iter().skip(2),
        );
        let stored = cache.store(&second);
        assert_eq!((stored.cached, stored.parent), (2, Some(first[1].sequence)));
        assert_eq!(stored.new, second[2..]);
        assert!(stored.evicted.is_empty());
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn beyond_its_capacity_the_least_recently_used_tails_go_first() {
        let mut cache = PrefixCache::new(4);
        let old = prompt(0, 3);
        cache.store(&old);
        let stored = cache.store(&prompt(1000, 2));
        assert_eq!(stored.evicted, [old[2].sequence], "the old prompt's tail, not its head");
        let stored = cache.store(&prompt(2000, 2));
        assert_eq!(stored.evicted, [old[1].sequence, old[0].sequence]);
        assert_eq!(cache.len(), 4);
        let long = prompt(3000, 6);
        let stored = cache.store(&long);
        assert_eq!(stored.new, long[..4], "at most the capacity's first blocks");
        assert_eq!(cache.len(), 4);
    }
}
