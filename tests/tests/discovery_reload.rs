//! Live reload of the discovery configuration against a real etcd: each reload class does what
//! the product document says, and kept graphs stay routable throughout.

use std::time::Duration;

use continuum_control_plane::app::{ControlPlane, ListenOverrides};
use continuum_control_plane::config::{self, Config, DiscoverySource};
use continuum_control_plane::fleet::Catchup;
use continuum_proto::model::WorkerKey;
use continuum_tests::etcd::{Etcd, decode_worker_records};
use continuum_tests::eventually;
use continuum_tests::process::free_port;

const CONVERGE: Duration = Duration::from_secs(30);

fn config(etcd: &Etcd, discovery: &str, namespaces: &[&str]) -> anyhow::Result<Config> {
    let mut yaml = format!(
        "dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      endpoints: [\"{}\"]\n{discovery}  \
         load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  shim:\n    pools:\n",
        etcd.client_url
    );
    for ns in namespaces {
        yaml.push_str(&format!("      - {{namespace: {ns}, backends: [shim-{ns}]}}\n"));
    }
    yaml.push_str("backends:\n");
    for ns in namespaces {
        yaml.push_str(&format!(
            "  - {{name: shim-{ns}, type: openai, url: \"http://127.0.0.1:8000\", role: unified}}\n"
        ));
    }
    yaml.push_str("control_plane:\n  grpc_listen: \"127.0.0.1:0\"\nadmin:\n  listen: \"127.0.0.1:0\"\n");
    let loaded = config::load_str(&yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}\n{yaml}"))?;
    Ok(loaded.config)
}

async fn put_worker(etcd: &Etcd, namespace: &str, id: u64) -> anyhow::Result<()> {
    let mut client = etcd.client().await?;
    for (key, value) in decode_worker_records(namespace, id, "tiny") {
        client.put(key, value, None).await?;
    }
    Ok(())
}

fn workers(control: &ControlPlane) -> Vec<(String, u64)> {
    let state = control.publisher.current();
    let mut workers: Vec<_> = state.view().workers().keys().map(|k| (k.namespace.to_string(), k.instance_id)).collect();
    workers.sort();
    workers
}

/// Whether any delta published since `version` removed `key`.
fn removed_since(control: &ControlPlane, version: u64, key: &WorkerKey) -> bool {
    match control.publisher.current().catchup(Some(version)) {
        Catchup::UpToDate => false,
        Catchup::Delta(delta) => delta.removed.contains(key),
        Catchup::Snapshot(_) => panic!("the delta log no longer covers version {version}"),
    }
}

