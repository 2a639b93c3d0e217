//! A real etcd (Debian's `etcd-server`) on free loopback ports, for discovery tests: plaintext
//! or https with client certificates, driven by `etcd_client` or `etcdctl`. The test itself
//! plays the Dynamo workers' part and writes records; the router only reads.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use tokio::process::{Child, Command};

use crate::pki::Pki;
use crate::process::free_port;

/// A running etcd member; killed when dropped. Its log is `etcd.log` beside its data.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    pub client_url: String,
    peer_url: String,
    metrics_url: String,
    data_dir: PathBuf,
    log: PathBuf,
    extra: Vec<String>,
    tls: Option<Pki>,
}

impl Etcd {
    /// Starts a single-member cluster in `dir` with extra flags (e.g. `--max-request-bytes`).
    pub async fn start(dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with(dir, extra, None).await
    }

    /// Starts a member that serves clients only over https and requires a client certificate
    /// signed by `pki`'s CA (`--client-cert-auth`).
    pub async fn start_tls(dir: &Path, pki: &Pki, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with(dir, extra, Some(pki.clone())).await
    }

    async fn start_with(dir: &Path, extra: &[&str], tls: Option<Pki>) -> anyhow::Result<Self> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut etcd = Self {
            child: None,
            client_url: String::new(),
            peer_url: String::new(),
            metrics_url: String::new(),
            data_dir: dir.join("etcd-data"),
            log: dir.join("etcd.log"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            tls,
        };
        // A port found free can be taken by a parallel test before etcd binds it; etcd then
        // exits at once, and a first start tries fresh ports (and fresh data, which would
        // remember the old peer address) up to three more times.
        let mut attempts = 0;
        loop {
            etcd.client_url = format!("{scheme}://{}", free_port()?);
            etcd.peer_url = format!("http://{}", free_port()?);
            etcd.metrics_url = format!("http://{}", free_port()?);
            match etcd.spawn().await {
                Err(e) if attempts < 3 && e.to_string().contains("address already in use") => {
                    attempts += 1;
                    let _ = std::fs::remove_dir_all(&etcd.data_dir);
                }
                outcome => return outcome.map(|()| etcd),
            }
        }
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let log_start = log.metadata()?.len();
        let mut command = Command::new("etcd");
        command
            .args(["--name", "continuum-test", "--data-dir"])
            .arg(&self.data_dir)
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url, "--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", &format!("continuum-test={}", self.peer_url)])
            .args(["--listen-metrics-urls", &self.metrics_url]);
        if let Some(pki) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&pki.server_cert)
                .arg("--key-file")
                .arg(&pki.server_key)
                .arg("--trusted-ca-file")
                .arg(&pki.ca_cert)
                .arg("--client-cert-auth");
        }
        let mut child = command
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start etcd (run scripts/test to install etcd-server): {e}"))?;
        let options = self.connect_options()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait()? {
                let log = std::fs::read(&self.log).unwrap_or_default();
                let ours = String::from_utf8_lossy(log.get(log_start as usize..).unwrap_or_default()).into_owned();
                let lines: Vec<&str> = ours.lines().collect();
                let tail = lines[lines.len().saturating_sub(5)..].join("\n");
                anyhow::bail!("etcd exited ({status}) before answering; its log ends:\n{tail}");
            }
            let answered = match etcd_client::Client::connect([self.client_url.as_str()], options.clone()).await {
                Ok(mut client) => client.get("health-probe", None).await.is_ok(),
                Err(_) => false,
            };
            if answered {
                self.child = Some(child);
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "etcd did not answer on {} within 30s", self.client_url);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A client with full access (before `auth enable`), over TLS when the member serves it.
    pub async fn client(&self) -> anyhow::Result<etcd_client::Client> {
        Ok(etcd_client::Client::connect([self.client_url.as_str()], self.connect_options()?).await?)
    }

    /// A client authenticated as `user`.
    pub async fn client_as(&self, user: &str, password: &str) -> anyhow::Result<etcd_client::Client> {
        let options = self.connect_options()?.unwrap_or_default().with_user(user, password);
        Ok(etcd_client::Client::connect([self.client_url.as_str()], Some(options)).await?)
    }

    fn connect_options(&self) -> anyhow::Result<Option<ConnectOptions>> {
        let Some(pki) = &self.tls else { return Ok(None) };
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(std::fs::read(&pki.ca_cert)?))
            .identity(Identity::from_pem(std::fs::read(&pki.client_cert)?, std::fs::read(&pki.client_key)?))
            .domain_name("localhost");
        Ok(Some(ConnectOptions::new().with_tls(tls)))
    }

    /// The client listener's address, for a proxy in front of it.
    pub fn client_addr(&self) -> anyhow::Result<SocketAddr> {
        let authority = self.client_url.split_once("://").map_or(self.client_url.as_str(), |(_, rest)| rest);
        Ok(authority.parse()?)
    }

    /// Runs `etcdctl` (API v3) against this member and returns its stdout.
    pub async fn ctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut command = Command::new("etcdctl");
        command.env("ETCDCTL_API", "3").arg(format!("--endpoints={}", self.client_url));
        if let Some(pki) = &self.tls {
            command
                .arg("--cacert")
                .arg(&pki.ca_cert)
                .arg("--cert")
                .arg(&pki.client_cert)
                .arg("--key")
                .arg(&pki.client_key);
        }
        let output = command.args(args).kill_on_drop(true).output().await?;
        anyhow::ensure!(
            output.status.success(),
            "etcdctl {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// The value of one sample on etcd's metrics listener, named exactly as exported: the
    /// metric name followed by its labels, if it has any.
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let text = reqwest::get(format!("{}/metrics", self.metrics_url)).await?.error_for_status()?.text().await?;
        let value = text
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .ok_or_else(|| anyhow::anyhow!("etcd exports no metric {name}"))?;
        Ok(value.trim().parse()?)
    }

    /// SIGKILL, then start again on the same ports and data. The ports were picked free but
    /// released for etcd to bind, so while it is down another test's connection may take one
    /// as its ephemeral port; the start is retried until that connection lets go (5 s at most).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.spawn().await {
                Err(e) if Instant::now() < deadline && e.to_string().contains("address already in use") => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                outcome => return outcome,
            }
        }
    }

    /// The member's process id while it runs, to signal it (`SIGSTOP` freezes it with its
    /// connections open).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
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

