//! The load-based picker's rules, end to end over a fleet view, and its invariants as a
//! property test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::model::{
    Backlog, Capacity, DataPlaneConfig, Load, LoadKey, LoadSample, PickerParams, Role, Worker, WorkerKey,
};
use continuum_proto::view::{FleetDelta, FleetView};
use prometheus::{IntCounterVec, Opts};
use proptest::prelude::*;

use super::candidates::{MAX_CACHED_POOLS, PoolCache, Pools};
use super::*;

/// Shared with the KV-aware picker's tests.
pub(super) const BLOCK: u32 = 16;

pub(super) fn worker(namespace: &str, id: u64, role: Role) -> Worker {
    Worker {
        key: WorkerKey::new(namespace, id),
        role,
        model: "tiny".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(BLOCK),
        capacity: Capacity { total_kv_blocks: Some(1000), max_num_batched_tokens: Some(2048), ..Capacity::default() },
        dp_start_rank: 0,
        dp_size: 0,
        disaggregated_endpoint: None,
        artifacts: None,
    }
}

pub(super) fn agg(id: u64) -> Worker {
    worker("ns", id, Role::Aggregated)
}

fn with_capacity(mut worker: Worker, total_kv_blocks: u64, max_num_batched_tokens: u64) -> Worker {
    worker.capacity = Capacity {
        total_kv_blocks: Some(total_kv_blocks),
        max_num_batched_tokens: Some(max_num_batched_tokens),
        ..Capacity::default()
    };
    worker
}

fn dp(mut worker: Worker, dp_size: u32) -> Worker {
    worker.dp_size = dp_size;
    worker
}

/// A fleet and the instant the test picks at; samples are placed relative to it.
struct Fleet {
    now: Instant,
    workers: Vec<Worker>,
    loads: Vec<(LoadKey, LoadSample)>,
    backlogs: Vec<(LoadKey, Backlog)>,
    max_staleness: Duration,
    prefill_load_scale: f64,
}

impl Fleet {
    fn new(workers: impl IntoIterator<Item = Worker>) -> Self {
        let now = Instant::now() + Duration::from_secs(600);
        Self {
            now,
            workers: workers.into_iter().collect(),
            loads: Vec::new(),
            backlogs: Vec::new(),
            max_staleness: Duration::from_secs(3),
            prefill_load_scale: PickerParams::default().prefill_load_scale,
        }
    }

    /// Rank `rank` of worker `id` (namespace of the first worker with that id) reported `load`, `age` ago.
    fn sample(mut self, id: u64, rank: u32, load: Load, age: Duration) -> Self {
        let namespace = self.workers.iter().find(|w| w.key.instance_id == id).map(|w| Arc::clone(&w.key.namespace));
        let key = LoadKey { worker: WorkerKey::new(namespace.unwrap_or_else(|| Arc::from("ns")), id), dp_rank: rank };
        self.loads.push((key, LoadSample { load, received_at: self.now - age }));
        self
    }

    fn used(self, id: u64, rank: u32, kv_used_blocks: u64, age: Duration) -> Self {
        self.sample(id, rank, Load { kv_used_blocks: Some(kv_used_blocks), ..Load::default() }, age)
    }

    /// The control plane's fleet-wide backlog of decode blocks on a rank of worker `id` (namespace "ns").
    fn backlog(self, id: u64, rank: u32, decode_blocks: u64) -> Self {
        self.fleet_backlog(id, rank, Backlog { decode_blocks, dispatches: 1, ..Backlog::default() })
    }

    fn fleet_backlog(mut self, id: u64, rank: u32, backlog: Backlog) -> Self {
        let key = LoadKey { worker: WorkerKey::new("ns", id), dp_rank: rank };
        self.backlogs.push((key, backlog));
        self
    }

    fn view(&self) -> FleetView {
        let config = DataPlaneConfig {
            picker: PickerParams {
                max_staleness: self.max_staleness,
                prefill_load_scale: self.prefill_load_scale,
                ..PickerParams::default()
            },
            ..DataPlaneConfig::default()
        };
        FleetView::new(1, self.workers.iter().cloned().map(Arc::new), self.loads.clone(), Arc::new(config))
            .and_then(|view| view.with_backlogs(self.backlogs.clone()))
            .expect("view")
    }
}

pub(super) const FRESH: Duration = Duration::from_secs(1);
pub(super) const STALE: Duration = Duration::from_secs(10);

fn selections() -> IntCounterVec {
    IntCounterVec::new(Opts::new("continuum_dynamo_selection_total", "test"), &["role", "reason"]).expect("counter")
}

fn picker() -> LoadBasedPicker {
    LoadBasedPicker::new(Arc::new(DispatchLedger::new()), selections()).from_first_contender()
}

fn request(prompt_tokens: u64) -> PickRequest<'static> {
    PickRequest { model: "tiny", prompt_tokens, namespaces: None }
}

fn pick(picker: &LoadBasedPicker, fleet: &Fleet) -> Selection {
    picker.pick(&fleet.view(), &request(32), fleet.now).expect("a selection")
}

/// Decode instance ids over `n` picks.
fn decode_ids(picker: &LoadBasedPicker, fleet: &Fleet, n: usize) -> Vec<u64> {
    (0..n).map(|_| pick(picker, fleet).decode.worker.instance_id).collect()
}

