//! etcd discovery against a real etcd (Debian `etcd-server`): get-then-watch is gapless, a
//! restarted etcd resyncs without losing or doubling anything, oversized values are refused
//! while their neighbours apply, a keyspace larger than one response is read in pages, a full
//! keyspace's relist waits while the watches go on, and a frozen member is noticed by its
//! silence. The test writes the records as the workers would;
//! the control plane only reads.

use std::time::Duration;

use continuum_control_plane::app::{ControlPlane, ListenOverrides};
use continuum_control_plane::config::{self, BackoffConfig, EtcdConfig};
use continuum_control_plane::discovery::MAX_RECORDS_PER_KEYSPACE;
use continuum_control_plane::metrics::Metrics;
use continuum_control_plane::sources::Registry;
use continuum_control_plane::sources::etcd::{MAX_ETCD_MESSAGE_BYTES, WatchHealth, prefixes, run_with, writes_after};
use continuum_tests::etcd::{Etcd, decode_worker_records};
use continuum_tests::eventually;
use tokio_util::sync::CancellationToken;

const CONVERGE: Duration = Duration::from_secs(30);

async fn control_plane(etcd: &Etcd) -> anyhow::Result<ControlPlane> {
    let yaml = format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      endpoints: [\"{}\"]\n      \
         watch_reconnect_backoff: {{initial: 100ms, max: 1s}}\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n\
         control_plane:\n  grpc_listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\n",
        etcd.client_url
    );
    let loaded = config::load_str(&yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(ControlPlane::start(loaded.config, ListenOverrides::default()).await?)
}

fn worker_ids(control: &ControlPlane) -> Vec<u64> {
    control.publisher.current().view().workers().keys().map(|k| k.instance_id).collect()
}

async fn put_workers(etcd: &Etcd, ids: impl IntoIterator<Item = u64>) -> anyhow::Result<()> {
    let mut client = etcd.client().await?;
    for id in ids {
        for (key, value) in decode_worker_records("dynamo", id, "tiny") {
            client.put(key, value, None).await?;
        }
    }
    Ok(())
}

async fn delete_worker(etcd: &Etcd, id: u64) -> anyhow::Result<()> {
    let mut client = etcd.client().await?;
    for (key, _) in decode_worker_records("dynamo", id, "tiny") {
        client.delete(key, None).await?;
    }
    Ok(())
}

/// etcd discovery of namespace `dynamo` run by hand, outside a control plane.
struct Watcher {
    registry: Registry,
    metrics: Metrics,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    fn start(config: EtcdConfig, health: WatchHealth) -> anyhow::Result<Self> {
        let (registry, metrics, cancel) =
            (Registry::new(continuum_tests::publisher()), Metrics::new()?, CancellationToken::new());
        let run = run_with(config, vec!["dynamo".into()], registry.clone(), metrics.clone(), health, cancel.clone());
        Ok(Self { registry, metrics, cancel, task: tokio::spawn(run) })
    }
}

/// Lease-like ids above 2^53, as real workers have.
fn lease(i: u64) -> u64 {
    7_587_890_000_000_000 + i
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_then_watch_is_gapless_under_concurrent_puts() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, (0..100).map(lease)).await?;
    // Puts keep landing while the control plane range-gets and opens its watches; the last
    // 150 workers wait until it has listed and watches, so that they can only come by watch.
    let (listed, watched) = tokio::sync::oneshot::channel::<()>();
    let writer = {
        let url = etcd.client_url.clone();
        tokio::spawn(async move {
            let mut client = etcd_client::Client::connect([url], None).await?;
            for id in (100..250).map(lease) {
                for (key, value) in decode_worker_records("dynamo", id, "tiny") {
                    client.put(key, value, None).await?;
                }
            }
            watched.await?;
            for id in (250..400).map(lease) {
                for (key, value) in decode_worker_records("dynamo", id, "tiny") {
                    client.put(key, value, None).await?;
                }
            }
            anyhow::Ok(())
        })
    };
    let control = control_plane(&etcd).await?;
    let events = |kind| control.metrics.discovery_events.with_label_values(&[kind]).get();
    eventually(CONVERGE, "the first listing and its watches", || async {
        events("resync") == 1 && control.metrics.discovery_connected.get() == 1
    })
    .await?;
    let puts_listed = events("put");
    let _ = listed.send(());
    writer.await??;
    let expected: Vec<u64> = (0..400).map(lease).collect();
    eventually(CONVERGE, "all 400 workers", || async { worker_ids(&control) == expected }).await?;
    assert_eq!(events("resync"), 1, "no relisting: the last workers came by watch");
    assert!(events("put") >= puts_listed + 300, "each of the last 150 workers' two records was a watched put");
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_etcd_is_resynced_with_nothing_lost_or_doubled() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, (0..10).map(lease)).await?;
    let control = control_plane(&etcd).await?;
    let first: Vec<u64> = (0..10).map(lease).collect();
    eventually(CONVERGE, "the first ten workers", || async { worker_ids(&control) == first }).await?;
    eventually(CONVERGE, "discovery connected", || async { control.metrics.discovery_connected.get() == 1 }).await?;

    etcd.restart().await?;
    // Changes made right after the restart, while the watcher may still be reconnecting.
    delete_worker(&etcd, lease(3)).await?;
    put_workers(&etcd, [lease(10), lease(11)]).await?;
    let expected: Vec<u64> = (0..12).filter(|i| *i != 3).map(lease).collect();
    eventually(CONVERGE, "the fleet after the restart", || async { worker_ids(&control) == expected }).await?;
    let resyncs = control.metrics.discovery_events.with_label_values(&["resync"]).get();
    assert!(resyncs >= 2, "a new pass resyncs from fresh range gets ({resyncs})");
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_value_is_refused_while_its_neighbours_apply() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &["--max-request-bytes", "20971520"]).await?;
    put_workers(&etcd, [lease(1), lease(2)]).await?;
    let control = control_plane(&etcd).await?;
    eventually(CONVERGE, "two workers", || async { worker_ids(&control).len() == 2 }).await?;

    let mut client = etcd.client().await?;
    let huge = format!("{{\"type\":\"Model\",\"pad\":\"{}\"}}", "x".repeat(16 * 1024 * 1024 + 1));
    client.put(format!("v1/mdc/dynamo/backend/generate/{:x}", lease(3)), huge, None).await?;
    put_workers(&etcd, [lease(4)]).await?;
    eventually(CONVERGE, "the neighbour", || async { worker_ids(&control) == [lease(1), lease(2), lease(4)] }).await?;
    eventually(CONVERGE, "the refusal counted", || async {
        control.metrics.discovery_events.with_label_values(&["oversized"]).get() == 1
    })
    .await?;
    control.shutdown().await;
    Ok(())
}

