use std::time::{Duration, Instant};

use continuum_proto::model::{Load, LoadSample, PickerParams};

use super::*;

fn weights(credit: f64, scale: f64) -> Weights {
    Weights { overlap_score_credit: credit, prefill_load_scale: scale, temperature: 0.0 }
}

fn load(active_prefill_tokens: u64, active_decode_blocks: u64) -> RankLoad {
    RankLoad { active_prefill_tokens, active_decode_blocks }
}

#[test]
fn worker_logit_on_hand_computed_examples() {
    // isl 100, bs 16, 3 blocks held (2 by requests in flight), 200 prefill tokens and 10
    // decode blocks queued: cached 48; raw 200 + 52 + 48 = 300 tokens = 18.75 blocks; credit
    // 3; adjusted 15.75; decode 10 + (7 - 2) = 15; cost 15.75 + 15 = 30.75.
    let logit = worker_logit(load(200, 10), 3, 2, Prompt::new(100, 16), &weights(1.0, 1.0));
    let expected = Logit {
        overlap_blocks: 3,
        shared_blocks: 2,
        cached_tokens: 48,
        raw_prefill_tokens: 300,
        raw_prefill_blocks: 18.75,
        overlap_credit_blocks: 3.0,
        adjusted_prefill: 15.75,
        decode_cost_blocks: 15,
        cost: 30.75,
    };
    assert_eq!(logit, expected);
    // The same rank with nothing in flight sharing the prefix: decode 10 + 7.
    let idle = worker_logit(load(200, 10), 3, 0, Prompt::new(100, 16), &weights(1.0, 1.0));
    assert_eq!((idle.adjusted_prefill, idle.decode_cost_blocks, idle.cost), (15.75, 17, 32.75));

    // credit 0.5, scale 2, isl 64, 2 of 4 blocks held, 32 prefill tokens, 5 decode blocks:
    // raw 96 tokens = 6 blocks; credit 1; adjusted 5, the 2 queued blocks among them; both held
    // blocks in flight: decode 5 + 2 = 7; cost 2 * 5 + 7 = 17 (the queue is scaled too).
    let logit = worker_logit(load(32, 5), 2, 2, Prompt::new(64, 16), &weights(0.5, 2.0));
    assert_eq!((logit.adjusted_prefill, logit.decode_cost_blocks, logit.cost), (5.0, 7, 17.0));
}

#[test]
fn cached_tokens_cap_at_the_prompt_and_terms_never_go_negative() {
    // 5 blocks held of a 20-token prompt (2 blocks): cached 20, credit 5 > 1.25 raw blocks.
    let logit = worker_logit(load(0, 0), 5, 9, Prompt::new(20, 16), &weights(1.0, 2.0));
    assert_eq!(logit.cached_tokens, 20);
    assert_eq!(logit.raw_prefill_tokens, 20, "the seed's raw prefill tokens: cached tokens cancel");
    assert_eq!((logit.adjusted_prefill, logit.decode_cost_blocks, logit.cost), (0.0, 0, 0.0), "active capped at held");
    // Saturating, not overflowing, at the extremes.
    let huge =
        worker_logit(load(u64::MAX, u64::MAX), u32::MAX, u32::MAX, Prompt::new(u64::MAX, 16), &weights(1.0, 1.0));
    assert!(huge.cost.is_finite());
}

#[test]
fn the_stale_and_conditional_costs() {
    let prompt = Prompt::new(100, 16);
    assert_eq!(stale_cost(3, 0, prompt, &weights(1.0, 1.0)), 6.25 - 3.0);
    assert_eq!(stale_cost(3, 0, prompt, &weights(0.5, 1.0)), 6.25 - 1.5);
    assert_eq!(stale_cost(3, 320, prompt, &weights(1.0, 1.0)), 6.25 + 20.0 - 3.0, "320 tokens left to prefill");
    let logit = worker_logit(load(200, 10), 3, 3, prompt, &weights(1.0, 1.0));
    assert_eq!(conditional_decode_cost(&logit), 14.0 - 3.0);
    let covered = worker_logit(load(0, 0), 7, 7, prompt, &weights(1.0, 1.0));
    assert_eq!(conditional_decode_cost(&covered), 0.0, "never below zero");
}

#[test]
fn block_size_zero_counts_as_one() {
    assert_eq!(Prompt::new(10, 0), Prompt { isl: 10, block_size: 1 });
    assert_eq!(Prompt::new(33, 16).blocks(), 3);
}

#[test]
fn unusable_weights_count_as_zero() {
    let params = PickerParams {
        overlap_score_credit: f64::NAN,
        prefill_load_scale: -1.0,
        router_temperature: f64::INFINITY,
        ..PickerParams::default()
    };
    assert_eq!(Weights::new(&params), weights(0.0, 0.0));
    let defaults = Weights::new(&PickerParams::default());
    assert_eq!(defaults, weights(1.0, 1.0));
}

