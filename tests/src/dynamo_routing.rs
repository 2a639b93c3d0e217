//! Routing through the real Dynamo 1.6.1 `dynamo.frontend --router-mode direct` inside a
//! [`NetNs`]: the frontend as the data plane's only shim replica, a control plane configured
//! with that shim pool (started as a process the test can SIGKILL), its replicas, and a curl
//! client that reads what the frontend echoed (`nvext.worker_id`) beside what the replica
//! disclosed (`x-continuum-*`).

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use crate::dynamo::{ETCD_URL, dynamo_env};
use crate::netns::NetNs;
use crate::tools;

/// The frontend's HTTP listener, the data plane's only shim replica.
pub const FRONTEND: &str = "127.0.0.1:8000";
/// The control plane's Fleet gRPC service.
pub const CONTROL_PLANE_GRPC: &str = "127.0.0.1:7000";
const CONTROL_PLANE_ADMIN: &str = "127.0.0.1:7001";
const FIRST_REPLICA_PORT: u16 = 8001;
/// A cold start on a busy 2-core machine (the README measured about 1 s).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Ends each response in curl's output, before its status.
const CURL_STATUS: &str = "\n\u{1f}";
/// curl's exit code when `--max-time` passed.
const CURL_TIMED_OUT: i32 = 28;

/// Starts `python -m dynamo.frontend --router-mode direct` on [`FRONTEND`] with the README's
/// environment. Returns its pid.
pub fn start_frontend(ns: &NetNs) -> anyhow::Result<u32> {
    start_frontend_routing(ns, "direct", &[])
}

/// [`start_frontend`] with another `--router-mode` (`round-robin`, `kv`, …): Dynamo routing on
/// its own, for comparison.
pub fn start_frontend_routing(ns: &NetNs, router_mode: &str, extra: &[&str]) -> anyhow::Result<u32> {
    let mut command = ns.command(tools::python());
    command.args(["-m", "dynamo.frontend", "--router-mode", router_mode, "--http-host", "127.0.0.1"]);
    command.args(extra);
    command.args(["--http-port", FRONTEND.rsplit(':').next().unwrap_or("8000")]);
    dynamo_env(&mut command);
    ns.spawn("frontend", command)
}

