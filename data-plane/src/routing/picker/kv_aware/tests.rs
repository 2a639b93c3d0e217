//! The KV-aware picker's rules end to end over a fleet view.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::model::{
    Backlog, Capacity, DataPlaneConfig, Load, LoadKey, LoadSample, PickerParams, Role, Worker, WorkerKey,
};
use continuum_proto::view::FleetView;
use prometheus::{IntCounterVec, Opts};
use proptest::prelude::*;

use super::super::tests::{BLOCK, FRESH, STALE, agg, arb_load, worker};
use super::super::{DispatchLedger, NOT_REPORTED, Pin};
use super::*;

fn used(kv_used_blocks: u64) -> Load {
    Load { kv_used_blocks: Some(kv_used_blocks), ..Load::default() }
}

fn prefilling(active_prefill_tokens: u64) -> Load {
    Load { active_prefill_tokens: Some(active_prefill_tokens), kv_used_blocks: Some(0), ..Load::default() }
}

/// A fleet, its picker parameters, and the instant the test picks at.
struct Fleet {
    now: Instant,
    workers: Vec<Worker>,
    loads: Vec<(LoadKey, LoadSample)>,
    backlogs: Vec<(LoadKey, Backlog)>,
    params: PickerParams,
}

impl Fleet {
    fn new(workers: impl IntoIterator<Item = Worker>) -> Self {
        Self {
            now: Instant::now() + Duration::from_secs(600),
            workers: workers.into_iter().collect(),
            loads: Vec::new(),
            backlogs: Vec::new(),
            params: PickerParams { kv_enabled: true, ..PickerParams::default() },
        }
    }

    fn key(&self, id: u64, rank: u32) -> LoadKey {
        let worker = self.workers.iter().find(|w| w.key.instance_id == id).map(|w| w.key.clone());
        LoadKey { worker: worker.unwrap_or_else(|| WorkerKey::new("ns", id)), dp_rank: rank }
    }

    /// Worker `id` (rank 0) reported `load`, `age` ago.
    fn sample(mut self, id: u64, load: Load, age: Duration) -> Self {
        let key = self.key(id, 0);
        self.loads.push((key, LoadSample { load, received_at: self.now - age }));
        self
    }

    fn backlog(mut self, id: u64, backlog: Backlog) -> Self {
        let key = self.key(id, 0);
        self.backlogs.push((key, backlog));
        self
    }

    fn params(mut self, params: PickerParams) -> Self {
        self.params = PickerParams { kv_enabled: true, ..params };
        self
    }

    fn view(&self) -> FleetView {
        let config = DataPlaneConfig { picker: self.params, ..DataPlaneConfig::default() };
        FleetView::new(1, self.workers.iter().cloned().map(Arc::new), self.loads.clone(), Arc::new(config))
            .and_then(|view| view.with_backlogs(self.backlogs.clone()))
            .expect("view")
    }
}

struct Counters {
    selections: IntCounterVec,
    kv: IntCounterVec,
}

impl Counters {
    fn new() -> Self {
        let selections = IntCounterVec::new(Opts::new("selections", "test"), &["role", "reason"]).expect("counter");
        let kv = IntCounterVec::new(Opts::new("kv", "test"), &["result"]).expect("counter");
        Self { selections, kv }
    }

    fn picker(&self) -> KvAwarePicker {
        KvAwarePicker::new(Arc::new(DispatchLedger::new()), self.selections.clone(), self.kv.clone()).with_seed(7)
    }

    fn result(&self, result: KvSelectionResult) -> u64 {
        self.kv.with_label_values(&[result.as_str()]).get()
    }

    fn selection(&self, role: &str, reason: Reason) -> u64 {
        self.selections.with_label_values(&[role, reason.as_str()]).get()
    }
}

fn picker() -> KvAwarePicker {
    Counters::new().picker()
}

fn request() -> PickRequest<'static> {
    PickRequest { model: "tiny", prompt_tokens: 1, namespaces: None }
}

fn overlaps(triples: &[(u64, u32, u32)]) -> Overlaps {
    triples.iter().map(|&(instance_id, dp_rank, blocks)| RankOverlap::cached(instance_id, dp_rank, blocks)).collect()
}

fn scored(isl_tokens: u64, overlaps: &Overlaps) -> KvTerm<'_> {
    KvTerm::Scored {
        isl_tokens,
        block_size: BLOCK,
        overlaps,
        answer: IndexAnswer::Answered { turn: 0, suggestion: None },
    }
}

fn pick(picker: &KvAwarePicker, fleet: &Fleet, kv: KvTerm<'_>) -> Selection {
    picker.pick(&fleet.view(), &request(), kv, fleet.now).expect("a selection")
}

/// (decode id, prefill id) over `n` picks.
fn picks(picker: &KvAwarePicker, fleet: &Fleet, kv: KvTerm<'_>, n: usize) -> Vec<(u64, Option<u64>)> {
    (0..n).map(|_| ids(&pick(picker, fleet, kv))).collect()
}

fn ids(selection: &Selection) -> (u64, Option<u64>) {
    (selection.decode.worker.instance_id, selection.prefill.as_ref().map(|p| p.worker.instance_id))
}

#[test]
fn a_cached_prefix_draws_no_request_onto_a_rank_without_room_while_another_has_it() {
    // 1,600 tokens (100 blocks), worker 2 holding 90 of them idle; 1,000 blocks each, scale 3.
    // Worker 1 at 800 blocks: 3 * 100 + (800 + 100) = 1,200. Worker 2 at 850: 3 * 10 + 950 =
    // 980, and its 950 blocks fit. At 950 it costs 1,080 but needs 1,050 blocks.
    let held = overlaps(&[(2, 0, 90)]);
    let params = PickerParams { prefill_load_scale: 3.0, ..PickerParams::default() };
    let fleet =
        |one, two| Fleet::new([agg(1), agg(2)]).sample(1, used(one), FRESH).sample(2, used(two), FRESH).params(params);
    let winner = |one, two| ids(&pick(&picker(), &fleet(one, two), scored(1_600, &held))).0;
    assert_eq!(winner(800, 850), 2, "room for it: the prefix wins");
    assert_eq!(winner(800, 950), 1, "no room beside the prefix, room elsewhere");
    assert_eq!(winner(950, 950), 2, "no room anywhere: the formula decides");
}

