//! FindMatches benchmark: the round trip a replica pays before a KV-aware pick — a data-plane
//! `MatchesClient` asking a real in-process Fleet gRPC server over loopback — beside the
//! in-process `find_matches` on the same index, so the reader sees the gRPC and network share,
//! against the 2 ms default deadline.
//!
//! The index is filled the way kv-events fill it (through `KvIndexer::apply_events`, identity
//! gate included): 1,024 ranks (256 workers × dp 4), each holding a few conversations that
//! share a system prompt with many ranks and a document with a handful, then a tail of its
//! own. Queries are 64–256 block hashes along one of those conversations, so every one hits.
//!
//! `cargo run --release -p continuum-tests --bin bench-find-matches -- [--calls 20000] [--write]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_control_plane::discovery::PublisherKey;
use continuum_control_plane::grpc::{self, FleetService, Replicas};
use continuum_control_plane::kv::decode::{KvEvent, KvEventData, ResidencyDomain, StorageTier, Stored};
use continuum_control_plane::kv::feed::SharedKvIndexer;
use continuum_control_plane::kv::{KvHandle, KvIndexer, LiveRanks, LiveWorker, ProvisionalResult, PublisherMapping};
use continuum_control_plane::listen::Guard;
use continuum_control_plane::metrics::Metrics;
use continuum_data_plane::fleet::{FIND_MATCHES_DEADLINE, FleetClientConfig, MatchesClient};
use continuum_kv_index::{IndexStats, Limits, RankKey, StoredBlock};
use continuum_tests::bench::{Quantiles, arg, write_section};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

const WORKERS: u64 = 256;
const DP_SIZE: u32 = 4;
/// System prompts, each shared by about 1/64th of the conversations.
const FAMILIES: usize = 64;
const FAMILY_BLOCKS: usize = 64;
/// Documents extending a system prompt, each held by a handful of ranks.
const DOCUMENTS: usize = 512;
const DOCUMENT_BLOCKS: usize = 128;
/// Conversations per rank, and the blocks each has past its document.
const CONVERSATIONS: usize = 3;
const TAIL_BLOCKS: usize = 48;
const CONCURRENCY: [usize; 2] = [1, 8];
/// Long enough that no call is cut short: the point is the distribution, set against
/// [`FIND_MATCHES_DEADLINE`] afterwards.
const MEASURE_DEADLINE: Duration = Duration::from_secs(1);

/// One conversation's chain of tokens hashes (system prompt, document, tail).
type Chain = Vec<u64>;

#[derive(Debug)]
struct Row {
    what: String,
    calls: usize,
    latency: Quantiles,
    /// Calls per second over the whole run.
    throughput: f64,
    over_deadline: usize,
    /// Mean ranks in an answer.
    ranks: f64,
}

fn main() -> anyhow::Result<()> {
    let calls = arg("--calls", 20_000)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let started = Instant::now();
    let (handle, chains) = populate();
    let stats = handle.stats();
    eprintln!("populated in {:?}: {stats:?}", started.elapsed());
    let queries = queries(&chains, calls);
    let mut rows = vec![in_process(&handle, &queries)?];
    eprintln!("{:?}", rows.last());
    rows.push(with_provisional_chains(&handle, &chains, &queries)?);
    eprintln!("{:?}", rows.last());
    rows.extend(runtime.block_on(over_grpc(handle, &queries))?);
    let table = table(&stats, &rows, queries.iter().map(Vec::len).sum::<usize>() as f64 / queries.len() as f64);
    print!("{table}");
    if std::env::args().any(|a| a == "--write") {
        let command =
            format!("cargo run --release -p continuum-tests --bin bench-find-matches -- --calls {calls} --write");
        write_section("bench-find-matches", "KV FindMatches round trip", &command, &table)?;
    }
    Ok(())
}

/// Fills an index through the kv-events path and returns every rank's conversations.
fn populate() -> (KvHandle, Vec<Chain>) {
    let mut rng = StdRng::seed_from_u64(1337);
    let mut blocks = |n: usize| -> Vec<u64> { (0..n).map(|_| rng.random()).collect() };
    let families: Vec<Vec<u64>> = (0..FAMILIES).map(|_| blocks(FAMILY_BLOCKS)).collect();
    let documents: Vec<(usize, Vec<u64>)> = (0..DOCUMENTS).map(|d| (d % FAMILIES, blocks(DOCUMENT_BLOCKS))).collect();
    let mut indexer = KvIndexer::new(Limits::default());
    let live: LiveRanks = (1..=WORKERS)
        .map(|w| (w, LiveWorker { namespace: "bench".into(), ranks: 0..DP_SIZE, publishing: DP_SIZE as usize }))
        .collect();
    indexer.set_live(live);
    let mut rng = StdRng::seed_from_u64(7);
    let mut chains = Vec::new();
    for worker_id in 1..=WORKERS {
        for dp_rank in 0..DP_SIZE {
            // One publisher per rank, as vLLM runs one per dp rank.
            let mapping = PublisherMapping {
                publisher: PublisherKey {
                    namespace: "bench".into(),
                    publisher_id: worker_id << 8 | u64::from(dp_rank),
                },
                worker_id,
                dp_rank: Some(dp_rank),
            };
            let mut events = Vec::new();
            for _ in 0..CONVERSATIONS {
                let (family, document) = &documents[rng.random_range(0..DOCUMENTS)];
                let tail: Vec<u64> = (0..TAIL_BLOCKS).map(|_| rng.random()).collect();
                let chain: Chain = families[*family].iter().chain(document).chain(&tail).copied().collect::<Vec<_>>();
                events.push(stored(worker_id, dp_rank, events.len() as u64 + 1, &chain));
                chains.push(chain);
            }
            indexer.apply_events(&mapping, &events);
        }
    }
    (KvHandle::new(SharedKvIndexer::new(indexer), true), chains)
}

