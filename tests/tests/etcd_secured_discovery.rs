//! etcd discovery against a secured real etcd: mutual TLS with certificates the test mints, and
//! password authentication as a user whose only permission is reading `v1/`. Misconfigured
//! control planes are shown to fail pass after pass without ever connecting or publishing.

use std::time::Duration;

use continuum_control_plane::app::{ControlPlane, ListenOverrides};
use continuum_control_plane::config;
use continuum_tests::etcd::{Etcd, delete_worker, discovery_yaml, lease, put_workers};
use continuum_tests::eventually;
use continuum_tests::pki::Pki;
use continuum_tests::proxy::Proxy;
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(15);

/// Failed passes (dial, fail, back off) before a misconfigured control plane is judged: three
/// prove it keeps retrying and keeps failing.
const FAILED_PASSES: usize = 3;

/// etcd's count of Authenticate calls it refused for bad credentials.
const REFUSED_AUTHENTICATIONS: &str = "grpc_server_handled_total{grpc_code=\"InvalidArgument\",\
     grpc_method=\"Authenticate\",grpc_service=\"etcdserverpb.Auth\",grpc_type=\"unary\"}";

const ROOT_PASSWORD: &str = "root-s3cret";
const ROUTER_PASSWORD: &str = "router-s3cret";

