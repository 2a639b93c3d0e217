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
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

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
/// `dynamo.kv.prefill_load_scale` for both Continuum pickers (the seed's default is 1): under KV
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
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// The figures of one run.
#[derive(Debug, Clone, Default)]
struct RunStats {
    requests_per_s: f64,
    output_tokens_per_s: f64,
    ttft_mean: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    ttft_p99: f64,
    e2e_p50: f64,
    e2e_p99: f64,
    /// Cached prompt tokens over prompt tokens; `None` if no response reported cached tokens.
    hit_rate: Option<f64>,
    failed: usize,
    /// `continuum_dynamo_kv_selection_total` increments during the run, by result.
    kv: BTreeMap<String, f64>,
    /// Requests per serving worker (decode, or aggregated).
    spread: BTreeMap<u64, usize>,
    /// Every answered request's TTFT and end-to-end time, sorted: a cell's percentiles pooled
    /// over its runs.
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    /// Later turns served by another worker than the conversation's previous turn…
    moved: usize,
    /// …and later turns on the same worker that still missed the cache (evicted under KV
    /// pressure): half or more of the prompt uncached.
    evicted: usize,
    /// Where requests waited behind another's prefill, and what the slowest decoded beside.
    placement: Placement,
    /// The first tokens outside the run's opening burst, sorted.
    ttft_after_opening: Vec<f64>,
}

impl RunStats {
    fn of(answer: &client::Answer, kv: BTreeMap<String, f64>) -> Self {
        let ok: Vec<&client::Outcome> = answer.results.iter().filter(|r| r.error.is_none()).collect();
        let wall = answer.wall_ms.max(1.0) / 1000.0;
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
        ttft.sort_by(f64::total_cmp);
        e2e.sort_by(f64::total_cmp);
        let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let reported = ok.iter().any(|r| r.cached_tokens.is_some());
        let cached = reported.then(|| ok.iter().filter_map(|r| r.cached_tokens).sum::<u64>());
        let mut spread = BTreeMap::new();
        for r in &ok {
            *spread.entry(r.decode_worker.unwrap_or(0)).or_insert(0) += 1;
        }
        let mut turns: BTreeMap<(usize, usize), &client::Outcome> = BTreeMap::new();
        for r in &ok {
            turns.insert((r.conversation, r.turn), r);
        }
        let (mut moved, mut evicted) = (0, 0);
        for (&(conversation, turn), r) in &turns {
            let Some(previous) = turn.checked_sub(1).and_then(|t| turns.get(&(conversation, t))) else { continue };
            if previous.decode_worker != r.decode_worker {
                moved += 1;
            } else if r.cached_tokens.unwrap_or(0) * 2 < r.prompt_tokens {
                evicted += 1;
            }
        }
        let served: Vec<Served> = ok
            .iter()
            .filter_map(|r| {
                let (ttft_ms, decode_worker) = (r.ttft_ms?, r.decode_worker?);
                let prefill_worker = r.prefill_worker.unwrap_or(decode_worker);
                Some(Served { start_ms: r.start_ms, ttft_ms, e2e_ms: r.e2e_ms, prefill_worker, decode_worker })
            })
            .collect();
        Self {
            placement: placement(&served),
            ttft_after_opening: ttft_after_opening(&served),
            requests_per_s: ok.len() as f64 / wall,
            output_tokens_per_s: ok.iter().map(|r| r.completion_tokens).sum::<u64>() as f64 / wall,
            ttft_mean: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
            ttft_p50: quantile(&ttft, 0.5),
            ttft_p90: quantile(&ttft, 0.9),
            ttft_p99: quantile(&ttft, 0.99),
            e2e_p50: quantile(&e2e, 0.5),
            e2e_p99: quantile(&e2e, 0.99),
            hit_rate: cached.filter(|_| prompt > 0).map(|c| c as f64 / prompt as f64),
            failed: answer.results.len() - ok.len(),
            kv,
            spread,
            ttft,
            e2e,
            moved,
            evicted,
        }
    }

