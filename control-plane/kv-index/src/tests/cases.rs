use super::{chain, engine, rank, sorted, tiny};
use crate::{KvIndex, KvResult, Limits, RankKey, StoredBlock};

#[test]
fn scores_are_contiguous_prefixes_from_the_root() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[10, 11, 12, 13]));
    index.apply_stored(rank(2), None, &chain(&[10, 11]));
    index.apply_stored(rank(3), None, &chain(&[20]));
    // Rank 4 holds blocks 0, 1 and 3 of the request: it scores 2.
    index.apply_stored(rank(4), None, &chain(&[10, 11, 12, 13]));
    index.apply_removed(rank(4), &[engine(12)]);
    index.check_invariants();

    let matches = index.find_matches(&[10, 11, 12, 13, 14]);
    assert_eq!(matches.as_slice().last(), Some(&(rank(1), 4)));
    assert!(matches.as_slice().windows(2).all(|w| w[0].1 <= w[1].1), "ascending order");
    assert_eq!(sorted(&index, &[10, 11, 12, 13, 14]), vec![(rank(1), 4), (rank(2), 2), (rank(4), 2)]);
    assert_eq!(matches.best(), 4);
    assert_eq!(matches.score(rank(3)), 0);
    assert!(index.find_matches(&[11, 12]).is_empty(), "no match that does not start at the root");
    assert!(index.find_matches(&[]).is_empty());
}

#[test]
fn a_chain_can_continue_under_a_held_parent() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[1, 2]));
    let outcome = index.apply_stored(rank(1), Some(engine(2)), &chain(&[3, 4]));
    assert_eq!(outcome.get(KvResult::Applied), 2);
    assert_eq!(sorted(&index, &[1, 2, 3, 4]), vec![(rank(1), 4)]);
    index.check_invariants();
}

#[test]
fn unknown_parent_refuses_the_whole_event() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[1, 2]));
    // Another rank's block is not a parent for this one.
    let outcome = index.apply_stored(rank(2), Some(engine(2)), &chain(&[3, 4]));
    assert_eq!((outcome.get(KvResult::UnknownParent), outcome.blocks()), (2, 2));
    assert_eq!(outcome.summary(), Some(KvResult::UnknownParent));
    let outcome = index.apply_stored(rank(1), Some(999), &chain(&[3]));
    assert_eq!(outcome.get(KvResult::UnknownParent), 1);
    let stats = index.stats();
    assert_eq!((stats.nodes, stats.ownerships, stats.ranks), (2, 2, 1));
    index.check_invariants();
}

#[test]
fn storing_the_same_chain_twice_is_idempotent() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[1, 2, 3]));
    let before = index.stats();
    let outcome = index.apply_stored(rank(1), None, &chain(&[1, 2, 3]));
    assert_eq!((outcome.get(KvResult::Duplicate), outcome.blocks()), (3, 3));
    assert_eq!(index.stats(), before);
    // One remove undoes the store: duplicates did not add references.
    index.apply_removed(rank(1), &[engine(3)]);
    assert_eq!(sorted(&index, &[1, 2, 3]), vec![(rank(1), 2)]);
    index.check_invariants();
}

#[test]
fn two_engine_hashes_for_one_node_keep_it_until_both_are_removed() {
    let mut index = KvIndex::default();
    let salted = |b: u64, t: u64| StoredBlock { block_hash: b, tokens_hash: t };
    index.apply_stored(rank(1), None, &[salted(100, 1)]);
    let outcome = index.apply_stored(rank(1), None, &[salted(200, 1)]);
    assert_eq!(outcome.get(KvResult::Applied), 1);
    assert_eq!((index.stats().ownerships, index.stats().nodes), (2, 1));
    index.apply_removed(rank(1), &[100]);
    assert_eq!(sorted(&index, &[1]), vec![(rank(1), 1)], "still held through hash 200");
    index.check_invariants();
    index.apply_removed(rank(1), &[200]);
    assert!(index.find_matches(&[1]).is_empty());
    assert_eq!(index.stats().nodes, 0);
    index.check_invariants();
}

