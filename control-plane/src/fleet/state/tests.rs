use std::sync::Arc;
use std::time::Instant;

use continuum_proto::model::{Capacity, DataPlaneConfig, Load, LoadKey, LoadSample, Role, Worker, WorkerKey};

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
