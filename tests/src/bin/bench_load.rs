//! Load-signal benchmark: kv_metrics frames decoded per second on one core (decode alone, and
//! ZMTP framing plus decode over an in-memory pipe), and the memory an idle subscription holds
//! (its buffers, and everything the supervisor allocates for it, measured by a counting
//! allocator against publishers in a child process).
//!
//! `cargo run --release -p continuum-tests --bin bench-load -- [--seconds 3] [--subscriptions 1024] [--write]`

use std::alloc::System;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use continuum_control_plane::load::decode::decode_kv_metrics;
use continuum_control_plane::load::zmtp::{Incoming, ZmtpLimits, ZmtpSubscriber};
use continuum_tests::bench::{arg, write_section};
use continuum_tests::load::{TestLoad, fleet, kv_metrics_publisher, loopback_config, test_options, worker};
use continuum_tests::zmtp_peer::{RawPublisher, encode_message, pub_handshake};
use continuum_tests::{eventually, tools};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tokio::io::AsyncWriteExt;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn main() -> anyhow::Result<()> {
    if let Ok(n) = arg("--serve-peers", 0)
        && n > 0
    {
        return serve_peers(n);
    }
    let seconds = arg("--seconds", 3)?;
    let subscriptions = arg("--subscriptions", 1024)?;
    let frames = captured_frames()?;
    let decode = decode_rate(&frames, Duration::from_secs(u64::try_from(seconds)?))?;
    let one_core = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let framed = one_core.block_on(framed_rate(&frames, Duration::from_secs(u64::try_from(seconds)?)))?;
    let buffers = one_core.block_on(idle_session_buffers())?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let (per_subscription, registry_only, _) = runtime.block_on(idle_subscriptions(subscriptions))?;

    let subscriptions_only = per_subscription * i64::try_from(subscriptions)?;
    let table = format!(
        "| measure | result |\n|---|---|\n\
         | kv_metrics frames decoded per second, one core ({} captured frames, decode only) | {:.0} ({:.0} ns each) |\n\
         | messages framed by the ZMTP client and decoded per second, one core (in-memory pipe) | {:.0} |\n\
         | buffers of an idle subscription (read + write + message; the seed's bound is 2.6 KiB) | {} B |\n\
         | heap per idle connected subscription, all of it (task, socket registration, status, buffers) | {} B |\n\
         | heap for {subscriptions} idle connected subscriptions | {:.2} MiB, of which buffers {:.2} MiB |\n\
         | heap of the discovered fleet and registry for them (not counted above) | {:.2} MiB |\n\
         | load average when measured (1 min; other builds share the 2 cores) | {} |\n",
        frames.len(),
        decode,
        1e9 / decode,
        framed,
        buffers,
        per_subscription,
        subscriptions_only as f64 / 1048576.0,
        (buffers * subscriptions) as f64 / 1048576.0,
        registry_only as f64 / 1048576.0,
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next().map(String::from))
            .unwrap_or_default(),
    );
    println!("{table}");
    if std::env::args().any(|a| a == "--write") {
        write_section(
            "bench-load",
            "Load signals (kv_metrics)",
            "cargo run --release -p continuum-tests --bin bench-load -- --write",
            &table,
        )?;
    }
    Ok(())
}

/// Every kv_metrics message captured from real Dynamo 1.6.1 workers: (frames, publisher id).
fn captured_frames() -> anyhow::Result<Vec<(Vec<Vec<u8>>, u64)>> {
    let mut out = Vec::new();
    for file in ["agg/zmq-messages.jsonl", "agg/zmq-messages-under-load-evictions.jsonl", "disagg/zmq-messages.jsonl"] {
        for message in tools::captured_messages(file)?.into_iter().filter(|m| m.topic == "kv_metrics") {
            let publisher = message.decoded["publisher_id_frame_u64be"].as_u64().context("publisher id")?;
            out.push((message.frames, publisher));
        }
    }
    Ok(out)
}

fn decode_rate(frames: &[(Vec<Vec<u8>>, u64)], run: Duration) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut decoded = 0u64;
    while started.elapsed() < run {
        for (message, publisher) in frames {
            let sample = decode_kv_metrics(message.iter().map(Vec::as_slice), *publisher);
            anyhow::ensure!(sample.is_ok(), "a captured frame failed to decode");
            decoded += 1;
        }
    }
    Ok(decoded as f64 / started.elapsed().as_secs_f64())
}

