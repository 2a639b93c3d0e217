//! Provisional overlap: the prompt prefix of every pinned request, credited to the rank that
//! prefills it at dispatch, before that rank's kv-events report the blocks.
//!
//! Between a dispatch and the worker's `stored` events there is a window (queueing, prefill,
//! the event batch) in which the index does not know the rank is about to hold the prefix.
//! Without a credit, N simultaneous requests for a new prefix each see no overlap anywhere and
//! spread by load, so each worker prefills the same prefix. Replicas report the chain with the
//! dispatch (`DispatchStarted.block_hashes`); every replica's `FindMatches` then scores each rank
//! with the longer of its indexed overlap and its provisional one.
//!
//! A chain lives until `dynamo.kv.provisional_ttl` passes, the index confirms it (the rank's
//! indexed overlap covers the whole chain: dropped at the lookup that sees it), or its rank
//! departs. Dynamo's router has the same idea as a side indexer of routing decisions merged
//! into the device scores by per-worker max (`router_predicted_ttl_secs`,
//! `DYN_ROUTER_PREDICTED_TTL_SECS`, off unless set); here it is shared by every replica, so
//! requests through different replicas land together too.
//!
//! Bounded: [`MAX_CHAINS_PER_RANK`] per rank, [`MAX_CHAINS`] and [`MAX_HASHES`] in all; past a
//! bound the oldest chain goes (`evicted`). A chain credited to a rank whose blocks are then
//! cleared (a gap, a `cleared` event) goes at the next lookup (`cleared`). Every chain credited
//! leaves once, under one label: `credited` = `expired` + `confirmed` + `evicted` + `departed` +
//! `replaced` + `cleared` + the chains held.
//! Pure: time is an argument.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;
use continuum_proto::active;
use continuum_proto::fast_hash::FastMap;

/// Live chains one rank holds at most: its most recent distinct prefixes.
pub const MAX_CHAINS_PER_RANK: usize = 32;
/// Live chains held at most, over all ranks.
pub const MAX_CHAINS: usize = 4_096;
/// Block hashes held at most, over all chains (8 MiB).
pub const MAX_HASHES: usize = 1 << 20;

/// What happened to a provisional chain, as counted by
/// `continuum_dynamo_kv_provisional_total{result}`. The label set is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProvisionalResult {
    /// A chain was credited to its rank.
    Credited,
    /// A chain's rank is not a live one (or the credit is off): nothing was held.
    Refused,
    /// The TTL passed before the index confirmed it.
    Expired,
    /// The rank's indexed overlap covered the whole chain.
    Confirmed,
    /// A bound pushed the chain out before its TTL, or the credit was turned off (a zero TTL,
    /// KV routing disabled) while it was held.
    Evicted,
    /// The chain's rank left the fleet.
    Departed,
    /// A later dispatch credited the rank a chain this one is a prefix of (the same prompt
    /// again, a conversation's next turn), which took its place.
    Replaced,
    /// The rank's blocks were cleared after it was credited (a gap, a `cleared` event, a lost
    /// message, a publisher gone stale): the prefix may be gone with them.
    Cleared,
}

impl ProvisionalResult {
    pub const ALL: [ProvisionalResult; 8] = [
        ProvisionalResult::Credited,
        ProvisionalResult::Refused,
        ProvisionalResult::Expired,
        ProvisionalResult::Confirmed,
        ProvisionalResult::Evicted,
        ProvisionalResult::Departed,
        ProvisionalResult::Replaced,
        ProvisionalResult::Cleared,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ProvisionalResult::Credited => "credited",
            ProvisionalResult::Refused => "refused",
            ProvisionalResult::Expired => "expired",
            ProvisionalResult::Confirmed => "confirmed",
            ProvisionalResult::Evicted => "evicted",
            ProvisionalResult::Departed => "departed",
            ProvisionalResult::Replaced => "replaced",
            ProvisionalResult::Cleared => "cleared",
        }
    }
}

/// Chains per [`ProvisionalResult`] since the counts were last taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProvisionalCounts([u64; ProvisionalResult::ALL.len()]);

impl ProvisionalCounts {
    pub fn get(&self, result: ProvisionalResult) -> u64 {
        self.0[result as usize]
    }

    /// The results with a non-zero count, in label order.
    pub fn iter(&self) -> impl Iterator<Item = (ProvisionalResult, u64)> + '_ {
        ProvisionalResult::ALL.into_iter().map(|r| (r, self.get(r))).filter(|(_, n)| *n > 0)
    }

    fn add(&mut self, result: ProvisionalResult, n: u64) {
        let slot = &mut self.0[result as usize];
        *slot = slot.saturating_add(n);
    }
}

#[derive(Debug)]
struct Chain {
    rank: RankKey,
    /// The chain, [`Folded`].
    prefix: Box<[u64]>,
    /// When it was credited: it counts for the TTL in force now, so a reload that shortens the
    /// TTL shortens every chain held.
    credited: Instant,
}

