//! Data-plane benchmark: requests per second and added latency (p50, p99) of one data-plane
//! replica with picking on (a disaggregated fleet of 2 prefill + 2 decode workers, pins written,
//! dispatches recorded and reported), against nginx reverse-proxying to the same stub shim, on
//! the same machine in the same run. A keep-alive hyper load generator sends the same chat
//! completion with fixed concurrency straight to the stub (the baseline), through nginx and
//! through the data plane; each proxy gets one thread, and each one's CPU time per request is
//! measured too, and the in-process control plane's while the data plane is measured. Nine
//! rounds; the table pools every round's requests of a path (single rounds on 2 shared cores
//! swing by ±25%, and one round's p99 more), and lists each round's ratios.
//!
//! `cargo run --release -p continuum-tests --bin bench-proxy -- [--requests 50000] [--concurrency 32] [--warmup 2000] [--rounds 9] [--write]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, Request, StatusCode, Uri, header};
use axum::routing::{get, post};
use bytes::Bytes;
use continuum_control_plane::fleet::FleetChange;
use continuum_data_plane::dispatch::MAX_IDLE_PER_AUTHORITY;
use continuum_data_plane::fleet::FleetClientConfig;
use continuum_data_plane::replica::Replica;
use continuum_data_plane::routing::headers::PREFILL_INSTANCE_ID;
use continuum_proto::model::{Backend, DataPlaneConfig, DisaggregatedServing, ShimPool};
use continuum_tests::bench::{Quantiles, arg, write_section};
use continuum_tests::nginx::{Nginx, UPSTREAM_KEEPALIVE};
use continuum_tests::relay::Relay;
use continuum_tests::{TestControlPlane, publisher, wait_for_version, worker};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::runtime::Runtime;

/// The data-plane binary's allocator, so the replica in this process allocates as it does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const COMMAND: &str = "cargo run --release -p continuum-tests --bin bench-proxy -- --write";
const NAMESPACE: &str = "dynamo";
const MODEL: &str = "tiny";
const CLIENT_MODEL: &str = "tiny-chat";
/// Prefill ids are 0 mod 3 and decode ids 1 mod 3 (see `continuum_tests::worker`).
const WORKER_IDS: [u64; 4] = [3, 4, 6, 7];
const REQUEST: &str = r#"{"model":"tiny-chat","messages":[{"role":"user","content":"hello there"}],"max_tokens":8}"#;
const COMPLETION: &str = r#"{"id":"chatcmpl-stub","object":"chat.completion","model":"tiny","choices":[{"index":0,"message":{"role":"assistant","content":"stub"},"finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One path's measurement.
#[derive(Debug, Clone, Copy)]
struct Run {
    rps: f64,
    latency: Quantiles,
    /// The proxy's CPU time (user and kernel) per request, in µs; `None` for the baseline.
    cpu_us: Option<f64>,
    /// The share of it spent in user space.
    user_share: Option<f64>,
}

impl Run {
    /// The CPU time per request split into user space and the kernel, in µs.
    fn split_us(&self) -> Option<(f64, f64)> {
        let (cpu, user) = (self.cpu_us?, self.user_share?);
        Some((cpu * user, cpu * (1.0 - user)))
    }
}

/// Requests of one path, one round's or every round's together: each one's latency, how long
/// they all took, and the CPU time spent on them.
#[derive(Debug, Default)]
struct Pooled {
    samples: Vec<Duration>,
    elapsed: Duration,
    /// The proxy's CPU time; zero for the baseline.
    cpu: CpuTime,
    /// The in-process control plane's CPU time while the path was measured.
    control_ns: u64,
}

impl Pooled {
    fn add(&mut self, round: Pooled) {
        self.samples.extend(round.samples);
        self.elapsed += round.elapsed;
        self.cpu.add(round.cpu);
        self.control_ns += round.control_ns;
    }

    fn run(&self) -> Run {
        Run {
            rps: self.samples.len() as f64 / self.elapsed.as_secs_f64(),
            latency: Quantiles::of(self.samples.clone()),
            cpu_us: (self.cpu.ns > 0).then(|| self.per_request_us(self.cpu.ns)),
            user_share: self.cpu.user_share(),
        }
    }

