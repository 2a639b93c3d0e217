//! The top level of the configuration file: the `dynamo` section, the OpenAI-wire `backends`
//! the shims are declared as, disaggregated serving, and Continuum's own listeners.
//!
//! Every struct defaults every field so that a document can be parsed around a bad value (the
//! loader reports all problems at once); required values are checked by `validate`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::discovery::DiscoveryConfig;
use super::event_bus::EventBusConfig;
use super::signals::{KvConfig, LoadConfig, ShimConfig};
use super::values::Secret;

/// The control plane's whole configuration file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub dynamo: DynamoConfig,
    pub backends: Vec<BackendConfig>,
    pub disaggregated_serving: DisaggregatedServingConfig,
    pub control_plane: ControlPlaneConfig,
    pub admin: AdminConfig,
}

/// `dynamo`: discovery of the worker fleet and what is done with it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DynamoConfig {
    /// Discovery is opt-in, as in the product: off unless set.
    pub enabled: bool,
    pub discovery: DiscoveryConfig,
    pub load: LoadConfig,
    pub shim: ShimConfig,
    pub kv: KvConfig,
    pub event_bus: EventBusConfig,
}

/// One OpenAI-wire backend; shim replicas (`dynamo.frontend --router-mode direct`) are these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendConfig {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub url: String,
    pub role: BackendRole,
    pub models: Vec<String>,
    /// Internal backends are never offered to the data plane.
    pub internal: bool,
    pub enabled: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            kind: "openai".to_owned(),
            url: String::new(),
            role: BackendRole::Unified,
            models: Vec::new(),
            internal: false,
            enabled: true,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendRole {
    #[default]
    Unified,
    Prefill,
    Decode,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DisaggregatedServingConfig {
    pub enabled: bool,
    pub fallback_to_unified: bool,
}

/// `control_plane`: where the data-plane replicas reach the Fleet gRPC service, and the bearer
/// token they must present there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControlPlaneConfig {
    pub grpc_listen: SocketAddr,
    pub token: Option<Secret>,
    /// Accepted beside `token` during a rotation, until every replica presents the new one.
    pub previous_token: Option<Secret>,
    /// The Fleet service over TLS; without it, plaintext HTTP/2 inside the cluster. Its files
    /// are read again as they change (see `grpc::tls`); turning it on or off needs a restart.
    pub tls: Option<ListenerTlsConfig>,
}

/// A TLS listener's (`control_plane.tls`, `dynamo.event_bus.tls`): its certificate, and the CA
/// whose certificates alone may connect (mutual TLS) when `client_ca` is set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ListenerTlsConfig {
    pub cert: Option<PathBuf>,
    /// A path to the listener's private key: masked in readbacks like etcd's `client_key`.
    pub key: Option<Secret>,
    pub client_ca: Option<PathBuf>,
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        let grpc_listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 50051);
        Self { grpc_listen, token: None, previous_token: None, tls: None }
    }
}

/// `admin`: the admin HTTP listener (`/admin/...`, `/metrics`) and its bearer token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub token: Option<Secret>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self { listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090), token: None }
    }
}
