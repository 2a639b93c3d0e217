//! One deterministic fleet workload: kv-events of 1,024 ranks and the requests to score.
//!
//! Prompts share prefixes the way a serving fleet's do: a few system prompts (popular ones far
//! more often), then often one of a family's shared documents, then a conversation's own blocks.
//! A rank stores only the blocks it does not hold yet (its engine reuses its prefix cache), in
//! events of at most 32 blocks, and sometimes continues its latest conversation. Evictions drop
//! an older conversation's own blocks, tail first, as engines evict leaves.

use std::collections::HashSet;

use continuum_kv_index::RankKey;

pub const RANKS: usize = 1024;
pub const STORED_BLOCKS: usize = 1_000_000;
pub const QUERIES: usize = 10_000;
const FAMILIES: usize = 64;
const DOCS_PER_FAMILY: usize = 16;
const MAX_BLOCKS_PER_EVENT: usize = 32;

#[derive(Debug, Clone)]
pub enum Event {
    Stored { rank: RankKey, parent: Option<u64>, blocks: Vec<(u64, u64)> },
    Removed { rank: RankKey, hashes: Vec<u64> },
}

#[derive(Debug)]
pub struct Workload {
    pub events: Vec<Event>,
    pub queries: Vec<Vec<u64>>,
    pub stored_blocks: usize,
    pub removed_blocks: usize,
}

/// SplitMix64: deterministic, seedable, and good enough to stand in for XXH3 outputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn prompt(&mut self, lo: usize, hi: usize) -> Vec<u64> {
        let n = self.range(lo, hi);
        self.tokens(n)
    }

    /// An index below `n`, small ones far more often (popular system prompts).
    fn skewed(&mut self, n: usize) -> usize {
        let bound = self.below(n) + 1;
        self.below(bound)
    }

    fn tokens(&mut self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The engine's block hash: a hash of the parent's block hash and this block's tokens, as
/// vLLM's sequence hashes are.
fn engine_hashes(tokens: &[u64]) -> Vec<u64> {
    let mut parent = 0x1337;
    tokens
        .iter()
        .map(|t| {
            parent = mix(parent ^ t.rotate_left(17));
            parent
        })
        .collect()
}

struct Conversation {
    tokens: Vec<u64>,
    /// Blocks before this index are shared (system prompt, document).
    own_from: usize,
    alive: bool,
}

#[derive(Default)]
struct RankState {
    held: HashSet<u64>,
    conversations: Vec<Conversation>,
}

pub fn rank_key(i: usize) -> RankKey {
    RankKey { worker_id: mix(0xC0FFEE + (i / 4) as u64), dp_rank: (i % 4) as u32 }
}

pub fn generate(seed: u64) -> Workload {
    let mut rng = Rng(seed);
    let systems: Vec<Vec<u64>> = (0..FAMILIES).map(|_| rng.prompt(8, 40)).collect();
    let docs: Vec<Vec<Vec<u64>>> =
        (0..FAMILIES).map(|_| (0..DOCS_PER_FAMILY).map(|_| rng.prompt(4, 32)).collect()).collect();
    let mut ranks: Vec<RankState> = (0..RANKS).map(|_| RankState::default()).collect();
    let mut w = Workload { events: Vec::new(), queries: Vec::new(), stored_blocks: 0, removed_blocks: 0 };

    while w.stored_blocks < STORED_BLOCKS {
        let r = rng.below(RANKS);
        let state = &mut ranks[r];
        let alive = state.conversations.iter().filter(|c| c.alive).count();
        if alive >= 3 && rng.chance(12) {
            evict(&mut rng, state, r, &mut w);
        } else if state.conversations.last().is_some_and(|c| c.alive) && rng.chance(30) {
            let n = rng.range(2, 16);
            let extra = rng.tokens(n);
            if let Some(c) = state.conversations.last_mut() {
                c.tokens.extend(extra);
            }
            store_missing(state, r, state.conversations.len() - 1, &mut w);
        } else {
            let family = rng.skewed(FAMILIES);
            let mut tokens = systems[family].clone();
            if rng.chance(50) {
                tokens.extend(&docs[family][rng.below(DOCS_PER_FAMILY)]);
            }
            let own_from = tokens.len();
            let n = rng.range(4, 48);
            tokens.extend(rng.tokens(n));
            state.conversations.push(Conversation { tokens, own_from, alive: true });
            store_missing(state, r, state.conversations.len() - 1, &mut w);
        }
    }

    for _ in 0..QUERIES {
        let query = match rng.below(10) {
            0..=6 => {
                let state = &ranks[rng.below(RANKS)];
                if state.conversations.is_empty() {
                    rng.tokens(8)
                } else {
                    let c = &state.conversations[rng.below(state.conversations.len())];
                    let mut q = c.tokens[..rng.range(1, c.tokens.len())].to_vec();
                    let n = rng.below(8);
                    q.extend(rng.tokens(n));
                    q
                }
            }
            7 | 8 => {
                let family = rng.skewed(FAMILIES);
                let mut q = systems[family].clone();
                q.extend(&docs[family][rng.below(DOCS_PER_FAMILY)]);
                let n = rng.range(1, 32);
                q.extend(rng.tokens(n));
                q
            }
            _ => rng.tokens(16),
        };
        w.queries.push(query);
    }
    w
}

fn store_missing(state: &mut RankState, r: usize, conversation: usize, w: &mut Workload) {
    let tokens = &state.conversations[conversation].tokens;
    let hashes = engine_hashes(tokens);
    let held = hashes.iter().take_while(|h| state.held.contains(h)).count();
    let mut parent = held.checked_sub(1).map(|i| hashes[i]);
    let mut start = held;
    while start < tokens.len() {
        let end = (start + MAX_BLOCKS_PER_EVENT).min(tokens.len());
        let blocks: Vec<(u64, u64)> = (start..end).map(|i| (hashes[i], tokens[i])).collect();
        state.held.extend(&hashes[start..end]);
        w.stored_blocks += blocks.len();
        w.events.push(Event::Stored { rank: rank_key(r), parent, blocks });
        parent = Some(hashes[end - 1]);
        start = end;
    }
}

/// Evicts an older conversation's own blocks, tail first (never the latest one, which may still
/// be continued, and never shared blocks, which other conversations of the rank may extend).
fn evict(rng: &mut Rng, state: &mut RankState, r: usize, w: &mut Workload) {
    let older = state.conversations.len() - 1;
    let candidates: Vec<usize> = (0..older).filter(|&i| state.conversations[i].alive).collect();
    let Some(&victim) = candidates.get(rng.below(candidates.len().max(1))) else { return };
    let c = &mut state.conversations[victim];
    c.alive = false;
    let hashes = engine_hashes(&c.tokens);
    let own: Vec<u64> = hashes[c.own_from..].iter().rev().copied().filter(|h| state.held.remove(h)).collect();
    if own.is_empty() {
        return;
    }
    w.removed_blocks += own.len();
    w.events.push(Event::Removed { rank: rank_key(r), hashes: own });
}