async fn framed_rate(frames: &[(Vec<Vec<u8>>, u64)], run: Duration) -> anyhow::Result<f64> {
    let (ours, mut peer) = tokio::io::duplex(64 * 1024);
    let batch: Vec<u8> = frames.iter().flat_map(|(f, _)| encode_message(f)).collect();
    let writer = tokio::spawn(async move {
        peer.write_all(&pub_handshake()).await?;
        loop {
            peer.write_all(&batch).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    });
    let mut session = ZmtpSubscriber::handshake(ours, ZmtpLimits::KV_METRICS, b"kv_metrics", 1).await?;
    let started = Instant::now();
    let mut decoded = 0u64;
    let mut i = 0;
    while started.elapsed() < run {
        let Incoming::Message(message) = session.recv().await? else { anyhow::bail!("dropped a captured message") };
        let publisher = frames[i % frames.len()].1;
        i += 1;
        anyhow::ensure!(decode_kv_metrics((0..message.len()).filter_map(|f| message.frame(f)), publisher).is_ok());
        decoded += 1;
    }
    writer.abort();
    Ok(decoded as f64 / started.elapsed().as_secs_f64())
}

async fn idle_session_buffers() -> anyhow::Result<usize> {
    let (ours, mut peer) = tokio::io::duplex(4096);
    peer.write_all(&pub_handshake()).await?;
    let session = ZmtpSubscriber::handshake(ours, ZmtpLimits::KV_METRICS, b"kv_metrics", 1).await?;
    Ok(session.buffered_capacity())
}

fn net(stats: stats_alloc::Stats) -> i64 {
    let allocated = i64::try_from(stats.bytes_allocated).unwrap_or(i64::MAX);
    let freed = i64::try_from(stats.bytes_deallocated).unwrap_or(i64::MAX);
    allocated - freed + i64::try_from(stats.bytes_reallocated).unwrap_or(0)
}

/// Starts `n` subscriptions through the real supervisor against publishers in a child process
/// and measures this process's live heap: (per subscription, fleet and registry alone, total).
async fn idle_subscriptions(n: usize) -> anyhow::Result<(i64, i64, i64)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve-peers", &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let endpoints: Vec<String> = BufReader::new(stdout).lines().take(n).collect::<Result<_, _>>()?;
    let fleet_of = || {
        let workers = (0..n as u64).map(|i| worker(1 + i, 1)).collect();
        let publishers = endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| kv_metrics_publisher(1 + i as u64, 1 + i as u64, e.clone()))
            .collect();
        fleet(workers, publishers)
    };

    // The same fleet published with no supervisor: what discovery's view costs by itself.
    let region = Region::new(GLOBAL);
    let bare = continuum_control_plane::sources::Registry::new(continuum_tests::publisher());
    bare.publish(fleet_of());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let registry_only = net(region.change());

    let fleet = fleet_of();
    let region = Region::new(GLOBAL);
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet);
    let connected = || load.metrics.load_subscriptions.with_label_values(&["connected", "direct"]).get();
    eventually(Duration::from_secs(60), "every subscription connected", || async { connected() == n as i64 }).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let total = net(region.change());
    load.stop().await;
    drop(bare);
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(b"done\n")?;
    }
    child.wait()?;
    Ok(((total - registry_only) / n as i64, registry_only, total))
}

/// Child mode: `n` raw publishers; prints their endpoints, holds their connections until
/// stdin closes.
fn serve_peers(n: usize) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    runtime.block_on(async {
        let mut peers = Vec::with_capacity(n);
        let mut out = std::io::stdout().lock();
        for _ in 0..n {
            let peer = RawPublisher::bind().await?;
            writeln!(out, "{}", peer.endpoint())?;
            peers.push(peer);
        }
        out.flush()?;
        drop(out);
        let mut held = Vec::new();
        let stdin = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        });
        tokio::pin!(stdin);
        loop {
            tokio::select! {
                _ = &mut stdin => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(50)) => {
                    for peer in &mut peers {
                        while let Some(connection) = peer.try_connection() {
                            held.push(connection);
                        }
                    }
                }
            }
        }
    })
}
