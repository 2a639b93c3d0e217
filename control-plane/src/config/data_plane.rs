//! Views derived from the configuration: the configured Dynamo namespaces and the part the
//! data plane needs (streamed to every replica).

use continuum_proto::model::{
    Backend, DataPlaneConfig, DisaggregatedServing, KvArtifactPolicy, PickerParams, ShimPool,
};

use super::Config;
use super::discovery::{DEFAULT_DYNAMO_NAMESPACE, DiscoverySource};
use super::types::{BackendConfig, BackendRole};

impl Config {
    /// The configured Dynamo namespaces, in order, without repeats: `namespaces` (or
    /// `dynamo_namespaces`) when set, else the single scalar; for the static source, the
    /// namespaces its workers name.
    pub fn namespaces(&self) -> Vec<String> {
        let discovery = &self.dynamo.discovery;
        let listed: Vec<&String> = match discovery.source {
            DiscoverySource::Etcd if discovery.etcd.namespaces.is_empty() => vec![&discovery.etcd.namespace],
            DiscoverySource::Etcd => discovery.etcd.namespaces.iter().collect(),
            DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods => {
                let kube = &discovery.kubernetes;
                if kube.dynamo_namespaces.is_empty() {
                    vec![&kube.dynamo_namespace]
                } else {
                    kube.dynamo_namespaces.iter().collect()
                }
            }
            DiscoverySource::Static => discovery.static_fleet.workers.iter().map(|w| &w.namespace).collect(),
            DiscoverySource::Simulator => vec![&discovery.simulator.namespace],
        };
        // Linear: a static fleet lists a namespace per worker, up to 16,384 of them.
        let mut seen = std::collections::HashSet::with_capacity(listed.len());
        listed.into_iter().filter(|namespace| seen.insert(namespace.as_str())).cloned().collect()
    }

    /// What the data-plane replicas are sent: dispatchable backends, shim pools, the model map,
    /// picker parameters and disaggregated serving.
    pub fn data_plane_config(&self) -> DataPlaneConfig {
        // A prefill or decode engine serves one phase: no plain request may go to it, so it is
        // offered only as a shim replica, where validation has warned about its role.
        let in_a_pool = |name: &str| {
            let shim = &self.dynamo.shim;
            shim.backends.iter().chain(shim.pools.iter().flat_map(|pool| &pool.backends)).any(|n| n == name)
        };
        let dispatchable: Vec<&BackendConfig> = self
            .backends
            .iter()
            .filter(|b| b.enabled && !b.internal && (b.role == BackendRole::Unified || in_a_pool(&b.name)))
            .collect();
        let backends = dispatchable
            .iter()
            .map(|b| Backend { name: b.name.clone(), url: b.url.clone(), models: b.models.clone() })
            .collect();
        // A replica the data plane was not given could never be dialled, so pools name only
        // dispatchable backends (validation has warned about the others).
        let usable = |names: &[String]| -> Vec<String> {
            names.iter().filter(|n| dispatchable.iter().any(|b| &b.name == *n)).cloned().collect()
        };
        let shim = &self.dynamo.shim;
        let shim_pools = if shim.pools.is_empty() {
            let replicas = usable(&shim.backends);
            let namespaces = match self.namespaces() {
                _ if replicas.is_empty() => Vec::new(),
                // A static fleet of no workers names no namespace: its shim backends are still a
                // pool's, never unified backends that plain requests would go to unpinned.
                namespaces if namespaces.is_empty() => vec![DEFAULT_DYNAMO_NAMESPACE.to_owned()],
                namespaces => namespaces,
            };
            namespaces.into_iter().map(|namespace| ShimPool { namespace, backends: replicas.clone() }).collect()
        } else {
            let pools = shim.pools.iter();
            pools.map(|p| ShimPool { namespace: p.namespace.clone(), backends: usable(&p.backends) }).collect()
        };
        let kv = &self.dynamo.kv;
        DataPlaneConfig {
            backends,
            shim_pools,
            model_map: shim.model_map.clone(),
            picker: self.picker_params(),
            disaggregated_serving: DisaggregatedServing {
                enabled: self.disaggregated_serving.enabled,
                fallback_to_unified: self.disaggregated_serving.fallback_to_unified,
            },
            kv_artifacts: KvArtifactPolicy {
                pinned: kv.pinned_artifacts.clone(),
                allow_http: kv.allow_http_artifacts,
                allow_hf: kv.allow_hf_artifacts,
                cache_dir: kv.artifact_cache_dir.display().to_string(),
            },
        }
    }

    fn picker_params(&self) -> PickerParams {
        let kv = &self.dynamo.kv;
        PickerParams {
            max_staleness: self.dynamo.load.max_staleness,
            // The KV term needs discovered publishers, so it is off whenever discovery is.
            kv_enabled: self.dynamo.enabled && kv.enabled,
            overlap_score_credit: kv.overlap_score_credit,
            prefill_load_scale: kv.prefill_load_scale,
            router_temperature: kv.router_temperature,
            send_token_data: kv.send_token_data,
            conditional_disaggregation: kv.conditional_disaggregation.enabled,
            decode_busy_threshold: kv.conditional_disaggregation.decode_busy_threshold,
        }
    }
}
