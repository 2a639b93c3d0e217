use std::time::{Duration, Instant};

use continuum_proto::model::{Capacity, Load, LoadSample};

use super::*;

const STALE: Duration = Duration::from_secs(3);

fn load(decode: Option<u64>, prefill: Option<u64>, used: Option<u64>) -> Load {
    Load { active_decode_blocks: decode, active_prefill_tokens: prefill, kv_used_blocks: used }
}

fn capacity(total_kv_blocks: Option<u64>, max_num_batched_tokens: Option<u64>) -> Capacity {
    Capacity { total_kv_blocks, max_num_batched_tokens, ..Capacity::default() }
}

fn inputs(capacity: &Capacity, block_size: Option<u32>, prompt_tokens: u64, standing: Standing) -> CostInputs<'_> {
    CostInputs {
        capacity,
        block_size,
        prompt_tokens,
        standing,
        dispatched: RankBacklog::default(),
        handover: false,
        queued_prefill_tokens: 0,
        prefill_load_scale: 1.0,
    }
}

#[test]
fn standing_of_a_rank_by_its_last_sample() {
    let now = Instant::now();
    let fresh = now - Duration::from_secs(1);
    let stale = now - STALE;
    // (case, phase, sample, expected)
    let cases: &[(&str, Phase, Option<LoadSample>, Standing)] = &[
        ("never published is quiet", Phase::Decode, None, Standing::Quiet),
        ("fresh decode blocks", Phase::Decode, Some(sample(load(Some(7), None, Some(9)), fresh)), Standing::Fresh(7)),
        (
            "nil decode blocks fall back to kv_used",
            Phase::Decode,
            Some(sample(load(None, None, Some(9)), fresh)),
            Standing::Fresh(9),
        ),
        (
            "fresh prefill tokens",
            Phase::Prefill,
            Some(sample(load(None, Some(300), Some(9)), fresh)),
            Standing::Fresh(300),
        ),
        (
            "fresh without the phase's field",
            Phase::Prefill,
            Some(sample(load(None, None, Some(0)), fresh)),
            Standing::Unknown,
        ),
        ("fresh with every field nil", Phase::Decode, Some(sample(load(None, None, None), fresh)), Standing::Unknown),
        (
            "stale at exactly max_staleness",
            Phase::Decode,
            Some(sample(load(None, None, Some(0)), stale)),
            Standing::Quiet,
        ),
        (
            "stale idle sample is quiet",
            Phase::Prefill,
            Some(sample(load(None, Some(0), Some(0)), stale)),
            Standing::Quiet,
        ),
        (
            "stale sample under load is silent",
            Phase::Decode,
            Some(sample(load(None, None, Some(4)), stale)),
            Standing::Unknown,
        ),
        (
            "stale backlog in another field is silent",
            Phase::Decode,
            Some(sample(load(Some(0), Some(12), None), stale)),
            Standing::Unknown,
        ),
        (
            "stale sample with blocks only cached, nothing decoding, is quiet",
            Phase::Decode,
            Some(sample(load(Some(0), Some(0), Some(40)), stale)),
            Standing::Quiet,
        ),
        (
            "and quiet in the prefill phase too",
            Phase::Prefill,
            Some(sample(load(Some(0), None, Some(40)), stale)),
            Standing::Quiet,
        ),
    ];
    for (name, phase, sample, expected) in cases {
        assert_eq!(standing(*phase, sample.as_ref(), STALE, now), *expected, "{name}");
    }
}

fn sample(load: Load, received_at: Instant) -> LoadSample {
    LoadSample { load, received_at }
}

/// (case, phase, capacity, block size, prompt tokens, standing, expected cost)
type Formula<'a> = (&'a str, Phase, &'a Capacity, Option<u32>, u64, Standing, Option<f64>);

