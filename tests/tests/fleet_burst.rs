//! Fleet-wide unanswered-dispatch accounting, end to end: four data-plane replicas share one
//! burst between two load samples and spread it the way one router would, because each sees the
//! dispatches the others pinned (reported on their Watch streams, summed by the control plane).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_control_plane::fleet::FleetChange;
use continuum_data_plane::replica::Replica;
use continuum_proto::model::{
    Backend, Capacity, DataPlaneConfig, DisaggregatedServing, Load, LoadKey, LoadSample, PickerParams, Role, ShimPool,
    Worker, WorkerKey,
};
use continuum_tests::shim_stub::StubShim;
use continuum_tests::{TestControlPlane, eventually, publisher, start_replicas, wait_for_version};

const REPLICAS: usize = 4;
const REQUESTS: usize = 64;
/// How long one request's report may take to reach every replica on a loaded machine.
const PROPAGATION: Duration = Duration::from_secs(20);
/// The idle worker starts this many blocks below the others: more than the 16 requests a
/// replica sends weigh (each answered at once and decoding 10 blocks: 160 in all), so a
/// replica that counted only its own dispatches would send all of its requests to it.
const HEAD_START_BLOCKS: u64 = 320;
/// The first event of every held stream, sent at once: each dispatch is answered (a decode
/// under way, its blocks held) rather than unanswered, so however slow the machine no rank
/// passes the stall age during the burst and the spread measures the accounting alone.
const FIRST_EVENT: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";

fn worker(id: u64) -> Arc<Worker> {
    Arc::new(Worker {
        key: WorkerKey::new("dynamo", id),
        role: Role::Aggregated,
        model: "tiny".into(),
        component: "backend".into(),
        endpoint: "generate".into(),
        block_size: Some(16),
        capacity: Capacity { total_kv_blocks: Some(1024), max_num_batched_tokens: Some(8192), ..Capacity::default() },
        dp_start_rank: 0,
        dp_size: 0,
        disaggregated_endpoint: None,
        artifacts: None,
    })
}

fn config(shim: &StubShim) -> DataPlaneConfig {
    DataPlaneConfig {
        backends: vec![Backend { name: "shim".into(), url: shim.url(), models: vec![] }],
        shim_pools: vec![ShimPool { namespace: "dynamo".into(), backends: vec!["shim".into()] }],
        picker: PickerParams { max_staleness: Duration::from_secs(60), ..PickerParams::default() },
        disaggregated_serving: DisaggregatedServing { enabled: true, fallback_to_unified: false },
        ..DataPlaneConfig::default()
    }
}

