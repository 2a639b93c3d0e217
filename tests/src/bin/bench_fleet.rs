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
    let iterations: usize = std::env::args()
        .skip_while(|a| a != "--iterations")
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(200);
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
    write_section(&table)?;
    Ok(())
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
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    let row = Row { workers, replicas, p50: at(0.5), p99: at(0.99), max: at(1.0) };
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

/// Replaces the text between this benchmark's markers in docs/benchmarks.md.
fn write_section(table: &str) -> anyhow::Result<()> {
    let path = continuum_tests::tools::workspace_root().join("docs/benchmarks.md");
    let (begin, end) = ("<!-- bench-fleet:begin -->", "<!-- bench-fleet:end -->");
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    let machine = machine_facts();
    let section = format!(
        "{begin}\nMeasured {} with `cargo run --release -p continuum-tests --bin bench-fleet` on {machine}.\n\n{table}{end}",
        date()
    );
    let updated = match (doc.find(begin), doc.find(end)) {
        (Some(b), Some(e)) if b < e => format!("{}{section}{}", &doc[..b], &doc[e + end.len()..]),
        _ => format!("{doc}\n## Fleet stream\n\n{section}\n"),
    };
    std::fs::write(&path, updated)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn machine_facts() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cpus} cores ({model})")
}

fn date() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "recently".into(), |s| s.trim().to_string())
}