#[test]
fn cost_formulas() {
    let full = capacity(Some(1000), Some(2048));
    let no_kv = capacity(None, Some(2048));
    let no_batch = capacity(Some(1000), None);
    let zero = capacity(Some(0), Some(0));
    let cases: &[Formula<'_>] = &[
        (
            "prefill = tokens / max_num_batched_tokens",
            Phase::Prefill,
            &full,
            Some(16),
            999,
            Standing::Fresh(512),
            Some(0.25),
        ),
        ("prefill of a quiet rank is zero", Phase::Prefill, &full, Some(16), 999, Standing::Quiet, Some(0.0)),
        ("prefill needs max_num_batched_tokens", Phase::Prefill, &no_batch, Some(16), 1, Standing::Fresh(1), None),
        (
            "decode = (blocks + ceil(prompt / bs)) / total",
            Phase::Decode,
            &full,
            Some(16),
            33,
            Standing::Fresh(97),
            Some(0.1),
        ),
        ("decode of a quiet rank counts the request", Phase::Decode, &full, Some(16), 160, Standing::Quiet, Some(0.01)),
        ("decode with no prompt", Phase::Decode, &full, Some(16), 0, Standing::Fresh(500), Some(0.5)),
        ("decode needs total_kv_blocks", Phase::Decode, &no_kv, Some(16), 1, Standing::Fresh(1), None),
        ("decode needs a block size", Phase::Decode, &full, None, 1, Standing::Fresh(1), None),
        ("zero capacities are undefined", Phase::Decode, &zero, Some(16), 1, Standing::Fresh(1), None),
        ("zero capacities are undefined (prefill)", Phase::Prefill, &zero, Some(16), 1, Standing::Fresh(1), None),
        ("unknown standing has no cost", Phase::Decode, &full, Some(16), 1, Standing::Unknown, None),
    ];
    for (name, phase, capacity, block_size, prompt, standing, expected) in cases {
        let got = cost(*phase, &inputs(capacity, *block_size, *prompt, *standing)).map(Cost::as_f64);
        assert_eq!(got, *expected, "{name}");
    }
}

#[test]
fn unanswered_dispatches_add_to_the_backlog() {
    let full = capacity(Some(100), Some(1000));
    let unanswered = RankBacklog {
        prefill_tokens: 250,
        unanswered_prefill_tokens: 250,
        decode_blocks: 9,
        in_flight_decode_blocks: 9,
        ..Default::default()
    };
    let with = |standing| CostInputs { dispatched: unanswered, ..inputs(&full, Some(16), 16, standing) };
    assert_eq!(cost(Phase::Prefill, &with(Standing::Fresh(250))).map(Cost::as_f64), Some(0.5));
    assert_eq!(cost(Phase::Decode, &with(Standing::Fresh(10))).map(Cost::as_f64), Some(0.2));
    assert_eq!(cost(Phase::Decode, &with(Standing::Quiet)).map(Cost::as_f64), Some(0.1), "a quiet rank fills up too");
    // Measured by the control plane: 5 foreign blocks + 9 in flight + 1 for the request,
    // whatever the (lagging) sample says.
    let measured = RankBacklog { foreign_decode_blocks: Some(5), ..unanswered };
    let with = |standing| CostInputs { dispatched: measured, ..inputs(&full, Some(16), 16, standing) };
    assert_eq!(cost(Phase::Decode, &with(Standing::Fresh(700))).map(Cost::as_f64), Some(0.15));
    assert_eq!(cost(Phase::Decode, &with(Standing::Unknown)).map(Cost::as_f64), None, "freshness still rules");
    // An engine that counts its queued prompts already counts the 250 dispatched tokens it
    // has received: measured, 50 of its 300 are foreign, and 50 + 250 is the backlog.
    let shared = RankBacklog { foreign_prefill_tokens: Some(50), ..unanswered };
    let with = |standing| CostInputs { dispatched: shared, ..inputs(&full, Some(16), 16, standing) };
    assert_eq!(cost(Phase::Prefill, &with(Standing::Fresh(300))).map(Cost::as_f64), Some(0.3));
    assert_eq!(
        cost(Phase::Prefill, &with(Standing::Quiet)).map(Cost::as_f64),
        Some(0.25),
        "no fresh sample, no foreign part"
    );
    assert_eq!(cost(Phase::Prefill, &with(Standing::Unknown)).map(Cost::as_f64), None);
}

