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
use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;
use continuum_proto::MAX_LOOKUP_CONTENDERS;

/// How long a lookup's reservation stands: past the time its dispatch takes to be reported
/// (at most 1 ms), folded and streamed back (the backlog window, 2 ms), after which every
/// replica's view counts it.
pub const RESERVATION_WINDOW: Duration = Duration::from_millis(8);
/// Most reservations held; past it the oldest go first. A burst larger than this within the
/// window is beyond what two cores serve, and losing a reservation costs one suggestion.
pub const MAX_RESERVATIONS: usize = 1024;
/// Most ranks whose last reservation is remembered for tie-breaks; past it the memory starts
/// over, which costs a tie-break or two the order a round robin would give them.
pub const MAX_REMEMBERED_RANKS: usize = 4096;

/// A replica's name for one of its lookups: its replica id and its own number for the lookup
/// (`FindMatchesRequest.lookup`). Only a report on that replica's session names it, so no
/// other replica can move its reservation, and the replica names it whether or not the answer
/// reached it in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupKey<'a> {
    pub replica: &'a str,
    pub lookup: u64,
}

#[derive(Debug)]
pub struct RecentLookups {
    window: Duration,
    /// The control plane's own numbering of the lookups it answered, which orders them.
    last_seq: u64,
    /// Oldest first, so numbered in increasing order.
    reservations: VecDeque<Reservation>,
    /// The reservation each standing key names, by its number.
    by_key: HashMap<(u64, u64), u64>,
    /// Hashes replica ids into keys; a collision of two replicas' 64-bit hashes would only let
    /// them name each other's lookups.
    hasher: RandomState,
    /// Each rank's newest reservation, however old, for tie-breaks.
    last_reserved: HashMap<RankKey, u64>,
    /// Reports that came before their lookup was answered (the replica's deadline passed and
    /// it picked alone while the lookup waited on the index), by key, with when: the answer
    /// reserves the rank the report names, not its own suggestion, which nothing could move.
    early: HashMap<(u64, u64), (RankKey, Instant)>,
    /// When the first of `early` lapses, as of its last pass: no pass before then frees room.
    early_full_until: Option<Instant>,
}

