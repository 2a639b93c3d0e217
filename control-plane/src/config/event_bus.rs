//! `dynamo.event_bus`: the inbound HTTP/2-over-TLS listener that in-cluster event brokers and
//! KV listeners dial out to, their credentials and the per-session limits.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::types::ListenerTlsConfig;
use super::values::duration;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventBusConfig {
    pub enabled: bool,
    pub listen: SocketAddr,
    pub tls: ListenerTlsConfig,
    pub brokers: Vec<BrokerConfig>,
    pub max_sessions: u32,
    pub max_streams_per_session: u32,
    pub max_session_buffer_bytes: u64,
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
}

impl Default for EventBusConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7443),
            tls: ListenerTlsConfig::default(),
            brokers: Vec::new(),
            max_sessions: 64,
            max_streams_per_session: 1024,
            max_session_buffer_bytes: 64 * 1024 * 1024,
            heartbeat_interval: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

/// One credential that may open sessions: an event broker or a KV listener.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BrokerConfig {
    /// Also the DNS SAN a client certificate must carry.
    pub id: String,
    pub role: BrokerRole,
    /// `sha256:<64 lowercase hex>` of the bearer token; never the token itself.
    pub token_hash: Option<String>,
    /// Dynamo namespaces a broker may cover; empty allows any.
    pub namespaces: Vec<String>,
    /// Backends a KV listener is granted.
    pub backends: Vec<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokerRole {
    #[default]
    Broker,
    KvListener,
}
