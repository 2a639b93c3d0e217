//! The Kubernetes manifests in `deploy/kubernetes` against the binaries they run: the control
//! plane's configuration validates with the secrets the pod gives it, every environment variable
//! set is one the binary reads, the ports, probes and Service names agree with the addresses,
//! and a replica's drain fits in its pod's termination grace period. No cluster is needed: a
//! renamed flag, port or path fails here instead of in someone's rollout.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use continuum_tests::tools;
use serde::Deserialize;
use serde_yaml_ng::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// Every document of a manifest file.
fn documents(file: &str) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(deploy().join(file)).with_context(|| format!("reading {file}"))?;
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|document| Value::deserialize(document).with_context(|| format!("parsing {file}")))
        .collect()
}

fn find<'a>(documents: &'a [Value], kind: &str) -> anyhow::Result<&'a Value> {
    documents.iter().find(|d| d["kind"] == kind).ok_or_else(|| anyhow!("no {kind}"))
}

fn text(value: &Value) -> anyhow::Result<&str> {
    value.as_str().ok_or_else(|| anyhow!("{value:?} is not a string"))
}

/// A Deployment's one container.
fn container(deployment: &Value) -> anyhow::Result<&Value> {
    let containers = deployment["spec"]["template"]["spec"]["containers"].as_sequence();
    match containers.map(Vec::as_slice) {
        Some([only]) => Ok(only),
        other => Err(anyhow!("expected one container, found {other:?}")),
    }
}

/// The container's environment variables with literal values; `valueFrom` ones map to `None`.
fn env(container: &Value) -> anyhow::Result<Vec<(String, Option<String>)>> {
    let vars = container["env"].as_sequence().ok_or_else(|| anyhow!("no env"))?;
    vars.iter().map(|var| Ok((text(&var["name"])?.to_string(), var["value"].as_str().map(str::to_string)))).collect()
}

fn value_of<'a>(env: &'a [(String, Option<String>)], name: &str) -> anyhow::Result<&'a str> {
    env.iter().find(|(n, _)| n == name).and_then(|(_, v)| v.as_deref()).ok_or_else(|| anyhow!("no value for {name}"))
}

fn container_port(container: &Value, name: &str) -> anyhow::Result<u64> {
    let ports = container["ports"].as_sequence().ok_or_else(|| anyhow!("no ports"))?;
    let port = ports.iter().find(|p| p["name"] == name).ok_or_else(|| anyhow!("no port named {name}"))?;
    port["containerPort"].as_u64().ok_or_else(|| anyhow!("port {name} has no number"))
}

fn port_of(addr: &str) -> anyhow::Result<u64> {
    let (_, port) = addr.rsplit_once(':').ok_or_else(|| anyhow!("{addr} has no port"))?;
    Ok(port.trim_end_matches('/').parse()?)
}

/// The names a binary reads from the environment, from its `--help`.
fn env_names(binary: &str) -> anyhow::Result<Vec<String>> {
    let help = std::process::Command::new(tools::binary(binary)).arg("--help").output()?;
    ensure!(help.status.success(), "{binary} --help failed");
    let help = String::from_utf8(help.stdout)?;
    // `[env: NAME=value]`, or `[env: NAME]` for a variable whose value help hides.
    Ok(help.split("[env: ").skip(1).filter_map(|rest| rest.split(['=', ']']).next()).map(str::to_string).collect())
}

/// Checks a probe's path and that it asks the named container port.
fn probe(container: &Value, which: &str, path: &str, port: &str) -> anyhow::Result<()> {
    let get = &container[which]["httpGet"];
    ensure!(get["path"] == path && get["port"] == port, "{which}: {get:?}, expected {path} on {port}");
    Ok(())
}

/// Runs `continuum-control-plane config <command>` on the manifests' configuration, with
/// placeholders for the secrets the control plane's pod sets (`valueFrom`); a variable the file
/// reads and the pod does not set fails at its key path.
fn control_plane_config(command: &str) -> anyhow::Result<String> {
    let manifests = documents("control-plane.yaml")?;
    let container = container(find(&manifests, "Deployment")?)?;
    let mut run = std::process::Command::new(tools::binary("continuum-control-plane"));
    run.args(["config", command]).arg(deploy().join("control-plane.config.yaml")).env_clear();
    for (name, _) in env(container)?.iter().filter(|(_, value)| value.is_none()) {
        run.env(name, "placeholder-secret");
    }
    let out = run.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "config {command}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    Ok(stdout)
}

/// The configuration as the control plane reads it, defaults filled in.
fn effective_config() -> anyhow::Result<Value> {
    Ok(serde_yaml_ng::from_str(&control_plane_config("show")?)?)
}

