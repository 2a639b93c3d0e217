//! Discovery end to end against the real Dynamo 1.6.1 `dynamo.mocker` workers: prefill, decode
//! and aggregated with two data-parallel ranks, registering in a real etcd, discovered by the
//! real control-plane binary and streamed to two real data-plane replicas, all inside a private
//! network namespace (Dynamo binds 0.0.0.0).
//!
//! Latencies are measured from the moment the test's own etcd watch sees a worker's `generate`
//! instance record (Dynamo puts the card first and the instance second, so that is when the
//! worker can be joined; the control plane's watch is told at the same moment) to the end of the
//! first poll that finds the control plane listing it correctly and every replica holding and
//! having acked the control plane's current fleet version. A replica acks a version only after
//! applying it, so that proves every replica's snapshot holds the worker. A SIGTERMed worker's
//! departure is timed from the etcd DELETE of its instance record (Dynamo's own shutdown before
//! it is bounded apart), a SIGKILLed one's from the moment etcd expires its lease. Each poll is
//! one curl reading every endpoint in the namespace (20 to 50 ms), so the figures are upper
//! bounds, and a poll counts only if it began within the bound.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use continuum_tests::dynamo::{self, Continuum, InstanceWatch, Mocker, Mode, NAMESPACE, Worker};
use continuum_tests::netns::NetNs;
use serde_json::Value;

/// The bound from a worker's registration (or deregistration) to every view of it.
const VISIBLE_WITHIN: Duration = Duration::from_secs(2);
/// Dynamo 1.6.1 grants each worker a 30 s lease; after a SIGKILL nothing revokes it, so etcd
/// deletes the worker's keys when it expires, up to 30 s after the last keepalive.
const LEASE_EXPIRY_WITHIN: Duration = Duration::from_secs(40);
/// A SIGTERMed worker deletes its own keys as it shuts down; Python's shutdown on 2 busy cores
/// is given this long.
const DEREGISTER_WITHIN: Duration = Duration::from_secs(15);

const PREFILL: Mocker = Mocker { mode: Mode::Prefill, kv_blocks: 1024, dp_size: 1 };
const DECODE: Mocker = Mocker { mode: Mode::Decode, kv_blocks: 512, dp_size: 1 };
const AGGREGATED: Mocker = Mocker { mode: Mode::Aggregated, kv_blocks: 24, dp_size: 2 };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_mocker_workers_reach_admin_and_every_replica_within_2s_and_leave_them_within_2s_of_deregistering_or_their_lease_expiring()
-> anyhow::Result<()> {
    let began = Instant::now();
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let continuum = Continuum::start(&ns, 2).await?;
    let fleet = Fleet { ns: &ns, continuum: &continuum };
    let mut report = Vec::new();

    let mut workers = Vec::new();
    for (label, mocker) in [("prefill", PREFILL), ("decode", DECODE), ("aggregated", AGGREGATED)] {
        let worker = mocker.start(&ns, &watch, label).await?;
        let put_at = worker.instance.put_at;
        workers.push(worker);
        let latency = fleet.converge(&workers, put_at, "registered").await?;
        report.push(format!("{label} registered -> listed in admin and acked by both replicas: {latency}"));
    }
    assert_ids_match_etcd(&fleet, &workers).await?;

    let decode = workers.remove(1);
    let sent = Instant::now();
    ns.terminate(decode.pid)?;
    // How long the worker takes to deregister is Dynamo's own shutdown; the bound is on what
    // follows its etcd DELETE, as for the SIGKILL below.
    let deleted = watch.wait_deleted(decode.instance.instance_id, DEREGISTER_WITHIN).await?;
    let latency = fleet.converge(&workers, deleted, "SIGTERMed").await?;
    report.push(format!(
        "decode SIGTERM -> etcd instance deleted after {:?}, then gone from admin and both replicas: {latency}",
        deleted.duration_since(sent)
    ));

    let prefill = workers.remove(0);
    let killed = Instant::now();
    ns.kill(prefill.pid)?;
    let expired = fleet.listed_until_its_lease_expires(&prefill, &watch, killed).await?;
    let latency = fleet.converge(&workers, expired, "expired").await?;
    report.push(format!(
        "prefill SIGKILL -> lease expired after {:?}, then gone from admin and both replicas: {latency}",
        expired.duration_since(killed)
    ));

    report.push(format!("whole test: {:?}", began.elapsed()));
    println!("{}", report.join("\n"));
    Ok(())
}

/// From a change in etcd to the end of the first poll that saw it everywhere.
struct Latency {
    upper_bound: Duration,
    poll: Duration,
}

