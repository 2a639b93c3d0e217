//! Reconnect delays: jittered exponential backoff between [`RECONNECT_INITIAL`] and
//! [`RECONNECT_MAX`], each drawn from [floor, ceiling]. The ceiling starts at twice the floor,
//! so even the first retries of subscriptions that broke together (a node restarting, a
//! partition healing) spread over a window instead of redialling in lockstep; it doubles on
//! every failed attempt and falls back only after a session that lasted [`STABLE_SESSION`], so
//! a publisher that accepts and then breaks the protocol cannot make the router reconnect in a
//! tight loop.

use std::time::Duration;

use rand::Rng;

pub const RECONNECT_INITIAL: Duration = Duration::from_millis(500);
pub const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// A session at least this long resets the backoff.
pub const STABLE_SESSION: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(RECONNECT_INITIAL, RECONNECT_MAX)
    }
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let max = max.max(initial);
        Self { initial, max, ceiling: Self::first_ceiling(initial, max) }
    }

    fn first_ceiling(initial: Duration, max: Duration) -> Duration {
        initial.saturating_mul(2).min(max)
    }

    /// A delay drawn uniformly from [floor, ceiling]; the ceiling then doubles up to the max.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.draw(&mut rand::rng());
        self.ceiling = (self.ceiling * 2).min(self.max);
        delay
    }

    fn draw(&self, rng: &mut impl Rng) -> Duration {
        let (low, high) = (self.initial.as_millis(), self.ceiling.as_millis());
        let millis = rng.random_range(low..=high.max(low));
        Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
    }

    /// Called when a session ends: only a long one resets the ceiling.
    pub fn session_ended(&mut self, lasted: Duration, stable: Duration) {
        if lasted >= stable {
            self.ceiling = Self::first_ceiling(self.initial, self.max);
        }
    }

    #[cfg(test)]
    pub fn ceiling(&self) -> Duration {
        self.ceiling
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_within_the_floor_and_a_doubling_ceiling() {
        let mut backoff = Backoff::default();
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            let ceiling = backoff.ceiling();
            let delay = backoff.next_delay();
            assert!(delay >= RECONNECT_INITIAL && delay <= ceiling, "{delay:?} outside [500ms, {ceiling:?}]");
            ceilings.push(ceiling.as_millis());
        }
        assert_eq!(ceilings, [1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000, 30000, 30000]);
    }

    #[test]
    fn only_a_30s_session_resets_the_floor() {
        let mut backoff = Backoff::default();
        for _ in 0..4 {
            backoff.next_delay();
        }
        backoff.session_ended(Duration::from_secs(29), STABLE_SESSION);
        assert_eq!(backoff.ceiling(), Duration::from_secs(16), "a short session keeps the backoff");
        backoff.session_ended(STABLE_SESSION, STABLE_SESSION);
        assert_eq!(backoff.ceiling(), RECONNECT_INITIAL * 2);
    }

    #[test]
    fn delays_are_spread_not_synchronised() {
        // 50 draws from the first window's 501 milliseconds repeat about 2.4 values: 20 repeats
        // (30 distinct) do not happen by chance, and lockstep gives 1 distinct.
        let spread = |backoff: Backoff| {
            let draws: std::collections::BTreeSet<Duration> = (0..50).map(|_| backoff.draw(&mut rand::rng())).collect();
            draws.len()
        };
        // The first retry of subscriptions that broke together (new ones, or ones reset by a
        // long session) as well as later ones.
        let mut backoff = Backoff::default();
        assert!(spread(backoff) > 30, "first retries must not redial in lockstep: {} distinct of 50", spread(backoff));
        backoff.session_ended(STABLE_SESSION, STABLE_SESSION);
        assert!(spread(backoff) > 30, "nor the first after a reset");
        for _ in 0..6 {
            backoff.next_delay();
        }
        assert!(
            spread(backoff) > 30,
            "1024 subscriptions must not reconnect in lockstep: {} distinct of 50",
            spread(backoff)
        );
    }
}
