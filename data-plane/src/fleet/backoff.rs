//! Full-jitter exponential backoff for reconnecting to the control plane.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
    /// No delay is shorter (0 until [`Backoff::saturate`]).
    floor: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max, current: initial, floor: Duration::ZERO }
    }

    /// A delay drawn uniformly from `[floor, current]`, then doubles `current` up to `max`.
    /// Full jitter spreads a fleet of replicas that lost the control plane at the same moment.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.current.max(self.floor);
        self.current = (self.current * 2).min(self.max);
        self.floor + (ceiling - self.floor).mul_f64(rand::random::<f64>())
    }

    /// For failures that retrying soon will not fix: every delay from now on is drawn from
    /// the upper half of the longest, still jittered, until a stable session resets it.
    pub fn saturate(&mut self) {
        self.current = self.max;
        self.floor = self.max / 2;
    }

    pub fn reset(&mut self) {
        self.current = self.initial;
        self.floor = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_capped_at_max() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(700));
        // The ceiling each delay was drawn under, and the one the next will be: it doubles.
        for (ceiling, next) in [(100, 200), (200, 400), (400, 700), (700, 700), (700, 700)] {
            assert_eq!(backoff.current, Duration::from_millis(ceiling));
            assert!(backoff.next_delay() <= Duration::from_millis(ceiling));
            assert_eq!(backoff.current, Duration::from_millis(next));
        }
        backoff.reset();
        assert_eq!((backoff.current, backoff.floor), (Duration::from_millis(100), Duration::ZERO));
        assert!(backoff.next_delay() <= Duration::from_millis(100));
        backoff.saturate();
        for _ in 0..100 {
            let delay = backoff.next_delay();
            assert!(delay >= Duration::from_millis(350) && delay <= Duration::from_millis(700), "{delay:?}");
        }
        backoff.reset();
        assert_eq!(backoff.current, Duration::from_millis(100), "a stable session starts over");
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
