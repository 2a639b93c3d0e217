//! Subscription supervisors: one actor task per feed (kv_metrics, kv-events) that follows the
//! registry's generations and runs one subscription task per admitted publisher of its topic.
//!
//! * Every generation: the feed's live gate is replaced (`Feed::set_live`), departed or
//!   changed publishers' tasks are cancelled together (each gets [`STOP_GRACE`], then is
//!   aborted) and what they held dropped (`Feed::departed`), and new publishers' tasks start.
//! * Admission: at most [`MAX_LOAD_SUBSCRIPTIONS`] run, every worker's first publisher before
//!   any worker's second (the lowest ids first within a turn), so a fleet cannot exhaust the
//!   process's file descriptors, nor one worker's hundreds of channels take the others' places; when some go, the next are admitted.
//!   While publishers wait beyond the cap, an admitted one that has never connected within
//!   [`YIELD_AFTER`] gives its place to the next (its record may name an address that cannot
//!   be reached); from then on it is admitted after every other, when there is room, until a
//!   session with it succeeds.
//! * Reload: `max_staleness` applies at once; a `transport` or `direct_allow_cidrs` change
//!   restarts only the subscriptions (each drops its samples when it connects again).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use continuum_proto::model::WorkerKey;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::backoff::{Backoff, RECONNECT_INITIAL, RECONNECT_MAX, STABLE_SESSION};
use super::feed::LoadFeed;
use super::status::SubscriptionStatus;
use super::store::{LoadStore, SharedLoadStore};
use super::subscription::{self, DialPolicy, Feed, SessionEnds, SubscriptionContext};
use super::zmtp::ZmtpLimits;
use crate::config::{LoadConfig, LoadTransport};
use crate::discovery::{Fleet, Publisher, Topic};
use crate::fleet::{FleetPublisher, LOAD_COALESCE_WINDOW, LoadCoalescer};
use crate::metrics::Metrics;
use crate::sources::Generation;

/// Most kv_metrics subscriptions (sockets) at once.
pub const MAX_LOAD_SUBSCRIPTIONS: usize = 1024;
/// How long a cancelled subscription may take to end before it is aborted.
pub const STOP_GRACE: Duration = Duration::from_secs(5);
/// How long an admitted subscription may go without a first session while others wait.
pub const YIELD_AFTER: Duration = Duration::from_secs(60);

/// Knobs that are constants in production and shorter in tests.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub limits: ZmtpLimits,
    pub max_subscriptions: usize,
    pub stop_grace: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub stable_session: Duration,
    pub yield_after: Duration,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            limits: ZmtpLimits::KV_METRICS,
            max_subscriptions: MAX_LOAD_SUBSCRIPTIONS,
            stop_grace: STOP_GRACE,
            backoff_initial: RECONNECT_INITIAL,
            backoff_max: RECONNECT_MAX,
            stable_session: STABLE_SESSION,
            yield_after: YIELD_AFTER,
        }
    }
}

/// The running subscriptions, for the admin API.
pub type Subscriptions = Arc<[Arc<SubscriptionStatus>]>;

/// What the admin API reads: the store and the running subscriptions.
#[derive(Debug, Clone)]
pub struct LoadView {
    pub store: SharedLoadStore,
    subscriptions: watch::Receiver<Subscriptions>,
}

impl LoadView {
    pub fn subscriptions(&self) -> Subscriptions {
        Arc::clone(&self.subscriptions.borrow())
    }
}

/// The kv_metrics subscriptions and the store they fill.
#[derive(Debug)]
pub struct LoadSupervisor {
    subscriptions: Supervisor,
    store: SharedLoadStore,
}

impl LoadSupervisor {
    /// Starts following `registry`; samples go to `publisher` through a coalescer.
    pub fn start(
        config: &LoadConfig,
        options: LoadOptions,
        registry: watch::Receiver<Arc<Generation>>,
        publisher: FleetPublisher,
        metrics: &Metrics,
        cancel: CancellationToken,
    ) -> Self {
        let mut store = LoadStore::new(Some(metrics.load_gauges.clone()));
        store.set_max_staleness(config.max_staleness);
        let store = SharedLoadStore::new(store);
        let feed = LoadFeed {
            store: store.clone(),
            sink: LoadCoalescer::spawn(publisher, LOAD_COALESCE_WINDOW, cancel.clone()),
            events: metrics.load_events.clone(),
            gauge: metrics.load_subscriptions.clone(),
            left_out: metrics.subscriptions_left_out.with_label_values(&[Topic::KvMetrics.as_str()]),
            session_ends: SessionEnds::new(&metrics.subscription_sessions_ended, Topic::KvMetrics),
            unsent: Mutex::default(),
        };
        let subscriptions = Supervisor::start(feed, dial_policy(config), options, registry, cancel);
        Self { subscriptions, store }
    }