    fn brief(&self) -> String {
        format!(
            "{:.2} req/s, TTFT p50 {:.0} p90 {:.0} ms, e2e p50 {:.0} ms, hit {}, failed {}, workers {:?}, kv {:?}",
            self.requests_per_s,
            self.ttft_p50,
            self.ttft_p90,
            self.e2e_p50,
            self.hit_rate.map_or("n/a".into(), |h| format!("{h:.2}")),
            self.failed,
            self.spread.values().collect::<Vec<_>>(),
            self.kv
        )
    }
}

/// A figure over a cell's runs: the median and the spread (min, max).
#[derive(Debug, Clone, Copy)]
struct Figure {
    median: f64,
    min: f64,
    max: f64,
}

impl Figure {
    fn of(runs: &[RunStats], get: impl Fn(&RunStats) -> Option<f64>) -> Option<Self> {
        let mut values: Vec<f64> = runs.iter().filter_map(get).collect();
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 };
        Some(Self { median, min: values[0], max: values[n - 1] })
    }

    fn show(fig: Option<Self>, decimals: usize) -> String {
        let Some(f) = fig else { return "n/a".into() };
        if f.min == f.max {
            return format!("{:.*}", decimals, f.median);
        }
        format!("{:.*} ({:.*}–{:.*})", decimals, f.median, decimals, f.min, decimals, f.max)
    }
}

/// The figures of the table, with whether higher is better.
const FIGURES: [(&str, bool, usize); 9] = [
    ("req/s", true, 2),
    ("output tok/s", true, 1),
    ("TTFT mean ms", false, 0),
    ("TTFT p50 ms", false, 0),
    ("TTFT p90 ms", false, 0),
    ("TTFT p99 ms", false, 0),
    ("e2e p50 ms", false, 0),
    ("e2e p99 ms", false, 0),
    ("hit rate", true, 2),
];

fn figure_of(runs: &[RunStats], index: usize) -> Option<Figure> {
    Figure::of(runs, |r| match index {
        0 => Some(r.requests_per_s),
        1 => Some(r.output_tokens_per_s),
        2 => Some(r.ttft_mean),
        3 => Some(r.ttft_p50),
        4 => Some(r.ttft_p90),
        5 => Some(r.ttft_p99),
        6 => Some(r.e2e_p50),
        7 => Some(r.e2e_p99),
        _ => r.hit_rate,
    })
}

struct Report {
    fleets: Vec<Fleet>,
    routers: Vec<Router>,
    cases: Vec<Case>,
    runs: usize,
    requests: usize,
    results: BTreeMap<(Fleet, usize, Router), Vec<RunStats>>,
    provisional: bool,
}

