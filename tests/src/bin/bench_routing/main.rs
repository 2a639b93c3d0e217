//! Routing benchmark against the real Dynamo 1.6.1 fleet: etcd and `dynamo.mocker` workers
//! (simulated engine timing, a 640-block KV cache each) in a private network namespace, and the
//! same seeded workloads driven through four routers:
//!
//! * `dynamo.frontend --router-mode round-robin`;
//! * `dynamo.frontend --router-mode kv` (Dynamo's own KV-aware router), at its defaults and
//!   with `--router-prefill-load-scale` set to Continuum's;
//! * Continuum, load-based: two data-plane replicas pinning workers through the frontend's
//!   `--router-mode direct`;
//! * Continuum, KV-aware: the same, with `dynamo.kv` on (replicas render, hash and ask the
//!   control plane's index), `prefill_load_scale: 3` and `send_token_data` (the frontend takes
//!   the replica's tokens).
//!
//! Each router gets a fresh namespace and fleet; each run uses content no cache holds (a new
//! content seed), the same content for every router. The client runs inside the namespace:
//! this binary again, in its hidden `--client` mode, streaming each request and reading its
//! time to first token, end-to-end time and `usage.prompt_tokens_details.cached_tokens`.
//!
//! `cargo build --release --bins && cargo run --release -p continuum-tests --bin bench-routing -- [--runs 5] [--requests 256] [--quick] [--write]`
//!
//! Five runs a cell by default: over three, single invocations of the shared-prefix cells moved
//! by 20–80 ms of TTFT p90, more than the routers differ (`docs/benchmark-notes.md`).
//!
//! Runs as root (network namespaces). `--quick`: one run of 128 requests, aggregated fleet,
//! the 8×2 shared-prefix and unique workloads only. To investigate a cell: `--only-fleets agg`,
//! `--only-routers round-robin,continuum-load`, `--only-cases unique` (a name prefix) and
//! `--dump DIR` (every run's per-request outcomes as JSON); `--unique-think-ms 0` sends the
//! unique prompts in lockstep (each the instant another ends). A filtered run is never written.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use continuum_tests::bench::{arg, quantile, quantile_difference_interval, text_arg, write_section};
use continuum_tests::dynamo::{self, InstanceWatch, Mocker, Mode};
use continuum_tests::dynamo_kv::{kv_control_plane_yaml, with_kv_section};
use continuum_tests::dynamo_routing::{self, FRONTEND, Outcome, RoutedContinuum, post_chat};
use continuum_tests::netns::NetNs;
use continuum_tests::placement::{OPENING_MS, Placement, Served, placement, ttft_after_opening};
use continuum_tests::tools;
use continuum_tests::workload::{self, Message, Shape, Spec, Workload};

mod client;
mod report;
mod stats;

use report::Report;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use stats::RunStats;

const COMMAND: &str =
    "cargo build --release --bins && cargo run --release -p continuum-tests --bin bench-routing -- --write";
/// Mocker flags beyond the harness's: simulated engine timing at real speed (suits 2 cores).
const MOCKER_ARGS: [&str; 2] = ["--speedup-ratio", "1.0"];
const KV_BLOCKS: u64 = 640;
/// The replicas' `--find-matches-deadline`. The default (2 ms) suits a control plane with a
/// core of its own, where a lookup's p99 is about 1 ms; here nine processes share 2 cores,
/// and at 2 ms one lookup in ten missed its deadline on the larger shared-prefix workload
/// (scored on a recent answer or on load alone). 10 ms let every one be answered.
const FIND_MATCHES_DEADLINE: &str = "10ms";
/// `dynamo.kv.prefill_load_scale` for both Continuum pickers (the default is 1): under KV
/// pressure a prompt prefilled on a rank that lacks its prefix also evicts blocks other
/// conversations will need, so cache affinity is worth more than one request's prefill; and a
/// request queued behind another's prefill waits for all of it, while decoding beside one more
/// request barely delays its first token. Dynamo kv runs once at its default and once with the
/// same scale (`--router-prefill-load-scale`).
const PREFILL_LOAD_SCALE: &str = "3";
const MAX_TOKENS: u32 = 16;
/// Resamples behind each shared-prefix verdict's interval.
const BOOTSTRAP_ROUNDS: usize = 2000;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The frontend may list the model before it can serve (disaggregated) requests.
const WARM_UP_WITHIN: Duration = Duration::from_secs(30);
/// Lets the last kv-events and load samples of a run settle before the next starts.
const BETWEEN_RUNS: Duration = Duration::from_secs(1);
/// "Within 5%" in the targets.
const TOLERANCE: f64 = 0.05;
/// Where the control plane's `dynamo.kv` settings live, to see whether provisional overlap
/// credit can be switched off.
const SIGNALS_RS: &str = "control-plane/src/config/signals.rs";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fleet {
    Aggregated,
    Disaggregated,
}