    /// Applies a reloaded `dynamo.load`: staleness at once, a dial policy change restarts
    /// the subscriptions (each drops its samples when it connects again).
    pub fn reload(&self, config: &LoadConfig) {
        self.store.lock().set_max_staleness(config.max_staleness);
        self.subscriptions.set_policy(dial_policy(config));
    }

    pub fn view(&self) -> LoadView {
        LoadView { store: self.store.clone(), subscriptions: self.subscriptions.statuses() }
    }

    /// Stops every subscription (concurrently, with the grace) and the supervisor.
    pub async fn stop(&mut self) {
        self.subscriptions.stop().await;
    }
}

pub fn dial_policy(config: &LoadConfig) -> DialPolicy {
    DialPolicy { transport: config.transport, allow: config.allow_cidrs().map(Arc::from) }
}

/// One actor task running a subscription per admitted publisher of a feed's topic.
#[derive(Debug)]
pub struct Supervisor {
    policy: watch::Sender<DialPolicy>,
    statuses: watch::Receiver<Subscriptions>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Supervisor {
    pub fn start<F: Feed>(
        feed: F,
        policy: DialPolicy,
        options: LoadOptions,
        registry: watch::Receiver<Arc<Generation>>,
        cancel: CancellationToken,
    ) -> Self {
        let ctx = Arc::new(SubscriptionContext {
            feed,
            limits: options.limits,
            backoff_initial: options.backoff_initial,
            backoff_max: options.backoff_max,
            stable_session: options.stable_session,
        });
        let (statuses_tx, statuses) = watch::channel(Subscriptions::from(Vec::new()));
        let (policy_tx, policy_rx) = watch::channel(policy.clone());
        let starts = Starts::new(&options);
        let actor = Actor {
            ctx,
            options,
            policy,
            running: BTreeMap::new(),
            statuses: statuses_tx,
            over_cap: 0,
            waiting: 0,
            benched: BTreeSet::new(),
            starts,
        };
        let task = tokio::spawn(actor.run(registry, policy_rx, cancel.clone()));
        Self { policy: policy_tx, statuses, cancel, task: Some(task) }
    }

    /// A changed dial policy restarts every subscription under it.
    pub fn set_policy(&self, new: DialPolicy) {
        self.policy.send_if_modified(|held| {
            let changed = *held != new;
            *held = new;
            changed
        });
    }

    pub fn statuses(&self) -> watch::Receiver<Subscriptions> {
        self.statuses.clone()
    }

    pub async fn stop(&mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// Ascending publisher id (then namespace), the admission order.
type AdmissionKey = (u64, Arc<str>);

struct Running {
    publisher: Publisher,
    status: Arc<SubscriptionStatus>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    since: Instant,
}

struct Actor<F> {
    ctx: Arc<SubscriptionContext<F>>,
    options: LoadOptions,
    policy: DialPolicy,
    running: BTreeMap<AdmissionKey, Running>,
    statuses: watch::Sender<Subscriptions>,
    /// Publishers left out by the cap at the last reconcile, to log changes only.
    over_cap: usize,
    /// Of those, the ones not benched: how many places unreachable publishers may yield.
    waiting: usize,
    /// Publishers that yielded their place (no session while others waited): admitted after
    /// every other until a session with one succeeds.
    benched: BTreeSet<AdmissionKey>,
    starts: Starts,
}

/// When each publisher's subscription last started, and the backoff its next start waits if
/// that comes within a stable session's length: a record that keeps changing (each change
/// stops the subscription and starts another) must not make the router redial at the rate of
/// the changes, which a task's own backoff, new with each task, would allow. Pure: time is an
/// argument.
struct Starts {
    by_key: BTreeMap<AdmissionKey, Start>,
    /// The backoff's floor and ceiling, and the length after which a start is forgotten.
    initial: Duration,
    max: Duration,
    stable: Duration,
}

struct Start {
    at: Instant,
    backoff: Backoff,
}

/// Starts remembered at most; past it the oldest is forgotten for a new one (its publisher's
/// next restart waits no backoff), never all of them: a record that flaps keeps its backoff
/// however many others come and go.
const MAX_REMEMBERED_STARTS: usize = 4 * MAX_LOAD_SUBSCRIPTIONS;

impl Starts {
    fn new(options: &LoadOptions) -> Self {
        let (initial, max, stable) = (options.backoff_initial, options.backoff_max, options.stable_session);
        Self { by_key: BTreeMap::new(), initial, max, stable }
    }

    /// How long a subscription starting for `key` at `now` waits before it dials: nothing at
    /// first, or a stable session's length after its last start; the next backoff delay
    /// otherwise.
    fn wait(&mut self, key: &AdmissionKey, now: Instant) -> Duration {
        let stable = self.stable;
        self.by_key.retain(|_, start| now.saturating_duration_since(start.at) < stable);
        if self.by_key.len() >= MAX_REMEMBERED_STARTS && !self.by_key.contains_key(key) {
            let oldest = self.by_key.iter().min_by_key(|(_, start)| start.at).map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.by_key.remove(&oldest);
            }
        }
        match self.by_key.get_mut(key) {
            Some(start) => {
                start.at = now;
                start.backoff.next_delay()
            }
            None => {
                let backoff = Backoff::new(self.initial, self.max);
                self.by_key.insert(key.clone(), Start { at: now, backoff });
                Duration::ZERO
            }
        }
    }
}

impl<F: Feed> Actor<F> {
    async fn run(
        mut self,
        mut registry: watch::Receiver<Arc<Generation>>,
        mut policy: watch::Receiver<DialPolicy>,
        cancel: CancellationToken,
    ) {
        // A closed channel is ready at every turn: its branch is left out from then on, or the
        // loop would spin (the policy's sender goes with a supervisor dropped before `stop`).
        let (mut registry_open, mut policy_open) = (true, true);
        let mut review = tokio::time::interval((self.options.yield_after / 4).max(Duration::from_millis(10)));
        review.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let generation = Arc::clone(&registry.borrow_and_update());
            self.reconcile(&generation).await;
            loop {
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => {
                        let all = std::mem::take(&mut self.running).into_values().collect();
                        stop_all(all, self.options.stop_grace).await;
                        // Nobody is left out once nobody subscribes: a later actor for the same
                        // family writes the gauge only when its count changes from zero.
                        self.ctx.feed.left_out().set(0);
                        return;
                    }
                    _ = review.tick(), if self.waiting > 0 => {
                        if self.bench_unreachable(Instant::now()) {
                            self.reconcile(&generation).await;
                        }
                    }
                    changed = policy.changed(), if policy_open => {
                        policy_open = changed.is_ok();
                        if policy_open {
                            let new = policy.borrow_and_update().clone();
                            // The fleet as it stands now: one reload may change both, and the
                            // publishers it removed must not be dialled again under the new policy.
                            let current = Arc::clone(&registry.borrow_and_update());
                            self.apply_policy(new, &current).await;
                            break;
                        }
                    }
                    changed = registry.changed(), if registry_open => {
                        registry_open = changed.is_ok();
                        if registry_open { break; }
                    }
                }
            }
        }
    }