/// One root-anchored chain, as an engine stores a whole prompt: engine hashes are per rank.
fn stored(worker_id: u64, dp_rank: u32, event_id: u64, chain: &[u64]) -> KvEvent {
    let salt = worker_id.rotate_left(32) ^ u64::from(dp_rank);
    let blocks = chain.iter().map(|&tokens_hash| StoredBlock { block_hash: tokens_hash ^ salt, tokens_hash }).collect();
    KvEvent {
        worker_id,
        dp_rank,
        event_id,
        storage_tier: StorageTier::Device,
        residency_domain: ResidencyDomain::Worker,
        data: KvEventData::Stored(Stored { parent_hash: None, start_position: None, blocks }),
    }
}

/// `n` requests: 64–256 hashes from the start of a random conversation.
fn queries(chains: &[Chain], n: usize) -> Vec<Vec<u64>> {
    let mut rng = StdRng::seed_from_u64(99);
    (0..n)
        .map(|_| {
            let chain = &chains[rng.random_range(0..chains.len())];
            chain[..rng.random_range(64..=256).min(chain.len())].to_vec()
        })
        .collect()
}

fn in_process(handle: &KvHandle, queries: &[Vec<u64>]) -> anyhow::Result<Row> {
    let mut samples = Vec::with_capacity(queries.len());
    let mut ranks = 0;
    let started = Instant::now();
    for query in queries {
        let t0 = Instant::now();
        let matches = handle.find_matches(query).ok_or_else(|| anyhow::anyhow!("the handle is enabled"))?;
        samples.push(t0.elapsed());
        ranks += matches.as_slice().len();
    }
    let elapsed = started.elapsed();
    Ok(row("in-process `find_matches` (one thread)", samples, elapsed, ranks))
}

/// What `FindMatches` answers in process (the index and the provisional chains merged) with
/// every conversation credited to its rank, as a burst of dispatches would leave them: each
/// query shares its system prompt with a 64th of the chains, and its document with a few.
/// The chains go again afterwards, so the gRPC rows measure the index alone.
fn with_provisional_chains(handle: &KvHandle, chains: &[Chain], queries: &[Vec<u64>]) -> anyhow::Result<Row> {
    handle.set_provisional_ttl(Duration::from_secs(600));
    // `populate` listed them worker by worker, rank by rank.
    let per_worker = CONVERSATIONS * DP_SIZE as usize;
    let mut credited = 0;
    for (i, chain) in chains.iter().enumerate() {
        let dp_rank = u32::try_from(i / CONVERSATIONS % DP_SIZE as usize)?;
        let rank = RankKey { worker_id: 1 + (i / per_worker) as u64, dp_rank };
        credited += usize::from(handle.credit_provisional(rank, chain) == ProvisionalResult::Credited);
    }
    // A query covering a whole chain would confirm it, and the index would lose it: each stops
    // a block short, so every chain stays held for every call.
    let whole = FAMILY_BLOCKS + DOCUMENT_BLOCKS + TAIL_BLOCKS;
    let mut samples = Vec::with_capacity(queries.len());
    let mut ranks = 0;
    let started = Instant::now();
    for query in queries {
        let query = &query[..query.len().min(whole - 1)];
        let t0 = Instant::now();
        let overlaps = handle.overlaps(query).ok_or_else(|| anyhow::anyhow!("the handle is enabled"))?;
        samples.push(t0.elapsed());
        ranks += overlaps.len();
    }
    let elapsed = started.elapsed();
    handle.set_provisional_ttl(Duration::ZERO);
    Ok(row(&format!("in-process, with {credited} provisional chains merged (one thread)"), samples, elapsed, ranks))
}

/// The ranks each lookup names as its contenders, as a replica of a two-worker fleet does: the
/// control plane weighs them against its recent lookups on every call.
const CONTENDERS: [(u64, u32); 2] = [(1, 0), (2, 0)];