#[test]
fn overlap_wins_against_equal_load() {
    // 128 tokens (8 blocks), both at 10 blocks. Worker 1: 8 + (10 + 8) = 26; worker 2, holding
    // 4 blocks: (8 - 4) + (10 + 4) = 18.
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(10), FRESH).sample(2, used(10), FRESH);
    let held = overlaps(&[(2, 0, 4)]);
    let counters = Counters::new();
    let picker = counters.picker();
    assert_eq!(picks(&picker, &fleet, scored(128, &held), 3), [(2, None); 3]);
    let s = pick(&picker, &fleet, scored(128, &held));
    assert_eq!((s.decode_reason, s.prefill_reason), (Reason::KvAware, Reason::NoPrefillPool));
    assert_eq!(
        s.cached_tokens,
        4 * u64::from(BLOCK),
        "the winner's overlap: its dispatch adds only the other 4 blocks"
    );
    assert_eq!(counters.result(KvSelectionResult::Overlap), 4);
    assert_eq!(counters.selection("decode", Reason::KvAware), 4);
}

#[test]
fn a_recent_answer_scores_like_the_index_and_is_counted_apart() {
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(10), FRESH).sample(2, used(10), FRESH);
    let held = overlaps(&[(2, 0, 4)]);
    let counters = Counters::new();
    let picker = counters.picker();
    let recent = KvTerm::Scored { isl_tokens: 128, block_size: BLOCK, overlaps: &held, answer: IndexAnswer::Recent };
    assert_eq!(ids(&pick(&picker, &fleet, recent)), (2, None));
    assert_eq!(counters.result(KvSelectionResult::IndexRecent), 1);
    assert_eq!(counters.result(KvSelectionResult::Overlap), 0);
}

#[test]
fn a_missed_lookup_scores_the_rendered_prompt_on_the_formula_without_overlap_credit() {
    // Worker 1 is prefilling 1,500 tokens with nothing decoding; worker 2 decodes 50 blocks and
    // prefills nothing. 128 tokens (8 blocks): worker 1 costs (1500 + 128) / 16 + 8 = 109.75,
    // worker 2 costs 8 + 50 + 8 = 66.
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, prefilling(1500), FRESH).sample(2, used(50), FRESH);
    let counters = Counters::new();
    let picker = counters.picker();
    let none = Overlaps::default();
    for result in [KvSelectionResult::IndexTimeout, KvSelectionResult::IndexUnavailable] {
        let missed =
            KvTerm::Scored { isl_tokens: 128, block_size: BLOCK, overlaps: &none, answer: IndexAnswer::Missed(result) };
        let s = pick(&picker, &fleet, missed);
        assert_eq!(ids(&s), (2, None));
        assert_eq!((s.decode_reason, s.cached_tokens), (Reason::KvAware, 0));
        assert_eq!(counters.result(result), 1, "counted as the miss it was");
    }
    assert_eq!(counters.result(KvSelectionResult::NoOverlap), 0);
}

#[test]
fn load_beats_overlap_when_the_gap_is_large() {
    // 128 tokens; worker 2 caches all 8 blocks (no request in flight holds them). Idle worker 1
    // costs 8 + 8 = 16; worker 2 costs 0 + (busy + 8): it wins at 5 busy blocks (13 < 16),
    // loses at 100 (108 > 16).
    let held = overlaps(&[(2, 0, 8)]);
    let close = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(5), FRESH);
    assert_eq!(picks(&picker(), &close, scored(128, &held), 2), [(2, None); 2]);
    let far = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(100), FRESH);
    let counters = Counters::new();
    assert_eq!(picks(&counters.picker(), &far, scored(128, &held), 2), [(1, None); 2]);
    assert_eq!(counters.result(KvSelectionResult::NoOverlap), 2, "the winner held nothing");
}

#[test]
fn blocks_requests_in_flight_hold_are_shared() {
    // Both cache all 8 blocks of a 128-token prompt; worker 2 carries 6 more decode blocks,
    // but its requests in flight hold the whole prefix, so serving it there adds none:
    // 1: 0 + (0 + 8) = 8, 2: 0 + (6 + 0) = 6 → 2. Without the requests in flight, 1.
    let in_flight = |active| {
        [
            RankOverlap { instance_id: 1, dp_rank: 0, blocks: 8, active: 0 },
            RankOverlap { instance_id: 2, dp_rank: 0, blocks: 8, active },
        ]
        .into_iter()
        .collect::<Overlaps>()
    };
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(6), FRESH);
    assert_eq!(picks(&picker(), &fleet, scored(128, &in_flight(8)), 1), [(2, None)]);
    assert_eq!(picks(&picker(), &fleet, scored(128, &in_flight(0)), 1), [(1, None)]);
}

#[test]
fn prefill_load_scale_and_credit_weigh_the_terms() {
    // The scale weighs the request's prefill: worker 2 holds all 8 blocks of a 128-token
    // prompt but 12 more decode blocks. scale 1: 1: 8 + 8 = 16, 2: 0 + 12 + 8 = 20 → 1.
    // scale 2: 1: 16 + 8 = 24, 2: 20 → 2.
    let held = overlaps(&[(2, 0, 8)]);
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(12), FRESH);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 1), [(1, None)]);
    let doubled = fleet.params(PickerParams { prefill_load_scale: 2.0, ..PickerParams::default() });
    assert_eq!(picks(&picker(), &doubled, scored(128, &held), 1), [(2, None)]);

    // …and the prefill already queued, which a request waits behind. Worker 1: 320 queued
    // prefill tokens; worker 2: 25 decode blocks; 16-token prompt. scale 1: 1: 20 + 1 + 1 =
    // 22, 2: 1 + 26 = 27 → 1. scale 2: 1: 2 * 21 + 1 = 43, 2: 2 * 1 + 26 = 28 → 2.
    let fleet = Fleet::new([agg(1), agg(2)])
        .sample(1, Load { active_prefill_tokens: Some(320), kv_used_blocks: Some(0), ..Load::default() }, FRESH)
        .sample(2, used(25), FRESH);
    let none = Overlaps::default();
    assert_eq!(picks(&picker(), &fleet, scored(16, &none), 1), [(1, None)]);
    let doubled = fleet.params(PickerParams { prefill_load_scale: 2.0, ..PickerParams::default() });
    assert_eq!(picks(&picker(), &doubled, scored(16, &none), 1), [(2, None)]);

    // Credit: worker 2 caches 8 of 8 blocks but carries 4 more decode blocks than worker 1.
    // credit 1: 1: 8 + 8 = 16, 2: 0 + 4 + 8 = 12 → 2. credit 0: 2: 8 + 12 = 20 → 1.
    let held = overlaps(&[(2, 0, 8)]);
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(4), FRESH);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 1), [(2, None)]);
    let uncredited = fleet.params(PickerParams { overlap_score_credit: 0.0, ..PickerParams::default() });
    assert_eq!(picks(&picker(), &uncredited, scored(128, &held), 1), [(1, None)]);
}

