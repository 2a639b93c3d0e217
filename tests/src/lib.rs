//! Shared helpers for the integration tests and benchmarks: an in-process control plane on a
//! loopback port, data-plane replicas following it, and waiting on explicit conditions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_control_plane::fleet::FleetPublisher;
use continuum_control_plane::grpc::{self, FleetService, Replicas};
use continuum_control_plane::listen::Guard;
use continuum_control_plane::metrics::Metrics;
use continuum_data_plane::fleet::FleetClientConfig;
use continuum_data_plane::replica::Replica;
use continuum_proto::model::{Capacity, DataPlaneConfig, Role, Worker, WorkerKey};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub mod bench;
pub mod dynamo;
pub mod dynamo_kv;
pub mod dynamo_load;
pub mod dynamo_routing;
pub mod etcd;
pub mod load;
pub mod netns;
pub mod nginx;
pub mod pki;
pub mod placement;
pub mod process;
pub mod proxy;
pub mod relay;
pub mod shim_stub;
pub mod tools;
pub mod wire_tap;
pub mod workload;
pub mod zmtp_peer;

/// A Fleet gRPC server on a loopback port, serving `publisher`.
#[derive(Debug)]
pub struct TestControlPlane {
    pub addr: SocketAddr,
    pub publisher: FleetPublisher,
    pub replicas: Replicas,
    pub metrics: Metrics,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl TestControlPlane {
    /// Serves on a fresh port.
    pub async fn start(publisher: FleetPublisher) -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1:0", publisher).await
    }

    /// Serves on `addr` (to restart on the port replicas already follow).
    pub async fn start_on(addr: &str, publisher: FleetPublisher) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (replicas, metrics, cancel) = (Replicas::default(), Metrics::new()?, CancellationToken::new());
        let service = FleetService::new(publisher.clone(), replicas.clone(), metrics.clone(), cancel.clone());
        let (shutdown, guard) = (cancel.clone(), Guard::fleet(&metrics));
        let task = tokio::spawn(async move {
            if let Err(error) = grpc::serve((listener, guard), service, None, shutdown).await {
                tracing::error!(%error, "test control plane failed");
            }
        });
        Ok(Self { addr, publisher, replicas, metrics, cancel, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Ends every stream and stops serving.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// Starts `n` replicas following `url`, each on its own loopback port.
pub async fn start_replicas(n: usize, url: &str) -> anyhow::Result<Vec<Replica>> {
    let mut replicas = Vec::with_capacity(n);
    for i in 0..n {
        let config = FleetClientConfig::new(url.to_string(), format!("replica-{i}"));
        replicas.push(Replica::start("127.0.0.1:0", config).await?);
    }
    Ok(replicas)
}

/// Waits until every replica holds `version`, following their change notifications.
pub async fn wait_for_version(replicas: &[Replica], version: u64, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    for replica in replicas {
        let mut changes = replica.fleet.subscribe();
        while replica.fleet.view().is_none_or(|v| v.version() != version) {
            let left = deadline.saturating_duration_since(Instant::now());
            let held = replica.fleet.view().map(|v| v.version());
            tokio::time::timeout(left, changes.changed())
                .await
                .map_err(|_| anyhow::anyhow!("replica at {held:?}, not at version {version}, after {timeout:?}"))??;
        }
    }
    Ok(())
}

/// Waits until every replica's view holds `key`.
pub async fn wait_until_worker(replicas: &[Replica], key: &WorkerKey, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    for replica in replicas {
        let mut changes = replica.fleet.subscribe();
        while replica.fleet.view().is_none_or(|v| v.worker(key).is_none()) {
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::timeout(left, changes.changed())
                .await
                .map_err(|_| anyhow::anyhow!("replica does not hold worker {key} after {timeout:?}"))??;
        }
    }
    Ok(())
}

/// Polls `condition` every 10 ms until it holds or `timeout` passes; for conditions that
/// have no notification to follow (an HTTP endpoint, a child process).
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !condition().await {
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The value of one sample line of a Prometheus text exposition: `series` is the metric name
/// with its labels as exported (`name{label="value"}`).
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A publisher with an empty fleet and a default data-plane configuration.
pub fn publisher() -> FleetPublisher {
    FleetPublisher::new(Arc::new(DataPlaneConfig::default()))
}

/// A plausible worker: roles and dp sizes vary with the id.
pub fn worker(namespace: &str, id: u64, model: &str) -> Arc<Worker> {
    let role = [Role::Prefill, Role::Decode, Role::Aggregated][usize::try_from(id % 3).unwrap_or(0)];
    Arc::new(Worker {
        key: WorkerKey::new(namespace, id),
        role,
        model: model.to_string(),
        component: if role == Role::Prefill { "prefill" } else { "backend" }.to_string(),
        endpoint: "generate".to_string(),
        block_size: Some(16),
        capacity: Capacity {
            total_kv_blocks: Some(1024 + id % 7),
            max_num_batched_tokens: Some(8192),
            max_num_seqs: Some(256),
            context_length: None,
        },
        dp_start_rank: 0,
        dp_size: u32::try_from(id % 3).unwrap_or(0),
        disaggregated_endpoint: None,
        artifacts: None,
    })
}