fn restarts(control: &ControlPlane) -> u64 {
    control.metrics.discovery_events.with_label_values(&["restart"]).get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_namespace_prunes_it_and_kept_graphs_stay_routable() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_worker(&etcd, "prod", 11).await?;
    put_worker(&etcd, "canary", 22).await?;
    let both = config(&etcd, "      namespaces: [prod, canary]\n", &["prod", "canary"])?;
    let mut control = ControlPlane::start(both, ListenOverrides::default()).await?;
    let expected = vec![("canary".to_string(), 22), ("prod".to_string(), 11)];
    eventually(CONVERGE, "both graphs", || async { workers(&control) == expected }).await?;

    let before = control.publisher.current().version();
    control.reload(config(&etcd, "      namespaces: [prod]\n", &["prod"])?).await?;
    assert_eq!(workers(&control), [("prod".to_string(), 11)], "the removed graph is pruned at once");
    assert_eq!(restarts(&control), 1);
    // The replacement watcher resyncs the kept graph; it must never have left the view.
    eventually(CONVERGE, "discovery reconnected", || async { control.metrics.discovery_connected.get() == 1 }).await?;
    put_worker(&etcd, "canary", 23).await?;
    put_worker(&etcd, "prod", 12).await?;
    eventually(CONVERGE, "the kept graph's new worker", || async { workers(&control).len() == 2 }).await?;
    assert_eq!(workers(&control), [("prod".to_string(), 11), ("prod".to_string(), 12)]);
    assert!(
        !removed_since(&control, before, &WorkerKey::new("prod", 11)),
        "a kept worker was dropped during the reload"
    );
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backoff_only_change_keeps_the_fleet_readable_while_the_watcher_is_replaced() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_worker(&etcd, "dynamo", 5).await?;
    let mut control = ControlPlane::start(config(&etcd, "", &["dynamo"])?, ListenOverrides::default()).await?;
    eventually(CONVERGE, "the worker", || async { workers(&control).len() == 1 }).await?;

    let before = control.publisher.current().version();
    let backoff = "      watch_reconnect_backoff: {initial: 200ms, max: 2s}\n";
    control.reload(config(&etcd, backoff, &["dynamo"])?).await?;
    assert_eq!(restarts(&control), 1, "a backoff change replaces the watcher");
    assert_eq!(workers(&control).len(), 1, "the snapshot stays readable");
    put_worker(&etcd, "dynamo", 6).await?;
    eventually(CONVERGE, "the replacement watching", || async { workers(&control).len() == 2 }).await?;
    assert!(!removed_since(&control, before, &WorkerKey::new("dynamo", 5)));

    // Reloading the same configuration changes nothing.
    control.reload(config(&etcd, backoff, &["dynamo"])?).await?;
    assert_eq!(restarts(&control), 1);
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_namespace_resets_the_registry_and_discovers_the_new_graph() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_worker(&etcd, "blue", 1).await?;
    put_worker(&etcd, "green", 2).await?;
    let mut control =
        ControlPlane::start(config(&etcd, "      namespace: blue\n", &[])?, ListenOverrides::default()).await?;
    eventually(CONVERGE, "blue", || async { workers(&control) == [("blue".to_string(), 1)] }).await?;

    control.reload(config(&etcd, "      namespace: green\n", &[])?).await?;
    assert_eq!(restarts(&control), 1);
    eventually(CONVERGE, "green", || async { workers(&control) == [("green".to_string(), 2)] }).await?;
    let readyz = format!("http://{}/readyz", control.admin_addr);
    let ready = || async { reqwest::get(&readyz).await.map(|r| r.status().as_u16()).unwrap_or_default() };
    assert_eq!(ready().await, 200);

    control.shutdown().await;
    Ok(())
}

/// New connection settings (a rotated password, other endpoints) reach the same fleet another
/// way: replicas following keep every worker while the new watcher connects, and for as long
/// as it cannot, as when etcd is unreachable; its first read then replaces the fleet whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_connection_settings_keep_the_fleet_until_the_new_watcher_reads_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = Etcd::start(dir.path(), &[]).await?;
    put_worker(&etcd, "green", 2).await?;
    let mut control =
        ControlPlane::start(config(&etcd, "      namespace: green\n", &[])?, ListenOverrides::default()).await?;
    eventually(CONVERGE, "green", || async { workers(&control) == [("green".to_string(), 2)] }).await?;
    let before = control.publisher.current().version();
    let readyz = format!("http://{}/readyz", control.admin_addr);
    let ready = || async { reqwest::get(&readyz).await.map(|r| r.status().as_u16()).unwrap_or_default() };

    let mut unreachable = config(&etcd, "      namespace: green\n", &[])?;
    // Port 1: no etcd a test beside this one starts can take it.
    unreachable.dynamo.discovery.etcd.endpoints = vec!["http://127.0.0.1:1".to_string()];
    control.reload(unreachable).await?;
    assert_eq!(restarts(&control), 1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(workers(&control), [("green".to_string(), 2)], "kept while the new endpoints answer nothing");
    assert!(!removed_since(&control, before, &WorkerKey::new("green", 2)), "never sent as removed");
    assert_eq!(ready().await, 200, "what it holds is the fleet's last-known state");

    // Back to endpoints that answer, where the fleet changed meanwhile: the first read replaces it.
    etcd.client().await?.delete("v1/", Some(etcd_client::DeleteOptions::new().with_prefix())).await?;
    put_worker(&etcd, "green", 3).await?;
    control.reload(config(&etcd, "      namespace: green\n", &[])?).await?;
    eventually(CONVERGE, "the new read", || async { workers(&control) == [("green".to_string(), 3)] }).await?;
    control.shutdown().await;
    Ok(())
}