#[test]
fn decode_rules_table() {
    // (rule, fleet, picks, expected decode ids, expected reason)
    let cases: Vec<(&str, Fleet, Vec<u64>, Reason)> = vec![
        (
            "fresh: lowest decode cost wins",
            Fleet::new([agg(1), agg(2)]).used(1, 0, 500, FRESH).used(2, 0, 100, FRESH),
            vec![2, 2, 2],
            Reason::Load,
        ),
        (
            "decode cost is a share of the worker's blocks, not a count of them",
            // 1,000 of 4,000 blocks (0.25) against 500 of 1,000 (0.5).
            Fleet::new([with_capacity(agg(1), 4000, 2048), agg(2)]).used(1, 0, 1000, FRESH).used(2, 0, 500, FRESH),
            vec![1, 1],
            Reason::Load,
        ),
        (
            "active_decode_blocks is preferred to kv_used_blocks",
            Fleet::new([agg(1), agg(2)])
                .sample(
                    1,
                    0,
                    Load { active_decode_blocks: Some(10), kv_used_blocks: Some(900), ..Load::default() },
                    FRESH,
                )
                .used(2, 0, 100, FRESH),
            vec![1, 1],
            Reason::Load,
        ),
        (
            "quiet (never published) competes as idle",
            Fleet::new([agg(1), agg(2)]).used(1, 0, 100, FRESH),
            vec![2, 2],
            Reason::Load,
        ),
        (
            "quiet (last sample idle, now stale) competes as idle",
            Fleet::new([agg(1), agg(2)]).used(1, 0, 100, FRESH).used(2, 0, 0, STALE),
            vec![2, 2],
            Reason::Load,
        ),
        (
            "silent under load is not chosen while another has a cost",
            Fleet::new([agg(1), agg(2)]).used(1, 0, 900, FRESH).used(2, 0, 5, STALE),
            vec![1, 1, 1],
            Reason::Load,
        ),
        (
            "no fresh sample anywhere: round robin across all",
            Fleet::new([agg(1), agg(2), agg(3)]).used(1, 0, 900, STALE).used(2, 0, 0, STALE),
            vec![1, 2, 3, 1],
            Reason::RoundRobinStale,
        ),
        ("never published anywhere: round robin", Fleet::new([agg(1), agg(2)]), vec![1, 2, 1], Reason::RoundRobinStale),
        (
            "equal costs rotate; more than a request (2 blocks) busier does not",
            Fleet::new([agg(1), agg(2), agg(3)]).used(1, 0, 7, FRESH).used(2, 0, 7, FRESH).used(3, 0, 10, FRESH),
            vec![1, 2, 1, 2],
            Reason::Load,
        ),
        (
            "at most a request busier rotates with the lightest",
            Fleet::new([agg(1), agg(2), agg(3)]).used(1, 0, 9, FRESH).used(2, 0, 7, FRESH).used(3, 0, 10, FRESH),
            vec![1, 2, 1, 2],
            Reason::Load,
        ),
        (
            "a card without capacity has no cost",
            Fleet::new([agg(1), Worker { capacity: Capacity::default(), ..agg(2) }])
                .used(1, 0, 900, FRESH)
                .used(2, 0, 0, FRESH),
            vec![1, 1],
            Reason::Load,
        ),
        (
            "unknown role is never routed, however idle",
            Fleet::new([agg(1), worker("ns", 2, Role::Unknown)]).used(1, 0, 900, FRESH),
            vec![1, 1],
            Reason::Load,
        ),
        (
            "prefill workers are not decode candidates",
            Fleet::new([agg(1), worker("ns", 2, Role::Prefill)]),
            vec![1, 1],
            Reason::RoundRobinStale,
        ),
        (
            "another model's workers are not candidates",
            Fleet::new([agg(1), Worker { model: "other".into(), ..agg(2) }]),
            vec![1, 1],
            Reason::RoundRobinStale,
        ),
    ];
    for (rule, fleet, expected, reason) in cases {
        let picker = picker();
        assert_eq!(decode_ids(&picker, &fleet, expected.len()), expected, "{rule}");
        assert_eq!(pick(&picker, &fleet).decode_reason, reason, "{rule}");
    }
}

#[test]
fn dp_ranks_are_candidates_with_rank_pins_only_when_declared() {
    let fleet = Fleet::new([dp(agg(1), 2)]).used(1, 0, 100, FRESH).used(1, 1, 10, FRESH);
    assert_eq!(pick(&picker(), &fleet).decode, Pin { worker: WorkerKey::new("ns", 1), dp_rank: Some(1) });

    let quiet = Fleet::new([dp(agg(1), 2)]);
    let quiet_picker = picker();
    let ranks: Vec<Option<u32>> = (0..4).map(|_| pick(&quiet_picker, &quiet).decode.dp_rank).collect();
    assert_eq!(ranks, [Some(0), Some(1), Some(0), Some(1)], "a quiet dp=2 worker uses both ranks");

    let single = Fleet::new([dp(agg(1), 1)]);
    assert_eq!(pick(&picker(), &single).decode.dp_rank, Some(0), "dp declared: rank 0 is pinned");
    let none = Fleet::new([agg(1)]);
    assert_eq!(pick(&picker(), &none).decode.dp_rank, None, "no dp declared: no rank");
}

#[test]
fn dp_ranks_start_at_the_declared_start_rank() {
    let fleet = Fleet::new([Worker { dp_start_rank: 2, ..dp(agg(1), 2) }]);
    let picker = picker();
    let ranks: Vec<Option<u32>> = (0..2).map(|_| pick(&picker, &fleet).decode.dp_rank).collect();
    assert_eq!(ranks, [Some(2), Some(3)]);
    // A start rank without a size declares nothing: the worker is rank 0, as its pin says.
    let undeclared = Worker { dp_start_rank: 4, ..agg(1) };
    assert_eq!(undeclared.dp_ranks(), 0..1);
    let picked = pick(&picker, &Fleet::new([undeclared])).decode;
    assert_eq!((picked.dp_rank, picked.rank_key().dp_rank), (None, 0));
}

fn record(picker: &LoadBasedPicker, selection: &Selection, tokens: u64, at: Instant) -> DispatchId {
    picker.ledger().record(selection, tokens, BLOCK, &[], at, NOT_REPORTED)
}

