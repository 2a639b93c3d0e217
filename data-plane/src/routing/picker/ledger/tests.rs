use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::model::{Backlog, Capacity, DataPlaneConfig, LoadKey, ReportsFolded, Role, Worker, WorkerKey};
use continuum_proto::view::FleetView;
use proptest::prelude::*;

use super::*;
use crate::routing::picker::{Pin, Reason, Selection};

fn pin(id: u64, dp_rank: Option<u32>) -> Pin {
    Pin { worker: WorkerKey::new("ns", id), dp_rank }
}

fn key(id: u64, dp_rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new("ns", id), dp_rank }
}

fn pair(decode: u64, prefill: u64) -> Selection {
    Selection {
        namespace: Arc::from("ns"),
        model: "tiny".into(),
        decode: pin(decode, None),
        prefill: Some(pin(prefill, None)),
        decode_reason: Reason::Load,
        prefill_reason: Reason::Load,
        cached_tokens: 0,
    }
}

fn alone(decode: Pin) -> Selection {
    Selection { decode, prefill: None, prefill_reason: Reason::NoPrefillPool, ..pair(0, 0) }
}

thread_local! {
    static OPS: Cell<u64> = const { Cell::new(0) };
}

/// The next operation's number: a test's operations are numbered in the order it performs
/// them, from 1, as a replica's reporter numbers them.
fn op() -> u64 {
    OPS.with(|ops| {
        ops.set(ops.get() + 1);
        ops.get()
    })
}

/// The number the last operation took.
fn last_op() -> u64 {
    OPS.with(Cell::get)
}

/// Sums holding operations `first_op` through `last_op`.
fn folded(first_op: u64, last_op: u64) -> Option<ReportsFolded> {
    Some(ReportsFolded { first_op, last_op })
}

/// The rank's sums (how recently it was sent a dispatch has a test of its own).
fn backlog(ledger: &DispatchLedger, key: LoadKey, sampled_at: Option<Instant>, now: Instant) -> RankBacklog {
    RankBacklog { last_dispatch: LastDispatch::default(), ..ledger.backlogs(&[(key, sampled_at)], None, now)[0] }
}

/// What the ledger adds to sums holding `folded` on rank 1.
fn joined(ledger: &DispatchLedger, folded: Option<ReportsFolded>, now: Instant) -> RankBacklog {
    RankBacklog { last_dispatch: LastDispatch::default(), ..ledger.backlogs(&[(key(1, 0), None)], folded, now)[0] }
}

#[test]
fn a_dispatch_the_fleets_sums_lack_is_the_ranks_most_recent() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_millis(1);
    let last = |folded| ledger.backlogs(&[(key(1, 0), None), (key(3, 0), None)], folded, t1);
    assert_eq!(last(None)[0].last_dispatch, LastDispatch::default(), "never sent one");
    ledger.record(&pair(1, 2), 33, 16, &[], t0, 4);
    let newest = ledger.record(&pair(3, 2), 33, 16, &[], t1, 5);
    let untold = last(None);
    assert_eq!([untold[0].last_dispatch, untold[1].last_dispatch], [LastDispatch::Local(t0), LastDispatch::Local(t1)]);
    let lacking = last(Some(ReportsFolded { first_op: 1, last_op: 4 }));
    assert_eq!(lacking[0].last_dispatch, LastDispatch::default(), "the sums hold it: theirs is the rank's number");
    assert_eq!(lacking[1].last_dispatch, LastDispatch::Local(t1));
    let fleet = Backlog { last_dispatch: 12, ..Backlog::default() };
    assert_eq!(lacking[0].with_fleet(Some(&fleet)).last_dispatch, LastDispatch::Folded(12));
    assert_eq!(lacking[1].with_fleet(Some(&fleet)).last_dispatch, LastDispatch::Local(t1), "newer than any they hold");
    // A short request can end before the sums hold its start: it stays the rank's newest.
    ledger.end(newest, t1, 6);
    let ended = last(Some(ReportsFolded { first_op: 1, last_op: 4 }));
    assert_eq!(ended[1].last_dispatch, LastDispatch::Local(t1), "ended, and still unknown to the sums");
    let held = last(Some(ReportsFolded { first_op: 1, last_op: 6 }));
    assert_eq!(held[1].last_dispatch, LastDispatch::default(), "the sums hold it now");
}

/// A rank whose dispatches in flight are all unanswered.
/// A rank's backlog with no sample answering any of its dispatches.
fn rank(prefill_tokens: u64, decode_blocks: u64, stalled: bool) -> RankBacklog {
    RankBacklog {
        prefill_tokens,
        unanswered_prefill_tokens: prefill_tokens,
        decode_blocks,
        in_flight_decode_blocks: decode_blocks,
        stalled,
        ..Default::default()
    }
}

#[test]
fn pair_adds_prompt_tokens_to_prefill_and_blocks_to_decode() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&pair(1, 2), 33, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(2, 0), None, t0), rank(33, 0, false));
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(0, 3, false));
    assert_eq!(backlog(&ledger, key(3, 0), None, t0), RankBacklog::default());
}

