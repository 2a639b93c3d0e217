//! `dynamo.discovery`: which source lists the worker fleet (etcd, the Kubernetes metadata or
//! Pod sources, Continuum's static list or its simulated fleet) and how to reach it.

use std::path::PathBuf;
use std::time::Duration;

use continuum_proto::model::{Capacity, Role};
use serde::{Deserialize, Serialize};

use super::simulator::SimulatorConfig;
use super::values::{Secret, duration, instance_id};

/// Dynamo's `DYN_NAMESPACE` default.
pub const DEFAULT_DYNAMO_NAMESPACE: &str = "dynamo";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiscoveryConfig {
    pub source: DiscoverySource,
    pub etcd: EtcdConfig,
    pub kubernetes: KubernetesConfig,
    #[serde(rename = "static")]
    pub static_fleet: StaticDiscoveryConfig,
    pub simulator: SimulatorConfig,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoverySource {
    #[default]
    Etcd,
    Kubernetes,
    KubernetesPods,
    /// Continuum's own: a fixed list of workers, no external service.
    Static,
    /// Continuum's own: an embedded simulated fleet and shim, for the demo.
    Simulator,
}

impl DiscoverySource {
    /// The name as written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            DiscoverySource::Etcd => "etcd",
            DiscoverySource::Kubernetes => "kubernetes",
            DiscoverySource::KubernetesPods => "kubernetes_pods",
            DiscoverySource::Static => "static",
            DiscoverySource::Simulator => "simulator",
        }
    }
}

/// Bounded exponential backoff between discovery passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackoffConfig {
    #[serde(with = "duration")]
    pub initial: Duration,
    #[serde(with = "duration")]
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self { initial: Duration::from_millis(500), max: Duration::from_secs(30) }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub namespace: String,
    /// Several Dynamo graphs; exclusive with a non-default `namespace`.
    pub namespaces: Vec<String>,
    pub tls: Option<EtcdTlsConfig>,
    pub auth: Option<EtcdAuthConfig>,
    pub watch_reconnect_backoff: BackoffConfig,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            namespaces: Vec::new(),
            tls: None,
            auth: None,
            watch_reconnect_backoff: BackoffConfig::default(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EtcdTlsConfig {
    pub ca_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    /// A path, but masked in every readback as the product does.
    pub client_key: Option<Secret>,
    pub server_name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EtcdAuthConfig {
    pub username: String,
    pub password: Secret,
}

/// Shared by `source: kubernetes` (metadata) and `source: kubernetes_pods`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KubernetesConfig {
    /// The Kubernetes namespace of the fleet (a DNS-1123 label).
    pub namespace: String,
    /// The workers' `DYN_NAMESPACE` label value.
    pub dynamo_namespace: String,
    pub dynamo_namespaces: Vec<String>,
    /// `kubernetes_pods` only: the model every worker Pod serves.
    pub model: Option<String>,
    /// `kubernetes_pods` only: the model per `nvidia.com/dynamo-component`.
    pub models: Vec<KubernetesModelConfig>,
    pub watch_reconnect_backoff: BackoffConfig,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: String::new(),
            dynamo_namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            dynamo_namespaces: Vec::new(),
            model: None,
            models: Vec::new(),
            watch_reconnect_backoff: BackoffConfig::default(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KubernetesModelConfig {
    pub component: String,
    pub model: String,
    /// Required when several Dynamo namespaces are watched.
    pub dynamo_namespace: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StaticDiscoveryConfig {
    pub workers: Vec<StaticWorkerConfig>,
}

/// The roles a static worker may be given (the registry's `unknown` is not configurable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    Prefill,
    Decode,
    Aggregated,
}

impl From<WorkerRole> for Role {
    fn from(role: WorkerRole) -> Self {
        match role {
            WorkerRole::Prefill => Role::Prefill,
            WorkerRole::Decode => Role::Decode,
            WorkerRole::Aggregated => Role::Aggregated,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StaticWorkerConfig {
    pub namespace: String,
    #[serde(with = "instance_id")]
    pub instance_id: u64,
    /// Required; optional here only so the rest of the file can still be checked without it.
    pub role: Option<WorkerRole>,
    pub model: String,
    /// Defaults by role (see [`StaticWorkerConfig::component`]); filled in on load.
    pub component: Option<String>,
    pub endpoint: String,
    pub block_size: Option<u32>,
    pub dp_start_rank: u32,
    /// 0 means the worker declares no data parallelism.
    pub dp_size: u32,
    pub capacity: Capacity,
}

impl Default for StaticWorkerConfig {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            instance_id: 0,
            role: None,
            model: String::new(),
            component: None,
            endpoint: "generate".to_owned(),
            block_size: None,
            dp_start_rank: 0,
            dp_size: 0,
            capacity: Capacity::default(),
        }
    }
}

impl StaticWorkerConfig {
    /// The configured component, else Dynamo's conventional one for the role.
    pub fn component(&self) -> &str {
        match (&self.component, self.role) {
            (Some(component), _) => component,
            (None, Some(WorkerRole::Prefill)) => "prefill",
            (None, _) => "backend",
        }
    }
}