#[test]
fn new_pickers_start_rotating_at_independent_places() {
    // Replicas start together, and every pick into an idle fleet is a tie. Were their cursors all
    // to start at the first contender, each replica's first request would land on one worker.
    let fleet = Fleet::new([agg(1), agg(2)]);
    let firsts: BTreeSet<u64> = (0..64)
        .map(|_| {
            let replica = LoadBasedPicker::new(Arc::new(DispatchLedger::new()), selections());
            let rotation = decode_ids(&replica, &fleet, 2);
            assert_ne!(rotation[0], rotation[1], "each still rotates");
            rotation[0]
        })
        .collect();
    // 64 random starts agree with probability 2^-63.
    assert_eq!(firsts, BTreeSet::from([1, 2]));
}

#[test]
fn ranks_a_request_apart_take_arrivals_in_turn_whoever_sent_the_last() {
    // Requests of 32 tokens are 2 blocks. Rank 1 decodes one request fewer than rank 2.
    let fleet = Fleet::new([agg(1), agg(2)]).used(1, 0, 8, FRESH).used(2, 0, 10, FRESH);
    let replica = picker();
    let first = pick(&replica, &fleet);
    assert_eq!(first.decode.worker.instance_id, 1);
    record(&replica, &first, 32, fleet.now);
    // Equal now, and rank 1 had the last dispatch: rank 2, whichever way the cursor turns
    // (these picks are not recorded).
    assert_eq!(decode_ids(&replica, &fleet, 2), [2, 2]);

    // The other replicas' dispatches, through the control plane's numbers: two ranks a request
    // apart go to the one the fleet sent nothing for longest, not the lighter one.
    let fleet_wide = |last_on_1, last_on_2| {
        let sent = |last_dispatch| Backlog { last_dispatch, ..Backlog::default() };
        Fleet::new([agg(1), agg(2)])
            .used(1, 0, 8, FRESH)
            .used(2, 0, 10, FRESH)
            .fleet_backlog(1, 0, sent(last_on_1))
            .fleet_backlog(2, 0, sent(last_on_2))
    };
    assert_eq!(decode_ids(&picker(), &fleet_wide(7, 3), 2), [2, 2]);
    assert_eq!(decode_ids(&picker(), &fleet_wide(3, 7), 2), [1, 1]);
    let far = Fleet::new([agg(1), agg(2)]).used(1, 0, 8, FRESH).used(2, 0, 11, FRESH);
    let far = far.fleet_backlog(1, 0, Backlog { last_dispatch: 7, ..Backlog::default() });
    assert_eq!(decode_ids(&picker(), &far, 2), [1, 1], "more than a request busier loses, however long idle");
}

#[test]
fn a_stalled_worker_is_passed_over_while_another_has_a_cost() {
    let mut fleet =
        Fleet::new([agg(1), agg(2)]).used(1, 0, 0, STALL_AFTER + FRESH).used(2, 0, 500, STALL_AFTER + FRESH);
    fleet.max_staleness = Duration::from_secs(10);
    let picker = picker();
    let first = pick(&picker, &fleet);
    assert_eq!(first.decode.worker.instance_id, 1);
    record(&picker, &first, 32, fleet.now - STALL_AFTER);
    assert_eq!(decode_ids(&picker, &fleet, 2), [2, 2], "two blocks unanswered for 5 s");

    // Without a fresh sample anywhere, nothing could have answered: stalls are ignored.
    fleet.max_staleness = Duration::from_secs(3);
    let picker_stale = LoadBasedPicker::new(Arc::clone(picker.ledger()), selections()).from_first_contender();
    let quiet = Fleet { loads: Vec::new(), ..fleet };
    // The round robin goes to the worker sent a dispatch longest ago: 2, then the stalled 1.
    let second = pick(&picker_stale, &quiet);
    assert_eq!(second.decode.worker.instance_id, 2);
    record(&picker_stale, &second, 32, quiet.now);
    assert_eq!(decode_ids(&picker_stale, &quiet, 1), [1], "stalled, and still its turn");
}

/// The control plane's stall, from another replica's dispatch this replica never saw: passed
/// over as its own would be, and ignored as its own would be without a fresh sample anywhere.
#[test]
fn a_worker_the_fleet_says_is_stalled_is_passed_over_while_another_has_a_cost() {
    let mut fleet =
        Fleet::new([agg(1), agg(2)]).used(1, 0, 0, STALL_AFTER + FRESH).used(2, 0, 500, STALL_AFTER + FRESH);
    fleet.max_staleness = Duration::from_secs(10);
    assert_eq!(decode_ids(&picker(), &fleet, 2), [1, 1], "the idle worker, while no replica's dispatch waits on it");
    let stalled = fleet.fleet_backlog(1, 0, Backlog { stalled: true, dispatches: 1, ..Backlog::default() });
    assert_eq!(decode_ids(&picker(), &stalled, 2), [2, 2]);
    let quiet = Fleet { loads: Vec::new(), max_staleness: Duration::from_secs(3), ..stalled };
    // Rotation among both, as if neither were stalled.
    assert_eq!(decode_ids(&picker(), &quiet, 4), [1, 2, 1, 2], "no fresh sample anywhere: the stall is ignored");
}

