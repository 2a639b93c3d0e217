//! `find_matches`: each rank's longest contiguous prefix of a request's blocks.
//!
//! The walk keeps the ranks that own every run so far: a list when few, a bitset over rank ids
//! when many. At each run it finds the next one (at most one table probe), counts how many of
//! its blocks the request shares, then keeps the ranks that also own it: a list is filtered rank
//! by rank, a bitset is intersected with a popular run's owner bitset 32 ranks a word. A rank
//! that drops out scores the depth it reached before the run; the ranks left score through the
//! shared blocks. The walk stops as soon as no rank is left or the request leaves a run.

use crate::index::KvIndex;
use crate::owners::Owners;
use crate::ranks::RankKey;
use crate::tree::ROOT;

/// Overlap scores of one request, reusable across requests to avoid allocating.
///
/// `scores` holds every rank that matched at least one block, with the number of leading blocks
/// of the request it holds contiguously from the root. Order: ascending by score (ranks drop out
/// in walk order); ranks with equal scores are in no particular order.
#[derive(Debug, Default, Clone)]
pub struct Matches {
    scores: Vec<(RankKey, u32)>,
    active: Vec<u32>,
    bits: Vec<u32>,
}

impl Matches {
    /// An empty result.
    pub fn new() -> Matches {
        Matches::default()
    }

    /// `(rank, score)` for every rank with a score of at least 1. See the type's ordering.
    pub fn as_slice(&self) -> &[(RankKey, u32)] {
        &self.scores
    }

    /// The score of `rank` (0 if it matched nothing). Linear in the number of matching ranks.
    pub fn score(&self, rank: RankKey) -> u32 {
        self.scores.iter().find(|(r, _)| *r == rank).map_or(0, |(_, s)| *s)
    }

    /// The best score of any rank (0 if none matched).
    pub fn best(&self) -> u32 {
        self.scores.last().map_or(0, |(_, s)| *s)
    }

    /// Ranks that matched at least one block.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// True when no rank matched a block.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The scores, giving up the scratch buffers.
    pub fn into_vec(self) -> Vec<(RankKey, u32)> {
        self.scores
    }
}

/// Above this many ranks still matching, the walk keeps them as a bitset: a popular prefix is
/// then intersected a 32-rank word at a time instead of one rank at a time.
const MAX_LISTED: usize = 64;

impl KvIndex {
    /// Each rank's longest contiguous prefix of `tokens_hashes` (one `LocalBlockHash` per block
    /// of the request, in order).
    pub fn find_matches(&self, tokens_hashes: &[u64]) -> Matches {
        let mut matches = Matches::new();
        self.find_matches_into(tokens_hashes, &mut matches);
        matches
    }

    /// [`KvIndex::find_matches`] into a caller's buffers, which it clears first.
    pub fn find_matches_into(&self, tokens_hashes: &[u64], matches: &mut Matches) {
        let Matches { scores, active, bits } = matches;
        scores.clear();
        active.clear();
        bits.clear();
        let mut listed = true;
        let mut first = true;
        let mut run = ROOT;
        let mut depth = 0u32;
        let mut rest = tokens_hashes;
        let mut drop = |id: u32, depth: u32| scores.extend(self.ranks.key(id).map(|k| (k, depth)));
        while let Some(&next) = rest.first() {
            let Some(child) = self.tree.child(run, next) else { break };
            // The child's first block matches; count how many more of its run the request shares.
            let hashes = self.tree.hashes(child);
            let shared = 1 + hashes[1..].iter().zip(&rest[1..]).take_while(|(a, b)| a == b).count();
            let owners = self.tree.owners(child);
            let remaining = if first {
                first = false;
                listed = owners.len() <= MAX_LISTED;
                if listed {
                    owners.for_each(|id| active.push(id));
                } else {
                    bits.resize(self.ranks.id_bound().div_ceil(32), 0);
                    owners.for_each(|id| bits[id as usize / 32] |= 1 << (id % 32));
                }
                owners.len()
            } else if listed {
                active.retain(|&id| owners.contains(id) || (drop(id, depth), false).1);
                active.len()
            } else {
                let remaining = intersect_bits(bits, owners, |id| drop(id, depth));
                if remaining <= MAX_LISTED {
                    listed = true;
                    for_each_bit(bits, |id| active.push(id));
                }
                remaining
            };
            if remaining == 0 {
                break;
            }
            depth = depth.saturating_add(u32::try_from(shared).unwrap_or(u32::MAX));
            if shared < hashes.len() {
                break;
            }
            rest = &rest[shared..];
            run = child;
        }
        if listed {
            active.iter().for_each(|&id| drop(id, depth));
        } else {
            for_each_bit(bits, |id| drop(id, depth));
        }
    }
}

/// Keeps in `active` the ranks that also own the node, reports the others, returns how many are
/// left.
fn intersect_bits(active: &mut [u32], owners: &Owners, mut dropped: impl FnMut(u32)) -> usize {
    let mut remaining = 0;
    let owner_bits = owners.bits();
    for (w, word) in active.iter_mut().enumerate() {
        let kept = match owner_bits {
            Some(owner_bits) => *word & owner_bits.get(w).copied().unwrap_or(0),
            None => {
                let mut kept = 0;
                for_each_bit(&[*word], |bit| kept |= u32::from(owners.contains(w as u32 * 32 + bit)) << bit);
                kept
            }
        };
        for_each_bit(&[*word & !kept], |bit| dropped(w as u32 * 32 + bit));
        *word = kept;
        remaining += kept.count_ones() as usize;
    }
    remaining
}

fn for_each_bit(words: &[u32], mut f: impl FnMut(u32)) {
    for (w, &word) in words.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            f(w as u32 * 32 + rest.trailing_zeros());
            rest &= rest - 1;
        }
    }
}
