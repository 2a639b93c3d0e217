//! The real Dynamo 1.6.1 fleet inside a [`NetNs`]: etcd, `dynamo.mocker` workers started as
//! `tests/fixtures/dynamo-1.6.1/README.md` describes, the test's own watch on their etcd
//! records, and the real Continuum control plane and replicas that discover them.
//!
//! Ports are fixed: the namespace is private, so nothing else holds them, and they sit below
//! the ephemeral range the workers' own listeners are given.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::ChildStdout;
use tokio::sync::watch;

use crate::netns::NetNs;
use crate::{eventually, tools};

pub const ETCD_URL: &str = "http://127.0.0.1:2379";
const ETCD_PEER_URL: &str = "http://127.0.0.1:2380";
const ETCD_METRICS_URL: &str = "http://127.0.0.1:2381";
const CONTROL_PLANE_GRPC: &str = "127.0.0.1:7000";
const CONTROL_PLANE_ADMIN: &str = "127.0.0.1:7001";
const FIRST_REPLICA_PORT: u16 = 8001;
/// Generous: a cold start on a busy 2-core machine (the README measured about 1 s).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// A key outside `v1/`, which Dynamo and the control plane ignore: seeing it proves the
/// test's watch is live before any worker registers.
const WATCH_SENTINEL: &str = "continuum-test/watch-live";
/// Dynamo's namespace for every worker here.
pub const NAMESPACE: &str = "dynamo";

/// `etcdctl` against the namespace's etcd.
pub fn etcdctl(ns: &NetNs) -> Command {
    let mut command = ns.command("etcdctl");
    command.args(["--endpoints", ETCD_URL]);
    command
}

/// Starts a single-member etcd (the README's flags) and waits until it answers.
pub async fn start_etcd(ns: &NetNs) -> anyhow::Result<()> {
    let mut command = ns.command("etcd");
    command.args(["--name", "continuum-test", "--data-dir"]).arg(ns.dir().join("etcd-data"));
    command.args(["--listen-client-urls", ETCD_URL, "--advertise-client-urls", ETCD_URL]);
    command.args(["--listen-peer-urls", ETCD_PEER_URL, "--initial-advertise-peer-urls", ETCD_PEER_URL]);
    command.args(["--initial-cluster", &format!("continuum-test={ETCD_PEER_URL}")]);
    command.args(["--listen-metrics-urls", ETCD_METRICS_URL]);
    let pid = ns.spawn("etcd", command)?;
    eventually(START_TIMEOUT, "etcd in the namespace to answer", || async {
        let mut health = etcdctl(ns);
        health.args(["endpoint", "health"]);
        ns.run(health).await.is_ok() || ns.exited(pid).is_ok_and(|s| s.is_some())
    })
    .await?;
    if ns.exited(pid)?.is_some() {
        bail!("etcd exited at start (run scripts/test to install etcd-server):\n{}", ns.log_tail("etcd"));
    }
    Ok(())
}

/// The environment every Dynamo process of the namespace runs with (the README's): etcd
/// discovery, the TCP request plane and the ZMQ event plane, all on loopback, offline.
pub fn dynamo_env(command: &mut Command) {
    let host = "127.0.0.1";
    command.envs([
        ("ETCD_ENDPOINTS", ETCD_URL),
        ("DYN_NAMESPACE", NAMESPACE),
        ("DYN_DISCOVERY_BACKEND", "etcd"),
        ("DYN_REQUEST_PLANE", "tcp"),
        ("DYN_EVENT_PLANE", "zmq"),
        ("DYN_TCP_RPC_HOST", host),
        ("DYN_TCP_RESPONSE_STREAM_HOST", host),
        ("DYN_EVENT_PLANE_HOST", host),
        ("DYN_SYSTEM_HOST", host),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
    ]);
}

/// A `dynamo.mocker` worker's disaggregation mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Prefill,
    Decode,
    Aggregated,
}

impl Mode {
    /// The `--disaggregation-mode` value.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Aggregated => "agg",
        }
    }
}

/// One `python -m dynamo.mocker` process.
#[derive(Debug, Clone, Copy)]
pub struct Mocker {
    pub mode: Mode,
    /// `--num-gpu-blocks-override`.
    pub kv_blocks: u64,
    /// `--data-parallel-size`.
    pub dp_size: u32,
}

/// A started mocker with the `generate` instance it registered.
#[derive(Debug, Clone)]
pub struct Worker {
    pub pid: u32,
    pub label: String,
    pub mocker: Mocker,
    pub instance: Instance,
}