/// Recent provisional chains, oldest first.
#[derive(Debug, Default)]
pub struct ProvisionalIndex {
    /// Zero turns the credit off.
    ttl: Duration,
    /// In the order credited, which is the order of their `credited` instants: each credit is
    /// stamped under the lock that orders them, so the expired are always the front's.
    chains: VecDeque<Chain>,
    /// How many of `chains` each rank holds, so a credit need not count them.
    per_rank: FastMap<RankKey, usize>,
    hashes: usize,
    counts: ProvisionalCounts,
}

impl ProvisionalIndex {
    /// An empty index crediting chains for `ttl` (zero: off).
    pub fn new(ttl: Duration) -> Self {
        Self { ttl, ..Self::default() }
    }

    /// Changes the TTL, for the chains held too; zero turns the credit off and drops every
    /// chain held.
    pub fn set_ttl(&mut self, ttl: Duration) {
        self.ttl = ttl;
        if ttl.is_zero() {
            self.clear();
        }
    }

    /// Drops every chain (counted as evicted).
    pub fn clear(&mut self) {
        self.counts.add(ProvisionalResult::Evicted, self.chains.len() as u64);
        self.chains.clear();
        self.per_rank.clear();
        self.hashes = 0;
    }

    /// Credits `hashes` (a request's prefix chain) to `rank` until `now + ttl`. A chain of the
    /// rank that is a prefix of this one is replaced by it. Returns what happened.
    pub fn credit(&mut self, rank: RankKey, hashes: &Folded, live: bool, now: Instant) -> ProvisionalResult {
        let hashes = &hashes.0;
        if hashes.is_empty() {
            return ProvisionalResult::Refused;
        }
        if !live || self.ttl.is_zero() || hashes.len() > MAX_HASHES {
            self.counts.add(ProvisionalResult::Refused, 1);
            return ProvisionalResult::Refused;
        }
        self.expire(now);
        let prefix = hashes.clone();
        // One walk of the chains held, and only when the rank holds any.
        if self.held_by(rank) > 0 {
            self.remove_where(|c| c.rank == rank && is_prefix(&c.prefix, &prefix), ProvisionalResult::Replaced);
        }
        while self.held_by(rank) >= MAX_CHAINS_PER_RANK {
            self.remove_where(|c| c.rank == rank, ProvisionalResult::Evicted);
        }
        // Oldest first, at the front: each chain pushed out costs one step, however many a
        // long chain needs room from.
        while self.chains.len() >= MAX_CHAINS || self.hashes + hashes.len() > MAX_HASHES {
            if !self.pop_oldest() {
                break;
            }
            self.counts.add(ProvisionalResult::Evicted, 1);
        }
        self.hashes += hashes.len();
        *self.per_rank.entry(rank).or_default() += 1;
        self.chains.push_back(Chain { rank, prefix, credited: now });
        self.counts.add(ProvisionalResult::Credited, 1);
        ProvisionalResult::Credited
    }

    /// Each rank's overlap with `query`: the larger of its indexed score (`indexed`, as
    /// `FindMatches` on the index returned it) and the longest contiguous prefix of `query` one of
    /// its live chains holds. Ascending by score, as the index orders its matches. Chains the
    /// index confirmed are dropped.
    pub fn merge(&mut self, query: &Folded, indexed: &[(RankKey, u32)], now: Instant) -> Vec<(RankKey, u32)> {
        let mut scores: FastMap<RankKey, u32> = indexed.iter().copied().collect();
        let query = &query.0;
        if !self.chains.is_empty() && !query.is_empty() {
            // Looked up once per chain sharing the prompt, thousands of them under this lock:
            // a map, not a walk of the index's matches each time.
            let indexed_scores = scores.clone();
            let indexed = |rank| indexed_scores.get(&rank).copied().unwrap_or(0);
            let mut confirmed = false;
            let ttl = self.ttl;
            let mut hint = 0;
            for chain in self.chains.iter().filter(|c| now.saturating_duration_since(c.credited) < ttl) {
                let shared = common_prefix(query, &chain.prefix, hint);
                if shared == 0 {
                    continue;
                }
                // From the last chain that shares the prompt: another prompt's says nothing.
                hint = shared;
                let blocks = u32::try_from(shared).unwrap_or(u32::MAX);
                confirmed |= shared == chain.prefix.len() && indexed(chain.rank) >= blocks;
                let score = scores.entry(chain.rank).or_default();
                *score = (*score).max(blocks);
            }
            if confirmed {
                // A chain past its TTL that the sweep has not reached yet expired: it is not
                // the index's confirmation, whatever the index holds now.
                let confirms = |c: &Chain| {
                    let blocks = u32::try_from(c.prefix.len()).unwrap_or(u32::MAX);
                    now.saturating_duration_since(c.credited) < ttl
                        && is_prefix(&c.prefix, query)
                        && indexed(c.rank) >= blocks
                };
                self.remove_where(confirms, ProvisionalResult::Confirmed);
            }
        }
        let mut merged: Vec<(RankKey, u32)> = scores.into_iter().collect();
        merged.sort_unstable_by_key(|(rank, score)| (*score, *rank));
        merged
    }

