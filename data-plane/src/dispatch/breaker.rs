//! Health of the shim replicas: one circuit breaker per replica, fed by the outcome of every
//! dispatch to it (passive), beside the verdict of its periodic `GET /live` probe (active, see
//! `probe`). A replica is used only while both allow it.
//!
//! Only the replica's own failures count: a refused or timed-out connection, a broken exchange,
//! a proxy in front of it answering 502 or 504, or no response head in time while it answered
//! nothing else (a buffered answer's head comes only once generation is done, so a head that
//! never came while the shim answered other requests is its pinned workers' silence, not its
//! own), or a success whose body breaks under its head (1.6.1 reports a worker's death in the
//! stream, so a broken connection is the shim's or the network's). A success counts once its
//! body has ended (its head closes a half-open breaker, since the trial reached the shim, but
//! resets no count), so a replica that cuts every answer under its head still opens it. Any
//! other HTTP answer, even a 5xx about a worker, proves the shim is alive. After
//! [`FAILURE_THRESHOLD`] consecutive failures the breaker opens and the replica is skipped; after
//! [`COOLDOWN`] one request is let through as a probe (half-open), and its outcome closes or
//! reopens the breaker. A probe that never reports (its request was cancelled) is replaced by
//! another once a further cooldown has passed.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use continuum_proto::fast_hash::FastMap;

use super::pool::ShimReplica;

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
    Closed {
        failures: u32,
    },
    Open {
        since: Instant,
    },
    /// Open, its cooldown cut short by a live liveness probe: the next request is the trial.
    Trial {
        opened: Instant,
    },
    /// A trial request under way; `opened` is when the breaker last opened.
    HalfOpen {
        probe_sent: Instant,
        opened: Instant,
    },
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
            State::Closed { .. } | State::Trial { .. } => true,
            State::Open { since } => now.saturating_duration_since(since) >= settings.cooldown,
            State::HalfOpen { probe_sent, .. } => now.saturating_duration_since(probe_sent) >= settings.cooldown,
        }
    }

    /// Lets a request through, claiming the probe when the cooldown is over.
    pub fn admit(&mut self, now: Instant, settings: &BreakerSettings) -> bool {
        if !self.usable(now, settings) {
            return false;
        }
        match self.state {
            State::Closed { .. } => {}
            State::Open { since: opened } | State::Trial { opened } | State::HalfOpen { opened, .. } => {
                self.state = State::HalfOpen { probe_sent: now, opened };
            }
        }
        true
    }

    /// A whole answer other than a success (the frontend's refusal, or its failure of the
    /// request's workers) to a request `sent` then: the replica's chat path answers. Like a
    /// success's head it closes a half-open breaker when it answers the trial, like a success's
    /// end it starts a closed breaker's count over; like either, it leaves an open breaker open,
    /// its cooldown whole.
    pub fn on_answered(&mut self, sent: Instant) {
        self.on_head(sent);
        self.on_served();
    }

    /// A success answer's head arrived for a request `sent` then: the replica answers chat
    /// completions, so a trial passed and a half-open breaker closes: any request sent since
    /// the breaker opened (a trial, even one a later trial replaced while its buffered answer
    /// was generated), but not one sent before (still answering as it tripped), which says
    /// nothing of the replica now. A closed breaker's count stands until the exchange's body
    /// ends and its outcome is recorded: a replica that cuts every answer under its head must
    /// still open it.
    pub fn on_head(&mut self, sent: Instant) {
        if let State::HalfOpen { opened, .. } | State::Trial { opened } = self.state
            && sent >= opened
        {
            self.state = State::Closed { failures: 0 };
        }
    }

    /// A success's body ended whole: a closed breaker's count of failures starts over. An
    /// exchange that began before the breaker opened (a long stream) says nothing of the
    /// replica now, so it neither closes an open breaker nor cuts its cooldown short.
    pub fn on_served(&mut self) {
        if matches!(self.state, State::Closed { .. }) {
            self.state = State::Closed { failures: 0 };
        }
    }

    /// A live answer of the replica's liveness probe: an open breaker lets its trial request
    /// through at once, and that request's outcome closes or reopens it. The probe proves the
    /// replica's HTTP server alive, not that it answers chat completions (a replica whose
    /// answers time out answers `/live` all the same), so it closes nothing itself.
    pub fn end_cooldown(&mut self) {
        if let State::Open { since } = self.state {
            self.state = State::Trial { opened: since };
        }
    }

    /// The request `sent` then was dropped before its outcome came (its client left, or a
    /// shutdown cut it): it says nothing of the replica. If it was the trial, the next request
    /// is the trial, as the cooldown it waited out allows, instead of waiting out another.
    pub fn abandoned(&mut self, sent: Instant) {
        if let State::HalfOpen { probe_sent, opened } = self.state
            && probe_sent == sent
        {
            self.state = State::Trial { opened };
        }
    }

    /// A request `sent` then failed at `now`. One sent before the breaker opened (still
    /// failing as it tripped) says nothing of the replica now: it neither reopens a breaker
    /// whose trial is under way nor restarts an open one's cooldown.
    pub fn on_failure(&mut self, (sent, now): (Instant, Instant), settings: &BreakerSettings) {
        self.state = match self.state {
            State::Closed { failures } if failures.saturating_add(1) < settings.failure_threshold => {
                State::Closed { failures: failures + 1 }
            }
            State::Open { since } => State::Open { since },
            State::Trial { opened } | State::HalfOpen { opened, .. } if sent < opened => self.state,
            State::Closed { .. } | State::Trial { .. } | State::HalfOpen { .. } => State::Open { since: now },
        };
    }

    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Trial { .. } | State::HalfOpen { .. } => BreakerState::HalfOpen,
            State::Open { .. } => BreakerState::Open,
        }
    }
}