#[derive(Clone, Copy, Debug)]
struct Reservation {
    seq: u64,
    key: Option<(u64, u64)>,
    at: Instant,
    /// Unknown until suggested or reported.
    rank: Option<RankKey>,
    tokens: u64,
    /// The suggested rank's newest reservation before this one: its own again should a report
    /// move this one elsewhere, so the rank that was only suggested is not taken for one just
    /// reserved in tie-breaks.
    suggested_after: u64,
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
        Self {
            window,
            last_seq: 0,
            reservations: VecDeque::new(),
            by_key: HashMap::new(),
            hasher: RandomState::new(),
            last_reserved: HashMap::new(),
            early: HashMap::new(),
            early_full_until: None,
        }
    }

    /// Sets how long a reservation stands (tests hold it open; [`RESERVATION_WINDOW`] is the
    /// control plane's).
    pub fn set_window(&mut self, window: Duration) {
        self.window = window;
    }

    /// Suggests one of `contenders` to a lookup for a prompt of `tokens`, and reserves the
    /// suggestion for it under `key` until a report names the rank taken. `None` only without
    /// contenders (or with more than are weighed). A lookup without a key (number 0) reserves
    /// all the same, but no report can move its reservation; a key a replica reuses (it
    /// restarted within the window) names its newest lookup.
    pub fn answer(
        &mut self,
        key: Option<LookupKey<'_>>,
        contenders: &[RankKey],
        tokens: u64,
        now: Instant,
    ) -> Option<Suggestion> {
        self.expire(now);
        self.last_seq += 1;
        let seq = self.last_seq;
        let suggestion = self.suggest(contenders);
        if self.reservations.len() >= MAX_RESERVATIONS {
            self.pop_oldest();
        }
        let key = key.filter(|key| key.lookup != 0).map(|key| self.slot(key));
        if let Some(key) = key {
            self.by_key.insert(key, seq);
        }
        // Its request went somewhere already: the reservation stands there.
        let window = self.window;
        let early = key.and_then(|key| self.early.remove(&key));
        let reported = early.filter(|(_, at)| now.saturating_duration_since(*at) < window).map(|(rank, _)| rank);
        let rank = reported.or(suggestion.map(Suggestion::rank));
        let suggested_after = rank.map_or(0, |rank| self.last(&rank));
        self.reservations.push_back(Reservation { seq, key, at: now, rank, tokens, suggested_after });
        if let Some(rank) = rank {
            self.remember(rank, seq);
        }
        suggestion
    }

    /// The dispatch of the lookup `key` names went to `rank`: its reservation now stands
    /// there. An expired or unknown lookup is not found, and nothing changes.
    pub fn reported(&mut self, key: LookupKey<'_>, rank: RankKey, now: Instant) {
        let slot = self.slot(key);
        let Some(&seq) = self.by_key.get(&slot) else {
            // Perhaps not answered yet: kept for its answer, as long as a reservation would be.
            if key.lookup == 0 {
                return;
            }
            if self.early.len() >= MAX_RESERVATIONS && self.early_full_until.is_none_or(|until| now >= until) {
                let window = self.window;
                self.early.retain(|_, (_, at)| now.saturating_duration_since(*at) < window);
                // What is left lapses no sooner than its oldest: no pass over it until then,
                // so a report of a thousand misses against a full set costs one pass, not one
                // each, under the lock every lookup takes (a steady stream of misses, each
                // freeing room for the next, still costs a pass each, but past 100,000 a second).
                self.early_full_until = self.early.values().map(|(_, at)| *at + window).min();
            }
            if self.early.len() < MAX_RESERVATIONS {
                self.early.insert(slot, (rank, now));
            }
            return;
        };
        // Numbers increase along the queue.
        let Ok(at) = self.reservations.binary_search_by_key(&seq, |r| r.seq) else { return };
        let Some(reservation) = self.reservations.get_mut(at) else { return };
        let (suggested, before) = (reservation.rank.replace(rank), reservation.suggested_after);
        if let Some(suggested) = suggested.filter(|suggested| *suggested != rank)
            && let Some(last) = self.last_reserved.get_mut(&suggested)
            && *last == seq
        {
            *last = before;
        }
        self.remember(rank, seq);
    }

    /// `rank`'s newest reservation (0: none remembered).
    fn last(&self, rank: &RankKey) -> u64 {
        self.last_reserved.get(rank).copied().unwrap_or(0)
    }

    /// Reservations held (some may have lapsed since the last lookup).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.reservations.len()
    }

    fn slot(&self, key: LookupKey<'_>) -> (u64, u64) {
        (self.hasher.hash_one(key.replica), key.lookup)
    }

    fn expire(&mut self, now: Instant) {
        while self.reservations.front().is_some_and(|r| now.saturating_duration_since(r.at) >= self.window) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        let Some(oldest) = self.reservations.pop_front() else { return };
        // Unless a newer lookup reused the key.
        if let Some(key) = oldest.key
            && self.by_key.get(&key) == Some(&oldest.seq)
        {
            self.by_key.remove(&key);
        }
    }

    fn remember(&mut self, rank: RankKey, seq: u64) {
        if self.last_reserved.len() >= MAX_REMEMBERED_RANKS && !self.last_reserved.contains_key(&rank) {
            self.last_reserved.clear();
        }
        let last = self.last_reserved.entry(rank).or_default();
        *last = (*last).max(seq);
    }

    /// The contender with the fewest tokens reserved when any has a reservation standing, else
    /// the one reserved longest ago; of equals, the one reserved longest ago, then the first.
    fn suggest(&self, contenders: &[RankKey]) -> Option<Suggestion> {
        if contenders.len() > MAX_LOOKUP_CONTENDERS {
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
        // A rank named twice weighs as it does the first time, not as one with nothing reserved.
        let first = |rank: &RankKey| contenders.iter().position(|c| c == rank).unwrap_or(0);
        let weighs = |at: usize| reserved.get(first(&contenders[at])).copied().unwrap_or(0);
        let (least, _) = (0..contenders.len())
            .map(|at| (&contenders[at], weighs(at)))
            .min_by_key(|(rank, reserved)| (*reserved, self.last(rank)))?;
        let reserved_tokens = reserved.iter().fold(0_u64, |sum, tokens| sum.saturating_add(*tokens));
        Some(if any { Suggestion::Weighed { rank: *least, reserved_tokens } } else { Suggestion::TieBreak(*least) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const X: RankKey = RankKey { worker_id: 1, dp_rank: 0 };
    const Y: RankKey = RankKey { worker_id: 2, dp_rank: 0 };

    /// Replica "a"'s lookup number `lookup`.
    fn a(lookup: u64) -> LookupKey<'static> {
        LookupKey { replica: "a", lookup }
    }

    fn weighed(lookups: &mut RecentLookups, tokens: u64, now: Instant) -> Option<RankKey> {
        match lookups.answer(None, &[X, Y], tokens, now) {
            Some(Suggestion::Weighed { rank, .. }) => Some(rank),
            _ => None,
        }
    }

    #[test]
    fn with_nothing_standing_the_rank_reserved_longest_ago_breaks_ties() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let tie_break = |rank| Some(Suggestion::TieBreak(rank));
        assert_eq!(lookups.answer(Some(a(1)), &[X, Y], 100, now), tie_break(X));
        let later = now + RESERVATION_WINDOW;
        assert_eq!(lookups.answer(Some(a(2)), &[X, Y], 100, later), tie_break(Y));
        assert_eq!(lookups.answer(Some(a(3)), &[X, Y], 100, later + RESERVATION_WINDOW), tie_break(X));
        // Its request went to Y after all: X is now the one reserved longest ago.
        lookups.reported(a(3), Y, Instant::now());
        assert_eq!(lookups.answer(Some(a(4)), &[X, Y], 100, later + RESERVATION_WINDOW * 3), tie_break(X));
        assert_eq!(lookups.answer(Some(a(5)), &[], 100, now), None, "no contender, nothing to suggest");
    }

    /// A rank only suggested, whose request went elsewhere, is again the one reserved as long
    /// ago as before: listed first or not, the rank that took the request loses the next tie.
    #[test]
    fn a_moved_reservation_gives_the_suggested_rank_its_place_in_tie_breaks_back() {
        for later_order in [[X, Y], [Y, X]] {
            let mut lookups = RecentLookups::default();
            let now = Instant::now();
            assert_eq!(lookups.answer(Some(a(1)), &[X, Y], 100, now), Some(Suggestion::TieBreak(X)));
            lookups.reported(a(1), Y, Instant::now());
            let later = now + RESERVATION_WINDOW;
            let next = lookups.answer(Some(a(2)), &later_order, 100, later);
            assert_eq!(next, Some(Suggestion::TieBreak(X)), "{later_order:?}: Y took the last request");
        }
    }

    /// A report that comes before its lookup is answered (the replica picked alone past its
    /// deadline) still places the lookup's reservation: on the rank the request went to, not
    /// on the suggestion the answer then makes, which nothing would move.
    #[test]
    fn a_report_before_its_answer_places_the_reservation() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.reported(a(1), Y, now);
        assert_eq!(
            lookups.answer(Some(a(1)), &[X, Y], 900, now),
            Some(Suggestion::TieBreak(X)),
            "suggested all the same"
        );
        assert_eq!(weighed(&mut lookups, 100, now), Some(X), "its 900 tokens stand on Y, where the request went");
        // Kept no longer than a reservation stands: a report that old places nothing.
        lookups.reported(a(2), X, now);
        let later = now + RESERVATION_WINDOW;
        let suggested = lookups.answer(Some(a(2)), &[X, Y], 900, later);
        assert_eq!(suggested, Some(Suggestion::TieBreak(Y)), "Y was reserved longest ago");
        assert_eq!(weighed(&mut lookups, 100, later), Some(X), "the stale report was dropped: Y holds the 900");
    }

    /// Early reports are held at most [`MAX_RESERVATIONS`] at once: past that, new ones are
    /// dropped until the held ones lapse, then kept again.
    #[test]
    fn early_reports_are_bounded_and_room_comes_back_as_they_lapse() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let count = MAX_RESERVATIONS as u64;
        (1..=count * 2).for_each(|n| lookups.reported(a(n), Y, now));
        assert_eq!(lookups.early.len(), MAX_RESERVATIONS);
        assert_eq!(lookups.early_full_until, Some(now + RESERVATION_WINDOW), "full until the first lapses");
        let later = now + RESERVATION_WINDOW;
        lookups.reported(a(count * 2 + 1), X, later);
        assert_eq!(lookups.early.len(), 1, "the lapsed ones gone, the new one held");
        lookups.answer(Some(a(count * 2 + 1)), &[X, Y], 900, later);
        assert_eq!(weighed(&mut lookups, 100, later), Some(Y), "its 900 tokens stand on X, where it went");
    }

    /// A rank a replica names twice among the contenders weighs what is reserved on it.
    #[test]
    fn a_contender_named_twice_weighs_what_it_holds() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.answer(Some(a(1)), &[X], 900, now);
        lookups.answer(Some(a(2)), &[Y], 100, now);
        let answer = lookups.answer(Some(a(3)), &[X, X, Y], 100, now).map(Suggestion::rank);
        assert_eq!(answer, Some(Y), "X holds 900 tokens however often it is named, Y 100");
    }

    #[test]
    fn a_burst_is_split_as_one_process_would_split_it() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        let went: Vec<RankKey> =
            (1..=8).map(|n| lookups.answer(Some(a(n)), &[X, Y], 100, now).expect("contenders").rank()).collect();
        assert_eq!(went, [X, Y, X, Y, X, Y, X, Y]);
    }

    #[test]
    fn larger_prompts_weigh_more_and_a_report_moves_a_reservation() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.answer(Some(a(1)), &[X, Y], 900, now);
        lookups.reported(a(1), Y, Instant::now());
        let small = lookups.answer(Some(a(2)), &[X, Y], 100, now);
        assert_eq!(small, Some(Suggestion::Weighed { rank: X, reserved_tokens: 900 }));
        assert_eq!(weighed(&mut lookups, 100, now), Some(X), "100 + 100 tokens against 900");
        // The small one's request went to Y after all (its replica saw something else).
        lookups.reported(a(2), Y, Instant::now());
        let answer = lookups.answer(None, &[X, Y], 100, now);
        assert_eq!(answer, Some(Suggestion::Weighed { rank: X, reserved_tokens: 1_100 }), "100 against 1,000");
    }

    #[test]
    fn only_the_replica_that_made_a_lookup_can_move_its_reservation() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        assert_eq!(lookups.answer(Some(a(7)), &[X, Y], 900, now), Some(Suggestion::TieBreak(X)));
        // Replica "b" numbers its own lookups, and its 7 is not a's.
        lookups.reported(LookupKey { replica: "b", lookup: 7 }, Y, Instant::now());
        assert_eq!(weighed(&mut lookups, 100, now), Some(Y), "a's 900 tokens still stand on X");
        // Nor does a lookup without a number answer to a report of number 0.
        lookups.answer(None, &[], 5_000, now);
        lookups.reported(a(0), X, Instant::now());
        assert_eq!(weighed(&mut lookups, 100, now), Some(Y));
        lookups.reported(a(7), Y, Instant::now());
        assert_eq!(weighed(&mut lookups, 100, now), Some(X), "a's own report moved it");
    }

    #[test]
    fn a_reused_key_names_the_newest_lookup_and_survives_the_older_ones_expiry() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.answer(Some(a(1)), &[X], 100, now);
        // Replica "a" restarted and numbers from 1 again.
        let later = now + RESERVATION_WINDOW / 2;
        lookups.answer(Some(a(1)), &[Y], 100, later);
        let lapsed = now + RESERVATION_WINDOW;
        lookups.answer(None, &[], 0, lapsed);
        assert_eq!(lookups.held(), 2, "the first reservation lapsed");
        lookups.reported(a(1), X, Instant::now());
        assert_eq!(weighed(&mut lookups, 100, lapsed), Some(Y), "the newer one moved to X");
    }

    #[test]
    fn equal_reservations_go_to_the_rank_reserved_longest_ago() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        for (n, rank) in [(1, Y), (2, X)] {
            lookups.answer(Some(a(n)), &[X, Y], 100, now);
            lookups.reported(a(n), rank, Instant::now());
        }
        assert_eq!(weighed(&mut lookups, 100, now), Some(Y));
    }

    #[test]
    fn reservations_lapse_after_the_window() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.answer(Some(a(1)), &[X, Y], 100, now);
        assert_eq!(weighed(&mut lookups, 100, now + RESERVATION_WINDOW / 2), Some(Y));
        assert_eq!(weighed(&mut lookups, 100, now + RESERVATION_WINDOW * 2), None, "every view counts them by now");
        assert_eq!(lookups.held(), 1, "only the latest lookup's reservation stands");
        assert!(lookups.by_key.is_empty(), "the lapsed lookup's key went with it");
        lookups.reported(a(1), Y, Instant::now());
        assert_eq!(lookups.held(), 1, "an expired lookup's report finds nothing");
    }

    #[test]
    fn only_contenders_are_weighed_and_too_many_get_no_suggestion() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        lookups.answer(Some(a(1)), &[], 100, now);
        lookups.reported(a(1), RankKey { worker_id: 9, dp_rank: 3 }, Instant::now());
        assert_eq!(lookups.answer(None, &[X, Y], 100, now), Some(Suggestion::TieBreak(X)), "no contender is reserved");
        let many: Vec<RankKey> =
            (0..=MAX_LOOKUP_CONTENDERS as u64).map(|id| RankKey { worker_id: id + 1, dp_rank: 0 }).collect();
        assert_eq!(lookups.answer(None, &many, 100, now), None);
    }

    #[test]
    fn reservations_keys_and_remembered_ranks_are_bounded() {
        let mut lookups = RecentLookups::default();
        let now = Instant::now();
        for id in 0..MAX_RESERVATIONS as u64 * 2 {
            let rank = RankKey { worker_id: id, dp_rank: 0 };
            lookups.answer(Some(a(id + 1)), &[rank], 100, now);
        }
        assert_eq!(lookups.held(), MAX_RESERVATIONS);
        assert_eq!(lookups.by_key.len(), MAX_RESERVATIONS);
        for id in 0..MAX_REMEMBERED_RANKS as u64 * 2 {
            let key = LookupKey { replica: "b", lookup: id + 1 };
            lookups.answer(Some(key), &[], 100, now);
            lookups.reported(key, RankKey { worker_id: id, dp_rank: 1 }, Instant::now());
        }
        assert!(lookups.last_reserved.len() <= MAX_REMEMBERED_RANKS);
        assert_eq!(lookups.by_key.len(), MAX_RESERVATIONS);
    }
}