#[test]
fn the_control_planes_configuration_validates_with_the_secrets_its_pod_sets() -> anyhow::Result<()> {
    let says = control_plane_config("validate")?;
    ensure!(says.contains("valid (0 warning(s))"), "{says}");
    Ok(())
}

#[test]
fn every_variable_the_pods_set_is_one_their_binary_reads() -> anyhow::Result<()> {
    for (file, binary) in
        [("control-plane.yaml", "continuum-control-plane"), ("data-plane.yaml", "continuum-data-plane")]
    {
        let known = env_names(binary)?;
        let manifests = documents(file)?;
        let container = container(find(&manifests, "Deployment")?)?;
        ensure!(container["command"][0] == binary, "{file} runs {:?}", container["command"]);
        let config: String = std::fs::read_to_string(deploy().join("control-plane.config.yaml"))?;
        for (name, _) in env(container)? {
            // The control plane also reads its secrets through `${VAR}` in its configuration.
            let substituted = binary == "continuum-control-plane" && config.contains(&format!("${{{name}}}"));
            ensure!(known.contains(&name) || substituted, "{file} sets {name}, which {binary} never reads");
        }
    }
    Ok(())
}

/// What the "restricted" Pod Security Standard requires of a pod, so that both deploy into a
/// namespace that enforces it: non-root, no privilege escalation, every capability dropped and
/// the runtime's seccomp profile (and, beyond the standard, a read-only root filesystem and no
/// ServiceAccount token, which neither binary uses).
#[test]
fn both_pods_meet_the_restricted_pod_security_standard() -> anyhow::Result<()> {
    for file in ["control-plane.yaml", "data-plane.yaml"] {
        let manifests = documents(file)?;
        let deployment = find(&manifests, "Deployment")?;
        let spec = &deployment["spec"]["template"]["spec"];
        ensure!(spec["automountServiceAccountToken"] == false, "{file}: automountServiceAccountToken");
        let pod = &spec["securityContext"];
        ensure!(pod["runAsNonRoot"] == true, "{file}: runAsNonRoot");
        ensure!(
            pod["seccompProfile"]["type"] == "RuntimeDefault",
            "{file}: seccompProfile {:?}",
            pod["seccompProfile"]
        );
        let container = &container(deployment)?["securityContext"];
        ensure!(container["allowPrivilegeEscalation"] == false, "{file}: allowPrivilegeEscalation");
        ensure!(container["readOnlyRootFilesystem"] == true, "{file}: readOnlyRootFilesystem");
        let dropped = container["capabilities"]["drop"].as_sequence().cloned().unwrap_or_default();
        ensure!(dropped == [Value::from("ALL")], "{file}: capabilities.drop {dropped:?}");
    }
    Ok(())
}