/// Consecutive failed probes that take a replica out (Envoy's `unhealthy_threshold` default).
pub const UNHEALTHY_AFTER_PROBES: u32 = 2;

/// A replica's active-probe verdict: out after [`UNHEALTHY_AFTER_PROBES`] consecutive failed
/// probes, back at the first one that succeeds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Probed {
    failures: u32,
}

impl Probed {
    pub fn down(&self) -> bool {
        self.failures >= UNHEALTHY_AFTER_PROBES
    }
}

/// A replica first seen: closed and up.
#[derive(Debug, Clone, Default)]
struct Replica {
    breaker: Breaker,
    probed: Probed,
    /// When it last answered a request (any answer that proves it alive).
    answered_at: Option<Instant>,
}

/// Where a relayed stream records its exchange's outcome on its shim replica's breaker once its
/// body ends: whole (the shim served it, an error event of the engine's included), or broken
/// under it (the shim's failure, or the network's; 1.6.1 says a worker's death in band).
#[derive(Debug)]
pub struct ShimExchange {
    settings: BreakerSettings,
    name: String,
    shared: Shared,
    sent: Instant,
}

impl ShimExchange {
    pub fn new(health: &ShimHealth, replica: &ShimReplica, sent: Instant) -> Self {
        let shared = Arc::clone(&health.of(replica).shared);
        Self { settings: health.settings, name: replica.name.clone(), shared, sent }
    }

    pub fn ended(&self, served: bool) {
        let replica = ReplicaHealth { settings: &self.settings, name: &self.name, shared: Cow::Borrowed(&self.shared) };
        replica.exchange_ended((self.sent, served));
    }
}

/// One replica's health, shared by the map and by the [`ShimReplica`]s that name it.
type Shared = Arc<Mutex<Replica>>;

/// Where a [`ShimReplica`] keeps its replica's health once it has looked it up: its requests
/// then reach it without the map, which a request would otherwise look up by name and URL, under
/// the map's lock, four times. Not part of what the replica is: any two are equal.
#[derive(Debug, Clone, Default)]
pub struct HealthSlot(OnceLock<Shared>);