#[test]
fn a_sample_newer_than_the_dispatch_answers_it() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_millis(10);
    ledger.record(&alone(pin(1, None)), 32, 16, &[], t1, op());
    let cases = [
        ("no sample yet", None, 2),
        ("older sample", Some(t0), 2),
        ("sample at the same instant", Some(t1), 2),
        ("newer sample", Some(t1 + Duration::from_millis(1)), 0),
    ];
    for (name, sampled_at, blocks) in cases {
        let got = backlog(&ledger, key(1, 0), sampled_at, t1);
        assert_eq!(got.decode_blocks, blocks, "{name}");
        assert_eq!(got.in_flight_decode_blocks, 2, "{name}: in flight until it ends, answered or not");
    }
}

#[test]
fn blocks_dispatches_share_count_once_until_the_last_ends() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let system: Vec<u64> = (1..=5).collect();
    let turn = |last: u64| -> Vec<u64> { system.iter().copied().chain([last]).collect() };
    // 100 tokens = 6 full blocks of 16 (hashed) and a partial one; 5 blocks are a shared prompt.
    let first = ledger.record(&alone(pin(1, None)), 100, 16, &turn(10), t0, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t0).in_flight_decode_blocks, 7);
    let t1 = t0 + Duration::from_millis(1);
    let second = ledger.record(&alone(pin(1, None)), 100, 16, &turn(11), t1, op());
    assert_eq!(
        backlog(&ledger, key(1, 0), None, t1).in_flight_decode_blocks,
        7 + 2,
        "the second adds its own full block and its partial one"
    );
    let since_first = joined(&ledger, folded(1, 1), t1).since_fleet.expect("told what the sums hold");
    assert_eq!(since_first.decode_started, 2, "what the fleet's sums lack is what the second added");
    ledger.end(first, t1, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t1).in_flight_decode_blocks, 7, "the shared prompt stays held");
    ledger.end(second, t1, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t1).in_flight_decode_blocks, 0);
}

/// A request left holding a shared prefix alone counts all of it while unanswered, not only
/// the blocks it was first to hold: the seed's "each dispatch adds its blocks until a sample
/// arrives", with blocks shared by dispatches in flight counted once.
#[test]
fn an_unanswered_request_counts_the_prefix_an_ended_one_shared_with_it() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let sampled = Some(t0);
    // 10 and 12 whole blocks of 16; the second shares the first's 10.
    let first = ledger.record(&alone(pin(1, None)), 160, 16, &(1..=10).collect::<Vec<_>>(), t0 + ms(1), op());
    ledger.record(&alone(pin(1, None)), 192, 16, &(1..=12).collect::<Vec<_>>(), t0 + ms(2), op());
    // One shorter request on the prefix, and one on another prompt.
    ledger.record(&alone(pin(1, None)), 80, 16, &(1..=5).collect::<Vec<_>>(), t0 + ms(3), op());
    ledger.record(&alone(pin(1, None)), 32, 16, &[50, 51], t0 + ms(4), op());
    let late = t0 + STALL_AFTER + ms(500);
    assert_eq!(backlog(&ledger, key(1, 0), sampled, late).decode_blocks, 14);
    ledger.end(first, t0 + ms(10), op());
    let unanswered = backlog(&ledger, key(1, 0), sampled, late);
    assert_eq!(
        (unanswered.decode_blocks, unanswered.in_flight_decode_blocks),
        (14, 14),
        "the 12 blocks held still count"
    );
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn a_decode_worker_of_a_pair_holds_a_shared_prompt_once() {
    // The decode worker keeps the KV it receives in its prefix cache: two requests with one
    // 6-block chain of a 7-block prompt hold 6 shared blocks and one each.
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let chain: Vec<u64> = (1..=6).collect();
    ledger.record(&pair(1, 2), 100, 16, &chain, t0, op());
    ledger.record(&pair(1, 2), 100, 16, &chain, t0, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t0).in_flight_decode_blocks, 8);
    assert_eq!(backlog(&ledger, key(2, 0), None, t0).in_flight_decode_blocks, 0, "the prefill leg holds nothing");
}

#[test]
fn a_rank_that_caches_the_prompt_prefills_only_the_rest_but_holds_every_block() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    // 100 tokens = 7 blocks of 16, 5 of them (80 tokens) cached on the aggregated rank: cached
    // blocks still occupy the rank while the request runs.
    ledger.record(&Selection { cached_tokens: 80, ..alone(pin(1, None)) }, 100, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(20, 7, false));
    ledger.record(&Selection { cached_tokens: 144, ..alone(pin(1, None)) }, 100, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(20, 14, false), "never below zero");
    // A pair's prefill rank holding 5 blocks prefills only the rest too; its decode rank
    // receives every block.
    ledger.record(&Selection { cached_tokens: 80, ..pair(2, 3) }, 100, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(3, 0), None, t0).prefill_tokens, 20);
    assert_eq!(backlog(&ledger, key(2, 0), None, t0), rank(0, 7, false));
}

#[test]
fn prompt_tokens_load_the_prefilling_rank_until_the_response_begins() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let aggregated = ledger.record(&alone(pin(1, None)), 64, 16, &[], t0, op());
    let paired = ledger.record(&pair(2, 3), 32, 16, &[], t0, op());
    let answered = Some(t0 + Duration::from_millis(1));
    assert_eq!(backlog(&ledger, key(1, 0), answered, t0).prefill_tokens, 64, "a sample does not answer a prefill");
    assert_eq!(backlog(&ledger, key(3, 0), answered, t0).prefill_tokens, 32);
    assert_eq!(backlog(&ledger, key(2, 0), None, t0).prefill_tokens, 0, "the decode leg of a pair prefills nothing");
    ledger.prefilled(aggregated, t0, op());
    ledger.prefilled(paired, t0, op());
    ledger.prefilled(paired, t0, op());
    // Answered by the sample above (which a dropped sample does not undo), its blocks are in
    // flight still: until it ends.
    let aggregated = backlog(&ledger, key(1, 0), None, t0);
    assert_eq!(
        (aggregated.prefill_tokens, aggregated.in_flight_decode_blocks),
        (0, 4),
        "its blocks stay until it ends"
    );
    assert_eq!(backlog(&ledger, key(3, 0), None, t0), rank(0, 0, false));
}

