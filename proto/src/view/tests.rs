use std::sync::Arc;
use std::time::Instant;

use proptest::prelude::*;

use super::*;
use crate::model::{Backlog, Capacity, Load, Role};

fn worker(id: u64, dp_size: u32) -> Arc<Worker> {
    Arc::new(Worker {
        key: WorkerKey::new("dynamo", id),
        role: Role::Decode,
        model: "tiny".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity { total_kv_blocks: Some(1024), ..Capacity::default() },
        dp_start_rank: 0,
        dp_size,
        disaggregated_endpoint: None,
        artifacts: None,
    })
}

fn sample(used: u64) -> LoadSample {
    LoadSample { load: Load { kv_used_blocks: Some(used), ..Load::default() }, received_at: Instant::now() }
}

fn load_key(id: u64, dp_rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank }
}

fn delta(base: u64) -> FleetDelta {
    FleetDelta { base_version: base, version: base + 1, ..FleetDelta::default() }
}

#[test]
fn delta_on_another_base_is_refused_and_view_unchanged() {
    let view = FleetView::default().apply(&FleetDelta { upserted: vec![worker(1, 1)], ..delta(0) }).unwrap();
    let err = view.apply(&FleetDelta { upserted: vec![worker(2, 1)], ..delta(7) }).unwrap_err();
    assert_eq!(err, ApplyError::BaseMismatch { base: 7, held: 1 });
    assert_eq!(view.workers().len(), 1);
}

#[test]
fn delta_that_does_not_advance_is_refused() {
    let stale = FleetDelta { base_version: 0, version: 0, ..FleetDelta::default() };
    assert_eq!(FleetView::default().apply(&stale).unwrap_err(), ApplyError::NotAdvancing { base: 0, version: 0 });
}

#[test]
fn load_for_unknown_worker_is_refused() {
    let err = FleetView::default().apply(&FleetDelta { loads: vec![(load_key(9, 0), sample(1))], ..delta(0) });
    assert!(matches!(err, Err(ApplyError::LoadForUnknownWorker { .. })));
}

#[test]
fn load_for_rank_outside_the_worker_is_refused() {
    let view = FleetView::default().apply(&FleetDelta { upserted: vec![worker(1, 2)], ..delta(0) }).unwrap();
    let ok = view.apply(&FleetDelta { loads: vec![(load_key(1, 1), sample(3))], ..delta(1) });
    assert!(ok.is_ok());
    let err = view.apply(&FleetDelta { loads: vec![(load_key(1, 2), sample(3))], ..delta(1) }).unwrap_err();
    assert!(matches!(err, ApplyError::RankOutOfRange { dp_rank: 2, first: 0, end: 2, .. }));
}

#[test]
fn removing_a_worker_drops_its_samples() {
    let view = FleetView::default()
        .apply(&FleetDelta { upserted: vec![worker(1, 2)], loads: vec![(load_key(1, 1), sample(5))], ..delta(0) })
        .unwrap();
    assert_eq!(view.loads().len(), 1);
    let view = view.apply(&FleetDelta { removed: vec![WorkerKey::new("dynamo", 1)], ..delta(1) }).unwrap();
    assert!(view.workers().is_empty());
    assert!(view.loads().is_empty());
}

#[test]
fn shrinking_ranks_drops_samples_of_ranks_given_up() {
    let view = FleetView::default()
        .apply(&FleetDelta {
            upserted: vec![worker(1, 2)],
            loads: vec![(load_key(1, 0), sample(1)), (load_key(1, 1), sample(2))],
            ..delta(0)
        })
        .unwrap();
    let view = view.apply(&FleetDelta { upserted: vec![worker(1, 1)], ..delta(1) }).unwrap();
    assert_eq!(view.loads().keys().cloned().collect::<Vec<_>>(), vec![load_key(1, 0)]);
}

