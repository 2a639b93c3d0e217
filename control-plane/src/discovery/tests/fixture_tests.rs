//! The real 1.6.1 captures: a disaggregated pair (prefill + decode registered as `backend`)
//! and an aggregated worker with two dp ranks.

use std::sync::Arc;

use continuum_proto::model::{Capacity, CheckedFile, ModelArtifacts, Role, Worker, WorkerKey};

use super::super::{EventKind, Fleet, Publisher, Reducer, Topic, WatchEvent};
use super::fixtures::{dump, instance_id, watch};
use super::{NS, t};

fn tiny(id: u64, role: Role, component: &str, total_kv_blocks: u64, dp_size: u32) -> Worker {
    Worker {
        key: WorkerKey::new(NS, id),
        role,
        model: "tiny".into(),
        component: component.into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity {
            total_kv_blocks: Some(total_kv_blocks),
            max_num_batched_tokens: Some(8192),
            max_num_seqs: Some(256),
            // The 1.6.1 card says `context_length: 0` (unknown) beside the model's own
            // `architectural_max_context_length: 4096`.
            context_length: Some(4096),
        },
        dp_start_rank: 0,
        dp_size,
        disaggregated_endpoint: None,
        artifacts: Some(Arc::new(tiny_artifacts())),
    }
}

/// The CheckedFile slots every 1.6.1 tiny card carries (the mocker's `--model-path`).
fn tiny_artifacts() -> ModelArtifacts {
    let file = |name: &str, checksum: &str, size| CheckedFile {
        uri: format!("/tmp/dynpeer/tinymodel/{name}"),
        checksum: format!("blake3:{checksum}"),
        size,
    };
    ModelArtifacts {
        tokenizer: Some(file(
            "tokenizer.json",
            "4b790d1231b2081593931289dcc9559ead3dd4d6df27357da278e0c93ec60884",
            252_970,
        )),
        tokenizer_config: Some(file(
            "tokenizer_config.json",
            "27b8fcaa163eb33d9b725dace88912192dd40899d37f80fa4343ea37539b4772",
            472,
        )),
        chat_template: None,
        defaults: Default::default(),
    }
}

/// (publisher id, topic, worker, dp rank, address)
type PublisherRow<'a> = (u64, Topic, Option<u64>, Option<u32>, &'a str);

