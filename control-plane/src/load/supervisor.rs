//! The load supervisor: one actor task that follows the registry's generations and runs one
//! subscription task per admitted kv_metrics publisher.
//!
//! * Every generation: the store's live gate is replaced (`set_live_and_retain`), departed or
//!   changed publishers' tasks are cancelled together (each gets [`STOP_GRACE`], then is
//!   aborted) and their held samples dropped, and new publishers' tasks start.
//! * Admission: at most [`MAX_LOAD_SUBSCRIPTIONS`] run, the lowest publisher ids first, so a
//!   fleet cannot exhaust the process's file descriptors; when some go, the next are admitted.
//! * Reload: `max_staleness` applies at once; a `transport` or `direct_allow_cidrs` change
//!   restarts only the subscriptions (each drops its samples when it connects again).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use continuum_proto::model::WorkerKey;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::backoff::{RECONNECT_INITIAL, RECONNECT_MAX, STABLE_SESSION};
use super::decode::KV_METRICS_TOPIC;
use super::status::SubscriptionStatus;
use super::store::{LoadStore, SharedLoadStore};
use super::subscription::{self, DialPolicy, SubscriptionContext};
use super::zmtp::ZmtpLimits;
use crate::config::{LoadConfig, LoadTransport};
use crate::discovery::{Fleet, Publisher, PublisherKey, Topic};
use crate::fleet::{FleetPublisher, LOAD_COALESCE_WINDOW, LoadCoalescer};
use crate::metrics::Metrics;
use crate::sources::Generation;

/// Most kv_metrics subscriptions (sockets) at once.
pub const MAX_LOAD_SUBSCRIPTIONS: usize = 1024;
/// How long a cancelled subscription may take to end before it is aborted.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Knobs that are constants in production and shorter in tests.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub limits: ZmtpLimits,
    pub max_subscriptions: usize,
    pub stop_grace: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub stable_session: Duration,
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
        }
    }
}

/// The reloadable part of `dynamo.load`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Settings {
    policy: DialPolicy,
    max_staleness: Duration,
}