impl Report {
    fn render(&self, took: Duration) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{}. Took {:.1} min. Each figure is the median of {} run(s) of {} requests, with the spread (min–max) \
             in brackets; the targets' TTFT p90 is taken over all runs' requests pooled. Workers: `dynamo.mocker` \
             with `--block-size 16 --num-gpu-blocks-override {KV_BLOCKS} --speedup-ratio 1.0` (its polynomial timing charges prefill by uncached prompt tokens), {MAX_TOKENS} \
             output tokens, streaming. Shared prefix: groups × users conversations, 1,500-token system prompt per \
             group, 60-token user turns, think time 0–500 ms, groups started 150 ms apart (+0–400 ms each); \
             concurrency 8 (8×2) and 12 (13×3). Unique prompts: 1,560 fresh tokens each, 8 clients sending one after another with a think time of 0–{UNIQUE_THINK_MS} ms. Hit rate \
             = Σ `usage.prompt_tokens_details.cached_tokens` / Σ prompt tokens. Continuum: 2 data-plane replicas \
             (requests alternate between them) pinning workers through `dynamo.frontend --router-mode direct`; \
             both at `prefill_load_scale: {PREFILL_LOAD_SCALE}` (the seed's default is 1; Dynamo kv is shown at \
             its default and at the same scale); KV-aware with `dynamo.kv` on, the tiny model's artifacts \
             pinned, `send_token_data: true` (the frontend takes the router's tokens instead of tokenizing the \
             prompt again), `--find-matches-deadline \
             {FIND_MATCHES_DEADLINE}` (the default, 2 ms, suits a control plane with a core of its own; here one \
             lookup in ten missed it).\n\n",
            memory_facts(),
            took.as_secs_f64() / 60.0,
            self.runs,
            self.requests,
        ));
        if !self.provisional {
            out.push_str(
                "The cell \"Continuum KV-aware, provisional credit off\" is absent: `dynamo.kv.provisional_ttl` \
                 did not exist in the control plane when this ran.\n\n",
            );
        }
        for &fleet in &self.fleets {
            for (c, case) in self.cases.iter().enumerate().filter(|(_, case)| case.runs_on(fleet)) {
                out.push_str(&format!("**{} — {}**\n\n| router |", fleet.label(), case.name));
                for (name, _, _) in FIGURES {
                    out.push_str(&format!(" {name} |"));
                }
                out.push_str(" failed |\n|---|");
                out.push_str(&"---|".repeat(FIGURES.len() + 1));
                out.push('\n');
                for &router in &self.routers {
                    let runs = self.cell(fleet, c, router);
                    out.push_str(&format!("| {} |", router.label()));
                    for (i, (_, _, decimals)) in FIGURES.iter().enumerate() {
                        out.push_str(&format!(" {} |", Figure::show(figure_of(runs, i), *decimals)));
                    }
                    out.push_str(&format!(" {} |\n", runs.iter().map(|r| r.failed).sum::<usize>()));
                }
                out.push('\n');
            }
        }
        out.push_str(&self.selections());
        out.push_str(&self.verdicts());
        out
    }

    fn cell(&self, fleet: Fleet, case: usize, router: Router) -> &[RunStats] {
        self.results.get(&(fleet, case, router)).map_or(&[], Vec::as_slice)
    }

    /// What the KV-aware replicas' selections came to, so a reader sees whether the 2 ms
    /// `FindMatches` deadline bit.
    fn selections(&self) -> String {
        let mut out = String::from(
            "KV-aware selections over all runs (`continuum_dynamo_kv_selection_total` by result, both replicas):\n\n",
        );
        for &fleet in &self.fleets {
            for (c, case) in self.cases.iter().enumerate().filter(|(_, case)| case.runs_on(fleet)) {
                for &router in
                    self.routers.iter().filter(|r| matches!(r, Router::ContinuumKv | Router::ContinuumKvNoProvisional))
                {
                    let mut total: BTreeMap<&str, f64> = BTreeMap::new();
                    for run in self.cell(fleet, c, router) {
                        for (k, v) in &run.kv {
                            *total.entry(k).or_insert(0.0) += v;
                        }
                    }
                    let shown: Vec<String> = total
                        .iter()
                        .filter(|(k, v)| **v > 0.0 && !k.starts_with(TERM_PREFIX))
                        .map(|(k, v)| format!("{k} {v:.0}"))
                        .collect();
                    let mean_ms = |stage: &str| {
                        let count = total.get(format!("{TERM_COUNT}{stage}").as_str()).copied().unwrap_or(0.0);
                        let seconds = total.get(format!("{TERM_SECONDS}{stage}").as_str()).copied().unwrap_or(0.0);
                        (count > 0.0).then(|| 1000.0 * seconds / count)
                    };
                    let queued = match (mean_ms("queue"), mean_ms("render")) {
                        (Some(queue), Some(render)) => {
                            format!(" (of which waiting to run {queue:.2} ms, running {render:.2} ms)")
                        }
                        _ => String::new(),
                    };
                    let timing = match (mean_ms("prepare"), mean_ms("find_matches")) {
                        (Some(prepare), Some(lookup)) => format!(
                            "; KV term per selection (mean): prepare {prepare:.2} ms{queued}, FindMatches {lookup:.2} ms"
                        ),
                        _ => String::new(),
                    };
                    out.push_str(&format!(
                        "* {} — {} — {}: {}{timing}\n",
                        fleet.label(),
                        case.name,
                        router.label(),
                        if shown.is_empty() { "none".into() } else { shown.join(", ") }
                    ));
                }
            }
        }
        out.push('\n');
        out
    }

    /// The targets, checked cell by cell, with what the runs say about each loss.
    fn verdicts(&self) -> String {
        let mut out = String::from(
            "Targets (shared prefix: TTFT p90 over all runs' requests pooled, hit rate and req/s medians; unique \
             prompts: rates the runs' medians, latencies over all runs' requests pooled):\n\n",
        );
        for &fleet in &self.fleets {
            for (c, case) in self.cases.iter().enumerate().filter(|(_, case)| case.runs_on(fleet)) {
                // A partial run (`--only-routers`) judges only the pairs it measured.
                let measured = |a, b| !self.cell(fleet, c, a).is_empty() && !self.cell(fleet, c, b).is_empty();
                if case.shared() {
                    if measured(Router::ContinuumKv, Router::DynamoKv) {
                        out.push_str(&self.shared_verdict(fleet, c, case));
                    }
                } else {
                    for router in [Router::ContinuumLoad, Router::ContinuumKv] {
                        if measured(router, Router::RoundRobin) {
                            out.push_str(&self.unique_verdict(fleet, c, case, router));
                        }
                    }
                }
            }
        }
        out
    }

    fn median(&self, fleet: Fleet, c: usize, router: Router, figure: usize) -> f64 {
        figure_of(self.cell(fleet, c, router), figure).map_or(f64::NAN, |f| f.median)
    }

    /// A TTFT quantile over every run's requests together: three runs' medians of a p90 move
    /// with each run's few slowest requests, the pooled p90 rests on ten times as many.
    fn pooled_ttft(&self, fleet: Fleet, c: usize, router: Router, q: f64) -> f64 {
        quantile(&self.pooled(fleet, c, router, |r| &r.ttft), q)
    }

    /// Every run's samples of one kind together, sorted.
    fn pooled(&self, fleet: Fleet, c: usize, router: Router, samples: fn(&RunStats) -> &[f64]) -> Vec<f64> {
        let mut all: Vec<f64> = self.cell(fleet, c, router).iter().flat_map(|r| samples(r).iter().copied()).collect();
        all.sort_by(f64::total_cmp);
        all
    }

    /// Figure `index` of [`FIGURES`] as the unique-prompt verdict weighs it: rates are the
    /// runs' medians; latencies are taken over every run's requests pooled, for the reason
    /// [`Self::pooled_ttft`] gives (a run's p99 of 256 requests is its third slowest).
    fn judged(&self, fleet: Fleet, c: usize, router: Router, index: usize) -> f64 {
        let ttft = || self.pooled(fleet, c, router, |r| &r.ttft);
        let e2e = || self.pooled(fleet, c, router, |r| &r.e2e);
        match index {
            2 => {
                let all = ttft();
                all.iter().sum::<f64>() / all.len().max(1) as f64
            }
            3 => quantile(&ttft(), 0.5),
            4 => quantile(&ttft(), 0.9),
            5 => quantile(&ttft(), 0.99),
            6 => quantile(&e2e(), 0.5),
            7 => quantile(&e2e(), 0.99),
            _ => self.median(fleet, c, router, index),
        }
    }

    fn shared_verdict(&self, fleet: Fleet, c: usize, case: &Case) -> String {
        let (ours, theirs) = (Router::ContinuumKv, Router::DynamoKv);
        let m = |router, figure| self.median(fleet, c, router, figure);
        let (p90, their_p90) = (self.pooled_ttft(fleet, c, ours, 0.9), self.pooled_ttft(fleet, c, theirs, 0.9));
        let (hit, their_hit) = (m(ours, 8), m(theirs, 8));
        let (rps, their_rps) = (m(ours, 0), m(theirs, 0));
        let mut losses = Vec::new();
        if p90.partial_cmp(&their_p90) != Some(Ordering::Less) {
            losses.push(format!("pooled TTFT p90 {p90:.0} ms vs {their_p90:.0} ms"));
        }
        if hit.partial_cmp(&their_hit) != Some(Ordering::Greater) {
            losses.push(format!("hit rate {hit:.2} vs {their_hit:.2}"));
        }
        // A NaN (a missing figure) counts as a loss.
        if rps.partial_cmp(&(their_rps * (1.0 - TOLERANCE))).is_none_or(Ordering::is_lt) {
            losses.push(format!("{rps:.2} req/s vs {their_rps:.2} (more than 5% lower)"));
        }
        let head = format!("* {} — {}: Continuum KV-aware vs Dynamo kv", fleet.label(), case.name);
        let control = self.same_scale(fleet, c);
        let spread = self.p90_interval(fleet, c, ours, theirs);
        if losses.is_empty() {
            return format!(
                "{head}: **meets** (pooled TTFT p90 {p90:.0} vs {their_p90:.0} ms, hit rate {hit:.2} vs {their_hit:.2}, \
                 {rps:.2} vs {their_rps:.2} req/s).{spread}{control}\n"
            );
        }
        format!("{head}: **loses** on {}.{spread} {}{control}\n", losses.join("; "), self.why(fleet, c, ours, theirs))
    }

    /// How far apart the two pooled TTFT p90s could be, given how much runs and requests vary:
    /// a difference inside the interval's reach is not one these runs can tell.
    fn p90_interval(&self, fleet: Fleet, c: usize, ours: Router, theirs: Router) -> String {
        let ttfts = |router| self.cell(fleet, c, router).iter().map(|r| r.ttft.clone()).collect::<Vec<_>>();
        match quantile_difference_interval(&ttfts(ours), &ttfts(theirs), 0.9, 0.95, BOOTSTRAP_ROUNDS) {
            Some((lo, hi)) => format!(
                " Pooled TTFT p90 less theirs: 95% bootstrap interval (runs, then requests, resampled) {lo:+.0} to \
                 {hi:+.0} ms{}.",
                if lo < 0.0 && hi > 0.0 { ": within what these runs can tell apart" } else { "" }
            ),
            None => String::new(),
        }
    }

    /// The control for Continuum's tuning: Dynamo kv given the same prefill load scale, so a
    /// reader sees how much of a win is the scale and how much the router.
    fn same_scale(&self, fleet: Fleet, c: usize) -> String {
        let (ours, control) = (Router::ContinuumKv, Router::DynamoKvScaled);
        if self.cell(fleet, c, control).is_empty() {
            return String::new();
        }
        let m = |router, figure| self.median(fleet, c, router, figure);
        format!(
            " Against Dynamo kv at the same scale: pooled TTFT p90 {:.0} vs {:.0} ms, hit rate {:.2} vs {:.2}, \
             {:.2} vs {:.2} req/s.",
            self.pooled_ttft(fleet, c, ours, 0.9),
            self.pooled_ttft(fleet, c, control, 0.9),
            m(ours, 8),
            m(control, 8),
            m(ours, 0),
            m(control, 0)
        )
    }

    fn unique_verdict(&self, fleet: Fleet, c: usize, case: &Case, ours: Router) -> String {
        let mut losses = Vec::new();
        for (i, (name, higher_better, _)) in FIGURES.iter().enumerate().take(8) {
            let (a, b) = (self.judged(fleet, c, ours, i), self.judged(fleet, c, Router::RoundRobin, i));
            let within = if *higher_better { a >= b * (1.0 - TOLERANCE) } else { a <= b * (1.0 + TOLERANCE) };
            if !within {
                let pooled = if (2..8).contains(&i) { "pooled " } else { "" };
                losses.push(format!("{pooled}{name} {a:.1} vs {b:.1} ({:+.0}%)", (a / b - 1.0) * 100.0));
            }
        }
        let head = format!("* {} — {}: {} vs Dynamo round-robin", fleet.label(), case.name, ours.label());
        if losses.is_empty() {
            return format!("{head}: **meets** (every figure within 5%).\n");
        }
        let spread = self.p90_interval(fleet, c, ours, Router::RoundRobin);
        format!(
            "{head}: **loses** on {}.{spread} {}\n",
            losses.join("; "),
            self.why(fleet, c, ours, Router::RoundRobin)
        )
    }

    /// What the measurements say about a losing Continuum cell.
    fn why(&self, fleet: Fleet, c: usize, ours: Router, theirs: Router) -> String {
        let runs = self.cell(fleet, c, ours);
        let total = |key: &str| runs.iter().map(|r| r.kv.get(key).copied().unwrap_or(0.0)).sum::<f64>();
        let selected: f64 =
            runs.iter().flat_map(|r| &r.kv).filter(|(k, _)| !k.starts_with(TERM_PREFIX)).map(|(_, v)| v).sum();
        let mut why = Vec::new();
        let timeouts = total("index_timeout") + total("index_unavailable");
        if timeouts > 0.0 {
            why.push(format!(
                "{timeouts:.0} of {selected:.0} selections got no FindMatches answer within the deadline (scored on \
                 load alone)"
            ));
        }
        let recent = total("index_recent");
        if recent > 0.0 {
            why.push(format!("{recent:.0} more missed it and were scored on a recent answer for their prefix"));
        }
        if self.cases.get(c).is_some_and(Case::shared) {
            let sum = |router, get: fn(&RunStats) -> usize| self.cell(fleet, c, router).iter().map(get).sum::<usize>();
            why.push(format!(
                "over all runs, later turns moved to another worker {} times (theirs {}) and missed the cache on the \
                 same worker (evicted under KV pressure) {} times (theirs {})",
                sum(ours, |r| r.moved),
                sum(theirs, |r| r.moved),
                sum(ours, |r| r.evicted),
                sum(theirs, |r| r.evicted)
            ));
        }
        if self.cases.get(c).is_some_and(|case| !case.shared()) {
            why.push(self.queueing(fleet, c, ours, theirs));
        }
        let fallbacks = total("tokenizer_unavailable") + total("render_unavailable") + total("prompt_too_large");
        if fallbacks > 0.0 {
            why.push(format!("{fallbacks:.0} selections fell back before hashing"));
        }
        let hop = self.median(fleet, c, ours, 6) - self.median(fleet, c, theirs, 6);
        let render = if matches!(ours, Router::ContinuumLoad) { "" } else { ", renders and tokenizes the prompt" };
        why.push(format!(
            "Continuum's path has one more HTTP hop (client → replica → frontend){render} and runs two more \
             processes on the same 2 cores; its e2e p50 is {hop:+.0} ms against {}'s",
            theirs.label()
        ));
        let failed: usize = runs.iter().map(|r| r.failed).sum();
        if failed > 0 {
            why.push(format!("{failed} requests failed"));
        }
        format!("Measured: {}.", why.join("; "))
    }

    /// Where a cell's requests waited for their prefill and what its slowest decoded beside,
    /// per run on average, against the peer's (see [`placement`]).
    fn queueing(&self, fleet: Fleet, c: usize, ours: Router, theirs: Router) -> String {
        let mean = |router, get: fn(&Placement) -> f64| {
            let runs = self.cell(fleet, c, router);
            runs.iter().map(|r| get(&r.placement)).sum::<f64>() / runs.len().max(1) as f64
        };
        let both = |get: fn(&Placement) -> f64, decimals: usize| {
            format!("{:.*} (theirs {:.*})", decimals, mean(ours, get), decimals, mean(theirs, get))
        };
        let mut told = format!(
            "per run, {} requests were sent while another on their prefilling worker still awaited its first token, \
             {} of them while another such worker had none awaiting, and {} of the {} sent while every such worker \
             had as many awaiting went to one whose newest had been sent later (it answers later); the slowest 1% \
             ran beside {} other requests on their decode worker and saw {} more sent there while they decoded",
            both(|p| p.queued as f64, 0),
            both(|p| p.avoidable as f64, 0),
            both(|p| p.behind_later as f64, 0),
            both(|p| p.level as f64, 0),
            both(|p| p.tail_beside, 1),
            both(|p| p.tail_prefills, 1),
        );
        told.push_str(&self.openings(fleet, c, ours, theirs));
        if ours == Router::ContinuumLoad && fleet == Fleet::Aggregated {
            told.push_str(
                " (the load-only cost weighs a worker's queued prefill against its decode blocks, both counted from \
                 a character and word estimate of each prompt, calibrated by the token counts of earlier answers)",
            );
        }
        told
    }

    /// How the runs' opening bursts split and how slow they were, and the pooled TTFT p99
    /// without them: on unique prompts those bursts are a cell's slowest first tokens.
    fn openings(&self, fleet: Fleet, c: usize, ours: Router, theirs: Router) -> String {
        let of = |router| {
            let runs = self.cell(fleet, c, router);
            let uneven = runs.iter().filter(|r| r.placement.opening.uneven).count();
            let slowest: Vec<String> =
                runs.iter().map(|r| format!("{:.0}", r.placement.opening.slowest_ttft_ms)).collect();
            let mut rest: Vec<f64> = runs.iter().flat_map(|r| r.ttft_after_opening.iter().copied()).collect();
            rest.sort_by(f64::total_cmp);
            (uneven, runs.len(), slowest.join(", "), quantile(&rest, 0.99))
        };
        let requests = self.cell(fleet, c, ours).first().map_or(0, |r| r.placement.opening.requests);
        let ((uneven, runs, slowest, p99), (their_uneven, their_runs, their_slowest, their_p99)) =
            (of(ours), of(theirs));
        format!(
            "; the runs' opening bursts ({requests} requests within {OPENING_MS:.0} ms, cold) gave a worker that \
             prefills more than its share in {uneven} of {runs} runs (theirs {their_uneven} of {their_runs}), their \
             slowest first tokens at {slowest} ms (theirs {their_slowest} ms); without them, pooled TTFT p99 is \
             {p99:.1} vs {their_p99:.1} ms"
        )
    }
}

