use super::*;

const TTL: Duration = Duration::from_secs(2);

fn rank(worker_id: u64) -> RankKey {
    RankKey { worker_id, dp_rank: 0 }
}

fn chain(first: u64, len: u64) -> Vec<u64> {
    (first..first + len).collect()
}

#[test]
fn a_credited_chain_scores_the_longest_contiguous_prefix_of_the_query() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    assert_eq!(index.credit(rank(1), &Folded::of(&[10, 11, 12, 13]), true, now), ProvisionalResult::Credited);
    // Shares the first two blocks, then leaves the chain: a later match does not count.
    assert_eq!(index.merge(&Folded::of(&[10, 11, 99, 13]), &[], now), [(rank(1), 2)]);
    assert_eq!(index.merge(&Folded::of(&[10, 11, 12, 13, 14]), &[], now), [(rank(1), 4)]);
    assert!(index.merge(&Folded::of(&[11, 12]), &[], now).is_empty(), "a match must start at the first block");
    assert!(index.merge(&Folded::of(&[]), &[], now).is_empty());
}

#[test]
fn each_rank_scores_the_larger_of_its_indexed_and_provisional_overlap() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    index.credit(rank(1), &Folded::of(&chain(10, 3)), true, now);
    index.credit(rank(2), &Folded::of(&chain(10, 1)), true, now);
    let query = chain(10, 8);
    let indexed = [(rank(3), 1), (rank(2), 5), (rank(1), 2)];
    assert_eq!(index.merge(&Folded::of(&query), &indexed, now), [(rank(3), 1), (rank(1), 3), (rank(2), 5)]);
}

#[test]
fn a_chain_stops_counting_when_its_ttl_passes_and_is_swept_as_expired() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    index.credit(rank(1), &Folded::of(&chain(10, 4)), true, now);
    assert_eq!(index.merge(&Folded::of(&chain(10, 4)), &[], now + TTL - Duration::from_millis(1)), [(rank(1), 4)]);
    assert!(
        index.merge(&Folded::of(&chain(10, 4)), &[], now + TTL).is_empty(),
        "expired at its deadline, before the sweep"
    );
    assert_eq!(index.size(), (1, 4));
    index.expire(now + TTL);
    assert_eq!(index.size(), (0, 0));
    let counts = index.take_counts();
    assert_eq!((counts.get(ProvisionalResult::Credited), counts.get(ProvisionalResult::Expired)), (1, 1));
    assert_eq!(index.take_counts(), ProvisionalCounts::default(), "counts are taken once");
}

/// A reload that shortens `dynamo.kv.provisional_ttl` shortens the chains already held: each
/// counts for the TTL in force, from when it was credited.
#[test]
fn a_shorter_ttl_applies_to_the_chains_already_held() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(Duration::from_secs(60));
    index.credit(rank(1), &Folded::of(&chain(10, 4)), true, now);
    index.set_ttl(TTL);
    assert_eq!(index.merge(&Folded::of(&chain(10, 4)), &[], now + TTL - Duration::from_millis(1)), [(rank(1), 4)]);
    assert!(index.merge(&Folded::of(&chain(10, 4)), &[], now + TTL).is_empty(), "two seconds, not sixty");
    index.expire(now + TTL);
    assert_eq!(index.size(), (0, 0));
}

#[test]
fn a_zero_ttl_turns_the_credit_off_and_drops_what_was_held() {
    let now = Instant::now();
    let mut off = ProvisionalIndex::new(Duration::ZERO);
    assert_eq!(off.credit(rank(1), &Folded::of(&chain(10, 4)), true, now), ProvisionalResult::Refused);
    assert!(off.merge(&Folded::of(&chain(10, 4)), &[], now).is_empty());

    let mut on = ProvisionalIndex::new(TTL);
    on.credit(rank(1), &Folded::of(&chain(10, 4)), true, now);
    on.set_ttl(Duration::ZERO);
    assert!(on.merge(&Folded::of(&chain(10, 4)), &[], now).is_empty());
    assert_eq!(on.size(), (0, 0));
}

#[test]
fn a_rank_that_is_not_live_earns_no_credit_and_a_departed_one_loses_its_chains() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    assert_eq!(index.credit(rank(9), &Folded::of(&chain(10, 4)), false, now), ProvisionalResult::Refused);
    index.credit(rank(1), &Folded::of(&chain(10, 4)), true, now);
    index.credit(rank(2), &Folded::of(&chain(10, 4)), true, now);
    index.retain_live(|r| r == rank(2));
    assert_eq!(index.merge(&Folded::of(&chain(10, 4)), &[], now), [(rank(2), 4)]);
    let counts = index.take_counts();
    assert_eq!((counts.get(ProvisionalResult::Refused), counts.get(ProvisionalResult::Departed)), (1, 1));
}

