//! Passive health of the shim replicas: one circuit breaker per replica, fed by the outcome of
//! every dispatch to it.
//!
//! Only the replica's own failures count: a refused or timed-out connection, or no response head
//! in time. Any HTTP answer, even a 5xx about a worker, proves the shim is alive. After
//! [`FAILURE_THRESHOLD`] consecutive failures the breaker opens and the replica is skipped; after
//! [`COOLDOWN`] one request is let through as a probe (half-open), and its outcome closes or
//! reopens the breaker. A probe that never reports (its request was cancelled) is replaced by
//! another once a further cooldown has passed.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Consecutive failures that open a replica's breaker.
pub const FAILURE_THRESHOLD: u32 = 5;
/// How long an open breaker keeps its replica out before a probe is let through.
pub const COOLDOWN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    pub failure_threshold: u32,
    pub cooldown: Duration,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self { failure_threshold: FAILURE_THRESHOLD, cooldown: COOLDOWN }
    }
}

/// What a breaker is doing, as the state gauge exports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    HalfOpen,
    Open,
}

impl BreakerState {
    /// The gauge value: 0 closed, 1 half-open, 2 open.
    pub fn gauge_value(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { since: Instant },
    HalfOpen { probe_sent: Instant },
}

/// One replica's breaker: a pure state machine over explicit instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    state: State,
}

impl Default for Breaker {
    fn default() -> Self {
        Self { state: State::Closed { failures: 0 } }
    }
}

impl Breaker {
    /// Whether a request sent now would be let through (without claiming a probe).
    pub fn usable(&self, now: Instant, settings: &BreakerSettings) -> bool {
        match self.state {
            State::Closed { .. } => true,
            State::Open { since } => now.saturating_duration_since(since) >= settings.cooldown,
            State::HalfOpen { probe_sent } => now.saturating_duration_since(probe_sent) >= settings.cooldown,
        }
    }

    /// Lets a request through, claiming the probe when the cooldown is over.
    pub fn admit(&mut self, now: Instant, settings: &BreakerSettings) -> bool {
        if !self.usable(now, settings) {
            return false;
        }
        if !matches!(self.state, State::Closed { .. }) {
            self.state = State::HalfOpen { probe_sent: now };
        }
        true
    }

    pub fn on_success(&mut self) {
        self.state = State::Closed { failures: 0 };
    }

    pub fn on_failure(&mut self, now: Instant, settings: &BreakerSettings) {
        self.state = match self.state {
            State::Closed { failures } if failures.saturating_add(1) < settings.failure_threshold => {
                State::Closed { failures: failures + 1 }
            }
            State::Open { since } => State::Open { since },
            State::Closed { .. } | State::HalfOpen { .. } => State::Open { since: now },
        };
    }

    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::HalfOpen { .. } => BreakerState::HalfOpen,
            State::Open { .. } => BreakerState::Open,
        }
    }
}

/// The breakers of every shim replica this data plane has dispatched to, by backend name. A
/// backend whose URL changed on reload starts over with a closed breaker.
#[derive(Debug, Default)]
pub struct ShimHealth {
    settings: BreakerSettings,
    replicas: Mutex<HashMap<String, (String, Breaker)>>,
}

impl ShimHealth {
    pub fn new(settings: BreakerSettings) -> Self {
        Self { settings, replicas: Mutex::default() }
    }

    pub fn usable(&self, name: &str, url: &str, now: Instant) -> bool {
        self.with(name, url, |breaker, settings| breaker.usable(now, settings))
    }

    pub fn admit(&self, name: &str, url: &str, now: Instant) -> bool {
        self.with(name, url, |breaker, settings| breaker.admit(now, settings))
    }

    pub fn record(&self, name: &str, url: &str, healthy: bool, now: Instant) {
        self.with(name, url, |breaker, settings| {
            let before = breaker.state();
            if healthy {
                breaker.on_success()
            } else {
                breaker.on_failure(now, settings)
            }
            let after = breaker.state();
            if before != after {
                tracing::warn!(backend = name, ?before, ?after, "shim replica circuit breaker changed state");
            }
        });
    }

    /// Every replica's state, for the gauge; replicas no longer in `keep` are forgotten.
    pub fn states(&self, keep: impl Fn(&str) -> bool) -> Vec<(String, BreakerState)> {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        replicas.retain(|name, _| keep(name));
        replicas.iter().map(|(name, (_, breaker))| (name.clone(), breaker.state())).collect()
    }

    fn with<T>(&self, name: &str, url: &str, f: impl FnOnce(&mut Breaker, &BreakerSettings) -> T) -> T {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = replicas.entry(name.to_string()).or_insert_with(|| (url.to_string(), Breaker::default()));
        if entry.0 != url {
            *entry = (url.to_string(), Breaker::default());
        }
        f(&mut entry.1, &self.settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: BreakerSettings = BreakerSettings { failure_threshold: 3, cooldown: Duration::from_secs(10) };

    fn failed(breaker: &mut Breaker, times: u32, now: Instant) {
        for _ in 0..times {
            breaker.on_failure(now, &SETTINGS);
        }
    }

    #[test]
    fn opens_after_the_threshold_of_consecutive_failures_only() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 2, now);
        breaker.on_success();
        failed(&mut breaker, 2, now);
        assert_eq!(breaker.state(), BreakerState::Closed, "a success in between resets the count");
        failed(&mut breaker, 1, now);
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(!breaker.admit(now + Duration::from_secs(9), &SETTINGS));
    }

    #[test]
    fn lets_one_probe_through_after_the_cooldown_and_closes_on_its_success() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 3, now);
        let later = now + SETTINGS.cooldown;
        assert!(breaker.admit(later, &SETTINGS), "the probe");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        assert!(!breaker.admit(later, &SETTINGS), "only one probe at a time");
        breaker.on_success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.admit(later, &SETTINGS));
    }

    #[test]
    fn a_failed_probe_reopens_for_another_cooldown() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 3, now);
        let probe = now + SETTINGS.cooldown;
        assert!(breaker.admit(probe, &SETTINGS));
        breaker.on_failure(probe, &SETTINGS);
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(!breaker.admit(probe + Duration::from_secs(9), &SETTINGS));
        assert!(breaker.admit(probe + SETTINGS.cooldown, &SETTINGS));
    }

    #[test]
    fn a_probe_that_never_reports_is_replaced_after_a_cooldown() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 3, now);
        assert!(breaker.admit(now + SETTINGS.cooldown, &SETTINGS));
        assert!(breaker.admit(now + SETTINGS.cooldown * 2, &SETTINGS));
    }

    #[test]
    fn a_changed_url_starts_a_closed_breaker() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for _ in 0..3 {
            health.record("shim", "http://a", false, now);
        }
        assert!(!health.usable("shim", "http://a", now));
        assert!(health.usable("shim", "http://b", now));
        assert_eq!(health.states(|_| true), vec![("shim".to_string(), BreakerState::Closed)]);
        assert!(health.states(|_| false).is_empty());
    }
}
