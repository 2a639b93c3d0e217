//! The table, the targets' verdicts and what the measurements say about each loss.

use super::stats::{FIGURES, Figure, figure_of};
use super::*;

pub(crate) struct Report {
    pub(crate) fleets: Vec<Fleet>,
    pub(crate) routers: Vec<Router>,
    pub(crate) cases: Vec<Case>,
    pub(crate) runs: usize,
    pub(crate) requests: usize,
    pub(crate) results: BTreeMap<(Fleet, usize, Router), Vec<RunStats>>,
    pub(crate) provisional: bool,
}

impl Report {
    pub(crate) fn render(&self, took: Duration) -> String {
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
             both at `prefill_load_scale: {PREFILL_LOAD_SCALE}` (the default is 1, the seed's for the KV-aware formula, whose load-only cost has no such term; Dynamo kv is shown at \
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

#[cfg(test)]
mod tests {
    use continuum_tests::placement::Opening;

    use super::*;

    /// A unique-prompt run: 120 first tokens of 100 ms and 120 ms, then its opening burst's 8.
    fn run(burst_ttft_ms: f64, uneven: bool) -> RunStats {
        let after: Vec<f64> = (0..120).map(|i| if i % 2 == 0 { 100.0 } else { 120.0 }).collect();
        let mut ttft = after.clone();
        ttft.extend([burst_ttft_ms; 8]);
        ttft.sort_by(f64::total_cmp);
        let placement = Placement {
            opening: Opening { requests: 8, uneven, slowest_ttft_ms: burst_ttft_ms },
            ..Placement::default()
        };
        RunStats { e2e: vec![500.0; ttft.len()], ttft, ttft_after_opening: after, placement, ..RunStats::default() }
    }

    #[test]
    fn a_unique_cell_lost_in_its_opening_bursts_says_how_they_split() {
        let cases = cases(128, false, UNIQUE_THINK_MS);
        let c = cases.iter().position(|case| !case.shared()).expect("a unique-prompt case");
        let fleet = Fleet::Disaggregated;
        let results = BTreeMap::from([
            ((fleet, c, Router::RoundRobin), vec![run(190.0, false), run(190.0, false)]),
            ((fleet, c, Router::ContinuumKv), vec![run(230.0, true), run(190.0, false)]),
        ]);
        let report = Report {
            fleets: vec![fleet],
            routers: vec![Router::RoundRobin, Router::ContinuumKv],
            cases: cases.clone(),
            runs: 2,
            requests: 128,
            results,
            provisional: true,
        };
        let verdict = report.unique_verdict(fleet, c, &cases[c], Router::ContinuumKv);
        assert!(verdict.contains("**loses** on pooled TTFT p99 ms 230.0 vs 190.0"), "{verdict}");
        assert!(
            verdict.contains(
                "the runs' opening bursts (8 requests within 20 ms, cold) gave a worker that prefills more than its \
                 share in 1 of 2 runs (theirs 0 of 2), their slowest first tokens at 230, 190 ms (theirs 190, 190 \
                 ms); without them, pooled TTFT p99 is 120.0 vs 120.0 ms"
            ),
            "{verdict}"
        );
    }
}