/// More card bytes under one prefix than one etcd response may carry (64 MiB), and one value
/// larger than that alone: the prefix is read in pages at one revision, the huge value is
/// stepped over and counted, and every worker beside it is discovered. One range get would
/// have failed every pass, leaving the fleet empty for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyspace_larger_than_one_response_is_read_in_pages_and_a_huge_value_stepped_over() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd =
        Etcd::start(dir.path(), &["--max-request-bytes", "70000000", "--quota-backend-bytes", "1000000000"]).await?;
    let mut client = etcd.client().await?;
    let workers: Vec<u64> = (0..50).map(lease).collect();
    let pad = "x".repeat(1_400_000);
    for id in &workers {
        for (key, value) in decode_worker_records("dynamo", *id, "tiny") {
            let value = match key.starts_with("v1/mdc/") {
                // Each card 1.4 MiB, within etcd's default request size: 70 MiB under the prefix.
                true => value.replacen('{', &format!("{{\"pad\":\"{pad}\","), 1),
                false => value,
            };
            client.put(key, value, None).await?;
        }
    }
    let huge = format!("{{\"type\":\"Model\",\"pad\":\"{}\"}}", "x".repeat(MAX_ETCD_MESSAGE_BYTES + 1));
    // Sorted among the cards (no worker of its own), so pages on both sides of it are read.
    client.put(format!("v1/mdc/dynamo/backend/generate/{:x}", lease(25) * 16), huge, None).await?;
    drop(client);

    let control = control_plane(&etcd).await?;
    eventually(CONVERGE, "every worker", || async { worker_ids(&control).len() == workers.len() }).await?;
    let mut ids = worker_ids(&control);
    ids.sort_unstable();
    assert_eq!(ids, workers);
    assert_eq!(control.metrics.discovery_events.with_label_values(&["oversized"]).get(), 1, "the huge value, counted");
    // The newest write is the huge value: the watch, starting after the listing, never
    // replays it, so the pass holds (a replay failed every pass, relisting it for good).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let resyncs = control.metrics.discovery_events.with_label_values(&["resync"]).get();
    assert_eq!((resyncs, control.metrics.discovery_connected.get()), (1, 1), "one listing, still watching");
    control.shutdown().await;
    Ok(())
}

