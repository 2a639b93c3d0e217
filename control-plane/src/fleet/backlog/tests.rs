use std::time::{Duration, Instant};

use continuum_proto::model::{Capacity, DataPlaneConfig, Load, LoadSample, Role, Worker, WorkerKey};

use super::*;

fn state_with(dp_size: u32) -> FleetState {
    let worker = Arc::new(Worker {
        key: WorkerKey::new("dynamo", 1),
        role: Role::Decode,
        model: "tiny".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity::default(),
        dp_start_rank: 0,
        dp_size,
        disaggregated_endpoint: None,
        artifacts: None,
    });
    let state = FleetState::new(1, Arc::new(DataPlaneConfig::default()));
    match state.commit(FleetChange { upsert: vec![worker], ..FleetChange::default() }) {
        Some((state, _)) => state,
        None => panic!("upsert is a change"),
    }
}

fn rank(dp_rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank }
}

fn started(id: u64, dp_rank: u32, tokens: u64) -> pb::DispatchStarted {
    let rank = Some((&rank(dp_rank)).into());
    pb::DispatchStarted { id, rank, prefill_tokens: tokens, decode_blocks: tokens / 16, block_hashes: Vec::new() }
}

fn report(started: Vec<pb::DispatchStarted>, ended: Vec<u64>) -> pb::DispatchReport {
    pb::DispatchReport { started, ended }
}

#[test]
fn reports_from_several_replicas_sum_per_rank_and_ends_subtract() {
    let state = state_with(2);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 160), started(2, 1, 32)], vec![]), t0, &state);
    book.report(2, report(vec![started(1, 0, 320)], vec![]), t0, &state);
    let change = book.take_change();
    let sums: Vec<_> =
        change.backlogs.iter().map(|(k, b)| (k.dp_rank, b.prefill_tokens, b.decode_blocks, b.dispatches)).collect();
    assert_eq!(sums, [(0, 480, 30, 2), (1, 32, 2, 1)], "replica ids are separate id spaces");

    book.report(1, report(vec![], vec![1, 2]), t0, &state);
    let change = book.take_change();
    assert_eq!(change.backlogs.iter().map(|(k, b)| (k.dp_rank, b.prefill_tokens)).collect::<Vec<_>>(), [(0, 320)]);
    assert_eq!(change.backlogs_removed, [rank(1)], "a rank with nothing outstanding is removed");
}

#[test]
fn reports_for_ranks_the_fleet_does_not_have_are_refused() {
    let state = state_with(0);
    let mut book = Book::default();
    book.report(1, report(vec![started(1, 3, 16)], vec![]), Instant::now(), &state);
    let mut stranger = started(2, 0, 16);
    stranger.rank = Some((&LoadKey { worker: WorkerKey::new("dynamo", 99), dp_rank: 0 }).into());
    book.report(1, report(vec![stranger], vec![]), Instant::now(), &state);
    assert_eq!(book.refused, 2);
    assert!(book.take_change().backlogs.is_empty());
}

#[test]
fn a_sample_received_after_a_dispatch_answers_it() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.take_change();
    let sample = LoadSample {
        load: Load { kv_used_blocks: Some(1), ..Load::default() },
        received_at: t0 + Duration::from_millis(5),
    };
    let Some((answered, _)) = state.commit(FleetChange { loads: vec![(rank(0), sample)], ..FleetChange::default() })
    else {
        panic!("a sample is a change");
    };
    book.expire(&answered, t0 + Duration::from_millis(6));
    assert_eq!(book.take_change().backlogs_removed, [rank(0)]);
}

#[test]
fn dispatches_age_out_and_leave_with_their_replica() {
    let state = state_with(0);
    let mut book = Book::default();
    let t0 = Instant::now();
    book.report(1, report(vec![started(1, 0, 16)], vec![]), t0, &state);
    book.report(2, report(vec![started(1, 0, 16)], vec![]), t0 + Duration::from_secs(20), &state);
    book.expire(&state, t0 + DISPATCH_MAX_AGE);
    book.take_change();
    assert_eq!(book.by_rank.get(&rank(0)).map(|d| d.len()), Some(1), "only the old dispatch aged out");
    book.replica_gone(2);
    assert!(book.by_rank.is_empty());
    assert_eq!(book.take_change().backlogs_removed, [rank(0)]);
}

#[test]
fn a_replica_holds_a_bounded_number_of_dispatches() {
    let state = state_with(0);
    let mut book = Book::default();
    let many = (0..MAX_DISPATCHES_PER_REPLICA as u64 + 10).map(|id| started(id, 0, 16)).collect();
    book.report(1, report(many, vec![]), Instant::now(), &state);
    assert_eq!(book.where_is.len(), MAX_DISPATCHES_PER_REPLICA);
    assert_eq!(book.refused, 10);
}
