//! Load signals end to end against real Dynamo 1.6.1 `dynamo.mocker` workers under load: an
//! aggregated worker with two data-parallel ranks and a second aggregated worker, requests
//! pinned to each rank through the real `dynamo.frontend --router-mode direct`, the real
//! control-plane binary subscribing to their kv_metrics publishers, and two real data-plane
//! replicas, all inside a private network namespace.
//!
//! An independent pyzmq subscriber records every message the workers publish. The control
//! plane's store must hold, per rank, exactly the tapped message it claims (same publisher,
//! sequence and kv_used_blocks) while load changes, and the tap's last message once the load
//! settles; the published fleet view must carry the same values, and both replicas must have
//! acked that version (a replica acks only what it applied, so they hold the same values).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};
use continuum_tests::dynamo::{self, Continuum, InstanceWatch, Mocker, Mode};
use continuum_tests::dynamo_load::{self, Tap, Tapped};
use continuum_tests::netns::NetNs;
use serde_json::Value;

const DP2: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 64, dp_size: 2 };
const DP1: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 64, dp_size: 1 };
const SETTLE: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_and_every_replica_hold_each_ranks_kv_used_blocks_as_the_real_workers_publish_them()
-> anyhow::Result<()> {
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let continuum = Continuum::start(&ns, 2).await?;
    let dp2 = DP2.start(&ns, &watch, "agg-dp2").await?;
    let dp1 = DP1.start(&ns, &watch, "agg-dp1").await?;
    let frontend = dynamo_load::start_frontend(&ns).await?;
    let admin = continuum.admin.clone();

    let endpoints = wait_for_channels(&ns, 2).await?;
    let tap = Tap::start(&ns, &endpoints).await?;
    wait_for_connected_subscriptions(&ns, &admin, 2).await?;

    let targets = [(dp2.instance.instance_id, 0), (dp2.instance.instance_id, 1), (dp1.instance.instance_id, 0)];
    let mut snapshots = Vec::new();
    for round in 0..4 {
        let mut requests = Vec::new();
        for &(worker, rank) in &targets {
            for n in 0..3 {
                let (ns, frontend) = (&ns, frontend.as_str());
                requests.push(async move {
                    dynamo_load::chat(ns, frontend, worker, rank, 60 + 40 * n + 10 * round, 24).await
                });
            }
        }
        // Read the store while the requests run, so in-flight (non-zero) samples are compared.
        let done = std::sync::atomic::AtomicBool::new(false);
        let poll = async {
            let mut taken = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                taken.push(ns.get_json(&format!("{admin}/admin/dynamo/loads")).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            taken
        };
        let send = async {
            let statuses = futures::future::join_all(requests).await;
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            statuses
        };
        let (statuses, taken) = tokio::join!(send, poll);
        for status in statuses {
            ensure!(status? == 200, "a pinned chat completion failed:\n{}", ns.log_tail("frontend"));
        }
        for snapshot in taken {
            snapshots.push(snapshot?);
        }
    }
    tap.settle(SETTLE, Duration::from_secs(30)).await?;

    let tapped = tap.all();
    let by_sequence: BTreeMap<(u64, u64), Tapped> = tapped.iter().map(|t| ((t.publisher_id, t.sequence), *t)).collect();
    let latest = tap.latest();
    ensure!(
        latest.len() == 3,
        "the tap saw ranks {:?}, want both ranks of the dp=2 worker and the dp=1 worker",
        latest.keys()
    );
    ensure!(
        tapped.iter().any(|t| t.kv_used_blocks.unwrap_or(0) > 0),
        "the workers never reported used blocks under load: {tapped:?}"
    );

    // While the load changed: every sample the store held was a real message, as published.
    // The tap joined at its own moment, so the store may hold messages from before it, and a
    // message the tap missed (a gap in its sequence numbers) cannot be checked; but once
    // settled, the tap saw each publisher's last, so the store held none past it.
    let mut last_seen: BTreeMap<u64, u64> = BTreeMap::new();
    for t in &tapped {
        let last = last_seen.entry(t.publisher_id).or_insert(t.sequence);
        *last = (*last).max(t.sequence);
    }
    let (mut checked, mut busy, mut unseen) = (0, 0, 0);
    for snapshot in &snapshots {
        for entry in snapshot["store"].as_array().context("store")? {
            let publisher: u64 = entry["publisher_id"].as_str().context("publisher_id")?.parse()?;
            let sequence = entry["sequence"].as_u64().context("sequence")?;
            if let Some(t) = by_sequence.get(&(publisher, sequence)) {
                assert_eq!(entry["kv_used_blocks"].as_u64(), t.kv_used_blocks, "{entry}");
                assert_eq!(entry["dp_rank"].as_u64(), Some(u64::from(t.dp_rank)), "{entry}");
                assert_eq!(entry["worker_id"].as_str(), Some(t.worker_id.to_string().as_str()), "{entry}");
                checked += 1;
                busy += usize::from(t.kv_used_blocks.unwrap_or(0) > 0);
            } else {
                let last = last_seen.get(&publisher).with_context(|| format!("the tap saw nothing of {entry}"))?;
                ensure!(
                    sequence < *last,
                    "the store held a message past the last the tap saw of that publisher ({last}): {entry}"
                );
                unseen += 1;
            }
        }
    }
    ensure!(
        busy > 0,
        "no store snapshot taken under load matched a tapped message with used blocks ({checked} idle ones did)"
    );

    // Settled: the store holds each rank's last message, the fleet view the same values, and
    // both replicas acked that version.
    let settled = settled_view(&ns, &admin, &latest).await?;
    println!(
        "{checked} store samples read under load matched the tap ({busy} with used blocks), {unseen} from before the tap joined or its gaps; settled: {settled}"
    );

    let workers = ns.get_json(&format!("{admin}/admin/dynamo/workers")).await?;
    ensure!(!workers.to_string().contains("tcp://"), "the admin API exported a publisher address: {workers}");
    let (_, metrics) = ns.get(&format!("{admin}/metrics")).await?;
    for (worker, rank) in targets {
        let series = format!(
            "continuum_dynamo_worker_kv_used_blocks{{dp_rank=\"{rank}\",namespace=\"dynamo\",worker=\"{worker:x}\"}}"
        );
        ensure!(metrics.contains(&series), "no {series} in\n{metrics}");
    }
    let applied = continuum_tests::sample(&metrics, "continuum_dynamo_load_events_total{result=\"applied\"}");
    ensure!(applied.is_some_and(|n| n > 0.0), "nothing applied ({applied:?}):\n{metrics}");
    Ok(())
}

/// Waits until etcd holds `n` kv_metrics channels; their endpoints.
async fn wait_for_channels(ns: &NetNs, n: usize) -> anyhow::Result<Vec<String>> {
    for _ in 0..100 {
        let endpoints = dynamo_load::kv_metrics_endpoints(ns).await?;
        if endpoints.len() == n {
            return Ok(endpoints);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("etcd never held {n} kv_metrics channels")
}

async fn wait_for_connected_subscriptions(ns: &NetNs, admin: &str, n: usize) -> anyhow::Result<()> {
    let mut last = Value::Null;
    for _ in 0..200 {
        last = ns.get_json(&format!("{admin}/admin/dynamo/workers")).await?;
        let subscriptions = last["subscriptions"].as_array().cloned().unwrap_or_default();
        let connected = subscriptions
            .iter()
            .filter(|s| s["state"] == "connected" && s["transport"] == "direct" && s["family"] == "kv_metrics")
            .count();
        if connected == n && last["load_publishers"] == n {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the control plane never had {n} connected kv_metrics subscriptions: {last}")
}

/// Polls until the store, the fleet view and both replicas agree with the tap's last message
/// per rank; returns the agreed values.
async fn settled_view(ns: &NetNs, admin: &str, latest: &BTreeMap<(u64, u32), Tapped>) -> anyhow::Result<String> {
    let mut why = String::new();
    for _ in 0..100 {
        match check_settled(ns, admin, latest).await {
            Ok(agreed) => return Ok(agreed),
            Err(error) => why = format!("{error:#}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the control plane and replicas never agreed with the tap: {why}")
}

async fn check_settled(ns: &NetNs, admin: &str, latest: &BTreeMap<(u64, u32), Tapped>) -> anyhow::Result<String> {
    let loads = ns.get_json(&format!("{admin}/admin/dynamo/loads")).await?;
    let key = |e: &Value| -> anyhow::Result<(u64, u32)> {
        Ok((
            e["worker_id"].as_str().context("worker_id")?.parse()?,
            u32::try_from(e["dp_rank"].as_u64().context("dp_rank")?)?,
        ))
    };
    let store: BTreeMap<(u64, u32), Value> = loads["store"]
        .as_array()
        .context("store")?
        .iter()
        .map(|e| Ok((key(e)?, e.clone())))
        .collect::<anyhow::Result<_>>()?;
    let fleet: BTreeMap<(u64, u32), Value> = loads["fleet"]["loads"]
        .as_array()
        .context("fleet loads")?
        .iter()
        .map(|e| Ok((key(e)?, e.clone())))
        .collect::<anyhow::Result<_>>()?;
    let mut agreed = Vec::new();
    for (rank, tapped) in latest {
        let held = store.get(rank).with_context(|| format!("the store holds nothing for {rank:?}"))?;
        ensure!(held["sequence"] == tapped.sequence, "store {held} vs tap {tapped:?}");
        ensure!(held["kv_used_blocks"].as_u64() == tapped.kv_used_blocks, "store {held} vs tap {tapped:?}");
        let sent = fleet.get(rank).with_context(|| format!("the fleet view holds nothing for {rank:?}"))?;
        ensure!(sent["kv_used_blocks"] == held["kv_used_blocks"], "fleet {sent} vs store {held}");
        agreed.push(format!("{:x}/{}={:?}", rank.0, rank.1, tapped.kv_used_blocks));
    }
    let version = loads["fleet"]["version"].as_u64().context("version")?;
    let replicas = ns.get_json(&format!("{admin}/admin/fleet/replicas")).await?;
    let acked: Vec<u64> = replicas["replicas"]
        .as_array()
        .context("replicas")?
        .iter()
        .filter_map(|r| r["acked_version"].as_u64())
        .collect();
    let current = replicas["version"].as_u64().context("current version")?;
    ensure!(current == version, "the fleet moved on from {version} to {current} meanwhile");
    ensure!(acked == [version, version], "replicas acked {acked:?}, want both at {version}");
    Ok(format!("{} at fleet version {version}, acked by both replicas", agreed.join(", ")))
}
