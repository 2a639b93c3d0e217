//! Discovery benchmark: reducer events per second, and etcd put → all-replicas latency with
//! 16,384 simulated workers registered in a real etcd.
//!
//! `cargo run --release -p continuum-tests --bin bench-discovery [-- --iterations 100]`
//! prints a table and rewrites the "Discovery" section of docs/benchmarks.md.

use std::time::{Duration, Instant, SystemTime};

use continuum_control_plane::app::{ControlPlane, ListenOverrides};
use continuum_control_plane::config;
use continuum_control_plane::discovery::{KeyValue, Reducer, WatchEvent};
use continuum_proto::model::WorkerKey;
use continuum_tests::bench::{Quantiles, arg, write_section};
use continuum_tests::etcd::{Etcd, decode_worker_records};
use continuum_tests::{start_replicas, wait_until_worker};
use etcd_client::{Txn, TxnOp};

const FLEET: u64 = 16_384;
const FIRST_LEASE: u64 = 7_587_890_000_000_000;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let iterations = arg("--iterations", 100)?;
    let reducer = reducer_throughput();
    eprintln!("{reducer:?}");
    let latency = put_to_replicas(iterations).await?;
    let seeded = FLEET - iterations as u64;
    let records = FLEET * 2;
    let row = |name: &str, (events, rate): (usize, f64)| format!("| {name} | {events} | {rate:.0} |\n");
    let table = format!(
        "Reducer (one thread, {FLEET} workers = {records} records):\n\n| phase | events | events/s |\n|---|---:|---:|\n\
         {}{}{}{}\nBuilding the published fleet of {FLEET} workers once: {:.2} ms.\n\n\
         etcd put → every replica holds the worker ({iterations} workers joining a fleet of {seeded} to reach {FLEET}, \
         4 replicas, real etcd 3.4, loopback):\n\n| p50 | p99 | max |\n|---:|---:|---:|\n| {:.2} ms | {:.2} ms | {:.2} ms |\n",
        row("register (puts)", reducer.puts),
        row("heartbeat re-puts", reducer.reputs),
        row("deregister (deletes)", reducer.deletes),
        row("full resync", reducer.resync),
        ms(reducer.fleet_build),
        ms(latency.p50),
        ms(latency.p99),
        ms(latency.max),
    );
    println!("{table}");
    write_section(
        "bench-discovery",
        "Discovery",
        "cargo run --release -p continuum-tests --bin bench-discovery",
        &table,
    )
}

#[derive(Debug)]
struct ReducerRates {
    puts: (usize, f64),
    reputs: (usize, f64),
    deletes: (usize, f64),
    resync: (usize, f64),
    /// Building the published fleet view of all workers once.
    fleet_build: Duration,
}

fn records(workers: u64) -> Vec<KeyValue> {
    (0..workers)
        .flat_map(|i| decode_worker_records("dynamo", FIRST_LEASE + i, "Qwen/Qwen3-32B"))
        .map(|(k, v)| KeyValue::new(k, v))
        .collect()
}

fn rate(events: usize, elapsed: Duration) -> (usize, f64) {
    (events, events as f64 / elapsed.as_secs_f64())
}

fn reducer_throughput() -> ReducerRates {
    let records = records(FLEET);
    let now = SystemTime::now();
    let mut reducer = Reducer::new(vec!["dynamo".into()]);
    let timed = |reducer: &mut Reducer, events: Vec<WatchEvent>| {
        let n = events.len();
        let start = Instant::now();
        for event in events {
            reducer.apply(event, now);
        }
        rate(n, start.elapsed())
    };
    let puts = timed(&mut reducer, records.iter().cloned().map(WatchEvent::Put).collect());
    let build_start = Instant::now();
    let fleet = reducer.fleet();
    let fleet_build = build_start.elapsed();
    assert_eq!(fleet.workers.len() as u64, FLEET);
    let reputs = timed(&mut reducer, records.iter().cloned().map(WatchEvent::Put).collect());
    let resync_start = Instant::now();
    reducer.apply(WatchEvent::Resync(records.clone()), now);
    let resync = rate(records.len(), resync_start.elapsed());
    let deletes = timed(&mut reducer, records.iter().map(|kv| WatchEvent::Delete { key: kv.key.clone() }).collect());
    assert!(reducer.fleet().workers.is_empty());
    ReducerRates { puts, reputs, deletes, resync, fleet_build }
}

async fn put_to_replicas(iterations: usize) -> anyhow::Result<Quantiles> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    let mut client = etcd.client().await?;
    // Register the fleet in transactions of 64 puts (etcd allows 128 operations per txn). The
    // measured workers bring it to exactly FLEET: a keyspace holds at most 16,384 keys, and a
    // worker past that bound would be refused (`over_capacity`), not discovered.
    let seeded = FLEET - iterations as u64;
    let ops: Vec<TxnOp> = records(seeded).into_iter().map(|kv| TxnOp::put(kv.key, kv.value, None)).collect();
    for chunk in ops.chunks(64) {
        client.txn(Txn::new().and_then(chunk.to_vec())).await?;
    }
    let yaml = format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      endpoints: [\"{}\"]\n  load:\n    \
         direct_allow_cidrs: [\"127.0.0.0/8\"]\ncontrol_plane:\n  grpc_listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\n",
        etcd.client_url
    );
    let loaded = config::load_str(&yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let control = ControlPlane::start(loaded.config, ListenOverrides::default()).await?;
    let url = format!("http://{}", control.grpc_addr);
    let replicas = start_replicas(4, &url).await?;
    let last = WorkerKey::new("dynamo", FIRST_LEASE + seeded - 1);
    wait_until_worker(&replicas, &last, Duration::from_secs(120)).await?;

    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations as u64 {
        let id = FIRST_LEASE + seeded + i;
        let ops: Vec<TxnOp> = decode_worker_records("dynamo", id, "Qwen/Qwen3-32B")
            .into_iter()
            .map(|(k, v)| TxnOp::put(k, v, None))
            .collect();
        let start = Instant::now();
        client.txn(Txn::new().and_then(ops)).await?;
        wait_until_worker(&replicas, &WorkerKey::new("dynamo", id), Duration::from_secs(10)).await?;
        samples.push(start.elapsed());
    }
    for replica in replicas {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(Quantiles::of(samples))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
