//! Full-jitter exponential backoff for reconnecting to the control plane.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max, current: initial }
    }

    /// A delay drawn uniformly from `[0, current]`, then doubles `current` up to `max`.
    /// Full jitter spreads a fleet of replicas that lost the control plane at the same moment.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.current;
        self.current = (self.current * 2).min(self.max);
        ceiling.mul_f64(rand::random::<f64>())
    }

    /// Jumps straight to the ceiling: for failures that retrying soon will not fix.
    pub fn saturate(&mut self) {
        self.current = self.max;
    }

    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_capped_at_max() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(700));
        for ceiling in [100, 200, 400, 700, 700] {
            assert!(backoff.next_delay() <= Duration::from_millis(ceiling));
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
        backoff.saturate();
        assert_eq!(backoff.current, Duration::from_millis(700));
    }
}
