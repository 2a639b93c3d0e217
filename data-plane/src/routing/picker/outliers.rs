//! Worker ranks whose pinned dispatches keep failing, kept out of picking for a while: the
//! replica's own outlier detection (Envoy's consecutive-5xx rule), so it stops choosing a dead
//! worker even while the control plane, which would remove it at lease expiry, is unreachable.
//!
//! [`EJECT_AFTER`] consecutive failed pinned dispatches on a rank eject it for [`EJECTION`]; a
//! success resets it. Pickers skip ejected ranks unless every candidate of a phase is ejected
//! (then none is skipped: a guess beats refusing every request). Bounded: at most
//! [`MAX_TRACKED`] ranks are remembered, forgetting all when full (it only resets counts).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::model::LoadKey;

/// Consecutive failed pinned dispatches that eject a rank.
pub const EJECT_AFTER: u32 = 2;
/// How long an ejected rank sits out.
pub const EJECTION: Duration = Duration::from_secs(10);
/// Ranks whose failures are remembered at once.
pub const MAX_TRACKED: usize = 4096;

#[derive(Debug, Clone, Copy, Default)]
struct Record {
    failures: u32,
    ejected_until: Option<Instant>,
}

#[derive(Debug, Default)]
pub struct Outliers {
    ranks: Mutex<HashMap<LoadKey, Record>>,
}

impl Outliers {
    /// A pinned dispatch on `ranks` failed in a way that points at the workers (the shim
    /// answered, but not with a response).
    pub fn failed(&self, ranks: &[LoadKey], now: Instant) {
        let mut held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        if held.len() + ranks.len() > MAX_TRACKED {
            held.clear();
        }
        for rank in ranks {
            let record = held.entry(rank.clone()).or_default();
            record.failures = record.failures.saturating_add(1);
            if record.failures >= EJECT_AFTER && record.ejected_until.is_none_or(|until| until <= now) {
                record.ejected_until = Some(now + EJECTION);
                tracing::warn!(worker = %rank.worker, dp_rank = rank.dp_rank, "pinned dispatches keep failing on this rank; skipping it for {EJECTION:?}");
            }
        }
    }

    /// A pinned dispatch on `ranks` answered.
    pub fn succeeded(&self, ranks: &[LoadKey]) {
        let mut held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_empty() {
            return;
        }
        for rank in ranks {
            held.remove(rank);
        }
    }

    /// Whether every rank's last pinned dispatch answered: there is nothing to skip.
    pub fn is_empty(&self) -> bool {
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }

    pub fn ejected(&self, rank: &LoadKey, now: Instant) -> bool {
        let held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(rank).and_then(|r| r.ejected_until).is_some_and(|until| until > now)
    }

    /// Drops the ejected ranks of `candidates`, unless that would drop them all.
    pub fn filter<T>(&self, candidates: &mut Vec<T>, key: impl Fn(&T) -> LoadKey, now: Instant) {
        if self.is_empty() {
            return;
        }
        if candidates.iter().all(|c| self.ejected(&key(c), now)) {
            return;
        }
        candidates.retain(|c| !self.ejected(&key(c), now));
    }
}

#[cfg(test)]
mod tests {
    use continuum_proto::model::WorkerKey;

    use super::*;

    fn rank(id: u64) -> LoadKey {
        LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank: 0 }
    }

    #[test]
    fn two_consecutive_failures_eject_for_the_ejection_time_and_a_success_resets() {
        let outliers = Outliers::default();
        let now = Instant::now();
        outliers.failed(&[rank(1)], now);
        assert!(!outliers.ejected(&rank(1), now), "one failure is not enough");
        outliers.succeeded(&[rank(1)]);
        outliers.failed(&[rank(1)], now);
        assert!(!outliers.ejected(&rank(1), now), "a success in between resets the count");
        outliers.failed(&[rank(1)], now);
        assert!(outliers.ejected(&rank(1), now));
        assert!(outliers.ejected(&rank(1), now + EJECTION - Duration::from_millis(1)));
        assert!(!outliers.ejected(&rank(1), now + EJECTION), "back after the ejection time");
    }

    #[test]
    fn filtering_skips_ejected_ranks_unless_all_are() {
        let outliers = Outliers::default();
        let now = Instant::now();
        for _ in 0..EJECT_AFTER {
            outliers.failed(&[rank(1)], now);
        }
        let mut candidates = vec![rank(1), rank(2)];
        outliers.filter(&mut candidates, Clone::clone, now);
        assert_eq!(candidates, vec![rank(2)]);
        let mut only_ejected = vec![rank(1)];
        outliers.filter(&mut only_ejected, Clone::clone, now);
        assert_eq!(only_ejected, vec![rank(1)], "a guess beats refusing every request");
    }

    #[test]
    fn memory_is_bounded() {
        let outliers = Outliers::default();
        let now = Instant::now();
        for id in 0..(MAX_TRACKED as u64 * 3) {
            outliers.failed(&[rank(id)], now);
        }
        assert!(outliers.ranks.lock().unwrap().len() <= MAX_TRACKED);
    }
}