/// The embedded default's simulated fleet on ports of its own, once its four workers are in
/// the view, and the configuration it runs.
async fn simulated() -> anyhow::Result<(Config, ControlPlane)> {
    let mut config = config::embedded_default();
    config.move_simulator_shim(free_port()?);
    config.control_plane.grpc_listen = "127.0.0.1:0".parse()?;
    config.admin.listen = "127.0.0.1:0".parse()?;
    let control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    eventually(CONVERGE, "the simulated workers", || async { workers(&control).len() == 4 }).await?;
    Ok((config, control))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_that_cannot_start_gives_way_to_the_one_running_and_the_reload_is_refused() -> anyhow::Result<()> {
    let (config, mut control) = simulated().await?;

    // The new shim's port is taken: the new simulator cannot bind it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut clashing = config.clone();
    clashing.move_simulator_shim(taken.local_addr()?);
    clashing.dynamo.discovery.simulator.prefill = 3;
    let restarts = control.metrics.discovery_events.with_label_values(&["restart"]);
    let before = restarts.get();
    assert!(control.reload(clashing).await.is_err(), "the reload is refused");
    // Refused before the running source stopped: the replicas were never sent an empty fleet.
    assert_eq!(restarts.get(), before, "the running simulator was not replaced, even for a moment");
    assert_eq!(workers(&control).len(), 4);

    // The running configuration is still the old one: a good reload applies in full.
    let mut grown = config.clone();
    grown.move_simulator_shim(free_port()?);
    grown.dynamo.discovery.simulator.prefill = 3;
    control.reload(grown).await?;
    eventually(CONVERGE, "the grown simulated fleet", || async { workers(&control).len() == 5 }).await?;
    // A simulated fleet has no connection to lose: it reads as connected, after a restart too.
    assert_eq!(control.metrics.discovery_connected.get(), 1);
    control.shutdown().await;
    Ok(())
}

/// A source this build does not have is refused on reload as at start, before the running
/// one stops: the replicas are never sent an empty fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_a_source_not_built_is_refused_and_the_running_one_stays() -> anyhow::Result<()> {
    let (config, mut control) = simulated().await?;
    let before = (restarts(&control), control.publisher.current().version());
    for source in [DiscoverySource::Kubernetes, DiscoverySource::KubernetesPods] {
        let mut unbuilt = config.clone();
        unbuilt.dynamo.discovery.source = source;
        let refused = control.reload(unbuilt).await.map(drop).expect_err("a source this build does not have");
        assert!(refused.to_string().contains("not available"), "{refused}");
    }
    assert_eq!((restarts(&control), control.publisher.current().version()), before, "nothing was replaced");
    assert_eq!(workers(&control).len(), 4);
    control.shutdown().await;
    Ok(())
}

/// A reload to etcd whose TLS files do not load is refused before the running source stops,
/// saying which file and why: a watcher that could never connect would otherwise replace it,
/// and the last fleet stay published with no watch behind it. Files that load are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_etcd_whose_tls_files_do_not_load_is_refused() -> anyhow::Result<()> {
    use continuum_control_plane::config::{EtcdTlsConfig, Secret};
    use continuum_tests::pki::Pki;

    let (config, mut control) = simulated().await?;
    let before = (restarts(&control), control.publisher.current().version());
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(dir.path())?;
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "not a certificate")?;
    let port = free_port()?;
    let with_tls = |ca: &std::path::Path, key: &std::path::Path| {
        let mut etcd = config.clone();
        etcd.dynamo.discovery.source = DiscoverySource::Etcd;
        etcd.dynamo.discovery.etcd.endpoints = vec![format!("https://{port}")];
        etcd.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig {
            ca_cert: Some(ca.to_path_buf()),
            client_cert: Some(pki.client_cert.clone()),
            client_key: Some(Secret::new(key.display().to_string())),
            server_name: None,
        });
        etcd
    };
    let cases = [
        (with_tls(&dir.path().join("missing.pem"), &pki.client_key), "ca_cert"),
        (with_tls(&not_pem, &pki.client_key), "holds no PEM certificate"),
        (with_tls(&pki.ca_cert, &not_pem), "client_key"),
    ];
    for (refused, says) in cases {
        let error = control.reload(refused).await.map(drop).expect_err("files that do not load");
        assert!(error.to_string().contains(says), "{error}");
        if says == "client_key" {
            assert!(!error.to_string().contains(&*not_pem.to_string_lossy()), "the key's path is masked: {error}");
        }
    }
    assert_eq!((restarts(&control), control.publisher.current().version()), before, "nothing was replaced");
    control.reload(with_tls(&pki.ca_cert, &pki.client_key)).await?;
    control.shutdown().await;
    Ok(())
}