#[test]
fn temperature_zero_ties_rotate_by_a_deterministic_cursor() {
    // With nothing cached anywhere a tie is one request (4 blocks) wide: worker 3 is 5 busier.
    let fleet = Fleet::new([agg(1), agg(2), agg(3)]).sample(1, used(5), FRESH).sample(2, used(5), FRESH).sample(
        3,
        used(10),
        FRESH,
    );
    let none = Overlaps::default();
    let first = picks(&picker(), &fleet, scored(64, &none), 4);
    assert_eq!(first, [(1, None), (2, None), (1, None), (2, None)]);
    assert_eq!(picks(&picker(), &fleet, scored(64, &none), 4), first, "a new picker rotates the same way");
}

/// Two replicas picking at the same instant from the same view, neither holding the other's
/// pick yet (each picker has a ledger and cursors of its own): the burst's race that a pick log
/// traced, both taking the prefill worker one token of queued prefill ahead.
#[test]
fn replicas_seeing_the_same_tie_at_once_split_it_by_their_lookups_turns() {
    let queued = |tokens| Backlog { prefill_tokens: tokens, dispatches: 4, ..Backlog::default() };
    let pair = |second_queue| {
        Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 4, Role::Decode)])
            .sample(1, used(0), FRESH)
            .sample(2, used(0), FRESH)
            .sample(4, used(0), FRESH)
            .backlog(1, queued(6_090))
            .backlog(2, queued(second_queue))
    };
    let none = Overlaps::default();
    let lookup = |answer| KvTerm::Scored { isl_tokens: 1_560, block_size: BLOCK, overlaps: &none, answer };
    let at_once = |fleet: &Fleet, first, second| {
        let (a, b) = (picker(), picker());
        [ids(&pick(&a, fleet, lookup(first))), ids(&pick(&b, fleet, lookup(second)))]
    };
    let turn = |turn| IndexAnswer::Answered { turn, suggestion: None };

    let near_tie = pair(6_091);
    assert_eq!(at_once(&near_tie, turn(41), turn(42)), [(4, Some(2)), (4, Some(1))], "consecutive turns split");
    assert_eq!(at_once(&near_tie, turn(42), turn(41)), [(4, Some(1)), (4, Some(2))]);
    // Without turns (recent answers stand in, or an unnumbered control plane), each replica's
    // own cursor: both start at the first contender.
    assert_eq!(at_once(&near_tie, IndexAnswer::Recent, IndexAnswer::Recent), [(4, Some(1)); 2]);
    assert_eq!(at_once(&near_tie, turn(0), turn(0)), [(4, Some(1)); 2]);
    // A real difference is no tie: 110 tokens more queued (6.9 blocks).
    assert_eq!(at_once(&pair(6_200), turn(41), turn(42)), [(4, Some(1)); 2]);
}

/// The fleet-wide turn breaks the prefill tie and then, what is left of it, the decode tie: over
/// consecutive turns the pairs go through every combination. Two namespaces of one prefill and
/// two decode workers each, nothing fresh: taken whole, turn `t` chose prefill `t % 2` and
/// decode `t % 2`, so each namespace's second decode worker never got a request.
#[test]
fn consecutive_turns_pair_every_prefill_winner_with_every_decode_worker() {
    let fleet = Fleet::new([
        worker("a", 1, Role::Prefill),
        worker("a", 2, Role::Decode),
        worker("a", 3, Role::Decode),
        worker("b", 4, Role::Prefill),
        worker("b", 5, Role::Decode),
        worker("b", 6, Role::Decode),
    ]);
    let none = Overlaps::default();
    let turn = |turn| KvTerm::Scored {
        isl_tokens: 160,
        block_size: BLOCK,
        overlaps: &none,
        answer: IndexAnswer::Answered { turn, suggestion: None },
    };
    let picker = picker();
    let mut pairs: Vec<(u64, Option<u64>)> = (1..=8).map(|t| ids(&pick(&picker, &fleet, turn(t)))).collect();
    pairs.sort_unstable();
    pairs.dedup();
    assert_eq!(pairs, [(2, Some(1)), (3, Some(1)), (5, Some(4)), (6, Some(4))], "every decode worker, in turn");
}

#[test]
fn temperature_sampling_follows_the_softmax() {
    // 16-token prompt; 0, 5 and 10 busy blocks cost 2, 7 and 12. Normalised by their range,
    // temperature 1 weighs them 1, e^-0.5, e^-1: p = 0.506, 0.307, 0.186.
    let fleet = Fleet::new([agg(1), agg(2), agg(3)])
        .sample(1, used(0), FRESH)
        .sample(2, used(5), FRESH)
        .sample(3, used(10), FRESH)
        .params(PickerParams { router_temperature: 1.0, ..PickerParams::default() });
    let none = Overlaps::default();
    let draws = 4000;
    let frequencies = |fleet: &Fleet| {
        let picker = picker();
        let mut counts = BTreeMap::new();
        for (decode, _) in picks(&picker, fleet, scored(16, &none), draws) {
            *counts.entry(decode).or_insert(0usize) += 1;
        }
        let share = |id| counts.get(&id).copied().unwrap_or(0) as f64 / draws as f64;
        (share(1), share(2), share(3))
    };
    let (p1, p2, p3) = frequencies(&fleet);
    assert!(p1 > p2 && p2 > p3, "cheaper is likelier: {p1} {p2} {p3}");
    assert!((0.46..0.55).contains(&p1), "{p1}");
    assert!((0.27..0.35).contains(&p2), "{p2}");
    assert!((0.15..0.22).contains(&p3), "{p3}");

    let cold = Fleet { params: PickerParams { router_temperature: 0.05, ..fleet.params }, ..fleet };
    let (p1, _, _) = frequencies(&cold);
    assert!(p1 > 0.99, "a low temperature nearly always takes the cheapest: {p1}");
}

#[test]
fn fresh_and_quiet_ranks_compete_and_the_others_sit_out() {
    // 64 tokens (4 blocks). 1 is fresh at 50 blocks (58); 2 never published (quiet: 8);
    // 3 went silent under load and sits out although it holds the whole prefix.
    let fleet = Fleet::new([agg(1), agg(2), agg(3)]).sample(1, used(50), FRESH).sample(3, used(40), STALE);
    let held = overlaps(&[(3, 0, 4)]);
    assert_eq!(picks(&picker(), &fleet, scored(64, &held), 3), [(2, None); 3]);
    // A stale but idle sample is quiet, so 3 competes again: 0 + 0 = 0.
    let idle = Fleet::new([agg(1), agg(2), agg(3)]).sample(1, used(50), FRESH).sample(3, used(0), STALE);
    assert_eq!(picks(&picker(), &idle, scored(64, &held), 2), [(3, None); 2]);
}

