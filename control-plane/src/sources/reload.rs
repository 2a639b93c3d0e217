//! Reload classes for the discovery configuration: what a new configuration does to the
//! running discovery source. Pure: it compares two configurations and says what to do.
//!
//! - Nothing discovery reads changed: keep the watcher.
//! - Only `watch_reconnect_backoff` changed: replace the watcher, but keep the current fleet
//!   readable until the replacement's first full resync (reason `backoff`).
//! - Namespaces were only added or removed (`namespaces`): prune the removed namespaces'
//!   workers now, keep the rest routable, and let the replacement resync (reason `namespaces`).
//! - The etcd connection (endpoints, TLS, auth) or the static workers changed: replace the
//!   watcher and keep the current fleet until the replacement's first full resync replaces it
//!   (reasons `connection`, `other`): the same fleet, reached another way.
//! - Anything else (enabled, source, the scalar namespace, the simulator): replace the watcher
//!   and empty the registry first (reasons `enabled`, `source`, `namespace`, `other`).

use crate::config::{Config, DiscoverySource};

/// What to do with the discovery source after a reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryReload {
    Keep,
    /// Discovery turned off: stop the watcher and empty the registry (not counted as a restart).
    Stop,
    Restart {
        reason: RestartReason,
        registry: RegistryOnRestart,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartReason {
    Enabled,
    Source,
    Namespace,
    Namespaces,
    Connection,
    Backoff,
    Other,
}

impl RestartReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RestartReason::Enabled => "enabled",
            RestartReason::Source => "source",
            RestartReason::Namespace => "namespace",
            RestartReason::Namespaces => "namespaces",
            RestartReason::Connection => "connection",
            RestartReason::Backoff => "backoff",
            RestartReason::Other => "other",
        }
    }
}

/// What happens to the published fleet while the replacement watcher seeds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryOnRestart {
    /// Keep it readable until the replacement publishes.
    Keep,
    /// Drop only these namespaces' workers now.
    Prune { keep: Vec<String> },
    /// Empty it now.
    Reset,
}

/// Compares the discovery parts of two configurations.
pub fn classify(old: &Config, new: &Config) -> DiscoveryReload {
    let (od, nd) = (&old.dynamo, &new.dynamo);
    if !nd.enabled {
        return if od.enabled { DiscoveryReload::Stop } else { DiscoveryReload::Keep };
    }
    let restart = |reason, registry| DiscoveryReload::Restart { reason, registry };
    if !od.enabled {
        return restart(RestartReason::Enabled, RegistryOnRestart::Reset);
    }
    let (os, ns) = (&od.discovery, &nd.discovery);
    if os.source != ns.source {
        return restart(RestartReason::Source, RegistryOnRestart::Reset);
    }
    match ns.source {
        DiscoverySource::Static if os.static_fleet != ns.static_fleet => {
            restart(RestartReason::Other, RegistryOnRestart::Keep)
        }
        DiscoverySource::Simulator if os.simulator != ns.simulator => {
            restart(RestartReason::Other, RegistryOnRestart::Reset)
        }
        DiscoverySource::Etcd => classify_etcd(old, new),
        _ => DiscoveryReload::Keep,
    }
}