#[test]
fn the_prefill_backlog_adds_a_fresh_samples_foreign_part_or_the_whole_sample() {
    let queued = RankBacklog {
        prefill_tokens: 400,
        prefilled_tokens: 100,
        unanswered_prefill_tokens: 150,
        ..Default::default()
    };
    assert_eq!(queued.prefill_backlog(None), 300, "no fresh sample: the fleet's queue, less what is done");
    assert_eq!(
        queued.prefill_backlog(Some(500)),
        650,
        "not measured: the seed's sample plus the dispatches no sample has answered"
    );
    let measured = RankBacklog { foreign_prefill_tokens: Some(20), ..queued };
    assert_eq!(measured.prefill_backlog(Some(500)), 320);
    assert_eq!(measured.prefill_backlog(None), 300, "a stale sample's foreign part is not added");
}

#[test]
fn a_rank_that_prefills_is_charged_its_queued_prefill() {
    let full = capacity(Some(100), Some(1000));
    // 16 blocks decoding, a 16-token request, and 17 tokens queued (2 blocks, rounded up).
    let queued = |scale| CostInputs {
        queued_prefill_tokens: 17,
        prefill_load_scale: scale,
        ..inputs(&full, Some(16), 16, Standing::Fresh(16))
    };
    let decode = |scale| cost(Phase::Decode, &queued(scale)).map(Cost::as_f64);
    assert_eq!(decode(0.0), Some(0.17), "scale 0: the seed's decode cost");
    assert_eq!(decode(1.0), Some(0.19));
    assert_eq!(decode(3.0), Some(0.23));
    assert_eq!(decode(1.25), Some(0.20), "2.5 blocks rounds to an integer backlog, so equal queues tie");
    assert_eq!(cost(Phase::Prefill, &queued(3.0)).map(Cost::as_f64), Some(0.016), "the prefill phase is the seed's");
}

#[test]
fn costs_compare_exactly() {
    let a = Cost { backlog: 1, capacity: 3, own: 0, held: 1 };
    let b = Cost { backlog: 2, capacity: 6, own: 1, held: 2 };
    let c = Cost { backlog: u64::MAX, capacity: u64::MAX - 1, own: 0, held: u64::MAX };
    let d = Cost { backlog: u64::MAX - 1, capacity: u64::MAX - 2, own: 0, held: u64::MAX - 1 };
    assert_eq!(a, b, "the request's own share is not compared");
    assert!(c < d, "(2^64-1)/(2^64-2) < (2^64-2)/(2^64-3), which f64 cannot tell apart");
}

fn scored(cost: Option<(u64, u64)>, fresh: bool, stalled: bool) -> Scored {
    let cost = cost.map(|(backlog, capacity)| Cost { backlog, capacity, own: 0, held: backlog });
    Scored { cost, fresh, heard: fresh, stalled, last_dispatch: LastDispatch::default() }
}

/// A fresh, healthy rank whose `backlog` (of `capacity`) includes the request's `own` blocks.
fn with_request(backlog: u64, own: u64, capacity: u64) -> Scored {
    Scored {
        cost: Some(Cost { backlog, capacity, own, held: backlog }),
        fresh: true,
        heard: true,
        stalled: false,
        last_dispatch: LastDispatch::default(),
    }
}

/// [`with_request`] for a rank whose `backlog` also weighs a queued prefill: its KV cache would
/// hold only `held` with the request.
fn with_queued_prefill(backlog: u64, own: u64, capacity: u64, held: u64) -> Scored {
    let scored = with_request(backlog, own, capacity);
    Scored { cost: scored.cost.map(|cost| Cost { held, ..cost }), ..scored }
}

/// `scored` as last sent a dispatch at `last_dispatch`.
fn sent(scored: Scored, last_dispatch: LastDispatch) -> Scored {
    Scored { last_dispatch, ..scored }
}