fn vllm_prefill_pool() -> Fleet {
    // dynamo.vllm prefill workers publish no active_prefill_tokens: no fresh prefill backlog.
    Fleet::new([
        worker("a", 1, Role::Prefill),
        worker("a", 2, Role::Prefill),
        worker("a", 3, Role::Prefill),
        worker("a", 4, Role::Decode),
    ])
    .sample(1, used(0), FRESH)
    .sample(2, used(90), FRESH)
    .sample(3, used(0), FRESH)
}

#[test]
fn without_a_fresh_prefill_backlog_overlap_and_size_decide() {
    let fleet = vllm_prefill_pool();
    let held = overlaps(&[(2, 0, 3), (3, 0, 1)]);
    let counters = Counters::new();
    let picker = counters.picker();
    assert_eq!(picks(&picker, &fleet, scored(100, &held), 3), [(4, Some(2)); 3], "most overlap, load unknown");
    assert_eq!(pick(&picker, &fleet, scored(100, &held)).prefill_reason, Reason::KvAware);

    let none = Overlaps::default();
    let picker = self::picker();
    let rotation = picks(&picker, &fleet, scored(100, &none), 4);
    assert_eq!(rotation, [(4, Some(1)), (4, Some(2)), (4, Some(3)), (4, Some(1))]);
    assert_eq!(pick(&picker, &fleet, scored(100, &none)).prefill_reason, Reason::RoundRobinStale);

    let tied = overlaps(&[(1, 0, 2), (3, 0, 2)]);
    let picker = self::picker();
    let rotation = picks(&picker, &fleet, scored(100, &tied), 4);
    assert_eq!(rotation, [(4, Some(1)), (4, Some(3)), (4, Some(1)), (4, Some(3))], "only the tied rotate");
    assert_eq!(pick(&picker, &fleet, scored(100, &tied)).prefill_reason, Reason::RoundRobinStale);
}

/// The fleet's own prefill dispatches in flight are the one load signal left when prefill
/// workers publish none; what is left of them to prefill counts whole.
#[test]
fn without_a_fresh_prefill_backlog_the_fleets_prefill_dispatches_weigh_in() {
    let queued = |tokens| Backlog { prefill_tokens: tokens, dispatches: 1, ..Backlog::default() };
    // Worker 2 holds 3 blocks more than 1 and 3, but has 80 tokens queued: 5 blocks.
    let held = overlaps(&[(2, 0, 3)]);
    let busy = vllm_prefill_pool().backlog(2, queued(80));
    let picker = self::picker();
    assert_eq!(picks(&picker, &busy, scored(100, &held), 2), [(4, Some(1)), (4, Some(3))], "tied at 100/16 + 0");
    // 32 tokens queued are 2 blocks: the prefix still wins.
    let light = vllm_prefill_pool().backlog(2, queued(32));
    assert_eq!(picks(&picker, &light, scored(100, &held), 2), [(4, Some(2)); 2]);
}

/// The control plane counts every replica's lookups of the last few milliseconds, which this
/// replica's view may lack; its weighed suggestion decides among ranks within one request of
/// the cheapest (what one missing pick makes), and never against a cached prefix.
#[test]
fn the_control_planes_suggestion_wins_within_one_request_of_the_cheapest() {
    let answered = |isl_tokens, overlaps, suggestion| KvTerm::Scored {
        isl_tokens,
        block_size: BLOCK,
        overlaps,
        answer: IndexAnswer::Answered { turn: 1, suggestion: Some(suggestion) },
    };
    let weighed = |rank, reserved_tokens| Suggested::Weighed { rank: (rank, 0), reserved_tokens };
    // Recent lookups reserved one request of the prompt's size: the most this view can lack.
    let suggesting = |isl_tokens, overlaps, rank| answered(isl_tokens, overlaps, weighed(rank, isl_tokens));
    let queued = |tokens| Backlog { prefill_tokens: tokens, dispatches: 1, ..Backlog::default() };
    let none = Overlaps::default();
    // No fresh prefill backlog: a 160-token prompt (10 blocks) against the fleet's dispatches.
    let one_ahead = vllm_prefill_pool().backlog(1, queued(160));
    let counters = Counters::new();
    let picker = counters.picker();
    assert_eq!(ids(&pick(&picker, &one_ahead, suggesting(160, &none, 1))), (4, Some(1)), "one request busier");
    assert_eq!(counters.selection("prefill", Reason::RoundRobinStale), 1);
    // A missing prompt may be a few tokens longer than this one: half a block of slack.
    let longer_ahead = vllm_prefill_pool().backlog(1, queued(168));
    assert_eq!(ids(&pick(&picker, &longer_ahead, suggesting(160, &none, 1))), (4, Some(1)));
    let two_ahead = vllm_prefill_pool().backlog(1, queued(320));
    assert_eq!(ids(&pick(&picker, &two_ahead, suggesting(160, &none, 1))).1.map(|id| id != 1), Some(true));
    // In a burst the recent lookups reserved more, and this view may lack all of their picks.
    let burst = answered(160, &none, weighed(1, 3 * 160));
    assert_eq!(ids(&pick(&picker, &two_ahead, burst)), (4, Some(1)));
    // A rank that is no contender (gone from this replica's view) is passed over.
    assert_eq!(ids(&pick(&picker, &one_ahead, suggesting(160, &none, 9))).1.map(|id| id != 1), Some(true));

    // Fresh samples: a 64-token prompt (4 blocks) adds 4 blocks of prefill, at scale 1, and 4
    // of decode to a rank's cost: 9 with the half block of slack. Worker 2 has 8 blocks busy,
    // then 10.
    let fresh = |busy| Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(busy), FRESH);
    assert_eq!(ids(&pick(&picker, &fresh(8), suggesting(64, &none, 2))), (2, None));
    assert_eq!(ids(&pick(&picker, &fresh(10), suggesting(64, &none, 2))), (1, None), "more than one request");
    // With a prefix cached anywhere ties are half a block wide: the cache is not traded.
    let held = overlaps(&[(1, 0, 2)]);
    assert_eq!(ids(&pick(&picker, &fresh(0), suggesting(64, &held, 2))), (1, None));

    // With nothing recent to weigh, the control plane's tie-break settles exact ties only.
    let breaking = |rank| answered(160, &none, Suggested::TieBreak((rank, 0)));
    assert_eq!(ids(&pick(&picker, &vllm_prefill_pool(), breaking(3))), (4, Some(3)), "all three tie");
    assert_eq!(ids(&pick(&picker, &vllm_prefill_pool(), breaking(2))), (4, Some(2)));
    assert_eq!(ids(&pick(&picker, &one_ahead, breaking(1))).1.map(|id| id != 1), Some(true), "no tie");
    // Unless this replica picked another request meanwhile, which the control plane had not
    // weighed: then the tie-break reaches that far.
    let after_a_pick = match breaking(1) {
        KvTerm::Scored { answer, .. } => {
            KvTerm::Scored { isl_tokens: 160, block_size: BLOCK, overlaps: &none, answer: answer.picked_meanwhile(160) }
        }
        unscored => unscored,
    };
    assert_eq!(ids(&pick(&picker, &one_ahead, after_a_pick)), (4, Some(1)));
}