impl Mocker {
    fn command(&self, ns: &NetNs, extra: &[&str]) -> Command {
        let mut command = ns.command(tools::python());
        command.args(["-m", "dynamo.mocker", "--model-path"]).arg(tools::dynamo_fixtures().join("tinymodel"));
        // Without --kv-bytes-per-token the mocker imports `transformers` to compute it.
        command.args(["--model-name", "tiny", "--kv-bytes-per-token", "4096", "--block-size", "16"]);
        command.args(["--disaggregation-mode", self.mode.flag()]);
        command.args(["--num-gpu-blocks-override", &self.kv_blocks.to_string()]);
        command.args(["--data-parallel-size", &self.dp_size.to_string()]);
        // No simulated engine time: the workers stay idle here, and the test measures discovery.
        command.args(["--speedup-ratio", "0"]);
        // argparse keeps an option's last value, so these override the defaults above.
        command.args(extra);
        dynamo_env(&mut command);
        command
    }

    /// Starts the worker and waits for its `generate` instance in `watch`. Start mockers one at
    /// a time: the next instance the watch sees is taken to be this one's.
    pub async fn start(self, ns: &NetNs, watch: &InstanceWatch, label: &str) -> anyhow::Result<Worker> {
        self.start_with(ns, watch, label, &[]).await
    }

    /// [`Mocker::start`] with extra mocker arguments (`--speedup-ratio 1.0` to simulate the
    /// engine's timing), which override this harness's defaults.
    pub async fn start_with(
        self,
        ns: &NetNs,
        watch: &InstanceWatch,
        label: &str,
        extra: &[&str],
    ) -> anyhow::Result<Worker> {
        let before = watch.count();
        let pid = ns.spawn(label, self.command(ns, extra))?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(instance) = watch.wait_nth(before, Duration::from_millis(100)).await {
                return Ok(Worker { pid, label: label.to_string(), mocker: self, instance });
            }
            if let Some(status) = ns.exited(pid)? {
                bail!("{label} exited ({status}) before registering:\n{}", ns.log_tail(label));
            }
            if Instant::now() >= deadline {
                bail!("{label} registered nothing within {START_TIMEOUT:?}:\n{}", ns.log_tail(label));
            }
        }
    }
}

/// A worker's `v1/instances/{ns}/{component}/generate/{lease hex}` record as the test's own
/// etcd watch saw it come and go.
#[derive(Debug, Clone)]
pub struct Instance {
    pub component: String,
    /// The record's decimal `instance_id` (Dynamo's worker id, equal to its lease id).
    pub instance_id: u64,
    /// The key's last segment: the same id in hex.
    pub key_hex: String,
    pub put_at: Instant,
    pub deleted_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct Seen {
    live: bool,
    instances: Vec<Instance>,
}

/// `etcdctl watch` on the whole keyspace inside the namespace, timestamping each `generate`
/// instance's PUT and DELETE as they reach this test (and so, within the same moment, the
/// control plane's own watch).
#[derive(Debug)]
pub struct InstanceWatch {
    seen: watch::Receiver<Seen>,
}

impl InstanceWatch {
    /// Starts the watch and returns once it is live.
    pub async fn start(ns: &NetNs) -> anyhow::Result<Self> {
        let mut command = etcdctl(ns);
        command.args(["watch", "--prefix", ""]);
        let (_, stdout) = ns.spawn_reading("etcd-watch", command)?;
        let (sender, seen) = watch::channel(Seen::default());
        tokio::spawn(follow(stdout, sender));
        let mut live = seen.clone();
        let deadline = Instant::now() + START_TIMEOUT;
        // Put until one is seen: a put that lands before the watch is established is missed.
        for attempt in 0u32.. {
            let mut put = etcdctl(ns);
            put.args(["put", WATCH_SENTINEL, &attempt.to_string()]);
            ns.run(put).await?;
            if tokio::time::timeout(Duration::from_millis(200), live.wait_for(|s| s.live)).await.is_ok() {
                break;
            }
            if Instant::now() >= deadline {
                bail!("the test's etcd watch saw nothing within {START_TIMEOUT:?}:\n{}", ns.log_tail("etcd-watch"));
            }
        }
        Ok(Self { seen })
    }

    /// How many `generate` instances have been put so far.
    pub fn count(&self) -> usize {
        self.seen.borrow().instances.len()
    }

    /// The instance with this id, as last seen.
    pub fn instance(&self, instance_id: u64) -> Option<Instance> {
        self.seen.borrow().instances.iter().find(|i| i.instance_id == instance_id).cloned()
    }

    /// Waits up to `timeout` for the `n`th instance (from 0) to be put.
    pub async fn wait_nth(&self, n: usize, timeout: Duration) -> Option<Instance> {
        let mut seen = self.seen.clone();
        let seen = tokio::time::timeout(timeout, seen.wait_for(|s| s.instances.len() > n)).await.ok()?.ok()?;
        seen.instances.get(n).cloned()
    }

