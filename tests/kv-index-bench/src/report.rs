//! The markdown section for `docs/benchmarks.md`.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use continuum_kv_index::IndexStats;

use crate::Figures;
use crate::workload::{RANKS, Workload};

const BEGIN: &str = "<!-- bench-kv-index:begin -->";
const END: &str = "<!-- bench-kv-index:end -->";
const HEADING: &str = "## KV index vs dynamo-kv-router";

/// Which of dynamo's indexers a row set compares against.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    RadixTree,
    KvIndexer,
}

impl Kind {
    fn title(self) -> &'static str {
        match self {
            Kind::RadixTree => "vs `RadixTree` (bare tree)",
            Kind::KvIndexer => "vs `KvIndexer` (what Dynamo's router runs)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Kind::RadixTree => "`RadixTree`",
            Kind::KvIndexer => "`KvIndexer`",
        }
    }
}

/// One of dynamo's indexers, measured, and how many requests it scored unlike ours.
pub struct Theirs<'a> {
    pub figures: &'a Figures,
    pub mismatches: usize,
    pub kind: Kind,
}

pub fn render(w: &Workload, ours: &Figures, theirs: &[Theirs<'_>], stats: &IndexStats, matched: usize) -> String {
    let events = w.events.len() as f64;
    let blocks = (w.stored_blocks + w.removed_blocks) as f64;
    let rate = |f: &Figures, n: f64| n / f.apply_time().as_secs_f64();
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let rounds =
        |f: &Figures| f.apply.iter().map(|d| format!("{:.0} ms", d.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(", ");

    let mut s = String::new();
    let _ = writeln!(
        s,
        "Measured {} with `cargo run --release -- --write` in `tests/kv-index-bench` on {} cores ({}).\n",
        today(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model()
    );
    let _ = writeln!(
        s,
        "One seeded workload: {RANKS} ranks, {} events storing {} blocks and removing {}, then {} requests scored by every index in the same process.\n",
        w.events.len(),
        w.stored_blocks,
        w.removed_blocks,
        w.queries.len()
    );
    s.push_str("| measure | dynamo-kv-router 1.6.1 | continuum-kv-index (bare, seed limits) | ours / theirs |\n");
    s.push_str("|---|---:|---:|---:|\n");
    for t in theirs {
        let f = t.figures;
        let (our_eps, their_eps) = (rate(ours, events), rate(f, events));
        let _ = writeln!(s, "| **{}** | | | |", t.kind.title());
        let _ = writeln!(
            s,
            "| events applied per second (median of 5 rounds) | {their_eps:.0} | {our_eps:.0} | **{:.2}×** |",
            our_eps / their_eps
        );
        let _ = writeln!(
            s,
            "| blocks applied per second | {:.0} | {:.0} | {:.2}× |",
            rate(f, blocks),
            rate(ours, blocks),
            our_eps / their_eps
        );
        let _ = writeln!(
            s,
            "| find_matches p50 | {:.1} µs | {:.1} µs | {:.2}× |",
            us(f.p50),
            us(ours.p50),
            us(ours.p50) / us(f.p50)
        );
        let _ = writeln!(
            s,
            "| find_matches p99 | {:.1} µs | {:.1} µs | {:.2}× |",
            us(f.p99),
            us(ours.p99),
            us(ours.p99) / us(f.p99)
        );
        let _ = writeln!(
            s,
            "| heap of the built index (counting allocator) | {:.1} MiB | {:.1} MiB | **{:.2}×** |",
            mib(f.heap_bytes),
            mib(ours.heap_bytes),
            ours.heap_bytes as f64 / f.heap_bytes as f64
        );
        let _ = writeln!(s, "| blocks refused | {} | {} | |", f.refused, ours.refused);
    }
    s.push('\n');
    let _ = writeln!(
        s,
        "- Our side is the bare `KvIndex` in both row sets: the same figures, measured on the calling thread with no channel in front. Same events, same requests, same process."
    );
    let _ = writeln!(
        s,
        "- `RadixTree` is the strict comparison: both bare data structures, applied and queried directly on one thread."
    );
    let _ = writeln!(
        s,
        "- `KvIndexer` is what a Dynamo KV router runs: its time runs from the first `event_sender().send` until `flush_and_wait()` returns (which drains every mutation sent before it), with its actor applying on its own thread while this thread sends; `find_matches` goes through its async API (send, actor's turn, reply); its heap includes the actor's runtime and channels, counted by the same allocator across threads. Its refusal count comes from an extra, untimed pass with `apply_event_and_wait`."
    );
    let _ = writeln!(
        s,
        "- Rounds: ours {}; {}. Load average when done: {}.",
        rounds(ours),
        theirs.iter().map(|t| format!("{} {}", t.kind.short(), rounds(t.figures))).collect::<Vec<_>>().join("; "),
        load_average()
    );
    for t in theirs {
        let _ = writeln!(
            s,
            "- {} gave the same overlap scores as ours for {} of {} requests ({} mismatches).",
            t.kind.short(),
            w.queries.len() - t.mismatches,
            w.queries.len(),
            t.mismatches
        );
    }
    let _ = writeln!(s, "- {matched} requests matched some rank.");
    let _ = writeln!(
        s,
        "- Ours held {} nodes and {} ownerships; its own `stats().heap_bytes` said {:.1} MiB.",
        stats.nodes,
        stats.ownerships,
        mib(stats.heap_bytes as i64)
    );
    for t in theirs {
        let f = t.figures;
        let ratio = rate(ours, events) / rate(f, events);
        let met = ratio >= 1.5 && ours.heap_bytes <= f.heap_bytes;
        let _ = writeln!(
            s,
            "- Target ≥ 1.5× their events/s at no more memory, {}: **{}** ({ratio:.2}×, heap {:.2}×).",
            t.kind.title(),
            if met { "met" } else { "NOT met" },
            ours.heap_bytes as f64 / f.heap_bytes as f64
        );
    }
    s
}

pub fn write(table: &str) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/benchmarks.md");
    let Ok(doc) = std::fs::read_to_string(path) else {
        eprintln!("cannot read {path}");
        return;
    };
    let section = format!("{BEGIN}\n{table}{END}");
    let updated = match (doc.find(BEGIN), doc.find(END)) {
        (Some(b), Some(e)) if b < e => format!("{}{section}{}", &doc[..b], &doc[e + END.len()..]),
        _ => format!("{}\n\n{HEADING}\n\n{section}\n", doc.trim_end()),
    };
    match std::fs::write(path, updated) {
        Ok(()) => eprintln!("wrote {path}"),
        Err(e) => eprintln!("cannot write {path}: {e}"),
    }
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, m)| m.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".to_string())
}

fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split_whitespace().next().unwrap_or("?").to_string()
}

/// Today's UTC date, from days since the epoch (Howard Hinnant's civil-from-days).
fn today() -> String {
    let days = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
