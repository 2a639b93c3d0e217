//! Warming the render path when a tokenizer loads. A replica's first renders pay one-time
//! costs that later ones do not: new render threads, and the allocator's first touch of
//! the memory an encode's buffers take. On the benchmark's 2 cores (`docs/benchmark-notes.md`, session 21) the
//! first burst's renders ran 25–100 ms against 2–5 ms once warm, and that burst's requests were
//! the run's slowest. So before a loaded tokenizer is served, one probe prompt is rendered on
//! as many threads at once as the renderer has permits free.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::super::artifacts::LoadedArtifacts;
use super::super::hashing::{BlockSize, SaltHash, block_hashes};

/// Bytes of pseudo-text in one probe: about a 2,000-token prompt for a byte-level BPE.
const PROBE_BYTES: usize = 8 << 10;
/// How long a probe holds its thread waiting for the others to start, at most.
pub(super) const WARM_WAIT: Duration = Duration::from_secs(1);

/// What one warming did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmed {
    /// Probes that rendered.
    pub rendered: usize,
    /// Distinct threads they ran on.
    pub threads: usize,
}

/// Renders a probe on each of up to `threads` render threads at the same time and waits for
/// them. Each holds one of `permits`, as a request's render does, taking only those free now:
/// warming never waits for requests' renders, nor holds permits they wait for beyond its own
/// probes. Each probe holds its thread until every probe has started (or [`WARM_WAIT`]
/// passed), so no two share one. Best effort: a probe that fails to render only warms less.
pub(super) async fn warm(artifacts: Arc<LoadedArtifacts>, permits: &Arc<Semaphore>, threads: usize) -> Warmed {
    let started = Instant::now();
    let running = Arc::new(AtomicUsize::new(0));
    let free: Vec<_> = (0..threads).map_while(|_| Arc::clone(permits).try_acquire_owned().ok()).collect();
    let threads = free.len();
    let mut probes = Vec::with_capacity(threads);
    for (probe, permit) in free.into_iter().enumerate() {
        let (artifacts, running) = (Arc::clone(&artifacts), Arc::clone(&running));
        probes.push(super::threads::spawn(move || {
            let _permit = permit;
            running.fetch_add(1, Ordering::AcqRel);
            let rendered = render_probe(&artifacts, probe).is_some();
            let deadline = Instant::now() + WARM_WAIT;
            while running.load(Ordering::Acquire) < threads && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            (rendered, std::thread::current().id())
        }));
    }
    let (mut rendered, mut ids) = (0, HashSet::new());
    for probe in probes {
        if let Ok((ok, id)) = probe.await {
            rendered += usize::from(ok);
            ids.insert(id);
        }
    }
    let warmed = Warmed { rendered, threads: ids.len() };
    tracing::debug!(?warmed, elapsed = ?started.elapsed(), "render path warmed");
    warmed
}

/// One probe's render, encode and hash; `None` when a step failed. It encodes the text whole,
/// past the piece cache, so the probe's text stays out of it.
fn render_probe(artifacts: &LoadedArtifacts, probe: usize) -> Option<()> {
    let text = artifacts.template.render(&probe_request(probe)).ok()?;
    let encoding = artifacts.tokenizer.encode(text.as_str(), false).ok()?;
    block_hashes(encoding.get_ids(), BlockSize::new(16).ok()?, SaltHash::default());
    Some(())
}

/// A system and a user message of pseudo-words, different for each probe.
fn probe_request(probe: usize) -> Value {
    let text = pseudo_text(probe as u64, PROBE_BYTES);
    let (system, user) = text.split_at(text.len() * 3 / 4);
    json!({"model": "probe", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

/// `bytes` of lowercase pseudo-words from a seeded linear congruential generator.
fn pseudo_text(seed: u64, bytes: usize) -> String {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        for _ in 0..2 + next() % 7 {
            text.push(char::from(b'a' + (next() % 26) as u8));
        }
        text.push(' ');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_are_sized_like_a_long_prompt_and_differ() {
        let (a, b) = (probe_request(0), probe_request(1));
        assert_ne!(a, b);
        let length = |r: &Value| {
            r["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap().len()).sum::<usize>()
        };
        assert!((PROBE_BYTES..PROBE_BYTES + 16).contains(&length(&a)), "{}", length(&a));
    }
}
