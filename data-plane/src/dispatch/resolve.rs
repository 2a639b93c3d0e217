//! Shim host names, resolved at most once per [`FRESH_FOR`] rather than at every new connection.
//!
//! A burst of new connections (a cold pool, the reuse limit learned after a shim restarted)
//! would otherwise ask the system resolver once each, and in a Kubernetes pod each question
//! walks the search domains first; a lookup the cluster's DNS loses waits seconds, inside the
//! connect timeout, and counts against the shim. An answer is kept for [`FRESH_FOR`]; when the
//! resolver then fails, the last answer serves for up to [`STALE_FOR`] more (a shim's address
//! rarely moves while its DNS is away). Each connection starts at the next address of the
//! answer, so a name with several (a headless Service's pods) spreads its connections.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long an answer is used without asking again.
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// How long past that an answer stands in for a resolver that fails.
pub const STALE_FOR: Duration = Duration::from_secs(300);
/// Names remembered at once: the configured shim backends (at most 64), with room to spare.
const MAX_NAMES: usize = 256;

#[derive(Debug)]
struct Answer {
    addrs: Arc<[SocketAddr]>,
    at: Instant,
}

#[derive(Debug, Default)]
pub struct Resolver {
    answers: Mutex<HashMap<String, Answer>>,
    /// Where the next connection starts in its answer.
    turn: AtomicUsize,
}

impl Resolver {
    /// The addresses to try for `host`:`port`, in the order to try them.
    pub async fn resolve(&self, host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        let addrs = match literal(host, port) {
            Some(addr) => return Ok(vec![addr]),
            None => self.addrs(host, port).await?,
        };
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % addrs.len().max(1);
        Ok(addrs.iter().cycle().skip(start).take(addrs.len()).copied().collect())
    }

    async fn addrs(&self, host: &str, port: u16) -> io::Result<Arc<[SocketAddr]>> {
        let key = format!("{host}:{port}");
        let held = self.held(&key);
        if let Some((addrs, at)) = &held
            && at.elapsed() < FRESH_FOR
        {
            return Ok(Arc::clone(addrs));
        }
        let asked = tokio::net::lookup_host((host, port)).await.and_then(|found| {
            let addrs: Arc<[SocketAddr]> = found.collect();
            if addrs.is_empty() {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("{host} resolved to no address")));
            }
            Ok(addrs)
        });
        match (asked, held) {
            (Ok(addrs), _) => {
                self.keep(key, Arc::clone(&addrs));
                Ok(addrs)
            }
            (Err(error), Some((addrs, at))) if at.elapsed() < FRESH_FOR + STALE_FOR => {
                tracing::debug!(%error, host, "resolving a shim host failed; using its last answer");
                Ok(addrs)
            }
            (Err(error), _) => Err(error),
        }
    }

    fn held(&self, key: &str) -> Option<(Arc<[SocketAddr]>, Instant)> {
        let answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        answers.get(key).map(|answer| (Arc::clone(&answer.addrs), answer.at))
    }

    pub(super) fn keep(&self, key: String, addrs: Arc<[SocketAddr]>) {
        let mut answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        if answers.len() >= MAX_NAMES && !answers.contains_key(&key) {
            answers.clear();
        }
        answers.insert(key, Answer { addrs, at: Instant::now() });
    }
}

/// `host` as an IP address literal (`[v6]` too), which needs no resolver.
fn literal(host: &str, port: u16) -> Option<SocketAddr> {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    bare.parse().ok().map(|ip| SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn literals_need_no_resolver_and_names_are_asked_once_while_fresh() -> io::Result<()> {
        let resolver = Resolver::default();
        assert_eq!(resolver.resolve("127.0.0.1", 80).await?, vec!["127.0.0.1:80".parse().expect("address")]);
        assert_eq!(resolver.resolve("[::1]", 81).await?, vec!["[::1]:81".parse().expect("address")]);
        assert!(resolver.held("127.0.0.1:80").is_none(), "a literal is not kept");
        let first = resolver.resolve("localhost", 8000).await?;
        assert!(!first.is_empty() && first.iter().all(|addr| addr.ip().is_loopback() && addr.port() == 8000));
        let (_, at) = resolver.held("localhost:8000").expect("kept");
        resolver.resolve("localhost", 8000).await?;
        assert_eq!(resolver.held("localhost:8000").map(|(_, again)| again), Some(at), "not asked again while fresh");
        Ok(())
    }

    /// A resolver that fails is stood in for by the last answer, for a while.
    #[tokio::test]
    async fn a_failing_resolver_is_stood_in_for_by_the_last_answer() -> io::Result<()> {
        let resolver = Resolver::default();
        let addrs: Arc<[SocketAddr]> = Arc::from(["10.0.0.7:8000".parse::<SocketAddr>().expect("address")]);
        // A name the system resolver refuses without asking anyone (no query leaves the host).
        let gone = "shim\0gone";
        resolver.answers.lock().expect("lock").insert(
            format!("{gone}:8000"),
            Answer { addrs: Arc::clone(&addrs), at: Instant::now() - FRESH_FOR - Duration::from_secs(1) },
        );
        assert_eq!(resolver.resolve(gone, 8000).await?, addrs.to_vec(), "the stale answer");
        resolver.answers.lock().expect("lock").insert(
            format!("{gone}:8000"),
            Answer { addrs, at: Instant::now() - FRESH_FOR - STALE_FOR - Duration::from_secs(1) },
        );
        assert!(resolver.resolve(gone, 8000).await.is_err(), "too old to stand in");
        Ok(())
    }

    /// Each connection starts at the next address of a name's answer.
    #[tokio::test]
    async fn connections_start_at_each_address_in_turn() -> io::Result<()> {
        let resolver = Resolver::default();
        let addrs: Vec<SocketAddr> =
            ["10.0.0.1:80", "10.0.0.2:80"].iter().map(|a| a.parse().expect("address")).collect();
        resolver.keep("pool.test:80".into(), Arc::from(addrs.clone()));
        let firsts: Vec<SocketAddr> = [
            resolver.resolve("pool.test", 80).await?,
            resolver.resolve("pool.test", 80).await?,
            resolver.resolve("pool.test", 80).await?,
        ]
        .iter()
        .map(|order| order[0])
        .collect();
        assert_eq!(firsts, [addrs[0], addrs[1], addrs[0]]);
        assert_eq!(resolver.resolve("pool.test", 80).await?, [addrs[1], addrs[0]], "the rest after");
        Ok(())
    }
}