/// Without a fresh backlog too, a request waits only for the rest of the prefill under way:
/// of two prefill workers each prefilling one prompt, the one further on wins, where the
/// cursor used to break the tie.
#[test]
fn without_a_fresh_prefill_backlog_the_prefill_under_way_counts_only_what_is_left() {
    let queued =
        |prefilled_tokens| Backlog { prefill_tokens: 1600, prefilled_tokens, dispatches: 1, ..Backlog::default() };
    let none = Overlaps::default();
    let level = vllm_prefill_pool().backlog(1, queued(0)).backlog(2, queued(0)).backlog(3, queued(0));
    let picker = self::picker();
    assert_eq!(picks(&picker, &level, scored(160, &none), 3), [(4, Some(1)), (4, Some(2)), (4, Some(3))], "tied");
    let further = vllm_prefill_pool().backlog(1, queued(0)).backlog(2, queued(600)).backlog(3, queued(200));
    assert_eq!(picks(&picker, &further, scored(160, &none), 3), [(4, Some(2)); 3]);
}

#[test]
fn an_aggregated_fleet_adds_prefill_tokens_when_sampled() {
    // 16 tokens. 1: 10 blocks and 320 queued prefill tokens: (320 + 16) / 16 + 11 = 32;
    // 2: 20 blocks, no prefill field: 1 + 21 = 22. Without the prefill tokens 1 would win (12).
    let fleet = Fleet::new([agg(1), agg(2)])
        .sample(1, Load { active_prefill_tokens: Some(320), kv_used_blocks: Some(10), ..Load::default() }, FRESH)
        .sample(2, used(20), FRESH);
    let none = Overlaps::default();
    assert_eq!(picks(&picker(), &fleet, scored(16, &none), 2), [(2, None); 2]);
    let quieter = Fleet::new([agg(1), agg(2)]).sample(1, used(10), FRESH).sample(2, used(20), FRESH);
    assert_eq!(picks(&picker(), &quieter, scored(16, &none), 2), [(1, None); 2]);
}

#[test]
fn only_a_decode_worker_beside_prefill_workers_is_charged_what_the_hand_over_leaves() {
    // Worker 1 carries more blocks, most of them about to end; worker 2's requests have just
    // begun. Reached by hand-over, 1 holds 150 when the request arrives; prefilling the request
    // itself (no prefill worker in its namespace), it holds all 600 when it starts.
    let measured = Backlog { foreign_decode_blocks: Some(0), dispatches: 4, ..Backlog::default() };
    let backlogs = |fleet: Fleet| {
        fleet
            .sample(1, used(600), FRESH)
            .sample(2, used(300), FRESH)
            .backlog(1, Backlog { decode_blocks: 600, ending_decode_blocks: 450, ..measured })
            .backlog(2, Backlog { decode_blocks: 300, ending_decode_blocks: 0, ..measured })
    };
    let none = Overlaps::default();
    let paired = backlogs(Fleet::new([
        worker("ns", 1, Role::Decode),
        worker("ns", 2, Role::Decode),
        worker("ns", 3, Role::Prefill),
    ]));
    assert_eq!(picks(&picker(), &paired, scored(16, &none), 2), [(1, Some(3)); 2]);
    let alone = backlogs(Fleet::new([worker("ns", 1, Role::Decode), worker("ns", 2, Role::Decode)]));
    assert_eq!(picks(&picker(), &alone, scored(16, &none), 2), [(2, None); 2]);
}

#[test]
fn the_kv_term_picks_the_prefill_worker_and_the_decode_worker_holding_the_prompt() {
    let fleet = |decode_3: u64| {
        Fleet::new([
            worker("a", 1, Role::Prefill),
            worker("a", 2, Role::Prefill),
            worker("a", 3, Role::Decode),
            worker("a", 4, Role::Decode),
        ])
        .sample(1, prefilling(0), FRESH)
        .sample(2, prefilling(0), FRESH)
        .sample(3, used(decode_3), FRESH)
        .sample(4, used(10), FRESH)
    };
    // Decode worker 3 holds the 8-block prompt (credited when an earlier request went there):
    // at equal load its cost is 10 + 8 - 8 = 10 against 4's 10 + 8.
    let held = overlaps(&[(2, 0, 4), (3, 0, 8)]);
    let counters = Counters::new();
    let picker = counters.picker();
    let s = pick(&picker, &fleet(10), scored(128, &held));
    assert_eq!(ids(&s), (3, Some(2)));
    assert_eq!(
        s.cached_tokens,
        4 * u64::from(BLOCK),
        "the prefill winner's overlap: it prefills only the other 4 blocks"
    );
    assert_eq!((s.decode_reason, s.prefill_reason), (Reason::KvAware, Reason::KvAware));
    assert_eq!(counters.result(KvSelectionResult::Overlap), 1);
    assert_eq!(counters.selection("prefill", Reason::KvAware), 1);
    assert_eq!(counters.selection("decode", Reason::KvAware), 1);
    // Load still wins a large gap: 100 + 8 - 8 against 18.
    assert_eq!(ids(&pick(&picker, &fleet(100), scored(128, &held))), (4, Some(2)));
}

fn mixed_fleet() -> Fleet {
    Fleet::new([
        worker("a", 1, Role::Prefill),
        worker("a", 2, Role::Decode),
        worker("a", 3, Role::Aggregated),
        worker("b", 4, Role::Aggregated),
        worker("c", 5, Role::Prefill),
        worker("c", 6, Role::Aggregated),
    ])
}

#[test]
fn prefill_workers_compete_only_beside_a_decode_worker() {
    let fleet = mixed_fleet();
    // c's prefill worker 5 and a's aggregated worker 3 hold the most, but neither may serve.
    let held = overlaps(&[(5, 0, 8), (3, 0, 8), (1, 0, 4)]);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 3), [(2, Some(1)); 3]);
    // c is scored as aggregated: its aggregated worker 6 serves alone.
    let held = overlaps(&[(5, 0, 8), (6, 0, 6), (1, 0, 4)]);
    let s = pick(&picker(), &fleet, scored(128, &held));
    assert_eq!((ids(&s), s.prefill_reason), ((6, None), Reason::NoPrefillPool));
}