/// Waits until `GET {base}/v1/models` lists `model`.
pub async fn wait_model_listed(ns: &NetNs, label: &str, base: &str, model: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok((200, body)) = ns.get(&format!("{base}/v1/models")).await {
            let listed: Value = serde_json::from_str(&body).unwrap_or_default();
            if listed["data"].as_array().is_some_and(|d| d.iter().any(|m| m["id"] == model)) {
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            bail!("{label} did not list {model} within {START_TIMEOUT:?}:\n{}", ns.log_tail(label));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The control-plane process and its replicas, configured with the frontend as the shim pool.
#[derive(Debug)]
pub struct RoutedContinuum {
    pub control_plane_pid: u32,
    pub admin: String,
    /// Each replica's base URL.
    pub replicas: Vec<String>,
}

impl RoutedContinuum {
    /// Starts the control plane, then `replicas` replicas, each once `/readyz` answers 200.
    pub async fn start(ns: &NetNs, replicas: u16, fallback_to_unified: bool) -> anyhow::Result<Self> {
        Self::start_with(ns, replicas, &control_plane_yaml(fallback_to_unified), &[]).await
    }

    /// [`RoutedContinuum::start`] with the control plane's YAML and extra replica arguments.
    pub async fn start_with(ns: &NetNs, replicas: u16, yaml: &str, replica_args: &[&str]) -> anyhow::Result<Self> {
        let config = ns.dir().join("control-plane.yaml");
        std::fs::write(&config, yaml)?;
        let mut command = ns.command(tools::binary("continuum-control-plane"));
        command.arg("--config").arg(&config);
        let control_plane_pid = ns.spawn("control-plane", command)?;
        let admin = format!("http://{CONTROL_PLANE_ADMIN}");
        wait_ready(ns, "control-plane", control_plane_pid, &format!("{admin}/readyz")).await?;
        let mut urls = Vec::new();
        for (n, port) in (1..=replicas).zip(FIRST_REPLICA_PORT..) {
            let listen = format!("127.0.0.1:{port}");
            let mut command = ns.command(tools::binary("continuum-data-plane"));
            command.args(["--listen", &listen, "--control-plane", &format!("http://{CONTROL_PLANE_GRPC}")]);
            command.args(["--replica-id", &format!("r{n}")]);
            command.args(replica_args);
            let label = format!("replica-r{n}");
            let pid = ns.spawn(&label, command)?;
            let url = format!("http://{listen}");
            wait_ready(ns, &label, pid, &format!("{url}/readyz")).await?;
            urls.push(url);
        }
        Ok(Self { control_plane_pid, admin, replicas: urls })
    }

    /// Waits until every replica's fleet holds `workers` workers.
    pub async fn wait_for_workers(&self, ns: &NetNs, workers: usize) -> anyhow::Result<()> {
        self.wait_for_fleet(ns, &format!("hold {workers} workers"), |fleet| fleet["workers"] == workers).await
    }

    /// Waits until every replica reports its Fleet stream down (the control plane gone): what
    /// it routes on from then is its last-known-good view.
    pub async fn wait_for_disconnection(&self, ns: &NetNs) -> anyhow::Result<()> {
        self.wait_for_fleet(ns, "report the control plane gone", |fleet| fleet["connected"] == false).await
    }

    /// Each replica's `continuum_dynamo_selection_total` for `role` and `reason` (0 before its
    /// first such selection).
    pub async fn selections(&self, ns: &NetNs, role: &str, reason: &str) -> anyhow::Result<Vec<f64>> {
        let labels = [format!("role=\"{role}\""), format!("reason=\"{reason}\"")];
        let mut counts = Vec::with_capacity(self.replicas.len());
        for url in &self.replicas {
            let (status, text) = ns.get(&format!("{url}/metrics")).await?;
            ensure!(status == 200, "{url}/metrics answered {status}");
            let count = text
                .lines()
                .filter(|line| line.starts_with("continuum_dynamo_selection_total{"))
                .filter(|line| labels.iter().all(|label| line.contains(label.as_str())))
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            counts.push(count);
        }
        Ok(counts)
    }

    /// Waits until `holds` is true of every replica's `/readyz` `fleet` section.
    async fn wait_for_fleet(&self, ns: &NetNs, what: &str, holds: impl Fn(&Value) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        for url in &self.replicas {
            while ns.get_json(&format!("{url}/readyz")).await.map(|r| holds(&r["fleet"])).ok() != Some(true) {
                ensure!(Instant::now() < deadline, "{url} did not {what} within {START_TIMEOUT:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }
}

/// Discovery from the namespace's etcd, the frontend as the one unified OpenAI backend and shim
/// replica, and disaggregated serving on.
pub fn control_plane_yaml(fallback_to_unified: bool) -> String {
    control_plane_yaml_via(FRONTEND, fallback_to_unified)
}

/// [`control_plane_yaml`] with the frontend reached at `shim` (a [`crate::wire_tap::WireTap`]
/// in front of it).
pub fn control_plane_yaml_via(shim: &str, fallback_to_unified: bool) -> String {
    format!(
        "dynamo:
  enabled: true
  discovery:
    source: etcd
    etcd:
      endpoints: [\"{ETCD_URL}\"]
  load:
    direct_allow_cidrs: [\"127.0.0.0/8\"]
  shim:
    backends: [frontend]
backends:
  - name: frontend
    type: openai
    url: \"http://{shim}\"
    role: unified
    models: [tiny]
disaggregated_serving:
  enabled: true
  fallback_to_unified: {fallback_to_unified}
control_plane:
  grpc_listen: \"{CONTROL_PLANE_GRPC}\"
admin:
  listen: \"{CONTROL_PLANE_ADMIN}\"
"
    )
}

async fn wait_ready(ns: &NetNs, label: &str, pid: u32, readyz: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !ns.get(readyz).await.is_ok_and(|(status, _)| status == 200) {
        if let Some(status) = ns.exited(pid)? {
            bail!("{label} exited ({status}) at start:\n{}", ns.log_tail(label));
        }
        ensure!(Instant::now() < deadline, "{label} not ready within {START_TIMEOUT:?}:\n{}", ns.log_tail(label));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A chat request body for the tiny model asking the frontend to echo its routing.
pub fn chat_body(n: usize, stream: bool, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": format!("request {n}: the quick brown fox")}],
        "max_tokens": max_tokens,
        "stream": stream,
        "nvext": {"extra_fields": ["worker_id"]},
    })
}

/// What one `POST /v1/chat/completions` came to.
#[derive(Debug)]
pub enum Outcome {
    Answered(Answer),
    /// curl's `--max-time` passed: the request hung.
    TimedOut,
}

/// A response: status, lowercase header names with their values, and the body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The disclosed decode worker (and rank) and prefill worker.
    pub fn disclosed(&self) -> anyhow::Result<Pins> {
        let id = |name: &str| self.header(name).map(str::parse::<u64>).transpose().context(name.to_string());
        Ok(Pins {
            decode: id("x-continuum-decode-worker")?.with_context(|| format!("no decode disclosed: {self:?}"))?,
            prefill: id("x-continuum-prefill-worker")?,
            decode_dp_rank: id("x-continuum-decode-dp-rank")?,
            prefill_dp_rank: id("x-continuum-prefill-dp-rank")?,
        })
    }

    /// The OpenAI error `code` of a JSON error body.
    pub fn error_code(&self) -> Option<String> {
        let body: Value = serde_json::from_str(&self.body).ok()?;
        body["error"]["code"].as_str().map(str::to_string)
    }
}

/// Worker pins, as disclosed by a replica or echoed by the frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pins {
    pub decode: u64,
    pub prefill: Option<u64>,
    pub decode_dp_rank: Option<u64>,
    pub prefill_dp_rank: Option<u64>,
}

/// `POST {base}/v1/chat/completions` with `body` and `headers`, from inside the namespace,
/// bounded by `max_time`.
pub async fn post_chat(
    ns: &NetNs,
    base: &str,
    body: &Value,
    headers: &[(&str, &str)],
    max_time: Duration,
) -> anyhow::Result<Outcome> {
    post_chat_noting_head(ns, base, body, headers, max_time, None).await
}

/// [`post_chat`], writing the answer's head to `head` as soon as it arrives (curl's `-D`), so
/// a test can tell a stream has begun while it runs.
pub async fn post_chat_noting_head(
    ns: &NetNs,
    base: &str,
    body: &Value,
    headers: &[(&str, &str)],
    max_time: Duration,
    head: Option<&std::path::Path>,
) -> anyhow::Result<Outcome> {
    let mut curl = ns.command("curl");
    curl.args(["-sS", "-N", "--max-time", &format!("{:.1}", max_time.as_secs_f64()), "-D"]);
    curl.arg(head.map_or_else(|| "-".into(), |path| path.as_os_str().to_owned()));
    curl.args(["-H", "content-type: application/json"]);
    for (name, value) in headers {
        curl.args(["-H", &format!("{name}: {value}")]);
    }
    curl.args(["--data-binary", &body.to_string(), "--write-out", &format!("{CURL_STATUS}%{{http_code}}")]);
    curl.arg(format!("{base}/v1/chat/completions"));
    let output = tokio::process::Command::from(curl).kill_on_drop(true).output().await?;
    if output.status.code() == Some(CURL_TIMED_OUT) {
        return Ok(Outcome::TimedOut);
    }
    let mut out = String::from_utf8(output.stdout)?;
    if let Some(head) = head {
        out.insert_str(0, &std::fs::read_to_string(head).unwrap_or_default());
    }
    ensure!(output.status.success(), "curl {}: {} {out}", output.status, String::from_utf8_lossy(&output.stderr));
    Ok(Outcome::Answered(parse_curl(&out)?))
}

fn parse_curl(out: &str) -> anyhow::Result<Answer> {
    let (response, status) = out.rsplit_once(CURL_STATUS).context("no status from curl")?;
    let (head, body) = response.split_once("\r\n\r\n").context("no header block from curl")?;
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Answer { status: status.trim().parse()?, headers, body: body.to_string() })
}

/// The frontend's `nvext.worker_id` echo of a buffered completion.
pub fn buffered_echo(body: &str) -> anyhow::Result<Pins> {
    let completion: Value = serde_json::from_str(body).with_context(|| format!("not JSON: {body}"))?;
    echo_of(&completion["nvext"]["worker_id"]).with_context(|| format!("no worker_id echo in {body}"))
}

/// The echo of an SSE stream, which must end with `data: [DONE]` and carry the same echo on
/// every chunk that has one (at least one does).
pub fn streamed_echo(body: &str) -> anyhow::Result<Pins> {
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    ensure!(events.last() == Some(&"[DONE]"), "the stream does not end with data: [DONE]: {body}");
    let mut echoes = Vec::new();
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).with_context(|| format!("chunk not JSON: {event}"))?;
        if let Some(echo) = echo_of(&chunk["nvext"]["worker_id"]) {
            echoes.push(echo);
        }
    }
    let first = *echoes.first().with_context(|| format!("no chunk echoes worker_id: {body}"))?;
    ensure!(echoes.iter().all(|e| *e == first), "chunks echo different pins {echoes:?}");
    Ok(first)
}

fn echo_of(worker_id: &Value) -> Option<Pins> {
    Some(Pins {
        decode: worker_id["decode_worker_id"].as_u64()?,
        prefill: worker_id["prefill_worker_id"].as_u64(),
        decode_dp_rank: worker_id["decode_dp_rank"].as_u64(),
        prefill_dp_rank: worker_id["prefill_dp_rank"].as_u64(),
    })
}
