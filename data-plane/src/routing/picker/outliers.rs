//! Worker ranks whose pinned dispatches keep failing, kept out of picking for a while: the
//! replica's own outlier detection (Envoy's consecutive-5xx rule), so it stops choosing a dead
//! worker even while the control plane, which would remove it at lease expiry, is unreachable.
//!
//! [`EJECT_AFTER`] consecutive failed pinned dispatches on a rank eject it for [`EJECTION`]; a
//! success resets it, and so does the end of an ejection: a rank back from one needs as many
//! failures again to go. An ejection under way runs its time whatever succeeds meanwhile (as
//! Envoy's does): the successes it sees are of requests sent before it, long streams a worker
//! that now refuses new requests still finishes, and each would let it fail two more. Pickers
//! skip ejected ranks, at most a third of a phase's candidates (at least one, never all: a
//! guess beats refusing every request). A rank's record goes when its ejection ends, or
//! [`EJECTION`] after a failure that ejected nothing, so a worker that left the fleet leaves
//! no trace. Bounded: at most [`MAX_TRACKED`] ranks are remembered; when full,
//! failures short of an ejection are forgotten first (it only resets counts).
//!
//! An answer that never came in time, or one that blames the pins, counts only against a rank
//! that answered nothing else since the request was sent ([`Outliers::failed_unless_answering`]):
//! a worker answering other requests is not hung, and the request was merely long (or its shim
//! replica failed it). Otherwise a client could eject healthy workers with a burst of requests
//! too long to finish in time, all timing out together.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::fast_hash::FastMap;
use continuum_proto::model::LoadKey;

/// Consecutive failed pinned dispatches that eject a rank.
pub const EJECT_AFTER: u32 = 2;
/// How long an ejected rank sits out.
pub const EJECTION: Duration = Duration::from_secs(10);
/// Ranks whose failures are remembered at once.
pub const MAX_TRACKED: usize = 4096;
/// Ranks whose last answer is remembered at once: every rank of a large fleet (16,384 workers
/// of a rank or few each) answers, and one forgotten looks silent to its next timeout. About
/// 6 MiB when full.
pub const MAX_ANSWERING: usize = 65_536;
/// An answer older than this says nothing of a request still waiting on its rank (none waits
/// longer for its head: a buffered answer's timeout is 300 s), so it is the first forgotten.
const ANSWER_RELEVANT_FOR: Duration = Duration::from_secs(3600);
/// At most this share of a phase's candidates is skipped for its ejections (at least one, and
/// never all): a request shape every worker answers with a 500 (a parser bug, a bad rollout)
/// would otherwise eject all but one, which would then take the whole fleet's load. Envoy's
/// `max_ejection_percent` does the same.
pub const MAX_EJECTED_DIVISOR: usize = 3;

#[derive(Debug, Clone, Copy)]
struct Record {
    failures: u32,
    last_failure: Instant,
    ejected_until: Option<Instant>,
}

impl Record {
    /// Whether the record still says something at `now`: an ejection under way, or a failure
    /// recent enough to count toward one.
    fn current(&self, now: Instant) -> bool {
        match self.ejected_until {
            Some(until) => until > now,
            None => now.saturating_duration_since(self.last_failure) < EJECTION,
        }
    }

    fn ejects(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| until > now)
    }
}

/// Keyed by the fleet's ranks (pins the picker chose), so a fast hash will do.
#[derive(Debug, Default)]
pub struct Outliers {
    ranks: Mutex<FastMap<LoadKey, Record>>,
    /// When each rank last answered a pinned dispatch (its first token, or a whole answer), at
    /// most [`MAX_ANSWERING`] ranks: when full, answers past [`ANSWER_RELEVANT_FOR`] go, and
    /// all if none had (it only makes a rank's next timeout count against it).
    answered: Mutex<FastMap<LoadKey, Instant>>,
}

