//! The real control-plane binary: killed and restarted under its replicas, inspected with
//! grpcurl, and its `config validate` command.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use continuum_proto::model::WorkerKey;
use continuum_tests::process::{ANY_PORT, ControlPlaneProcess, free_port};
use continuum_tests::{eventually, start_replicas, tools};

const CONVERGE: Duration = Duration::from_secs(20);

/// A static-fleet configuration with workers of the given ids.
fn static_config(dir: &Path, name: &str, ids: &[u64]) -> anyhow::Result<std::path::PathBuf> {
    let mut yaml =
        String::from("dynamo:\n  enabled: true\n  discovery:\n    source: static\n    static:\n      workers:\n");
    for id in ids {
        let role = if id % 2 == 0 { "decode" } else { "prefill" };
        yaml.push_str(&format!("        - {{instance_id: {id}, role: {role}, model: tiny, block_size: 16}}\n"));
    }
    yaml.push_str("admin:\n  listen: \"127.0.0.1:0\"\n");
    let path = dir.join(name);
    std::fs::write(&path, yaml)?;
    Ok(path)
}

fn ids(replica: &continuum_data_plane::replica::Replica) -> Vec<u64> {
    replica.fleet.view().map(|v| v.workers().keys().map(|k| k.instance_id).collect()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_keep_last_known_good_while_the_control_plane_is_killed_then_converge_on_its_new_fleet()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let before = static_config(dir.path(), "before.yaml", &[1, 2, 3, 4])?;
    let after = static_config(dir.path(), "after.yaml", &[2, 3, 4, 5, 6])?;
    let grpc = free_port()?;

    let control = ControlPlaneProcess::start(&before, grpc).await?;
    let replicas = start_replicas(2, &control.grpc_url()).await?;
    for replica in &replicas {
        eventually(CONVERGE, "first fleet", || async { ids(replica) == [1, 2, 3, 4] }).await?;
    }

    control.kill().await?;
    for replica in &replicas {
        eventually(CONVERGE, "the replica noticing the loss", || async {
            !replica.fleet.status(std::time::Instant::now()).connected
        })
        .await?;
    }
    // Last-known-good: the workers stay, readiness stays, and the view's age grows.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for replica in &replicas {
        assert_eq!(ids(replica), [1, 2, 3, 4], "workers are kept while the control plane is away");
        let readyz: serde_json::Value =
            reqwest::get(format!("http://{}/readyz", replica.local_addr)).await?.error_for_status()?.json().await?;
        assert_eq!(readyz["ready"], true);
        assert_eq!(readyz["fleet"]["connected"], false);
        let age = readyz["fleet"]["snapshot_age_seconds"].as_f64().unwrap_or(0.0);
        assert!(age >= 0.2, "snapshot age {age} reports the outage");
        let metrics = reqwest::get(format!("http://{}/metrics", replica.local_addr)).await?.text().await?;
        assert!(metrics.contains("continuum_fleet_stream_connected 0"), "{metrics}");
    }

    let control = ControlPlaneProcess::start(&after, grpc).await?;
    for replica in &replicas {
        eventually(CONVERGE, "the new fleet", || async { ids(replica) == [2, 3, 4, 5, 6] }).await?;
        let view = replica.fleet.view().ok_or_else(|| anyhow::anyhow!("no view"))?;
        assert!(view.worker(&WorkerKey::new("dynamo", 1)).is_none(), "a worker removed while away is gone");
    }
    for replica in replicas {
        replica.shutdown().await;
    }
    control.kill().await?;
    Ok(())
}

fn run(binary: &Path, args: &[&str]) -> anyhow::Result<Output> {
    Ok(std::process::Command::new(binary).args(args).output()?)
}

