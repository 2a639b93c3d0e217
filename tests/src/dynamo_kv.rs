//! KV cache events of the real Dynamo fleet in a [`NetNs`]: an independent pyzmq subscriber
//! that records every `stored` and `removed` event the workers publish, to hold the router's
//! own rendering, hashing and index against.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;

use crate::dynamo::{self, NAMESPACE};
use crate::dynamo_load::start_tap;
use crate::netns::NetNs;
use crate::tools;

/// One kv-events event as the tap decoded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TappedEvent {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub event_id: u64,
    /// `Some(parent)` for a stored chain (`None` inside = root-anchored).
    pub stored_parent: Option<Option<u64>>,
    /// Stored blocks' `tokens_hash` values, in chain order.
    pub tokens_hashes: Vec<u64>,
    /// Stored blocks' `block_hash` values, or the removed ones.
    pub block_hashes: Vec<u64>,
}

/// pyzmq SUB on every given endpoint, printing each kv-events event as a JSON line.
const TAP: &str = r#"
import json, sys, zmq, msgspec
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
connect_all(sub, sys.argv[1:])
print(json.dumps({"ready": True}), flush=True)
while True:
    frames = sub.recv_multipart()
    envelope = msgspec.msgpack.decode(frames[3][5:])
    for e in msgspec.msgpack.decode(envelope["payload"]):
        event = e["event"]
        data = event["data"]
        out = {"worker_id": e["worker_id"], "dp_rank": event.get("dp_rank") or 0, "event_id": event["event_id"],
               "tier": e.get("storage_tier")}
        if isinstance(data, dict) and "stored" in data:
            out["parent"] = data["stored"].get("parent_hash")
            out["stored"] = [[b["tokens_hash"], b["block_hash"]] for b in data["stored"]["blocks"]]
        elif isinstance(data, dict) and "removed" in data:
            out["removed"] = data["removed"]["block_hashes"]
        print(json.dumps(out), flush=True)
"#;

/// Every kv-events event the workers published since the tap started.
#[derive(Debug, Clone, Default)]
pub struct KvTap {
    seen: Arc<Mutex<Vec<TappedEvent>>>,
}

impl KvTap {
    /// Starts the tap on `endpoints` and returns once it is subscribed.
    pub async fn start(ns: &NetNs, endpoints: &[String]) -> anyhow::Result<Self> {
        let mut lines = start_tap(ns, "kv-events-tap", TAP, endpoints).await?;
        let tap = Self::default();
        let seen = Arc::clone(&tap.seen);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(m) = serde_json::from_str::<Value>(&line) else { continue };
                let pairs = |key: &str, i: usize| -> Vec<u64> {
                    m[key].as_array().map(|a| a.iter().filter_map(|p| p[i].as_u64()).collect()).unwrap_or_default()
                };
                let stored = m.get("stored").is_some();
                let event = TappedEvent {
                    worker_id: m["worker_id"].as_u64().unwrap_or_default(),
                    dp_rank: u32::try_from(m["dp_rank"].as_u64().unwrap_or_default()).unwrap_or_default(),
                    event_id: m["event_id"].as_u64().unwrap_or_default(),
                    stored_parent: stored.then(|| m["parent"].as_u64()),
                    tokens_hashes: pairs("stored", 0),
                    block_hashes: if stored {
                        pairs("stored", 1)
                    } else {
                        m["removed"]
                            .as_array()
                            .map(|a| a.iter().filter_map(Value::as_u64).collect())
                            .unwrap_or_default()
                    },
                };
                seen.lock().unwrap_or_else(PoisonError::into_inner).push(event);
            }
        });
        Ok(tap)
    }

    pub fn all(&self) -> Vec<TappedEvent> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The `tokens_hash` chain stored by `worker` since the tap started, in publication order.
    pub fn stored_chain(&self, worker_id: u64) -> Vec<u64> {
        self.all().into_iter().filter(|e| e.worker_id == worker_id).flat_map(|e| e.tokens_hashes).collect()
    }

    /// Waits until `worker` has stored at least `blocks` blocks, at most `timeout`.
    pub async fn wait_stored(&self, worker_id: u64, blocks: usize, timeout: Duration) -> anyhow::Result<Vec<u64>> {
        let deadline = Instant::now() + timeout;
        loop {
            let chain = self.stored_chain(worker_id);
            if chain.len() >= blocks {
                return Ok(chain);
            }
            if Instant::now() > deadline {
                bail!("worker {worker_id} stored {} of {blocks} blocks within {timeout:?}", chain.len());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The `tcp://` endpoints of every channel of `topic` registered in the namespace's etcd.
pub async fn channel_endpoints(ns: &NetNs, topic: &str) -> anyhow::Result<Vec<String>> {
    let mut get = dynamo::etcdctl(ns);
    get.args(["get", "--prefix", &format!("v1/event_channels/namespace/{NAMESPACE}/"), "--print-value-only"]);
    let mut endpoints = Vec::new();
    for line in ns.run(get).await?.lines().filter(|l| !l.is_empty()) {
        let record: Value = serde_json::from_str(line)?;
        if record["topic"] == topic
            && let Some(endpoint) = record["transport"]["config"]["endpoint"].as_str()
        {
            endpoints.push(endpoint.to_string());
        }
    }
    Ok(endpoints)
}

/// The fixture model's `tokenizer.json` and `tokenizer_config.json`, pinned by content (the
/// checksums `dynamo.kv.pinned_artifacts` lists).
pub fn tinymodel_pins() -> anyhow::Result<Vec<String>> {
    ["tokenizer.json", "tokenizer_config.json"]
        .iter()
        .map(|f| {
            let bytes = std::fs::read(tools::dynamo_fixtures().join("tinymodel").join(f))?;
            Ok(continuum_data_plane::kv::artifacts::Checksum::of(&bytes).to_string())
        })
        .collect()
}

/// [`crate::dynamo_routing::control_plane_yaml`] with KV-aware selection on: the tiny model's
/// artifacts pinned, cached under `cache_dir`. `extra_kv` is more `dynamo.kv` settings, one
/// `key: value` a line.
pub fn kv_control_plane_yaml(cache_dir: &std::path::Path, extra_kv: &[&str]) -> anyhow::Result<String> {
    let pinned: Vec<String> = tinymodel_pins()?.into_iter().map(|p| format!("\"{p}\"")).collect();
    let mut kv = format!(
        "  kv:\n    enabled: true\n    artifact_cache_dir: \"{}\"\n    pinned_artifacts: [{}]\n",
        cache_dir.display(),
        pinned.join(", ")
    );
    for line in extra_kv {
        kv.push_str(&format!("    {line}\n"));
    }
    with_kv_section(&kv)
}

/// The routing tests' control-plane YAML with `kv` (a `  kv:` section, indented as under
/// `dynamo`) added: with `enabled` left out, it only sets the pickers' weights.
pub fn with_kv_section(kv: &str) -> anyhow::Result<String> {
    let base = crate::dynamo_routing::control_plane_yaml(false);
    let (head, rest) =
        base.split_once("  discovery:\n").ok_or_else(|| anyhow::anyhow!("the base YAML has no dynamo.discovery"))?;
    Ok(format!("{head}{kv}  discovery:\n{rest}"))
}