#[test]
fn an_engine_hash_stored_under_another_prefix_moves() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &[StoredBlock { block_hash: 5, tokens_hash: 1 }]);
    index.apply_stored(rank(1), None, &[StoredBlock { block_hash: 5, tokens_hash: 2 }]);
    assert_eq!(sorted(&index, &[2]), vec![(rank(1), 1)]);
    assert!(index.find_matches(&[1]).is_empty(), "the old node was released and freed");
    assert_eq!((index.stats().nodes, index.stats().ownerships), (1, 1));
    index.check_invariants();
}

#[test]
fn removing_frees_empty_chains_up_to_a_shared_parent() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[1, 2, 3]));
    index.apply_stored(rank(2), None, &chain(&[1, 9]));
    let outcome = index.apply_removed(rank(1), &[engine(3), engine(2), engine(1), 12345]);
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::UnknownBlock)), (3, 1));
    assert_eq!(index.stats().nodes, 2, "node 1 survives for rank 2, nodes 2 and 3 are freed");
    assert_eq!(index.rank_blocks(rank(1)), 0);
    assert_eq!(index.stats().ranks, 1, "a rank holding nothing is forgotten");
    let outcome = index.apply_removed(rank(7), &[1, 2]);
    assert_eq!(outcome.get(KvResult::UnknownBlock), 2);
    index.check_invariants();
}

/// A block whose last owner removes it takes what lies under it, for every rank (Dynamo's
/// router clears its children): no match could pass it. The hashes naming what went are
/// unknown from then on.
#[test]
fn removing_a_middle_block_its_last_owner_held_drops_what_lies_under_it() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&[1, 2, 3]));
    index.apply_stored(rank(2), None, &chain(&[1, 2, 4]));
    index.apply_removed(rank(1), &[engine(2)]);
    assert_eq!(sorted(&index, &[1, 2, 3]), vec![(rank(1), 1), (rank(2), 2)], "rank 2 still holds block 2");
    assert_eq!(index.stats().nodes, 4, "1, 2, 3 and 4: block 2 is rank 2's");
    index.apply_removed(rank(2), &[engine(2)]);
    assert_eq!(sorted(&index, &[1, 2, 4]), vec![(rank(1), 1), (rank(2), 1)]);
    assert_eq!(index.stats().nodes, 1, "blocks 3 and 4 went with block 2");
    assert_eq!((index.rank_blocks(rank(1)), index.rank_blocks(rank(2))), (1, 1));
    let under = index.apply_stored(rank(1), Some(engine(3)), &chain(&[6]));
    assert_eq!(under.get(KvResult::UnknownParent), 1, "block 3 is gone");
    assert_eq!(index.apply_removed(rank(2), &[engine(4)]).get(KvResult::UnknownBlock), 1);
    index.check_invariants();
}