fn memory_facts() -> String {
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find(|l| l.starts_with("MemTotal")).map(|l| l.split_whitespace().nth(1).map(String::from))
        })
        .flatten()
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or("unknown memory".into(), |kb| format!("{:.0} GiB memory", kb / 1048576.0));
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(String::from))
        .unwrap_or_default();
    format!("Machine: {mem}, load average {load} at the end")
}

/// The client, run inside the namespace: drives a workload at its concurrency and prints one
/// JSON [`Answer`].
mod client {
    use super::*;
    use tokio::sync::Semaphore;

    /// One request's outcome.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Outcome {
        pub conversation: usize,
        pub turn: usize,
        /// When the request was sent, from the run's start.
        pub start_ms: f64,
        pub ttft_ms: Option<f64>,
        pub e2e_ms: f64,
        pub prompt_tokens: u64,
        pub cached_tokens: Option<u64>,
        pub completion_tokens: u64,
        pub decode_worker: Option<u64>,
        /// The worker that prefilled it: the decode worker on an aggregated fleet.
        pub prefill_worker: Option<u64>,
        pub error: Option<String>,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Answer {
        pub wall_ms: f64,
        pub results: Vec<Outcome>,
    }

    pub async fn run(file: &Path, bases: &str) -> anyhow::Result<()> {
        let workload: Workload = serde_json::from_slice(&std::fs::read(file)?)?;
        let bases: Arc<Vec<String>> = Arc::new(bases.split(',').map(str::to_string).collect());
        let http = reqwest::Client::builder().no_proxy().timeout(REQUEST_TIMEOUT).build()?;
        let permits = Arc::new(Semaphore::new(workload.spec.concurrency.max(1)));
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for conversation in workload.conversations {
            let (http, permits, bases) = (http.clone(), Arc::clone(&permits), Arc::clone(&bases));
            let max_tokens = workload.spec.max_tokens;
            tasks.spawn(async move {
                tokio::time::sleep_until((started + Duration::from_millis(conversation.start_ms)).into()).await;
                let mut out = Vec::with_capacity(conversation.turns.len());
                for (turn, step) in conversation.turns.iter().enumerate() {
                    tokio::time::sleep(Duration::from_millis(step.think_ms)).await;
                    let Ok(_permit) = permits.acquire().await else { break };
                    // Requests alternate between the replicas, as a load balancer in front would.
                    let base = &bases[(conversation.id + turn) % bases.len()];
                    let start_ms = started.elapsed().as_secs_f64() * 1000.0;
                    let mut outcome = one(&http, base, &step.messages, max_tokens).await;
                    (outcome.conversation, outcome.turn, outcome.start_ms) = (conversation.id, turn, start_ms);
                    out.push(outcome);
                }
                out
            });
        }
        let mut results = Vec::new();
        while let Some(done) = tasks.join_next().await {
            results.extend(done?);
        }
        let answer = Answer { wall_ms: started.elapsed().as_secs_f64() * 1000.0, results };
        println!("{}", serde_json::to_string(&answer)?);
        Ok(())
    }

