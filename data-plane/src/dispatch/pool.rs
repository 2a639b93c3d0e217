//! Which shim replicas may carry a request: a namespace's pool (`shim_pools` names backends,
//! `backends` gives their URLs), or for unpinned routing the backends that list the model.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use axum::http::Uri;
use continuum_proto::model::DataPlaneConfig;

use super::breaker::HealthSlot;

/// The OpenAI chat ingress every shim replica serves.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";

/// One dialable shim replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimReplica {
    /// The backend's configured name: the breaker key and the metric label. Never its URL,
    /// which is an internal address.
    pub name: String,
    /// The configured base URL, which the breaker watches for changes.
    pub url: String,
    /// The chat completions endpoint on it.
    pub endpoint: Uri,
    /// Its breaker and probe verdict, once a request has looked them up.
    pub health: HealthSlot,
}

impl ShimReplica {
    /// A replica named `name` at `url`, for tests that build no configuration.
    #[cfg(test)]
    pub(crate) fn for_tests(name: &str, url: &str) -> Self {
        let endpoint = format!("{url}{CHAT_COMPLETIONS_PATH}").parse().expect("a valid endpoint");
        Self { name: name.into(), url: url.into(), endpoint, health: HealthSlot::default() }
    }
}

/// The replicas of `namespace`'s pool that have a dialable URL, in configuration order.
fn namespace_pool(config: &DataPlaneConfig, namespace: &str) -> Vec<ShimReplica> {
    let Some(pool) = config.shim_pools.iter().find(|p| p.namespace == namespace) else {
        return Vec::new();
    };
    pool.backends.iter().filter_map(|name| replica(config, name)).collect()
}

/// Every namespace's pool, resolved (URLs parsed) once per configuration rather than per request.
/// Pools are shared (`Arc`), so a request holds its pool without copying it.
#[derive(Debug, Default)]
pub struct ShimPools {
    /// The pooled namespaces, in configuration order, parallel to `pools`.
    namespaces: Vec<String>,
    pools: Vec<Arc<[ShimReplica]>>,
}

impl ShimPools {
    pub fn resolve(config: &DataPlaneConfig) -> Self {
        let namespaces: Vec<String> = pooled_namespaces(config).map(str::to_string).collect();
        let pools = namespaces.iter().map(|ns| namespace_pool(config, ns).into()).collect();
        Self { namespaces, pools }
    }

    /// The namespaces with a pool and their replicas, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[ShimReplica])> {
        self.namespaces.iter().map(String::as_str).zip(self.pools.iter().map(|replicas| &replicas[..]))
    }

    /// The namespaces with a pool, in configuration order.
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }

    /// `namespace`'s pool, shared rather than copied (empty when it has none).
    pub fn pool(&self, namespace: &str) -> Arc<[ShimReplica]> {
        let index = self.namespaces.iter().position(|ns| ns == namespace);
        index.and_then(|i| self.pools.get(i)).map_or_else(|| Arc::from([]), Arc::clone)
    }
}

/// The pools of the configuration in force, resolved again only when the configuration changes
/// (a new `Arc` from the Fleet stream).
#[derive(Debug, Default)]
pub struct PoolCache {
    current: ArcSwapOption<Resolved>,
}

#[derive(Debug)]
struct Resolved {
    config: Arc<DataPlaneConfig>,
    pools: Arc<ShimPools>,
}

impl PoolCache {
    pub fn get(&self, config: &Arc<DataPlaneConfig>) -> Arc<ShimPools> {
        if let Some(resolved) = self.current.load().as_ref().filter(|r| Arc::ptr_eq(&r.config, config)) {
            return Arc::clone(&resolved.pools);
        }
        let pools = Arc::new(ShimPools::resolve(config));
        self.current.store(Some(Arc::new(Resolved { config: Arc::clone(config), pools: Arc::clone(&pools) })));
        pools
    }
}

/// The namespaces that have a shim pool, in configuration order.
fn pooled_namespaces(config: &DataPlaneConfig) -> impl Iterator<Item = &str> {
    config.shim_pools.iter().map(|p| p.namespace.as_str())
}

/// Backends that list `model` among theirs: the targets of unpinned (unified) routing.
pub fn serving_backends(config: &DataPlaneConfig, model: &str) -> Vec<ShimReplica> {
    let serving = config.backends.iter().filter(|b| b.models.iter().any(|m| m == model));
    serving.filter_map(|b| replica(config, &b.name)).collect()
}

/// Backends that take `model` without pins: those listing it, less every shim pool's members.
/// A direct-mode frontend refuses every request without pins (1.6.1 answers 500 or 400), so an
/// unpinned resend or fall-through to one is a round trip sure to fail.
pub fn unified_backends(config: &DataPlaneConfig, model: &str) -> Vec<ShimReplica> {
    // Pool members are left out before their URLs are resolved: a pinned request asks this
    // of every request's model, and most fleets have no other backend.
    let serving = config.backends.iter().filter(|b| b.models.iter().any(|m| m == model) && !is_pooled(config, &b.name));
    serving.filter_map(|b| replica(config, &b.name)).collect()
}