impl Outliers {
    /// A pinned dispatch on `ranks` failed in a way that points at the workers (the shim
    /// answered, but not with a response).
    pub fn failed(&self, ranks: &[LoadKey], now: Instant) {
        let mut held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|_, record| record.current(now));
        if held.len() + ranks.len() > MAX_TRACKED {
            // Failures short of an ejection go first: forgetting an ejection would put a rank
            // that keeps failing back into every pick.
            held.retain(|_, record| record.ejects(now));
        }
        if held.len() + ranks.len() > MAX_TRACKED {
            held.clear();
        }
        for rank in ranks {
            let record =
                held.entry(rank.clone()).or_insert(Record { failures: 0, last_failure: now, ejected_until: None });
            record.failures = record.failures.saturating_add(1);
            record.last_failure = now;
            if record.failures >= EJECT_AFTER && record.ejected_until.is_none() {
                record.ejected_until = Some(now + EJECTION);
                tracing::warn!(worker = %rank.worker, dp_rank = rank.dp_rank, "pinned dispatches keep failing on this rank; skipping it for {EJECTION:?}");
            }
        }
    }

    /// A pinned dispatch's answer on `ranks`, sent at `sent`, broke off at `now` under its head,
    /// which points at its workers (`DispatchEnd::blame`). A rank alone is counted. Of a pair
    /// the failure may be either one's (1.6.1 answers one generic 500 whichever worker failed),
    /// so a rank that answered another dispatch since `sent` is cleared of it: it works, and
    /// the other is the suspect. One dead decode worker would otherwise eject every healthy
    /// prefill rank paired with it.
    pub fn failed_since(&self, ranks: &[LoadKey], sent: Instant, now: Instant) {
        if ranks.len() < 2 {
            return self.failed(ranks, now);
        }
        self.failed_unless_answering(ranks, sent, now);
    }

    /// A pinned dispatch on `ranks` sent at `sent` failed by `now` with no answer in time, or
    /// with an answer that blames them (a 5xx, a 404, a refusal of their ids): a failure of the
    /// ranks that answered nothing else since, through any shim replica. One that did works:
    /// the request was merely long, or its shim replica failed it (a frontend that lost its
    /// discovery, or restarted, answers every pin so while its `/live` says 200), and blamed
    /// on the workers such a replica would eject healthy ones every other replica serves.
    pub fn failed_unless_answering(&self, ranks: &[LoadKey], sent: Instant, now: Instant) {
        let silent: Vec<LoadKey> = {
            let answered = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
            ranks.iter().filter(|rank| answered.get(*rank).is_none_or(|at| *at < sent)).cloned().collect()
        };
        if !silent.is_empty() {
            self.failed(&silent, now);
        }
    }

    /// A pinned dispatch on `ranks` began to answer at `now` (its first token): they work.
    pub fn answered<'k>(&self, ranks: impl IntoIterator<Item = &'k LoadKey>, now: Instant) {
        let mut answered = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
        for rank in ranks {
            if let Some(at) = answered.get_mut(rank) {
                *at = now;
                continue;
            }
            if answered.len() >= MAX_ANSWERING {
                answered.retain(|_, at| now.saturating_duration_since(*at) < ANSWER_RELEVANT_FOR);
                // Too few old ones to make room for long: each new rank would scan the table
                // again under the lock.
                if answered.len() >= MAX_ANSWERING - MAX_ANSWERING / 8 {
                    answered.clear();
                }
            }
            answered.insert(rank.clone(), now);
        }
    }

    /// A pinned dispatch on `ranks` answered whole at `now`: their failures start over, but
    /// for an ejection under way, which runs its time.
    pub fn succeeded<'k>(&self, ranks: impl IntoIterator<Item = &'k LoadKey> + Clone, now: Instant) {
        self.answered(ranks.clone(), now);
        let mut held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_empty() {
            return;
        }
        for rank in ranks {
            if held.get(rank).is_some_and(|record| !record.ejects(now)) {
                held.remove(rank);
            }
        }
    }

    /// Whether no rank has a record: then a success has nothing to reset.
    pub fn is_empty(&self) -> bool {
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }

    /// Whether some rank is ejected at `now`: otherwise there is nothing to skip. Records
    /// that no longer say anything are dropped on the way.
    pub fn any_ejected(&self, now: Instant) -> bool {
        let mut held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        if held.is_empty() {
            return false;
        }
        held.retain(|_, record| record.current(now));
        held.values().any(|record| record.ejects(now))
    }

    /// Whether `rank` is ejected at `now`.
    pub fn ejected(&self, rank: &LoadKey, now: Instant) -> bool {
        let held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(rank).is_some_and(|record| record.ejects(now))
    }

    /// Drops the ejected ranks of `candidates`, at most a `MAX_EJECTED_DIVISOR`th of them
    /// (at least one, never all): past that share, those ejected last, whose failures are the
    /// most recent. One look at the records, so a rank ejected meanwhile cannot empty the list.
    pub fn filter<T>(&self, candidates: &mut Vec<T>, key: impl Fn(&T) -> LoadKey, now: Instant) {
        let held = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        // One candidate (or none) is never skipped: a guess beats refusing every request.
        if held.is_empty() || candidates.len() < 2 {
            return;
        }
        let mut ejected: Vec<(Instant, usize)> = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                held.get(&key(c)).filter(|r| r.ejects(now)).and_then(|r| r.ejected_until).map(|until| (until, i))
            })
            .collect();
        if ejected.is_empty() {
            return;
        }
        let most = (candidates.len() / MAX_EJECTED_DIVISOR).max(1);
        ejected.sort_unstable_by(|a, b| b.cmp(a));
        ejected.truncate(most);
        let mut skipped: Vec<usize> = ejected.into_iter().map(|(_, i)| i).collect();
        skipped.sort_unstable();
        let mut index = 0;
        candidates.retain(|_| {
            index += 1;
            skipped.binary_search(&(index - 1)).is_err()
        });
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
        outliers.succeeded(&[rank(1)], now);
        outliers.failed(&[rank(1)], now);
        assert!(!outliers.ejected(&rank(1), now), "a success in between resets the count");
        outliers.failed(&[rank(1)], now);
        assert!(outliers.ejected(&rank(1), now));
        // A request sent before the ejection (a long stream) finishing well does not end it.
        outliers.succeeded(&[rank(1)], now + Duration::from_secs(1));
        assert!(outliers.ejected(&rank(1), now + Duration::from_secs(1)), "an ejection runs its time");
        assert!(outliers.ejected(&rank(1), now + EJECTION - Duration::from_millis(1)));
        assert!(!outliers.ejected(&rank(1), now + EJECTION), "back after the ejection time");
    }

    #[test]
    fn a_rank_back_from_an_ejection_needs_as_many_failures_again_and_old_records_go() {
        let outliers = Outliers::default();
        let now = Instant::now();
        for _ in 0..EJECT_AFTER {
            outliers.failed(&[rank(1)], now);
        }
        assert!(outliers.any_ejected(now));
        let back = now + EJECTION;
        assert!(!outliers.any_ejected(back), "the ejection is over");
        outliers.failed(&[rank(1)], back);
        assert!(!outliers.ejected(&rank(1), back), "one failure after an ejection is one failure");
        // A worker that fails once and leaves the fleet leaves nothing behind.
        assert!(!outliers.any_ejected(back + EJECTION));
        assert!(outliers.ranks.lock().unwrap_or_else(PoisonError::into_inner).is_empty());
    }

    /// However many ranks are ejected, at most a third of a list is skipped (at least one):
    /// those ejected last.
    #[test]
    fn filtering_skips_at_most_a_third_of_the_candidates_those_ejected_last() {
        let outliers = Outliers::default();
        let start = Instant::now();
        let now = start + Duration::from_millis(5);
        for (at, id) in (1..=5).enumerate() {
            let failed_at = start + Duration::from_millis(at as u64);
            for _ in 0..EJECT_AFTER {
                outliers.failed(&[rank(id)], failed_at);
            }
        }
        let mut six: Vec<LoadKey> = (1..=6).map(rank).collect();
        outliers.filter(&mut six, Clone::clone, now);
        assert_eq!(six, vec![rank(1), rank(2), rank(3), rank(6)], "two of six skipped: ranks 5 and 4, ejected last");
        let mut two = vec![rank(1), rank(2)];
        outliers.filter(&mut two, Clone::clone, now);
        assert_eq!(two, vec![rank(1)], "one of two: the one ejected last");
    }

    #[test]
    fn filtering_never_skips_every_candidate() {
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
        let mut none: Vec<LoadKey> = Vec::new();
        outliers.filter(&mut none, Clone::clone, now);
        assert!(none.is_empty());
    }

    /// A request too long to be answered in time says nothing of a rank that answered others
    /// since it was sent: a burst of such requests timing out together ejects nobody. A rank
    /// that answered nothing since is a suspect.
    #[test]
    fn a_timeout_counts_only_against_a_rank_silent_since_the_request_was_sent() {
        let outliers = Outliers::default();
        let sent = Instant::now();
        let later = sent + Duration::from_secs(1);
        outliers.answered(&[rank(1)], later);
        let timed_out = sent + Duration::from_secs(300);
        for _ in 0..20 {
            outliers.failed_unless_answering(&[rank(1), rank(2)], sent, timed_out);
        }
        assert!(!outliers.ejected(&rank(1), timed_out), "it answered others meanwhile");
        assert!(outliers.ejected(&rank(2), timed_out), "silent since: hung");
        // An answer before the request was sent clears nothing.
        outliers.failed_unless_answering(&[rank(1)], later + Duration::from_secs(1), timed_out);
        outliers.failed_unless_answering(&[rank(1)], later + Duration::from_secs(1), timed_out);
        assert!(outliers.ejected(&rank(1), timed_out));
    }

    /// A pair's failure before its first token may be either worker's: the one that answers
    /// other dispatches meanwhile is cleared, the other ejected. A rank alone is counted
    /// whatever it answered: the failure can only be its own.
    #[test]
    fn a_pairs_failure_counts_against_the_rank_that_answered_nothing_since() {
        let outliers = Outliers::default();
        let (prefill, dead_decode) = (rank(1), rank(2));
        let sent = Instant::now();
        for turn in 1..=4 {
            let now = sent + Duration::from_millis(10 * turn);
            outliers.answered(&[prefill.clone(), rank(3)], now - Duration::from_millis(5));
            outliers.failed_since(&[prefill.clone(), dead_decode.clone()], sent, now);
        }
        let now = sent + Duration::from_secs(1);
        assert!(outliers.ejected(&dead_decode, now), "silent since: the suspect");
        assert!(!outliers.ejected(&prefill, now), "it prefilled for another decode worker meanwhile");
        // Both silent: both suspects, as before.
        outliers.failed_since(&[rank(4), rank(5)], now, now);
        outliers.failed_since(&[rank(4), rank(5)], now, now);
        assert!(outliers.ejected(&rank(4), now) && outliers.ejected(&rank(5), now));
        // Alone, a rank's failures are its own.
        outliers.answered(&[rank(6)], now);
        outliers.failed_since(&[rank(6)], sent, now);
        outliers.failed_since(&[rank(6)], sent, now);
        assert!(outliers.ejected(&rank(6), now));
    }

    #[test]
    fn memory_is_bounded_and_ejections_outlast_a_burst_of_single_failures() {
        let outliers = Outliers::default();
        let now = Instant::now();
        let dead = rank(u64::MAX);
        for _ in 0..EJECT_AFTER {
            outliers.failed(std::slice::from_ref(&dead), now);
        }
        for id in 0..(MAX_TRACKED as u64 * 3) {
            outliers.failed(&[rank(id)], now);
        }
        assert!(outliers.ranks.lock().unwrap().len() <= MAX_TRACKED);
        assert!(outliers.ejected(&dead, now), "the ejection is kept while single failures come and go");
    }

    /// Every rank of a fleet larger than the failures remembered keeps its last answer, so a
    /// request timing out on a rank that answered others since is no failure of it; answers
    /// too old to matter are forgotten first when the table fills.
    #[test]
    fn a_large_fleet_keeps_every_ranks_answer_and_the_table_stays_bounded() {
        let outliers = Outliers::default();
        let sent = Instant::now();
        let now = sent + Duration::from_secs(1);
        let fleet = MAX_TRACKED as u64 * 4;
        for id in 0..fleet {
            outliers.answered(&[rank(id)], now);
        }
        for _ in 0..EJECT_AFTER {
            outliers.failed_unless_answering(&[rank(0)], sent, now);
        }
        assert!(!outliers.ejected(&rank(0), now), "it answered others since");
        // Old answers go first; the table never passes its bound.
        let later = now + ANSWER_RELEVANT_FOR;
        for id in fleet..(MAX_ANSWERING as u64 + 10) {
            outliers.answered(&[rank(id)], later);
        }
        let answered = outliers.answered.lock().unwrap();
        assert_eq!(answered.len(), MAX_ANSWERING + 10 - fleet as usize, "the old ones gone, the new ones kept");
        assert!(answered.contains_key(&rank(fleet)) && answered.contains_key(&rank(MAX_ANSWERING as u64 + 9)));
    }
}