/// Lease-like instance ids above 2^53, as real workers have.
pub fn lease(i: u64) -> u64 {
    7_587_890_000_000_000 + i
}

/// Registers decode workers with the given ids in namespace `dynamo`, as the workers would.
pub async fn put_workers(client: &mut etcd_client::Client, ids: impl IntoIterator<Item = u64>) -> anyhow::Result<()> {
    for id in ids {
        for (key, value) in decode_worker_records("dynamo", id, "tiny") {
            client.put(key, value, None).await?;
        }
    }
    Ok(())
}

/// Deregisters a worker written by [`put_workers`].
pub async fn delete_worker(client: &mut etcd_client::Client, id: u64) -> anyhow::Result<()> {
    for (key, _) in decode_worker_records("dynamo", id, "tiny") {
        client.delete(key, None).await?;
    }
    Ok(())
}

/// A control-plane configuration that discovers namespace `dynamo` through etcd with the given
/// `dynamo.discovery.etcd` section (JSON is YAML), a fast reconnect backoff unless it sets one,
/// and every listener on a loopback port 0.
pub fn discovery_yaml(mut etcd: serde_json::Value) -> String {
    if let Some(section) = etcd.as_object_mut() {
        section.entry("watch_reconnect_backoff").or_insert(serde_json::json!({"initial": "100ms", "max": "1s"}));
    }
    format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd: {etcd}\n  load:\n    \
         direct_allow_cidrs: [\"127.0.0.0/8\"]\ncontrol_plane:\n  grpc_listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\n"
    )
}