#[test]
fn prefill_beside_aggregated_workers_alone_leaves_the_fleet_aggregated() {
    let fleet = Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Aggregated)]);
    let held = overlaps(&[(1, 0, 8)]);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 3), [(2, None); 3]);
    let prefill_only = Fleet::new([worker("a", 1, Role::Prefill)]);
    assert!(picker().pick(&prefill_only.view(), &request(), scored(128, &held), prefill_only.now).is_none());
}

#[test]
fn mixed_namespaces_rotate_across_every_prefilling_rank() {
    let fleet = mixed_fleet();
    let none = Overlaps::default();
    let picker = picker();
    let mut seen = BTreeMap::new();
    for (decode, prefill) in picks(&picker, &fleet, scored(64, &none), 9) {
        *seen.entry((decode, prefill)).or_insert(0) += 1;
    }
    // b's 4 and c's 6 serve alone; a pairs 1 with 2.
    assert_eq!(seen, BTreeMap::from([((2, Some(1)), 3), ((4, None), 3), ((6, None), 3)]));
}

#[test]
fn the_namespace_filter_and_missing_models() {
    let fleet = mixed_fleet();
    let only_b = ["b".to_string()];
    let held = overlaps(&[(1, 0, 8)]);
    let filtered = PickRequest { namespaces: Some(&only_b), ..request() };
    let s = picker().pick(&fleet.view(), &filtered, scored(128, &held), fleet.now).expect("b serves");
    assert_eq!(ids(&s), (4, None));
    let absent = PickRequest { model: "absent", ..request() };
    let counters = Counters::new();
    assert!(counters.picker().pick(&fleet.view(), &absent, scored(128, &held), fleet.now).is_none());
    let unavailable = KvTerm::Unavailable(KvSelectionResult::TokenizerUnavailable);
    assert!(counters.picker().pick(&fleet.view(), &absent, unavailable, fleet.now).is_none());
    assert!(KvSelectionResult::ALL.iter().all(|r| counters.result(*r) == 0), "nothing selected, nothing counted");
}

#[test]
fn a_rank_of_another_block_size_earns_no_credit() {
    let big = Worker { block_size: Some(32), ..agg(2) };
    let fleet = Fleet::new([agg(1), big]).sample(1, used(0), FRESH).sample(2, used(0), FRESH);
    let held = overlaps(&[(2, 0, 8)]);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 2), [(1, None), (2, None)], "a tie: no credit for 2");
}

#[test]
fn dp_ranks_are_scored_by_their_own_overlap() {
    let fleet = Fleet::new([Worker { dp_size: 2, ..agg(1) }, agg(2)]);
    let held = overlaps(&[(1, 1, 3), (1, 0, 1)]);
    let s = pick(&picker(), &fleet, scored(128, &held));
    assert_eq!(s.decode, Pin { worker: WorkerKey::new("ns", 1), dp_rank: Some(1) });
}

/// Two aggregated workers each prefilling one 1,600-token prompt: a request waits for the rest
/// of the one under way. Worker 1 decodes one request more (100 blocks), but its prefill is
/// half done; at scale 3 the formula sends the request there once the fleet says so.
#[test]
fn the_prefill_under_way_counts_only_what_is_left_of_it() {
    let queued = |decode_blocks, prefilled_tokens| Backlog {
        prefill_tokens: 1600,
        prefilled_tokens,
        decode_blocks,
        dispatches: 1,
        foreign_decode_blocks: Some(0),
        ..Backlog::default()
    };
    let none = Overlaps::default();
    let scale = PickerParams { prefill_load_scale: 3.0, ..PickerParams::default() };
    let level = |prefilled_tokens| {
        Fleet::new([agg(1), agg(2)])
            .sample(1, used(0), FRESH)
            .sample(2, used(0), FRESH)
            .backlog(1, queued(200, prefilled_tokens))
            .backlog(2, queued(100, 0))
            .params(scale)
    };
    // 1: 3 * (100 + 10) + 200 + 10 = 540; 2: 3 * 110 + 110 = 440.
    assert_eq!(picks(&picker(), &level(0), scored(160, &none), 1), [(2, None)]);
    // 1: 3 * (50 + 10) + 210 = 390.
    assert_eq!(picks(&picker(), &level(800), scored(160, &none), 1), [(1, None)]);
}

#[test]
fn unanswered_dispatches_and_fleet_backlogs_add_to_the_formula() {
    // Equal and idle: the first pick goes to 1; its 10 unanswered blocks send the next to 2.
    let fleet = Fleet::new([agg(1), agg(2)]).sample(1, used(0), FRESH).sample(2, used(0), FRESH);
    let none = Overlaps::default();
    let picker = picker();
    let first = pick(&picker, &fleet, scored(160, &none));
    assert_eq!(ids(&first), (1, None));
    picker.ledger().record(&first, 160, BLOCK, &[], fleet.now, NOT_REPORTED);
    assert_eq!(picks(&picker, &fleet, scored(160, &none), 2), [(2, None); 2]);

    // Other replicas sent 1 fifty blocks: 2 bits outweigh its 2-block overlap.
    let busy = Fleet::new([agg(1), agg(2)])
        .sample(1, used(0), FRESH)
        .sample(2, used(0), FRESH)
        .backlog(1, Backlog { decode_blocks: 50, dispatches: 1, ..Backlog::default() });
    let held = overlaps(&[(1, 0, 2)]);
    assert_eq!(picks(&self::picker(), &busy, scored(160, &held), 2), [(2, None); 2]);

    // A pinned prefill leg adds its tokens to the prefill worker until its next sample.
    let pair = Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 3, Role::Decode)])
        .sample(1, prefilling(0), FRESH)
        .sample(2, prefilling(0), FRESH);
    let picker = self::picker();
    let first = pick(&picker, &pair, scored(160, &none));
    assert_eq!(ids(&first), (3, Some(1)));
    picker.ledger().record(&first, 160, BLOCK, &[], pair.now, NOT_REPORTED);
    assert_eq!(picks(&picker, &pair, scored(160, &none), 2), [(3, Some(2)); 2]);
}

fn conditional_fleet(decode_2: Load, decode_3: Load) -> Fleet {
    Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Decode), worker("a", 3, Role::Decode)])
        .sample(1, prefilling(0), FRESH)
        .sample(2, decode_2, FRESH)
        .sample(3, decode_3, FRESH)
        .params(PickerParams { conditional_disaggregation: true, ..PickerParams::default() })
}

