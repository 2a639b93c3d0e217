//! Benchmark: `continuum-kv-index` against `dynamo-kv-router` 1.6.1 on one deterministic
//! workload (see `workload.rs`), in one process, twice over: against its bare `RadixTree` (the data
//! structures alone) and against its `KvIndexer` (the channel-fed actor its router runs). Our side
//! is the bare index both times.
//!
//! Run: `cargo run --release` in this directory; `--write`
//! also replaces the `bench-kv-index` section of `docs/benchmarks.md`.

mod dynamo;
mod dynamo_indexer;
mod ours;
mod report;
mod workload;

use std::time::{Duration, Instant};

use continuum_kv_index::KvIndex;
use dynamo_kv_router::RadixTree;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

const SEED: u64 = 0x5EED_CAFE;
const ROUNDS: usize = 5;

/// What one index measured.
#[derive(Debug, Default)]
pub struct Figures {
    pub apply: Vec<Duration>,
    pub heap_bytes: i64,
    pub reported_heap: Option<usize>,
    pub nodes: Option<usize>,
    pub p50: Duration,
    pub p99: Duration,
    pub refused: usize,
}

impl Figures {
    /// The median round.
    pub fn apply_time(&self) -> Duration {
        let mut times = self.apply.clone();
        times.sort();
        times[times.len() / 2]
    }
}