impl From<&LoadConfig> for Settings {
    fn from(config: &LoadConfig) -> Self {
        let allow = config.allow_cidrs().map(Arc::from);
        Self { policy: DialPolicy { transport: config.transport, allow }, max_staleness: config.max_staleness }
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

#[derive(Debug)]
pub struct LoadSupervisor {
    settings: watch::Sender<Settings>,
    view: LoadView,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
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
        let settings = Settings::from(config);
        let mut store = LoadStore::new(Some(metrics.load_gauges.clone()));
        store.set_max_staleness(settings.max_staleness);
        let store = SharedLoadStore::new(store);
        let ctx = Arc::new(SubscriptionContext {
            store: store.clone(),
            sink: LoadCoalescer::spawn(publisher, LOAD_COALESCE_WINDOW, cancel.clone()),
            events: metrics.load_events.clone(),
            limits: options.limits,
            backoff_initial: options.backoff_initial,
            backoff_max: options.backoff_max,
            stable_session: options.stable_session,
        });
        let (statuses, subscriptions) = watch::channel(Subscriptions::from(Vec::new()));
        let (settings_tx, settings_rx) = watch::channel(settings.clone());
        let actor = Actor {
            ctx,
            options,
            settings,
            gauge: metrics.load_subscriptions.clone(),
            running: BTreeMap::new(),
            statuses,
            over_cap: 0,
        };
        let task = tokio::spawn(actor.run(registry, settings_rx, cancel.clone()));
        Self { settings: settings_tx, view: LoadView { store, subscriptions }, cancel, task: Some(task) }
    }

    /// Applies a reloaded `dynamo.load`.
    pub fn reload(&self, config: &LoadConfig) {
        let new = Settings::from(config);
        self.settings.send_if_modified(|held| {
            let changed = *held != new;
            *held = new;
            changed
        });
    }

    pub fn view(&self) -> LoadView {
        self.view.clone()
    }

    /// Stops every subscription (concurrently, with the grace) and the supervisor.
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
}

struct Actor {
    ctx: Arc<SubscriptionContext>,
    options: LoadOptions,
    settings: Settings,
    gauge: prometheus::IntGaugeVec,
    running: BTreeMap<AdmissionKey, Running>,
    statuses: watch::Sender<Subscriptions>,
    /// Publishers left out by the cap at the last reconcile, to log changes only.
    over_cap: usize,
}

impl Actor {
    async fn run(
        mut self,
        mut registry: watch::Receiver<Arc<Generation>>,
        mut settings: watch::Receiver<Settings>,
        cancel: CancellationToken,
    ) {
        let mut registry_open = true;
        loop {
            let generation = Arc::clone(&registry.borrow_and_update());
            self.reconcile(&generation.fleet).await;
            loop {
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => {
                        let all = std::mem::take(&mut self.running).into_values().collect();
                        stop_all(all, self.options.stop_grace).await;
                        return;
                    }
                    changed = settings.changed() => {
                        if changed.is_ok() {
                            let new = settings.borrow_and_update().clone();
                            self.apply_settings(new, &generation.fleet).await;
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

    async fn reconcile(&mut self, fleet: &Fleet) {
        let evicted = self.ctx.store.lock().set_live_and_retain(live_ranks(fleet));
        self.ctx.sink.remove(evicted).await;
        let admitted = self.admitted(fleet);
        let stale: Vec<AdmissionKey> = self
            .running
            .iter()
            .filter(|(key, running)| admitted.get(*key).is_none_or(|p| **p != running.publisher))
            .map(|(key, _)| key.clone())
            .collect();
        let stopping: Vec<Running> = stale.iter().filter_map(|key| self.running.remove(key)).collect();
        let departed: Vec<PublisherKey> = stopping.iter().map(|r| r.status.publisher.clone()).collect();
        stop_all(stopping, self.options.stop_grace).await;
        for publisher in departed {
            let dropped = self.ctx.store.lock().drop_publisher(&publisher);
            self.ctx.sink.remove(dropped).await;
        }
        for (key, publisher) in admitted {
            if !self.running.contains_key(&key) {
                let running = self.spawn(publisher.clone());
                self.running.insert(key, running);
            }
        }
        self.publish_statuses();
    }

    /// The kv_metrics publishers to run, lowest ids first, at most the cap.
    fn admitted<'a>(&mut self, fleet: &'a Fleet) -> BTreeMap<AdmissionKey, &'a Publisher> {
        let all: BTreeMap<AdmissionKey, &Publisher> = fleet
            .publishers
            .iter()
            .filter(|p| p.topic == Topic::KvMetrics)
            .map(|p| ((p.publisher_id, p.namespace.clone()), p))
            .collect();
        let over_cap = all.len().saturating_sub(self.options.max_subscriptions);
        if over_cap != self.over_cap {
            self.over_cap = over_cap;
            if over_cap > 0 {
                let cap = self.options.max_subscriptions;
                tracing::warn!(
                    cap,
                    left_out = over_cap,
                    "more kv_metrics publishers than subscriptions allowed; the highest publisher ids read as quiet"
                );
            }
        }
        all.into_iter().take(self.options.max_subscriptions).collect()
    }

    async fn apply_settings(&mut self, new: Settings, fleet: &Fleet) {
        if new.max_staleness != self.settings.max_staleness {
            self.ctx.store.lock().set_max_staleness(new.max_staleness);
        }
        let restart = new.policy != self.settings.policy;
        self.settings = new;
        if restart {
            tracing::info!(transport = ?self.settings.policy.transport, "restarting kv_metrics subscriptions under the new dial policy");
            let all = std::mem::take(&mut self.running).into_values().collect();
            stop_all(all, self.options.stop_grace).await;
            self.reconcile(fleet).await;
        }
    }

    fn spawn(&self, publisher: Publisher) -> Running {
        let key = PublisherKey { namespace: publisher.namespace.clone(), publisher_id: publisher.publisher_id };
        let transport: LoadTransport = self.settings.policy.transport;
        let status = Arc::new(SubscriptionStatus::new(
            KV_METRICS_TOPIC,
            key,
            publisher.component.clone(),
            transport,
            self.gauge.clone(),
        ));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(subscription::run(
            Arc::clone(&self.ctx),
            publisher.clone(),
            self.settings.policy.clone(),
            Arc::clone(&status),
            cancel.clone(),
        ));
        Running { publisher, status, cancel, task }
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
            tracing::warn!(publisher = %running.status.publisher, "kv_metrics subscription did not stop within {grace:?}; aborting it");
            task.abort();
            let _ = task.await;
        }
    }))
    .await;
}

/// The ranks each discovered worker serves: the store's admission gate.
fn live_ranks(fleet: &Fleet) -> HashMap<WorkerKey, Range<u32>> {
    fleet
        .workers
        .iter()
        .map(|w| {
            let start = w.worker.dp_start_rank;
            (w.worker.key.clone(), start..start.saturating_add(w.worker.dp_size.max(1)))
        })
        .collect()
}

#[cfg(test)]
mod tests;
