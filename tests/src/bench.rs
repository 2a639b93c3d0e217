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