/// An etcd frozen with its connections open (`SIGSTOP`) answers nothing, not even the
/// read that confirms a quiet watch: its silence ends the pass within the deadline,
/// long before the HTTP/2 keepalive would (20 s), and discovery resyncs once it thaws. A quiet
/// but healthy etcd is never taken for a frozen one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_etcd_is_noticed_by_its_silence_and_a_quiet_one_is_not() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, [lease(1)]).await?;
    let config = EtcdConfig { endpoints: vec![etcd.client_url.clone()], ..EtcdConfig::default() };
    let health = WatchHealth {
        progress_every: Duration::from_millis(300),
        // An etcd slowed by the other tests' etcds must still confirm within these.
        silent_after: Duration::from_secs(3),
        confirm_within: Duration::from_secs(3),
    };
    let Watcher { registry, metrics, cancel, task } = Watcher::start(config, health)?;
    let resyncs = || metrics.discovery_events.with_label_values(&["resync"]).get();
    let connected = || metrics.discovery_connected.get() == 1;
    eventually(CONVERGE, "watching", || async { connected() }).await?;
    let workers = || registry.current().fleet.workers.len();
    assert_eq!(workers(), 1);

    // Quiet for three deadlines: the confirming reads (no write has come to answer progress
    // requests) keep the pass alive.
    tokio::time::sleep(3 * health.silent_after).await;
    assert_eq!((resyncs(), connected()), (1, true), "a quiet etcd is not a silent one");

    let pid = etcd.pid().ok_or_else(|| anyhow::anyhow!("etcd runs"))?.to_string();
    let signal = |name: &str| std::process::Command::new("kill").args([name, pid.as_str()]).status();
    signal("-STOP")?;
    // Before the HTTP/2 keepalive's 20 s: noticed by silence (3 s and a 3 s confirming read), not
    // by the keepalive.
    let noticed = eventually(Duration::from_secs(15), "the pass ends", || async { !connected() }).await;
    signal("-CONT")?;
    noticed?;
    eventually(CONVERGE, "resynced once thawed", || async { connected() && resyncs() == 2 }).await?;
    put_workers(&etcd, [lease(2)]).await?;
    eventually(CONVERGE, "and watching again", || async { workers() == 2 }).await?;
    cancel.cancel();
    task.await?;
    Ok(())
}