/// About 160 prompt tokens (10 blocks of 16) by the data plane's estimate.
fn request() -> serde_json::Value {
    let words = "alpha beta gamma delta ".repeat(30);
    serde_json::json!({"model": "tiny", "stream": true, "messages": [{"role": "user", "content": words}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_spread_a_burst_between_samples_as_one_router_would() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    // Every request is answered and held open, so its dispatch decodes for the whole burst.
    let gates: Vec<_> = (0..REQUESTS).map(|_| shim.push_stream()).collect();
    for gate in &gates {
        gate.try_send(Ok(bytes::Bytes::from_static(FIRST_EVENT.as_bytes())))?;
    }
    let control = TestControlPlane::start(publisher()).await?;
    let workers: Vec<_> = (1..=4).map(worker).collect();
    let now = Instant::now();
    let samples = (1..=4u64)
        .map(|id| {
            let used = if id == 1 { 0 } else { HEAD_START_BLOCKS };
            let load = Load { kv_used_blocks: Some(used), ..Load::default() };
            (LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank: 0 }, LoadSample { load, received_at: now })
        })
        .collect();
    control.publisher.apply(FleetChange {
        upsert: workers,
        loads: samples,
        config: Some(Arc::new(config(&shim))),
        ..FleetChange::default()
    });
    let replicas = start_replicas(REPLICAS, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), Duration::from_secs(20)).await?;

    let client = reqwest::Client::new();
    let mut inflight = Vec::new();
    // In waves of one request per replica, all four at once: within a wave no replica can know
    // of the others' picks, so each is made on the same view (the hard case). The next wave
    // arrives once every replica counts this one (a few milliseconds: a 1 ms report batch, the
    // 2 ms backlog window, the stream), as a burst spread over a sample interval would; no
    // load sample arrives meanwhile. Waiting on it rather than a fixed pace keeps the test
    // about the accounting, not about the machine's speed. (All 64 in one instant, no
    // accounting could spread: every replica would pick its 16 before any other's report could
    // reach it, and the idle worker's head start outweighs 16. The 64 are still in flight
    // together: each is held open until the end.)
    for wave in 0..REQUESTS / REPLICAS {
        for replica in &replicas {
            let url = format!("http://{}/v1/chat/completions", replica.local_addr);
            inflight.push(tokio::spawn(client.post(url).json(&request()).send()));
        }
        let sent = (wave + 1) * REPLICAS;
        let counted = |view: &continuum_proto::view::FleetView| {
            view.backlogs().values().map(|backlog| backlog.dispatches as usize).sum::<usize>()
        };
        eventually(PROPAGATION, "every replica counts the burst so far", || async {
            replicas.iter().all(|r| r.fleet.view().is_some_and(|view| counted(&view) >= sent))
        })
        .await?;
    }
    let mut received = shim.count();
    tokio::time::timeout(Duration::from_secs(20), received.wait_for(|n| *n >= REQUESTS)).await??;

    let mut pins: BTreeMap<String, usize> = BTreeMap::new();
    for request in shim.received() {
        let pin = request.header("x-dynamo-worker-instance-id").unwrap_or("none").to_string();
        *pins.entry(pin).or_default() += 1;
    }
    // One router would give the idle worker 40 of the 64: at 10 blocks a request its head start
    // is 32 requests more than each busy worker's 8. Four replicas picking together overshoot
    // by at most a wave. Four replicas that each saw only their own dispatches would give it
    // all 64 (none fills the head start alone); four that rotated regardless of load, 16.
    assert_eq!(pins.values().sum::<usize>(), REQUESTS, "every request pinned once: {pins:?}");
    assert!(pins.keys().all(|pin| ["1", "2", "3", "4"].contains(&pin.as_str())), "only the fleet's workers: {pins:?}");
    let idle = pins.get("1").copied().unwrap_or(0);
    assert!((32..=46).contains(&idle), "the idle worker took {idle} of {REQUESTS}: {pins:?}");
    for busy in ["2", "3", "4"] {
        let n = pins.get(busy).copied().unwrap_or(0);
        assert!((4..=12).contains(&n), "worker {busy} took {n} of {REQUESTS}: {pins:?}");
    }

    drop(gates);
    for request in inflight {
        let response = request.await??;
        anyhow::ensure!(response.status().is_success(), "a request of the burst failed: {}", response.status());
        response.bytes().await?;
    }
    for replica in replicas {
        Replica::shutdown(replica).await;
    }
    control.stop().await;
    shim.stop();
    Ok(())
}

/// A control plane that restarts forgets every dispatch in flight. Each replica reports its own
/// again as its new stream opens, so the new control plane, and every other replica through
/// it, count them at once rather than only as the workers' samples come to show them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_control_plane_hears_again_of_the_dispatches_in_flight() -> anyhow::Result<()> {
    const HELD: usize = 3;
    let shim = StubShim::start().await?;
    let gates: Vec<_> = (0..HELD).map(|_| shim.push_stream()).collect();
    let fleet =
        || FleetChange { upsert: vec![worker(1)], config: Some(Arc::new(config(&shim))), ..FleetChange::default() };
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(fleet());
    let replicas = start_replicas(2, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), PROPAGATION).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 0 };
    let dispatches = |view: Option<&continuum_proto::view::FleetView>| {
        view.and_then(|view| view.backlogs().get(&rank).map(|backlog| backlog.dispatches as usize)).unwrap_or(0)
    };

    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/chat/completions", replicas[0].local_addr);
    let mut held = Vec::new();
    for _ in 0..HELD {
        held.push(client.post(&url).json(&request()).send().await?);
    }
    eventually(PROPAGATION, "the other replica counts them", || async {
        dispatches(replicas[1].fleet.view().as_deref()) == HELD
    })
    .await?;

    let addr = control.addr.to_string();
    control.stop().await;
    let control = TestControlPlane::start_on(&addr, publisher()).await?;
    control.publisher.apply(fleet());
    eventually(PROPAGATION, "the new control plane counts them", || async {
        dispatches(Some(control.publisher.current().view())) == HELD
    })
    .await?;
    eventually(PROPAGATION, "and so does the other replica", || async {
        dispatches(replicas[1].fleet.view().as_deref()) == HELD
    })
    .await?;
    // The book exports its counts on its next tick.
    let replayed = control.metrics.dispatches_replayed.clone();
    eventually(PROPAGATION, "counted as replayed", || async { replayed.get() == HELD as u64 }).await?;
    assert_eq!(replicas[0].metrics.dispatches_replayed.get(), HELD as u64);

    // Their ends, reported under the ids they first had, take them off.
    drop(gates);
    for response in held {
        response.bytes().await?;
    }
    eventually(PROPAGATION, "ended everywhere", || async { dispatches(replicas[1].fleet.view().as_deref()) == 0 })
        .await?;
    for replica in replicas {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(())
}