impl Fleet {
    fn label(self) -> &'static str {
        match self {
            Fleet::Aggregated => "agg (2 workers)",
            Fleet::Disaggregated => "disagg (2 prefill + 2 decode)",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Fleet::Aggregated => "agg",
            Fleet::Disaggregated => "disagg",
        }
    }

    fn mockers(self) -> Vec<(&'static str, Mocker)> {
        let mocker = |mode| Mocker { mode, kv_blocks: KV_BLOCKS, dp_size: 1 };
        match self {
            Fleet::Aggregated => vec![("agg-a", mocker(Mode::Aggregated)), ("agg-b", mocker(Mode::Aggregated))],
            Fleet::Disaggregated => vec![
                ("prefill-a", mocker(Mode::Prefill)),
                ("prefill-b", mocker(Mode::Prefill)),
                ("decode-a", mocker(Mode::Decode)),
                ("decode-b", mocker(Mode::Decode)),
            ],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Router {
    RoundRobin,
    DynamoKv,
    DynamoKvScaled,
    ContinuumLoad,
    ContinuumKv,
    ContinuumKvNoProvisional,
}

impl Router {
    fn label(self) -> Cow<'static, str> {
        match self {
            Router::RoundRobin => "Dynamo round-robin".into(),
            Router::DynamoKv => "Dynamo kv".into(),
            Router::DynamoKvScaled => format!("Dynamo kv, `--router-prefill-load-scale {PREFILL_LOAD_SCALE}`").into(),
            Router::ContinuumLoad => "Continuum load-based".into(),
            Router::ContinuumKv => "Continuum KV-aware".into(),
            Router::ContinuumKvNoProvisional => "Continuum KV-aware, provisional credit off".into(),
        }
    }

    /// The name `--only-routers` and `--dump` use.
    fn slug(self) -> &'static str {
        match self {
            Router::RoundRobin => "round-robin",
            Router::DynamoKv => "dynamo-kv",
            Router::DynamoKvScaled => "dynamo-kv-scaled",
            Router::ContinuumLoad => "continuum-load",
            Router::ContinuumKv => "continuum-kv",
            Router::ContinuumKvNoProvisional => "continuum-kv-no-provisional",
        }
    }

    fn is_continuum(self) -> bool {
        matches!(self, Router::ContinuumLoad | Router::ContinuumKv | Router::ContinuumKvNoProvisional)
    }
}

/// A named workload; its seed is set per run.
#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    spec: Spec,
    larger: bool,
}

impl Case {
    fn shared(&self) -> bool {
        matches!(self.spec.shape, Shape::SharedPrefix { .. })
    }

    /// The larger variant runs on the aggregated fleet only, to keep the matrix within about
    /// 30 minutes on 2 cores.
    fn runs_on(&self, fleet: Fleet) -> bool {
        !self.larger || fleet == Fleet::Aggregated
    }
}

/// Think time of the unique-prompt clients between two requests: uniform in 0 to this. Enough
/// to spread their arrivals over several of an engine's decode steps.
const UNIQUE_THINK_MS: u64 = 200;

