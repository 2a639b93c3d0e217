//! Shared pieces of the benchmark binaries: arguments, quantiles, and writing a result section
//! into docs/benchmarks.md between the benchmark's own markers.

use std::time::Duration;

/// Latency quantiles of a run.
#[derive(Debug, Clone, Copy)]
pub struct Quantiles {
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Quantiles {
    pub fn of(mut samples: Vec<Duration>) -> Self {
        samples.sort();
        let at = |q: f64| {
            let index = ((samples.len().saturating_sub(1)) as f64 * q).round() as usize;
            samples.get(index).copied().unwrap_or_default()
        };
        Self { p50: at(0.5), p90: at(0.9), p99: at(0.99), max: at(1.0) }
    }
}

/// `--name N` from the command line, or `default`.
pub fn arg(name: &str, default: usize) -> anyhow::Result<usize> {
    Ok(text_arg(name).map(|n| n.parse()).transpose()?.unwrap_or(default))
}

/// The value after `--name` on the command line, if given.
pub fn text_arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

/// Replaces the text between `<!-- {id}:begin -->` and `<!-- {id}:end -->` in
/// docs/benchmarks.md (appending a `## {title}` section the first time).
pub fn write_section(id: &str, title: &str, command: &str, table: &str) -> anyhow::Result<()> {
    let path = crate::tools::workspace_root().join("docs/benchmarks.md");
    let (begin, end) = (format!("<!-- {id}:begin -->"), format!("<!-- {id}:end -->"));
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    let section = format!("{begin}\nMeasured {} with `{command}` on {}.\n\n{table}{end}", date(), machine_facts());
    let updated = match (doc.find(&begin), doc.find(&end)) {
        (Some(b), Some(e)) if b < e => format!("{}{section}{}", &doc[..b], &doc[e + end.len()..]),
        _ => format!("{}\n\n## {title}\n\n{section}\n", doc.trim_end()),
    };
    std::fs::write(&path, updated)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn machine_facts() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cpus} cores ({model})")
}

fn date() -> String {
    std::process::Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "recently".into(), |s| s.trim().to_string())
}

/// A bootstrap interval of `q`-quantile(ours) − `q`-quantile(theirs), each side's requests
/// pooled over its runs: the central `confidence` share of `rounds` resamples. Each resample
/// draws a side's runs with replacement, then each drawn run's requests with replacement
/// (the hierarchical bootstrap), so the spread between runs counts, not only the spread
/// between requests of one run. Seeded: the same runs give the same interval. `None` when a
/// side has no requests.
pub fn quantile_difference_interval(
    ours: &[Vec<f64>],
    theirs: &[Vec<f64>],
    q: f64,
    confidence: f64,
    rounds: usize,
) -> Option<(f64, f64)> {
    use rand::{Rng, SeedableRng};
    if [ours, theirs].iter().any(|runs| runs.iter().all(Vec::is_empty)) {
        return None;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let mut resample = |runs: &[Vec<f64>], pooled: &mut Vec<f64>| {
        pooled.clear();
        for _ in 0..runs.len() {
            let run = &runs[rng.random_range(0..runs.len())];
            pooled.extend((0..run.len()).map(|_| run[rng.random_range(0..run.len())]));
        }
        pooled.sort_by(f64::total_cmp);
        quantile(pooled, q)
    };
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut differences: Vec<f64> = Vec::with_capacity(rounds);
    while differences.len() < rounds.max(1) {
        let difference = resample(ours, &mut a) - resample(theirs, &mut b);
        // A resample of only empty runs has no quantile; draw again.
        if difference.is_finite() {
            differences.push(difference);
        }
    }
    differences.sort_by(f64::total_cmp);
    let tail = (1.0 - confidence.clamp(0.0, 1.0)) / 2.0;
    Some((quantile(&differences, tail), quantile(&differences, 1.0 - tail)))
}

/// The `q`-quantile of sorted values by nearest rank; NaN when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let index = ((sorted.len().saturating_sub(1)) as f64 * q).round() as usize;
    sorted.get(index).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(offset: f64) -> Vec<Vec<f64>> {
        (0..3).map(|r| (0..200).map(|i| offset + f64::from(i) + f64::from(r) * 5.0).collect()).collect()
    }

    #[test]
    fn the_interval_brackets_a_true_difference_and_excludes_zero_when_it_is_large() {
        let (lo, hi) = quantile_difference_interval(&runs(0.0), &runs(50.0), 0.9, 0.95, 500).expect("an interval");
        assert!(lo <= -50.0 && -50.0 <= hi, "({lo}, {hi}) holds the true −50");
        assert!(hi < 0.0, "a 50-unit shift is told apart from run-to-run noise of 10");
    }

    #[test]
    fn the_interval_straddles_zero_between_equal_sides_and_is_reproducible() {
        let once = quantile_difference_interval(&runs(0.0), &runs(0.0), 0.9, 0.95, 500).expect("an interval");
        assert!(once.0 < 0.0 && 0.0 < once.1, "{once:?}");
        assert_eq!(quantile_difference_interval(&runs(0.0), &runs(0.0), 0.9, 0.95, 500), Some(once));
    }

    #[test]
    fn empty_sides_have_no_interval() {
        assert_eq!(quantile_difference_interval(&[vec![]], &runs(0.0), 0.9, 0.95, 10), None);
        assert_eq!(quantile_difference_interval(&runs(0.0), &[], 0.9, 0.95, 10), None);
    }
}