fn main() {
    let write = std::env::args().any(|a| a == "--write");
    let started = Instant::now();
    let w = workload::generate(SEED);
    eprintln!(
        "workload: {} events, {} blocks stored, {} removed, {} queries ({:.1}s)",
        w.events.len(),
        w.stored_blocks,
        w.removed_blocks,
        w.queries.len(),
        started.elapsed().as_secs_f64()
    );

    let mut ours_fig = Figures::default();
    let mut dyn_fig = Figures::default();
    let mut actor_fig = Figures::default();
    // Drives the sending side of `KvIndexer`; its actor runs on its own thread and runtime.
    let rt = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(e) => panic!("cannot build a tokio runtime: {e}"),
    };
    let mut our_index = KvIndex::default();
    let mut dyn_tree = RadixTree::new();
    // Rounds alternate which index goes first; each round builds a fresh index.
    for round in 0..ROUNDS {
        for which in [round % 2, 1 - round % 2] {
            if which == 0 {
                let events = ours::events(&w.events);
                let mut index = KvIndex::default();
                let start = Instant::now();
                let outcome = ours::apply(&mut index, events);
                ours_fig.apply.push(start.elapsed());
                ours_fig.refused = ours::refused(&outcome) as usize;
                our_index = index;
            } else {
                let events = dynamo::events(&w.events);
                let mut tree = RadixTree::new();
                let start = Instant::now();
                dyn_fig.refused = dynamo::apply(&mut tree, events);
                dyn_fig.apply.push(start.elapsed());
                dyn_tree = tree;
            }
        }
        // Dynamo's KvIndexer last in every round, so the RadixTree pair above runs as it always did.
        let events = dynamo::events(&w.events);
        let threads = dynamo_indexer::threads();
        let indexer = dynamo_indexer::new();
        let start = Instant::now();
        rt.block_on(dynamo_indexer::apply(&indexer, events));
        actor_fig.apply.push(start.elapsed());
        dynamo_indexer::shut_down(indexer, threads);
        eprintln!(
            "round {round}: ours {:?}, dynamo RadixTree {:?}, dynamo KvIndexer {:?}",
            ours_fig.apply[round], dyn_fig.apply[round], actor_fig.apply[round]
        );
    }
    let threads = dynamo_indexer::threads();
    let indexer = dynamo_indexer::new();
    actor_fig.refused = rt.block_on(dynamo_indexer::apply_counting_refusals(&indexer, dynamo::events(&w.events)));
    dynamo_indexer::shut_down(indexer, threads);

    // Memory: build each index once more, feeding a clone of each event that the apply consumes,
    // so the net heap change is the index alone.
    drop(std::mem::take(&mut our_index));
    drop(std::mem::replace(&mut dyn_tree, RadixTree::new()));
    let our_events = ours::events(&w.events);
    let region = Region::new(GLOBAL);
    let mut index = KvIndex::default();
    for event in &our_events {
        ours::apply(&mut index, [clone_ours(event)]);
    }
    ours_fig.heap_bytes = net(region.change());
    drop(our_events);
    let stats = index.stats();
    ours_fig.reported_heap = Some(stats.heap_bytes);
    ours_fig.nodes = Some(stats.nodes);

    let dyn_events = dynamo::events(&w.events);
    let region = Region::new(GLOBAL);
    let mut tree = RadixTree::new();
    for event in &dyn_events {
        dynamo::apply(&mut tree, [event.clone()]);
    }
    dyn_fig.heap_bytes = net(region.change());
    drop(dyn_events);

    // KvIndexer: the tree plus what the actor keeps (its runtime, channels), counted across threads.
    let dyn_events = dynamo::events(&w.events);
    let region = Region::new(GLOBAL);
    let indexer = dynamo_indexer::new();
    rt.block_on(dynamo_indexer::apply(&indexer, dyn_events.clone()));
    actor_fig.heap_bytes = net(region.change());
    drop(dyn_events);

    // Scores: both must agree on every query.
    let mut mismatches = 0;
    for q in &w.queries {
        if ours::scores(&index, q) != dynamo::scores(&tree, dynamo::query(q)) {
            mismatches += 1;
        }
    }
    let mut actor_mismatches = 0;
    for q in &w.queries {
        if ours::scores(&index, q) != rt.block_on(dynamo_indexer::scores(&indexer, dynamo::query(q))) {
            actor_mismatches += 1;
        }
    }
    let matched = w.queries.iter().filter(|q| !index.find_matches(q).is_empty()).count();

    let (p50, p99) = latency(&w.queries, |q| {
        let start = Instant::now();
        std::hint::black_box(index.find_matches(q));
        start.elapsed()
    });
    (ours_fig.p50, ours_fig.p99) = (p50, p99);
    let (p50, p99) = latency(&w.queries, |q| {
        let query = dynamo::query(q);
        let start = Instant::now();
        std::hint::black_box(tree.find_matches(query, false));
        start.elapsed()
    });
    (dyn_fig.p50, dyn_fig.p99) = (p50, p99);
    // Through its async API: the send, the actor's turn, and the reply, as the router waits for it.
    let (p50, p99) = latency(&w.queries, |q| {
        let query = dynamo::query(q);
        rt.block_on(async {
            let start = Instant::now();
            std::hint::black_box(dynamo_indexer::find_matches(&indexer, query).await);
            start.elapsed()
        })
    });
    (actor_fig.p50, actor_fig.p99) = (p50, p99);

    let table = report::render(
        &w,
        &ours_fig,
        &[
            report::Theirs { figures: &dyn_fig, mismatches, kind: report::Kind::RadixTree },
            report::Theirs { figures: &actor_fig, mismatches: actor_mismatches, kind: report::Kind::KvIndexer },
        ],
        &stats,
        matched,
    );
    println!("{table}");
    if mismatches + actor_mismatches > 0 {
        eprintln!(
            "{mismatches} (RadixTree) and {actor_mismatches} (KvIndexer) of {} queries scored differently",
            w.queries.len()
        );
        std::process::exit(1);
    }
    if write {
        report::write(&table);
    }
}

fn clone_ours(event: &ours::OurEvent) -> ours::OurEvent {
    match event {
        ours::OurEvent::Stored { rank, parent, blocks } => {
            ours::OurEvent::Stored { rank: *rank, parent: *parent, blocks: blocks.clone() }
        }
        ours::OurEvent::Removed { rank, hashes } => ours::OurEvent::Removed { rank: *rank, hashes: hashes.clone() },
    }
}

/// p50 and p99 of `measure` over the queries (after one warm-up pass).
fn latency(queries: &[Vec<u64>], mut measure: impl FnMut(&[u64]) -> Duration) -> (Duration, Duration) {
    for q in queries {
        measure(q);
    }
    let mut times: Vec<Duration> = queries.iter().map(|q| measure(q)).collect();
    times.sort();
    (times[times.len() / 2], times[times.len() * 99 / 100])
}

/// Live bytes: stats_alloc already books a realloc's growth under `bytes_allocated` and its
/// shrinking under `bytes_deallocated` (`bytes_reallocated` is the same change again).
fn net(stats: stats_alloc::Stats) -> i64 {
    let allocated = i64::try_from(stats.bytes_allocated).unwrap_or(i64::MAX);
    let freed = i64::try_from(stats.bytes_deallocated).unwrap_or(i64::MAX);
    allocated - freed
}
