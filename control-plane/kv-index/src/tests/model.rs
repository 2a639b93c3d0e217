//! The index against a naive model: each rank maps engine hashes to the full tokens path of the
//! block they name; a score is the longest prefix of the request whose every prefix some hash of
//! the rank names. After every step the scores of several queries, the stats and the event
//! outcomes must agree, and the index's invariants must hold.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::tiny;
use crate::{KvIndex, KvResult, Limits, Outcome, RankKey, StoredBlock};

type Path = Vec<u64>;

#[derive(Debug, Clone)]
enum Op {
    Stored { rank: u8, parent: Option<u64>, blocks: Vec<(u64, u64)> },
    Removed { rank: u8, hashes: Vec<u64> },
    Clear { rank: u8 },
    Retain { keep_mask: u64 },
}

#[derive(Default)]
struct Model {
    limits: Option<Limits>,
    ranks: BTreeMap<u8, BTreeMap<u64, Path>>,
}

fn key(rank: u8) -> RankKey {
    // Worker ids spread over the whole u64 range (above i64::MAX too), several dp ranks each.
    RankKey { worker_id: u64::from(rank % 3) << 62, dp_rank: u32::from(rank / 3) }
}

impl Model {
    fn nodes(&self) -> BTreeSet<Path> {
        let paths = self.ranks.values().flat_map(|held| held.values());
        paths.flat_map(|p| (1..=p.len()).map(|n| p[..n].to_vec())).collect()
    }

    fn owners(&self, path: &Path) -> usize {
        self.ranks.values().filter(|held| held.values().any(|p| p == path)).count()
    }

    fn stored(&mut self, rank: u8, parent: Option<u64>, blocks: &[(u64, u64)]) -> Outcome {
        let mut outcome = Outcome::default();
        let parent_path = match parent {
            None => Some(Vec::new()),
            Some(h) => self.ranks.get(&rank).and_then(|held| held.get(&h)).cloned(),
        };
        let Some(mut path) = parent_path else {
            outcome.add(KvResult::UnknownParent, blocks.len());
            return outcome;
        };
        for (i, &(block_hash, tokens_hash)) in blocks.iter().enumerate() {
            path.push(tokens_hash);
            let held = self.ranks.get(&rank).and_then(|h| h.get(&block_hash));
            if held == Some(&path) {
                outcome.add(KvResult::Duplicate, 1);
                continue;
            }
            if !self.fits(rank, block_hash, &path) {
                outcome.add(KvResult::OverCapacity, blocks.len() - i);
                break;
            }
            self.ranks.entry(rank).or_default().insert(block_hash, path.clone());
            outcome.add(KvResult::Applied, 1);
        }
        outcome
    }

    fn fits(&self, rank: u8, block_hash: u64, path: &Path) -> bool {
        let Some(limits) = self.limits else { return true };
        let held = self.ranks.get(&rank);
        let new_entry = held.is_none_or(|h| !h.contains_key(&block_hash));
        let rank_len = held.map_or(0, BTreeMap::len);
        let total: usize = self.ranks.values().map(BTreeMap::len).sum();
        if new_entry && (rank_len >= limits.max_blocks_per_rank || total >= limits.max_ownerships) {
            return false;
        }
        let nodes = self.nodes();
        if !nodes.contains(path) {
            return nodes.len() < limits.max_blocks;
        }
        let already_owner = held.is_some_and(|h| h.values().any(|p| p == path));
        already_owner || self.owners(path) < limits.max_owners_per_node
    }

    fn removed(&mut self, rank: u8, hashes: &[u64]) -> Outcome {
        let mut outcome = Outcome::default();
        for h in hashes {
            let gone = self.ranks.get_mut(&rank).and_then(|held| held.remove(h));
            outcome.add(if gone.is_some() { KvResult::Applied } else { KvResult::UnknownBlock }, 1);
        }
        self.ranks.retain(|_, held| !held.is_empty());
        outcome
    }

    /// Dynamo's rule, as the index keeps it after each event: a block no rank holds takes what
    /// lies under it, for every rank.
    fn drop_orphans(&mut self) {
        let held: BTreeSet<Path> = self.ranks.values().flat_map(|h| h.values().cloned()).collect();
        for paths in self.ranks.values_mut() {
            paths.retain(|_, path| (1..path.len()).all(|n| held.contains(&path[..n])));
        }
        self.ranks.retain(|_, paths| !paths.is_empty());
    }

    /// Each rank's held paths, to score queries against.
    fn paths(&self) -> Vec<(RankKey, BTreeSet<&[u64]>)> {
        self.ranks.iter().map(|(r, held)| (key(*r), held.values().map(Vec::as_slice).collect())).collect()
    }

