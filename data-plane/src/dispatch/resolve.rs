//! Shim host names, resolved off the connect path once an answer is held.
//!
//! A burst of new connections (a cold pool, the reuse limit learned after a shim restarted)
//! would otherwise ask the system resolver once each, and in a Kubernetes pod each question
//! walks the search domains first; a lookup the cluster's DNS loses waits seconds, inside the
//! connect timeout, and counts against the shim. So a name is looked up on the connect path
//! only while no answer is held. An answer is used as it stands for [`FRESH_FOR`]; after that a
//! connection still takes it at once while one lookup of the name refreshes it in the
//! background, for up to [`STALE_FOR`] in all (a shim's address rarely moves while its DNS is
//! away; a refresh that fails leaves the answer as it was). Each connection starts at the next
//! address of the answer, so a name with several (a headless Service's pods) spreads its
//! connections.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

// tokio's clock, so tests can age an answer by pausing it.
use tokio::time::Instant;

/// How long an answer is used without asking again.
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// How long an answer is used at all, refreshed or not: past it a connection waits for a
/// lookup of its own.
pub const STALE_FOR: Duration = Duration::from_secs(300);
/// Names remembered at once: the configured shim backends (at most 64), with room to spare.
const MAX_NAMES: usize = 256;

#[derive(Debug)]
struct Answer {
    addrs: Arc<[SocketAddr]>,
    at: Instant,
}

#[derive(Debug, Default)]
struct Held {
    answers: HashMap<String, Answer>,
    /// Names whose background refresh is under way: one at a time each.
    refreshing: HashSet<String>,
}

#[derive(Debug, Default)]
pub struct Resolver {
    held: Mutex<Held>,
    /// Where the next connection starts in its answer.
    turn: AtomicUsize,
}

impl Resolver {
    /// The addresses to try for `host`:`port`, in the order to try them.
    pub async fn resolve(self: &Arc<Self>, host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        let addrs = match literal(host, port) {
            Some(addr) => return Ok(vec![addr]),
            None => self.addrs(host, port).await?,
        };
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % addrs.len().max(1);
        Ok(addrs.iter().cycle().skip(start).take(addrs.len()).copied().collect())
    }

    async fn addrs(self: &Arc<Self>, host: &str, port: u16) -> io::Result<Arc<[SocketAddr]>> {
        let key = format!("{host}:{port}");
        let held = self.lock().answers.get(&key).map(|answer| (Arc::clone(&answer.addrs), answer.at.elapsed()));
        match held {
            Some((addrs, age)) if age < FRESH_FOR => return Ok(addrs),
            Some((addrs, age)) if age < STALE_FOR => {
                self.refresh(key, host.to_owned(), port);
                return Ok(addrs);
            }
            _ => {}
        }
        let addrs = lookup(host, port).await?;
        self.keep(key, Arc::clone(&addrs));
        Ok(addrs)
    }

    /// Looks `host` up again in the background, unless a lookup of it is under way.
    fn refresh(self: &Arc<Self>, key: String, host: String, port: u16) {
        if !self.lock().refreshing.insert(key.clone()) {
            return;
        }
        let resolver = Arc::clone(self);
        tokio::spawn(async move {
            match lookup(&host, port).await {
                Ok(addrs) => resolver.keep(key.clone(), addrs),
                Err(error) => {
                    tracing::debug!(%error, host, "refreshing a shim host's addresses failed; keeping the last answer")
                }
            }
            resolver.lock().refreshing.remove(&key);
        });
    }

    pub(super) fn keep(&self, key: String, addrs: Arc<[SocketAddr]>) {
        let mut held = self.lock();
        if held.answers.len() >= MAX_NAMES && !held.answers.contains_key(&key) {
            held.answers.clear();
        }
        held.answers.insert(key, Answer { addrs, at: Instant::now() });
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

async fn lookup(host: &str, port: u16) -> io::Result<Arc<[SocketAddr]>> {
    let addrs: Arc<[SocketAddr]> = tokio::net::lookup_host((host, port)).await?.collect();
    if addrs.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("{host} resolved to no address")));
    }
    Ok(addrs)
}