impl std::fmt::Display for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<= {:.0?} (the confirming poll took {:.0?})", self.upper_bound, self.poll)
    }
}

/// The control plane and replicas of one namespace, read the way an operator would.
struct Fleet<'a> {
    ns: &'a NetNs,
    continuum: &'a Continuum,
}

impl Fleet<'_> {
    /// Polls until [`Self::check`] passes, failing unless a poll that began within
    /// [`VISIBLE_WITHIN`] of `since` passes; returns how long it took, and how long the
    /// confirming poll itself took.
    async fn converge(&self, workers: &[Worker], since: Instant, what: &str) -> anyhow::Result<Latency> {
        loop {
            let poll = Instant::now();
            let began_in_time = poll.saturating_duration_since(since) <= VISIBLE_WITHIN;
            let checked = self.check(workers).await;
            match checked {
                Ok(()) if began_in_time => return Ok(Latency { upper_bound: since.elapsed(), poll: poll.elapsed() }),
                Err(_) if began_in_time => tokio::time::sleep(Duration::from_millis(10)).await,
                outcome => bail!(
                    "the fleet did not converge within {VISIBLE_WITHIN:?} of a worker being {what} (first seen by a poll begun {:?} after): {}",
                    poll.saturating_duration_since(since),
                    outcome.err().map_or_else(|| "it converged later".to_owned(), |why| format!("{why:#}"))
                ),
            }
        }
    }

    /// The admin API lists exactly `workers`, each as its card and flags describe it, and
    /// every replica has applied and acked the control plane's current version. One curl reads
    /// every endpoint, in this order.
    async fn check(&self, workers: &[Worker]) -> anyhow::Result<()> {
        let admin = &self.continuum.admin;
        let mut urls = vec![
            format!("{admin}/admin/dynamo/workers"),
            format!("{admin}/admin/fleet/replicas"),
            format!("{admin}/readyz"),
        ];
        urls.extend(self.continuum.replicas.iter().map(|r| format!("{}/readyz", r.url)));
        let answers = self.ns.get_all_json(&urls.iter().map(String::as_str).collect::<Vec<_>>()).await?;
        let [listed, replicas, readyz, held @ ..] = &answers[..] else { bail!("curl answered {answers:?}") };

        let listed = listed_workers(listed)?;
        let ids: BTreeSet<&str> = listed.iter().filter_map(|w| w["worker_id"].as_str()).collect();
        let want: Vec<String> = workers.iter().map(|w| w.instance.instance_id.to_string()).collect();
        ensure!(ids == want.iter().map(String::as_str).collect(), "admin lists {ids:?}, want {want:?}");
        for (worker, id) in workers.iter().zip(&want) {
            let entry = listed.iter().find(|w| w["worker_id"] == id.as_str()).context("listed above")?;
            assert_describes(entry, worker);
        }

        let version = replicas["version"].as_u64().context("no version")?;
        let acked: Vec<(&str, u64)> = replicas["replicas"]
            .as_array()
            .context("no replicas")?
            .iter()
            .map(|r| (r["replica_id"].as_str().unwrap_or_default(), r["acked_version"].as_u64().unwrap_or_default()))
            .collect();
        let expected: Vec<(&str, u64)> = self.continuum.replicas.iter().map(|r| (r.id.as_str(), version)).collect();
        ensure!(acked == expected, "control plane at version {version}, replicas acked {acked:?}");
        ensure!(readyz["fleet"]["version"] == version, "/readyz moved on from {version}: {readyz}");
        for (replica, held) in self.continuum.replicas.iter().zip(held) {
            let fleet = &held["fleet"];
            ensure!(
                fleet["version"] == version && fleet["workers"] == workers.len(),
                "replica {} holds {fleet}, want version {version} with {} workers",
                replica.id,
                workers.len()
            );
        }
        Ok(())
    }

    /// The admin API still lists `id` among `count` workers, and every replica still holds
    /// that many.
    async fn still_holds(&self, id: u64, count: usize) -> anyhow::Result<bool> {
        let listed = self.workers().await?;
        let mut holds = listed.len() == count && listed.iter().any(|w| w["worker_id"] == id.to_string().as_str());
        for replica in &self.continuum.replicas {
            holds &= self.ns.get_json(&format!("{}/readyz", replica.url)).await?["fleet"]["workers"] == count;
        }
        Ok(holds)
    }

    async fn workers(&self) -> anyhow::Result<Vec<Value>> {
        let body = self.ns.get_json(&format!("{}/admin/dynamo/workers", self.continuum.admin)).await?;
        Ok(listed_workers(&body)?.clone())
    }

    /// A SIGKILLed worker deregisters nothing: it must stay listed, and in every replica's
    /// fleet, until etcd expires its lease. Returns when the test's watch saw its instance
    /// deleted.
    async fn listed_until_its_lease_expires(
        &self,
        worker: &Worker,
        watch: &InstanceWatch,
        killed: Instant,
    ) -> anyhow::Result<Instant> {
        let id = worker.instance.instance_id;
        let listed = self.workers().await?.len();
        loop {
            if let Some(deleted) = watch.instance(id).and_then(|i| i.deleted_at) {
                return Ok(deleted);
            }
            ensure!(killed.elapsed() < LEASE_EXPIRY_WITHIN, "{id} still in etcd {LEASE_EXPIRY_WITHIN:?} after SIGKILL");
            if !self.still_holds(id, listed).await? {
                // The control plane's watch may be told a moment before the test's.
                return watch.wait_deleted(id, Duration::from_secs(1)).await.with_context(|| {
                    format!(
                        "{id} left the admin list or a replica {:?} after SIGKILL, before its lease expired",
                        killed.elapsed()
                    )
                });
            }
            // The next look, or the expiry itself, whichever comes first.
            let _ = watch.wait_deleted(id, Duration::from_millis(250)).await;
        }
    }
}

