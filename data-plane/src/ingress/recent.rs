//! The index's recent answers, for a request whose `FindMatches` misses its deadline.
//!
//! On a busy machine a lookup sometimes takes longer than its (tight) deadline, and a request
//! scored without overlap credit usually lands away from the rank holding its prefix: a cache
//! miss that costs a whole prefill. Conversations and shared system prompts repeat prefixes
//! within seconds, so the replica keeps each answer for [`RECENT_FOR`] under its prompt's
//! prefix, and a missed lookup is scored on the answer for the longest prefix it shares with an
//! earlier one. An old answer can only overstate what a rank still holds (blocks get evicted,
//! and provisional credit for them expires), which is why it serves only a miss and only
//! briefly.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::routing::picker::RankOverlap;

/// How long an answer stands in for a missed lookup.
pub const RECENT_FOR: Duration = Duration::from_secs(5);
/// Prefix keys held at once; the oldest go first.
pub const MAX_RECENT: usize = 8192;
/// Ranks the kept answers name at once, each answer counted once however many keys it is kept
/// under (24 bytes a rank: 24 MiB at most): an answer may name thousands of ranks (a fleet
/// whose every rank holds a shared system prompt), and the key bound alone would let 8,192 of
/// them hold gigabytes.
pub const MAX_HELD_RANKS: usize = 1 << 20;
/// Besides under its whole prompt, an answer is kept under every this many blocks of it, so a
/// request sharing only a leading part (another user of the same system prompt) finds it.
const EVERY: usize = 16;
/// Keys one answer is kept under at most, besides its whole prompt's: a long prompt's are
/// spread wider apart (every 1,024 blocks for the longest, 65,536), so that a few long prompts
/// cannot take every key from the conversations around them.
const MAX_KEYS_PER_ANSWER: usize = 64;

/// How many blocks apart an answer for a prompt of `blocks` is kept.
fn spacing(blocks: usize) -> usize {
    blocks.div_ceil(MAX_KEYS_PER_ANSWER).next_multiple_of(EVERY).max(EVERY)
}

#[derive(Debug, Default)]
pub struct RecentAnswers {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_prefix: HashMap<u64, Entry>,
    /// Insertion order, for eviction; a key re-inserted later is skipped when its old turn comes.
    order: VecDeque<(u64, Instant)>,
    /// The ranks the entries' answers name, summed over the distinct answers
    /// ([`MAX_HELD_RANKS`]).
    held_ranks: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    at: Instant,
    /// The prefix's length in blocks: no rank can hold more of it than that.
    blocks: u32,
    answer: Arc<[RankOverlap]>,
}

impl RecentAnswers {
    /// Keeps `answer`, the index's reply for `model`'s prompt whose block hashes are `hashes`.
    /// Kept by model: two models sharing a tokenizer (two sizes of one family) hash the same
    /// prompt alike, and one's ranks are no answer for the other's.
    pub fn remember(&self, model: &str, hashes: &[u64], answer: &[RankOverlap], now: Instant) {
        if hashes.is_empty() {
            return;
        }
        let answer: Arc<[RankOverlap]> = answer.into();
        // Hashed before the lock, as `recall` does: a long prompt's keys take a millisecond,
        // and every request's lookup shares this lock.
        let every = spacing(hashes.len());
        let kept: Vec<(u64, u32)> = prefix_keys(model, hashes)
            .zip(1..)
            .filter(|(_, blocks)| blocks % every == 0 || *blocks == hashes.len())
            .map(|(key, blocks)| (key, u32::try_from(blocks).unwrap_or(u32::MAX)))
            .collect();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.held_ranks += answer.len();
        for (key, blocks) in kept {
            let entry = Entry { at: now, blocks, answer: Arc::clone(&answer) };
            if let Some(replaced) = inner.by_prefix.insert(key, entry) {
                inner.forget(&replaced);
            }
            inner.order.push_back((key, now));
        }
        // Its last holders are the entries now: an evicted one can tell it is the last.
        drop(answer);
        inner.evict(now);
    }