#[test]
fn dispatches_count_for_thirty_seconds_at_most() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&alone(pin(1, None)), 16, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(1, 0), None, t0 + UNANSWERED_FOR - Duration::from_millis(1)).decode_blocks, 1);
    assert_eq!(backlog(&ledger, key(1, 0), None, t0 + UNANSWERED_FOR).decode_blocks, 0);
    assert!(ledger.is_empty(), "the expired dispatch is forgotten");
}

#[test]
fn ended_dispatches_stop_counting_and_ending_twice_is_harmless() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let first = ledger.record(&pair(1, 2), 64, 16, &[], t0, op());
    ledger.record(&pair(1, 2), 16, 16, &[], t0, op());
    ledger.end(first, t0, op());
    ledger.end(first, t0, op());
    ledger.end(DispatchId::UNRECORDED, t0, op());
    assert_eq!(backlog(&ledger, key(2, 0), None, t0), rank(16, 0, false));
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(0, 1, false));
    assert_eq!(ledger.len(), 1);
}

#[test]
fn dp_ranks_are_kept_apart() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&alone(pin(1, Some(1))), 32, 16, &[], t0, op());
    assert_eq!(backlog(&ledger, key(1, 1), None, t0).decode_blocks, 2);
    assert_eq!(backlog(&ledger, key(1, 0), None, t0).decode_blocks, 0);
}

#[test]
fn stall_rules() {
    let t0 = Instant::now();
    let late = t0 + STALL_AFTER;
    // (case, selection, prompt tokens, queried rank, what happened to it, sampled after, expected stalled)
    let cases: &[(&str, Selection, u64, LoadKey, Happened, bool, bool)] = &[
        ("two blocks unanswered 5 s", alone(pin(1, None)), 32, key(1, 0), Happened::Nothing, false, true),
        ("one block never stalls", alone(pin(1, None)), 16, key(1, 0), Happened::Nothing, false, false),
        ("prefill leg of a pair stalls", pair(1, 2), 32, key(2, 0), Happened::Nothing, false, true),
        ("decode leg of a pair does not", pair(1, 2), 32, key(1, 0), Happened::Nothing, false, false),
        ("an ended dispatch does not", alone(pin(1, None)), 32, key(1, 0), Happened::Ended, false, false),
        ("a prefill leg that answered does not", pair(1, 2), 32, key(2, 0), Happened::Prefilled, false, false),
        ("nor does a dispatch answering", alone(pin(1, None)), 32, key(1, 0), Happened::Prefilled, false, false),
        ("a newer sample clears the stall", alone(pin(1, None)), 32, key(1, 0), Happened::Nothing, true, false),
    ];
    for (name, selection, tokens, rank_key, happened, sampled, stalled) in cases {
        let ledger = DispatchLedger::new();
        let id = ledger.record(selection, *tokens, 16, &[], t0, op());
        match happened {
            Happened::Nothing => {}
            Happened::Ended => ledger.end(id, t0, op()),
            Happened::Prefilled => ledger.prefilled(id, t0, op()),
        }
        let sampled_at = sampled.then_some(t0 + Duration::from_millis(1));
        assert!(
            !backlog(&ledger, rank_key.clone(), sampled_at, late - Duration::from_millis(1)).stalled,
            "{name}: early"
        );
        assert_eq!(backlog(&ledger, rank_key.clone(), sampled_at, late).stalled, *stalled, "{name}");
        // Past the bound on an unanswered dispatch it counts for nothing, a stall included.
        let aged_out = t0 + UNANSWERED_FOR;
        assert!(!backlog(&ledger, rank_key.clone(), sampled_at, aged_out).stalled, "{name}: aged out");
    }
}

/// A sample the control plane later drops (a sequence gap, a resubscription) answered the
/// dispatches before it all the same: they neither stall the rank nor count as unanswered again.
#[test]
fn a_sample_dropped_after_it_answered_a_dispatch_still_answered_it() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&alone(pin(1, None)), 64, 16, &[], t0, op());
    let heard = Some(t0 + Duration::from_millis(50));
    let answered = backlog(&ledger, key(1, 0), heard, t0 + Duration::from_secs(1));
    assert_eq!(answered.decode_blocks, 0, "answered: its blocks are the sample's");
    let dropped = backlog(&ledger, key(1, 0), None, t0 + STALL_AFTER + Duration::from_secs(1));
    assert!(!dropped.stalled, "the rank answered it");
    assert_eq!(dropped.decode_blocks, 0);
    // A dispatch after that sample is unanswered, and stalls.
    let t1 = t0 + Duration::from_secs(2);
    ledger.record(&alone(pin(1, None)), 64, 16, &[], t1, op());
    assert!(backlog(&ledger, key(1, 0), None, t1 + STALL_AFTER).stalled);
}

/// What became of a dispatch in [`stall_rules`].
#[derive(Debug, Clone, Copy)]
enum Happened {
    Nothing,
    Ended,
    Prefilled,
}