    fn control_us(&self) -> f64 {
        self.per_request_us(self.control_ns)
    }

    fn per_request_us(&self, ns: u64) -> f64 {
        ns as f64 / 1e3 / self.samples.len().max(1) as f64
    }
}

/// One round: direct to the stub, through nginx, through the data plane, through the floor.
#[derive(Debug, Clone, Copy)]
struct Round {
    direct: Run,
    nginx: Run,
    data_plane: Run,
    floor: Run,
}

impl Round {
    fn rps_ratio(&self) -> f64 {
        self.data_plane.rps / self.nginx.rps
    }

    fn floor_rps_ratio(&self) -> f64 {
        self.floor.rps / self.nginx.rps
    }

    /// The data plane's CPU time per request over nginx's.
    fn cpu_ratio(&self) -> Option<f64> {
        Some(self.data_plane.cpu_us? / self.nginx.cpu_us?)
    }

    /// The floor's CPU time per request over nginx's.
    fn floor_cpu_ratio(&self) -> Option<f64> {
        Some(self.floor.cpu_us? / self.nginx.cpu_us?)
    }

    fn added_p99_ratio(&self) -> f64 {
        self.added_p99_over_nginx(&self.data_plane)
    }

    fn added_p99_over_nginx(&self, proxy: &Run) -> f64 {
        added(proxy.latency.p99, self.direct.latency.p99) / added(self.nginx.latency.p99, self.direct.latency.p99)
    }
}

#[derive(Debug, Clone, Copy)]
struct Load {
    requests: usize,
    concurrency: usize,
    warmup: usize,
}

fn main() -> anyhow::Result<()> {
    if let Err(error) = Nginx::binary() {
        eprintln!("bench-proxy: {error}");
        std::process::exit(2);
    }
    let load = Load {
        requests: arg("--requests", 50_000)?,
        concurrency: arg("--concurrency", 32)?,
        warmup: arg("--warmup", 2_000)?,
    };
    let rounds = arg("--rounds", 9)?.max(1);
    // Each server gets its own runtime, like a process of its own: one thread for the stub, one
    // for the control plane, one for the data plane (nginx runs one process); the load
    // generator drives from this thread.
    let stub_rt = runtime("stub", 1)?;
    let control_rt = runtime("control-plane", 1)?;
    let proxy_rt = OneThread::start("data-plane")?;
    let relay_rt = OneThread::start("relay")?;
    let load_rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    let pinned = Arc::new(AtomicU64::new(0));
    let stub = stub_rt.block_on(start_stub(Arc::clone(&pinned)))?;
    let control = control_rt.block_on(start_control_plane(stub))?;
    let replica = proxy_rt.block_on(start_replica(&control))?;
    let nginx = load_rt.block_on(Nginx::start(stub))?;
    let relay = relay_rt.block_on(Relay::start(stub))?;

    let targets = [
        Target { name: "direct", addr: stub, cpu: None },
        Target { name: "nginx", addr: nginx.addr, cpu: Some(format!("/proc/{}/schedstat", nginx.pid())) },
        Target { name: "data plane", addr: replica.local_addr, cpu: Some(format!("{}/schedstat", proxy_rt.task_dir)) },
        Target { name: "floor", addr: relay.addr, cpu: Some(format!("{}/schedstat", relay_rt.task_dir)) },
    ];
    let client = load_client(load.concurrency);
    let mut measured = Vec::with_capacity(rounds);
    let mut pooled: [Pooled; PATHS] = Default::default();
    for round in 0..rounds {
        let runs = load_rt.block_on(measure_round(&client, &targets, load, round, &mut pooled))?;
        measured.push(runs);
    }
    let through_data_plane = pinned.load(Ordering::Relaxed);
    let expected = (rounds * (load.requests + load.warmup)) as u64;
    anyhow::ensure!(through_data_plane >= expected, "only {through_data_plane} of {expected} requests arrived pinned");

    let table = table(&measured, &pooled, load, &nginx.version);
    println!("{table}");
    drop(nginx);
    drop(relay);
    proxy_rt.block_on(replica.shutdown());
    control_rt.block_on(control.stop());
    if std::env::args().any(|a| a == "--write") {
        write_section("bench-proxy", "Data plane vs nginx", COMMAND, &table)?;
    }
    Ok(())
}