    /// The recent answer for `model`'s longest prefix of `hashes` that one was kept under,
    /// each rank's blocks capped at that prefix's length.
    pub fn recall(&self, model: &str, hashes: &[u64], now: Instant) -> Option<Vec<RankOverlap>> {
        let keys: Vec<u64> = prefix_keys(model, hashes).collect();
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = keys
            .iter()
            .rev()
            .filter_map(|key| inner.by_prefix.get(key))
            .find(|entry| now.saturating_duration_since(entry.at) < RECENT_FOR)?;
        Some(entry.answer.iter().map(|overlap| overlap.capped(entry.blocks)).collect())
    }
}

impl Inner {
    /// An entry taken out: its answer's ranks no longer count once no other entry holds it.
    fn forget(&mut self, entry: &Entry) {
        if Arc::strong_count(&entry.answer) == 1 {
            self.held_ranks -= entry.answer.len();
        }
    }

    fn evict(&mut self, now: Instant) {
        while let Some(&(key, at)) = self.order.front() {
            let bounded = self.by_prefix.len() <= MAX_RECENT
                && self.order.len() <= 4 * MAX_RECENT
                && self.held_ranks <= MAX_HELD_RANKS;
            if bounded && now.saturating_duration_since(at) < RECENT_FOR {
                break;
            }
            self.order.pop_front();
            if self.by_prefix.get(&key).is_some_and(|entry| entry.at == at)
                && let Some(removed) = self.by_prefix.remove(&key)
            {
                self.forget(&removed);
            }
        }
    }
}

