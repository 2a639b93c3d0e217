use std::sync::Arc;
use std::time::Instant;

use continuum_proto::model::{Backlog, Capacity, DataPlaneConfig, Load, LoadKey, LoadSample, Role, Worker, WorkerKey};

use super::*;

fn worker(id: u64, model: &str) -> Arc<Worker> {
    Arc::new(Worker {
        key: WorkerKey::new("dynamo", id),
        role: Role::Prefill,
        model: model.into(),
        component: "prefill".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity { total_kv_blocks: Some(64), ..Capacity::default() },
        dp_start_rank: 0,
        dp_size: 0,
        disaggregated_endpoint: None,
        artifacts: None,
    })
}

fn sample(used: u64) -> LoadSample {
    LoadSample { load: Load { kv_used_blocks: Some(used), ..Load::default() }, received_at: Instant::now() }
}

fn upsert(workers: Vec<Arc<Worker>>) -> FleetChange {
    FleetChange { upsert: workers, ..FleetChange::default() }
}

fn state() -> FleetState {
    FleetState::new(10, Arc::new(DataPlaneConfig::default()))
}

#[test]
fn identical_upsert_does_not_bump_the_version() {
    let (s1, _) = state().commit(upsert(vec![worker(1, "tiny")])).unwrap();
    assert_eq!(s1.version(), 11);
    assert!(s1.commit(upsert(vec![worker(1, "tiny")])).is_none());
    assert!(s1.commit(FleetChange { remove: vec![WorkerKey::new("dynamo", 99)], ..FleetChange::default() }).is_none());
}

#[test]
fn samples_for_unknown_workers_or_ranks_are_dropped() {
    let (s1, _) = state().commit(upsert(vec![worker(1, "a")])).unwrap();
    let change = FleetChange {
        loads: vec![
            (LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 0 }, sample(4)),
            (LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 1 }, sample(5)),
            (LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 }, sample(6)),
        ],
        ..FleetChange::default()
    };
    let (s2, delta) = s1.commit(change).unwrap();
    assert_eq!(delta.loads.len(), 1);
    assert_eq!(s2.view().loads().len(), 1);
}

#[test]
fn a_replica_within_the_log_gets_one_merged_delta_that_converges() {
    let mut s = state();
    let replica = s.view().clone();
    for id in 0..20u64 {
        s = s.commit(upsert(vec![worker(id % 5, &format!("m{id}"))])).unwrap().0;
    }
    let Catchup::Delta(delta) = s.catchup(Some(replica.version())) else { panic!("expected a delta") };
    assert_eq!(delta.upserted.len(), 5, "twenty changes to five workers merge into five upserts");
    assert!(replica.apply(&delta).unwrap().same_content(s.view()));
    assert!(matches!(s.catchup(Some(s.version())), Catchup::UpToDate));
}

#[test]
fn a_replica_a_few_versions_behind_a_full_log_gets_the_deltas_since_its_own() {
    let mut s = state();
    let mut held = Vec::new();
    for id in 0..(DELTA_LOG_CAPACITY as u64 + 40) {
        s = s.commit(upsert(vec![worker(id % 7, &format!("m{id}"))])).unwrap().0;
        held.push(s.view().clone());
    }
    // Replicas at several places in the log, which has dropped its oldest deltas.
    for behind in [1, 3, 10, DELTA_LOG_CAPACITY - 1] {
        let replica = &held[held.len() - 1 - behind];
        let Catchup::Delta(delta) = s.catchup(Some(replica.version())) else { panic!("{behind} behind: a delta") };
        assert_eq!(delta.base_version, replica.version(), "{behind} behind");
        assert!(replica.apply(&delta).unwrap().same_content(s.view()), "{behind} behind converges");
    }
}

#[test]
fn a_replica_behind_the_log_or_new_gets_a_snapshot() {
    let mut s = state();
    let start = s.version();
    for id in 0..(DELTA_LOG_CAPACITY as u64 + 5) {
        s = s.commit(upsert(vec![worker(id, "m")])).unwrap().0;
    }
    assert!(matches!(s.catchup(Some(start)), Catchup::Snapshot(_)));
    assert!(matches!(s.catchup(None), Catchup::Snapshot(_)));
    assert!(matches!(s.catchup(Some(s.version() + 3)), Catchup::Snapshot(_)), "a version from the future resyncs");
    assert!(matches!(s.catchup(Some(s.version() - 3)), Catchup::Delta(_)));
}

#[test]
fn a_replica_behind_a_rank_shrink_and_regrow_converges_on_the_merged_delta() {
    let with_ranks = |dp_size| {
        let mut w = (*worker(1, "m")).clone();
        w.dp_size = dp_size;
        Arc::new(w)
    };
    let rank1 = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 1 };
    let (s1, _) = state().commit(upsert(vec![with_ranks(2)])).unwrap();
    let (s2, _) = s1.commit(FleetChange { loads: vec![(rank1.clone(), sample(3))], ..FleetChange::default() }).unwrap();
    let replica = s2.view().clone();
    let (s3, shrink) = s2.commit(upsert(vec![with_ranks(1)])).unwrap();
    assert_eq!(shrink.loads_removed, std::slice::from_ref(&rank1), "a given-up rank's sample is removed explicitly");
    let (s4, _) = s3.commit(upsert(vec![with_ranks(2)])).unwrap();
    assert!(s4.view().loads().get(&rank1).is_none());
    let Catchup::Delta(merged) = s4.catchup(Some(replica.version())) else { panic!("expected a delta") };
    assert!(replica.apply(&merged).unwrap().same_content(s4.view()));
}

#[test]
fn of_several_upserts_of_one_worker_the_last_wins_even_when_it_is_the_one_held() {
    let (s1, _) = state().commit(upsert(vec![worker(1, "a")])).unwrap();
    assert!(s1.commit(upsert(vec![worker(1, "b"), worker(1, "a")])).is_none(), "the last is what is held");
    let (s2, _) = s1.commit(upsert(vec![worker(1, "a"), worker(1, "b")])).unwrap();
    assert_eq!(s2.view().worker(&WorkerKey::new("dynamo", 1)).map(|w| w.model.as_str()), Some("b"));
}

#[test]
fn a_worker_removed_and_upserted_in_one_change_keeps_the_backlogs_that_change_names() {
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 0 };
    let backlog = Backlog { dispatches: 2, prefill_tokens: 64, ..Backlog::default() };
    let (s1, _) = state().commit(upsert(vec![worker(1, "a")])).unwrap();
    let (s2, _) = s1.commit(FleetChange { backlogs: vec![(rank.clone(), backlog)], ..FleetChange::default() }).unwrap();
    let change = FleetChange {
        remove: vec![rank.worker.clone()],
        upsert: vec![worker(1, "a")],
        backlogs: vec![(rank.clone(), backlog)],
        ..FleetChange::default()
    };
    let (s3, _) = s2.commit(change).unwrap();
    assert_eq!(s3.view().backlogs().get(&rank), Some(&backlog));
}