impl PartialEq for HealthSlot {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for HealthSlot {}

/// The breakers and probe verdicts of every shim replica, by backend name and URL (the
/// operator's configuration names them, so a fast hash will do). A backend moved to another URL
/// on reload starts over there, closed and up, and whatever still concerns its old URL (a long
/// stream's end, a retry or fallback of a request routed before the reload, a probe sent before
/// it) concerns the old URL's entry, which goes once the configuration no longer names it
/// ([`Self::states`]); a request routed before then holds on to the entry it found, and what it
/// records there goes with it.
#[derive(Debug, Default)]
pub struct ShimHealth {
    settings: BreakerSettings,
    /// By name, then URL.
    replicas: Mutex<FastMap<String, Vec<(String, Shared)>>>,
}

impl ShimHealth {
    pub fn new(settings: BreakerSettings) -> Self {
        Self { settings, replicas: Mutex::default() }
    }

    /// The replica `name` at `url`, found in the map.
    pub fn at<'a>(&'a self, name: &'a str, url: &str) -> ReplicaHealth<'a> {
        ReplicaHealth { settings: &self.settings, name, shared: Cow::Owned(self.shared(name, url)) }
    }

    /// The replica `replica` names: found in the map the first time, then through the slot it
    /// keeps ([`HealthSlot`]).
    pub fn of<'a>(&'a self, replica: &'a ShimReplica) -> ReplicaHealth<'a> {
        let shared = replica.health.0.get_or_init(|| self.shared(&replica.name, &replica.url));
        ReplicaHealth { settings: &self.settings, name: &replica.name, shared: Cow::Borrowed(shared) }
    }

    /// Clears the probe verdicts of the replicas `probed` leaves out: a backend that left every
    /// pool is probed no more, and a verdict nothing renews would keep it out of unified
    /// routing for good. Its breaker, which its own requests renew, stands.
    pub fn clear_probes_except(&self, probed: impl Fn(&str) -> bool) {
        let replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        for (_, urls) in replicas.iter().filter(|(name, _)| !probed(name)) {
            for (_, replica) in urls {
                lock(replica).probed = Probed::default();
            }
        }
    }

    /// Every replica's state, for the gauge (a replica down by its probes reads as open);
    /// replicas whose (name, URL) `keep` leaves out are forgotten.
    pub fn states(&self, keep: impl Fn(&str, &str) -> bool) -> Vec<(String, BreakerState)> {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        replicas.retain(|name, urls| {
            urls.retain(|(url, _)| keep(name, url));
            !urls.is_empty()
        });
        let state = |r: &Shared| {
            let r = lock(r);
            if r.probed.down() { BreakerState::Open } else { r.breaker.state() }
        };
        replicas.iter().flat_map(|(name, urls)| urls.iter().map(|(_, r)| (name.clone(), state(r)))).collect()
    }

    /// The entry of the replica `name` at `url`, made if it has none.
    fn shared(&self, name: &str, url: &str) -> Shared {
        let mut replicas = self.replicas.lock().unwrap_or_else(PoisonError::into_inner);
        // Looked up by `&str` first: a name is allocated only for a replica not seen before.
        let urls = match replicas.get_mut(name) {
            Some(urls) => urls,
            None => replicas.entry(name.to_string()).or_default(),
        };
        if let Some((_, replica)) = urls.iter().find(|(at, _)| at == url) {
            return Arc::clone(replica);
        }
        // URLs a name had before reloads, which only requests routed before them still ask
        // about: the oldest goes first.
        if urls.len() >= MAX_URLS_PER_REPLICA {
            urls.remove(0);
        }
        let replica = Shared::default();
        urls.push((url.to_string(), Arc::clone(&replica)));
        replica
    }
}

fn lock(replica: &Shared) -> MutexGuard<'_, Replica> {
    replica.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One replica's breaker and probe verdict, as a request or a probe reaches it
/// ([`ShimHealth::at`], [`ShimHealth::of`]).
#[derive(Debug)]
pub struct ReplicaHealth<'a> {
    settings: &'a BreakerSettings,
    /// The backend's name, for the log.
    name: &'a str,
    shared: Cow<'a, Shared>,
}