async fn control_plane(etcd_section: serde_json::Value) -> anyhow::Result<ControlPlane> {
    let loaded = config::load_str(&discovery_yaml(etcd_section), &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(ControlPlane::start(loaded.config, ListenOverrides::default()).await?)
}

fn worker_ids(control: &ControlPlane) -> Vec<u64> {
    control.publisher.current().view().workers().keys().map(|k| k.instance_id).collect()
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

/// Checks that a misconfigured `control`, after failing several passes, never connected, never
/// seeded and published no worker.
fn assert_never_connected(control: &ControlPlane, case: &str) {
    assert_eq!(control.metrics.discovery_connected.get(), 0, "{case}: connected");
    assert_eq!(control.metrics.discovery_events.with_label_values(&["resync"]).get(), 0, "{case}: seeded");
    assert!(worker_ids(control).is_empty(), "{case}: published {:?}", worker_ids(control));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_discovered_over_mutual_tls_with_a_client_certificate() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"))?;
    let etcd = Etcd::start_tls(dir.path(), &pki, &[]).await?;
    let mut writer = etcd.client().await?;
    put_workers(&mut writer, (0..3).map(lease)).await?;

    let control = control_plane(json!({
        "endpoints": [etcd.client_url],
        "tls": {"ca_cert": path(&pki.ca_cert), "client_cert": path(&pki.client_cert),
            "client_key": path(&pki.client_key), "server_name": "localhost"},
    }))
    .await?;
    let first: Vec<u64> = (0..3).map(lease).collect();
    eventually(CONVERGE, "the seeded workers", || async { worker_ids(&control) == first }).await?;
    eventually(CONVERGE, "discovery connected", || async { control.metrics.discovery_connected.get() == 1 }).await?;

    // The watch runs over the same TLS channel.
    delete_worker(&mut writer, lease(1)).await?;
    put_workers(&mut writer, [lease(3)]).await?;
    let watched = [lease(0), lease(2), lease(3)];
    eventually(CONVERGE, "the watched changes", || async { worker_ids(&control) == watched }).await?;
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_certificate_or_trusting_another_ca_discovery_never_connects() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"))?;
    let foreign = Pki::generate(&dir.path().join("foreign-pki"))?;
    let etcd = Etcd::start_tls(dir.path(), &pki, &[]).await?;
    put_workers(&mut etcd.client().await?, (0..3).map(lease)).await?;
    // Every control plane dials through the proxy, which counts its attempts.
    let proxy = Proxy::start(etcd.client_addr()?).await?;
    let endpoint = format!("https://{}", proxy.addr);

    let no_client_cert = json!({"ca_cert": path(&pki.ca_cert), "server_name": "localhost"});
    // The foreign CA bears the same name as the real one, so only its key tells them apart.
    let foreign_ca = json!({"ca_cert": path(&foreign.ca_cert), "client_cert": path(&pki.client_cert),
        "client_key": path(&pki.client_key), "server_name": "localhost"});
    for (case, tls) in [("no client certificate", no_client_cert), ("another CA trusted", foreign_ca)] {
        let dials = proxy.connections() + FAILED_PASSES;
        let control = control_plane(json!({"endpoints": [endpoint], "tls": tls})).await?;
        eventually(CONVERGE, &format!("{case}: failed dials"), || async { proxy.connections() >= dials }).await?;
        assert_never_connected(&control, case);
        control.shutdown().await;
    }

    // The same path with the right material connects, so the refusals above were TLS's.
    let control = control_plane(json!({"endpoints": [endpoint], "tls": {"ca_cert": path(&pki.ca_cert),
        "client_cert": path(&pki.client_cert), "client_key": path(&pki.client_key), "server_name": "localhost"}}))
    .await?;
    eventually(CONVERGE, "the workers through the proxy", || async { worker_ids(&control).len() == 3 }).await?;
    control.shutdown().await;
    Ok(())
}

/// A plaintext etcd with auth enabled: `root`, and `router` whose role may only read `v1/`.
async fn etcd_with_read_only_router(dir: &std::path::Path) -> anyhow::Result<Etcd> {
    let etcd = Etcd::start(dir, &[]).await?;
    let root = format!("root:{ROOT_PASSWORD}");
    let router = format!("router:{ROUTER_PASSWORD}");
    etcd.ctl(&["user", "add", &root]).await?;
    etcd.ctl(&["role", "add", "reader"]).await?;
    etcd.ctl(&["role", "grant-permission", "reader", "--prefix=true", "read", "v1/"]).await?;
    etcd.ctl(&["user", "add", &router]).await?;
    etcd.ctl(&["user", "grant-role", "router", "reader"]).await?;
    etcd.ctl(&["auth", "enable"]).await?;
    Ok(etcd)
}

fn router_auth(password: &str) -> serde_json::Value {
    json!({"username": "router", "password": password})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_may_only_read_v1_discovers_and_watches_the_fleet() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = etcd_with_read_only_router(dir.path()).await?;
    let mut root = etcd.client_as("root", ROOT_PASSWORD).await?;
    put_workers(&mut root, (0..3).map(lease)).await?;
    // The premise: this user cannot write, so discovery works without writing anything.
    let mut reader = etcd.client_as("router", ROUTER_PASSWORD).await?;
    let refused = reader.put("v1/instances/dynamo/backend/generate/1", "{}", None).await;
    assert!(refused.is_err_and(|e| e.to_string().contains("permission denied")), "router wrote to v1/");

    let control = control_plane(json!({"endpoints": [etcd.client_url], "auth": router_auth(ROUTER_PASSWORD)})).await?;
    let first: Vec<u64> = (0..3).map(lease).collect();
    eventually(CONVERGE, "the seeded workers", || async { worker_ids(&control) == first }).await?;
    eventually(CONVERGE, "discovery connected", || async { control.metrics.discovery_connected.get() == 1 }).await?;

    delete_worker(&mut root, lease(0)).await?;
    put_workers(&mut root, [lease(3)]).await?;
    let watched = [lease(1), lease(2), lease(3)];
    eventually(CONVERGE, "the watched changes", || async { worker_ids(&control) == watched }).await?;
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_etcd_password_never_connects() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let etcd = etcd_with_read_only_router(dir.path()).await?;
    put_workers(&mut etcd.client_as("root", ROOT_PASSWORD).await?, (0..3).map(lease)).await?;

    let control =
        control_plane(json!({"endpoints": [etcd.client_url], "auth": router_auth("not-the-password")})).await?;
    eventually(CONVERGE, "etcd to refuse the password on several passes", || async {
        etcd.metric(REFUSED_AUTHENTICATIONS).await.is_ok_and(|n| n >= FAILED_PASSES as f64)
    })
    .await?;
    assert_never_connected(&control, "a wrong password");
    control.shutdown().await;

    let control = control_plane(json!({"endpoints": [etcd.client_url], "auth": router_auth(ROUTER_PASSWORD)})).await?;
    eventually(CONVERGE, "the workers with the right password", || async { worker_ids(&control).len() == 3 }).await?;
    control.shutdown().await;
    Ok(())
}
