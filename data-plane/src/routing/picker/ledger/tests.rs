use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::model::{Backlog, Capacity, DataPlaneConfig, LoadKey, Role, Worker, WorkerKey};
use continuum_proto::view::FleetView;

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
        prefill_reason: Some(Reason::Load),
    }
}

fn alone(decode: Pin) -> Selection {
    Selection { decode, prefill: None, prefill_reason: Some(Reason::NoPrefillPool), ..pair(0, 0) }
}

fn backlog(ledger: &DispatchLedger, key: LoadKey, sampled_at: Option<Instant>, now: Instant) -> RankBacklog {
    ledger.backlogs(&[(key, sampled_at)], now)[0]
}

const fn rank(prefill_tokens: u64, decode_blocks: u64, stalled: bool) -> RankBacklog {
    RankBacklog { prefill_tokens, decode_blocks, stalled }
}

#[test]
fn pair_adds_prompt_tokens_to_prefill_and_blocks_to_decode() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&pair(1, 2), 33, 16, t0);
    assert_eq!(backlog(&ledger, key(2, 0), None, t0), rank(33, 0, false));
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(0, 3, false));
    assert_eq!(backlog(&ledger, key(3, 0), None, t0), RankBacklog::default());
}

#[test]
fn a_sample_newer_than_the_dispatch_answers_it() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_millis(10);
    ledger.record(&alone(pin(1, None)), 32, 16, t1);
    let cases = [
        ("no sample yet", None, 2),
        ("older sample", Some(t0), 2),
        ("sample at the same instant", Some(t1), 2),
        ("newer sample", Some(t1 + Duration::from_millis(1)), 0),
    ];
    for (name, sampled_at, blocks) in cases {
        assert_eq!(backlog(&ledger, key(1, 0), sampled_at, t1).decode_blocks, blocks, "{name}");
    }
}

#[test]
fn dispatches_count_for_thirty_seconds_at_most() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&alone(pin(1, None)), 16, 16, t0);
    assert_eq!(backlog(&ledger, key(1, 0), None, t0 + UNANSWERED_FOR - Duration::from_millis(1)).decode_blocks, 1);
    assert_eq!(backlog(&ledger, key(1, 0), None, t0 + UNANSWERED_FOR).decode_blocks, 0);
    assert!(ledger.is_empty(), "the expired dispatch is forgotten");
}

#[test]
fn ended_dispatches_stop_counting_and_ending_twice_is_harmless() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    let first = ledger.record(&pair(1, 2), 64, 16, t0);
    ledger.record(&pair(1, 2), 16, 16, t0);
    ledger.end(first, t0);
    ledger.end(first, t0);
    ledger.end(DispatchId::UNRECORDED, t0);
    assert_eq!(backlog(&ledger, key(2, 0), None, t0), rank(16, 0, false));
    assert_eq!(backlog(&ledger, key(1, 0), None, t0), rank(0, 1, false));
    assert_eq!(ledger.len(), 1);
}

#[test]
fn dp_ranks_are_kept_apart() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    ledger.record(&alone(pin(1, Some(1))), 32, 16, t0);
    assert_eq!(backlog(&ledger, key(1, 1), None, t0).decode_blocks, 2);
    assert_eq!(backlog(&ledger, key(1, 0), None, t0).decode_blocks, 0);
}

#[test]
fn stall_rules() {
    let t0 = Instant::now();
    let late = t0 + STALL_AFTER;
    // (case, selection, prompt tokens, queried rank, ended, sampled after, expected stalled)
    let cases: &[(&str, Selection, u64, LoadKey, bool, bool, bool)] = &[
        ("two blocks unanswered 5 s", alone(pin(1, None)), 32, key(1, 0), false, false, true),
        ("one block never stalls", alone(pin(1, None)), 16, key(1, 0), false, false, false),
        ("prefill leg of a pair stalls", pair(1, 2), 32, key(2, 0), false, false, true),
        ("decode leg of a pair does not", pair(1, 2), 32, key(1, 0), false, false, false),
        ("an ended dispatch does not", alone(pin(1, None)), 32, key(1, 0), true, false, false),
        ("a newer sample clears the stall", alone(pin(1, None)), 32, key(1, 0), false, true, false),
    ];
    for (name, selection, tokens, rank_key, ended, sampled, stalled) in cases {
        let ledger = DispatchLedger::new();
        let id = ledger.record(selection, *tokens, 16, t0);
        if *ended {
            ledger.end(id, t0);
        }
        let sampled_at = sampled.then_some(t0 + Duration::from_millis(1));
        assert!(
            !backlog(&ledger, rank_key.clone(), sampled_at, late - Duration::from_millis(1)).stalled,
            "{name}: early"
        );
        assert_eq!(backlog(&ledger, rank_key.clone(), sampled_at, late).stalled, *stalled, "{name}");
    }
}

#[test]
fn a_full_ledger_refuses_and_counts_then_recovers_after_expiry() {
    let ledger = DispatchLedger::with_capacity(2);
    let t0 = Instant::now();
    assert!(ledger.record(&alone(pin(1, None)), 16, 16, t0).is_recorded());
    assert!(ledger.record(&alone(pin(2, None)), 16, 16, t0).is_recorded());
    let refused = ledger.record(&alone(pin(3, None)), 16, 16, t0);
    assert!(!refused.is_recorded());
    assert_eq!(ledger.refused_total(), 1);
    ledger.end(refused, t0);
    assert_eq!(ledger.len(), 2);
    // Ranks nobody queries are swept when recording, so the ledger takes dispatches again.
    assert!(ledger.record(&alone(pin(3, None)), 16, 16, t0 + UNANSWERED_FOR).is_recorded());
    assert_eq!(ledger.len(), 1);
}

#[test]
fn default_capacity_is_the_named_bound() {
    let ledger = DispatchLedger::new();
    let t0 = Instant::now();
    for id in 0..LEDGER_CAPACITY as u64 {
        assert!(ledger.record(&alone(pin(id % 64, None)), 1, 16, t0).is_recorded());
    }
    assert!(!ledger.record(&alone(pin(1, None)), 1, 16, t0).is_recorded());
    assert_eq!(ledger.refused_total(), 1);
}

#[test]
fn refusals_reach_the_replica_metric() {
    let metric = prometheus::IntCounter::new("refused_total", "test").unwrap();
    let ledger = DispatchLedger::counting_refusals(metric.clone());
    let t0 = Instant::now();
    for id in 0..LEDGER_CAPACITY as u64 + 3 {
        ledger.record(&alone(pin(id % 64, None)), 1, 16, t0);
    }
    assert_eq!(metric.get(), 3);
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
    let fleet = Backlog { prefill_tokens: 50, decode_blocks: 9, dispatches: 4 };
    assert_eq!(local.with_fleet(Some(&fleet)), rank(100, 9, true));
    assert_eq!(RankBacklog::default().with_fleet(Some(&fleet)), rank(50, 9, false), "stalls stay local");
}
