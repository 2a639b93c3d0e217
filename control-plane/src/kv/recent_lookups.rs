//! The lookups `FindMatches` answered in the last few milliseconds, and the rank each one's
//! request went to: the one place where picks made at once through different replicas are all
//! counted before any replica has folded them.
//!
//! A replica sees another's dispatch only after its report reaches the control plane, is
//! folded and streamed back: a few milliseconds in which a burst through two replicas is
//! picked on two views, each missing the other's picks. Opening bursts of the prefill/decode
//! unique-prompt benchmark (8 requests at once on a cold fleet) split 5/3 across two prefill
//! workers in 2 of 5 runs that way (`docs/benchmark-notes.md`, "Five runs a cell"). The
//! control plane answers every lookup in order, so it can arbitrate: each lookup reserves the
//! rank its request goes to (the rank suggested to it until the dispatch report names the rank
//! it took), and a lookup made while reservations stand on its contenders is suggested the one
//! with the fewest prompt tokens reserved, as one process's least-loaded pick would be
//! ([`Suggestion::Weighed`]). A lookup with none standing is suggested the contender reserved
//! longest ago, to break exact ties with ([`Suggestion::TieBreak`]): the first lookups of a
//! burst often reach the control plane before any report does, and on a cold fleet every
//! contender ties, so the replica takes that rank and the reservation is right from the start.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;

/// How long a lookup's reservation stands: past the time its dispatch takes to be reported
/// (at most 1 ms), folded and streamed back (the backlog window, 2 ms), after which every
/// replica's view counts it.
pub const RESERVATION_WINDOW: Duration = Duration::from_millis(8);
/// Most reservations held; past it the oldest go first. A burst larger than this within the
/// window is beyond what two cores serve, and losing a reservation costs one suggestion.
pub const MAX_RESERVATIONS: usize = 1024;
/// Most contenders a lookup is weighed against; with more, no rank is suggested, so that one
/// lookup's cost stays bounded whatever a replica sends.
pub const MAX_CONTENDERS: usize = 64;
/// Most ranks whose last reservation is remembered for tie-breaks; past it the memory starts
/// over, which costs a tie-break or two the order a round robin would give them.
pub const MAX_REMEMBERED_RANKS: usize = 4096;

#[derive(Debug)]
pub struct RecentLookups {
    window: Duration,
    last_lookup: u64,
    /// Oldest first, so numbered in increasing order.
    reservations: VecDeque<Reservation>,
    /// Each rank's newest reservation, however old, for tie-breaks.
    last_reserved: HashMap<RankKey, u64>,
}

#[derive(Clone, Copy, Debug)]
struct Reservation {
    lookup: u64,
    at: Instant,
    /// Unknown until suggested or reported.
    rank: Option<RankKey>,
    tokens: u64,
}

/// One answered lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The lookup's number, 1, 2, 3…
    pub lookup: u64,
    /// `None` only without contenders (or with more than are weighed).
    pub suggestion: Option<Suggestion>,
}

/// What the control plane suggests to a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suggestion {
    /// The contender the lookups standing left the fewest prompt tokens, and the tokens they
    /// reserved on all contenders: the most by which the replica's own view, which may miss
    /// their picks, can be behind.
    Weighed { rank: RankKey, reserved_tokens: u64 },
    /// No lookup stands on a contender: the one reserved longest ago, for exact ties only.
    TieBreak(RankKey),
}

impl Suggestion {
    pub fn rank(self) -> RankKey {
        match self {
            Suggestion::Weighed { rank, .. } | Suggestion::TieBreak(rank) => rank,
        }
    }
}

impl Default for RecentLookups {
    fn default() -> Self {
        Self::new(RESERVATION_WINDOW)
    }
}

impl RecentLookups {
    pub fn new(window: Duration) -> Self {
        Self { window, last_lookup: 0, reservations: VecDeque::new(), last_reserved: HashMap::new() }
    }

    /// Sets how long a reservation stands (tests hold it open; [`RESERVATION_WINDOW`] is the
    /// control plane's).
    pub fn set_window(&mut self, window: Duration) {
        self.window = window;
    }

