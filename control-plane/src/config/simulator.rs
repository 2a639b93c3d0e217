//! `dynamo.discovery.simulator`: Continuum's embedded simulated fleet for the demo. Workers
//! publish real ZMTP kv_metrics frames on loopback and a direct-mode shim answers pinned
//! requests, so the whole router runs without etcd, Kubernetes or a GPU.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::discovery::DEFAULT_DYNAMO_NAMESPACE;
use super::values::duration;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimulatorConfig {
    /// The model every simulated worker serves (and the shim lists).
    pub model: String,
    pub namespace: String,
    /// How many prefill workers; 0 makes the decode workers aggregated.
    pub prefill: u32,
    pub decode: u32,
    pub block_size: u32,
    pub total_kv_blocks: u64,
    /// Where the simulated `dynamo.frontend --router-mode direct` shim listens; a backend in
    /// `backends` should point at it.
    pub shim_listen: SocketAddr,
    /// How long a killed worker stays registered, as a SIGKILLed Dynamo worker's etcd lease
    /// outlives it (30 s in the 1.6.1 captures).
    #[serde(with = "duration")]
    pub lease_ttl: Duration,
}

impl Default for SimulatorConfig {
    fn default() -> Self {
        Self {
            model: "tiny".to_owned(),
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            prefill: 2,
            decode: 2,
            block_size: 16,
            total_kv_blocks: 1024,
            shim_listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 8000)),
            lease_ttl: Duration::from_secs(30),
        }
    }
}

impl crate::config::Config {
    /// Moves the simulator's shim to `addr`, and every backend that pointed at the old address
    /// with it, so tests and demos can run the embedded default on a free port. A
    /// configuration that runs no simulator is left as it is: its backends at that address
    /// are real shims.
    pub fn move_simulator_shim(&mut self, addr: SocketAddr) {
        if self.dynamo.discovery.source != crate::config::DiscoverySource::Simulator {
            tracing::warn!(%addr, "the simulator's shim address is ignored: discovery is not the simulator");
            return;
        }
        let simulator = &mut self.dynamo.discovery.simulator;
        let old = format!("http://{}", simulator.shim_listen);
        simulator.shim_listen = addr;
        for backend in self.backends.iter_mut().filter(|b| b.url.trim_end_matches('/') == old) {
            backend.url = format!("http://{addr}");
        }
    }
}