    /// Waits up to `timeout` for the instance's record to be deleted; when it was.
    pub async fn wait_deleted(&self, instance_id: u64, timeout: Duration) -> anyhow::Result<Instant> {
        let mut seen = self.seen.clone();
        let deleted = |s: &Seen| s.instances.iter().find(|i| i.instance_id == instance_id).and_then(|i| i.deleted_at);
        let waited = tokio::time::timeout(timeout, seen.wait_for(|s| deleted(s).is_some())).await;
        let seen = waited.map_err(|_| anyhow!("instance {instance_id} still in etcd after {timeout:?}"))??;
        deleted(&seen).ok_or_else(|| anyhow!("instance {instance_id} vanished from the watch"))
    }
}

/// Reads `etcdctl watch`'s simple output: an event is three lines, the operation, the key and
/// the value (empty for a delete); every value here is single-line JSON.
async fn follow(stdout: ChildStdout, seen: watch::Sender<Seen>) {
    let mut lines = BufReader::new(stdout).lines();
    let mut event: Vec<String> = Vec::with_capacity(3);
    while let Ok(Some(line)) = lines.next_line().await {
        if event.is_empty() && line != "PUT" && line != "DELETE" {
            continue;
        }
        event.push(line);
        if let [op, key, value] = &event[..] {
            let at = Instant::now();
            seen.send_modify(|s| apply(s, op, key, value, at));
            event.clear();
        }
    }
}

fn apply(seen: &mut Seen, op: &str, key: &str, value: &str, at: Instant) {
    if key == WATCH_SENTINEL {
        seen.live = true;
        return;
    }
    let parts: Vec<&str> = key.split('/').collect();
    let ["v1", "instances", _, component, "generate", key_hex] = parts[..] else { return };
    let current = seen.instances.iter_mut().find(|i| i.key_hex == key_hex && i.deleted_at.is_none());
    match (op, current) {
        ("DELETE", Some(instance)) => instance.deleted_at = Some(at),
        ("PUT", None) => {
            let record: Value = serde_json::from_str(value).unwrap_or_default();
            let Some(instance_id) = record["instance_id"].as_u64() else { return };
            let component = component.to_string();
            seen.instances.push(Instance {
                component,
                instance_id,
                key_hex: key_hex.to_string(),
                put_at: at,
                deleted_at: None,
            });
        }
        _ => {}
    }
}

/// A replica started by [`Continuum::start`].
#[derive(Debug, Clone)]
pub struct Replica {
    pub id: String,
    pub url: String,
}

/// The real `continuum-control-plane`, discovering from the namespace's etcd, and its
/// `continuum-data-plane` replicas, all inside the namespace.
#[derive(Debug)]
pub struct Continuum {
    /// The control plane's admin HTTP base URL.
    pub admin: String,
    pub replicas: Vec<Replica>,
}

impl Continuum {
    /// Starts the control plane, waits until discovery has seeded it, then starts `replicas`
    /// replicas (`r1`, `r2`, …) and waits until each holds a fleet.
    pub async fn start(ns: &NetNs, replicas: u16) -> anyhow::Result<Self> {
        let config = ns.dir().join("control-plane.yaml");
        std::fs::write(&config, control_plane_yaml())?;
        let mut command = ns.command(tools::binary("continuum-control-plane"));
        command.arg("--config").arg(&config);
        let pid = ns.spawn("control-plane", command)?;
        let admin = format!("http://{CONTROL_PLANE_ADMIN}");
        wait_ready(ns, "control-plane", pid, &format!("{admin}/readyz")).await?;
        let mut started = Vec::new();
        for (n, port) in (1..=replicas).zip(FIRST_REPLICA_PORT..) {
            let (id, listen) = (format!("r{n}"), format!("127.0.0.1:{port}"));
            let mut command = ns.command(tools::binary("continuum-data-plane"));
            command.args(["--listen", &listen, "--control-plane", &format!("http://{CONTROL_PLANE_GRPC}")]);
            command.args(["--replica-id", &id]);
            let label = format!("replica-{id}");
            let pid = ns.spawn(&label, command)?;
            let url = format!("http://{listen}");
            wait_ready(ns, &label, pid, &format!("{url}/readyz")).await?;
            started.push(Replica { id, url });
        }
        Ok(Self { admin, replicas: started })
    }
}

fn control_plane_yaml() -> String {
    format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      endpoints: [\"{ETCD_URL}\"]\n  load:\n    \
         direct_allow_cidrs: [\"127.0.0.0/8\"]\ncontrol_plane:\n  grpc_listen: \"{CONTROL_PLANE_GRPC}\"\nadmin:\n  \
         listen: \"{CONTROL_PLANE_ADMIN}\"\n"
    )
}

/// Waits for `readyz` to answer 200, failing early with the log if the process exits.
async fn wait_ready(ns: &NetNs, label: &str, pid: u32, readyz: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !ns.get(readyz).await.is_ok_and(|(status, _)| status == 200) {
        if let Some(status) = ns.exited(pid)? {
            bail!("{label} exited ({status}) at start:\n{}", ns.log_tail(label));
        }
        if Instant::now() >= deadline {
            bail!("{label} not ready within {START_TIMEOUT:?}:\n{}", ns.log_tail(label));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