#[test]
fn a_replica_refuses_flags_it_could_never_follow_a_control_plane_with() -> anyhow::Result<()> {
    let binary = tools::binary("continuum-data-plane");
    let too_long = "r".repeat(129);
    let not_pem = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let rows: [(&[&str], &str); 14] = [
        (&["--control-plane", "grpc://127.0.0.1:50051"], "http:// or https:// URL"),
        (&["--control-plane", "https://127.0.0.1:50051"], "needs --control-plane-ca"),
        (&["--control-plane", "https://127.0.0.1:50051", "--control-plane-ca", "/nonexistent/ca.pem"], "cannot read"),
        (&["--control-plane", "https://127.0.0.1:50051", "--control-plane-ca", not_pem], "holds no PEM certificate"),
        (&["--control-plane", "http://127.0.0.1:9", "--control-plane-ca", "/ca.pem"], "need an https://"),
        (&["--control-plane", "http://127.0.0.1:9", "--control-plane-cert", "/c.pem"], "--control-plane-key"),
        (&["--control-plane", "http://127.0.0.1:9", "--control-plane-token", "two words"], "visible ASCII"),
        (&["--control-plane", "http://127.0.0.1:9", "--replica-id", ""], "1 to 128 printable ASCII characters"),
        (&["--control-plane", "http://127.0.0.1:9", "--replica-id", &too_long], "1 to 128 printable ASCII characters"),
        // Written into log lines as it is: a line break would forge lines of its own.
        (&["--control-plane", "http://127.0.0.1:9", "--replica-id", "r1\nINFO forged"], "without spaces"),
        (&["--control-plane", "http://127.0.0.1:9", "--worker-threads", "0"], "within 1..=1024"),
        (&["--control-plane", "http://127.0.0.1:9", "--worker-threads", "1152921504606846976"], "within 1..=1024"),
        (
            &["--control-plane", "http://127.0.0.1:9", "--find-matches-deadline", "0s"],
            "--find-matches-deadline must be",
        ),
        (
            &["--control-plane", "http://127.0.0.1:9", "--find-matches-deadline", "1h"],
            "--find-matches-deadline must be",
        ),
    ];
    for (args, says) in rows {
        let out = run(&binary, args)?;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8(out.stderr)?;
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_describes_and_reads_the_snapshot_over_reflection() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[7_587_890_000_000_000_123, 2])?;
    let control = ControlPlaneProcess::start(&config, ANY_PORT).await?;
    let grpcurl = tools::grpcurl();
    let addr = control.grpc_addr.to_string();

    let list = run(&grpcurl, &["-plaintext", &addr, "list"])?;
    let services = String::from_utf8(list.stdout)?;
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    for service in ["continuum.fleet.v1.Fleet", "grpc.health.v1.Health"] {
        assert!(services.lines().any(|l| l == service), "{service} missing from:\n{services}");
    }

    let describe = run(&grpcurl, &["-plaintext", &addr, "describe", "continuum.fleet.v1.Fleet"])?;
    let text = String::from_utf8(describe.stdout)?;
    assert!(
        text.contains(
            "rpc Watch ( stream .continuum.fleet.v1.WatchRequest ) returns ( stream .continuum.fleet.v1.FleetUpdate )"
        ),
        "{text}"
    );
    assert!(text.contains("rpc GetSnapshot"), "{text}");

    let get = run(&grpcurl, &["-plaintext", &addr, "continuum.fleet.v1.Fleet/GetSnapshot"])?;
    assert!(get.status.success(), "{}", String::from_utf8_lossy(&get.stderr));
    let snapshot: serde_json::Value = serde_json::from_slice(&get.stdout)?;
    let ids: Vec<&str> = snapshot["workers"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no workers in {snapshot}"))?
        .iter()
        .filter_map(|w| w["key"]["instanceId"].as_str())
        .collect();
    // proto3 JSON renders uint64 as strings, so ids above 2^53 keep every digit.
    assert_eq!(ids, ["2", "7587890000000000123"]);

    let health = run(&grpcurl, &["-plaintext", &addr, "grpc.health.v1.Health/Check"])?;
    assert!(String::from_utf8(health.stdout)?.contains("SERVING"));
    control.kill().await?;
    Ok(())
}

/// Inside a Kubernetes pod a missing configuration is an error, not the simulated demo fleet.
#[test]
fn without_a_config_inside_a_pod_the_demo_fleet_is_refused() -> anyhow::Result<()> {
    let mut child = std::process::Command::new(tools::binary("continuum-control-plane"))
        .env_remove("CONTINUUM_CONFIG")
        .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--simulator-shim-listen",
            "127.0.0.1:0",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let status = exited_within(&mut child, Duration::from_secs(10))?;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?, &mut stderr)?;
    assert_eq!(status.and_then(|s| s.code()), Some(2), "it must exit at once, refusing:\n{stderr}");
    assert!(stderr.contains("inside a Kubernetes pod"), "{stderr}");
    Ok(())
}