    /// Numbers a lookup for a prompt of `tokens` among `contenders`, suggests one of them, and
    /// reserves the suggestion for it.
    pub fn answer(&mut self, contenders: &[RankKey], tokens: u64, now: Instant) -> Answer {
        self.expire(now);
        self.last_lookup += 1;
        let lookup = self.last_lookup;
        let suggestion = self.suggest(contenders);
        if self.reservations.len() >= MAX_RESERVATIONS {
            self.reservations.pop_front();
        }
        let rank = suggestion.map(Suggestion::rank);
        self.reservations.push_back(Reservation { lookup, at: now, rank, tokens });
        if let Some(rank) = rank {
            self.remember(rank, lookup);
        }
        Answer { lookup, suggestion }
    }

    /// The dispatch of `lookup` went to `rank`: its reservation now stands there.
    pub fn reported(&mut self, lookup: u64, rank: RankKey) {
        // Numbers increase along the queue; an expired or unknown lookup is not found.
        let Ok(at) = self.reservations.binary_search_by_key(&lookup, |r| r.lookup) else { return };
        if let Some(reservation) = self.reservations.get_mut(at) {
            reservation.rank = Some(rank);
            self.remember(rank, lookup);
        }
    }

    /// Reservations held (some may have lapsed since the last lookup).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.reservations.len()
    }

    fn expire(&mut self, now: Instant) {
        while self.reservations.front().is_some_and(|r| now.saturating_duration_since(r.at) >= self.window) {
            self.reservations.pop_front();
        }
    }

    fn remember(&mut self, rank: RankKey, lookup: u64) {
        if self.last_reserved.len() >= MAX_REMEMBERED_RANKS && !self.last_reserved.contains_key(&rank) {
            self.last_reserved.clear();
        }
        let last = self.last_reserved.entry(rank).or_default();
        *last = (*last).max(lookup);
    }

    /// The contender with the fewest tokens reserved when any has a reservation standing, else
    /// the one reserved longest ago; of equals, the one reserved longest ago, then the first.
    fn suggest(&self, contenders: &[RankKey]) -> Option<Suggestion> {
        if contenders.len() > MAX_CONTENDERS {
            return None;
        }
        let mut reserved = vec![0_u64; contenders.len()];
        let mut any = false;
        for reservation in &self.reservations {
            let Some(rank) = reservation.rank else { continue };
            if let Some(at) = contenders.iter().position(|c| *c == rank) {
                reserved[at] = reserved[at].saturating_add(reservation.tokens.max(1));
                any = true;
            }
        }
        let last = |rank: &RankKey| self.last_reserved.get(rank).copied().unwrap_or(0);
        let (least, _) = contenders.iter().zip(&reserved).min_by_key(|(rank, reserved)| (**reserved, last(rank)))?;
        let reserved_tokens = reserved.iter().fold(0_u64, |sum, tokens| sum.saturating_add(*tokens));
        Some(if any { Suggestion::Weighed { rank: *least, reserved_tokens } } else { Suggestion::TieBreak(*least) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const X: RankKey = RankKey { worker_id: 1, dp_rank: 0 };
    const Y: RankKey = RankKey { worker_id: 2, dp_rank: 0 };

    fn weighed(lookups: &mut RecentLookups, tokens: u64, now: Instant) -> Option<RankKey> {
        match lookups.answer(&[X, Y], tokens, now).suggestion {
            Some(Suggestion::Weighed { rank, .. }) => Some(rank),
            _ => None,
        }
    }

    #[test]
    fn with_nothing_standing_the_rank_reserved_longest_ago_breaks_ties() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let tie_break = |rank| Some(Suggestion::TieBreak(rank));
        assert_eq!(lookups.answer(&[X, Y], 100, now), Answer { lookup: 1, suggestion: tie_break(X) });
        let later = now + RESERVATION_WINDOW;
        assert_eq!(lookups.answer(&[X, Y], 100, later), Answer { lookup: 2, suggestion: tie_break(Y) });
        let answer = lookups.answer(&[X, Y], 100, later + RESERVATION_WINDOW);
        assert_eq!(answer.suggestion, tie_break(X));
        // Its request went to Y after all: X is now the one reserved longest ago.
        lookups.reported(answer.lookup, Y);
        assert_eq!(lookups.answer(&[X, Y], 100, later + RESERVATION_WINDOW * 3).suggestion, tie_break(X));
        assert_eq!(lookups.answer(&[], 100, now).suggestion, None, "no contender, nothing to suggest");
    }

    #[test]
    fn a_burst_is_split_as_one_process_would_split_it() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let mut went = Vec::new();
        for _ in 0..8 {
            went.push(lookups.answer(&[X, Y], 100, now).suggestion.map(Suggestion::rank).expect("contenders"));
        }
        assert_eq!(went, [X, Y, X, Y, X, Y, X, Y]);
    }

    #[test]
    fn larger_prompts_weigh_more_and_a_report_moves_a_reservation() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let big = lookups.answer(&[X, Y], 900, now);
        lookups.reported(big.lookup, Y);
        let small = lookups.answer(&[X, Y], 100, now);
        assert_eq!(small.suggestion, Some(Suggestion::Weighed { rank: X, reserved_tokens: 900 }));
        assert_eq!(weighed(&mut lookups, 100, now), Some(X), "100 + 100 tokens against 900");
        // The small one's request went to Y after all (its replica saw something else).
        lookups.reported(small.lookup, Y);
        let answer = lookups.answer(&[X, Y], 100, now).suggestion;
        assert_eq!(answer, Some(Suggestion::Weighed { rank: X, reserved_tokens: 1_100 }), "100 against 1,000");
    }

    #[test]
    fn equal_reservations_go_to_the_rank_reserved_longest_ago() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        for rank in [Y, X] {
            let answer = lookups.answer(&[X, Y], 100, now);
            lookups.reported(answer.lookup, rank);
        }
        assert_eq!(weighed(&mut lookups, 100, now), Some(Y));
    }

    #[test]
    fn reservations_lapse_after_the_window() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let first = lookups.answer(&[X, Y], 100, now);
        assert_eq!(weighed(&mut lookups, 100, now + RESERVATION_WINDOW / 2), Some(Y));
        assert_eq!(weighed(&mut lookups, 100, now + RESERVATION_WINDOW * 2), None, "every view counts them by now");
        assert_eq!(lookups.held(), 1, "only the latest lookup's reservation stands");
        lookups.reported(first.lookup, Y);
        assert_eq!(lookups.held(), 1, "an expired lookup's report finds nothing");
    }

    #[test]
    fn only_contenders_are_weighed_and_too_many_get_no_suggestion() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let elsewhere = lookups.answer(&[], 100, now);
        lookups.reported(elsewhere.lookup, RankKey { worker_id: 9, dp_rank: 3 });
        let answer = lookups.answer(&[X, Y], 100, now);
        assert_eq!(answer.suggestion, Some(Suggestion::TieBreak(X)), "no contender is reserved");
        let many: Vec<RankKey> =
            (0..=MAX_CONTENDERS as u64).map(|id| RankKey { worker_id: id + 1, dp_rank: 0 }).collect();
        assert_eq!(lookups.answer(&many, 100, now).suggestion, None);
    }

    #[test]
    fn reservations_and_remembered_ranks_are_bounded() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        for id in 0..MAX_RESERVATIONS as u64 * 2 {
            let rank = RankKey { worker_id: id, dp_rank: 0 };
            lookups.answer(&[rank], 100, now);
        }
        assert_eq!(lookups.held(), MAX_RESERVATIONS);
        for id in 0..MAX_REMEMBERED_RANKS as u64 * 2 {
            let answer = lookups.answer(&[], 100, now);
            lookups.reported(answer.lookup, RankKey { worker_id: id, dp_rank: 1 });
        }
        assert!(lookups.last_reserved.len() <= MAX_REMEMBERED_RANKS);
    }
}