/// The stall rule in the prefill phase: prompts unanswered on a prefill worker for the stall
/// age take it out while another prefill worker has a cost, however little it has queued.
#[test]
fn a_stalled_prefill_worker_is_passed_over_while_another_has_a_cost() {
    let age = STALL_AFTER + FRESH;
    let queued = |tokens| Load { active_prefill_tokens: Some(tokens), kv_used_blocks: Some(0), ..Load::default() };
    let mut fleet =
        Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 9, Role::Decode)])
            .used(9, 0, 0, age)
            .sample(1, 0, queued(0), age)
            .sample(2, 0, queued(5000), age);
    fleet.max_staleness = Duration::from_secs(10);
    let picker = picker();
    let prefill_of = |s: Selection| s.prefill.map(|p| p.worker.instance_id);
    let first = pick(&picker, &fleet);
    assert_eq!(prefill_of(first.clone()), Some(1));
    record(&picker, &first, 320, fleet.now - STALL_AFTER);
    let next: Vec<_> = (0..2).map(|_| prefill_of(pick(&picker, &fleet))).collect();
    assert_eq!(next, [Some(2), Some(2)], "320 tokens unanswered on 1 for 5 s: passed over for 5,000 queued on 2");
}

#[test]
fn an_ended_or_single_block_dispatch_never_stalls() {
    let mut fleet =
        Fleet::new([agg(1), agg(2)]).used(1, 0, 0, STALL_AFTER + FRESH).used(2, 0, 500, STALL_AFTER + FRESH);
    fleet.max_staleness = Duration::from_secs(10);
    let picker = picker();
    let first = pick(&picker, &fleet);
    let ended = record(&picker, &first, 320, fleet.now - STALL_AFTER);
    picker.ledger().end(ended, fleet.now, NOT_REPORTED);
    record(&picker, &first, 16, fleet.now - STALL_AFTER);
    assert_eq!(decode_ids(&picker, &fleet, 2), [1, 1]);
}

#[test]
fn a_burst_between_samples_spreads_thanks_to_the_ledger() {
    // Worker 1 looks idle, worker 2 carries 40 blocks; each request adds 10 blocks.
    let fleet = Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 40, FRESH);
    let blind = picker();
    assert!(decode_ids(&blind, &fleet, 20).iter().all(|id| *id == 1), "without the ledger one worker takes the burst");

    let picker = picker();
    let mut counts = BTreeMap::new();
    for _ in 0..20 {
        let selection = pick(&picker, &fleet);
        record(&picker, &selection, 160, fleet.now);
        *counts.entry(selection.decode.worker.instance_id).or_insert(0) += 1;
    }
    // Each request adds 10 blocks to decode and 10 of prefill still queued (none is answered).
    assert_eq!(counts, BTreeMap::from([(1, 11), (2, 9)]), "worker 1 fills up to its peer's load, then they alternate");
}

/// The costs logged at debug level are those the picks use: picking with the log on chooses
/// as picking with it off, request for request.
#[test]
fn picks_explained_at_debug_level_are_the_picks_made_without() {
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let fleet = Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 40, FRESH);
    let burst = |picker: &LoadBasedPicker| -> Vec<u64> {
        (0..12)
            .map(|_| {
                let selection = pick(picker, &fleet);
                record(picker, &selection, 160, fleet.now);
                selection.decode.worker.instance_id
            })
            .collect()
    };
    let quiet = burst(&picker());
    assert!(quiet.contains(&1) && quiet.contains(&2), "the costs, not one worker, decide: {quiet:?}");
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber =
        tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).with_writer(move || writer.clone()).finish();
    let explained = tracing::subscriber::with_default(subscriber, || burst(&picker()));
    assert_eq!(explained, quiet);
    let logged =
        String::from_utf8_lossy(&lines.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned();
    assert_eq!(logged.matches("Decode:").count(), 12, "{logged}");
    assert!(logged.contains("1/0[") && logged.contains("cost"), "{logged}");
}

#[test]
fn an_aggregated_worker_still_prefilling_is_charged_its_queue() {
    // Worker 1 has just been sent a 320-token prompt (20 blocks to decode, 20 to prefill first);
    // worker 2 decodes 30 blocks. The request adds 2 blocks either way.
    let pick_after_a_dispatch = |prefill_load_scale| {
        let fleet =
            Fleet { prefill_load_scale, ..Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 30, FRESH) };
        let picker = picker();
        let first = pick(&picker, &fleet);
        assert_eq!(first.decode.worker.instance_id, 1, "idle against 30 blocks");
        let dispatch = record(&picker, &first, 320, fleet.now);
        let next = pick(&picker, &fleet).decode.worker.instance_id;
        // Its response began: the prefill no longer queues, its blocks still decode (20 < 30).
        picker.ledger().prefilled(dispatch, fleet.now, NOT_REPORTED);
        (next, pick(&picker, &fleet).decode.worker.instance_id)
    };
    assert_eq!(pick_after_a_dispatch(0.0), (1, 1), "the seed's cost: 22 against 32 blocks");
    assert_eq!(pick_after_a_dispatch(1.0), (2, 1), "42 against 32 blocks while the prompt prefills");
}

#[test]
fn a_sample_newer_than_the_dispatches_replaces_their_backlog() {
    // Decode blocks alone: the unanswered prompts would still queue their prefill.
    let fleet =
        Fleet { prefill_load_scale: 0.0, ..Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 40, FRESH) };
    let picker = picker();
    for _ in 0..6 {
        let selection = pick(&picker, &fleet);
        record(&picker, &selection, 160, fleet.now - FRESH - FRESH);
    }
    assert_eq!(decode_ids(&picker, &fleet, 3), [1, 1, 1], "older dispatches were answered by the samples");
}

#[test]
fn fleet_wide_backlogs_count_once() {
    // Other replicas sent worker 1 fifty blocks since its sample.
    let busy = Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 15, FRESH).backlog(1, 0, 50);
    assert_eq!(decode_ids(&picker(), &busy, 2), [2, 2]);

    // This replica's own ten blocks, already in the fleet-wide sum, count once: 0 + 10 < 15
    // (decode blocks alone: its prompt's prefill is not in the fleet-wide sum given here).
    let own = Fleet {
        prefill_load_scale: 0.0,
        ..Fleet::new([agg(1), agg(2)]).used(1, 0, 0, FRESH).used(2, 0, 15, FRESH).backlog(1, 0, 10)
    };
    let picker = picker();
    let first = pick(&picker, &own);
    record(&picker, &first, 160, own.now);
    assert_eq!(decode_ids(&picker, &own, 1), [1]);
}