impl ReplicaHealth<'_> {
    pub fn usable(&self, now: Instant) -> bool {
        self.with(|r, settings| !r.probed.down() && r.breaker.usable(now, settings))
    }

    pub fn admit(&self, now: Instant) -> bool {
        self.with(|r, settings| !r.probed.down() && r.breaker.admit(now, settings))
    }

    /// A request admitted at `sent` was dropped before its outcome came ([`Breaker::abandoned`]).
    pub fn abandoned(&self, sent: Instant) {
        self.with(|r, _| r.breaker.abandoned(sent));
    }

    /// A probe's outcome. A successful one also ends an open breaker's cooldown (see
    /// [`Breaker::end_cooldown`]).
    pub fn record_probe(&self, live: bool) {
        let name = self.name;
        self.with(|r, _| {
            let was_down = r.probed.down();
            if live {
                r.probed = Probed::default();
                r.breaker.end_cooldown();
            } else {
                r.probed.failures = r.probed.failures.saturating_add(1);
            }
            match (was_down, r.probed.down()) {
                (false, true) => tracing::warn!(backend = name, "shim replica failed its liveness probes; taken out"),
                (true, false) => tracing::info!(backend = name, "shim replica answers its liveness probe again"),
                _ => {}
            }
        });
    }

    /// A success's body ended: whole (`served`, [`Breaker::on_served`]: the replica answers,
    /// which [`Self::record_unanswered`] asks of the time since a request was sent), or broken
    /// under its head, the replica's failure.
    pub fn exchange_ended(&self, (sent, served): (Instant, bool)) {
        let now = Instant::now();
        if !served {
            return self.failed((sent, now));
        }
        self.with(|r, _| {
            r.answered_at = Some(now);
            r.breaker.on_served();
        });
    }

    /// A success answer's head arrived ([`Breaker::on_head`]); its body's end records the
    /// exchange's outcome.
    pub fn head_arrived(&self, (sent, now): (Instant, Instant)) {
        self.answering(now, |breaker| breaker.on_head(sent));
    }

    /// The replica answered at `now`, which `answer` tells its breaker.
    fn answering(&self, now: Instant, answer: impl FnOnce(&mut Breaker)) {
        let name = self.name;
        self.with(|r, _| {
            r.answered_at = Some(now);
            let before = r.breaker.state();
            answer(&mut r.breaker);
            if before != r.breaker.state() {
                tracing::info!(backend = name, ?before, "shim replica answered its trial request; breaker closed");
            }
        });
    }

    /// A request sent at `sent` got no response head in time: the replica's failure unless it
    /// answered another request since (then its chat path works, and the silence is the
    /// request's workers'). Whether it was counted as the replica's.
    pub fn record_unanswered(&self, sent: Instant, now: Instant) -> bool {
        let answered_since = self.with(|r, _| r.answered_at.is_some_and(|at| at >= sent));
        if !answered_since {
            self.failed((sent, now));
        }
        !answered_since
    }

    /// A whole answer other than a success ([`Breaker::on_answered`]).
    pub fn answered(&self, (sent, now): (Instant, Instant)) {
        self.answering(now, |breaker| breaker.on_answered(sent));
    }

    /// The replica failed a request `sent` then, at `now` (no connection, no answer, a
    /// gateway's, a body cut short).
    pub fn failed(&self, (sent, now): (Instant, Instant)) {
        let name = self.name;
        self.with(|r, settings| {
            let before = r.breaker.state();
            r.breaker.on_failure((sent, now), settings);
            let after = r.breaker.state();
            if before != after {
                tracing::warn!(backend = name, ?before, ?after, "shim replica circuit breaker changed state");
            }
        });
    }

    /// `f` on the replica, under its own lock.
    fn with<T>(&self, f: impl FnOnce(&mut Replica, &BreakerSettings) -> T) -> T {
        f(&mut lock(&self.shared), self.settings)
    }
}