/// A rank removing the heads of its chains while it stores under their tails (an engine
/// evicting from the root end) holds every block the tree keeps for it: it cannot fill the
/// index past its share, and other ranks' blocks still fit.
#[test]
fn a_rank_removing_heads_while_storing_under_tails_holds_no_more_than_its_share() {
    let mut index = KvIndex::new(tiny(64, 16, 1024, 8));
    index.share_among(4);
    let mut tail = None;
    for head in 0..200u64 {
        let stored = index.apply_stored(rank(1), tail, &chain(&[1000 + head]));
        if stored.get(KvResult::UnknownParent) > 0 {
            // Its tail went with the head removed last time: a new chain at the root.
            index.apply_stored(rank(1), None, &chain(&[1000 + head]));
        }
        tail = Some(engine(1000 + head));
        if head % 2 == 1 {
            index.apply_removed(rank(1), &[engine(1000 + head - 1)]);
        }
        assert!(index.stats().nodes <= index.rank_blocks(rank(1)), "a block the tree keeps that no rank holds");
        index.check_invariants();
    }
    let other = index.apply_stored(rank(2), None, &chain(&[1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!(other.get(KvResult::Applied), 8, "room for another rank's share");
}

/// Dropping an orphan's subtree takes a pass over each owner's lookup, however few blocks went:
/// the work an event is weighed by says so, for a caller bounding what one hold applies.
#[test]
fn dropping_what_lies_under_an_orphan_weighs_the_owners_lookups() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &chain(&(10_000..14_096).collect::<Vec<_>>()));
    index.apply_stored(rank(1), None, &chain(&[1, 2]));
    let before = index.work();
    index.apply_stored(rank(1), None, &chain(&[3]));
    assert_eq!(index.work() - before, 1, "a block named, no more");
    let before = index.work();
    index.apply_removed(rank(1), &[engine(1)]);
    assert_eq!(index.rank_blocks(rank(1)), 4_097, "block 2 went with block 1");
    assert!(index.work() - before >= 256, "a pass over 4,000 entries: {}", index.work() - before);
    index.check_invariants();
}

/// A hash moved under a block below its old one leaves the old block an orphan whose subtree
/// holds the new one: all of it goes, and the index stays whole.
#[test]
fn a_hash_moved_below_its_old_block_goes_with_it() {
    let mut index = KvIndex::default();
    index.apply_stored(rank(1), None, &[StoredBlock { block_hash: 5, tokens_hash: 1 }]);
    let moved = index.apply_stored(
        rank(1),
        Some(5),
        &[StoredBlock { block_hash: 5, tokens_hash: 2 }, StoredBlock { block_hash: 6, tokens_hash: 3 }],
    );
    assert_eq!(moved.get(KvResult::Applied), 2);
    assert_eq!((index.stats().nodes, index.stats().ownerships, index.stats().ranks), (0, 0, 0));
    index.check_invariants();
}

#[test]
fn clear_and_retain_drop_whole_ranks() {
    let mut index = KvIndex::default();
    for w in 0..4 {
        let r = RankKey { worker_id: w / 2, dp_rank: (w % 2) as u32 };
        index.apply_stored(r, None, &chain(&[1, 2, 100 + w]));
    }
    assert_eq!(index.clear_rank(RankKey { worker_id: 0, dp_rank: 1 }), 3);
    assert_eq!(index.clear_rank(RankKey { worker_id: 0, dp_rank: 1 }), 0);
    index.check_invariants();
    assert_eq!(index.retain_ranks(|r| r.worker_id != 1), 2);
    let mut left: Vec<_> = index.ranks().collect();
    left.sort();
    assert_eq!(left, vec![RankKey { worker_id: 0, dp_rank: 0 }]);
    assert_eq!(index.stats().nodes, 3);
    index.check_invariants();
    index.retain_ranks(|_| false);
    assert_eq!(index.stats(), crate::IndexStats { heap_bytes: index.stats().heap_bytes, ..Default::default() });
    index.check_invariants();
}

#[test]
fn hashes_above_i64_max_work() {
    let mut index = KvIndex::default();
    let big = [u64::MAX, u64::MAX - 1, (i64::MAX as u64) + 1];
    let blocks: Vec<_> = big.iter().map(|&t| StoredBlock { block_hash: t, tokens_hash: t }).collect();
    index.apply_stored(RankKey { worker_id: u64::MAX, dp_rank: u32::MAX }, None, &blocks);
    index.apply_stored(rank(2), Some(u64::MAX), &[]);
    let outcome =
        index.apply_stored(RankKey { worker_id: u64::MAX, dp_rank: u32::MAX }, Some(u64::MAX - 1), &chain(&[5]));
    assert_eq!(outcome.get(KvResult::Applied), 1);
    assert_eq!(sorted(&index, &big), vec![(RankKey { worker_id: u64::MAX, dp_rank: u32::MAX }, 3)]);
    index.apply_removed(RankKey { worker_id: u64::MAX, dp_rank: u32::MAX }, &[u64::MAX]);
    assert!(index.find_matches(&big).is_empty());
    index.check_invariants();
}

#[test]
fn node_ceiling_refuses_the_rest_of_the_chain() {
    let mut index = KvIndex::new(tiny(3, 100, 100, 100));
    let outcome = index.apply_stored(rank(1), None, &chain(&[1, 2, 3, 4, 5]));
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (3, 2));
    // A neighbour can still share existing nodes, but not add one.
    let outcome = index.apply_stored(rank(2), None, &chain(&[1, 2, 9]));
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (2, 1));
    assert_eq!(sorted(&index, &[1, 2, 3, 4]), vec![(rank(1), 3), (rank(2), 2)]);
    assert_eq!(index.stats().nodes, 3);
    index.check_invariants();
    // Freeing a node makes room again.
    index.apply_removed(rank(1), &[engine(3)]);
    assert_eq!(index.apply_stored(rank(2), Some(engine(2)), &chain(&[9])).get(KvResult::Applied), 1);
    index.check_invariants();
}