/// A full keyspace that frees room asks for a relist (Dynamo writes a key once: what it refused
/// comes back only by listing again), paced by the reconnect backoff. While the relist waits,
/// the watches go on: a worker deregistering meanwhile leaves the fleet at once, not after the
/// wait, and the refused worker is listed when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_for_freed_room_waits_its_turn_while_the_watches_go_on() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, (1..=4).map(lease)).await?;
    // The instances keyspace filled with bare instance records (no card: never workers).
    let mut kv = etcd.client().await?.kv_client();
    let filler = MAX_RECORDS_PER_KEYSPACE - 4;
    for chunk in (0..filler as u64).collect::<Vec<_>>().chunks(128) {
        let puts = chunk.iter().map(|i| {
            let (key, value) = decode_worker_records("dynamo", lease(1_000 + i), "tiny").remove(1);
            etcd_client::TxnOp::put(key, value, None)
        });
        kv.txn(etcd_client::Txn::new().and_then(puts.collect::<Vec<_>>())).await?;
    }
    let backoff = BackoffConfig { initial: Duration::from_secs(8), max: Duration::from_secs(16) };
    let config = EtcdConfig {
        endpoints: vec![etcd.client_url.clone()],
        watch_reconnect_backoff: backoff,
        ..EtcdConfig::default()
    };
    let Watcher { registry, metrics, cancel, task } = Watcher::start(config, WatchHealth::default())?;
    let resyncs = || metrics.discovery_events.with_label_values(&["resync"]).get();
    let holds = |id: u64| registry.current().fleet.workers.iter().any(|found| found.worker.key.instance_id == id);
    eventually(CONVERGE, "the four workers", || async { (1..=4).all(|i| holds(lease(i))) }).await?;

    put_workers(&etcd, [lease(5)]).await?;
    let refused = || metrics.discovery_events.with_label_values(&["over_capacity"]).get();
    eventually(CONVERGE, "the fifth worker's instance refused", || async { refused() >= 1 }).await?;
    assert!(!holds(lease(5)));

    // Its room freed, a relist is asked for; the deletion after it is still watched.
    delete_worker(&etcd, lease(1)).await?;
    delete_worker(&etcd, lease(2)).await?;
    eventually(Duration::from_secs(3), "both deletions, by watch", || async { !holds(lease(1)) && !holds(lease(2)) })
        .await?;
    assert_eq!((resyncs(), metrics.discovery_connected.get()), (1, 1), "the relist still waits its pacing");
    // The fleet is published before the resync is counted: wait for both.
    eventually(CONVERGE, "the refused worker, listed by the relist", || async { holds(lease(5)) && resyncs() == 2 })
        .await?;
    assert!((3..=4).all(|i| holds(lease(i))) && !holds(lease(1)) && !holds(lease(2)));
    cancel.cancel();
    task.await?;
    Ok(())
}

/// [`writes_after`]'s verdict on `prefix` after `revision`, checking the revision it says it
/// read at: the store's as the check began (none is written meanwhile here).
async fn changed(kv: &mut etcd_client::KvClient, prefix: &str, revision: i64) -> Option<bool> {
    let checked = writes_after(kv, prefix, revision, Duration::from_secs(5)).await;
    let store = kv.get("any", None).await.ok().and_then(|r| r.header().map(|h| h.revision()));
    assert_eq!(checked.map(|c| c.at), store, "{prefix} after {revision}");
    checked.map(|c| c.changed)
}