/// A current-thread runtime driven by a thread of its own, until dropped.
struct OneThread {
    handle: tokio::runtime::Handle,
    /// `/proc/<pid>/task/<tid>` of the thread.
    task_dir: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OneThread {
    fn start(name: &str) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (told, task_dir) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            let _ = told.send(std::fs::read_link("/proc/thread-self").map(|p| format!("/proc/{}", p.display())));
            let _ = runtime.block_on(stopped);
        })?;
        let task_dir = task_dir.recv()??;
        Ok(Self { handle, task_dir, stop: Some(stop), thread: Some(thread) })
    }

    fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.handle.block_on(future)
    }
}

impl Drop for OneThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn runtime(name: &str, threads: usize) -> anyhow::Result<Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(threads).thread_name(name).enable_all().build()?)
}

/// The stub shim: answers every chat completion at once with a fixed body, counting the
/// requests that arrive with a prefill pin, and answers the data plane's liveness probe
/// (`GET /live`) as the Dynamo frontend does.
async fn start_stub(pinned: Arc<AtomicU64>) -> anyhow::Result<SocketAddr> {
    let answer = move |headers: HeaderMap, _body: Bytes| {
        if headers.contains_key(PREFILL_INSTANCE_ID) {
            pinned.fetch_add(1, Ordering::Relaxed);
        }
        std::future::ready(([(header::CONTENT_TYPE, "application/json")], COMPLETION))
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = Router::new().route("/v1/chat/completions", post(answer)).route(
        "/live",
        get(|| std::future::ready(([(header::CONTENT_TYPE, "application/json")], r#"{"status":"live"}"#))),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// A control plane serving 2 prefill + 2 decode workers behind one shim pool: the stub.
async fn start_control_plane(stub: SocketAddr) -> anyhow::Result<TestControlPlane> {
    let control = TestControlPlane::start(publisher()).await?;
    let config = DataPlaneConfig {
        backends: vec![Backend { name: "stub".into(), url: format!("http://{stub}"), models: vec![] }],
        shim_pools: vec![ShimPool { namespace: NAMESPACE.into(), backends: vec!["stub".into()] }],
        model_map: [(CLIENT_MODEL.to_string(), MODEL.to_string())].into(),
        disaggregated_serving: DisaggregatedServing { enabled: true, fallback_to_unified: false },
        ..DataPlaneConfig::default()
    };
    let upsert = WORKER_IDS.iter().map(|id| worker(NAMESPACE, *id, MODEL)).collect();
    control.publisher.apply(FleetChange { upsert, config: Some(Arc::new(config)), ..FleetChange::default() });
    Ok(control)
}

async fn start_replica(control: &TestControlPlane) -> anyhow::Result<Replica> {
    let follow = FleetClientConfig::new(control.url(), "bench-proxy");
    let replica = Replica::start("127.0.0.1:0", follow).await?;
    let version = control.publisher.current().version();
    wait_for_version(std::slice::from_ref(&replica), version, Duration::from_secs(20)).await?;
    Ok(replica)
}

fn load_client(concurrency: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_max_idle_per_host(concurrency).build(connector)
}

/// Every target once, warm-up first; the order rotates from round to round. Each path's
/// requests are added to its pool too.
async fn measure_round(
    client: &HttpClient,
    targets: &[Target; PATHS],
    load: Load,
    round: usize,
    pooled: &mut [Pooled; PATHS],
) -> anyhow::Result<Round> {
    let mut runs = [None; PATHS];
    for i in (0..PATHS).map(|i| (i + round) % PATHS) {
        let Target { name, addr, cpu } = &targets[i];
        let uri: Uri = format!("http://{addr}/v1/chat/completions").parse()?;
        drive(client, &uri, load.warmup, load.concurrency).await?;
        let before = cpu.as_deref().map(cpu_time).transpose()?;
        let control_before = (i == DATA_PLANE).then(control_plane_ns).transpose()?;
        let mut measured = drive(client, &uri, load.requests, load.concurrency).await?;
        if let (Some(before), Some(path)) = (before, cpu.as_deref()) {
            measured.cpu = cpu_time(path)?.since(before);
        }
        if let Some(before) = control_before {
            measured.control_ns = control_plane_ns()? - before;
        }
        let run = measured.run();
        pooled[i].add(measured);
        eprintln!(
            "round {}: {name:<10} {:>8.0} req/s  p50 {:>5} µs  p99 {:>5} µs  cpu {:>5.1} µs/request",
            round + 1,
            run.rps,
            run.latency.p50.as_micros(),
            run.latency.p99.as_micros(),
            run.cpu_us.unwrap_or_default()
        );
        runs[i] = Some(run);
    }
    let [Some(direct), Some(nginx), Some(data_plane), Some(floor)] = runs else {
        anyhow::bail!("a target was not measured")
    };
    Ok(Round { direct, nginx, data_plane, floor })
}

/// A path to measure, and where its proxy's CPU time is read.
struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The proxy's `schedstat` (nanoseconds on a CPU first): one process or one thread.
    cpu: Option<String>,
}

/// How many paths are measured: direct, nginx, the data plane and the floor, in that order.
const PATHS: usize = 4;
/// Where the data plane is in [`Round`]'s order of targets.
const DATA_PLANE: usize = 2;

/// Nanoseconds the in-process control plane's threads (its runtime's, all named
/// `control-plane`) have run on a CPU.
fn control_plane_ns() -> anyhow::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        if std::fs::read_to_string(dir.join("comm")).is_ok_and(|comm| comm.trim() == "control-plane") {
            total += cpu_ns(&dir.join("schedstat").display().to_string())?;
        }
    }
    Ok(total)
}

/// Nanoseconds a process or thread has run on a CPU, from its `schedstat`.
fn cpu_ns(schedstat: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(schedstat)?;
    let first = text.split_whitespace().next().unwrap_or_default();
    first.parse().map_err(|_| anyhow::anyhow!("{schedstat}: unexpected contents {text:?}"))
}

/// A process's or thread's time on a CPU: nanoseconds in all (`schedstat`), and the clock ticks
/// it spent in user space and in the kernel (`stat`), which only split that total.
#[derive(Debug, Default, Clone, Copy)]
struct CpuTime {
    ns: u64,
    user_ticks: u64,
    system_ticks: u64,
}

impl CpuTime {
    fn add(&mut self, other: CpuTime) {
        self.ns += other.ns;
        self.user_ticks += other.user_ticks;
        self.system_ticks += other.system_ticks;
    }

    fn since(self, before: CpuTime) -> CpuTime {
        CpuTime {
            ns: self.ns.saturating_sub(before.ns),
            user_ticks: self.user_ticks.saturating_sub(before.user_ticks),
            system_ticks: self.system_ticks.saturating_sub(before.system_ticks),
        }
    }

    /// The share of the time spent in user space, once any tick was counted.
    fn user_share(&self) -> Option<f64> {
        let ticks = self.user_ticks + self.system_ticks;
        (ticks > 0).then(|| self.user_ticks as f64 / ticks as f64)
    }
}

/// The CPU time of the process or thread whose `schedstat` is at `schedstat`; its `stat` is
/// beside it.
fn cpu_time(schedstat: &str) -> anyhow::Result<CpuTime> {
    let ns = cpu_ns(schedstat)?;
    let stat_path = format!("{}stat", schedstat.trim_end_matches("schedstat"));
    let stat = std::fs::read_to_string(&stat_path)?;
    // After the command name (which may hold spaces), the fields from the third on: `utime` is
    // the 14th and `stime` the 15th.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let field = |n: usize| -> anyhow::Result<u64> {
        let text = fields.get(n - 3).ok_or_else(|| anyhow::anyhow!("{stat_path}: no field {n}"))?;
        text.parse().map_err(|_| anyhow::anyhow!("{stat_path}: field {n} is {text:?}"))
    };
    Ok(CpuTime { ns, user_ticks: field(14)?, system_ticks: field(15)? })
}

/// `total` requests from `concurrency` keep-alive callers; each latency runs from sending the
/// request to reading the whole response body.
async fn drive(client: &HttpClient, uri: &Uri, total: usize, concurrency: usize) -> anyhow::Result<Pooled> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, uri, next) = (client.clone(), uri.clone(), Arc::clone(&next));
        callers.spawn(async move {
            let mut samples = Vec::with_capacity(total / concurrency + 1);
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let sent = Instant::now();
                call(&client, &uri).await?;
                samples.push(sent.elapsed());
            }
            anyhow::Ok(samples)
        });
    }
    let mut samples = Vec::with_capacity(total);
    while let Some(caller) = callers.join_next().await {
        samples.extend(caller??);
    }
    Ok(Pooled { samples, elapsed: started.elapsed(), ..Pooled::default() })
}

