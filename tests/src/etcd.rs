//! A real etcd (Debian's `etcd-server`) on free loopback ports, for discovery tests. The test
//! itself plays the Dynamo workers' part and writes records; the router only reads.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::eventually;
use crate::process::free_port;

/// A running etcd member; killed when dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    pub client_url: String,
    peer_url: String,
    data_dir: PathBuf,
    extra: Vec<String>,
}

impl Etcd {
    /// Starts a single-member cluster in `dir` with extra flags (e.g. `--max-request-bytes`).
    pub async fn start(dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        let mut etcd = Self {
            child: None,
            client_url: format!("http://{}", free_port()?),
            peer_url: format!("http://{}", free_port()?),
            data_dir: dir.join("etcd-data"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        etcd.spawn().await?;
        Ok(etcd)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let child = Command::new("etcd")
            .args(["--name", "continuum-test", "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url, "--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", &format!("continuum-test={}", self.peer_url)])
            .args(["--listen-metrics-urls", &format!("http://{}", free_port()?)])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start etcd (run scripts/test to install etcd-server): {e}"))?;
        self.child = Some(child);
        let url = self.client_url.clone();
        eventually(Duration::from_secs(20), "etcd to answer", || {
            let url = url.clone();
            async move {
                match etcd_client::Client::connect([url], None).await {
                    Ok(mut client) => client.get("health-probe", None).await.is_ok(),
                    Err(_) => false,
                }
            }
        })
        .await
    }

    pub async fn client(&self) -> anyhow::Result<etcd_client::Client> {
        Ok(etcd_client::Client::connect([self.client_url.as_str()], None).await?)
    }

    /// SIGKILL, then start again on the same ports and data.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await?;
        self.spawn().await
    }

    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }
}

/// The records a Dynamo 1.6.1 decode worker registers, shaped like the fixtures.
pub fn decode_worker_records(namespace: &str, lease: u64, model: &str) -> Vec<(String, String)> {
    let instance = serde_json::json!({
        "type": "Endpoint", "namespace": namespace, "component": "backend", "endpoint": "generate",
        "instance_id": lease, "transport": {"tcp": format!("127.0.0.1:1/{lease:x}/{namespace}/backend/generate")},
        "device_type": "cpu", "request_plane_codec": "msgpack",
    });
    let card = serde_json::json!({
        "type": "Model", "namespace": namespace, "component": "backend", "endpoint": "generate", "instance_id": lease,
        "card_json": {"display_name": model, "worker_type": "decode", "kv_cache_block_size": 16,
            "runtime_config": {"total_kv_blocks": 1024, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
                "data_parallel_size": 1, "data_parallel_start_rank": 0}},
    });
    vec![
        (format!("v1/mdc/{namespace}/backend/generate/{lease:x}"), card.to_string()),
        (format!("v1/instances/{namespace}/backend/generate/{lease:x}"), instance.to_string()),
    ]
}