#[test]
fn per_rank_ceiling_leaves_other_ranks_alone() {
    let mut index = KvIndex::new(tiny(100, 2, 100, 100));
    let outcome = index.apply_stored(rank(1), None, &chain(&[1, 2, 3]));
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (2, 1));
    assert_eq!(index.rank_blocks(rank(1)), 2);
    // A duplicate is not a new block, and another rank has its own allowance.
    assert_eq!(index.apply_stored(rank(1), None, &chain(&[1, 2])).get(KvResult::Duplicate), 2);
    assert_eq!(index.apply_stored(rank(2), None, &chain(&[1, 2])).get(KvResult::Applied), 2);
    assert_eq!(sorted(&index, &[1, 2, 3]), vec![(rank(1), 2), (rank(2), 2)]);
    index.check_invariants();
}

/// Shared among the fleet's ranks, the index holds at most an equal share for each: ranks that
/// cache a great deal cannot fill it and lock a later one out.
#[test]
fn shared_among_ranks_each_holds_at_most_its_share() {
    let mut index = KvIndex::new(tiny(8, 100, 100, 100));
    index.share_among(3);
    let outcome = index.apply_stored(rank(1), None, &chain(&[1, 2, 3, 4]));
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (2, 2));
    index.apply_stored(rank(2), None, &chain(&[11, 12, 13, 14]));
    let outcome = index.apply_stored(rank(3), None, &chain(&[21, 22]));
    assert_eq!(outcome.get(KvResult::Applied), 2, "room left for the third rank");
    // One more rank in the fleet: those past the smaller share keep their blocks, add none.
    index.share_among(4);
    assert_eq!(index.apply_stored(rank(1), Some(engine(2)), &chain(&[5])).get(KvResult::OverCapacity), 1);
    assert_eq!(index.rank_blocks(rank(1)), 2);
    // With no fleet to share among, the per-rank ceiling alone.
    index.share_among(0);
    let outcome = index.apply_stored(rank(1), Some(engine(2)), &chain(&[5]));
    assert_eq!(outcome.get(KvResult::Applied), 1, "{outcome:?}");
    index.check_invariants();
}

/// However many ranks share it, their shares add up to no more than the index: a fleet larger
/// than the index has room for at a few hundred blocks each still gives every rank its share,
/// rather than the first ranks filling it and locking the rest out.
#[test]
fn shares_add_up_to_no_more_than_the_index_however_many_ranks() {
    let ranks = 512u64;
    let mut index = KvIndex::new(tiny(ranks as usize, 100, 10_000, 10_000));
    index.share_among(ranks as usize);
    assert_eq!(index.rank_share(), 1);
    for id in 1..=ranks {
        let outcome = index.apply_stored(rank(id), None, &chain(&[10 * id, 10 * id + 1]));
        assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (1, 1), "rank {id}");
    }
    assert_eq!(index.stats().nodes, ranks as usize, "the index is full, each rank holding its share");
    index.check_invariants();
}

#[test]
fn ownership_ceiling_is_shared_by_all_ranks() {
    let mut index = KvIndex::new(tiny(100, 100, 3, 100));
    index.apply_stored(rank(1), None, &chain(&[1, 2]));
    let outcome = index.apply_stored(rank(2), None, &chain(&[1, 2]));
    assert_eq!((outcome.get(KvResult::Applied), outcome.get(KvResult::OverCapacity)), (1, 1));
    assert_eq!(index.stats().ownerships, 3);
    assert_eq!(sorted(&index, &[1, 2]), vec![(rank(1), 2), (rank(2), 1)]);
    index.check_invariants();
}

#[test]
fn owners_per_node_ceiling_refuses_one_more_rank() {
    let mut index = KvIndex::new(tiny(100, 100, 100, 2));
    index.apply_stored(rank(1), None, &chain(&[1]));
    index.apply_stored(rank(2), None, &chain(&[1]));
    let outcome = index.apply_stored(rank(3), None, &chain(&[1, 2]));
    assert_eq!((outcome.get(KvResult::OverCapacity), outcome.blocks()), (2, 2));
    assert_eq!(index.stats().ranks, 2, "a refused rank is not interned");
    // An owner adding a second hash for the same node is not one more owner.
    let again = [StoredBlock { block_hash: 77, tokens_hash: 1 }];
    assert_eq!(index.apply_stored(rank(1), None, &again).get(KvResult::Applied), 1);
    // Other nodes are unaffected.
    assert_eq!(index.apply_stored(rank(3), None, &chain(&[5])).get(KvResult::Applied), 1);
    index.check_invariants();
}