#[test]
fn a_full_ledger_refuses_and_counts_then_recovers_after_expiry() {
    let ledger = DispatchLedger::with_capacity(2);
    let t0 = Instant::now();
    assert!(ledger.record(&alone(pin(1, None)), 16, 16, &[], t0, op()).is_recorded());
    assert!(ledger.record(&alone(pin(2, None)), 16, 16, &[], t0, op()).is_recorded());
    let refused = ledger.record(&alone(pin(3, None)), 16, 16, &[], t0, op());
    assert!(!refused.is_recorded());
    assert_eq!(ledger.refused_total(), 1);
    ledger.end(refused, t0, op());
    assert_eq!(ledger.len(), 2);
    // Ranks nobody queries are swept when recording, so the ledger takes dispatches again.
    assert!(ledger.record(&alone(pin(3, None)), 16, 16, &[], t0 + UNANSWERED_FOR, op()).is_recorded());
    assert_eq!(ledger.len(), 1);
}

#[test]
fn default_capacity_is_the_named_bound() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    for id in 0..LEDGER_CAPACITY as u64 {
        assert!(ledger.record(&alone(pin(id % 64, None)), 1, 16, &[], t0, op()).is_recorded());
    }
    assert!(!ledger.record(&alone(pin(1, None)), 1, 16, &[], t0, op()).is_recorded());
    assert_eq!(ledger.refused_total(), 1);
}

#[test]
fn refusals_and_prompt_size_ratios_reach_the_replica_metrics() {
    let metric = prometheus::IntCounter::new("refused_total", "test").unwrap();
    let ratios = prometheus::GaugeVec::new(prometheus::Opts::new("ratio", "test"), &["model"]).unwrap();
    let ledger = DispatchLedger::with_metrics(metric.clone(), ratios.clone());
    let t0 = Instant::now();
    for id in 0..LEDGER_CAPACITY as u64 + 3 {
        ledger.record(&alone(pin(id % 64, None)), 1, 16, &[], t0, op());
    }
    assert_eq!(metric.get(), 3);
    ledger.prompt_sizes().learn("tiny", 100, 200);
    assert_eq!(ratios.with_label_values(&["tiny"]).get(), ledger.prompt_sizes().factor("tiny"));
    assert!(ratios.with_label_values(&["tiny"]).get() > 1.0);
}

#[test]
fn block_size_comes_from_the_decode_worker_card() {
    let worker = |id: u64, block_size: Option<u32>| {
        Arc::new(Worker {
            key: WorkerKey::new("ns", id),
            role: Role::Decode,
            model: "tiny".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size,
            capacity: Capacity::default(),
            dp_start_rank: 0,
            dp_size: 0,
            disaggregated_endpoint: None,
            artifacts: None,
        })
    };
    let view = FleetView::new(
        1,
        [worker(1, Some(64)), worker(2, None), worker(3, Some(0))],
        [],
        Arc::new(DataPlaneConfig::default()),
    )
    .expect("view");
    assert_eq!(dispatch_block_size(&view, &alone(pin(1, None))), 64);
    assert_eq!(dispatch_block_size(&view, &alone(pin(2, None))), FALLBACK_BLOCK_SIZE);
    assert_eq!(dispatch_block_size(&view, &alone(pin(3, None))), FALLBACK_BLOCK_SIZE);
    assert_eq!(dispatch_block_size(&view, &alone(pin(9, None))), FALLBACK_BLOCK_SIZE);
}

#[test]
fn the_fleet_backlog_joins_the_local_one_field_by_field_without_adding() {
    let local = rank(100, 3, true);
    assert_eq!(local.with_fleet(None), local);
    let fleet = Backlog { prefill_tokens: 50, decode_blocks: 9, dispatches: 4, ..Backlog::default() };
    assert_eq!(local.with_fleet(Some(&fleet)), rank(100, 9, true));
    // Stalls stay local, and so does what no sample has answered: the sums do not say.
    let joined = RankBacklog { unanswered_prefill_tokens: 0, ..rank(50, 9, false) };
    assert_eq!(RankBacklog::default().with_fleet(Some(&fleet)), joined);
    let measured = Backlog { foreign_decode_blocks: Some(7), ..fleet };
    assert_eq!(local.with_fleet(Some(&measured)).foreign_decode_blocks, Some(7), "only the fleet measures it");
}

#[test]
fn the_decode_backlog_is_foreign_plus_in_flight_once_the_fleet_measured_it() {
    let answered = RankBacklog { decode_blocks: 0, in_flight_decode_blocks: 40, ..RankBacklog::default() };
    assert_eq!(answered.decode_backlog(500), 500, "the seed's rule: the sample plus unanswered dispatches");
    let measured = RankBacklog { foreign_decode_blocks: Some(3), ..answered };
    assert_eq!(measured.decode_backlog(500), 43, "a stale sample's 500 blocks do not count twice");
    let ending = RankBacklog { ending_decode_blocks: 30, ..measured };
    assert_eq!(ending.decode_backlog(500), 43, "now, the ending dispatches still hold their blocks");
    assert_eq!(ending.handover_decode_backlog(500), 13, "by hand-over they will have ended");
    assert_eq!(RankBacklog { ending_decode_blocks: 90, ..measured }.handover_decode_backlog(500), 0);
}