#[test]
fn a_chain_the_index_covers_is_dropped_as_confirmed() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    index.credit(rank(1), &Folded::of(&chain(10, 3)), true, now);
    // The index holds only two of its three blocks: not confirmed yet.
    assert_eq!(index.merge(&Folded::of(&chain(10, 6)), &[(rank(1), 2)], now), [(rank(1), 3)]);
    assert_eq!(index.size().0, 1);
    // Another rank's indexed blocks confirm nothing.
    index.merge(&Folded::of(&chain(10, 6)), &[(rank(2), 6)], now);
    assert_eq!(index.size().0, 1);
    assert_eq!(index.merge(&Folded::of(&chain(10, 6)), &[(rank(1), 5)], now), [(rank(1), 5)]);
    assert_eq!(index.size(), (0, 0));
    assert_eq!(index.take_counts().get(ProvisionalResult::Confirmed), 1);
}

#[test]
fn a_longer_chain_replaces_its_prefix_on_the_same_rank() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    index.credit(rank(1), &Folded::of(&chain(10, 2)), true, now);
    index.credit(rank(1), &Folded::of(&chain(10, 2)), true, now);
    index.credit(rank(1), &Folded::of(&chain(10, 5)), true, now);
    assert_eq!(index.size(), (1, 5));
    index.credit(rank(2), &Folded::of(&chain(10, 2)), true, now);
    assert_eq!(index.size(), (2, 7), "another rank's chain is its own");
}

#[test]
fn a_rank_holds_at_most_its_bound_of_chains_and_loses_the_oldest() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    for i in 0..=MAX_CHAINS_PER_RANK as u64 {
        index.credit(rank(1), &Folded::of(&[1_000 * (i + 1)]), true, now);
    }
    assert_eq!(index.size().0, MAX_CHAINS_PER_RANK);
    assert!(index.merge(&Folded::of(&[1_000]), &[], now).is_empty(), "the oldest chain went");
    assert_eq!(index.merge(&Folded::of(&[2_000]), &[], now), [(rank(1), 1)]);
    assert_eq!(index.take_counts().get(ProvisionalResult::Evicted), 1);
}

#[test]
fn the_whole_index_holds_at_most_its_chain_and_hash_bounds() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    for i in 0..=MAX_CHAINS as u64 {
        index.credit(rank(i), &Folded::of(&[7]), true, now);
    }
    assert_eq!(index.size(), (MAX_CHAINS, MAX_CHAINS));
    assert!(index.merge(&Folded::of(&[7]), &[], now).iter().all(|(r, _)| *r != rank(0)), "the oldest chain went");

    let mut index = ProvisionalIndex::new(TTL);
    let half = chain(0, (MAX_HASHES / 2) as u64);
    index.credit(rank(1), &Folded::of(&half), true, now);
    index.credit(rank(2), &Folded::of(&half), true, now);
    assert_eq!(index.size(), (2, MAX_HASHES));
    index.credit(rank(3), &Folded::of(&[1]), true, now);
    assert_eq!(index.size(), (2, MAX_HASHES / 2 + 1));
    assert_eq!(index.merge(&Folded::of(&[0]), &[], now), [(rank(2), 1)]);
    assert_eq!(
        index.credit(rank(4), &Folded::of(&chain(0, MAX_HASHES as u64 + 1)), true, now),
        ProvisionalResult::Refused
    );
}

#[test]
fn a_long_chain_pushes_out_as_many_of_the_oldest_as_it_needs_room_from() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    let short = 2_000_u64;
    for i in 0..short {
        index.credit(rank(100 + i), &Folded::of(&[i + 1]), true, now);
    }
    index.credit(rank(1), &Folded::of(&chain(10_000, MAX_HASHES as u64 - short)), true, now);
    assert_eq!(index.size(), (short as usize + 1, MAX_HASHES));
    index.take_counts();
    assert_eq!(index.credit(rank(2), &Folded::of(&chain(1 << 40, short)), true, now), ProvisionalResult::Credited);
    assert_eq!(index.size(), (2, MAX_HASHES), "every short chain went, and only they");
    assert_eq!(index.take_counts().get(ProvisionalResult::Evicted), short);
    assert_eq!(index.merge(&Folded::of(&[10_000]), &[], now), [(rank(1), 1)]);
}

#[test]
fn labels_are_distinct_snake_case() {
    let mut labels: Vec<_> = ProvisionalResult::ALL.iter().map(|r| r.as_str()).collect();
    assert!(labels.iter().all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), ProvisionalResult::ALL.len());
}