#[test]
fn conditional_disaggregation_lets_the_decode_worker_holding_the_prefix_prefill() {
    // 1024 tokens (64 blocks); decode worker 2 holds 60: 64 tokens uncached (< 2048, 6%).
    // Its conditional cost max(0, 30 + 4 - 60) = 0 beats 3's 20 + 64 = 84, though the load-only
    // rule (30 + 64 vs 20 + 64) would choose 3.
    let fleet = conditional_fleet(used(30), used(20));
    let held = overlaps(&[(2, 0, 60)]);
    let counters = Counters::new();
    let s = pick(&counters.picker(), &fleet, scored(1024, &held));
    assert_eq!(ids(&s), (2, None));
    assert_eq!((s.decode_reason, s.prefill_reason), (Reason::ConditionalBypass, Reason::ConditionalBypass));
    assert_eq!(counters.result(KvSelectionResult::Bypass), 1);
    assert_eq!(counters.selection("decode", Reason::ConditionalBypass), 1);

    // A quarter cached (768 tokens, 75% uncached): the decode worker is still chosen by the
    // conditional cost (30 + 48 - 16 = 62 < 84), but the prefill worker does the work.
    let quarter = overlaps(&[(2, 0, 16)]);
    let s = pick(&counters.picker(), &fleet, scored(1024, &quarter));
    assert_eq!((ids(&s), s.decode_reason), ((2, Some(1)), Reason::KvAware));

    // Off (the default): the same decode worker, by the same cost, and never a bypass.
    let off = Fleet { params: PickerParams { conditional_disaggregation: false, ..fleet.params }, ..fleet };
    let s = pick(&counters.picker(), &off, scored(1024, &held));
    assert_eq!((ids(&s), s.decode_reason), ((2, Some(1)), Reason::KvAware));
    assert_eq!(counters.result(KvSelectionResult::Bypass), 1);
}

#[test]
fn the_busy_threshold_vetoes_a_bypass() {
    let held = overlaps(&[(2, 0, 60)]);
    let threshold =
        |fleet: Fleet, t| Fleet { params: PickerParams { decode_busy_threshold: Some(t), ..fleet.params }, ..fleet };
    // total_kv_blocks 1000, threshold 0.5: serving the 64-block prompt makes all of it active
    // (none of its 60 cached blocks is in flight), so projected 436 + 64 = 500 is at the line;
    // 437 + 64 over. (Worker 3 carries 900 so that 2 stays the chosen decode worker.)
    let at = threshold(conditional_fleet(used(436), used(900)), 0.5);
    assert_eq!(ids(&pick(&picker(), &at, scored(1024, &held))), (2, None));
    let over = threshold(conditional_fleet(used(437), used(900)), 0.5);
    assert_eq!(ids(&pick(&picker(), &over, scored(1024, &held))), (2, Some(1)));

    // No fresh sample, or no capacity on the card, vetoes too.
    let lone = |decode: Worker| {
        Fleet::new([worker("a", 1, Role::Prefill), decode])
            .sample(1, prefilling(0), FRESH)
            .params(PickerParams { conditional_disaggregation: true, ..PickerParams::default() })
    };
    let unsampled = threshold(lone(worker("a", 2, Role::Decode)), 0.9);
    assert_eq!(ids(&pick(&picker(), &unsampled, scored(1024, &held))), (2, Some(1)));
    let no_capacity = Worker { capacity: Capacity::default(), ..worker("a", 2, Role::Decode) };
    let uncapped = threshold(lone(no_capacity).sample(2, used(0), FRESH), 0.9);
    assert_eq!(ids(&pick(&picker(), &uncapped, scored(1024, &held))), (2, Some(1)));
    // Without a threshold nothing is vetoed, sample or not.
    let unsampled = lone(worker("a", 2, Role::Decode));
    assert_eq!(ids(&pick(&picker(), &unsampled, scored(1024, &held))), (2, None));
}

#[test]
fn an_unavailable_term_falls_back_to_load_only_selection_and_counts_its_result() {
    let fleet = Fleet::new([
        worker("a", 1, Role::Prefill),
        worker("a", 2, Role::Prefill),
        worker("a", 3, Role::Decode),
        worker("b", 4, Role::Aggregated),
    ])
    .sample(1, prefilling(500), FRESH)
    .sample(2, prefilling(0), FRESH)
    .sample(3, used(10), FRESH)
    .sample(4, used(300), FRESH);
    let counters = Counters::new();
    let picker = counters.picker();
    let load_only = super::super::LoadBasedPicker::new(Arc::new(DispatchLedger::new()), Counters::new().selections)
        .from_first_contender();
    for result in [KvSelectionResult::TokenizerUnavailable, KvSelectionResult::RenderUnavailable] {
        let s = pick(&picker, &fleet, KvTerm::Unavailable(result));
        let expected = load_only.pick(&fleet.view(), &request(), fleet.now).expect("a selection");
        assert_eq!(s, expected);
        assert_eq!(ids(&s), (3, Some(2)));
        assert_eq!((s.decode_reason, s.prefill_reason), (Reason::Load, Reason::Load));
        assert_eq!(counters.result(result), 1);
    }
    assert_eq!(counters.selection("decode", Reason::Load), 2);
    assert_eq!(counters.selection("prefill", Reason::KvAware), 0);
}

#[test]
fn a_mislabelled_counter_never_stops_picking() {
    let odd = IntCounterVec::new(Opts::new("x", "x"), &["a", "b", "c"]).expect("counter");
    let picker = KvAwarePicker::new(Arc::new(DispatchLedger::new()), odd.clone(), odd);
    let fleet = Fleet::new([agg(1)]);
    let none = Overlaps::default();
    assert!(picker.pick(&fleet.view(), &request(), scored(16, &none), fleet.now).is_some());
}

#[test]
fn labels() {
    assert_eq!([Reason::KvAware, Reason::ConditionalBypass].map(Reason::as_str), ["kv_aware", "conditional_bypass"]);
    let results = KvSelectionResult::ALL.map(KvSelectionResult::as_str);
    assert_eq!(
        results,
        [
            "overlap",
            "no_overlap",
            "tokenizer_unavailable",
            "prompt_too_large",
            "render_unavailable",
            "artifact_unpinned",
            "bypass",
            "index_unavailable",
            "index_timeout",
            "index_recent"
        ]
    );
}

