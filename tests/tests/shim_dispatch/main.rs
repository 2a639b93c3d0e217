//! Shim dispatch through a real data-plane replica fed by an in-process control plane, against
//! stub shims on loopback ports: the pins that leave, what clients see for every answer the real
//! 1.6.1 frontend gives, SSE relay, retries and circuit breakers, and `/v1/models`.

mod drain;
mod failures;
mod health;
mod http1;
mod ingress;
mod pins;
mod streaming;

use std::sync::Arc;
use std::time::Duration;

use continuum_control_plane::fleet::FleetChange;
use continuum_data_plane::dispatch::DispatchSettings;
use continuum_data_plane::fleet::FleetClientConfig;
use continuum_data_plane::replica::Replica;
use continuum_proto::model::{
    Backend, Capacity, DataPlaneConfig, DisaggregatedServing, Role, ShimPool, Worker, WorkerKey,
};
use continuum_tests::{TestControlPlane, publisher, wait_for_version};
use serde_json::{Value, json};

/// The instance ids of the captured disaggregated fleet: both above 2^53.
pub const PREFILL_ID: u64 = 7_668_682_560_356_783_938;
pub const DECODE_ID: u64 = 7_668_682_560_356_783_952;
pub const NAMESPACE: &str = "dynamo";
/// The Dynamo display name the workers serve, and the client id the model map gives it.
pub const MODEL: &str = "tiny";
pub const CLIENT_MODEL: &str = "tiny-chat";
pub const CONVERGE: Duration = Duration::from_secs(20);

pub fn worker(id: u64, role: Role, model: &str, dp_size: u32) -> Arc<Worker> {
    Arc::new(Worker {
        key: WorkerKey::new(NAMESPACE, id),
        role,
        model: model.to_string(),
        component: if role == Role::Prefill { "prefill" } else { "backend" }.to_string(),
        endpoint: "generate".to_string(),
        block_size: Some(16),
        capacity: Capacity {
            total_kv_blocks: Some(1024),
            max_num_batched_tokens: Some(8192),
            max_num_seqs: Some(256),
            context_length: None,
        },
        dp_start_rank: 0,
        dp_size,
        disaggregated_endpoint: None,
        artifacts: None,
    })
}

/// One prefill and one decode worker serving [`MODEL`].
pub fn disaggregated_fleet() -> Vec<Arc<Worker>> {
    vec![worker(PREFILL_ID, Role::Prefill, MODEL, 0), worker(DECODE_ID, Role::Decode, MODEL, 0)]
}

/// Shim backends `(name, url)` forming [`NAMESPACE`]'s pool, with disaggregated serving on.
pub fn config(pool: &[(&str, String)]) -> DataPlaneConfig {
    let backends = pool.iter().map(|(name, url)| Backend { name: name.to_string(), url: url.clone(), models: vec![] });
    DataPlaneConfig {
        backends: backends.collect(),
        shim_pools: vec![ShimPool {
            namespace: NAMESPACE.into(),
            backends: pool.iter().map(|(n, _)| n.to_string()).collect(),
        }],
        model_map: [(CLIENT_MODEL.to_string(), MODEL.to_string())].into(),
        disaggregated_serving: DisaggregatedServing { enabled: true, fallback_to_unified: false },
        ..DataPlaneConfig::default()
    }
}

pub fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": stream, "max_tokens": 8})
}

/// A control plane serving one fleet and one replica following it.
#[derive(Debug)]
pub struct Harness {
    control: TestControlPlane,
    pub replica: Replica,
    pub http: reqwest::Client,
}

impl Harness {
    pub async fn start(workers: Vec<Arc<Worker>>, config: DataPlaneConfig) -> anyhow::Result<Self> {
        Self::start_with(workers, config, DispatchSettings::default()).await
    }

    pub async fn start_with(
        workers: Vec<Arc<Worker>>,
        config: DataPlaneConfig,
        settings: DispatchSettings,
    ) -> anyhow::Result<Self> {
        let control = TestControlPlane::start(publisher()).await?;
        control.publisher.apply(FleetChange {
            upsert: workers,
            config: Some(Arc::new(config)),
            ..FleetChange::default()
        });
        let follow = FleetClientConfig::new(control.url(), "shim-dispatch");
        let replica = Replica::start_with("127.0.0.1:0", follow, settings).await?;
        wait_for_version(std::slice::from_ref(&replica), control.publisher.current().version(), CONVERGE).await?;
        Ok(Self { control, replica, http: reqwest::Client::new() })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.replica.local_addr)
    }

    pub async fn post(&self, body: &Value) -> anyhow::Result<reqwest::Response> {
        Ok(self.http.post(self.url("/v1/chat/completions")).json(body).send().await?)
    }

    /// Applies a change to the fleet and waits until the replica holds it.
    pub async fn change(&self, change: FleetChange) -> anyhow::Result<()> {
        self.control.publisher.apply(change);
        wait_for_version(std::slice::from_ref(&self.replica), self.control.publisher.current().version(), CONVERGE)
            .await
    }

    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(self.http.get(self.url("/metrics")).send().await?.text().await?)
    }

    pub async fn stop(self) {
        self.replica.shutdown().await;
        self.control.stop().await;
    }
}

/// The status and the OpenAI error `code` of an error response, checking its shape.
pub async fn error_of(response: reqwest::Response) -> anyhow::Result<(u16, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    let error = &body["error"];
    anyhow::ensure!(error["message"].as_str().is_some_and(|m| m.len() > 20), "error without a useful message: {body}");
    anyhow::ensure!(error["type"].is_string(), "error without a type: {body}");
    let code = error["code"].as_str().ok_or_else(|| anyhow::anyhow!("error without a code: {body}"))?;
    Ok((status, code.to_string()))
}

pub use continuum_tests::sample;