struct Expected {
    workers: Vec<Worker>,
    /// (publisher id, topic, worker, dp rank, address)
    publishers: Vec<(u64, Topic, u64, Option<u32>, &'static str)>,
}

fn disagg() -> anyhow::Result<Expected> {
    let prefill = instance_id("disagg", "prefill")?;
    let decode = instance_id("disagg", "backend")?;
    Ok(Expected {
        workers: vec![tiny(prefill, Role::Prefill, "prefill", 1024, 1), tiny(decode, Role::Decode, "backend", 1024, 1)],
        publishers: vec![
            (0x8a4ab3feb5855, Topic::KvMetrics, prefill, None, "tcp://127.0.0.1:46711"),
            (0x149f52fc2aeb38, Topic::KvMetrics, decode, None, "tcp://127.0.0.1:39261"),
            (0x1ee80a9960e440, Topic::KvEvents, prefill, Some(0), "tcp://127.0.0.1:41287"),
        ],
    })
}

fn agg() -> anyhow::Result<Expected> {
    let agg = instance_id("agg", "backend")?;
    Ok(Expected {
        workers: vec![tiny(agg, Role::Aggregated, "backend", 24, 2)],
        publishers: vec![
            (0x239e48cc72921, Topic::KvMetrics, agg, None, "tcp://127.0.0.1:37331"),
            (0xa0ca3e7a14204, Topic::KvEvents, agg, Some(1), "tcp://127.0.0.1:35167"),
            (0x154ad984fb4e2d, Topic::KvEvents, agg, Some(0), "tcp://127.0.0.1:44777"),
        ],
    })
}

fn assert_fleet(fleet: &Fleet, expected: &Expected, context: &str) {
    let workers: Vec<&Worker> = fleet.workers.iter().map(|w| &w.worker).collect();
    let mut want_workers: Vec<&Worker> = expected.workers.iter().collect();
    want_workers.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(workers, want_workers, "{context}: workers");
    assert!(fleet.workers.iter().all(|w| w.excluded.is_none() && w.card.is_some()), "{context}: cards and exclusions");
    let publishers: Vec<PublisherRow<'_>> = fleet
        .publishers
        .iter()
        .map(|p| (p.publisher_id, p.topic, p.worker.as_ref().map(|w| w.instance_id), p.dp_rank, &*p.address))
        .collect();
    let mut want: Vec<PublisherRow<'_>> = expected
        .publishers
        .iter()
        .map(|&(id, topic, worker, rank, address)| (id, topic, Some(worker), rank, address))
        .collect();
    want.sort_by_key(|p| p.0);
    assert_eq!(publishers, want, "{context}: publishers");
    assert!(fleet.publishers.iter().all(scoped_to_generate), "{context}: publisher scope");
}

fn scoped_to_generate(publisher: &Publisher) -> bool {
    &*publisher.namespace == NS && publisher.endpoint.as_deref() == Some("generate")
}

#[test]
fn real_etcd_dumps_materialise_exact_workers_and_publishers() -> anyhow::Result<()> {
    let cases = [("disagg", disagg()?, 8, 4), ("agg", agg()?, 7, 4)];
    for (run, expected, records, skipped) in cases {
        let kvs = dump(run)?;
        let mut by_puts = Reducer::new(vec![NS.into()]);
        let mut put_count = 0;
        let mut skip_count = 0;
        for kv in kvs.clone() {
            let applied = by_puts.apply(WatchEvent::Put(kv), t(1));
            put_count += applied.count(EventKind::Put);
            skip_count += applied.count(EventKind::Skipped);
        }
        assert_eq!((put_count, skip_count), (records, skipped), "{run}: put and skipped counts");
        assert_fleet(&by_puts.fleet(), &expected, run);

        let mut by_resync = Reducer::new(vec![NS.into()]);
        let applied = by_resync.apply(WatchEvent::Resync(kvs), t(1));
        assert_eq!((applied.count(EventKind::Put), applied.count(EventKind::Duplicate)), (records, 0), "{run}: resync");
        assert_eq!(by_resync.fleet(), by_puts.fleet(), "{run}: a resync folds like the same puts");
    }
    Ok(())
}

#[test]
fn real_instance_ids_above_2_pow_53_are_exact() -> anyhow::Result<()> {
    let mut reducer = Reducer::new(vec![NS.into()]);
    reducer.apply(WatchEvent::Resync(dump("disagg")?), t(1));
    let ids: Vec<u64> = reducer.fleet().workers.iter().map(|w| w.worker.key.instance_id).collect();
    assert_eq!(ids, vec![7_668_682_560_356_783_938, 7_668_682_560_356_783_952]);
    assert!(ids.iter().all(|&id| id > 1 << 53 && (id as f64) as u64 != id), "the fixture ids would not survive an f64");
    Ok(())
}

/// What the fleet holds once every event up to `revision` is applied.
struct Checkpoint {
    revision: u64,
    what: &'static str,
    workers: Vec<(u64, Role)>,
    /// (publisher id, dp rank)
    publishers: Vec<(u64, Option<u32>)>,
}

fn replay(run: &str, checkpoints: &[Checkpoint]) -> anyhow::Result<()> {
    let events = watch(run)?;
    let mut reducer = Reducer::new(vec![NS.into()]);
    let mut checked = 0;
    for (at, (revision, event)) in events.iter().enumerate() {
        reducer.apply(event.clone(), t(*revision));
        let last_of_revision = events.get(at + 1).is_none_or(|(next, _)| next != revision);
        let Some(checkpoint) = checkpoints.iter().find(|c| c.revision == *revision).filter(|_| last_of_revision) else {
            continue;
        };
        let fleet = reducer.fleet();
        let workers: Vec<(u64, Role)> =
            fleet.workers.iter().map(|w| (w.worker.key.instance_id, w.worker.role)).collect();
        let publishers: Vec<(u64, Option<u32>)> =
            fleet.publishers.iter().map(|p| (p.publisher_id, p.dp_rank)).collect();
        assert_eq!(workers, checkpoint.workers, "{run} r{revision} {}: workers", checkpoint.what);
        assert_eq!(publishers, checkpoint.publishers, "{run} r{revision} {}: publishers", checkpoint.what);
        checked += 1;
    }
    assert_eq!(checked, checkpoints.len(), "{run}: every checkpoint revision occurs in the capture");
    Ok(())
}

#[test]
fn disagg_watch_replay_tracks_registration_sigkill_and_sigterm() -> anyhow::Result<()> {
    let prefill = instance_id("disagg", "prefill")?;
    let decode = instance_id("disagg", "backend")?;
    let (pre_metrics, pre_events, dec_metrics) = (0x8a4ab3feb5855, 0x1ee80a9960e440, 0x149f52fc2aeb38);
    let both = vec![(prefill, Role::Prefill), (decode, Role::Decode)];
    replay(
        "disagg",
        &[
            Checkpoint { revision: 20, what: "prefill card before its instance", workers: vec![], publishers: vec![] },
            Checkpoint {
                revision: 21,
                what: "prefill instance",
                workers: vec![(prefill, Role::Prefill)],
                publishers: vec![],
            },
            Checkpoint {
                revision: 24,
                what: "prefill channels, no event source yet",
                workers: vec![(prefill, Role::Prefill)],
                publishers: vec![(pre_metrics, None), (pre_events, None)],
            },
            Checkpoint {
                revision: 26,
                what: "prefill event source",
                workers: vec![(prefill, Role::Prefill)],
                publishers: vec![(pre_metrics, None), (pre_events, Some(0))],
            },
            Checkpoint {
                revision: 31,
                what: "decode registered",
                workers: both,
                publishers: vec![(pre_metrics, None), (dec_metrics, None), (pre_events, Some(0))],
            },
            Checkpoint {
                revision: 32,
                what: "decode SIGKILL: lease expiry deletes all its keys",
                workers: vec![(prefill, Role::Prefill)],
                publishers: vec![(pre_metrics, None), (pre_events, Some(0))],
            },
            Checkpoint {
                revision: 33,
                what: "prefill SIGTERM: generate instance deleted first",
                workers: vec![],
                publishers: vec![(pre_metrics, None), (pre_events, Some(0))],
            },
            Checkpoint { revision: 35, what: "prefill lease revoked", workers: vec![], publishers: vec![] },
        ],
    )
}

#[test]
fn agg_watch_replay_tracks_two_dp_ranks_and_sigterm() -> anyhow::Result<()> {
    let agg = instance_id("agg", "backend")?;
    let (metrics, rank0, rank1) = (0x239e48cc72921, 0x154ad984fb4e2d, 0xa0ca3e7a14204);
    let worker = vec![(agg, Role::Aggregated)];
    replay(
        "agg",
        &[
            Checkpoint { revision: 37, what: "card before instance", workers: vec![], publishers: vec![] },
            Checkpoint { revision: 38, what: "instance", workers: worker.clone(), publishers: vec![] },
            Checkpoint {
                revision: 42,
                what: "channels without event sources",
                workers: worker.clone(),
                publishers: vec![(metrics, None), (rank1, None), (rank0, None)],
            },
            Checkpoint {
                revision: 46,
                what: "event sources give the dp ranks",
                workers: worker,
                publishers: vec![(metrics, None), (rank1, Some(1)), (rank0, Some(0))],
            },
            Checkpoint {
                revision: 47,
                what: "SIGTERM: generate instance deleted",
                workers: vec![],
                publishers: vec![(metrics, None), (rank1, Some(1)), (rank0, Some(0))],
            },
            Checkpoint { revision: 51, what: "lease revoked", workers: vec![], publishers: vec![] },
        ],
    )
}

#[test]
fn replayed_worker_keeps_first_seen_and_takes_last_updated_from_its_latest_record() -> anyhow::Result<()> {
    let mut reducer = Reducer::new(vec![NS.into()]);
    for (revision, event) in watch("disagg")?.into_iter().take_while(|(r, _)| *r <= 31) {
        reducer.apply(event, t(revision));
    }
    let times: Vec<(u64, std::time::SystemTime, std::time::SystemTime)> =
        reducer.fleet().workers.iter().map(|w| (w.worker.key.instance_id, w.first_seen, w.last_updated)).collect();
    let (prefill, decode) = (instance_id("disagg", "prefill")?, instance_id("disagg", "backend")?);
    assert_eq!(times, vec![(prefill, t(21), t(21)), (decode, t(29), t(29))]);
    Ok(())
}