/// Both pods request CPU and memory and have a memory limit (a pod without is the first a
/// node short of memory evicts: for the control plane, the singleton every replica follows),
/// and the data plane runs as many runtime threads as CPUs it requests, not one per core of
/// the node.
#[test]
fn both_pods_request_what_they_use_and_the_data_plane_threads_follow_its_cpu() -> anyhow::Result<()> {
    for file in ["control-plane.yaml", "data-plane.yaml"] {
        let manifests = documents(file)?;
        let resources = &container(find(&manifests, "Deployment")?)?["resources"];
        for (what, resource) in [("requests", "cpu"), ("requests", "memory"), ("limits", "memory")] {
            ensure!(!resources[what][resource].is_null(), "{file}: resources.{what}.{resource}");
        }
    }
    let manifests = documents("data-plane.yaml")?;
    let data_plane = container(find(&manifests, "Deployment")?)?;
    let threads = data_plane["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|entry| entry["name"] == "CONTINUUM_WORKER_THREADS")
        .map(|entry| &entry["valueFrom"]["resourceFieldRef"]["resource"]);
    ensure!(threads.is_some_and(|r| r == "requests.cpu"), "CONTINUUM_WORKER_THREADS from requests.cpu: {threads:?}");
    ensure!(env_names("continuum-data-plane")?.iter().any(|name| name == "CONTINUUM_WORKER_THREADS"));
    Ok(())
}

#[test]
fn ports_probes_and_addresses_agree() -> anyhow::Result<()> {
    let config = effective_config()?;
    let control = documents("control-plane.yaml")?;
    let control_container = container(find(&control, "Deployment")?)?;
    let grpc = container_port(control_container, "grpc")?;
    let admin = container_port(control_container, "admin")?;
    assert_eq!(port_of(text(&config["control_plane"]["grpc_listen"])?)?, grpc);
    assert_eq!(port_of(text(&config["admin"]["listen"])?)?, admin);
    probe(control_container, "readinessProbe", "/readyz", "admin")?;
    // Liveness by the kernel's handshake: an HTTP probe needs one of the admin listener's
    // slots, which its clients may hold.
    ensure!(
        control_container["livenessProbe"]["tcpSocket"]["port"] == "admin",
        "{:?}",
        control_container["livenessProbe"]
    );
    // The configuration is mounted where CONTINUUM_CONFIG looks for it, under the key the
    // kustomization gives it.
    let control_env = env(control_container)?;
    let config_path = value_of(&control_env, "CONTINUUM_CONFIG")?;
    let mount = &control_container["volumeMounts"][0]["mountPath"];
    let kustomization: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(deploy().join("kustomization.yaml"))?)?;
    let key = text(&kustomization["configMapGenerator"][0]["files"][0])?.split('=').next().unwrap_or_default();
    assert_eq!(config_path, format!("{}/{key}", text(mount)?));

    let data = documents("data-plane.yaml")?;
    let data_container = container(find(&data, "Deployment")?)?;
    let data_env = env(data_container)?;
    assert_eq!(port_of(value_of(&data_env, "CONTINUUM_LISTEN")?)?, container_port(data_container, "http")?);
    probe(data_container, "readinessProbe", "/readyz", "http")?;
    // The data plane's liveness is its listener's: a slot for an HTTP probe is one a stream may hold.
    ensure!(data_container["livenessProbe"]["tcpSocket"]["port"] == "http", "{:?}", data_container["livenessProbe"]);
    // Replicas dial the control plane's Service on its gRPC port.
    let service = find(&control, "Service")?;
    let url = value_of(&data_env, "CONTINUUM_CONTROL_PLANE")?;
    let name = text(&service["metadata"]["name"])?;
    assert_eq!(url, format!("http://{name}:{grpc}"));
    let grpc_port = service["spec"]["ports"].as_sequence().and_then(|ports| ports.iter().find(|p| p["name"] == "grpc"));
    assert_eq!(grpc_port.map(|p| (&p["port"], &p["targetPort"])), Some((&Value::from(grpc), &Value::from("grpc"))));
    // Only it: the admin API (whose /metrics names every worker) stays off the Service.
    assert_eq!(service["spec"]["ports"].as_sequence().map(Vec::len), Some(1), "{:?}", service["spec"]["ports"]);
    // The KV artifact cache (its default path) lies on the writable volume.
    let cache = &data_container["volumeMounts"][0]["mountPath"];
    let artifacts = text(&config["dynamo"]["kv"]["artifact_cache_dir"])?;
    assert!(Path::new(artifacts).starts_with(text(cache)?), "{artifacts} is not under {cache:?}");
    Ok(())
}

#[test]
fn a_replicas_drain_is_seen_by_its_probes_and_fits_in_its_pods_termination_grace_period() -> anyhow::Result<()> {
    let data = documents("data-plane.yaml")?;
    let deployment = find(&data, "Deployment")?;
    let env = env(container(deployment)?)?;
    let delay = humantime::parse_duration(value_of(&env, "CONTINUUM_DRAIN_DELAY")?)?;
    let grace = humantime::parse_duration(value_of(&env, "CONTINUUM_SHUTDOWN_GRACE")?)?;
    let period = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .ok_or_else(|| anyhow!("no terminationGracePeriodSeconds"))?;
    // Past the grace the replica still stops its tasks and its runtime before it exits.
    let exit = continuum_data_plane::replica::EXIT_AFTER_GRACE;
    ensure!(
        delay + grace + exit < Duration::from_secs(period),
        "{delay:?} + {grace:?} + {exit:?} to exit does not fit in {period} s"
    );
    // A load balancer probing readiness sees the drain before the delay is over.
    let readiness = &container(deployment)?["readinessProbe"];
    let probe_period = readiness["periodSeconds"].as_u64().unwrap_or(10);
    let failures = readiness["failureThreshold"].as_u64().unwrap_or(3);
    let noticed = Duration::from_secs(probe_period * failures);
    ensure!(noticed < delay, "readiness fails only after {noticed:?}, past the {delay:?} drain delay");
    Ok(())
}

/// Both Deployments run the image the kustomization's `images` entry renames, so the one
/// `kustomize edit set image` the deploy README gives points both at the operator's registry,
/// and a node that already holds the image runs it without pulling.
#[test]
fn the_kustomization_names_the_image_both_deployments_run() -> anyhow::Result<()> {
    let kustomization: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(deploy().join("kustomization.yaml"))?)?;
    let renamed = text(&kustomization["images"][0]["name"])?;
    for file in ["control-plane.yaml", "data-plane.yaml"] {
        let deployment = documents(file)?;
        let container = container(find(&deployment, "Deployment")?)?;
        let image = text(&container["image"])?;
        let name = image.split_once(':').map_or(image, |(name, _tag)| name);
        ensure!(name == renamed, "{file} runs {image}, which the kustomization's images entry ({renamed}) misses");
        assert_eq!(container["imagePullPolicy"], "IfNotPresent", "{file}");
    }
    Ok(())
}