fn classify_etcd(old: &Config, new: &Config) -> DiscoveryReload {
    let (oe, ne) = (&old.dynamo.discovery.etcd, &new.dynamo.discovery.etcd);
    let restart = |reason, registry| DiscoveryReload::Restart { reason, registry };
    let (old_ns, new_ns) = (old.namespaces(), new.namespaces());
    // A list in another order names the same fleet.
    let same = |a: &[String], b: &[String]| a.iter().all(|n| b.contains(n)) && b.iter().all(|n| a.contains(n));
    if !same(&old_ns, &new_ns) {
        // A list that only gained or lost entries keeps its surviving graphs routable; a
        // changed scalar namespace is a different fleet.
        let lists = !oe.namespaces.is_empty() || !ne.namespaces.is_empty();
        let kept: Vec<String> = old_ns.iter().filter(|n| new_ns.contains(n)).cloned().collect();
        return if lists && !kept.is_empty() {
            restart(RestartReason::Namespaces, RegistryOnRestart::Prune { keep: kept })
        } else {
            restart(RestartReason::Namespace, RegistryOnRestart::Reset)
        };
    }
    // Namespaces unchanged (a change of them decides above, whatever else changed with them).
    if oe.endpoints != ne.endpoints || oe.tls != ne.tls || oe.auth != ne.auth {
        // The same fleet reached another way (a rotated password or certificate, an endpoint
        // added): emptied now, every replica following would be sent no workers until the new
        // watcher's first read, and for good were the new settings wrong. It stays as the last
        // read found it, as when etcd is unreachable, until that read replaces it whole.
        return restart(RestartReason::Connection, RegistryOnRestart::Keep);
    }
    if oe.watch_reconnect_backoff != ne.watch_reconnect_backoff {
        return restart(RestartReason::Backoff, RegistryOnRestart::Keep);
    }
    DiscoveryReload::Keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_str;

    fn config(discovery: &str) -> Config {
        let yaml = format!("dynamo:\n  enabled: true\n  discovery:\n{discovery}");
        match load_str(&yaml, &|_| Some("pw".into())) {
            Ok(loaded) => loaded.config,
            Err(error) => panic!("test config does not load: {error:?}\n{yaml}"),
        }
    }

    fn etcd(extra: &str) -> Config {
        config(&format!("    source: etcd\n    etcd:\n      endpoints: [\"http://127.0.0.1:2379\"]\n{extra}"))
    }

    fn restart(reason: RestartReason, registry: RegistryOnRestart) -> DiscoveryReload {
        DiscoveryReload::Restart { reason, registry }
    }

    #[test]
    fn each_change_maps_to_its_reload_class() {
        let base = etcd("      namespaces: [a, b]\n");
        let cases = [
            ("identical", etcd("      namespaces: [a, b]\n"), DiscoveryReload::Keep),
            ("reordered", etcd("      namespaces: [b, a]\n"), DiscoveryReload::Keep),
            (
                "backoff only",
                etcd("      namespaces: [a, b]\n      watch_reconnect_backoff: {initial: 1s, max: 1m}\n"),
                restart(RestartReason::Backoff, RegistryOnRestart::Keep),
            ),
            (
                "a namespace removed",
                etcd("      namespaces: [a]\n"),
                restart(RestartReason::Namespaces, RegistryOnRestart::Prune { keep: vec!["a".into()] }),
            ),
            (
                "a namespace added",
                etcd("      namespaces: [a, b, c]\n"),
                restart(RestartReason::Namespaces, RegistryOnRestart::Prune { keep: vec!["a".into(), "b".into()] }),
            ),
            (
                "every namespace replaced",
                etcd("      namespaces: [c, d]\n"),
                restart(RestartReason::Namespace, RegistryOnRestart::Reset),
            ),
            (
                "endpoints",
                config(
                    "    source: etcd\n    etcd:\n      endpoints: [\"http://127.0.0.1:2380\"]\n      namespaces: [a, b]\n",
                ),
                restart(RestartReason::Connection, RegistryOnRestart::Keep),
            ),
            (
                "endpoints and every namespace at once: a different fleet",
                config(
                    "    source: etcd\n    etcd:\n      endpoints: [\"http://127.0.0.1:2380\"]\n      namespaces: [c, d]\n",
                ),
                restart(RestartReason::Namespace, RegistryOnRestart::Reset),
            ),
            (
                "auth",
                etcd("      namespaces: [a, b]\n      auth: {username: u, password: \"${PW}\"}\n"),
                restart(RestartReason::Connection, RegistryOnRestart::Keep),
            ),
            ("source", config("    source: static\n"), restart(RestartReason::Source, RegistryOnRestart::Reset)),
        ];
        for (name, new, expected) in cases {
            assert_eq!(classify(&base, &new), expected, "{name}");
        }
    }

    #[test]
    fn a_changed_scalar_namespace_resets_and_disabling_stops() {
        let base = etcd("      namespace: prod\n");
        assert_eq!(
            classify(&base, &etcd("      namespace: canary\n")),
            restart(RestartReason::Namespace, RegistryOnRestart::Reset)
        );
        let mut disabled = base.clone();
        disabled.dynamo.enabled = false;
        assert_eq!(classify(&base, &disabled), DiscoveryReload::Stop);
        assert_eq!(classify(&disabled, &disabled), DiscoveryReload::Keep);
        assert_eq!(classify(&disabled, &base), restart(RestartReason::Enabled, RegistryOnRestart::Reset));
    }
}