#[test]
fn a_decode_worker_reached_by_hand_over_is_charged_what_will_be_left_when_the_request_arrives() {
    // Worker 1 carries more blocks, but most of them belong to requests about to end; worker 2's
    // requests have just begun.
    let backlogs = |fleet: Fleet| {
        let measured = Backlog { foreign_decode_blocks: Some(0), dispatches: 4, ..Backlog::default() };
        fleet
            .used(1, 0, 600, FRESH)
            .used(2, 0, 300, FRESH)
            .fleet_backlog(1, 0, Backlog { decode_blocks: 600, ending_decode_blocks: 450, ..measured })
            .fleet_backlog(2, 0, Backlog { decode_blocks: 300, ending_decode_blocks: 0, ..measured })
    };
    let paired = backlogs(Fleet::new([
        worker("ns", 1, Role::Decode),
        worker("ns", 2, Role::Decode),
        worker("ns", 3, Role::Prefill),
    ]));
    let picker = picker();
    let selection = pick(&picker, &paired);
    assert_eq!(selection.decode.worker.instance_id, 1, "150 blocks left by hand-over against 300");
    assert_eq!(selection.prefill.map(|p| p.worker.instance_id), Some(3));

    // An aggregated worker takes the request at once: the ending requests still hold their blocks.
    let aggregated = backlogs(Fleet::new([agg(1), agg(2)]));
    assert_eq!(decode_ids(&picker, &aggregated, 2), [2, 2]);
    // So does a decode worker with no prefill worker beside it: it prefills the request itself.
    let alone = backlogs(Fleet::new([worker("ns", 1, Role::Decode), worker("ns", 2, Role::Decode)]));
    assert_eq!(decode_ids(&picker, &alone, 2), [2, 2]);
}

fn pair_fleet() -> Fleet {
    Fleet::new([
        worker("a", 1, Role::Prefill),
        worker("a", 2, Role::Decode),
        worker("a", 3, Role::Aggregated),
        worker("b", 4, Role::Decode),
        worker("b", 5, Role::Aggregated),
        worker("c", 6, Role::Prefill),
        worker("c", 7, Role::Aggregated),
    ])
}

#[test]
fn mixed_namespaces() {
    let fleet = pair_fleet();
    let picker = picker();
    let mut seen = BTreeMap::new();
    for _ in 0..12 {
        let s = pick(&picker, &fleet);
        seen.insert(s.decode.worker.instance_id, (s.prefill.map(|p| p.worker.instance_id), s.prefill_reason));
    }
    let no_pool = Reason::NoPrefillPool;
    let expected = BTreeMap::from([
        (2, (Some(1), Reason::RoundRobinStale)),
        (4, (None, no_pool)),
        (5, (None, no_pool)),
        (7, (None, no_pool)),
    ]);
    assert_eq!(seen, expected, "a's aggregated worker is out; b's and c's aggregated workers serve alone");
}

#[test]
fn graph_local_prefill_comes_from_the_decode_winners_namespace() {
    let prefill = |ns, id| worker(ns, id, Role::Prefill);
    let decode = |ns, id| worker(ns, id, Role::Decode);
    let tokens = |n| Load { active_prefill_tokens: Some(n), kv_used_blocks: Some(0), ..Load::default() };
    let fleet = Fleet::new([prefill("a", 1), decode("a", 2), prefill("b", 3), prefill("b", 4), decode("b", 5)])
        .used(2, 0, 900, FRESH)
        .used(5, 0, 10, FRESH)
        .sample(1, 0, tokens(0), FRESH)
        .sample(3, 0, tokens(1024), FRESH)
        .sample(4, 0, tokens(512), FRESH);
    let picker = picker();
    let s = pick(&picker, &fleet);
    assert_eq!(&*s.namespace, "b");
    assert_eq!(s.decode.worker, WorkerKey::new("b", 5));
    assert_eq!(s.prefill, Some(Pin { worker: WorkerKey::new("b", 4), dp_rank: None }));
    assert_eq!((s.decode_reason, s.prefill_reason), (Reason::Load, Reason::Load));
}

/// Without the control plane's measure (its stream lost), a prefill worker's sample counts the
/// prompts it had received: this replica's dispatch from before the sample is in it already,
/// and is not added again (the seed: a dispatch counts until a sample from its worker arrives).
#[test]
fn a_prompt_the_prefill_sample_already_counts_is_not_counted_twice() {
    let tokens = |n| Load { active_prefill_tokens: Some(n), kv_used_blocks: Some(0), ..Load::default() };
    let fleet =
        Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 3, Role::Decode)])
            .used(3, 0, 0, FRESH)
            .sample(1, 0, tokens(6000), FRESH)
            .sample(2, 0, tokens(7000), FRESH);
    let picker = picker();
    let to_one = pick(&picker, &Fleet { loads: Vec::new(), ..Fleet::new(fleet.workers.clone()) });
    let to_one = Selection { prefill: Some(Pin { worker: WorkerKey::new("a", 1), dp_rank: None }), ..to_one };
    record(&picker, &to_one, 6000, fleet.now - FRESH - Duration::from_millis(500));
    let s = pick(&picker, &fleet);
    assert_eq!(s.prefill.map(|p| p.worker.instance_id), Some(1), "6,000 queued on 1 against 7,000 on 2");
    // One sent after the sample is not in it: it counts on top.
    record(&picker, &to_one, 2000, fleet.now);
    let s = pick(&picker, &fleet);
    assert_eq!(s.prefill.map(|p| p.worker.instance_id), Some(2), "8,000 on 1 against 7,000 on 2");
}

