//! `dynamo.discovery.kubernetes` under `source: kubernetes` (metadata) and
//! `source: kubernetes_pods`: names, namespace lists and the model mapping.

use std::collections::HashSet;

use super::Report;
use super::names::{check_backoff, check_namespace_list, dns_label_message, duplicates, label_value_message};
use crate::config::Config;
use crate::config::discovery::{DEFAULT_DYNAMO_NAMESPACE, DiscoverySource, KubernetesConfig};

/// Component-to-model entries `kubernetes.models` may hold.
pub const MAX_KUBERNETES_MODELS: usize = 256;

const BASE: &str = "dynamo.discovery.kubernetes";

pub(super) fn check(config: &Config, report: &mut Report) {
    let kube = &config.dynamo.discovery.kubernetes;
    let source = config.dynamo.discovery.source;
    if !matches!(source, DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods) {
        return;
    }
    if config.dynamo.enabled {
        // An error, not a warning: `config validate` must not pass what the binary refuses.
        report.error(
            "dynamo.discovery.source",
            format!(
                "{} discovery is specified but not available in this build: the control plane refuses to start with it; use etcd, static or simulator",
                source.as_str()
            ),
        );
    }
    if let Some(problem) = dns_label_message(&kube.namespace) {
        report.error(format!("{BASE}.namespace"), format!("{problem}; set the Kubernetes namespace of the fleet"));
    }
    check_dynamo_namespaces(kube, report);
    check_backoff(report, &format!("{BASE}.watch_reconnect_backoff"), &kube.watch_reconnect_backoff);
    if source == DiscoverySource::Kubernetes {
        if kube.model.is_some() || !kube.models.is_empty() {
            let key = if kube.model.is_some() { "model" } else { "models" };
            report.warning(
                format!("{BASE}.{key}"),
                "is ignored under source: kubernetes; each worker's model comes from its model card",
            );
        }
        return;
    }
    report.warning(
        "dynamo.discovery.source",
        "kubernetes_pods gives no capacity or load signals (Pods carry no model cards): workers are picked round-robin; prefer source: kubernetes where RBAC allows",
    );
    check_pod_models(kube, report);
}

fn check_dynamo_namespaces(kube: &KubernetesConfig, report: &mut Report) {
    if let Some(problem) = label_value_message(&kube.dynamo_namespace) {
        report.error(format!("{BASE}.dynamo_namespace"), problem);
    }
    if kube.dynamo_namespaces.is_empty() {
        return;
    }
    let path = format!("{BASE}.dynamo_namespaces");
    check_namespace_list(report, &path, &kube.dynamo_namespaces, label_value_message);
    if kube.dynamo_namespace != DEFAULT_DYNAMO_NAMESPACE {
        report.error(
            format!("{BASE}.dynamo_namespace"),
            "is mutually exclusive with dynamo_namespaces; list every namespace under dynamo_namespaces",
        );
    }
}

/// `kubernetes_pods` needs exactly one of `model` or `models`.
fn check_pod_models(kube: &KubernetesConfig, report: &mut Report) {
    match (&kube.model, kube.models.is_empty()) {
        (Some(_), false) => report.error(format!("{BASE}.models"), "set exactly one of model or models, not both"),
        (None, true) => report.error(
            format!("{BASE}.model"),
            "source kubernetes_pods needs model (one model for every worker Pod) or models (one per component)",
        ),
        (Some(model), true) => {
            if let Some(problem) = model_name_problem(model) {
                report.error(format!("{BASE}.model"), problem);
            }
        }
        (None, false) => check_models_list(kube, report),
    }
}

fn check_models_list(kube: &KubernetesConfig, report: &mut Report) {
    if kube.models.len() > MAX_KUBERNETES_MODELS {
        report.error(
            format!("{BASE}.models"),
            format!("lists {} entries; at most {MAX_KUBERNETES_MODELS} are supported", kube.models.len()),
        );
    }
    let watched: HashSet<&str> = kube.dynamo_namespaces.iter().map(String::as_str).collect();
    for (index, entry) in kube.models.iter().enumerate() {
        let path = format!("{BASE}.models[{index}]");
        if entry.component.is_empty() {
            report.error(format!("{path}.component"), "must not be empty");
        }
        if let Some(problem) = model_name_problem(&entry.model) {
            report.error(format!("{path}.model"), problem);
        }
        match &entry.dynamo_namespace {
            None if watched.len() > 1 => report.error(
                format!("{path}.dynamo_namespace"),
                "is required when dynamo_namespaces lists several namespaces",
            ),
            Some(ns) if !watched.is_empty() && !watched.contains(ns.as_str()) => {
                report.error(format!("{path}.dynamo_namespace"), format!("`{ns}` is not listed in dynamo_namespaces"))
            }
            Some(ns) if watched.is_empty() && *ns != kube.dynamo_namespace => report.error(
                format!("{path}.dynamo_namespace"),
                format!("`{ns}` is not the watched dynamo_namespace `{}`", kube.dynamo_namespace),
            ),
            _ => {}
        }
    }
    // With one namespace listed, a model that names none is in that one.
    let only = match kube.dynamo_namespaces.as_slice() {
        [only] => Some(only.as_str()),
        _ => None,
    };
    let keys = kube.models.iter().map(|m| (m.dynamo_namespace.as_deref().or(only), m.component.as_str()));
    for (index, first) in duplicates(keys) {
        report.error(format!("{BASE}.models[{index}].component"), format!("duplicates {BASE}.models[{first}]"));
    }
}

fn model_name_problem(model: &str) -> Option<&'static str> {
    if model.is_empty() {
        Some("must not be empty")
    } else if model.chars().any(char::is_whitespace) {
        Some("must not contain whitespace")
    } else {
        None
    }
}
