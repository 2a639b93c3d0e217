//! Load on the real Dynamo fleet of a [`NetNs`]: the real `dynamo.frontend --router-mode
//! direct` to send requests pinned to a worker rank (the mocker publishes kv_metrics only while
//! its load changes, so a test needs requests), and an independent pyzmq subscriber that records
//! every kv_metrics message the workers publish, to compare the control plane against.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::ChildStdout;

use crate::dynamo;
use crate::netns::NetNs;
use crate::tools;

const FRONTEND: &str = "127.0.0.1:8000";
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Starts the frontend and waits until it lists the model `tiny`; returns its base URL.
pub async fn start_frontend(ns: &NetNs) -> anyhow::Result<String> {
    let mut command = ns.command(tools::python());
    let (host, port) = FRONTEND.split_once(':').context("address")?;
    command.args(["-m", "dynamo.frontend", "--router-mode", "direct", "--http-host", host, "--http-port", port]);
    dynamo::dynamo_env(&mut command);
    let pid = ns.spawn("frontend", command)?;
    let url = format!("http://{FRONTEND}");
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok((200, body)) = ns.get(&format!("{url}/v1/models")).await
            && body.contains("\"tiny\"")
        {
            return Ok(url);
        }
        if let Some(status) = ns.exited(pid)? {
            bail!("the frontend exited ({status}):\n{}", ns.log_tail("frontend"));
        }
        if Instant::now() > deadline {
            bail!("the frontend did not list `tiny` within {START_TIMEOUT:?}:\n{}", ns.log_tail("frontend"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A chat completion pinned to `worker` rank `rank` through the frontend; its HTTP status.
pub async fn chat(
    ns: &NetNs,
    frontend: &str,
    worker: u64,
    rank: u32,
    words: usize,
    max_tokens: u32,
) -> anyhow::Result<u16> {
    let prompt: Vec<String> = (0..words).map(|i| format!("word{}", i % 97)).collect();
    let body = serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt.join(" ")}],
        "max_tokens": max_tokens,
        "stream": false,
    });
    let mut curl = ns.command("curl");
    curl.args(["-sS", "--max-time", "30", "-o", "/dev/null", "--write-out", "%{http_code}"]);
    curl.args(["-H", "content-type: application/json"]);
    curl.args(["-H", &format!("x-dynamo-worker-instance-id: {worker}"), "-H", &format!("x-dynamo-dp-rank: {rank}")]);
    curl.args(["--data", &body.to_string(), &format!("{frontend}/v1/chat/completions")]);
    Ok(ns.run(curl).await?.trim().parse()?)
}

/// The `tcp://` endpoints of every kv_metrics channel registered in the namespace's etcd.
pub async fn kv_metrics_endpoints(ns: &NetNs) -> anyhow::Result<Vec<String>> {
    crate::dynamo_kv::channel_endpoints(ns, "kv_metrics").await
}

/// One kv_metrics message as the tap decoded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tapped {
    pub publisher_id: u64,
    pub sequence: u64,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub kv_used_blocks: Option<u64>,
    pub at: Instant,
}

/// pyzmq SUB on every given endpoint, printing each kv_metrics message as a JSON line.
const TAP: &str = r#"
import json, sys, zmq, msgspec
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv_metrics")
connect_all(sub, sys.argv[1:])
print(json.dumps({"ready": True}), flush=True)
while True:
    frames = sub.recv_multipart()
    envelope = msgspec.msgpack.decode(frames[3][5:])
    load = msgspec.msgpack.decode(envelope["payload"])
    print(json.dumps({"publisher_id": envelope["publisher_id"], "sequence": envelope["sequence"],
                      "worker_id": load["worker_id"], "dp_rank": load.get("dp_rank") or 0,
                      "kv_used_blocks": load.get("kv_used_blocks")}), flush=True)
"#;

/// Every kv_metrics message the workers published since the tap started.
#[derive(Debug, Clone, Default)]
pub struct Tap {
    seen: Arc<Mutex<Vec<Tapped>>>,
}

impl Tap {
    /// Starts the tap on `endpoints` and returns once it is subscribed.
    pub async fn start(ns: &NetNs, endpoints: &[String]) -> anyhow::Result<Self> {
        let mut lines = start_tap(ns, "kv-metrics-tap", TAP, endpoints).await?;
        let tap = Self::default();
        let seen = Arc::clone(&tap.seen);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(m) = serde_json::from_str::<Value>(&line) else { continue };
                let tapped = Tapped {
                    publisher_id: m["publisher_id"].as_u64().unwrap_or_default(),
                    sequence: m["sequence"].as_u64().unwrap_or_default(),
                    worker_id: m["worker_id"].as_u64().unwrap_or_default(),
                    dp_rank: u32::try_from(m["dp_rank"].as_u64().unwrap_or_default()).unwrap_or_default(),
                    kv_used_blocks: m["kv_used_blocks"].as_u64(),
                    at: Instant::now(),
                };
                seen.lock().unwrap_or_else(PoisonError::into_inner).push(tapped);
            }
        });
        Ok(tap)
    }

    pub fn all(&self) -> Vec<Tapped> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The last message per (worker, rank).
    pub fn latest(&self) -> BTreeMap<(u64, u32), Tapped> {
        self.all().into_iter().map(|t| ((t.worker_id, t.dp_rank), t)).collect()
    }

    /// Waits until nothing new arrived for `quiet`, at most `timeout`.
    pub async fn settle(&self, quiet: Duration, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self.all().last().map(|t| t.at);
            if last.is_some_and(|at| at.elapsed() >= quiet) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("kv_metrics still flowing (or never flowed) after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Defines `connect_all(sub, endpoints)` for a tap: connects to every endpoint and returns once
/// each ZMTP handshake has succeeded, so the subscription, sent right after it, is on its way
/// when the tap says it is ready, however slow the machine (a PUB drops what it publishes
/// before a subscription arrives: an event the test waits for would never come).
const CONNECT_ALL: &str = r#"
def connect_all(sub, endpoints):
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for endpoint in endpoints:
        sub.connect(endpoint)
    done = set()
    while len(done) < len(set(endpoints)):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            done.add(event["endpoint"])
    sub.disable_monitor()
"#;

/// Starts the pyzmq tap `script` (it calls `connect_all`, prints `{"ready": true}` once
/// subscribed, then one JSON line per message) on `endpoints`, and returns its output lines
/// once it is subscribed.
pub(crate) async fn start_tap(
    ns: &NetNs,
    label: &str,
    script: &str,
    endpoints: &[String],
) -> anyhow::Result<Lines<BufReader<ChildStdout>>> {
    let mut command = ns.command(tools::python());
    command.arg("-c").arg(format!("{CONNECT_ALL}{script}")).args(endpoints);
    let (_, stdout) = ns.spawn_reading(label, command)?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(START_TIMEOUT, lines.next_line()).await;
    if !matches!(&ready, Ok(Ok(Some(line))) if line.contains("ready")) {
        bail!("the pyzmq tap did not start (run scripts/test to install pyzmq):\n{}", ns.log_tail(label));
    }
    // The subscription follows each handshake: give the PUBs a moment to read it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(lines)
}