/// The seed's rules in the prefill phase: fresh, quiet, silent under load and no fresh sample,
/// judged on queued prefill tokens over `max_num_batched_tokens`.
#[test]
fn prefill_rules_table() {
    let prefill = |id, tokens, age| {
        move |fleet: Fleet| {
            let load = Load { active_prefill_tokens: Some(tokens), kv_used_blocks: Some(0), ..Load::default() };
            fleet.sample(id, 0, load, age)
        }
    };
    let fleet = || {
        Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 9, Role::Decode)])
            .used(9, 0, 0, FRESH)
    };
    // (rule, fleet, expected prefill ids, expected reason)
    let cases: Vec<(&str, Fleet, Vec<u64>, Reason)> = vec![
        (
            "fresh: fewest queued prefill tokens wins",
            prefill(2, 100, FRESH)(prefill(1, 5000, FRESH)(fleet())),
            vec![2, 2, 2],
            Reason::Load,
        ),
        (
            "prefill cost is a share of the worker's batch, not a count of tokens",
            // 3,000 of 8,192 batched tokens (0.37) against 1,000 of 2,048 (0.49).
            prefill(2, 1000, FRESH)(prefill(1, 3000, FRESH)(
                Fleet::new([
                    with_capacity(worker("a", 1, Role::Prefill), 1000, 8192),
                    worker("a", 2, Role::Prefill),
                    worker("a", 9, Role::Decode),
                ])
                .used(9, 0, 0, FRESH),
            )),
            vec![1, 1],
            Reason::Load,
        ),
        ("quiet (never published) competes as idle", prefill(1, 100, FRESH)(fleet()), vec![2, 2], Reason::Load),
        (
            "quiet (idle, now stale) competes as idle",
            prefill(2, 0, STALE)(prefill(1, 100, FRESH)(fleet())),
            vec![2, 2],
            Reason::Load,
        ),
        (
            "silent under load is not chosen while another has a cost",
            prefill(2, 500, STALE)(prefill(1, 9000, FRESH)(fleet())),
            vec![1, 1, 1],
            Reason::Load,
        ),
        (
            "no fresh sample anywhere: round robin",
            prefill(2, 500, STALE)(prefill(1, 9000, STALE)(fleet())),
            vec![1, 2, 1],
            Reason::RoundRobinStale,
        ),
    ];
    for (rule, fleet, expected, reason) in cases {
        let picker = picker();
        let picks: Vec<Selection> = expected.iter().map(|_| pick(&picker, &fleet)).collect();
        let ids: Vec<u64> = picks.iter().filter_map(|s| s.prefill.as_ref()).map(|p| p.worker.instance_id).collect();
        assert_eq!(ids, expected, "{rule}");
        assert!(picks.iter().all(|s| s.prefill_reason == reason), "{rule}: {picks:?}");
    }
}

#[test]
fn prefill_without_prefill_tokens_rotates() {
    // The mocker and dynamo.vllm publish no active_prefill_tokens.
    let fleet =
        Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Prefill), worker("a", 3, Role::Decode)])
            .used(1, 0, 0, FRESH)
            .used(2, 0, 50, FRESH);
    let picker = picker();
    let picks: Vec<_> = (0..4).map(|_| pick(&picker, &fleet)).collect();
    let ids: Vec<u64> = picks.iter().filter_map(|s| s.prefill.as_ref()).map(|p| p.worker.instance_id).collect();
    assert_eq!(ids, [1, 2, 1, 2]);
    assert!(picks.iter().all(|s| s.prefill_reason == Reason::RoundRobinStale));
}

#[test]
fn namespace_filter_and_missing_model() {
    let fleet = pair_fleet();
    let picker = picker();
    let only_b = ["b".to_string()];
    let request = PickRequest { namespaces: Some(&only_b), ..request(1) };
    for _ in 0..4 {
        let s = picker.pick(&fleet.view(), &request, fleet.now).expect("b serves");
        assert_eq!(&*s.namespace, "b");
    }
    let none: [String; 0] = [];
    assert!(picker.pick(&fleet.view(), &PickRequest { namespaces: Some(&none), ..request }, fleet.now).is_none());
    assert!(picker.pick(&fleet.view(), &PickRequest { model: "absent", ..request }, fleet.now).is_none());
    let prefill_only = Fleet::new([worker("a", 1, Role::Prefill), worker("a", 2, Role::Unknown)]);
    assert!(picker.pick(&prefill_only.view(), &request, prefill_only.now).is_none(), "no decode candidate");
}

#[test]
fn pools_are_listed_once_per_workers_map_and_follow_its_changes() {
    let fleet = pair_fleet();
    let view = fleet.view();
    let cache = PoolCache::default();
    let (only_a, only_b) = (["a".to_string()], ["b".to_string()]);
    let a = cache.get(&view, "tiny", Some(&only_a));
    let b = cache.get(&view, "tiny", Some(&only_b));
    assert!(a.decode.iter().all(|c| &*c.worker.key.namespace == "a"), "{a:?}");
    assert!(b.decode.iter().all(|c| &*c.worker.key.namespace == "b"), "{b:?}");
    assert!(Arc::ptr_eq(&a, &cache.get(&view, "tiny", Some(&only_a))), "a filter keeps its own listing");
    assert!(cache.get(&view, "absent", None).decode.is_empty());

    // A load-only update shares the workers map: nothing is listed again.
    let sample = LoadSample { load: Load::default(), received_at: fleet.now };
    let loads_only = FleetDelta {
        base_version: 1,
        version: 2,
        loads: vec![(LoadKey { worker: WorkerKey::new("a", 2), dp_rank: 0 }, sample)],
        ..FleetDelta::default()
    };
    let view = view.apply(&loads_only).expect("delta");
    assert!(Arc::ptr_eq(&a, &cache.get(&view, "tiny", Some(&only_a))));

    // A worker joining or leaving is seen at once.
    let joined = FleetDelta {
        base_version: 2,
        version: 3,
        upserted: vec![Arc::new(worker("a", 9, Role::Decode))],
        ..FleetDelta::default()
    };
    let view = view.apply(&joined).expect("delta");
    let ids = |pools: &Pools| pools.decode.iter().map(|c| c.worker.key.instance_id).collect::<Vec<_>>();
    assert_eq!(ids(&cache.get(&view, "tiny", Some(&only_a))), [2, 9]);
    let left =
        FleetDelta { base_version: 3, version: 4, removed: vec![WorkerKey::new("a", 2)], ..FleetDelta::default() };
    let view = view.apply(&left).expect("delta");
    assert_eq!(ids(&cache.get(&view, "tiny", Some(&only_a))), [9]);
}