/// An ending dispatch this replica saw end since the fleet's sums were taken is subtracted
/// once: it has left the blocks in flight, so it no longer counts as ending.
#[test]
fn dispatches_this_replica_saw_end_are_not_discounted_twice() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let id = ledger.record(&alone(pin(1, None)), 1600, 16, &[], t0, op());
    let sums = folded(1, last_op());
    let fleet =
        Backlog { decode_blocks: 300, ending_decode_blocks: 250, foreign_decode_blocks: Some(0), ..Backlog::default() };
    let t1 = t0 + Duration::from_millis(2);
    let before = joined(&ledger, sums, t1).with_fleet(Some(&fleet));
    assert_eq!((before.in_flight_decode_blocks, before.ending_decode_blocks), (300, 250));
    assert_eq!(before.handover_decode_backlog(0), 50);
    ledger.end(id, t1, op());
    let after = joined(&ledger, sums, t1).with_fleet(Some(&fleet));
    assert_eq!((after.in_flight_decode_blocks, after.ending_decode_blocks), (200, 150));
    assert_eq!(after.handover_decode_backlog(0), 50, "its end changes nothing at hand-over");
}

/// The control plane credits the prefill under way with what it should have done; a prefill
/// this replica saw answered since the sums were taken was most likely that one, so its
/// tokens leave both the queue and the credit, and nothing is taken off twice.
#[test]
fn the_prefill_under_way_is_credited_once_and_not_after_this_replica_saw_it_answered() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let first = ledger.record(&alone(pin(1, None)), 1600, 16, &[], t0, op());
    let sums = folded(1, last_op());
    // This replica's prompt, half done, and another replica's behind it.
    let fleet = Backlog { prefill_tokens: 3200, prefilled_tokens: 800, dispatches: 2, ..Backlog::default() };
    let t1 = t0 + Duration::from_millis(2);
    let before = joined(&ledger, sums, t1).with_fleet(Some(&fleet));
    assert_eq!((before.prefill_tokens, before.queued_prefill_tokens()), (3200, 2400));
    ledger.prefilled(first, t1, op());
    let after = joined(&ledger, sums, t1).with_fleet(Some(&fleet));
    assert_eq!((after.prefill_tokens, after.queued_prefill_tokens()), (1600, 1600), "the other prompt, whole");
    let untold = joined(&ledger, None, t1).with_fleet(Some(&fleet));
    assert_eq!(untold.queued_prefill_tokens(), 2400, "untold: the sums and their credit");
    assert_eq!(
        RankBacklog { prefill_tokens: 100, prefilled_tokens: 300, ..RankBacklog::default() }.queued_prefill_tokens(),
        0
    );
}

/// The fleet's sums trail this replica's reports: a burst that just ended on a rank is still in
/// them. Brought up to date with the operations they do not hold, the sums drop the ended
/// burst at once and count the new dispatch, instead of keeping the larger of two views (which
/// would hold the ended burst until the sums caught up).
#[test]
fn the_fleet_sums_are_brought_up_to_date_with_this_replicas_own_dispatches() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let burst: Vec<DispatchId> = (0..8).map(|_| ledger.record(&alone(pin(1, None)), 1600, 16, &[], t0, op())).collect();
    let sums = folded(1, last_op());
    let fleet = Backlog { decode_blocks: 800, dispatches: 8, ..Backlog::default() };
    let t1 = t0 + Duration::from_millis(2);
    for id in burst {
        ledger.end(id, t1, op());
    }
    ledger.record(&alone(pin(1, None)), 160, 16, &[], t1, op());
    let local = joined(&ledger, sums, t1);
    let since = local.since_fleet.expect("told what the sums hold");
    assert_eq!((since.decode_started, since.decode_ended), (10, 800));
    assert_eq!(local.with_fleet(Some(&fleet)).in_flight_decode_blocks, 10, "800 + 10 - 800");
    let untold = joined(&ledger, None, t1);
    assert_eq!(untold.with_fleet(Some(&fleet)).in_flight_decode_blocks, 800, "untold: the larger view");
    // Another replica's 30 blocks are in the sums too, and stay.
    let shared = Backlog { decode_blocks: 830, ..fleet };
    assert_eq!(local.with_fleet(Some(&shared)).in_flight_decode_blocks, 40);
    // A rank no sample has measured (no foreign part) counts the fleet's dispatches whole, up
    // to date the same way: not the sums' 830, which hold the burst that ended.
    assert_eq!(local.with_fleet(Some(&shared)).decode_backlog(0), 40);
    assert_eq!(untold.with_fleet(Some(&shared)).decode_backlog(0), 830, "untold: the larger view");
    // Once the sums hold every operation, nothing is the ledger's to add.
    let caught_up = joined(&ledger, folded(1, last_op()), t1).since_fleet.expect("told");
    assert_eq!(caught_up, SinceFleet::default());
    // Changes are remembered for a while only. Sums trailing by more still lack the dispatch in
    // flight, known from its leg; the burst's ends are no longer known, so the rank reads
    // busier than it is (810), never idler: its new dispatches are not lost from both views.
    let later = t1 + Duration::from_secs(2);
    let stale = joined(&ledger, sums, later).since_fleet.expect("told");
    assert_eq!((stale.decode_started, stale.decode_ended), (10, 0));
    assert_eq!(joined(&ledger, sums, later).with_fleet(Some(&fleet)).in_flight_decode_blocks, 810);
    let caught_up = joined(&ledger, folded(1, last_op()), later).since_fleet;
    assert_eq!(caught_up, Some(SinceFleet::default()), "sums holding every operation lack nothing");
}

