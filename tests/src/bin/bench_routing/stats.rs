//! One run's figures, and a figure over a cell's runs.

use super::*;

/// The figures of one run.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunStats {
    pub(crate) requests_per_s: f64,
    pub(crate) output_tokens_per_s: f64,
    pub(crate) ttft_mean: f64,
    pub(crate) ttft_p50: f64,
    pub(crate) ttft_p90: f64,
    pub(crate) ttft_p99: f64,
    pub(crate) e2e_p50: f64,
    pub(crate) e2e_p99: f64,
    /// Cached prompt tokens over prompt tokens; `None` if no response reported cached tokens.
    pub(crate) hit_rate: Option<f64>,
    pub(crate) failed: usize,
    /// `continuum_dynamo_kv_selection_total` increments during the run, by result.
    pub(crate) kv: BTreeMap<String, f64>,
    /// Requests per serving worker (decode, or aggregated).
    pub(crate) spread: BTreeMap<u64, usize>,
    /// Every answered request's TTFT and end-to-end time, sorted: a cell's percentiles pooled
    /// over its runs.
    pub(crate) ttft: Vec<f64>,
    pub(crate) e2e: Vec<f64>,
    /// Later turns served by another worker than the conversation's previous turn…
    pub(crate) moved: usize,
    /// …and later turns on the same worker that still missed the cache (evicted under KV
    /// pressure): half or more of the prompt uncached.
    pub(crate) evicted: usize,
    /// Where requests waited behind another's prefill, and what the slowest decoded beside.
    pub(crate) placement: Placement,
    /// The first tokens outside the run's opening burst, sorted.
    pub(crate) ttft_after_opening: Vec<f64>,
}

impl RunStats {
    pub(crate) fn of(answer: &client::Answer, kv: BTreeMap<String, f64>) -> Self {
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

    pub(crate) fn brief(&self) -> String {
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
pub(crate) struct Figure {
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
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

    pub(crate) fn show(fig: Option<Self>, decimals: usize) -> String {
        let Some(f) = fig else { return "n/a".into() };
        if f.min == f.max {
            return format!("{:.*}", decimals, f.median);
        }
        format!("{:.*} ({:.*}–{:.*})", decimals, f.median, decimals, f.min, decimals, f.max)
    }
}

/// The figures of the table, with whether higher is better.
pub(crate) const FIGURES: [(&str, bool, usize); 9] = [
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

pub(crate) fn figure_of(runs: &[RunStats], index: usize) -> Option<Figure> {
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