#[derive(Clone, Debug)]
enum Op {
    Upsert(u64, u32),
    Remove(u64),
    Load(u64, u32, u64),
    Unload(u64, u32),
    Backlog(u64, u32, u64),
    Unbacklog(u64, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..6u64, 0..3u32).prop_map(|(id, dp)| Op::Upsert(id, dp)),
        (0..6u64).prop_map(Op::Remove),
        (0..6u64, 0..3u32, 0..100u64).prop_map(|(id, r, u)| Op::Load(id, r, u)),
        (0..6u64, 0..3u32).prop_map(|(id, r)| Op::Unload(id, r)),
        (0..6u64, 0..3u32, 1..100u64).prop_map(|(id, r, n)| Op::Backlog(id, r, n)),
        (0..6u64, 0..3u32).prop_map(|(id, r)| Op::Unbacklog(id, r)),
    ]
}

/// Turns an op into a delta that fits `view`, or `None` when it would not (a sample for a
/// rank the worker does not serve), the way the control plane only emits valid deltas.
fn delta_for(view: &FleetView, op: &Op) -> Option<FleetDelta> {
    let base = delta(view.version());
    let d = match *op {
        // Deltas name the samples and backlogs of ranks a worker gives up explicitly, as the
        // control plane's do, so that a merged delta drops them too.
        Op::Upsert(id, dp) => {
            let next = worker(id, dp);
            let given_up = |k: &LoadKey| k.worker == next.key && !next.serves_rank(k.dp_rank);
            FleetDelta {
                loads_removed: view.loads().keys().filter(|k| given_up(k)).cloned().collect(),
                backlogs_removed: view.backlogs().keys().filter(|k| given_up(k)).cloned().collect(),
                upserted: vec![next],
                ..base
            }
        }
        Op::Remove(id) => FleetDelta { removed: vec![WorkerKey::new("dynamo", id)], ..base },
        Op::Load(id, r, u) => FleetDelta { loads: vec![(load_key(id, r), sample(u))], ..base },
        Op::Unload(id, r) => FleetDelta { loads_removed: vec![load_key(id, r)], ..base },
        Op::Backlog(id, r, n) => {
            let backlog = Backlog { prefill_tokens: n * 16, decode_blocks: n, dispatches: 1, ..Backlog::default() };
            FleetDelta { backlogs: vec![(load_key(id, r), backlog)], ..base }
        }
        Op::Unbacklog(id, r) => FleetDelta { backlogs_removed: vec![load_key(id, r)], ..base },
    };
    view.apply(&d).ok().map(|_| d)
}

proptest! {
    #[test]
    fn merged_deltas_equal_applying_them_one_by_one(ops in proptest::collection::vec(op(), 1..60), split in 0usize..60) {
        let mut view = FleetView::default();
        let mut prefix = view.clone();
        let mut tail = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if let Some(d) = delta_for(&view, op) {
                view = view.apply(&d).unwrap();
                if i < split { prefix = view.clone(); } else { tail.push(d); }
            }
        }
        if let Some(merged) = FleetDelta::merge(&tail) {
            let via_merge = prefix.apply(&merged).unwrap();
            prop_assert!(via_merge.same_content(&view), "merged {merged:?}");
            prop_assert_eq!(via_merge.version(), view.version());
        }
    }
}

#[test]
fn removing_a_worker_drops_its_backlog() {
    let backlog = crate::model::every_field_backlog();
    let view = FleetView::default()
        .apply(&FleetDelta { upserted: vec![worker(1, 1)], backlogs: vec![(load_key(1, 0), backlog)], ..delta(0) })
        .unwrap();
    assert_eq!(view.backlogs().get(&load_key(1, 0)), Some(&backlog));
    let view = view.apply(&FleetDelta { removed: vec![WorkerKey::new("dynamo", 1)], ..delta(1) }).unwrap();
    assert!(view.backlogs().is_empty());
}

#[test]
fn a_worker_declaring_more_ranks_than_any_fleet_is_refused_on_the_wire() {
    let wire = |dp_size| {
        let mut worker = crate::pb::Worker::from(&*worker(7, 0));
        worker.dp_size = dp_size;
        Worker::try_from(worker)
    };
    assert!(wire(crate::MAX_DATA_PARALLEL_SIZE).is_ok());
    let refused = wire(u32::MAX).map(|_| ()).map_err(|e| e.to_string());
    assert!(refused.as_ref().is_err_and(|e| e.contains("data-parallel ranks")), "{refused:?}");
}