/// The shim address the simulated workers' cards name (their artifacts are served by it).
fn carded_shim(control: &ControlPlane) -> Option<String> {
    let state = control.publisher.current();
    let worker = state.view().workers().values().next()?.clone();
    let uri = worker.artifacts.as_ref()?.tokenizer.as_ref()?.uri.clone();
    Some(uri.trim_start_matches("http://").split('/').next()?.to_owned())
}

/// A simulator restarted on the same shim address listens on the socket the last one held: the
/// port is never free between the two, so nothing can take it and the restart cannot fail on
/// it, and a shim asked for on port 0 keeps the port the workers' cards name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_restarted_on_its_shim_address_keeps_the_shims_socket() -> anyhow::Result<()> {
    let mut config = config::embedded_default();
    config.move_simulator_shim("127.0.0.1:0".parse()?);
    config.control_plane.grpc_listen = "127.0.0.1:0".parse()?;
    config.admin.listen = "127.0.0.1:0".parse()?;
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    eventually(CONVERGE, "the simulated workers", || async { workers(&control).len() == 4 }).await?;
    let shim = carded_shim(&control).expect("the cards name the shim");

    let mut grown = config.clone();
    grown.dynamo.discovery.simulator.prefill = 3;
    control.reload(grown).await?;
    eventually(CONVERGE, "the grown simulated fleet", || async { workers(&control).len() == 5 }).await?;
    assert_eq!(carded_shim(&control), Some(shim.clone()), "the same port");
    assert!(std::net::TcpListener::bind(&shim).is_err(), "and it is held");
    let models = reqwest::get(format!("http://{shim}/v1/models")).await?;
    assert!(models.status().is_success(), "the restarted shim serves on it: {}", models.status());
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_control_plane_refuses_watches_until_seeded_so_replicas_keep_their_last_view() -> anyhow::Result<()>
{
    let mut first = config::embedded_default();
    first.move_simulator_shim("127.0.0.1:0".parse()?);
    first.control_plane.grpc_listen = "127.0.0.1:0".parse()?;
    first.admin.listen = "127.0.0.1:0".parse()?;
    let control = ControlPlane::start(first, ListenOverrides::default()).await?;
    let grpc = control.grpc_addr;
    let replicas = continuum_tests::start_replicas(1, &format!("http://{grpc}")).await?;
    let workers = || replicas[0].fleet.view().map_or(0, |view| view.workers().len());
    eventually(CONVERGE, "the replica holds the simulated fleet", || async { workers() == 4 }).await?;
    control.shutdown().await;

    // The control plane comes back on the same address, reading an etcd that does not answer
    // (port 1 on loopback refuses at once): it has no fleet to give yet.
    let mut second = config::embedded_default();
    second.dynamo.discovery.source = config::DiscoverySource::Etcd;
    second.dynamo.discovery.etcd.endpoints = vec!["127.0.0.1:1".into()];
    second.control_plane.grpc_listen = grpc;
    second.admin.listen = "127.0.0.1:0".parse()?;
    let control = ControlPlane::start(second, ListenOverrides::default()).await?;
    let refused = control.metrics.watch_refused.with_label_values(&["not_seeded"]);
    eventually(CONVERGE, "the replica's Watch refused", || async { refused.get() > 0 }).await?;
    assert_eq!(workers(), 4, "the replica routes on its last-known-good view, not an empty one");
    assert!(control.replicas.list().is_empty(), "no session was opened on an unseeded fleet");
    control.shutdown().await;
    for replica in replicas {
        continuum_data_plane::replica::Replica::shutdown(replica).await;
    }
    Ok(())
}