/// One key per block naming the model and the whole prefix up to it: block hashes are per
/// block, not chained.
fn prefix_keys<'h>(model: &str, hashes: &'h [u64]) -> impl Iterator<Item = u64> + 'h {
    hashes.iter().scan(xxh3_64_with_seed(model.as_bytes(), 0), |chain, hash| {
        *chain = xxh3_64_with_seed(&hash.to_le_bytes(), *chain);
        Some(*chain)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(blocks: std::ops::Range<u64>) -> Vec<u64> {
        blocks.collect()
    }

    fn held(overlaps: &[(u64, u32, u32, u32)]) -> Vec<RankOverlap> {
        overlaps
            .iter()
            .map(|&(instance_id, dp_rank, blocks, active)| RankOverlap { instance_id, dp_rank, blocks, active })
            .collect()
    }

    /// Two models sharing a tokenizer hash one prompt alike: each is recalled its own answer,
    /// and a third none.
    #[test]
    fn answers_are_kept_by_model() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        recent.remember("a", &chain(0..32), &held(&[(7, 0, 32, 0)]), t0);
        recent.remember("b", &chain(0..32), &held(&[(8, 0, 32, 0)]), t0);
        assert_eq!(recent.recall("a", &chain(0..32), t0), Some(held(&[(7, 0, 32, 0)])));
        assert_eq!(recent.recall("b", &chain(0..32), t0), Some(held(&[(8, 0, 32, 0)])));
        assert_eq!(recent.recall("c", &chain(0..32), t0), None);
    }

    #[test]
    fn a_longer_prompt_finds_the_answer_for_its_prefix() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        recent.remember("m", &chain(0..40), &held(&[(7, 0, 40, 36), (8, 1, 12, 0)]), t0);
        assert_eq!(
            recent.recall("m", &chain(0..50), t0),
            Some(held(&[(7, 0, 40, 36), (8, 1, 12, 0)])),
            "the next turn"
        );
        // Another user of the same first 32 blocks: the answer kept at block 32, capped there.
        let mut other = chain(0..32);
        other.extend(100..120);
        assert_eq!(recent.recall("m", &other, t0), Some(held(&[(7, 0, 32, 32), (8, 1, 12, 0)])));
        let mut stranger = vec![99];
        stranger.extend(1..40);
        assert_eq!(recent.recall("m", &stranger, t0), None, "keys name whole prefixes, not single blocks");
    }

    #[test]
    fn answers_stand_in_briefly_and_in_bounded_number() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        recent.remember("m", &chain(0..16), &held(&[(7, 0, 16, 0)]), t0);
        assert!(recent.recall("m", &chain(0..16), t0 + RECENT_FOR).is_none(), "too old");
        for n in 0..MAX_RECENT as u64 + 10 {
            recent.remember("m", &[n + 1000], &held(&[(7, 0, 1, 0)]), t0);
        }
        let inner = recent.inner.lock().expect("unpoisoned");
        assert_eq!(inner.by_prefix.len(), MAX_RECENT);
    }

    /// A long prompt's answer takes a bounded number of keys, spread along it: the
    /// conversations kept before it keep theirs, and a request sharing part of it finds the
    /// answer at the nearest key below.
    #[test]
    fn a_long_prompt_takes_a_bounded_number_of_keys() {
        assert_eq!((spacing(1), spacing(1024), spacing(1025), spacing(65_536)), (16, 16, 32, 1024));
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        for n in 0..MAX_RECENT as u64 - 200 {
            recent.remember("m", &[n + (1 << 40)], &held(&[(7, 0, 1, 0)]), t0);
        }
        recent.remember("m", &chain(0..65_536), &held(&[(8, 0, 65_536, 0)]), t0);
        assert_eq!(recent.inner.lock().expect("unpoisoned").by_prefix.len(), MAX_RECENT - 200 + 64);
        assert_eq!(recent.recall("m", &[1 << 40], t0), Some(held(&[(7, 0, 1, 0)])), "the first kept its key");
        let mut part = chain(0..3_000);
        part.push(u64::MAX);
        assert_eq!(recent.recall("m", &part, t0), Some(held(&[(8, 0, 2_048, 0)])), "at the key below 3,000");
    }

    /// Answers naming thousands of ranks each are kept within the bound on ranks, not only on
    /// keys; the newest stand in still.
    #[test]
    fn answers_naming_many_ranks_are_bounded_by_the_ranks_they_name() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        let many: Vec<RankOverlap> =
            (0..8192).map(|id| RankOverlap { instance_id: id, dp_rank: 0, blocks: 1, active: 0 }).collect();
        for n in 0..1024 {
            recent.remember("m", &[n], &many, t0);
        }
        {
            let inner = recent.inner.lock().expect("unpoisoned");
            let mut distinct: Vec<&Arc<[RankOverlap]>> = inner.by_prefix.values().map(|entry| &entry.answer).collect();
            distinct.sort_by_key(|answer| Arc::as_ptr(answer).cast::<u8>());
            distinct.dedup_by(|a, b| Arc::ptr_eq(a, b));
            let named: usize = distinct.iter().map(|answer| answer.len()).sum();
            assert!(named <= MAX_HELD_RANKS && named == inner.held_ranks, "{named} ranks held");
        }
        assert_eq!(recent.recall("m", &[1023], t0).map(|answer| answer.len()), Some(8192), "the newest stands in");
        assert!(recent.recall("m", &[0], t0).is_none(), "the oldest went");
    }

    /// An answer kept under many prefixes of a long prompt counts once: its shorter prefixes
    /// stand in as its whole does.
    #[test]
    fn an_answer_kept_under_many_prefixes_counts_its_ranks_once() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        let many: Vec<RankOverlap> =
            (0..4096).map(|id| RankOverlap { instance_id: id, dp_rank: 0, blocks: 16, active: 0 }).collect();
        let prompt = chain(0..8192);
        recent.remember("m", &prompt, &many, t0);
        assert_eq!(recent.inner.lock().expect("unpoisoned").held_ranks, 4096);
        assert_eq!(
            recent.recall("m", &prompt[..spacing(prompt.len())], t0).map(|answer| answer.len()),
            Some(4096),
            "a short prefix stands in"
        );
    }

    #[test]
    fn the_newest_answer_for_a_prefix_wins() {
        let recent = RecentAnswers::default();
        let t0 = Instant::now();
        recent.remember("m", &chain(0..16), &held(&[(7, 0, 16, 0)]), t0);
        recent.remember("m", &chain(0..16), &held(&[(8, 0, 16, 0)]), t0 + Duration::from_secs(1));
        assert_eq!(recent.recall("m", &chain(0..16), t0 + Duration::from_secs(2)), Some(held(&[(8, 0, 16, 0)])));
        assert!(recent.recall("m", &[], t0).is_none());
    }
}
