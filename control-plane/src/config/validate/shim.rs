//! `backends`, `dynamo.shim` and their cross-references: every shim replica is a configured
//! OpenAI-wire backend, and with several namespaces each has exactly one pool.

use std::collections::HashMap;

use super::Report;
use super::names::{check_namespace, duplicates};
use crate::config::Config;
use crate::config::types::{BackendConfig, BackendRole};

/// Shim replicas `shim.backends` (or one pool) may list.
pub const MAX_SHIM_BACKENDS: usize = 64;
/// Entries `shim.model_map` may hold.
pub const MAX_MODEL_MAP_ENTRIES: usize = 1024;

const SHIM: &str = "dynamo.shim";

pub(super) fn check(config: &Config, report: &mut Report) {
    check_backends(&config.backends, report);
    let by_name: HashMap<&str, &BackendConfig> = config.backends.iter().map(|b| (b.name.as_str(), b)).collect();
    let shim = &config.dynamo.shim;
    check_replicas(&format!("{SHIM}.backends"), &shim.backends, &by_name, report);
    check_pools(config, &by_name, report);
    check_model_map(config, report);
    let listed = !shim.backends.is_empty() || !shim.pools.is_empty();
    let pinning = config.dynamo.enabled && config.disaggregated_serving.enabled;
    if listed && !pinning {
        report.warning(
            SHIM,
            "lists shim replicas but dynamo.enabled or disaggregated_serving.enabled is false: no request is pinned through them",
        );
    }
    if !listed && pinning {
        report.warning(
            format!("{SHIM}.backends"),
            "lists no shim replica: discovery and disaggregated serving are on, but no request can be pinned (requests go to unified backends, or are refused)",
        );
    }
}

fn check_backends(backends: &[BackendConfig], report: &mut Report) {
    for (index, backend) in backends.iter().enumerate() {
        let path = format!("backends[{index}]");
        if backend.name.is_empty() {
            report.error(format!("{path}.name"), "must not be empty");
        }
        if backend.kind != "openai" {
            // Dialled as OpenAI whatever it said, its requests would be malformed for it.
            report.error(
                format!("{path}.type"),
                format!("is `{}`; this build speaks only the OpenAI wire to backends (type: openai)", backend.kind),
            );
        }
        if let Some(problem) = url_problem(&backend.url) {
            report.error(format!("{path}.url"), problem);
        }
        if backend.role != BackendRole::Unified && !backend.models.is_empty() {
            report.warning(
                format!("{path}.role"),
                "is not unified: a prefill or decode engine serves one phase, so it gets no plain requests for its models \
                 (disaggregated serving runs through a Dynamo shim, which is role: unified)",
            );
        }
        for (model_index, model) in backend.models.iter().enumerate() {
            if model.is_empty() {
                report.error(format!("{path}.models[{model_index}]"), "must not be empty");
            }
        }
    }
    for (index, first) in duplicates(backends.iter().map(|b| b.name.as_str()).filter(|n| !n.is_empty())) {
        report.error(format!("backends[{index}].name"), format!("duplicates backends[{first}].name"));
    }
}

/// What is wrong with a backend URL, if anything. The data plane dials `http://host:port` (port
/// 80 when none is written), with an optional path the chat path is appended to; anything it
/// would not dial as written is refused here rather than left out of routing, or dialled at
/// another port, at run time. The URL is never quoted: its key path names it, and a query
/// string or a user part may hold a credential.
fn url_problem(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://").map_or((None, url), |(scheme, rest)| (Some(scheme), rest));
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    // First, whatever the scheme, and never quoted: what precedes the `@` is a password. Looked
    // for in the whole URL: a password may hold a `/`, `?` or `#`, which would end the
    // authority short of its `@`. No backend URL needs an `@` elsewhere.
    if rest.contains('@') {
        return Some("must not embed credentials (user:pass@host)".to_owned());
    }
    if scheme == Some("https") {
        return Some(
            "is https://; backends (shims and unified ones alike) are dialled over plain http:// only, \
             from beside them inside the cluster"
                .to_owned(),
        );
    }
    if scheme != Some("http") {
        return Some("must be an http:// URL".to_owned());
    }
    if authority.is_empty() || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some("must name a host and contain no whitespace".to_owned());
    }
    if tail.contains(['?', '#']) {
        return Some("must have no query string or fragment: the chat path is appended to it".to_owned());
    }
    // As the data plane reads it: a host, and a port from 1 to 65535 when one is written.
    let Ok(uri) = url.parse::<hyper::Uri>() else {
        return Some(
            "is not a URL the data plane can read: check the host's characters and an IPv6 host's brackets".to_owned(),
        );
    };
    let written_port = authority.rsplit_once(':').filter(|(host, _)| !host.is_empty() && !authority.ends_with(']'));
    if uri.host().is_none_or(str::is_empty) {
        return Some("must name a host".to_owned());
    }
    if written_port.is_some() && uri.port_u16().is_none_or(|port| port == 0) {
        return Some("has a port that is not a number from 1 to 65535".to_owned());
    }
    None
}