/// The models unpinned routing takes to a backend, as clients name them: those of every
/// dialable backend while disaggregated serving is off ([`serving_backends`]), else of those
/// outside every shim pool ([`unified_backends`]).
pub fn unpinned_models(config: &DataPlaneConfig) -> impl Iterator<Item = &str> {
    let disaggregated = config.disaggregated_serving.enabled;
    let unpinned = move |name: &str| (!disaggregated || !is_pooled(config, name)) && replica(config, name).is_some();
    config.backends.iter().filter(move |b| unpinned(&b.name)).flat_map(|b| b.models.iter().map(String::as_str))
}

/// Whether backend `name` is a member of some namespace's shim pool.
pub fn is_pooled(config: &DataPlaneConfig, name: &str) -> bool {
    config.shim_pools.iter().any(|pool| pool.backends.iter().any(|b| b == name))
}

/// [`rotation`], copied: what it must agree with.
#[cfg(test)]
pub fn rotated(mut replicas: Vec<ShimReplica>, start: usize) -> Vec<ShimReplica> {
    if !replicas.is_empty() {
        let len = replicas.len();
        replicas.rotate_left(start % len);
    }
    replicas
}

/// `replicas` starting at `start` (modulo their number), borrowed: successive requests spread
/// over a pool, and each retry moves on to the next replica.
pub fn rotation(replicas: &[ShimReplica], start: usize) -> impl Iterator<Item = &ShimReplica> {
    let len = replicas.len();
    (0..len).filter_map(move |i| replicas.get((start % len + i) % len))
}

fn replica(config: &DataPlaneConfig, name: &str) -> Option<ShimReplica> {
    let backend = config.backends.iter().find(|b| b.name == name)?;
    match endpoint(&backend.url) {
        Some(endpoint) => Some(ShimReplica {
            name: backend.name.clone(),
            url: backend.url.clone(),
            endpoint,
            health: HealthSlot::default(),
        }),
        None => {
            tracing::debug!(backend = name, "shim backend URL is not a dialable http:// URL; skipping it");
            None
        }
    }
}

/// `base` joined with the chat path. Only plain `http://` is dialled: shims sit next to the
/// data plane inside the cluster.
fn endpoint(base: &str) -> Option<Uri> {
    let uri: Uri = format!("{}{CHAT_COMPLETIONS_PATH}", base.trim_end_matches('/')).parse().ok()?;
    (uri.scheme_str() == Some("http") && uri.authority().is_some()).then_some(uri)
}

#[cfg(test)]
mod tests {
    use continuum_proto::model::{Backend, ShimPool};

    use super::*;

    fn config() -> DataPlaneConfig {
        let backend = |name: &str, url: &str, models: &[&str]| Backend {
            name: name.into(),
            url: url.into(),
            models: models.iter().map(|m| m.to_string()).collect(),
        };
        DataPlaneConfig {
            backends: vec![
                backend("a", "http://10.0.0.1:8000/", &["tiny"]),
                backend("b", "http://10.0.0.2:8000/prefix", &[]),
                backend("tls", "https://10.0.0.3:8443", &["tiny"]),
            ],
            shim_pools: vec![ShimPool {
                namespace: "prod".into(),
                backends: vec!["a".into(), "b".into(), "tls".into(), "gone".into()],
            }],
            ..DataPlaneConfig::default()
        }
    }

    #[test]
    fn the_cache_resolves_again_only_for_a_new_configuration() {
        let cache = PoolCache::default();
        let first = Arc::new(config());
        let pools = cache.get(&first);
        assert!(Arc::ptr_eq(&pools, &cache.get(&first)), "same configuration, same resolution");
        assert_eq!(pools.pool("a").to_vec(), namespace_pool(&first, "a"));
        let second = Arc::new(config());
        assert!(!Arc::ptr_eq(&pools, &cache.get(&second)));
    }

    #[test]
    fn a_pool_keeps_dialable_replicas_in_order() {
        let pool = namespace_pool(&config(), "prod");
        let names: Vec<&str> = pool.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(pool[0].endpoint, "http://10.0.0.1:8000/v1/chat/completions");
        assert_eq!(pool[1].endpoint, "http://10.0.0.2:8000/prefix/v1/chat/completions");
        assert!(namespace_pool(&config(), "canary").is_empty());
    }

    #[test]
    fn unified_targets_are_the_backends_listing_the_model() {
        let names: Vec<String> = serving_backends(&config(), "tiny").into_iter().map(|r| r.name).collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    fn rotation_starts_at_the_cursor() {
        let names = |start| -> Vec<String> {
            rotated(namespace_pool(&config(), "prod"), start).into_iter().map(|r| r.name).collect()
        };
        assert_eq!(names(0), ["a", "b"]);
        assert_eq!(names(3), ["b", "a"]);
        assert!(rotated(Vec::new(), 5).is_empty());
        let pool = namespace_pool(&config(), "prod");
        for start in 0..4 {
            assert_eq!(rotation(&pool, start).cloned().collect::<Vec<_>>(), rotated(pool.clone(), start));
        }
        assert_eq!(rotation(&[], 5).count(), 0);
    }
}