#[test]
fn seed_limits_are_the_default() {
    assert_eq!(KvIndex::default().limits(), Limits::SEED);
    assert_eq!(Limits::SEED.max_blocks, 1_048_576);
    assert_eq!(Limits::SEED.max_blocks_per_rank, 262_144);
    assert_eq!(Limits::SEED.max_ownerships, 8_388_608);
    assert_eq!(Limits::SEED.max_owners_per_node, 4_096);
}

#[test]
fn heap_figure_grows_with_content_and_comes_back_down() {
    let mut index = KvIndex::default();
    let empty = index.stats().heap_bytes;
    for w in 0..64 {
        let tokens: Vec<u64> = (0..64).map(|i| if i < 16 { i } else { w * 1000 + i }).collect();
        index.apply_stored(rank(w), None, &chain(&tokens));
    }
    let full = index.stats();
    // At least the per-block payload: a 16-byte lookup entry per ownership, 16-byte edge per node.
    assert!(full.heap_bytes > empty + 16 * (full.ownerships + full.nodes), "{full:?}");
    index.retain_ranks(|_| false);
    assert!(index.stats().heap_bytes < full.heap_bytes);
    index.check_invariants();
}

/// A segment split into a run a block by removals in its middle, then pruned back to its first
/// block from the tail, gives back its run list: each pinned block holds a few dozen bytes,
/// not the 8 KiB list of the runs it once had (one rank could pin 2 GiB that way).
#[test]
fn a_segment_pruned_back_to_one_block_gives_its_run_list_back() {
    let mut index = KvIndex::default();
    let baseline = index.stats().heap_bytes;
    const SEGMENTS: u64 = 256;
    for segment in 0..SEGMENTS {
        let tokens: Vec<u64> = (0..1024).map(|i| segment * 10_000 + i).collect();
        index.apply_stored(rank(1), None, &chain(&tokens));
        let odd: Vec<u64> = tokens.iter().copied().filter(|t| t % 2 == 1).map(engine).collect();
        index.apply_removed(rank(1), &odd);
        let even_from_tail: Vec<u64> = tokens.iter().rev().copied().filter(|t| t % 2 == 0).map(engine).collect();
        index.apply_removed(rank(1), &even_from_tail[..even_from_tail.len() - 1]);
    }
    index.check_invariants();
    let stats = index.stats();
    assert_eq!((stats.nodes, stats.ownerships), (SEGMENTS as usize, SEGMENTS as usize), "one block pinned each");
    let per_block = (stats.heap_bytes - baseline) / SEGMENTS as usize;
    assert!(per_block < 1024, "{per_block} bytes held per pinned block");
}

#[test]
fn a_shared_prefix_is_one_run_split_only_where_owners_diverge() {
    let mut index = KvIndex::default();
    let prefix: Vec<u64> = (0..30).collect();
    index.apply_stored(rank(1), None, &chain(&prefix));
    // Continuing its own leaf grows the run in place.
    index.apply_stored(rank(1), Some(engine(29)), &chain(&[100, 101]));
    assert_eq!((index.stats().nodes, index.stats().runs), (32, 1));
    // A second rank sharing the first 30 blocks: one split where it branches, one new run.
    let theirs: Vec<u64> = prefix.iter().copied().chain([200]).collect();
    let outcome = index.apply_stored(rank(2), None, &chain(&theirs));
    assert_eq!(outcome.get(KvResult::Applied), 31, "outcomes still count blocks");
    assert_eq!((index.stats().nodes, index.stats().runs, index.stats().ownerships), (33, 3, 63));
    // Removing a middle block splits the shared run around it, for that rank only.
    index.apply_removed(rank(2), &[engine(10)]);
    assert_eq!((index.stats().nodes, index.stats().runs), (33, 5));
    assert_eq!(sorted(&index, &theirs), vec![(rank(1), 30), (rank(2), 10)]);
    // Evicting the leaf tail first shortens it, then frees it.
    index.apply_removed(rank(1), &[engine(101), engine(100)]);
    assert_eq!((index.stats().nodes, index.stats().runs), (31, 4));
    index.check_invariants();
}