/// Workers declaring more dp ranks than a pick weighs cost a replica no more than the bound:
/// the ranks past it are left out, namespace by namespace, and a decode worker listed always
/// has its namespace's prefill pool beside it.
#[test]
fn a_models_candidates_stop_at_the_rank_bound() {
    let per_worker = 1024;
    let namespace = |ns: &str, first: u64| {
        let prefill = (first..first + 8).map(move |id| dp(worker(ns, id, Role::Prefill), per_worker));
        let decode = (first + 100..first + 140).map(move |id| dp(worker(ns, id, Role::Decode), per_worker));
        prefill.chain(decode).collect::<Vec<_>>()
    };
    let fleet = Fleet::new(namespace("a", 1000).into_iter().chain(namespace("b", 2000)));
    let pools = PoolCache::default().get(&fleet.view(), "tiny", None);
    let prefill: usize = pools.prefill.values().map(Vec::len).sum();
    assert_eq!(pools.decode.len() + prefill, super::candidates::MAX_CANDIDATE_RANKS);
    for candidate in &pools.decode {
        let beside = pools.prefill.get(&candidate.worker.key.namespace);
        assert!(beside.is_some_and(|pool| !pool.is_empty()), "{:?} without its prefill pool", candidate.worker.key);
    }
    // `a` whole (48 workers), then `b`'s prefill pool, then 8 of its 40 decode workers.
    let ranks = |workers: usize| workers * per_worker as usize;
    assert_eq!(pools.prefill.get("b").map(Vec::len), Some(ranks(8)));
    let b_decode = pools.decode.iter().filter(|c| &*c.worker.key.namespace == "b").count();
    assert_eq!((pools.decode.len() - b_decode, b_decode), (ranks(40), ranks(8)));
}

#[test]
fn the_pool_cache_is_bounded_and_stays_correct_past_its_bound() {
    let fleet = pair_fleet();
    let view = fleet.view();
    let cache = PoolCache::default();
    let filters: Vec<[String; 2]> = (0..MAX_CACHED_POOLS + 8).map(|i| [format!("n{i}"), "b".to_string()]).collect();
    for filter in &filters {
        assert_eq!(cache.get(&view, "tiny", Some(filter)).decode.len(), 2);
    }
    let held = cache.held(&view);
    assert!(held > 0 && held <= MAX_CACHED_POOLS, "{held}");
    let only_b = ["b".to_string()];
    assert_eq!(cache.get(&view, "tiny", Some(&only_b)).decode.len(), 2);
    // A model no worker serves is the client's word: listed, never kept.
    let held = cache.held(&view);
    for i in 0..8 {
        assert!(cache.get(&view, &format!("{i}{}", "m".repeat(1 << 16)), None).decode.is_empty());
    }
    assert_eq!(cache.held(&view), held);
}

#[test]
fn every_selection_is_counted_by_role_and_reason() {
    let counter = selections();
    let picker = LoadBasedPicker::new(Arc::new(DispatchLedger::new()), counter.clone());
    let fleet = pair_fleet();
    for _ in 0..4 {
        pick(&picker, &fleet);
    }
    let count = |role: &str, reason: Reason| counter.with_label_values(&[role, reason.as_str()]).get();
    assert_eq!(count("decode", Reason::RoundRobinStale), 4);
    assert_eq!(count("prefill", Reason::RoundRobinStale), 1);
    assert_eq!(count("prefill", Reason::NoPrefillPool), 3);
    // With a fresh sample in the phase, the pick is by load.
    let sampled = pair_fleet().used(2, 0, 10, Duration::ZERO).used(4, 0, 20, Duration::ZERO);
    pick(&picker, &sampled);
    assert_eq!(count("decode", Reason::Load), 1);

    let mislabelled = IntCounterVec::new(Opts::new("x", "x"), &["only"]).expect("counter");
    let odd = LoadBasedPicker::new(Arc::new(DispatchLedger::new()), mislabelled);
    assert!(odd.pick(&fleet.view(), &request(1), fleet.now).is_some(), "a mislabelled counter never stops picking");
}

#[test]
fn reason_labels() {
    let labels = Reason::ALL.map(Reason::as_str);
    assert_eq!(labels, ["load", "round_robin_stale", "no_prefill_pool", "kv_aware", "conditional_bypass"]);
}

// --- property: the picker only ever returns candidates, and never pairs prefill with aggregated.