fn cases(requests: usize, quick: bool, unique_think_ms: u64) -> Vec<Case> {
    let shared = |groups, users, concurrency| Spec {
        shape: Shape::SharedPrefix { groups, users, system_tokens: 1500, turn_tokens: 60 },
        requests,
        max_tokens: MAX_TOKENS,
        concurrency,
        max_think_ms: 500,
        seed: 0,
    };
    let unique = Spec {
        shape: Shape::Unique { prompt_tokens: 1560 },
        requests,
        max_tokens: MAX_TOKENS,
        concurrency: 8,
        max_think_ms: unique_think_ms,
        seed: 0,
    };
    let mut cases = vec![Case { name: "shared prefix 8×2", spec: shared(8, 2, 8), larger: false }];
    if !quick {
        cases
            .push(Case { name: "shared prefix 13×3 (larger, agg fleet only)", spec: shared(13, 3, 12), larger: true });
    }
    cases.push(Case { name: "unique prompts", spec: unique, larger: false });
    cases
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--client") {
        let (file, bases) = (args.get(at + 1).context("--client FILE BASES")?, args.get(at + 2).context("BASES")?);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        return runtime.block_on(client::run(Path::new(file), bases));
    }
    let quick = args.iter().any(|a| a == "--quick");
    let runs = arg("--runs", if quick { 1 } else { 5 })?.max(1);
    let requests = arg("--requests", if quick { 128 } else { 256 })?;
    let seed = u64::try_from(arg("--seed", 1)?)?;
    for binary in ["continuum-control-plane", "continuum-data-plane"] {
        let path = tools::binary(binary);
        ensure!(path.exists(), "no {}: run `cargo build --release --bins` first", path.display());
    }
    let mut fleets = if quick { vec![Fleet::Aggregated] } else { vec![Fleet::Aggregated, Fleet::Disaggregated] };
    if let Some(only) = text_arg("--only-fleets") {
        fleets.retain(|f| only.split(',').any(|o| o == f.slug()));
    }
    let provisional = provisional_ttl_exists();
    let mut routers =
        vec![Router::RoundRobin, Router::DynamoKv, Router::DynamoKvScaled, Router::ContinuumLoad, Router::ContinuumKv];
    if provisional {
        routers.push(Router::ContinuumKvNoProvisional);
    }
    // Investigation filters: `--only-routers round-robin,continuum-load` `--only-cases unique`.
    if let Some(only) = text_arg("--only-routers") {
        routers.retain(|r| only.split(',').any(|o| o == r.slug()));
    }
    // `--unique-think-ms 0`: the lockstep closed loop, to investigate phase effects.
    let unique_think_ms = u64::try_from(arg("--unique-think-ms", UNIQUE_THINK_MS as usize)?)?;
    let mut cases = cases(requests, quick, unique_think_ms);
    if let Some(only) = text_arg("--only-cases") {
        cases.retain(|c| only.split(',').any(|o| c.name.starts_with(o)));
    }
    ensure!(!routers.is_empty() && !cases.is_empty(), "the filters left nothing to run");
    let dump = text_arg("--dump").map(std::path::PathBuf::from);
    let filtered = ["--only-fleets", "--only-routers", "--only-cases", "--kv-settings", "--unique-think-ms"]
        .iter()
        .any(|f| text_arg(f).is_some());
    ensure!(!(filtered && args.iter().any(|a| a == "--write")), "a filtered run is not the whole table: drop --write");
    let tokenizer = tokenizers::Tokenizer::from_file(tools::dynamo_fixtures().join("tinymodel/tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("the fixture tokenizer: {e}"))?;
    let mut count = |text: &str| tokenizer.encode(text, false).map_or(0, |e| e.len());
    // The same content for every router: run r of case c has its own seed.
    let mut workloads: BTreeMap<(usize, usize), Workload> = BTreeMap::new();
    for (c, case) in cases.iter().enumerate() {
        for run in 0..runs {
            let spec = Spec { seed: seed * 1_000_000 + (c * 1000 + run) as u64, ..case.spec };
            workloads.insert((c, run), workload::generate(spec, &mut count));
        }
    }

    let began = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut results: BTreeMap<(Fleet, usize, Router), Vec<RunStats>> = BTreeMap::new();
    for &fleet in &fleets {
        for &router in &routers {
            let cell = Instant::now();
            let stats = runtime.block_on(bench_router(fleet, router, &cases, runs, &workloads, dump.as_deref()))?;
            eprintln!("{} / {}: {:?}", fleet.label(), router.label(), cell.elapsed());
            for ((c, _), s) in stats {
                results.entry((fleet, c, router)).or_default().push(s);
            }
        }
    }
    let report = Report { fleets, routers, cases, runs, requests, results, provisional };
    let table = report.render(began.elapsed());
    println!("{table}");
    if args.iter().any(|a| a == "--write") {
        write_section("bench-routing", "Routing: Continuum vs Dynamo's routers (real mockers)", COMMAND, &table)?;
    }
    Ok(())
}

/// Whether the control plane knows `dynamo.kv.provisional_ttl` (provisional overlap credit for
/// a request just routed, before its kv-events arrive; `0s` switches it off).
fn provisional_ttl_exists() -> bool {
    std::fs::read_to_string(tools::workspace_root().join(SIGNALS_RS)).is_ok_and(|s| s.contains("provisional_ttl"))
}

/// One router on one fleet: every case's runs, in a fresh namespace.
async fn bench_router(
    fleet: Fleet,
    router: Router,
    cases: &[Case],
    runs: usize,
    workloads: &BTreeMap<(usize, usize), Workload>,
    dump: Option<&Path>,
) -> anyhow::Result<Vec<((usize, usize), RunStats)>> {
    let ns = NetNs::create()?;
    dynamo::start_etcd(&ns).await?;
    let watch = InstanceWatch::start(&ns).await?;
    let frontend = format!("http://{FRONTEND}");
    let continuum = match router {
        Router::RoundRobin => {
            dynamo_routing::start_frontend_routing(&ns, "round-robin", &[])?;
            None
        }
        Router::DynamoKv => {
            dynamo_routing::start_frontend_routing(&ns, "kv", &[])?;
            None
        }
        Router::DynamoKvScaled => {
            dynamo_routing::start_frontend_routing(&ns, "kv", &["--router-prefill-load-scale", PREFILL_LOAD_SCALE])?;
            None
        }
        Router::ContinuumLoad | Router::ContinuumKv | Router::ContinuumKvNoProvisional => {
            let cache = ns.dir().join("kv-artifacts");
            // Investigation: `--kv-settings "prefill_load_scale: 2;router_temperature: 0.1"`
            // sets `dynamo.kv` keys for both KV-aware variants (the scale for load-based too).
            let tuned = text_arg("--kv-settings").unwrap_or_default();
            let mut kv: Vec<&str> = tuned.split(';').map(str::trim).filter(|s| !s.is_empty()).collect();
            let default_scale = format!("prefill_load_scale: {PREFILL_LOAD_SCALE}");
            let scale = kv.iter().find(|s| s.starts_with("prefill_load_scale")).copied().unwrap_or(&default_scale);
            let yaml = match router {
                Router::ContinuumLoad => with_kv_section(&format!("  kv:\n    {scale}\n"))?,
                _ => {
                    if !tuned.contains("prefill_load_scale") {
                        kv.push(&default_scale);
                    }
                    kv.push("send_token_data: true");
                    if router == Router::ContinuumKvNoProvisional {
                        kv.push("provisional_ttl: 0s");
                    }
                    kv_control_plane_yaml(&cache, &kv)?
                }
            };
            let replica_args = ["--find-matches-deadline", FIND_MATCHES_DEADLINE];
            let continuum = RoutedContinuum::start_with(&ns, 2, &yaml, &replica_args).await?;
            dynamo_routing::start_frontend(&ns)?;
            Some(continuum)
        }
    };
    let mockers = fleet.mockers();
    for (label, mocker) in &mockers {
        mocker.start_with(&ns, &watch, label, &MOCKER_ARGS).await?;
    }
    dynamo_routing::wait_model_listed(&ns, "frontend", &frontend, "tiny").await?;
    let bases = match &continuum {
        Some(continuum) => {
            continuum.wait_for_workers(&ns, mockers.len()).await?;
            for replica in &continuum.replicas {
                dynamo_routing::wait_model_listed(&ns, "replica", replica, "tiny").await?;
            }
            continuum.replicas.clone()
        }
        None => vec![frontend],
    };
    for base in &bases {
        warm_up(&ns, base, router).await?;
    }

    let mut out = Vec::new();
    for (c, case) in cases.iter().enumerate().filter(|(_, case)| case.runs_on(fleet)) {
        for run in 0..runs {
            let workload = workloads.get(&(c, run)).context("a generated workload")?;
            let before = selections(&ns, &bases, router).await?;
            let file = ns.dir().join(format!("workload-{c}-{run}.json"));
            std::fs::write(&file, serde_json::to_vec(workload)?)?;
            let mut client = ns.command(std::env::current_exe()?);
            client.arg("--client").arg(&file).arg(bases.join(","));
            let output = ns.run(client).await.with_context(|| format!("the client, {} run {run}", case.name))?;
            let answer: client::Answer = serde_json::from_str(&output)?;
            if let Some(dir) = dump {
                std::fs::create_dir_all(dir)?;
                let name = format!("{}-{}-{c}-{run}.json", fleet.slug(), router.slug());
                std::fs::write(dir.join(name), &output)?;
            }
            let after = selections(&ns, &bases, router).await?;
            let kv = after.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0))).collect();
            let stats = RunStats::of(&answer, kv);
            eprintln!("  {} run {run}: {}", case.name, stats.brief());
            out.push(((c, run), stats));
            tokio::time::sleep(BETWEEN_RUNS).await;
        }
    }
    if let Some(dir) = dump {
        // The processes' logs too (`RUST_LOG=continuum_data_plane::routing=debug` explains each pick).
        for entry in std::fs::read_dir(ns.dir())? {
            let path = entry?.path();
            if let Some(name) = path.file_name().and_then(|n| n.to_str()).filter(|n| n.ends_with(".log")) {
                std::fs::copy(&path, dir.join(format!("{}-{}-{name}", fleet.slug(), router.slug())))?;
            }
        }
        // And the replicas' metrics, whose histograms show where a request's time went.
        for (i, base) in bases.iter().enumerate().filter(|_| router.is_continuum()) {
            let (_, text) = ns.get(&format!("{base}/metrics")).await?;
            std::fs::write(dir.join(format!("{}-{}-replica-{i}-metrics.txt", fleet.slug(), router.slug())), text)?;
        }
    }
    Ok(out)
}

