//! The control plane's one YAML configuration file: its typed form, loading (environment
//! substitution, typed parsing that reports every type error and unknown key, validation by
//! the product's rules), the views handed to the rest of the control plane and the data
//! plane, and the masked readback.
//!
//! A configuration is loaded whole and immutable; a reload loads a new one and the caller
//! swaps it in.

mod data_plane;
mod diagnostic;
mod discovery;
mod event_bus;
mod load;
mod parse;
mod path;
mod show;
mod signals;
mod simulator;
mod substitute;
mod types;
mod unknown_keys;
mod validate;
mod values;

#[cfg(test)]
mod tests;

pub use diagnostic::{ConfigError, Diagnostic, Severity};
pub use discovery::{
    BackoffConfig, DEFAULT_DYNAMO_NAMESPACE, DiscoveryConfig, DiscoverySource, EtcdAuthConfig, EtcdConfig,
    EtcdTlsConfig, KubernetesConfig, KubernetesModelConfig, StaticDiscoveryConfig, StaticWorkerConfig, WorkerRole,
};
pub use event_bus::{BrokerConfig, BrokerRole, EventBusConfig};
#[cfg(test)]
pub use load::embedded_default_yaml;
pub use load::{Loaded, embedded_default, load_file, load_str};
pub use signals::{
    ConditionalDisaggregationConfig, DEFAULT_PROVISIONAL_TTL, KvConfig, LoadConfig, LoadTransport, ShimConfig,
    ShimPoolConfig,
};
pub use simulator::SimulatorConfig;
pub use types::{
    AdminConfig, BackendConfig, BackendRole, Config, ControlPlaneConfig, DisaggregatedServingConfig, DynamoConfig,
    ListenerTlsConfig,
};
pub use validate::{
    MAX_DIRECT_ALLOW_CIDRS, MAX_DYNAMO_NAMESPACES, MAX_ETCD_ENDPOINTS, MAX_KUBERNETES_MODELS, MAX_MAX_STALENESS,
    MAX_MODEL_MAP_ENTRIES, MAX_PROVISIONAL_TTL, MAX_SHIM_BACKENDS, MAX_SIMULATED_WORKERS, MAX_STATIC_WORKERS,
    MIN_MAX_STALENESS, MIN_SESSION_BUFFER_BYTES_PER_STREAM,
};
pub use values::{Cidr, MASK, Secret, parse_hex_instance_id};