#[test]
fn config_validate_prints_key_paths_and_fails_on_errors() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoint: [\"http://127.0.0.1:2379\"]\n  load:\n    max_staleness: 10ms\n",
    )?;
    let binary = tools::binary("continuum-control-plane");
    let out = run(&binary, &["config", "validate", bad.to_str().unwrap_or_default()])?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(!out.status.success(), "an invalid config must fail validation:\n{stdout}");
    assert!(stdout.contains("dynamo.discovery.etcd.endpoint"), "{stdout}");
    assert!(stdout.contains("did you mean `endpoints`"), "{stdout}");
    assert!(stdout.contains("dynamo.load.max_staleness"), "{stdout}");

    let good = static_config(dir.path(), "good.yaml", &[1])?;
    let out = run(&binary, &["config", "validate", good.to_str().unwrap_or_default()])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));

    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.to_string();
    let out = run(&binary, &["--config", good.to_str().unwrap_or_default(), "--grpc-listen", &port])?;
    assert!(!out.status.success(), "a taken port must fail the start");
    assert!(String::from_utf8(out.stderr)?.contains("cannot listen"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_configuration_file_and_replicas_follow() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[1, 2])?;
    let control = ControlPlaneProcess::start(&config, ANY_PORT).await?;
    let replicas = start_replicas(1, &control.grpc_url()).await?;
    eventually(CONVERGE, "first fleet", || async { ids(&replicas[0]) == [1, 2] }).await?;

    // An invalid file is refused and changes nothing.
    std::fs::write(&config, "dynamo:\n  enabled: yes please\n")?;
    let pid = control.child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?.to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status()?.success());
    let metrics = format!("http://{}/metrics", control.admin_addr);
    let reloads = |result: &'static str| {
        let metrics = metrics.clone();
        async move {
            let text = reqwest::get(metrics).await.ok()?.text().await.ok()?;
            let series = format!("continuum_config_reloads_total{{result=\"{result}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(series.as_str())?.trim().parse::<u64>().ok())
        }
    };
    eventually(CONVERGE, "the reload to be refused", || async { reloads("refused").await == Some(1) }).await?;
    assert_eq!(ids(&replicas[0]), [1, 2], "a refused reload changes nothing");
    let mut control = control;
    assert!(control.child.try_wait()?.is_none(), "a refused reload does not stop the control plane");
    static_config(dir.path(), "fleet.yaml", &[2, 3])?;
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status()?.success());
    eventually(CONVERGE, "the reloaded fleet", || async { ids(&replicas[0]) == [2, 3] }).await?;
    // Counted once the reload returns, which may be a moment after its fleet went out.
    eventually(CONVERGE, "the reload counted", || async { reloads("applied").await == Some(1) }).await?;
    for replica in replicas {
        replica.shutdown().await;
    }
    control.kill().await?;
    Ok(())
}

/// The control plane binary on SIGTERM shuts down and exits cleanly, also when the signal
/// comes right behind a SIGHUP (both are handled, neither kills it), and its replicas keep
/// routing on what they hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_told_to_terminate_behind_a_reload_exits_cleanly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[1, 2])?;
    let mut control = ControlPlaneProcess::start(&config, ANY_PORT).await?;
    let replicas = start_replicas(1, &control.grpc_url()).await?;
    eventually(CONVERGE, "first fleet", || async { ids(&replicas[0]) == [1, 2] }).await?;

    let pid = control.child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?.to_string();
    for signal in ["-HUP", "-TERM"] {
        assert!(std::process::Command::new("kill").args([signal, &pid]).status()?.success());
    }
    let exit = tokio::time::timeout(Duration::from_secs(30), control.child.wait()).await??;
    assert!(exit.success(), "a clean shutdown, not the signal's default action: {exit}");
    assert_eq!(ids(&replicas[0]), [1, 2], "the replica keeps its last-known-good fleet");
    for replica in replicas {
        replica.shutdown().await;
    }
    Ok(())
}

/// `--simulator-shim-listen` bypasses the file's validation: a reload to the simulator that the
/// flag would make invalid (a shim on port 0) is refused, as the same start would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_the_simulator_flag_makes_invalid_is_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[1, 2])?;
    let control =
        ControlPlaneProcess::start_with(&config, ANY_PORT, &["--simulator-shim-listen", "127.0.0.1:0"]).await?;
    let simulated =
        "dynamo:\n  enabled: true\n  discovery:\n    source: simulator\nadmin:\n  listen: \"127.0.0.1:0\"\n";
    std::fs::write(&config, simulated)?;
    let pid = control.child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?.to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status()?.success());
    let metrics = format!("http://{}/metrics", control.admin_addr);
    eventually(CONVERGE, "the reload to be refused", || async {
        let text = reqwest::get(&metrics).await.ok().map(|r| r.text());
        let Some(text) = text else { return false };
        text.await.is_ok_and(|t| t.contains("continuum_config_reloads_total{result=\"refused\"} 1"))
    })
    .await?;
    control.kill().await?;
    Ok(())
}

