//! The README's first command, as a newcomer runs it: `scripts/demo` builds what it needs,
//! starts the control plane on its embedded default and a data-plane replica, and prints a
//! banner with a curl line. That request is routed, with the pins the shim echoes, and Ctrl-C
//! stops both processes.

use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use continuum_tests::process::free_port;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Relinking at most the two binaries (scripts/test built their dependencies as the demo
/// resolves them) and starting both processes.
const BANNER_WITHIN: Duration = Duration::from_secs(120);
const STOPPED_WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_first_command_routes_the_request_its_banner_prints_and_stops_on_ctrl_c() -> anyhow::Result<()> {
    let (listen, admin, grpc, shim) = (free_port()?, free_port()?, free_port()?, free_port()?);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/demo");
    let mut command = std::process::Command::new("bash");
    command.arg(script).process_group(0).stdout(Stdio::piped()).stderr(Stdio::inherit());
    for (name, addr) in [("LISTEN", listen), ("ADMIN", admin), ("GRPC", grpc), ("SHIM", shim)] {
        command.env(format!("CONTINUUM_DEMO_{name}"), addr.to_string());
    }
    // A shell set up for a deployment: the demo runs its embedded default all the same.
    command.env("CONTINUUM_CONFIG", "/nonexistent/control-plane.yaml");
    command.env("CONTINUUM_CONTROL_PLANE_CA", "/nonexistent/ca.pem");
    command.env("CONTINUUM_WORKER_THREADS", "many");
    let mut demo = Command::from(command).kill_on_drop(true).spawn()?;
    let group = demo.id().context("the demo's process group")?;
    let stopped = Stopper(group);

    let mut lines = BufReader::new(demo.stdout.take().context("no stdout")?).lines();
    let banner = async {
        let mut printed = Vec::new();
        while let Some(line) = lines.next_line().await? {
            let curl = line.contains("curl -s -D- http://") && line.contains("/v1/chat/completions");
            printed.push(line);
            if curl {
                return Ok(printed);
            }
        }
        bail!("the demo ended before its banner:\n{}", printed.join("\n"))
    };
    let printed = tokio::time::timeout(BANNER_WITHIN, banner).await.context("no banner in time")??;
    let curl = printed.last().context("a curl line")?;
    ensure!(curl.contains(&format!("http://{listen}/v1/chat/completions")), "the banner names the replica: {curl}");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    // The banner's request: its headers and body, as printed on the line after it.
    let request = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                         "nvext": {"extra_fields": ["worker_id"]}});
    let response = reqwest::Client::new()
        .post(format!("http://{listen}/v1/chat/completions"))
        .header("x-backend", "show")
        .json(&request)
        .send()
        .await?;
    ensure!(response.status() == 200, "{}", response.status());
    let pinned = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (decode, prefill) = (pinned("x-continuum-decode-worker"), pinned("x-continuum-prefill-worker"));
    let body: Value = response.json().await?;
    let echoed = &body["nvext"]["worker_id"];
    ensure!(decode.is_some() && echoed["decode_worker_id"].as_u64() == decode, "{body}");
    ensure!(prefill.is_some() && echoed["prefill_worker_id"].as_u64() == prefill, "{body}");

    stopped.interrupt()?;
    let status = tokio::time::timeout(STOPPED_WITHIN, demo.wait()).await.context("the demo did not stop")??;
    ensure!(!status.success(), "the demo exits non-zero when stopped ({status})");
    let deadline = Instant::now() + STOPPED_WITHIN;
    while [listen, admin, grpc, shim].iter().any(|addr| std::net::TcpStream::connect(addr).is_ok()) {
        ensure!(Instant::now() < deadline, "a process the demo started still listens after Ctrl-C");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The demo's process group, interrupted as Ctrl-C would, and killed if the test ends first.
struct Stopper(u32);

impl Stopper {
    fn interrupt(&self) -> anyhow::Result<()> {
        let status = std::process::Command::new("kill").args(["-INT", "--", &format!("-{}", self.0)]).status()?;
        ensure!(status.success(), "kill -INT: {status}");
        Ok(())
    }
}

impl Drop for Stopper {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .stderr(Stdio::null())
            .status();
    }
}