    /// Drops chains whose TTL has passed: the oldest, at the front.
    pub fn expire(&mut self, now: Instant) {
        let ttl = self.ttl;
        while self.chains.front().is_some_and(|c| now.saturating_duration_since(c.credited) >= ttl) {
            self.pop_oldest();
            self.counts.add(ProvisionalResult::Expired, 1);
        }
    }

    /// How many chains `rank` holds.
    fn held_by(&self, rank: RankKey) -> usize {
        self.per_rank.get(&rank).copied().unwrap_or(0)
    }

    /// Takes the oldest chain out (uncounted); whether there was one.
    fn pop_oldest(&mut self) -> bool {
        let Some(oldest) = self.chains.pop_front() else { return false };
        self.hashes -= oldest.prefix.len();
        forget_one(&mut self.per_rank, oldest.rank);
        true
    }

    /// Drops the chains credited to a rank before its blocks were cleared (`cleared`, from the
    /// index): what they promised the rank would hold may have gone with them.
    pub fn forget_cleared(&mut self, cleared: &crate::kv::indexer::Cleared) {
        if cleared.ranks.is_empty() && cleared.all_at.is_none() {
            return;
        }
        let before = |c: &Chain, at: Option<&Instant>| at.is_some_and(|at| c.credited <= *at);
        self.remove_where(
            |c| before(c, cleared.all_at.as_ref()) || before(c, cleared.ranks.get(&c.rank)),
            ProvisionalResult::Cleared,
        );
    }

    /// Drops chains of ranks `live` no longer admits.
    pub fn retain_live(&mut self, live: impl Fn(RankKey) -> bool) {
        self.remove_where(|c| !live(c.rank), ProvisionalResult::Departed);
    }

    /// Counts since the last call, for the metrics.
    pub fn take_counts(&mut self) -> ProvisionalCounts {
        std::mem::take(&mut self.counts)
    }

    /// Live and expired-but-not-yet-swept chains held, and their block hashes.
    pub fn size(&self) -> (usize, usize) {
        (self.chains.len(), self.hashes)
    }

    /// Removes every chain `doomed` picks (only the oldest one when `counted` is `Evicted`,
    /// so eviction frees one slot at a time), counting them under `counted`.
    fn remove_where(&mut self, doomed: impl Fn(&Chain) -> bool, counted: ProvisionalResult) {
        let only_oldest = counted == ProvisionalResult::Evicted;
        let mut removed = 0;
        let mut hashes = 0;
        let per_rank = &mut self.per_rank;
        self.chains.retain(|c| {
            let gone = doomed(c) && !(only_oldest && removed > 0);
            if gone {
                removed += 1;
                hashes += c.prefix.len();
                forget_one(per_rank, c.rank);
            }
            !gone
        });
        self.hashes -= hashes;
        self.counts.add(counted, removed);
    }
}

/// One chain of `rank` gone from `per_rank`'s count; a rank holding none leaves the map.
fn forget_one(per_rank: &mut FastMap<RankKey, usize>, rank: RankKey) {
    if let Some(held) = per_rank.get_mut(&rank) {
        *held -= 1;
        if *held == 0 {
            per_rank.remove(&rank);
        }
    }
}

/// A chain with each block hash folded with all before it ([`active::prefix_hashes`]), so
/// whether one chain starts another is one comparison, and their common prefix a bisection (a
/// shared system prompt puts every chain held hundreds of blocks deep in a query). Folded
/// before the index is locked, for [`ProvisionalIndex::merge`] and [`ProvisionalIndex::credit`].
#[derive(Debug)]
pub struct Folded(Box<[u64]>);

impl Folded {
    pub fn of(hashes: &[u64]) -> Self {
        Self(active::prefix_hashes(hashes).collect())
    }
}

/// Whether the chain folded into `prefix` starts the one folded into `of` (both [`Folded`]).
fn is_prefix(prefix: &[u64], of: &[u64]) -> bool {
    prefix.len() <= of.len() && prefix.last() == of.get(prefix.len().wrapping_sub(1))
}

/// How many leading blocks two folded chains share: folds agree below that length and at no
/// position from it on. A chain of another prompt costs one comparison; for the rest `hint`, a
/// likely answer, is tried first: the chains of one shared prompt all part from a query at the
/// same block, so most cost two.
fn common_prefix(a: &[u64], b: &[u64], hint: usize) -> usize {
    let agrees = |i: usize| a.get(i) == b.get(i);
    // Most chains held are other prompts': they part at the first block (or one is empty).
    if !agrees(0) {
        return 0;
    }
    let (mut agree, mut differ) = (0, a.len().min(b.len()));
    let hint = hint.min(differ);
    if hint > 0 && agrees(hint - 1) {
        agree = hint;
        if hint < differ && !agrees(hint) {
            differ = hint;
        }
    } else if hint > 0 {
        differ = hint - 1;
    }
    while agree < differ {
        let mid = agree + (differ - agree) / 2;
        if agrees(mid) {
            agree = mid + 1;
        } else {
            differ = mid;
        }
    }
    agree
}

#[cfg(test)]
mod tests;