    async fn one(http: &reqwest::Client, base: &str, messages: &[Message], max_tokens: u32) -> Outcome {
        let began = Instant::now();
        let mut outcome = Outcome {
            conversation: 0,
            turn: 0,
            start_ms: 0.0,
            ttft_ms: None,
            e2e_ms: 0.0,
            prompt_tokens: 0,
            cached_tokens: None,
            completion_tokens: 0,
            decode_worker: None,
            prefill_worker: None,
            error: None,
        };
        if let Err(error) = stream(http, base, messages, max_tokens, began, &mut outcome).await {
            outcome.error = Some(format!("{error:#}"));
        }
        outcome.e2e_ms = began.elapsed().as_secs_f64() * 1000.0;
        outcome
    }

    async fn stream(
        http: &reqwest::Client,
        base: &str,
        messages: &[Message],
        max_tokens: u32,
        began: Instant,
        outcome: &mut Outcome,
    ) -> anyhow::Result<()> {
        let body = json!({
            "model": "tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "nvext": {"extra_fields": ["worker_id", "timing"]},
        });
        let mut response = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await?;
        let status = response.status();
        if !status.is_success() {
            bail!("{status}: {}", response.text().await.unwrap_or_default());
        }
        let mut pending: Vec<u8> = Vec::new();
        let mut done = false;
        while let Some(chunk) = response.chunk().await? {
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let Some(data) = std::str::from_utf8(&line).ok().and_then(|l| l.trim().strip_prefix("data:")) else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let event: Value = serde_json::from_str(data).with_context(|| format!("an SSE event: {data}"))?;
                read_event(&event, began, outcome);
            }
        }
        ensure!(done, "the stream ended without data: [DONE]");
        ensure!(outcome.ttft_ms.is_some(), "no content chunk");
        Ok(())
    }

    fn read_event(event: &Value, began: Instant, outcome: &mut Outcome) {
        let has_content = event["choices"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["delta"]["content"].as_str().is_some_and(|s| !s.is_empty())));
        if has_content && outcome.ttft_ms.is_none() {
            outcome.ttft_ms = Some(began.elapsed().as_secs_f64() * 1000.0);
        }
        let pins = &event["nvext"]["worker_id"];
        if let Some(worker) = pins["decode_worker_id"].as_u64() {
            outcome.decode_worker = Some(worker);
        }
        if let Some(worker) = pins["prefill_worker_id"].as_u64() {
            outcome.prefill_worker = Some(worker);
        }
        let usage = &event["usage"];
        if usage.is_object() {
            outcome.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            outcome.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
            outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().or(outcome.cached_tokens);
        }
    }
}