/// A buffered answer's prompt, which the control plane deemed done by the rank's prefill time
/// before the answer ended: its end does not take the prompt off sums that no longer hold it.
#[test]
fn the_end_of_a_buffered_answer_takes_no_prompt_off_sums_that_let_it_go() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let buffered = Recorded { op: op(), legs: [31, 0], buffered: true };
    let answer = ledger.record(&alone(pin(1, None)), 1600, 16, &[], t0, buffered);
    let other =
        ledger.record(&alone(pin(1, None)), 800, 16, &[], t0, Recorded { op: op(), legs: [32, 0], buffered: false });
    let sums = folded(1, last_op());
    // The sums hold the streamed prompt only: the buffered one was deemed done.
    let fleet = Backlog { prefill_tokens: 800, decode_blocks: 150, dispatches: 2, ..Backlog::default() };
    let t1 = t0 + Duration::from_secs(2);
    ledger.end(answer, t1, op());
    let queued = joined(&ledger, sums, t1).with_fleet(Some(&fleet)).prefill_tokens;
    assert_eq!(queued, 800, "the streamed prompt still queued, not 800 - 1600");
    // A streamed answer's end takes its prompt off: the sums hold it until a first token.
    ledger.end(other, t1, op());
    assert_eq!(joined(&ledger, sums, t1).with_fleet(Some(&fleet)).prefill_tokens, 0);
}

/// Two replicas each queue a prompt on a rank; the fleet's sums hold both. This replica then
/// queues another. The rank has three prompts queued: the larger of the two views would count
/// two, and a burst arriving through several replicas would stack its prompts on one worker.
#[test]
fn the_fleet_sums_of_queued_prompts_are_brought_up_to_date_with_this_replicas_own() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let first = ledger.record(&alone(pin(1, None)), 1600, 16, &[], t0, op());
    // This replica's first prompt and another replica's.
    let sums = folded(1, last_op());
    let fleet = Backlog { prefill_tokens: 3200, decode_blocks: 200, dispatches: 2, ..Backlog::default() };
    let queued = |now| joined(&ledger, sums, now).with_fleet(Some(&fleet)).prefill_tokens;

    let t1 = t0 + Duration::from_millis(2);
    let third = ledger.record(&alone(pin(1, None)), 1600, 16, &[], t1, op());
    assert_eq!(queued(t1), 4800, "3200 in the sums + 1600 queued since");
    let untold = joined(&ledger, None, t1);
    assert_eq!(untold.with_fleet(Some(&fleet)).prefill_tokens, 3200, "untold: the larger view");

    // The first prompt's response begins: the sums still hold it.
    let t2 = t0 + Duration::from_millis(3);
    ledger.prefilled(first, t2, op());
    assert_eq!(queued(t2), 3200, "3200 + 1600 - 1600");
    // The third is cancelled before its response began.
    ledger.end(third, t2, op());
    assert_eq!(queued(t2), 1600, "the other replica's prompt is all that is queued");
    // Once the first has ended too, the ledger still remembers for a while what left the sums.
    ledger.end(first, t2, op());
    assert_eq!(queued(t2), 1600);
}

/// What the age of the sums could not tell: a dispatch recorded *before* the sums were taken
/// whose report had not reached the control plane yet, and dispatches recorded before this
/// stream's first report (the control plane never had them). Both are the ledger's to add.
#[test]
fn operations_outside_the_range_the_sums_hold_are_added_whatever_their_time() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    // Recorded while the stream was down: operation 1, never reported to this stream.
    let before_stream = ledger.record(&alone(pin(1, None)), 160, 16, &[], t0, op());
    // Reported on the new stream: operations 2 and 3; the sums hold the first of them only.
    ledger.record(&alone(pin(1, None)), 320, 16, &[], t0, op());
    let in_flight = ledger.record(&alone(pin(1, None)), 480, 16, &[], t0, op());
    let sums = folded(2, 2);
    let fleet = Backlog { prefill_tokens: 320, decode_blocks: 20, dispatches: 1, ..Backlog::default() };

    let now = t0 + Duration::from_millis(5);
    let since = joined(&ledger, sums, now).since_fleet.expect("told");
    assert_eq!((since.decode_started, since.prefill_started), (10 + 30, 160 + 480));
    let total = joined(&ledger, sums, now).with_fleet(Some(&fleet));
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (960, 60), "all three, once each");

    // The newest ends before the sums hold it: its start and end cancel out.
    ledger.end(in_flight, now, op());
    let total = joined(&ledger, sums, now).with_fleet(Some(&fleet));
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (320 + 160, 20 + 10));
    // The one from before the stream ends on it. The control plane never had it, so its end
    // is not remembered for the join: it leaves the legs the sums lack, and the join is right
    // at once, before and after the sums hold the end.
    ledger.end(before_stream, now, Op { number: op(), stream_first: 2 });
    for sums in [sums, folded(2, last_op())] {
        let total = joined(&ledger, sums, now).with_fleet(Some(&fleet));
        assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (320, 20), "only operation 2 is in flight");
    }
}