    fn matches(paths: &[(RankKey, BTreeSet<&[u64]>)], query: &[u64]) -> Vec<(RankKey, u32)> {
        let score = |held: &BTreeSet<&[u64]>| (1..=query.len()).take_while(|n| held.contains(&query[..*n])).count();
        let mut scores: Vec<_> =
            paths.iter().map(|(k, held)| (*k, score(held) as u32)).filter(|(_, s)| *s > 0).collect();
        scores.sort();
        scores
    }

    /// Every path the model holds, and each one block longer, as queries.
    fn queries(&self) -> BTreeSet<Path> {
        let mut queries: BTreeSet<Path> = self.ranks.values().flat_map(|h| h.values().cloned()).collect();
        let longer: Vec<Path> = queries.iter().map(|p| p.iter().copied().chain([0]).collect()).collect();
        queries.extend(longer);
        queries.insert(vec![0, 1, 2, 3]);
        queries
    }
}

fn tokens() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 0u64..4, 1 => Just(u64::MAX), 1 => Just(1u64 << 63)]
}

fn engine_hash() -> impl Strategy<Value = u64> {
    prop_oneof![6 => 0u64..10, 1 => Just(u64::MAX - 3)]
}

fn op(ranks: u8) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..ranks, proptest::option::weighted(0.6, engine_hash()), prop::collection::vec((engine_hash(), tokens()), 0..5))
            .prop_map(|(rank, parent, blocks)| Op::Stored { rank, parent, blocks }),
        3 => (0..ranks, prop::collection::vec(engine_hash(), 0..4)).prop_map(|(rank, hashes)| Op::Removed { rank, hashes }),
        1 => (0..ranks).prop_map(|rank| Op::Clear { rank }),
        1 => any::<u64>().prop_map(|keep_mask| Op::Retain { keep_mask }),
    ]
}

fn kept(keep_mask: u64, rank: u8) -> bool {
    keep_mask & (1 << (rank % 64)) != 0
}

/// Applies `ops` to both; checks invariants and stats after every step, and scores every
/// `match_every` steps and after the last.
fn run(limits: Option<Limits>, ops: &[Op], match_every: usize) {
    let mut index = KvIndex::new(limits.unwrap_or(Limits::SEED));
    let mut model = Model { limits, ..Model::default() };
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Stored { rank, parent, blocks } => {
                let chain: Vec<_> =
                    blocks.iter().map(|&(block_hash, tokens_hash)| StoredBlock { block_hash, tokens_hash }).collect();
                let got = index.apply_stored(key(*rank), *parent, &chain);
                assert_eq!(got, model.stored(*rank, *parent, blocks), "{op:?}");
            }
            Op::Removed { rank, hashes } => {
                assert_eq!(index.apply_removed(key(*rank), hashes), model.removed(*rank, hashes), "{op:?}");
            }
            Op::Clear { rank } => {
                let held = model.ranks.remove(rank).map_or(0, |h| h.len());
                assert_eq!(index.clear_rank(key(*rank)), held);
            }
            Op::Retain { keep_mask } => {
                let before = model.ranks.len();
                model.ranks.retain(|r, _| kept(*keep_mask, *r));
                let cleared = index.retain_ranks(|k| (0..=u8::MAX).any(|r| key(r) == k && kept(*keep_mask, r)));
                assert_eq!(cleared, before - model.ranks.len());
            }
        }
        model.drop_orphans();
        index.check_invariants();
        let stats = index.stats();
        assert_eq!(stats.nodes, model.nodes().len(), "after {op:?}");
        assert_eq!(stats.ownerships, model.ranks.values().map(BTreeMap::len).sum::<usize>());
        assert_eq!(stats.ranks, model.ranks.len());
        if step % match_every == 0 || step + 1 == ops.len() {
            let paths = model.paths();
            for query in model.queries() {
                assert_eq!(
                    super::sorted(&index, &query),
                    Model::matches(&paths, &query),
                    "query {query:?} after {op:?}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_the_model(ops in prop::collection::vec(op(5), 1..40)) {
        run(None, &ops, 1);
    }


    #[test]
    fn agrees_with_the_model_at_small_ceilings(
        ops in prop::collection::vec(op(5), 1..40),
        max_blocks in 1usize..8,
        per_rank in 1usize..6,
        ownerships in 1usize..12,
        owners in 1usize..4,
    ) {
        run(Some(tiny(max_blocks, per_rank, ownerships, owners)), &ops, 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// 120 ranks first share one prefix, so its nodes hold their owners as a bitset; the random
    /// steps then shrink them back to lists.
    #[test]
    fn agrees_with_the_model_with_many_owners(ops in prop::collection::vec(op(120), 50..200)) {
        let shared = (0..120).map(|rank| Op::Stored { rank, parent: None, blocks: vec![(1, 0), (2, 1)] });
        run(None, &shared.chain(ops).collect::<Vec<_>>(), 16);
    }
}