    async fn reconcile(&mut self, generation: &Generation) {
        let fleet = &generation.fleet;
        self.ctx.feed.set_live(generation).await;
        let admitted = self.admitted(fleet);
        self.stop(&admitted, false).await;
        for (key, publisher) in admitted {
            if !self.running.contains_key(&key) {
                let first_wait = self.starts.wait(&key, Instant::now());
                let running = self.spawn(publisher.clone(), first_wait);
                self.running.insert(key, running);
            }
        }
        self.publish_statuses();
    }

    /// Stops the subscriptions `admitted` no longer holds as they run, or with `everything`
    /// every one. Those whose publisher is not admitted depart (their samples and ranks go);
    /// the rest are for the caller to start again.
    async fn stop(&mut self, admitted: &BTreeMap<AdmissionKey, &Publisher>, everything: bool) {
        let gone = |key: &AdmissionKey, running: &Running| admitted.get(key).is_none_or(|p| **p != running.publisher);
        let (stopping, kept): (BTreeMap<_, _>, BTreeMap<_, _>) =
            std::mem::take(&mut self.running).into_iter().partition(|(key, running)| everything || gone(key, running));
        self.running = kept;
        let departed: Vec<Publisher> = stopping
            .iter()
            .filter(|(key, running)| gone(key, running))
            .map(|(_, running)| running.publisher.clone())
            .collect();
        stop_all(stopping.into_values().collect(), self.options.stop_grace).await;
        for publisher in departed {
            self.ctx.feed.departed(&publisher).await;
        }
    }

    /// While publishers wait beyond the cap, benches the admitted ones that have not had a
    /// session within [`LoadOptions::yield_after`], at most one per waiting publisher not
    /// benched itself; whether it benched any.
    fn bench_unreachable(&mut self, now: Instant) -> bool {
        let yield_after = self.options.yield_after;
        let stuck: Vec<AdmissionKey> = self
            .running
            .iter()
            .filter(|(key, r)| {
                !self.benched.contains(*key)
                    && r.status.sessions() == 0
                    && now.saturating_duration_since(r.since) >= yield_after
            })
            .map(|(key, _)| key.clone())
            .take(self.waiting)
            .collect();
        for key in &stuck {
            tracing::warn!(
                publisher_id = key.0,
                namespace = %key.1,
                topic = self.ctx.feed.topic().as_str(),
                "no session with this publisher within {yield_after:?} while others wait beyond the subscription cap; \
                 giving its place to the next"
            );
            self.benched.insert(key.clone());
        }
        !stuck.is_empty()
    }