#[test]
fn the_first_token_of_a_dispatch_from_an_earlier_stream_leaves_the_join_right() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    // Recorded and reported on a stream since lost (operation 1); the new one starts at 2.
    let old = ledger.record(&alone(pin(1, None)), 160, 16, &[], t0, op());
    let new = ledger.record(&alone(pin(1, None)), 320, 16, &[], t0, op());
    let sums = folded(2, 2);
    let fleet = Backlog { prefill_tokens: 320, decode_blocks: 20, dispatches: 1, ..Backlog::default() };
    let total = joined(&ledger, sums, t0).with_fleet(Some(&fleet));
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (480, 30), "both, once each");
    // The old one's response begins: its prompt is done, its blocks stay until it ends.
    ledger.prefilled(old, t0, Op { number: op(), stream_first: 2 });
    let total = joined(&ledger, sums, t0).with_fleet(Some(&fleet));
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (320, 30));
    ledger.end(new, t0, op());
    ledger.end(old, t0, Op { number: op(), stream_first: 2 });
    let drained = Backlog { prefill_tokens: 0, decode_blocks: 0, dispatches: 0, ..Backlog::default() };
    let total = joined(&ledger, folded(2, last_op()), t0).with_fleet(Some(&drained));
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (0, 0), "nothing is left, nothing owed");
}

/// A dispatch past `UNANSWERED_FOR` counts nowhere: a new stream does not report it again,
/// whether or not a sweep found it first.
#[test]
fn a_dispatch_past_the_unanswered_bound_is_not_replayed() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let old =
        ledger.record(&alone(pin(1, None)), 160, 16, &[], t0, Recorded { op: op(), legs: [21, 0], buffered: false });
    let later = t0 + UNANSWERED_FOR - Duration::from_millis(1);
    let young =
        ledger.record(&alone(pin(2, None)), 160, 16, &[], later, Recorded { op: op(), legs: [22, 0], buffered: false });
    let stream_first = op();
    let ids = ledger.dispatches_before(stream_first);
    assert_eq!(ids, [old, young], "listed before the sweep");
    let (_, legs) = ledger.replay_legs(&ids, usize::MAX, stream_first, stream_first, t0 + UNANSWERED_FOR);
    let replayed: Vec<u64> = legs.iter().map(|leg| leg.report).collect();
    assert_eq!(replayed, [22], "only the dispatch still within the bound");
}

/// A new stream (after a reconnect, or a control plane that restarted) holds none of the
/// dispatches in flight: the ledger reports them again, under their first reports' ids and by
/// an operation of the new stream, with what each still weighs and since when. From then on
/// the join counts them as the sums do: once, whether or not they were reported before.
#[test]
fn dispatches_in_flight_are_replayed_on_a_new_stream_and_then_joined_once() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let reported = |legs| Recorded { op: op(), legs, buffered: false };
    // On the stream since lost: one reported (operation 1) whose response began, one whose
    // operation found the queue full, and a pair whose prefill worker answered.
    let answered = ledger.record(&alone(pin(1, None)), 160, 16, &[], t0, reported([11, 0]));
    let unreported = ledger.record(
        &alone(pin(1, None)),
        320,
        16,
        &[],
        t0,
        Recorded { op: NOT_REPORTED, legs: [12, 0], buffered: false },
    );
    let paired = ledger.record(&pair(1, 2), 480, 16, &[], t0, reported([13, 14]));
    ledger.prefilled(answered, t0, op());
    ledger.prefilled(paired, t0, op());
    // The new stream's first operation is the replay.
    let stream_first = op();
    let ids = ledger.dispatches_before(stream_first);
    assert_eq!(ids, [answered, unreported, paired]);
    let later = t0 + Duration::from_millis(700);
    let (taken, legs) = ledger.replay_legs(&ids, usize::MAX, stream_first, stream_first, later);
    assert_eq!(taken, 3);
    let shown: Vec<(u64, u64, u64, bool)> =
        legs.iter().map(|l| (l.report, l.prefill_tokens, l.decode_blocks, l.answered)).collect();
    assert_eq!(
        shown,
        [(11, 0, 10, true), (12, 320, 20, false), (14, 0, 30, true)],
        "the prefill worker's leg, answered and holding nothing, is over (its end went with its first token)"
    );
    assert!(legs.iter().all(|l| l.age == Duration::from_millis(700) && l.rank == key(1, 0)));
    assert!(ledger.dispatches_before(stream_first).is_empty(), "replayed once");
    assert!(ledger.replay_legs(&ids, usize::MAX, stream_first, stream_first, later).1.is_empty());

    // A dispatch on the new stream, after the replay; the sums hold the replay only.
    ledger.record(&alone(pin(1, None)), 640, 16, &[], later, reported([15, 0]));
    let truth = backlog(&ledger, key(1, 0), None, later);
    let fleet = Backlog { prefill_tokens: 320, decode_blocks: 10 + 20 + 30, dispatches: 3, ..Backlog::default() };
    let total = joined(&ledger, folded(stream_first, stream_first), later).with_fleet(Some(&fleet));
    assert_eq!(
        (total.prefill_tokens, total.in_flight_decode_blocks),
        (truth.prefill_tokens, truth.in_flight_decode_blocks)
    );
    assert_eq!((total.prefill_tokens, total.in_flight_decode_blocks), (320 + 640, 100), "each once");
}

