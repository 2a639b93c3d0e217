//! A load supervisor under test: a registry the test publishes fleets into, the supervisor
//! following it with short timings, and fleets of workers and kv_metrics publishers built from
//! [`RawPublisher`](crate::zmtp_peer::RawPublisher) addresses.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use continuum_control_plane::config::LoadConfig;
use continuum_control_plane::discovery::{DiscoveredWorker, Fleet, Publisher, PublisherKey, Topic};
use continuum_control_plane::fleet::FleetPublisher;
use continuum_control_plane::load::zmtp::ZmtpLimits;
use continuum_control_plane::load::{LoadOptions, LoadSupervisor, LoadView, SubscriptionStatus};
use continuum_control_plane::metrics::Metrics;
use continuum_control_plane::sources::Registry;
use continuum_proto::model::{Capacity, Role, Worker, WorkerKey};
use tokio_util::sync::CancellationToken;

pub const NAMESPACE: &str = "dynamo";

/// Timings short enough for tests: reconnects within 100 ms. The handshake deadline is 5 s:
/// a peer on a machine loaded by the other tests may take longer than a shorter one, which
/// would count as a transport refusal.
pub fn test_options() -> LoadOptions {
    LoadOptions {
        limits: ZmtpLimits { handshake_timeout: Duration::from_secs(5), ..ZmtpLimits::KV_METRICS },
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
        ..LoadOptions::default()
    }
}

/// Dialling only loopback, as the real-fleet tests do.
pub fn loopback_config() -> LoadConfig {
    LoadConfig { direct_allow_cidrs: Some(vec!["127.0.0.0/8".into()]), ..LoadConfig::default() }
}

#[derive(Debug)]
pub struct TestLoad {
    pub registry: Registry,
    pub publisher: FleetPublisher,
    pub metrics: Metrics,
    pub supervisor: LoadSupervisor,
    pub view: LoadView,
    cancel: CancellationToken,
}

impl TestLoad {
    pub fn start(config: &LoadConfig, options: LoadOptions) -> anyhow::Result<Self> {
        let publisher = crate::publisher();
        let registry = Registry::new(publisher.clone());
        let metrics = Metrics::new()?;
        let cancel = CancellationToken::new();
        let supervisor =
            LoadSupervisor::start(config, options, registry.subscribe(), publisher.clone(), &metrics, cancel.clone());
        let view = supervisor.view();
        Ok(Self { registry, publisher, metrics, supervisor, view, cancel })
    }

    /// `continuum_dynamo_load_events_total{result}`.
    pub fn events(&self, result: &str) -> u64 {
        self.metrics.load_events.with_label_values(&[result]).get()
    }

    pub fn subscription(&self, publisher_id: u64) -> Option<Arc<SubscriptionStatus>> {
        self.view.subscriptions().iter().find(|s| s.publisher.publisher_id == publisher_id).cloned()
    }

    pub async fn stop(mut self) {
        self.supervisor.stop().await;
        self.cancel.cancel();
    }
}

/// A routable decode worker serving `dp_size` ranks (1 when 0).
pub fn worker(id: u64, dp_size: u32) -> DiscoveredWorker {
    DiscoveredWorker {
        worker: Worker {
            key: WorkerKey::new(NAMESPACE, id),
            role: Role::Decode,
            model: "tiny".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            block_size: Some(16),
            capacity: Capacity { total_kv_blocks: Some(1024), ..Capacity::default() },
            dp_start_rank: 0,
            dp_size,
            disaggregated_endpoint: None,
            artifacts: None,
        },
        first_seen: SystemTime::UNIX_EPOCH,
        last_updated: SystemTime::UNIX_EPOCH,
        card: None,
        excluded: None,
    }
}

/// The kv_metrics channel of `worker`, published at `address`.
pub fn kv_metrics_publisher(publisher_id: u64, worker: u64, address: String) -> Publisher {
    Publisher {
        publisher_id,
        namespace: NAMESPACE.into(),
        component: Some("backend".into()),
        endpoint: Some("generate".into()),
        topic: Topic::KvMetrics,
        worker: Some(WorkerKey::new(NAMESPACE, worker)),
        dp_rank: None,
        address,
    }
}

/// A fleet of `workers` and `publishers`, keyed as discovery keys them.
pub fn fleet(workers: Vec<DiscoveredWorker>, publishers: Vec<Publisher>) -> Fleet {
    Fleet {
        workers: workers.into_iter().map(|w| (w.worker.key.clone(), w)).collect(),
        publishers: publishers
            .into_iter()
            .map(|p| (PublisherKey { namespace: p.namespace.clone(), publisher_id: p.publisher_id }, p))
            .collect(),
    }
}