/// `host` as an IP address literal (`[v6]` too), which needs no resolver.
fn literal(host: &str, port: u16) -> Option<SocketAddr> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    bare.parse().ok().map(|ip| SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_at(resolver: &Resolver, key: &str) -> Option<Instant> {
        resolver.lock().answers.get(key).map(|answer| answer.at)
    }

    #[tokio::test]
    async fn literals_need_no_resolver_and_names_are_asked_once_while_fresh() -> io::Result<()> {
        let resolver = Arc::new(Resolver::default());
        assert_eq!(resolver.resolve("127.0.0.1", 80).await?, vec!["127.0.0.1:80".parse().expect("address")]);
        assert_eq!(resolver.resolve("[::1]", 81).await?, vec!["[::1]:81".parse().expect("address")]);
        assert!(held_at(&resolver, "127.0.0.1:80").is_none(), "a literal is not kept");
        let first = resolver.resolve("localhost", 8000).await?;
        assert!(!first.is_empty() && first.iter().all(|addr| addr.ip().is_loopback() && addr.port() == 8000));
        let at = held_at(&resolver, "localhost:8000").expect("kept");
        resolver.resolve("localhost", 8000).await?;
        assert_eq!(held_at(&resolver, "localhost:8000"), Some(at), "not asked again while fresh");
        Ok(())
    }

    /// Past its freshness an answer still serves at once while a lookup refreshes it behind;
    /// one that fails leaves it as it was. Past [`STALE_FOR`] a connection waits for a lookup.
    /// The clock is paused and moved on by hand (a lookup in flight holds it still).
    #[tokio::test(start_paused = true)]
    async fn a_stale_answer_serves_at_once_while_the_name_is_looked_up_again() -> io::Result<()> {
        let resolver = Arc::new(Resolver::default());
        let addrs: Arc<[SocketAddr]> = Arc::from(["10.0.0.7:8000".parse::<SocketAddr>().expect("address")]);
        // Names the system resolver refuses without asking anyone: no query leaves the host.
        let (gone, moved) = ("shim\0gone", "localhost");
        let (gone_key, moved_key) = (format!("{gone}:8000"), format!("{moved}:8000"));
        resolver.keep(gone_key.clone(), Arc::clone(&addrs));
        resolver.keep(moved_key.clone(), Arc::clone(&addrs));
        let kept = held_at(&resolver, &gone_key).expect("kept");
        tokio::time::advance(FRESH_FOR + Duration::from_secs(1)).await;
        assert_eq!(resolver.resolve(gone, 8000).await?, addrs.to_vec(), "the stale answer, at once");
        // A refresh that succeeds replaces the answer: `localhost` was held as 10.0.0.7.
        assert_eq!(resolver.resolve(moved, 8000).await?, addrs.to_vec(), "the stale answer, at once");
        let refreshed = async {
            while !resolver.lock().refreshing.is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), refreshed).await.map_err(io::Error::other)?;
        let held = |key: &str| resolver.lock().answers.get(key).map(|a| (a.addrs.to_vec(), a.at));
        let refreshed = held(&moved_key).map(|(addrs, _)| addrs.iter().all(|a| a.ip().is_loopback()));
        assert_eq!(refreshed, Some(true), "a refresh that succeeded replaced the answer");
        assert_eq!(held(&gone_key), Some((addrs.to_vec(), kept)), "a failed one kept it as it was");
        tokio::time::advance(STALE_FOR).await;
        assert!(resolver.resolve(gone, 8000).await.is_err(), "too old to stand in");
        Ok(())
    }

    /// Each connection starts at the next address of a name's answer.
    #[tokio::test]
    async fn connections_start_at_each_address_in_turn() -> io::Result<()> {
        let resolver = Arc::new(Resolver::default());
        let addrs: Vec<SocketAddr> =
            ["10.0.0.1:80", "10.0.0.2:80"].iter().map(|a| a.parse().expect("address")).collect();
        resolver.keep("pool.test:80".into(), Arc::from(addrs.clone()));
        let mut firsts = Vec::new();
        for _ in 0..3 {
            firsts.push(resolver.resolve("pool.test", 80).await?[0]);
        }
        assert_eq!(firsts, [addrs[0], addrs[1], addrs[0]]);
        assert_eq!(resolver.resolve("pool.test", 80).await?, [addrs[1], addrs[0]], "the rest after");
        Ok(())
    }
}