/// A replayed leg that is its rank's newest is the sums' newest once they hold the replay: it
/// no longer reads as dispatched just now, ahead of every rank the sums order.
#[test]
fn a_replayed_newest_leg_is_ordered_by_the_sums_once_they_hold_it() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let id =
        ledger.record(&alone(pin(1, None)), 160, 16, &[], t0, Recorded { op: op(), legs: [11, 0], buffered: false });
    let stream_first = op();
    let later = t0 + Duration::from_secs(20);
    assert_eq!(ledger.replay_legs(&[id], usize::MAX, stream_first, stream_first, later).0, 1);
    let replayed = folded(stream_first, stream_first);
    let last = ledger.backlogs(&[(key(1, 0), None)], replayed, later)[0].last_dispatch;
    assert_eq!(last, LastDispatch::default(), "the sums hold it");
}

/// A replay operation takes dispatches until their chains would pass its hash budget (one at
/// least, however long), so the report carrying it never drops a chain.
#[test]
fn a_replay_takes_dispatches_within_its_hash_budget() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let chain: Vec<u64> = (0..100).collect();
    let ids: Vec<DispatchId> = (0..3)
        .map(|i| {
            ledger.record(
                &alone(pin(1, None)),
                1600,
                16,
                &chain,
                t0,
                Recorded { op: op(), legs: [20 + i, 0], buffered: false },
            )
        })
        .collect();
    let stream_first = op();
    let (taken, legs) = ledger.replay_legs(&ids, 250, stream_first, stream_first, t0);
    assert_eq!((taken, legs.len()), (2, 2), "two chains of 100 fit 250, a third would not");
    assert!(legs.iter().all(|l| l.block_hashes.len() == 100));
    let (taken, legs) = ledger.replay_legs(&ids[2..], 10, stream_first, stream_first, t0);
    assert_eq!((taken, legs.len()), (1, 1), "one at least");
}

/// One step of a replica's dispatches on one rank, for the join's property test.
#[derive(Clone, Debug)]
enum Step {
    Record {
        tokens: u64,
    },
    /// A dispatch whose recording found the report queue full.
    RecordUnreported {
        tokens: u64,
    },
    /// The response of the `n`th dispatch still in flight (modulo their count) began.
    Prefilled(usize),
    /// The `n`th dispatch still in flight (modulo their count) ended.
    End(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        (1..2000u64).prop_map(|tokens| Step::Record { tokens }),
        (1..2000u64).prop_map(|tokens| Step::RecordUnreported { tokens }),
        any::<usize>().prop_map(Step::Prefilled),
        any::<usize>().prop_map(Step::End),
    ];
    proptest::collection::vec(step, 1..40)
}

/// The control plane's sums after folding a prefix of the operations: what each dispatch
/// reported, as the book counts it (prompt tokens until the first token, blocks until the end).
#[derive(Clone, Default)]
struct Sums {
    in_flight: BTreeMap<usize, (u64, u64)>,
}

impl Sums {
    fn backlog(&self) -> Backlog {
        let (prefill_tokens, decode_blocks) =
            self.in_flight.values().fold((0, 0), |(tokens, blocks), (t, b)| (tokens + t, blocks + b));
        Backlog { prefill_tokens, decode_blocks, ..Backlog::default() }
    }
}

proptest! {
    /// Whatever the operations (some of them never reported) and however far the sums trail
    /// them, the sums joined with what the ledger says they lack are exactly what the ledger
    /// holds.
    #[test]
    fn the_join_is_exact_wherever_the_sums_stand(script in steps()) {
        let ledger = DispatchLedger::new();
        let t0 = Instant::now();
        // Dispatch index → ledger id, in flight; and each operation's effect on the sums.
        let mut live: Vec<(usize, DispatchId)> = Vec::new();
        let mut folded_after: Vec<Sums> = vec![Sums::default()];
        for (op, step) in (1u64..).zip(&script) {
            let mut sums = folded_after.last().cloned().unwrap_or_default();
            match *step {
                Step::Record { tokens } => {
                    let id = ledger.record(&alone(pin(1, None)), tokens, 16, &[], t0, op);
                    let index = op as usize;
                    live.push((index, id));
                    sums.in_flight.insert(index, (tokens, tokens.div_ceil(16)));
                }
                Step::RecordUnreported { tokens } => {
                    // The control plane never hears of it, nor so of its first token or end.
                    let id = ledger.record(&alone(pin(1, None)), tokens, 16, &[], t0, NOT_REPORTED);
                    live.push((op as usize, id));
                }
                Step::Prefilled(n) if !live.is_empty() => {
                    let (index, id) = live[n % live.len()];
                    ledger.prefilled(id, t0, op);
                    if let Some(entry) = sums.in_flight.get_mut(&index) {
                        entry.0 = 0;
                    }
                }
                Step::End(n) if !live.is_empty() => {
                    let (index, id) = live.remove(n % live.len());
                    ledger.end(id, t0, op);
                    sums.in_flight.remove(&index);
                }
                // Nothing in flight: an operation that reports nothing still takes its number.
                Step::Prefilled(_) | Step::End(_) => {}
            }
            folded_after.push(sums);
        }
        let truth = backlog(&ledger, key(1, 0), None, t0);
        for (last_op, sums) in folded_after.iter().enumerate() {
            // Through operation 0: the sums hold nothing of this replica's yet.
            let joined = joined(&ledger, folded(1, last_op as u64), t0).with_fleet(Some(&sums.backlog()));
            prop_assert_eq!(
                (joined.prefill_tokens, joined.in_flight_decode_blocks),
                (truth.prefill_tokens, truth.in_flight_decode_blocks),
                "sums through operation {}", last_op
            );
        }
    }
}