    /// The feed's publishers to run, at most the cap: the lowest ids first, those benched last.
    fn admitted<'a>(&mut self, fleet: &'a Fleet) -> BTreeMap<AdmissionKey, &'a Publisher> {
        let topic = self.ctx.feed.topic();
        // Only the channels of workers in the fleet: every message of any other would be refused
        // after it was read, and reading it would take its part of the large-message budget
        // the fleet's workers share. A channel whose worker registers later is dialled then.
        let speaks_for_a_worker = |p: &Publisher| p.worker.as_ref().is_some_and(|key| fleet.worker(key).is_some());
        let all: BTreeMap<AdmissionKey, &Publisher> = fleet
            .publishers
            .iter()
            .filter(|p| p.topic == topic && speaks_for_a_worker(p))
            .map(|p| ((p.publisher_id, p.namespace.clone()), p))
            .collect();
        // A publisher benched stays so while it is in the fleet and no session with it succeeded.
        let running = &self.running;
        self.benched.retain(|key| all.contains_key(key) && running.get(key).is_none_or(|r| r.status.sessions() == 0));
        let over_cap = all.len().saturating_sub(self.options.max_subscriptions);
        if over_cap != self.over_cap {
            self.ctx.feed.left_out().set(i64::try_from(over_cap).unwrap_or(i64::MAX));
            self.over_cap = over_cap;
            if over_cap > 0 {
                let cap = self.options.max_subscriptions;
                tracing::warn!(
                    cap,
                    left_out = over_cap,
                    topic = topic.as_str(),
                    "more publishers than subscriptions allowed; the channels a worker has beyond those of others, then the highest publisher ids, are not subscribed"
                );
            }
        }
        // Stable: ascending ids among the unbenched, then among the benched; within each, the
        // workers taken in turn: every worker's first publisher before any worker's second, so
        // that one registering hundreds of channels under low ids cannot take the places of
        // the rest of the fleet.
        let mut turns: HashMap<&WorkerKey, usize> = HashMap::new();
        let mut order: Vec<(AdmissionKey, &Publisher, usize)> = all
            .into_iter()
            .map(|(key, publisher)| {
                let turn = publisher.worker.as_ref().map_or(0, |worker| {
                    let taken = turns.entry(worker).or_default();
                    *taken += 1;
                    *taken
                });
                (key, publisher, turn)
            })
            .collect();
        order.sort_by_key(|(key, _, turn)| (self.benched.contains(key), *turn));
        let cap = self.options.max_subscriptions;
        self.waiting = order.iter().skip(cap).filter(|(key, ..)| !self.benched.contains(key)).count();
        order.into_iter().take(cap).map(|(key, publisher, _)| (key, publisher)).collect()
    }

    async fn apply_policy(&mut self, new: DialPolicy, generation: &Generation) {
        if new == self.policy {
            return;
        }
        self.policy = new;
        let topic = self.ctx.feed.topic().as_str();
        tracing::info!(transport = ?self.policy.transport, topic, "restarting subscriptions under the new dial policy");
        // The same reload may have removed publishers: those depart, as a fleet change alone
        // would have made them; the rest restart.
        let admitted = self.admitted(&generation.fleet);
        self.stop(&admitted, true).await;
        self.reconcile(generation).await;
    }

    fn spawn(&self, publisher: Publisher, first_wait: Duration) -> Running {
        let transport: LoadTransport = self.policy.transport;
        let status = Arc::new(SubscriptionStatus::new(
            self.ctx.feed.topic().as_str(),
            publisher.key(),
            publisher.component.clone(),
            transport,
            self.ctx.feed.gauge().clone(),
        ));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(subscription::run(
            Arc::clone(&self.ctx),
            publisher.clone(),
            self.policy.clone(),
            Arc::clone(&status),
            (first_wait, cancel.clone()),
        ));
        Running { publisher, status, cancel, task, since: Instant::now() }
    }

    fn publish_statuses(&self) {
        let statuses: Vec<Arc<SubscriptionStatus>> = self.running.values().map(|r| Arc::clone(&r.status)).collect();
        self.statuses.send_replace(Subscriptions::from(statuses));
    }
}

/// Cancels every subscription at once and waits for all of them, aborting any that takes
/// longer than `grace`.
async fn stop_all(subscriptions: Vec<Running>, grace: Duration) {
    for running in &subscriptions {
        running.cancel.cancel();
    }
    futures::future::join_all(subscriptions.into_iter().map(|running| async move {
        let mut task = running.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            tracing::warn!(publisher = %running.status.publisher, "subscription did not stop within {grace:?}; aborting it");
            task.abort();
            let _ = task.await;
        }
    }))
    .await;
}

#[cfg(test)]
mod tests;