/// URLs one backend's health is kept for at once: the configured one, and those earlier
/// configurations gave it while requests routed under them are still under way.
const MAX_URLS_PER_REPLICA: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: BreakerSettings = BreakerSettings { failure_threshold: 3, cooldown: Duration::from_secs(10) };

    fn failed(breaker: &mut Breaker, times: u32, now: Instant) {
        for _ in 0..times {
            breaker.on_failure((now, now), &SETTINGS);
        }
    }

    #[test]
    fn opens_after_the_threshold_of_consecutive_failures_only() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 2, now);
        breaker.on_answered(now);
        failed(&mut breaker, 2, now);
        assert_eq!(breaker.state(), BreakerState::Closed, "an answer in between resets the count");
        failed(&mut breaker, 1, now);
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(!breaker.admit(now + Duration::from_secs(9), &SETTINGS));
    }

    /// A trial whose client left before its outcome came hands the trial to the next request,
    /// which need not wait out another cooldown; any other request dropped so changes nothing.
    #[test]
    fn an_abandoned_trial_lets_the_next_request_be_the_trial() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 3, now);
        let trial = now + SETTINGS.cooldown;
        assert!(breaker.admit(trial, &SETTINGS), "the trial");
        let later = trial + Duration::from_secs(1);
        assert!(!breaker.usable(later, &SETTINGS), "a trial under way keeps the others out");
        breaker.abandoned(trial - Duration::from_millis(1));
        assert!(!breaker.usable(later, &SETTINGS), "another request's drop changes nothing");
        breaker.abandoned(trial);
        assert!(breaker.admit(later, &SETTINGS), "the next request is the trial");
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        breaker.on_head(later);
        assert_eq!(breaker.state(), BreakerState::Closed, "and its answer closes the breaker");

        // A closed breaker's count is not touched by a drop.
        failed(&mut breaker, 2, now);
        breaker.abandoned(now);
        failed(&mut breaker, 1, now);
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    /// A success's head closes a half-open breaker (its trial passed) but leaves a closed one's
    /// count to the exchange's end: answers cut under their heads still add up.
    #[test]
    fn a_heads_arrival_closes_a_trial_but_resets_no_count() {
        let now = Instant::now();
        let mut breaker = Breaker::default();
        failed(&mut breaker, 2, now);
        breaker.on_head(now);
        failed(&mut breaker, 1, now);
        assert_eq!(breaker.state(), BreakerState::Open, "three failures in a row, heads between");
        assert!(breaker.admit(now + SETTINGS.cooldown, &SETTINGS), "the trial");
        breaker.on_head(now - Duration::from_secs(1));
        assert_eq!(breaker.state(), BreakerState::HalfOpen, "a request sent before it opened says nothing");
        // A trial whose buffered answer took longer than a cooldown, replaced by a second trial
        // meanwhile, still closes it: it was sent after the breaker opened.
        assert!(breaker.admit(now + SETTINGS.cooldown * 2, &SETTINGS), "a second trial");
        breaker.on_head(now + SETTINGS.cooldown);
        assert_eq!(breaker.state(), BreakerState::Closed);

        // A long exchange ending whole after the breaker opened leaves it open, its cooldown
        // whole; ending whole while it is closed starts its count over.
        failed(&mut breaker, 3, now);
        breaker.on_served();
        assert_eq!(breaker.state(), BreakerState::Open, "served before it opened: says nothing now");
        assert!(!breaker.admit(now + Duration::from_secs(1), &SETTINGS));
        let mut breaker = Breaker::default();
        failed(&mut breaker, 2, now);
        breaker.on_served();
        failed(&mut breaker, 2, now);
        assert_eq!(breaker.state(), BreakerState::Closed, "the count started over");
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
        breaker.on_answered(later);
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
        breaker.on_failure((probe, probe), &SETTINGS);
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
        let just_before = now + SETTINGS.cooldown * 2 - Duration::from_millis(1);
        assert!(!breaker.admit(just_before, &SETTINGS), "the silent probe holds its place for a cooldown");
        assert!(breaker.admit(now + SETTINGS.cooldown * 2, &SETTINGS));
        assert!(!breaker.admit(now + SETTINGS.cooldown * 2, &SETTINGS), "one replacement, not a flood");
    }

    #[test]
    fn two_failed_probes_take_a_replica_out_and_one_live_probe_brings_it_back_for_one_trial_request() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        health.at("shim", "http://a").record_probe(false);
        assert!(health.at("shim", "http://a").usable(now), "one failed probe is not enough");
        health.at("shim", "http://a").record_probe(false);
        assert!(!health.at("shim", "http://a").usable(now));
        assert!(!health.at("shim", "http://a").admit(now + SETTINGS.cooldown * 10), "no breaker probe either");
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Open)]);
        for _ in 0..3 {
            health.at("shim", "http://a").failed((now, now));
        }
        health.at("shim", "http://a").record_probe(true);
        assert!(health.at("shim", "http://a").usable(now), "a live answer ends the open breaker's cooldown");
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::HalfOpen)]);
        // One trial request, not a flood: `/live` answers whatever the chat path does.
        assert!(health.at("shim", "http://a").admit(now));
        assert!(!health.at("shim", "http://a").admit(now), "the trial is in flight");
        health.at("shim", "http://a").answered((now, now));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Closed)]);
        // A failed trial opens it again, for a whole cooldown.
        for _ in 0..SETTINGS.failure_threshold {
            health.at("shim", "http://a").failed((now, now));
        }
        health.at("shim", "http://a").record_probe(true);
        assert!(health.at("shim", "http://a").admit(now));
        health.at("shim", "http://a").failed((now, now));
        assert!(!health.at("shim", "http://a").admit(now + SETTINGS.cooldown / 2));
        assert!(health.at("shim", "http://a").admit(now + SETTINGS.cooldown));
    }

    #[test]
    fn a_replica_no_longer_probed_loses_its_probe_verdict_but_not_its_breaker() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for name in ["pooled", "left"] {
            health.at(name, "http://a").record_probe(false);
            health.at(name, "http://a").record_probe(false);
        }
        health.clear_probes_except(|name| name == "pooled");
        assert!(!health.at("pooled", "http://a").usable(now), "still probed, still down");
        assert!(health.at("left", "http://a").usable(now), "out of every pool: its own requests decide");
        for _ in 0..3 {
            health.at("left", "http://a").failed((now, now));
        }
        health.clear_probes_except(|name| name == "pooled");
        assert!(!health.at("left", "http://a").usable(now), "its breaker stands");
    }

    /// Requests in flight as a breaker opens go on being answered: a refusal or a 500 of one of
    /// them closes the breaker no more than a success's body ending whole does. Only the trial
    /// request, sent after the cooldown, decides.
    #[test]
    fn an_answer_to_a_request_sent_before_the_breaker_opened_leaves_it_open() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for _ in 0..SETTINGS.failure_threshold {
            health.at("shim", "http://a").failed((now, now));
        }
        let sent_before = now - Duration::from_secs(1);
        health.at("shim", "http://a").answered((sent_before, now + Duration::from_secs(1)));
        assert!(!health.at("shim", "http://a").usable(now + Duration::from_secs(1)), "still cooling down");
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Open)]);
        let trial = now + SETTINGS.cooldown;
        assert!(health.at("shim", "http://a").admit(trial), "the trial");
        // Nor, once the trial is under way, does an older request decide for it.
        health.at("shim", "http://a").answered((sent_before, trial + Duration::from_millis(5)));
        health.at("shim", "http://a").head_arrived((sent_before, trial + Duration::from_millis(5)));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::HalfOpen)]);
        health.at("shim", "http://a").answered((trial, trial + Duration::from_millis(10)));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Closed)]);
    }

    /// A request sent while the replica was failing, whose failure comes in after its breaker
    /// opened, says nothing of the replica now: the trial under way decides.
    #[test]
    fn a_failure_of_a_request_sent_before_the_breaker_opened_leaves_its_trial_to_decide() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for _ in 0..SETTINGS.failure_threshold {
            health.at("shim", "http://a").failed((now, now));
        }
        let trial = now + SETTINGS.cooldown;
        assert!(health.at("shim", "http://a").admit(trial));
        let sent_before = now - Duration::from_secs(1);
        assert!(health.at("shim", "http://a").record_unanswered(sent_before, trial + Duration::from_millis(1)));
        health.at("shim", "http://a").exchange_ended((sent_before, false));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::HalfOpen)]);
        health.at("shim", "http://a").head_arrived((trial, trial + Duration::from_millis(2)));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Closed)]);
        // The trial's own failure reopens it.
        for _ in 0..SETTINGS.failure_threshold {
            health.at("shim", "http://a").failed((trial, trial));
        }
        let second = trial + SETTINGS.cooldown;
        assert!(health.at("shim", "http://a").admit(second));
        health.at("shim", "http://a").failed((second, second + Duration::from_millis(1)));
        assert_eq!(health.states(|_, _| true), vec![("shim".to_string(), BreakerState::Open)]);
    }

    /// After a reload moved a backend, whatever still concerns its old URL (a long stream
    /// ending, a probe sent before the reload, a request routed before it asking to be let
    /// through) concerns the old URL's entry, never the new one's.
    #[test]
    fn what_concerns_a_replicas_old_url_leaves_its_new_one_alone() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        assert!(health.at("shim", "http://b").usable(now), "moved to b");
        for _ in 0..SETTINGS.failure_threshold {
            health.at("shim", "http://b").failed((now, now));
        }
        health.at("shim", "http://a").exchange_ended((now, true));
        health.at("shim", "http://a").record_probe(true);
        health.at("shim", "http://a").answered((now, now));
        assert!(health.at("shim", "http://a").admit(now), "a request routed before the reload");
        assert!(!health.at("shim", "http://b").usable(now), "b's breaker stands open");
        health.at("shim", "http://b").record_probe(false);
        health.at("shim", "http://b").record_probe(false);
        health.at("shim", "http://a").record_probe(true);
        assert!(!health.at("shim", "http://b").usable(now + SETTINGS.cooldown), "b's failed probes stand");
        // Once the configuration names only b, a's entry goes.
        let current = |_: &str, url: &str| url == "http://b";
        assert_eq!(health.states(current), vec![("shim".to_string(), BreakerState::Open)]);
        assert_eq!(health.states(|_, _| true).len(), 1, "a was forgotten");
    }

    #[test]
    fn a_changed_url_starts_a_closed_breaker() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for _ in 0..3 {
            health.at("shim", "http://a").failed((now, now));
        }
        assert!(!health.at("shim", "http://a").usable(now));
        assert!(health.at("shim", "http://b").usable(now));
        let moved = health.states(|_, url| url == "http://b");
        assert_eq!(moved, vec![("shim".to_string(), BreakerState::Closed)]);
        assert!(health.states(|_, _| false).is_empty());
    }

    /// A name keeps the health of a few URLs at most, however many reloads moved it.
    #[test]
    fn a_backend_moved_again_and_again_keeps_a_few_urls_health() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        for n in 0..100 {
            assert!(health.at("shim", &format!("http://{n}")).usable(now));
        }
        assert_eq!(health.states(|_, _| true).len(), MAX_URLS_PER_REPLICA);
    }

    /// A replica's requests reach its health through the slot it keeps, the same entry its name
    /// and URL find in the map: what either records, the other sees. Once a reload has dropped
    /// its URL, what a request routed before then records stays with the entry it held.
    #[test]
    fn a_replicas_slot_and_its_name_reach_the_same_breaker() {
        let health = ShimHealth::new(SETTINGS);
        let now = Instant::now();
        let replica = ShimReplica::for_tests("shim", "http://a");
        for _ in 0..SETTINGS.failure_threshold {
            health.of(&replica).failed((now, now));
        }
        assert!(!health.at("shim", "http://a").usable(now), "the slot's failures opened the breaker by name");
        health.at("shim", "http://a").record_probe(true);
        assert!(health.of(&replica).admit(now), "a live probe by name ended the cooldown the slot reads");
        assert!(!health.of(&replica.clone()).admit(now), "the trial is taken");

        // The configuration moves the backend: the old URL's entry goes from the map.
        health.states(|_, url| url == "http://b");
        assert!(health.at("shim", "http://a").admit(now), "a new entry for the old URL, closed");
        for _ in 0..SETTINGS.failure_threshold {
            health.of(&replica).failed((now, now));
        }
        assert!(health.at("shim", "http://a").usable(now), "the request routed before kept its own");
        assert!(health.at("shim", "http://b").usable(now));
    }
}