async fn call(client: &HttpClient, uri: &Uri) -> anyhow::Result<()> {
    let request = Request::post(uri.clone())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(REQUEST.as_bytes())))?;
    let response = client.request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status == StatusCode::OK, "{uri} answered {status}: {}", String::from_utf8_lossy(&body));
    Ok(())
}

/// Latency a proxy adds over the direct path, in microseconds.
fn added(proxied: Duration, direct: Duration) -> f64 {
    proxied.as_secs_f64() * 1e6 - direct.as_secs_f64() * 1e6
}

fn table(rounds: &[Round], pooled: &[Pooled; PATHS], load: Load, nginx: &str) -> String {
    let [direct, through_nginx, data_plane, floor] = pooled;
    let all =
        Round { direct: direct.run(), nginx: through_nginx.run(), data_plane: data_plane.run(), floor: floor.run() };
    let mut by_ratio: Vec<&Round> = rounds.iter().collect();
    by_ratio.sort_by(|a, b| a.rps_ratio().total_cmp(&b.rps_ratio()));
    let median = by_ratio[by_ratio.len() / 2];
    let index = rounds.iter().position(|r| std::ptr::eq(r, median)).unwrap_or(0) + 1;
    let row = |path: &str, run: &Run, added_to: Option<&Run>| {
        let (p50, p99) = added_to.map_or(("—".into(), "—".into()), |d| {
            (
                format!("{:.0}", added(run.latency.p50, d.latency.p50)),
                format!("{:.0}", added(run.latency.p99, d.latency.p99)),
            )
        });
        let cpu = match (run.cpu_us, run.split_us()) {
            (Some(us), Some((user, kernel))) => format!("{us:.1} ({user:.1} + {kernel:.1})"),
            (Some(us), None) => format!("{us:.1}"),
            (None, _) => "—".into(),
        };
        format!(
            "| {path} | {:.0} | {} | {} | {p50} | {p99} | {cpu} |\n",
            run.rps,
            run.latency.p50.as_micros(),
            run.latency.p99.as_micros()
        )
    };
    let each: Vec<String> =
        rounds.iter().map(|r| format!("{:.2}×/{:.2}×", r.rps_ratio(), r.added_p99_ratio())).collect();
    let floor_each: Vec<String> = rounds.iter().map(|r| format!("{:.2}×", r.floor_rps_ratio())).collect();
    let cpu_ratio = all.cpu_ratio().unwrap_or(f64::NAN);
    let control_us = data_plane.control_us();
    let split = match (all.data_plane.split_us(), all.nginx.split_us()) {
        (Some((dp_user, dp_kernel)), Some((nginx_user, nginx_kernel))) => {
            let floor = all
                .floor
                .split_us()
                .map_or(String::new(), |(user, kernel)| format!("; the floor {user:.1} and {kernel:.1} µs"));
            format!(
                "in user space the data plane spent **{:.2}×** nginx's time a request ({dp_user:.1} against {nginx_user:.1} µs), in the kernel **{:.2}×** ({dp_kernel:.1} against {nginx_kernel:.1} µs){floor}",
                dp_user / nginx_user,
                dp_kernel / nginx_kernel
            )
        }
        _ => "not measured (no clock ticks counted)".into(),
    };
    let with_control =
        all.data_plane.cpu_us.zip(all.nginx.cpu_us).map_or(f64::NAN, |(dp, nginx)| (dp + control_us) / nginx);
    format!(
        "| path | requests/s | p50 (µs) | p99 (µs) | added p50 (µs) | added p99 (µs) | proxy CPU per request (µs): all (user + kernel) |\n|---|---|---|---|---|---|---|\n{}{}{}{}\n\
         - Data plane / nginx throughput: **{:.2}×** (target ≥ 1.0×); data plane / nginx added p99: **{:.2}×** (target ≤ 1.0×).\n\
         - Every figure pools a path's requests over all {} rounds: requests/s is their number over the time they took, the latencies their quantiles. Added latency is the path's quantile less the direct path's. The median round by throughput ratio (round {index}) gave {:.2}×/{:.2}×; every round's (throughput ratio / added-p99 ratio): {}.\n\
         - CPU per request, data plane / nginx: **{cpu_ratio:.2}×**. It is the thread's (nginx: the process's) time on a CPU, user and kernel, during its path's measured requests, from `schedstat`; it steadies the comparison where throughput swings with how the scheduler places four busy threads on two cores. The in-process control plane's threads ran {control_us:.1} µs per data-plane request besides (folding the reports, streaming the backlogs), on the same cores: with it, **{with_control:.2}×**. The split between user space and the kernel is by the clock ticks the proxy spent in each (`/proc/…/stat`): {split}.\n\
         - The floor, a relay on the data plane's runtime: throughput **{:.2}×** nginx's, added p99 **{:.2}×**, CPU per request **{:.2}×** (rounds: {}). It is a current-thread tokio runtime on a thread of its own, like the data plane's, that frames each request and answer by `Content-Length` with `httparse` and moves their bytes unchanged over one upstream connection per client connection: no header hygiene, no JSON, no pick, no ledger, no report. What parts it from nginx is the runtime; what parts the data plane from it is the data plane's work.\n\
         - Each path: {} requests per round at concurrency {} over keep-alive HTTP/1.1 after {} warm-up requests; the paths take turns, in an order rotating per round. Load average when done: {}.\n\
         - Same machine, same run, loopback. The stub, the load generator, each proxy (one thread each: nginx `worker_processes 1`, the data plane a current-thread runtime on a thread of its own, with its control-plane stream) and the in-process control plane share the cores, so these are relative numbers. The benchmark binary allocates with mimalloc and is built with the workspace's release profile (fat LTO, one codegen unit), as the data-plane binary is.\n\
         - Both proxies keep idle keep-alive connections to the stub: nginx `keepalive {UPSTREAM_KEEPALIVE}`, the data plane its own HTTP/1.1 client (at most {MAX_IDLE_PER_AUTHORITY} idle per shim replica), which writes each request in one system call and reads the answer on the request's own task. The data plane serves clients with its own HTTP/1.1 server (`data-plane/src/server`).\n\
         - The data plane does more than nginx: it parses and validates the JSON (forwarding the body as sent when nothing in it must change), picks a prefill and a decode worker among 2 + 2, writes the pins, records the dispatch in its ledger and reports it to the control plane over gRPC (and applies the backlogs it streams back), and keeps metrics.\n",
        row("direct to the stub (baseline)", &all.direct, None),
        row(&format!("{nginx} (`proxy_pass`, upstream keepalive)"), &all.nginx, Some(&all.direct)),
        row("Continuum data plane (picking on)", &all.data_plane, Some(&all.direct)),
        row("floor: tokio relay, framing only", &all.floor, Some(&all.direct)),
        all.rps_ratio(),
        all.added_p99_ratio(),
        rounds.len(),
        median.rps_ratio(),
        median.added_p99_ratio(),
        each.join(", "),
        all.floor_rps_ratio(),
        all.added_p99_over_nginx(&all.floor),
        all.floor_cpu_ratio().unwrap_or(f64::NAN),
        floor_each.join(", "),
        load.requests,
        load.concurrency,
        load.warmup,
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next().map(String::from))
            .unwrap_or_default(),
    )
}