/// The `workers` of an `/admin/dynamo/workers` answer.
fn listed_workers(body: &Value) -> anyhow::Result<&Vec<Value>> {
    ensure!(body["source"] == "etcd", "not discovering from etcd: {body}");
    body["workers"].as_array().context("no workers array")
}

/// What the admin API must say about a real worker: its card's role, model, block size and
/// capacity, the data-parallel ranks it was started with, and ids that match its etcd key.
fn assert_describes(entry: &Value, worker: &Worker) {
    let (role, component) = match worker.mocker.mode {
        Mode::Prefill => ("prefill", "prefill"),
        Mode::Decode => ("decode", "backend"),
        Mode::Aggregated => ("aggregated", "backend"),
    };
    let label = &worker.label;
    assert_eq!(entry["instance_id"], worker.instance.key_hex.as_str(), "{label}: instance_id is the key's hex lease");
    assert_eq!(entry["namespace"], NAMESPACE, "{label}");
    assert_eq!(entry["role"], role, "{label}: {entry}");
    assert_eq!(entry["model"], "tiny", "{label}: {entry}");
    assert_eq!(entry["component"], component, "{label}: {entry}");
    assert_eq!(worker.instance.component, component, "{label}: the etcd key's component");
    assert_eq!(entry["endpoint"], "generate", "{label}: {entry}");
    assert_eq!(entry["block_size"], 16, "{label}: {entry}");
    assert_eq!(entry["capacity"]["total_kv_blocks"], worker.mocker.kv_blocks, "{label}: {entry}");
    assert_eq!(entry["capacity"]["max_num_seqs"], 256, "{label}: the mocker's default: {entry}");
    assert_eq!(entry["capacity"]["context_length"], 4096, "{label}: the tiny model's own limit: {entry}");
    assert_eq!(entry["capacity"]["max_num_batched_tokens"], 8192, "{label}: the mocker's default: {entry}");
    assert_eq!(entry["dp_start_rank"], 0, "{label}: {entry}");
    assert_eq!(entry["dp_size"], worker.mocker.dp_size, "{label}: {entry}");
    assert_eq!(entry["excluded"], Value::Null, "{label}: {entry}");
}

/// The ids the admin API reports are the ones etcd holds, read from etcd here rather than from
/// the test's own watch (which `Fleet::check` compares against).
async fn assert_ids_match_etcd(fleet: &Fleet<'_>, workers: &[Worker]) -> anyhow::Result<()> {
    let mut get = dynamo::etcdctl(fleet.ns);
    get.args(["get", "--prefix", &format!("v1/instances/{NAMESPACE}/"), "--print-value-only"]);
    let records: Vec<Value> = fleet
        .ns
        .run(get)
        .await?
        .lines()
        .filter(|l| !l.is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let in_etcd: BTreeSet<String> = records
        .iter()
        .filter(|r| r["endpoint"] == "generate")
        .filter_map(|r| r["instance_id"].as_u64())
        .map(|id| id.to_string())
        .collect();
    let listed = fleet.workers().await?;
    let in_admin: BTreeSet<String> =
        listed.iter().filter_map(|w| w["worker_id"].as_str()).map(str::to_string).collect();
    assert_eq!(in_admin, in_etcd, "the admin API lists etcd's generate instances");
    assert_eq!(in_etcd.len(), workers.len(), "one generate instance per worker the test started");
    Ok(())
}