#[test]
fn overlaps_keep_the_longest_match_per_rank() {
    let held = |instance_id, dp_rank, blocks, active| RankOverlap { instance_id, dp_rank, blocks, active };
    let overlaps =
        Overlaps::from(vec![held(1, 0, 3, 3), held(1, 0, 5, 1), held(1, 0, 2, 0), held(1, 1, 4, 9), held(2, 0, 0, 0)]);
    assert_eq!((overlaps.get(1, 0), overlaps.get(1, 1), overlaps.get(2, 0), overlaps.get(9, 0)), (5, 4, 0, 0));
    assert_eq!(
        (overlaps.active(1, 0), overlaps.active(1, 1), overlaps.active(9, 0)),
        (3, 4, 0),
        "never past the blocks"
    );
    assert_eq!(overlaps.len(), 2, "zero-block entries are as if absent");
    assert!(Overlaps::default().is_empty());
}

// --- property: only candidates are picked, prefill only beside a decode worker of its
// namespace, and a bypass only under conditional disaggregation.

fn arb_worker() -> impl Strategy<Value = Worker> {
    let role = prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Aggregated), Just(Role::Unknown)];
    (0..3usize, 1..6u64, role, 0..2usize, 0..3u32, proptest::option::of(prop_oneof![Just(16u32), Just(32)])).prop_map(
        |(ns, id, role, model, dp_size, block_size)| Worker {
            key: WorkerKey::new(["a", "b", "c"][ns], id),
            role,
            model: ["tiny", "other"][model].into(),
            block_size,
            dp_size,
            ..worker("a", 0, Role::Aggregated)
        },
    )
}

proptest! {
    #[test]
    fn picks_only_candidates_and_bypasses_only_when_enabled(
        workers in proptest::collection::vec(arb_worker(), 0..10),
        loads in proptest::collection::vec(arb_load(), 30),
        held in proptest::collection::vec((1..6u64, 0..3u32, 0..80u32, 0..80u32), 0..12),
        isl in 0..2000u64,
        temperature in prop_oneof![Just(0.0), 0.01..2.0f64],
        conditional in any::<bool>(),
        threshold in proptest::option::of(0.0..1.5f64),
    ) {
        let mut by_key = BTreeMap::new();
        for w in workers { by_key.insert(w.key.clone(), w); }
        let mut fleet = Fleet::new(by_key.into_values()).params(PickerParams {
            router_temperature: temperature,
            conditional_disaggregation: conditional,
            decode_busy_threshold: threshold,
            ..PickerParams::default()
        });
        let ranks: Vec<LoadKey> = fleet.workers.iter()
            .flat_map(|w| w.dp_ranks().map(|dp_rank| LoadKey { worker: w.key.clone(), dp_rank }))
            .collect();
        for (key, (load, age_ms)) in ranks.into_iter().zip(loads) {
            if age_ms % 5 != 0 {
                fleet.loads.push((key, LoadSample { load, received_at: fleet.now - Duration::from_millis(age_ms) }));
            }
        }
        let view = fleet.view();
        let overlaps: Overlaps = held
            .into_iter()
            .map(|(instance_id, dp_rank, blocks, active)| RankOverlap { instance_id, dp_rank, blocks, active })
            .collect();
        let picker = picker();
        for _ in 0..3 {
            let Some(s) = picker.pick(&view, &request(), scored(isl, &overlaps), fleet.now) else {
                let any = view.workers().values().any(|w| w.model == "tiny" && matches!(w.role, Role::Decode | Role::Aggregated));
                prop_assert!(!any, "a decode candidate existed but nothing was picked");
                continue;
            };
            let decode = view.worker(&s.decode.worker).expect("decode worker is in the view");
            prop_assert_eq!(&decode.model, "tiny");
            prop_assert!(matches!(decode.role, Role::Decode | Role::Aggregated));
            prop_assert_eq!(&s.namespace, &decode.key.namespace);
            let here = |role| view.workers().values().any(|w| w.model == "tiny" && w.key.namespace == decode.key.namespace && w.role == role);
            match &s.prefill {
                Some(p) => {
                    let prefill = view.worker(&p.worker).expect("prefill worker is in the view");
                    prop_assert_eq!(prefill.role, Role::Prefill);
                    prop_assert_eq!(decode.role, Role::Decode);
                    prop_assert_eq!(&prefill.key.namespace, &decode.key.namespace);
                }
                None if s.prefill_reason == Reason::ConditionalBypass => {
                    prop_assert!(conditional, "a bypass without conditional disaggregation");
                    prop_assert_eq!(decode.role, Role::Decode);
                }
                None => {
                    prop_assert_eq!(s.prefill_reason, Reason::NoPrefillPool);
                    prop_assert!(!(here(Role::Prefill) && here(Role::Decode)), "a pair namespace served without prefill");
                }
            }
        }
    }
}

/// The seed: "When no rank has a fresh prefill backlog (as on dynamo.vllm fleets where
/// active_prefill_tokens is nil), all ranks compete on overlap and request size." Beside a
/// prefill pool of dynamo.vllm workers, aggregated workers' fresh decode samples are no prefill
/// backlog either: they must not put the prefill workers out of the competition.
#[test]
fn aggregated_workers_decode_samples_do_not_shut_a_prefill_pool_out() {
    let fleet = Fleet::new([
        worker("a", 1, Role::Aggregated),
        worker("a", 2, Role::Aggregated),
        worker("b", 3, Role::Prefill),
        worker("b", 4, Role::Decode),
    ])
    .sample(1, used(300), FRESH)
    .sample(2, used(500), FRESH)
    .sample(3, used(0), FRESH)
    .sample(4, used(0), FRESH);
    let none = Overlaps::default();
    let chosen = picks(&picker(), &fleet, scored(64, &none), 6);
    assert!(chosen.contains(&(4, Some(3))), "the pair takes its turn: {chosen:?}");
    // With the prefix cached on the prefill worker, it wins outright.
    let held = overlaps(&[(3, 0, 4)]);
    assert_eq!(picks(&picker(), &fleet, scored(128, &held), 2), [(4, Some(3)); 2]);
}

/// A model served in two block sizes: each rank is costed in its own blocks, which its backlog
/// and capacity are counted in. In the lookup's 16-token blocks worker 2 (64-token blocks, 650
/// of 1,000 used) would need 400 more and read as full; in its own it needs 100, and its cost
/// is well below worker 1's (500 used, 400 more).
#[test]
fn a_rank_of_another_block_size_is_costed_in_its_own_blocks() {
    let large_blocks = Worker { block_size: Some(64), ..agg(2) };
    let fleet = Fleet::new([agg(1), large_blocks]).sample(1, used(500), FRESH).sample(2, used(650), FRESH);
    let none = Overlaps::default();
    assert_eq!(picks(&picker(), &fleet, scored(6_400, &none), 3), [(2, None); 3]);
}