/// Every chain credited leaves once, under one label, or is still held: the counts add up
/// through replacements, confirmations, bounds, departures, expiry and the credit turned off.
#[test]
fn every_credited_chain_is_accounted_for_once() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    let mut total = ProvisionalCounts::default();
    let mut take = |index: &mut ProvisionalIndex| {
        let counts = index.take_counts();
        for (result, n) in counts.iter() {
            total.add(result, n);
        }
        total
    };
    // Each rank's count of its chains is the chains' own, whatever took some away.
    let per_rank_true = |index: &ProvisionalIndex| {
        let mut counted: FastMap<RankKey, usize> = FastMap::default();
        index.chains.iter().for_each(|c| *counted.entry(c.rank).or_default() += 1);
        counted == index.per_rank
    };
    let balanced = |counts: ProvisionalCounts, held: usize| {
        let gone = [
            ProvisionalResult::Expired,
            ProvisionalResult::Confirmed,
            ProvisionalResult::Evicted,
            ProvisionalResult::Departed,
            ProvisionalResult::Replaced,
        ];
        counts.get(ProvisionalResult::Credited) == gone.iter().map(|r| counts.get(*r)).sum::<u64>() + held as u64
    };
    // The same prompt twice, then its next turn: two replacements.
    index.credit(rank(1), &Folded::of(&chain(10, 2)), true, now);
    index.credit(rank(1), &Folded::of(&chain(10, 2)), true, now);
    index.credit(rank(1), &Folded::of(&chain(10, 4)), true, now);
    let counts = take(&mut index);
    assert_eq!(counts.get(ProvisionalResult::Replaced), 2);
    assert!(balanced(counts, index.size().0) && per_rank_true(&index));
    // Confirmed by the index, pushed out by a rank's bound, departed.
    index.merge(&Folded::of(&chain(10, 4)), &[(rank(1), 4)], now);
    for i in 0..=MAX_CHAINS_PER_RANK as u64 {
        index.credit(rank(2), &Folded::of(&chain(1000 * (i + 1), 2)), true, now);
    }
    index.credit(rank(3), &Folded::of(&chain(5, 2)), true, now);
    index.retain_live(|r| r != rank(3));
    let counts = take(&mut index);
    assert_eq!(
        [ProvisionalResult::Confirmed, ProvisionalResult::Evicted, ProvisionalResult::Departed].map(|r| counts.get(r)),
        [1, 1, 1]
    );
    assert!(balanced(counts, index.size().0) && per_rank_true(&index));
    // Expired, then the credit turned off with a chain held.
    index.expire(now + TTL);
    index.credit(rank(4), &Folded::of(&chain(7, 2)), true, now + TTL);
    index.set_ttl(Duration::ZERO);
    let counts = take(&mut index);
    assert_eq!(counts.get(ProvisionalResult::Expired), MAX_CHAINS_PER_RANK as u64);
    assert_eq!(index.size(), (0, 0));
    assert!(balanced(counts, 0) && index.per_rank.is_empty());
}

/// A chain past its TTL that no sweep has reached is expired, not confirmed, even when the
/// index now covers it.
#[test]
fn a_chain_past_its_ttl_is_not_confirmed() {
    let now = Instant::now();
    let mut index = ProvisionalIndex::new(TTL);
    index.credit(rank(1), &Folded::of(&chain(10, 2)), true, now);
    index.credit(rank(2), &Folded::of(&chain(10, 3)), true, now + TTL / 2);
    // Rank 2's live chain is confirmed; rank 1's expired one waits for the sweep.
    index.merge(&Folded::of(&chain(10, 3)), &[(rank(1), 3), (rank(2), 3)], now + TTL);
    let counts = index.take_counts();
    assert_eq!(counts.get(ProvisionalResult::Confirmed), 1);
    index.expire(now + TTL);
    assert_eq!(index.take_counts().get(ProvisionalResult::Expired), 1);
    assert_eq!(index.size(), (0, 0));
}

proptest::proptest! {
    /// Folded chains give the common prefix and the prefix test of the block hashes themselves,
    /// including chains that share blocks after they part (hashes from a small alphabet).
    #[test]
    fn folded_chains_agree_with_the_block_hashes(
        a in proptest::collection::vec(0u64..4, 0..40),
        b in proptest::collection::vec(0u64..4, 0..40),
    ) {
        let walked = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let (fa, fb) = (Folded::of(&a).0, Folded::of(&b).0);
        for hint in 0..=a.len().max(b.len()) + 1 {
            proptest::prop_assert_eq!(common_prefix(&fa, &fb, hint), walked, "hint {}", hint);
        }
        proptest::prop_assert_eq!(is_prefix(&fa, &fb), b.starts_with(&a));
        proptest::prop_assert_eq!(is_prefix(&fb, &fa), a.starts_with(&b));
    }
}