/// The same queries through `MatchesClient` → loopback gRPC → `FleetService::find_matches`,
/// at each concurrency in [`CONCURRENCY`] on one client (one HTTP/2 connection, as a replica
/// has).
async fn over_grpc(handle: KvHandle, queries: &[Vec<u64>]) -> anyhow::Result<Vec<Row>> {
    let cancel = CancellationToken::new();
    let metrics = Metrics::new()?;
    let guard = Guard::fleet(&metrics);
    let service =
        FleetService::new(continuum_tests::publisher(), Replicas::default(), metrics, cancel.clone()).with_kv(handle);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(grpc::serve((listener, guard), service, None, cancel.clone()));
    let client = MatchesClient::new(&FleetClientConfig::new(url.as_str(), "bench"), MEASURE_DEADLINE)?;
    // Connect and warm up.
    for query in queries.iter().take(500) {
        client.find_matches(0, query.clone(), "bench", &CONTENDERS, 1_024).await?;
    }
    let queries: Arc<[Vec<u64>]> = queries.into();
    let mut rows = Vec::new();
    for concurrency in CONCURRENCY {
        let started = Instant::now();
        let tasks: Vec<_> = (0..concurrency)
            .map(|lane| {
                let (client, queries) = (client.clone(), Arc::clone(&queries));
                tokio::spawn(async move {
                    let mut samples = Vec::new();
                    let mut ranks = 0;
                    for query in queries.iter().skip(lane).step_by(concurrency) {
                        let t0 = Instant::now();
                        let overlaps =
                            client.find_matches(0, query.clone(), "bench", &CONTENDERS, 1_024).await?.overlaps;
                        samples.push(t0.elapsed());
                        ranks += overlaps.len();
                    }
                    anyhow::Ok((samples, ranks))
                })
            })
            .collect();
        let (mut samples, mut ranks) = (Vec::with_capacity(queries.len()), 0);
        for task in tasks {
            let (s, r) = task.await??;
            samples.extend(s);
            ranks += r;
        }
        let elapsed = started.elapsed();
        rows.push(row(&format!("gRPC round trip, concurrency {concurrency}"), samples, elapsed, ranks));
        eprintln!("{:?}", rows.last());
    }
    cancel.cancel();
    server.await??;
    Ok(rows)
}

fn row(what: &str, samples: Vec<Duration>, elapsed: Duration, ranks: usize) -> Row {
    let calls = samples.len();
    let over_deadline = samples.iter().filter(|s| **s > FIND_MATCHES_DEADLINE).count();
    Row {
        what: what.to_string(),
        calls,
        latency: Quantiles::of(samples),
        throughput: calls as f64 / elapsed.as_secs_f64().max(1e-9),
        over_deadline,
        ranks: ranks as f64 / calls.max(1) as f64,
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn table(stats: &IndexStats, rows: &[Row], mean_hashes: f64) -> String {
    let mut out = format!(
        "Index: {} ranks ({WORKERS} workers × dp {DP_SIZE}), {} nodes, {} ownerships, {:.1} MiB heap; \
         {CONVERSATIONS} conversations per rank ({FAMILIES} shared system prompts of {FAMILY_BLOCKS} blocks, \
         {DOCUMENTS} documents of {DOCUMENT_BLOCKS}, a private tail of {TAIL_BLOCKS}). Queries: 64–256 hashes \
         (mean {mean_hashes:.0}) along a held conversation, so every one hits.\n\n",
        stats.ranks,
        stats.nodes,
        stats.ownerships,
        stats.heap_bytes as f64 / (1024.0 * 1024.0),
    );
    // A shared 2-core machine: the tail quantiles move with whatever else runs.
    let load = std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| l.split(' ').next().map(str::to_string));
    out.push_str(&format!("1-minute load average at the start: {}.\n\n", load.as_deref().unwrap_or("unknown")));
    out.push_str("| path | calls | p50 | p99 | max | calls/s | > 2 ms deadline | ranks per answer |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} | {} ({:.3}%) | {:.1} |\n",
            r.what,
            r.calls,
            us(r.latency.p50),
            us(r.latency.p99),
            us(r.latency.max),
            r.throughput,
            r.over_deadline,
            100.0 * r.over_deadline as f64 / r.calls.max(1) as f64,
            r.ranks,
        ));
    }
    let remote = rows.iter().find(|r| r.what.starts_with("gRPC"));
    if let (Some(local), Some(remote)) = (rows.first(), remote) {
        let share = 1.0 - local.latency.p50.as_secs_f64() / remote.latency.p50.as_secs_f64().max(1e-12);
        out.push_str(&format!(
            "\nAt concurrency 1 the index lookup is {} of the {} p50 round trip; the rest ({:.0}%) is protobuf, \
             HTTP/2 and loopback TCP. Client and server share one process and its 2-thread runtime, so the \
             concurrency-8 row also measures them competing for 2 cores. A call past the deadline \
             ({} ms by default, `--find-matches-deadline`) is abandoned and the request is scored on a recent answer for \
             its prefix, or on the formula without overlap credit. The second row is what a lookup's answer \
             costs with every conversation credited provisionally to its rank (the index and the chains merged, as \
             `FindMatches` answers for `provisional_ttl` after a burst of dispatches); each query shares its system \
             prompt with a 64th of the chains.\n",
            us(local.latency.p50),
            us(remote.latency.p50),
            100.0 * share,
            FIND_MATCHES_DEADLINE.as_millis(),
        ));
    }
    out
}