fn arb_worker() -> impl Strategy<Value = Worker> {
    let role = prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Aggregated), Just(Role::Unknown)];
    let capacity = (proptest::option::of(0..200u64), proptest::option::of(0..4096u64)).prop_map(
        |(total_kv_blocks, max_num_batched_tokens)| Capacity {
            total_kv_blocks,
            max_num_batched_tokens,
            ..Capacity::default()
        },
    );
    (0..3usize, 1..6u64, role, 0..2usize, 0..3u32, 0..3u32, proptest::option::of(0..32u32), capacity).prop_map(
        |(ns, id, role, model, dp_size, start, block_size, capacity)| Worker {
            key: WorkerKey::new(["a", "b", "c"][ns], id),
            role,
            model: ["tiny", "other"][model].into(),
            block_size,
            capacity,
            dp_size,
            dp_start_rank: start,
            ..worker("a", 0, Role::Aggregated)
        },
    )
}

/// A sample of any shape (each field absent or up to 300) and its age in milliseconds.
pub(super) fn arb_load() -> impl Strategy<Value = (Load, u64)> {
    let field = || proptest::option::of(0..300u64);
    ((field(), field(), field()), 0..12_000u64).prop_map(|((d, p, u), age_ms)| {
        (Load { active_decode_blocks: d, active_prefill_tokens: p, kv_used_blocks: u }, age_ms)
    })
}

proptest! {
    #[test]
    fn picks_only_candidates_and_never_pairs_prefill_with_aggregated(
        workers in proptest::collection::vec(arb_worker(), 0..10),
        loads in proptest::collection::vec(arb_load(), 30),
        filter in proptest::option::of(proptest::sample::subsequence(vec!["a", "b", "c"], 0..=3)),
        picks in 1..6usize,
        dispatches in proptest::collection::vec((0..400u64, 0..8_000u64), 0..6),
    ) {
        let mut by_key = BTreeMap::new();
        for w in workers { by_key.insert(w.key.clone(), w); }
        let mut fleet = Fleet::new(by_key.into_values());
        let ranks: Vec<LoadKey> = fleet.workers.iter()
            .flat_map(|w| w.dp_ranks().map(|dp_rank| LoadKey { worker: w.key.clone(), dp_rank }))
            .collect();
        for (key, (load, age_ms)) in ranks.into_iter().zip(loads) {
            if age_ms % 5 != 0 {
                fleet.loads.push((key, LoadSample { load, received_at: fleet.now - Duration::from_millis(age_ms) }));
            }
        }
        let view = fleet.view();
        let names: Option<Vec<String>> = filter.map(|f| f.into_iter().map(String::from).collect());
        let request = PickRequest { model: "tiny", prompt_tokens: 100, namespaces: names.as_deref() };
        let picker = picker();
        for i in 0..picks {
            let Some(s) = picker.pick(&view, &request, fleet.now) else {
                let any = view.workers().values().any(|w| w.model == "tiny"
                    && matches!(w.role, Role::Decode | Role::Aggregated)
                    && names.as_ref().is_none_or(|n| n.iter().any(|x| *x == *w.key.namespace)));
                prop_assert!(!any, "a decode candidate existed but nothing was picked");
                continue;
            };
            let decode = view.worker(&s.decode.worker).expect("decode worker is in the view");
            prop_assert_eq!(&decode.model, "tiny");
            prop_assert!(matches!(decode.role, Role::Decode | Role::Aggregated));
            prop_assert!(names.as_ref().is_none_or(|n| n.iter().any(|x| *x == *decode.key.namespace)));
            prop_assert_eq!(&s.namespace, &decode.key.namespace);
            check_rank(decode, s.decode.dp_rank)?;
            let pairs_here = |role| view.workers().values().any(|w| w.model == "tiny" && w.key.namespace == decode.key.namespace && w.role == role);
            if decode.role == Role::Aggregated {
                prop_assert!(s.prefill.is_none(), "prefill paired with an aggregated worker");
                prop_assert!(!(pairs_here(Role::Prefill) && pairs_here(Role::Decode)), "aggregated chosen beside a prefill/decode pool");
            }
            match &s.prefill {
                Some(p) => {
                    let prefill = view.worker(&p.worker).expect("prefill worker is in the view");
                    prop_assert_eq!(prefill.role, Role::Prefill);
                    prop_assert_eq!(&prefill.model, "tiny");
                    prop_assert_eq!(&prefill.key.namespace, &decode.key.namespace);
                    check_rank(prefill, p.dp_rank)?;
                }
                None => {
                    prop_assert_eq!(s.prefill_reason, Reason::NoPrefillPool);
                    prop_assert!(
                        !(decode.role == Role::Decode && pairs_here(Role::Prefill)),
                        "a decode worker pinned without the prefill pool beside it"
                    );
                }
            }
            if let Some((tokens, ago)) = dispatches.get(i) {
                picker.ledger().record(&s, *tokens, BLOCK, &[], fleet.now - Duration::from_millis(*ago), NOT_REPORTED);
            }
        }
    }
}

fn check_rank(worker: &Worker, dp_rank: Option<u32>) -> Result<(), TestCaseError> {
    match dp_rank {
        Some(rank) => {
            prop_assert!(worker.dp_size > 0, "rank pinned on a worker without dp");
            prop_assert!(worker.serves_rank(rank), "rank {} outside the worker's ranks", rank);
        }
        None => prop_assert_eq!(worker.dp_size, 0, "dp declared but no rank pinned"),
    }
    Ok(())
}

/// Prefill workers with no decode worker beside them pair with nobody: they take none of the
/// room a pick weighs, which the aggregated workers that do serve need.
#[test]
fn prefill_ranks_that_cannot_pair_take_no_room() {
    let prefill = (1..=64).map(|id| dp(worker("a", id, Role::Prefill), 1024));
    let fleet = Fleet::new(prefill.chain([worker("a", 100, Role::Aggregated), worker("b", 200, Role::Aggregated)]));
    let pools = PoolCache::default().get(&fleet.view(), "tiny", None);
    assert_eq!((pools.decode.len(), pools.prefill.len()), (2, 0));
}