/// The check a silent watch stream gets: did its prefix change after the revision the stream
/// delivered (a key written, or one deleted)? Only changes under that prefix count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_checked_for_writes_under_its_prefix_past_what_it_delivered() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, [lease(1)]).await?;
    let mut kv = etcd.client().await?.kv_client();
    let [instances, cards, ..] = prefixes("dynamo");
    let now = kv.get("any", None).await?.header().map(|h| h.revision()).unwrap_or_default();
    assert_eq!(changed(&mut kv, &instances, now).await, Some(false), "nothing newer");
    assert_eq!(changed(&mut kv, &instances, 0).await, Some(true), "the instance written");
    put_workers(&etcd, [lease(2)]).await?;
    assert_eq!(changed(&mut kv, &instances, now).await, Some(true), "a new instance");
    kv.put(format!("{cards}other"), "{}", None).await?;
    let after = kv.get("any", None).await?.header().map(|h| h.revision()).unwrap_or_default();
    assert_eq!(changed(&mut kv, &instances, after - 1).await, Some(false), "a write elsewhere");
    assert_eq!(changed(&mut kv, &cards, after - 1).await, Some(true));
    // A delete (a lease expiring) leaves no key written after it: the count tells.
    kv.delete(format!("{cards}other"), None).await?;
    assert_eq!(changed(&mut kv, &cards, after).await, Some(true), "a key deleted");
    let deleted = kv.get("any", None).await?.header().map(|h| h.revision()).unwrap_or_default();
    assert_eq!(changed(&mut kv, &cards, deleted).await, Some(false), "nothing since");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_workers_lists_discovered_workers_behind_the_token_without_internal_addresses() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_workers(&etcd, [lease(7)]).await?;
    let yaml = format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      endpoints: [\"{}\"]\n  load:\n    \
         direct_allow_cidrs: [\"127.0.0.0/8\"]\ncontrol_plane:\n  grpc_listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\n  \
         token: \"${{ADMIN_TOKEN}}\"\n",
        etcd.client_url
    );
    let env = |name: &str| (name == "ADMIN_TOKEN").then(|| "s3cret".to_string());
    let loaded = config::load_str(&yaml, &env).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let control = ControlPlane::start(loaded.config, ListenOverrides::default()).await?;
    eventually(CONVERGE, "the worker", || async { worker_ids(&control) == [lease(7)] }).await?;

    let url = format!("http://{}/admin/dynamo/workers", control.admin_addr);
    let client = reqwest::Client::new();
    assert_eq!(client.get(&url).send().await?.status(), 401);
    assert_eq!(client.get(&url).bearer_auth("wrong").send().await?.status(), 401);
    let body = client.get(&url).bearer_auth("s3cret").send().await?.error_for_status()?.text().await?;
    let json: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(json["source"], "etcd");
    let worker = &json["workers"][0];
    assert_eq!(worker["worker_id"], lease(7).to_string());
    assert_eq!(worker["instance_id"], format!("{:x}", lease(7)));
    assert_eq!(worker["role"], "decode");
    assert_eq!(worker["model"], "tiny");
    assert_eq!(worker["block_size"], 16);
    assert_eq!(worker["capacity"]["total_kv_blocks"], 1024);
    assert!(!body.contains("127.0.0.1:1"), "the worker's transport address leaked: {body}");
    assert!(!body.contains("card_json"), "the raw card leaked: {body}");

    let metrics = client.get(format!("http://{}/metrics", control.admin_addr)).send().await?.text().await?;
    assert!(metrics.contains("continuum_dynamo_discovery_connected 1"), "{metrics}");
    assert!(metrics.contains("continuum_admin_unauthenticated_total 2"), "both refusals counted: {metrics}");
    assert!(metrics.contains("continuum_dynamo_discovery_events_total{kind=\"resync\"}"), "{metrics}");
    assert!(metrics.contains("continuum_dynamo_workers{role=\"decode\"} 1"), "{metrics}");
    assert!(metrics.contains("continuum_dynamo_workers{role=\"prefill\"} 0"), "{metrics}");
    let generation = continuum_tests::sample(&metrics, "continuum_dynamo_registry_generation");
    assert!(generation.is_some_and(|g| g >= 1.0), "a registry generation was published: {metrics}");
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_is_not_ready_until_discovery_has_seeded() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut etcd = Etcd::start(dir.path(), &[]).await?;
    etcd.kill().await?;
    let control = control_plane(&etcd).await?;
    let readyz = format!("http://{}/readyz", control.admin_addr);
    assert_eq!(reqwest::get(&readyz).await?.status(), 503, "no etcd, no first view");
    etcd.restart().await?;
    eventually(CONVERGE, "readiness after the first resync", || async {
        reqwest::get(&readyz).await.is_ok_and(|r| r.status() == 200)
    })
    .await?;
    control.shutdown().await;
    Ok(())
}

/// The harness itself: an etcd that exits before answering is reported at once, with the end
/// of its log, instead of being probed until a deadline passes.
#[tokio::test]
async fn an_etcd_that_exits_at_start_is_reported_at_once_with_its_log() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let error = Etcd::start(dir.path(), &["--no-such-flag"]).await.expect_err("etcd refuses an unknown flag");
    let message = error.to_string();
    // Only the exit path says so: a probe that ran out its deadline would say it timed out.
    assert!(message.contains("exited"), "{message}");
    assert!(message.lines().count() > 1, "the log's last lines follow: {message}");
    Ok(())
}