/// One list of shim replicas: bounded, unique, each a usable configured backend.
fn check_replicas(path: &str, names: &[String], by_name: &HashMap<&str, &BackendConfig>, report: &mut Report) {
    if names.len() > MAX_SHIM_BACKENDS {
        report.error(path, format!("lists {} replicas; at most {MAX_SHIM_BACKENDS} are supported", names.len()));
    }
    for (index, first) in duplicates(names.iter()) {
        report.error(format!("{path}[{index}]"), format!("duplicates {path}[{first}]"));
    }
    for (index, name) in names.iter().enumerate() {
        let item = format!("{path}[{index}]");
        match by_name.get(name.as_str()) {
            None => report.error(item, format!("`{name}` is not a configured backends[].name")),
            Some(backend) if backend.internal || !backend.enabled => report.warning(
                item,
                format!("backend `{name}` is internal: true or enabled: false, so it never receives shim traffic"),
            ),
            Some(backend) if backend.role != BackendRole::Unified => report.warning(
                item,
                format!("backend `{name}` should have role: unified (a direct-mode shim runs both phases itself)"),
            ),
            Some(_) => {}
        }
    }
}

fn check_pools(config: &Config, by_name: &HashMap<&str, &BackendConfig>, report: &mut Report) {
    let shim = &config.dynamo.shim;
    let namespaces = config.namespaces();
    if shim.pools.is_empty() {
        if namespaces.len() > 1 && !shim.backends.is_empty() {
            report.error(
                format!("{SHIM}.backends"),
                "several Dynamo namespaces are configured: use shim.pools (one pool per namespace) instead",
            );
        } else if namespaces.len() > 1 && config.dynamo.enabled && config.disaggregated_serving.enabled {
            report.error(
                format!("{SHIM}.pools"),
                "several Dynamo namespaces are configured: shim.pools is required (one pool per namespace)",
            );
        }
        return;
    }
    if !shim.backends.is_empty() {
        report.error(format!("{SHIM}.backends"), "is mutually exclusive with shim.pools; list replicas per pool");
    }
    let mut pool_of_replica: HashMap<&str, usize> = HashMap::new();
    for (index, pool) in shim.pools.iter().enumerate() {
        let path = format!("{SHIM}.pools[{index}]");
        check_namespace(report, &format!("{path}.namespace"), &pool.namespace);
        if !pool.namespace.is_empty() && !namespaces.contains(&pool.namespace) {
            report.error(
                format!("{path}.namespace"),
                format!("`{}` is not a configured Dynamo namespace", pool.namespace),
            );
        }
        if pool.backends.is_empty() {
            report.error(format!("{path}.backends"), "must list at least one shim replica");
        }
        check_replicas(&format!("{path}.backends"), &pool.backends, by_name, report);
        for (replica_index, name) in pool.backends.iter().enumerate() {
            let owner = *pool_of_replica.entry(name.as_str()).or_insert(index);
            if owner != index {
                report.error(
                    format!("{path}.backends[{replica_index}]"),
                    format!("`{name}` already belongs to {SHIM}.pools[{owner}]; a replica serves one namespace"),
                );
            }
        }
    }
    for (index, first) in duplicates(shim.pools.iter().map(|p| p.namespace.as_str())) {
        report.error(format!("{SHIM}.pools[{index}].namespace"), format!("duplicates {SHIM}.pools[{first}]"));
    }
    for namespace in namespaces.iter().filter(|ns| !shim.pools.iter().any(|p| &p.namespace == *ns)) {
        report.error(
            format!("{SHIM}.pools"),
            format!("namespace `{namespace}` has no pool; every configured namespace needs one"),
        );
    }
}

fn check_model_map(config: &Config, report: &mut Report) {
    let map = &config.dynamo.shim.model_map;
    let path = format!("{SHIM}.model_map");
    if map.len() > MAX_MODEL_MAP_ENTRIES {
        report.error(&path, format!("has {} entries; at most {MAX_MODEL_MAP_ENTRIES} are supported", map.len()));
    }
    for (client_model, dynamo_model) in map {
        if client_model.is_empty() {
            report.error(&path, "has an entry with an empty client model id");
        } else if dynamo_model.is_empty() {
            report.error(format!("{path}.{client_model}"), "must name the Dynamo display_name");
        }
    }
}