/// A reload stuck reading its file (a stalled volume; here a FIFO nobody writes, whose open
/// blocks) leaves the process listening for the signals that end it: SIGTERM abandons the
/// reload, and the process exits without waiting for the stuck read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_stuck_on_its_file_does_not_keep_the_control_plane_from_exiting() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[1, 2])?;
    let mut control = ControlPlaneProcess::start(&config, ANY_PORT).await?;
    std::fs::remove_file(&config)?;
    anyhow::ensure!(std::process::Command::new("mkfifo").arg(&config).status()?.success(), "mkfifo");
    let pid = control.child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?.to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status()?.success());
    // The reload is under way, one of the process's threads blocked opening the FIFO, before
    // the stop comes.
    eventually(CONVERGE, "a thread blocked opening the FIFO", || async { blocked_on_a_fifo(&pid) }).await?;
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status()?.success());
    let exit = tokio::time::timeout(Duration::from_secs(30), control.child.wait()).await;
    // Whatever happened, nothing stays blocked on the FIFO once the test is done with it.
    drop(std::fs::OpenOptions::new().write(true).custom_flags(libc_nonblock()).open(&config));
    let exit = exit.map_err(|_| anyhow::anyhow!("the control plane did not exit with its reload stuck"))??;
    assert!(exit.success(), "a clean shutdown: {exit}");
    Ok(())
}

/// A configuration file that does not read as the control plane starts (a stalled volume:
/// here a FIFO no one writes) ends it with a clear error, rather than leave it up serving
/// nothing.
#[test]
fn a_configuration_that_does_not_read_at_start_ends_the_process_with_a_clear_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("stalled.yaml");
    anyhow::ensure!(std::process::Command::new("mkfifo").arg(&config).status()?.success(), "mkfifo");
    let mut child = std::process::Command::new(tools::binary("continuum-control-plane"))
        .env_remove("CONTINUUM_CONFIG")
        .arg("--config")
        .arg(&config)
        .args(["--grpc-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let status = exited_within(&mut child, Duration::from_secs(60))?;
    // Whatever happened, nothing stays blocked on the FIFO once the test is done with it.
    drop(std::fs::OpenOptions::new().write(true).custom_flags(libc_nonblock()).open(&config));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().ok_or_else(|| anyhow::anyhow!("no stderr"))?, &mut stderr)?;
    assert_eq!(status.and_then(|s| s.code()), Some(2), "it must exit, refusing:\n{stderr}");
    assert!(stderr.contains("did not read within"), "{stderr}");
    Ok(())
}

/// How `child` exited, if it did within `wait`; killed otherwise.
fn exited_within(child: &mut std::process::Child, wait: Duration) -> anyhow::Result<Option<std::process::ExitStatus>> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if std::time::Instant::now() > deadline {
            child.kill()?;
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a thread of process `pid` waits in the kernel for a FIFO's other end
/// (`wait_for_partner`, where an `open` of a FIFO nobody writes blocks).
fn blocked_on_a_fifo(pid: &str) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("wchan")).is_ok_and(|wchan| wchan.trim() == "wait_for_partner")
    })
}

/// `O_NONBLOCK`: opening a FIFO for writing with no reader fails at once instead of blocking.
fn libc_nonblock() -> i32 {
    0o4000
}

/// The replica binary on SIGTERM: readiness fails at once while it still answers, then it exits
/// cleanly once its drain delay is over and nothing is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_told_to_terminate_fails_readiness_for_its_drain_delay_then_exits() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = static_config(dir.path(), "fleet.yaml", &[1, 2])?;
    let control = ControlPlaneProcess::start(&config, ANY_PORT).await?;
    let listen = free_port()?;
    let mut replica = tokio::process::Command::new(tools::binary("continuum-data-plane"))
        .args(["--listen", &listen.to_string(), "--control-plane", &control.grpc_url()])
        .args(["--drain-delay", "5s", "--shutdown-grace", "5s"])
        .kill_on_drop(true)
        .spawn()?;
    let readyz = format!("http://{listen}/readyz");
    let status = || async { reqwest::get(&readyz).await.map(|r| r.status().as_u16()).unwrap_or_default() };
    eventually(CONVERGE, "the replica ready", || async { status().await == 200 }).await?;

    let pid = replica.id().ok_or_else(|| anyhow::anyhow!("the replica exited early"))?;
    let signalled_at = std::time::Instant::now();
    let signalled = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
    assert!(signalled.success());
    eventually(Duration::from_secs(5), "readiness failing while the replica still answers", || async {
        status().await == 503
    })
    .await?;
    let exit = tokio::time::timeout(Duration::from_secs(15), replica.wait()).await??;
    assert!(exit.success(), "{exit}");
    assert!(signalled_at.elapsed() >= Duration::from_secs(5), "it waited out its drain delay");
    control.kill().await?;
    Ok(())
}