#[test]
fn rank_load_takes_the_phase_backlog_and_the_other_field_when_fresh() {
    let now = Instant::now();
    let max = Duration::from_secs(3);
    let fresh = |load: Load| LoadSample { load, received_at: now - Duration::from_secs(1) };
    let stale = |load: Load| LoadSample { load, received_at: now - Duration::from_secs(5) };
    let both = Load { active_prefill_tokens: Some(100), kv_used_blocks: Some(7), ..Load::default() };
    let vllm = Load { kv_used_blocks: Some(7), ..Load::default() };
    let unanswered = RankBacklog {
        prefill_tokens: 50,
        unanswered_prefill_tokens: 50,
        decode_blocks: 3,
        in_flight_decode_blocks: 3,
        ..Default::default()
    };
    // (case, phase, sample, expected)
    type Case = (&'static str, Phase, Option<LoadSample>, (Option<RankLoad>, bool));
    let cases: Vec<Case> = vec![
        ("prefill worker, fresh", Phase::Prefill, Some(fresh(both)), (Some(load(150, 10)), true)),
        ("aggregated worker, fresh", Phase::Decode, Some(fresh(both)), (Some(load(150, 10)), true)),
        ("aggregated vllm worker: no prefill tokens", Phase::Decode, Some(fresh(vllm)), (Some(load(50, 10)), true)),
        ("vllm prefill worker: backlog unknown", Phase::Prefill, Some(fresh(vllm)), (None, false)),
        ("never published: quiet", Phase::Prefill, None, (Some(load(50, 3)), false)),
        (
            "stale and idle: quiet, stale fields ignored",
            Phase::Decode,
            Some(stale(Load::default())),
            (Some(load(50, 3)), false),
        ),
        ("stale under load: unknown", Phase::Decode, Some(stale(vllm)), (None, false)),
    ];
    for (case, phase, sample, expected) in cases {
        assert_eq!(rank_load(phase, sample.as_ref(), unanswered, false, max, now), expected, "{case}");
    }
    // A decode worker of a pair gets the request after its prefill: of its 10 blocks, the 2
    // expected to end by then do not count.
    let ending = RankBacklog { ending_decode_blocks: 2, ..unanswered };
    let sample = fresh(vllm);
    assert_eq!(rank_load(Phase::Decode, Some(&sample), ending, true, max, now), (Some(load(50, 8)), true));
    assert_eq!(rank_load(Phase::Decode, Some(&sample), ending, false, max, now), (Some(load(50, 10)), true));
    // Measured by the control plane, 30 of the sample's 100 queued tokens are foreign: the
    // other 70 are the fleet's 50 and an answered prompt's, not added again.
    let measured = RankBacklog { foreign_prefill_tokens: Some(30), ..unanswered };
    for phase in [Phase::Prefill, Phase::Decode] {
        assert_eq!(rank_load(phase, Some(&fresh(both)), measured, false, max, now), (Some(load(80, 10)), true));
    }
    assert_eq!(rank_load(Phase::Prefill, None, measured, false, max, now), (Some(load(50, 3)), false));
}

fn scored(cost: Option<f64>, fresh: bool, stalled: bool, stale_cost: f64) -> Scored {
    Scored { cost, fresh, heard: fresh, stalled, full: false, stale_cost, last_dispatch: LastDispatch::default() }
}

#[test]
fn contenders_follow_the_seed_rules() {
    let fresh = |cost| scored(Some(cost), true, false, 0.0);
    let quiet = |cost| scored(Some(cost), false, false, 0.0);
    let unknown = |stale_cost| scored(None, false, false, stale_cost);
    let stale = |stale_cost| scored(Some(1.0), false, false, stale_cost);
    let full = |cost| Scored { full: true, ..scored(cost, true, false, 0.0) };
    // (rule, scored, temperature, expected)
    type Case = (&'static str, Vec<Scored>, f64, (Reason, Draw));
    let cases: Vec<Case> = vec![
        (
            "fresh and quiet compete, unknown sits out",
            vec![fresh(5.0), quiet(3.0), unknown(-100.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "a fresh rank whose card lacks its capacity has no cost, and a quiet one's wins",
            vec![scored(None, true, false, 0.0), quiet(3.0), unknown(-100.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "lowest ties rotate",
            vec![fresh(5.0), fresh(6.0), fresh(5.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![0, 2])),
        ),
        (
            "costs within half a block of the lowest tie with it",
            vec![fresh(5.6), fresh(5.4), fresh(5.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1, 2])),
        ),
        (
            "a stalled rank is passed over while another competes",
            vec![scored(Some(1.0), true, true, 0.0), fresh(9.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "all stalled: they compete anyway",
            vec![scored(Some(4.0), true, true, 0.0), scored(Some(2.0), true, true, 0.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "a full rank is passed over while one with room competes, however cheap",
            vec![full(Some(100.0)), fresh(900.0), full(Some(50.0))],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "all full: they compete on the formula",
            vec![full(Some(700.0)), full(Some(650.0))],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "room on a stalled rank only: the full ones compete",
            vec![scored(Some(1.0), true, true, 0.0), full(Some(9.0)), full(Some(8.0))],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![2])),
        ),
        (
            "no fresh rank: fullness plays no part in overlap and size",
            vec![Scored { full: true, ..unknown(2.0) }, unknown(3.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![0])),
        ),
        (
            "above temperature 0 the eligible are sampled",
            vec![fresh(5.0), unknown(0.0), quiet(7.0)],
            0.5,
            (Reason::KvAware, Draw::Sample(vec![(0, 5.0), (2, 7.0)])),
        ),
        (
            "no fresh rank: every rank competes on overlap and size",
            vec![unknown(6.25), stale(3.25), unknown(6.25)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        (
            "no fresh rank: ties rotate as round_robin_stale",
            vec![unknown(3.0), unknown(6.0), stale(3.0)],
            0.0,
            (Reason::RoundRobinStale, Draw::Rotate(vec![0, 2])),
        ),
        (
            "no fresh rank: a token of queued prefill apart is a tie",
            vec![unknown(380.0), unknown(380.03), unknown(381.0)],
            0.0,
            (Reason::RoundRobinStale, Draw::Rotate(vec![0, 1])),
        ),
        (
            "no fresh rank and nothing to tell apart: plain rotation",
            vec![unknown(4.0), stale(4.0), unknown(4.0)],
            0.7,
            (Reason::RoundRobinStale, Draw::Rotate(vec![0, 1, 2])),
        ),
        (
            "no fresh rank, temperature above 0: sampled on the stale cost",
            vec![unknown(4.0), stale(2.0)],
            0.7,
            (Reason::KvAware, Draw::Sample(vec![(0, 4.0), (1, 2.0)])),
        ),
        (
            "no rank fresh on its phase, but the stream alive: a stalled rank sits out however cheap",
            vec![Scored { heard: true, ..unknown(6.0) }, scored(None, false, true, 1.0), unknown(6.0)],
            0.0,
            (Reason::RoundRobinStale, Draw::Rotate(vec![0, 2])),
        ),
        (
            "no sample anywhere: a stall is ignored, since nothing could have answered",
            vec![unknown(6.0), scored(None, false, true, 1.0)],
            0.0,
            (Reason::KvAware, Draw::Rotate(vec![1])),
        ),
        ("nobody", vec![], 0.0, (Reason::RoundRobinStale, Draw::Rotate(vec![]))),
    ];
    for (rule, scored, temperature, expected) in cases {
        assert_eq!(contenders(&scored, temperature, TIE_TOLERANCE, None), expected, "{rule}");
    }
}

#[test]
fn a_rank_is_full_when_its_projected_decode_blocks_pass_its_capacity() {
    let weights = Weights { overlap_score_credit: 1.0, prefill_load_scale: 1.0, temperature: 0.0 };
    let prompt = Prompt::new(160, 16);
    // 630 blocks in use, 10 more for the request: exactly the capacity still fits.
    let at = |active_decode_blocks, shared| {
        worker_logit(RankLoad { active_prefill_tokens: 0, active_decode_blocks }, shared, shared, prompt, &weights)
    };
    assert!(!over_capacity(Some(&at(630, 0)), Some(640)));
    assert!(over_capacity(Some(&at(631, 0)), Some(640)));
    assert!(!over_capacity(Some(&at(635, 5)), Some(640)), "blocks a request in flight holds are not new");
    assert!(!over_capacity(Some(&at(10_000, 0)), None), "unknown capacity");
    assert!(!over_capacity(Some(&at(10_000, 0)), Some(0)), "a card declaring no blocks");
    assert!(!over_capacity(None, Some(640)), "unknown backlog");
}

#[test]
fn ties_go_to_the_ranks_sent_a_dispatch_longest_ago_and_widen_when_nothing_overlaps() {
    let sent =
        |cost, last| Scored { last_dispatch: LastDispatch::Folded(last), ..scored(Some(cost), true, false, 0.0) };
    let ranks = [sent(300.0, 9), sent(340.0, 4), sent(300.0, 4), sent(300.0, 2)];
    let prompt = Prompt::new(1_560, 16);
    assert_eq!(tie_width(prompt, true), TIE_TOLERANCE, "a cached prefix is never traded for a turn");
    assert_eq!(tie_width(prompt, false), 98.0, "nothing to reuse: one request's blocks");
    assert_eq!(tie_width(Prompt::new(0, 16), false), TIE_TOLERANCE);
    let at = |tie| contenders(&ranks[..3], 0.0, tie, None);
    assert_eq!(at(TIE_TOLERANCE), (Reason::KvAware, Draw::Rotate(vec![2])), "of the lowest, the longest idle");
    assert_eq!(at(98.0), (Reason::KvAware, Draw::Rotate(vec![1, 2])), "a request wide: rank 1 ties, idle as long");
    assert_eq!(contenders(&ranks, 0.0, 98.0, None), (Reason::KvAware, Draw::Rotate(vec![3])));
    let sampled = contenders(&ranks[..2], 0.5, 98.0, None);
    assert_eq!(sampled, (Reason::KvAware, Draw::Sample(vec![(0, 300.0), (1, 340.0)])), "sampling ignores recency");
}

#[test]
fn softmax_sample_index_normalises_costs_by_their_range() {
    // Costs 0 and 1 at temperature 1: weights 1 and e^-1, so index 0 has p = 1 / (1 + e^-1).
    let p0 = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((p0 - 0.7311).abs() < 1e-4);
    assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, p0 - 1e-6), 0);
    assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, p0 + 1e-6), 1);
    // The same split for any scale or offset of the costs.
    assert_eq!(softmax_sample_index(&[1000.0, 2000.0], 1.0, p0 - 1e-6), 0);
    assert_eq!(softmax_sample_index(&[1000.0, 2000.0], 1.0, p0 + 1e-6), 1);
    // Lower temperature concentrates on the cheapest.
    assert_eq!(softmax_sample_index(&[0.0, 1.0], 0.05, 0.999), 0);
    assert_eq!(softmax_sample_index(&[1.0, 0.0], 0.05, 0.001), 1, "cheapest wins from either side");
    // A temperature so small its scale underflows: the cheapest, never a draw gone to NaN.
    for sample in [0.0, 0.5, 0.999] {
        assert_eq!(softmax_sample_index(&[10.0, 10.25], 5e-324, sample), 0, "{sample}");
        assert_eq!(softmax_sample_index(&[10.25, 10.0, 11.0], 5e-324, sample), 1, "{sample}");
    }
}

#[test]
fn softmax_sample_index_edge_cases() {
    assert_eq!(softmax_sample_index(&[5.0; 4], 1.0, 0.3), 1, "equal costs: uniform");
    assert_eq!(softmax_sample_index(&[5.0; 4], 1.0, 0.99), 3);
    assert_eq!(softmax_sample_index(&[], 1.0, 0.5), 0);
    assert_eq!(softmax_sample_index(&[2.0], 1.0, 0.9), 0);
    assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, 1.0), 1, "a draw of 1 takes the last");
    assert!(softmax_sample_index(&[f64::NAN, 1.0, 2.0], 1.0, 0.5) < 3, "NaN never panics nor escapes the range");
    assert!(softmax_sample_index(&[f64::MAX, -f64::MAX], 1.0, 0.5) < 2, "an infinite range is uniform");
}

#[test]
fn prefill_locally_is_upstreams_isl_bound() {
    // (case, isl, block size, decode overlap blocks, expected)
    let cases = [
        ("small and mostly cached", 1000, 64, 14, true),
        ("nothing cached", 200, 64, 0, false),
        ("cached share fine but too many uncached tokens", 100_000, 64, 1000, false),
        ("uncached exactly at the bound", 4096, 64, 32, false),
        ("uncached just under the bound", 4096, 64, 33, true),
        ("ratio exactly at the bound", 1000, 100, 3, false),
        ("ratio under the bound", 1000, 100, 4, true),
        ("overlap past the prompt", 500, 64, 10, true),
        ("empty prompt", 0, 64, 0, true),
    ];
    for (case, isl, block_size, overlap, expected) in cases {
        assert_eq!(prefill_locally(Prompt::new(isl, block_size), overlap), expected, "{case}");
    }
}

#[test]
fn decode_has_room_unless_busy_or_unknown() {
    // (case, threshold, projected, total, expected)
    let cases = [
        ("no threshold: nothing to veto", None, None, None, true),
        ("at the line", Some(0.5), Some(500), Some(1000), true),
        ("over the line", Some(0.5), Some(501), Some(1000), false),
        ("no fresh sample", Some(0.5), None, Some(1000), false),
        ("no capacity", Some(0.5), Some(0), None, false),
        ("zero capacity", Some(0.5), Some(0), Some(0), false),
        ("NaN threshold", Some(f64::NAN), Some(0), Some(1000), false),
    ];
    for (case, threshold, projected, total, expected) in cases {
        assert_eq!(decode_has_room(threshold, projected, total), expected, "{case}");
    }
}
