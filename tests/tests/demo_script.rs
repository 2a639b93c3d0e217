//! The README's first command, as a newcomer runs it: `scripts/demo` builds what it needs,
//! starts the control plane on its embedded default and a data-plane replica, and prints a
//! banner with a curl line. That request is routed, with the pins the shim echoes, and Ctrl-C
//! stops both processes.

use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use continuum_tests::process::free_port;
use serde_json::Value;
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
    // A group of its own, as a terminal gives a foreground job, so Ctrl-C reaches every process
    // in it. Outside the test's group, nextest's timeout would not reach the demo: if the test
    // dies first, the parent-death signal (util-linux, essential on Debian) has the script's
    // trap stop what it started.
    let mut command = std::process::Command::new("setpriv");
    command.args(["--pdeathsig", "TERM", "bash", script]);
    command.process_group(0).stdout(Stdio::piped()).stderr(Stdio::inherit());
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
            if line.contains("curl -s -D- http://") && line.contains("/v1/chat/completions") {
                // The command goes on, with its headers and body, on the next line.
                let rest = lines.next_line().await?.context("the curl line's continuation")?;
                return Ok(command_of(&[line, rest]));
            }
            printed.push(line);
        }
        bail!("the demo ended before its banner:\n{}", printed.join("\n"))
    };
    let command = tokio::time::timeout(BANNER_WITHIN, banner).await.context("no banner in time")??;
    ensure!(
        command.contains(&format!("http://{listen}/v1/chat/completions")),
        "the banner names the replica: {command}"
    );
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    // The README shows the same command, at the default address.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))?;
    let shown: Vec<String> =
        readme.lines().skip_while(|l| !l.starts_with("curl -s -D- ")).take(2).map(str::to_owned).collect();
    ensure!(
        command_of(&shown) == command.replace(&listen.to_string(), "127.0.0.1:8080"),
        "the README's curl line differs from the demo's: {shown:?}"
    );

    // The banner's command, run as printed.
    let answer = shell(&command).await.context("the printed command")?;
    let (head, body) = answer.split_once("\r\n\r\n").context("a head and a body")?;
    ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    let pinned = |name: &str| {
        head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix(&format!("{name}: "))?.trim().parse::<u64>().ok())
    };
    let (decode, prefill) = (pinned("x-continuum-decode-worker"), pinned("x-continuum-prefill-worker"));
    let body: Value = serde_json::from_str(body)?;
    let echoed = &body["nvext"]["worker_id"];
    ensure!(decode.is_some() && echoed["decode_worker_id"].as_u64() == decode, "{head}\n{body}");
    ensure!(prefill.is_some() && echoed["prefill_worker_id"].as_u64() == prefill, "{head}\n{body}");

    // The README's shared-prefix example, run as shown, back to back: the second prompt goes
    // to the prefill worker that cached the first, and finds its system message there.
    let example: Vec<&str> =
        readme.lines().skip_while(|l| !l.starts_with("ask() {")).take_while(|l| !l.starts_with("```")).collect();
    ensure!(example.last().is_some_and(|l| l.starts_with("ask '")), "the README's ask() example: {example:?}");
    let example = example.join("\n").replace("127.0.0.1:8080", &listen.to_string());
    let printed = shell(&example).await.context("the README's example")?;
    let values = |prefix: &str| -> Vec<u64> {
        printed.lines().filter_map(|l| l.strip_prefix(prefix)?.trim().parse().ok()).collect()
    };
    let (holders, cached) = (values("x-continuum-prefill-worker: "), values("\"cached_tokens\":"));
    ensure!(holders.len() == 2 && holders[0] == holders[1], "one prefill worker for both prompts: {printed}");
    ensure!(cached.len() == 2 && cached[0] == 0 && cached[1] > 0, "the second found the first's prefix: {printed}");

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

/// What `script` prints, run by bash as a newcomer's shell would (no proxy for loopback);
/// an error if it fails.
async fn shell(script: &str) -> anyhow::Result<String> {
    let output = Command::new("bash").args(["-c", script]).env("NO_PROXY", "*").env("no_proxy", "*").output().await?;
    ensure!(output.status.success(), "failed: {output:?}");
    Ok(String::from_utf8(output.stdout)?)
}

/// A command printed over `lines`, each but the last ending in a backslash, as one line.
fn command_of(lines: &[String]) -> String {
    let parts: Vec<&str> = lines.iter().map(|l| l.trim().trim_end_matches('\\').trim()).collect();
    parts.join(" ")
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