#[test]
fn contender_rules() {
    let now = Instant::now();
    let cases: &[(&str, Vec<Scored>, Reason, Vec<usize>)] = &[
        ("no candidates", vec![], Reason::RoundRobinStale, vec![]),
        (
            "lowest defined cost wins",
            vec![scored(Some((5, 10)), true, false), scored(Some((1, 10)), true, false)],
            Reason::Load,
            vec![1],
        ),
        (
            "equal costs tie (different capacities)",
            vec![
                scored(Some((2, 10)), true, false),
                scored(Some((4, 20)), true, false),
                scored(Some((5, 20)), true, false),
            ],
            Reason::Load,
            vec![0, 1],
        ),
        (
            "a rank at most one request busier ties with the best",
            vec![with_request(30, 10, 100), with_request(20, 10, 100), with_request(31, 10, 100)],
            Reason::Load,
            vec![0, 1],
        ),
        (
            "one request busier, on different capacities",
            vec![with_request(40, 20, 200), with_request(10, 5, 100)],
            Reason::Load,
            vec![0, 1],
        ),
        (
            // The small rank's 1,500 blocks of the request would take it past its capacity
            // (3,500 of 2,000), the large one's not (7,500 of 10,000).
            "a rank the request would overfill ties with none that it would not",
            vec![with_request(7_500, 1_500, 10_000), with_request(2_500, 1_500, 2_000)],
            Reason::Load,
            vec![0],
        ),
        (
            // A prompt of 6,250 blocks: the empty rank's cost with it is the busier one's
            // without it (3,500 used), but that one would hold 9,750 of its 10,000, past seven
            // eighths: the empty rank alone takes it.
            "a long request ties no rank it would leave nearly full with the best",
            vec![with_request(6_250, 6_250, 10_000), with_request(9_750, 6_250, 10_000)],
            Reason::Load,
            vec![0],
        ),
        (
            "an equal cost ties whatever it leaves free",
            vec![with_request(9_500, 500, 10_000), with_request(9_500, 500, 10_000)],
            Reason::Load,
            vec![0, 1],
        ),
        (
            // 900 blocks used and 600 of the request hold 1,500 of its 2,000; a queued prefill
            // weighs 600 more, which is time, not memory.
            "a queued prefill's weight does not count as KV the request would overfill",
            vec![with_request(7_500, 1_500, 10_000), with_queued_prefill(2_100, 600, 2_000, 1_500)],
            Reason::Load,
            vec![0, 1],
        ),
        (
            // Equal costs (1,001 of 1,000), in either order: the first would hold 1,001
            // blocks, the second 901 (its queued prefill weighs 100 more, as time).
            "of equally cheap ranks, one the request would overfill ties with none",
            vec![with_request(1_001, 2, 1_000), with_queued_prefill(1_001, 2, 1_000, 901)],
            Reason::Load,
            vec![1],
        ),
        (
            "of equally cheap ranks, one the request would overfill ties with none, in any order",
            vec![with_queued_prefill(1_001, 2, 1_000, 901), with_request(1_001, 2, 1_000)],
            Reason::Load,
            vec![0],
        ),
        (
            "ranks the request would all overfill tie as before",
            vec![with_request(12_000, 1_500, 10_000), with_request(2_500, 1_500, 2_000)],
            Reason::Load,
            vec![0, 1],
        ),
        (
            "more than one request busier loses",
            vec![with_request(200, 10, 1000), with_request(189, 10, 1000)],
            Reason::Load,
            vec![1],
        ),
        (
            "of the tied, the rank that went longest without a dispatch",
            vec![
                sent(with_request(30, 10, 100), LastDispatch::Folded(5)),
                sent(with_request(20, 10, 100), LastDispatch::Folded(7)),
                sent(with_request(25, 10, 100), LastDispatch::Folded(5)),
            ],
            Reason::Load,
            vec![0, 2],
        ),
        (
            "a dispatch the fleet's sums do not hold yet is the most recent",
            vec![
                sent(with_request(20, 10, 100), LastDispatch::Local(now)),
                sent(with_request(20, 10, 100), LastDispatch::Folded(u64::MAX)),
            ],
            Reason::Load,
            vec![1],
        ),
        (
            "recency does not outweigh a request's difference in cost",
            vec![
                sent(with_request(21, 10, 100), LastDispatch::Folded(1)),
                sent(with_request(10, 10, 100), LastDispatch::Folded(9)),
            ],
            Reason::Load,
            vec![1],
        ),
        (
            "a quiet rank competes on its zero backlog",
            vec![scored(Some((3, 10)), true, false), scored(Some((0, 10)), false, false)],
            Reason::Load,
            vec![1],
        ),
        (
            "silent under load is not chosen while another has a cost",
            vec![scored(None, false, false), scored(Some((9, 10)), true, false)],
            Reason::Load,
            vec![1],
        ),
        (
            "no fresh sample anywhere: every candidate rotates",
            vec![scored(Some((0, 10)), false, false), scored(None, false, false), scored(Some((0, 10)), false, true)],
            Reason::RoundRobinStale,
            vec![0, 1, 2],
        ),
        (
            "fresh samples without the phase's field: a stalled rank sits out the rotation",
            vec![
                Scored { heard: true, ..scored(None, false, false) },
                Scored { heard: false, ..scored(None, false, true) },
                scored(Some((0, 10)), false, false),
            ],
            Reason::RoundRobinStale,
            vec![0, 2],
        ),
        (
            "fresh samples without the phase's field, every rank stalled: they rotate anyway",
            vec![Scored { heard: true, ..scored(None, false, true) }, scored(None, false, true)],
            Reason::RoundRobinStale,
            vec![0, 1],
        ),
        (
            "no fresh sample anywhere: a round robin across replicas, the longest idle first",
            vec![
                sent(scored(None, false, false), LastDispatch::Folded(4)),
                sent(scored(None, false, false), LastDispatch::Folded(3)),
                sent(scored(Some((0, 10)), false, false), LastDispatch::Local(now)),
            ],
            Reason::RoundRobinStale,
            vec![1],
        ),
        (
            "a fresh sample without a defined cost: the lowest defined cost (a quiet rank's) wins",
            vec![scored(None, true, false), scored(Some((0, 10)), false, false), scored(None, false, false)],
            Reason::Load,
            vec![1],
        ),
        (
            "fresh samples but no defined cost anywhere: every candidate rotates",
            vec![scored(None, true, false), scored(None, false, false)],
            Reason::RoundRobinStale,
            vec![0, 1],
        ),
        (
            "stalled is passed over while another has a cost",
            vec![scored(Some((0, 10)), true, true), scored(Some((9, 10)), false, false)],
            Reason::Load,
            vec![1],
        ),
        (
            "stalled everywhere: lowest cost still wins",
            vec![scored(Some((5, 10)), true, true), scored(Some((1, 10)), true, true), scored(None, false, false)],
            Reason::Load,
            vec![1],
        ),
    ];
    for (name, scored, reason, expected) in cases {
        let (got, chosen) = contenders(scored);
        assert_eq!((got, chosen.into_vec()), (*reason, expected.clone()), "{name}");
    }
}

/// The prefill term's sample is fresh on the picker's side of the boundary, as its standing is:
/// younger than `max_staleness`.
#[test]
fn a_phase_load_is_fresh_only_younger_than_max_staleness() {
    let now = Instant::now() + Duration::from_secs(60);
    let busy = load(None, Some(300), None);
    let at = |age: Duration| fresh_load(Phase::Prefill, Some(&sample(busy, now - age)), STALE, now);
    assert_eq!(at(STALE - Duration::from_millis(1)), Some(300));
    assert_eq!(at(STALE), None, "exactly max_staleness old is stale");
    assert_eq!(fresh_load(Phase::Prefill, None, STALE, now), None);
    assert_eq!(fresh_load(Phase::Decode, Some(&sample(busy, now)), STALE, now), None, "it carries no decode field");
}
