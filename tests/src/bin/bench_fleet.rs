//! Fleet stream benchmark: propagation of a one-worker change from the control plane to all N
//! replicas (real gRPC on loopback, in one process), and encoded sizes of snapshots and deltas.
//!
//! `cargo run --release -p continuum-tests --bin bench-fleet [-- --iterations 200]`
//! prints a table and rewrites the "Fleet stream" section of docs/benchmarks.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_control_plane::fleet::FleetChange;
use continuum_proto::convert::{delta_to_wire, snapshot_to_wire};
use continuum_proto::view::FleetDelta;
use continuum_tests::bench::{Quantiles, arg, write_section};
use continuum_tests::{TestControlPlane, publisher, start_replicas, wait_for_version, worker};
use prost::Message;

const FLEETS: [usize; 2] = [100, 16_384];
const REPLICAS: [usize; 3] = [1, 16, 64];

#[derive(Debug)]
struct Row {
    workers: usize,
    replicas: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let iterations = arg("--iterations", 200)?;
    let mut rows = Vec::new();
    let mut sizes = Vec::new();
    for &workers in &FLEETS {
        sizes.push(encoded_sizes(workers));
        for &replicas in &REPLICAS {
            rows.push(propagation(workers, replicas, iterations).await?);
            eprintln!("{:?}", rows.last());
        }
    }
    let table = render(&rows, &sizes, iterations);
    println!("{table}");
    write_section("bench-fleet", "Fleet stream", "cargo run --release -p continuum-tests --bin bench-fleet", &table)
}

/// Changes one worker `iterations` times and times each until every replica holds it.
async fn propagation(workers: usize, replicas: usize, iterations: usize) -> anyhow::Result<Row> {
    let control = TestControlPlane::start(publisher()).await?;
    let fleet = (1..=workers as u64).map(|id| worker("dynamo", id, "bench-model")).collect();
    control.publisher.apply(FleetChange { upsert: fleet, ..FleetChange::default() });
    let started = start_replicas(replicas, &control.url()).await?;
    wait_for_version(&started, control.publisher.current().version(), Duration::from_secs(60)).await?;

    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let change = FleetChange { upsert: vec![worker("dynamo", 1, &format!("model-{i}"))], ..FleetChange::default() };
        let t0 = Instant::now();
        let version = control.publisher.apply(change).ok_or_else(|| anyhow::anyhow!("change was a no-op"))?;
        wait_for_version(&started, version, Duration::from_secs(10)).await?;
        samples.push(t0.elapsed());
    }
    let q = Quantiles::of(samples);
    let row = Row { workers, replicas, p50: q.p50, p99: q.p99, max: q.max };
    for replica in started {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(row)
}

/// (workers, full snapshot bytes, one-worker delta bytes)
fn encoded_sizes(workers: usize) -> (usize, usize, usize) {
    let publisher = publisher();
    let fleet = (1..=workers as u64).map(|id| worker("dynamo", 7_587_890_000_000_000 + id, "Qwen/Qwen3-32B")).collect();
    publisher.apply(FleetChange { upsert: fleet, ..FleetChange::default() });
    let now = Instant::now();
    let snapshot = snapshot_to_wire(publisher.current().view(), now).encoded_len();
    let delta = FleetDelta {
        base_version: 1,
        version: 2,
        upserted: vec![Arc::clone(&worker("dynamo", 7_587_890_000_000_001, "Qwen/Qwen3-32B"))],
        ..FleetDelta::default()
    };
    (workers, snapshot, delta_to_wire(&delta, now).encoded_len())
}

fn render(rows: &[Row], sizes: &[(usize, usize, usize)], iterations: usize) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "Propagation of a one-worker change to all replicas ({iterations} changes per cell, loopback gRPC, one process):\n\n"
    ));
    out.push_str("| workers | replicas | p50 | p99 | max |\n|---:|---:|---:|---:|---:|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {:.2} ms | {:.2} ms | {:.2} ms |\n",
            r.workers,
            r.replicas,
            ms(r.p50),
            ms(r.p99),
            ms(r.max)
        ));
    }
    out.push_str("\nEncoded sizes (protobuf):\n\n| workers | full snapshot | one-worker delta |\n|---:|---:|---:|\n");
    for (workers, snapshot, delta) in sizes {
        out.push_str(&format!("| {workers} | {:.1} KiB | {delta} B |\n", *snapshot as f64 / 1024.0));
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