/// Until `base` answers a short request with 200 (a disaggregated frontend lists the model
/// before it can serve), then, for a KV-aware replica, until its tokenizer is loaded.
async fn warm_up(ns: &NetNs, base: &str, router: Router) -> anyhow::Result<()> {
    let deadline = Instant::now() + WARM_UP_WITHIN;
    for n in 0.. {
        let body = json!({"model": "tiny", "messages": [{"role": "user", "content": format!("warm up {n}")}],
                          "max_tokens": 2, "stream": false});
        let last = match post_chat(ns, base, &body, &[], REQUEST_TIMEOUT).await? {
            Outcome::Answered(a) if a.status == 200 => break,
            Outcome::Answered(a) => format!("{} {}", a.status, a.body),
            Outcome::TimedOut => "timed out".to_string(),
        };
        ensure!(Instant::now() < deadline, "{base} did not answer 200 within {WARM_UP_WITHIN:?}: {last}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if matches!(router, Router::ContinuumKv | Router::ContinuumKvNoProvisional) {
        let series = "continuum_dynamo_kv_artifacts_total{result=\"loaded\"}";
        while metric(&ns.get(&format!("{base}/metrics")).await?.1, series) == 0.0 {
            ensure!(Instant::now() < deadline, "{base} never loaded the tiny model's tokenizer");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Keys of the KV term's timing in a run's `kv` figures, before the stage name; selection
/// results are keyed by their bare name.
const TERM_PREFIX: &str = "term ";
const TERM_SECONDS: &str = "term seconds ";
const TERM_COUNT: &str = "term count ";

/// `continuum_dynamo_kv_selection_total` by result, and `continuum_dynamo_kv_term_seconds`'s
/// sum and count by stage (keyed [`TERM_SECONDS`] / [`TERM_COUNT`] and the stage), summed over
/// the replicas.
async fn selections(ns: &NetNs, bases: &[String], router: Router) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut total = BTreeMap::new();
    if !router.is_continuum() {
        return Ok(total);
    }
    let series = [
        ("continuum_dynamo_kv_selection_total{result=\"", ""),
        ("continuum_dynamo_kv_term_seconds_sum{stage=\"", TERM_SECONDS),
        ("continuum_dynamo_kv_term_seconds_count{stage=\"", TERM_COUNT),
    ];
    for base in bases {
        let (_, text) = ns.get(&format!("{base}/metrics")).await?;
        for line in text.lines() {
            let Some((key, rest)) = series.iter().find_map(|(p, key)| Some((*key, line.strip_prefix(p)?))) else {
                continue;
            };
            let Some((label, value)) = rest.split_once("\"}") else { continue };
            *total.entry(format!("{key}{label}")).or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    Ok(total)
}

fn metric(text: &str, series: &str) -> f64 {
    continuum_tests::sample(text, series).unwrap_or(0.0)
}
