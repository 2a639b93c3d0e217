//! The KV side of the control plane at run time: kv-events subscriptions feeding the shared
//! index while `dynamo.kv.enabled`, a sweeper that drops publishers down past
//! [`KV_EVENTS_STALE_AFTER`] and exports the index's size, and the [`KvHandle`] the Fleet
//! service answers `FindMatches` from.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use continuum_kv_index::{Limits, Matches};
use prometheus::IntGaugeVec;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::feed::{KvFeed, SharedKvIndexer};
use super::indexer::{KV_EVENTS_STALE_AFTER, KvIndexer};
use crate::config::Config;
use crate::load::zmtp::ZmtpLimits;
use crate::load::{LoadOptions, Subscriptions, Supervisor, dial_policy};
use crate::metrics::Metrics;
use crate::sources::Generation;

/// How often stale publishers are looked for and the index gauges refreshed.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Most block hashes one `FindMatches` call may carry: a 1,048,576-token prompt (the render
/// cap) in 16-token blocks, the smallest block size.
pub const MAX_FIND_MATCHES_HASHES: usize = 65_536;

/// What `FindMatches` reads: the index, when the KV term is on.
#[derive(Debug, Clone, Default)]
pub struct KvHandle {
    indexer: SharedKvIndexer,
    enabled: Arc<AtomicBool>,
}

impl KvHandle {
    /// Each rank's contiguous prefix overlap, or `None` while `dynamo.kv.enabled` is false.
    pub fn find_matches(&self, block_hashes: &[u64]) -> Option<Matches> {
        self.enabled.load(Ordering::Relaxed).then(|| self.indexer.read().find_matches(block_hashes))
    }
}

/// Runs the kv-events subscriptions while `dynamo.kv.enabled` and keeps the index tidy.
#[derive(Debug)]
pub struct KvSupervisor {
    handle: KvHandle,
    feed_parts: FeedParts,
    subscriptions: Option<Supervisor>,
    registry: watch::Receiver<Arc<Generation>>,
    options: LoadOptions,
    cancel: CancellationToken,
    sweeper: Option<JoinHandle<()>>,
}

/// What a fresh set of subscriptions is built from.
#[derive(Debug, Clone)]
struct FeedParts {
    events: prometheus::IntCounterVec,
    gauge: IntGaugeVec,
}

/// The subscription knobs for kv-events: the load defaults with the kv-events frame limits.
pub fn kv_options() -> LoadOptions {
    LoadOptions { limits: ZmtpLimits::KV_EVENTS, ..LoadOptions::default() }
}

impl KvSupervisor {
    pub fn start(
        config: &Config,
        options: LoadOptions,
        registry: watch::Receiver<Arc<Generation>>,
        metrics: &Metrics,
        cancel: CancellationToken,
    ) -> Self {
        let handle =
            KvHandle { indexer: SharedKvIndexer::new(KvIndexer::new(Limits::default())), enabled: Arc::default() };
        let sweeper = tokio::spawn(sweep(handle.indexer.clone(), metrics.kv_index.clone(), cancel.clone()));
        let mut supervisor = Self {
            handle,
            feed_parts: FeedParts { events: metrics.kv_events.clone(), gauge: metrics.kv_subscriptions.clone() },
            subscriptions: None,
            registry,
            options,
            cancel,
            sweeper: Some(sweeper),
        };
        supervisor.apply(config);
        supervisor
    }

    pub fn handle(&self) -> KvHandle {
        self.handle.clone()
    }

    /// The running kv-events subscriptions, for the admin API.
    pub fn subscriptions(&self) -> Subscriptions {
        self.subscriptions.as_ref().map_or_else(|| Subscriptions::from(Vec::new()), |s| s.statuses().borrow().clone())
    }

    /// Applies a reloaded configuration: `dynamo.kv.enabled` starts or stops the subscriptions
    /// (stopping empties the index), a dial policy change restarts them.
    pub async fn reload(&mut self, config: &Config) {
        if !kv_on(config)
            && let Some(mut running) = self.subscriptions.take()
        {
            running.stop().await;
            self.handle.enabled.store(false, Ordering::Relaxed);
            *self.handle.indexer.write() = KvIndexer::new(Limits::default());
            tracing::info!("dynamo.kv disabled: kv-events subscriptions stopped and the index emptied");
        }
        self.apply(config);
    }

    fn apply(&mut self, config: &Config) {
        let policy = dial_policy(&config.dynamo.load);
        match &self.subscriptions {
            Some(running) => running.set_policy(policy),
            None if kv_on(config) => {
                let feed = KvFeed {
                    indexer: self.handle.indexer.clone(),
                    events: self.feed_parts.events.clone(),
                    gauge: self.feed_parts.gauge.clone(),
                };
                let running =
                    Supervisor::start(feed, policy, self.options, self.registry.clone(), self.cancel.child_token());
                self.subscriptions = Some(running);
                self.handle.enabled.store(true, Ordering::Relaxed);
            }
            None => {}
        }
    }

    pub async fn stop(&mut self) {
        if let Some(mut running) = self.subscriptions.take() {
            running.stop().await;
        }
        self.cancel.cancel();
        if let Some(sweeper) = self.sweeper.take() {
            let _ = sweeper.await;
        }
    }
}

/// The KV term needs discovered publishers, so it is off whenever discovery is.
fn kv_on(config: &Config) -> bool {
    config.dynamo.enabled && config.dynamo.kv.enabled
}

async fn sweep(indexer: SharedKvIndexer, gauges: IntGaugeVec, cancel: CancellationToken) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = every.tick() => {}
        }
        let stats = {
            let mut indexer = indexer.write();
            for publisher_id in indexer.clear_stale(Instant::now(), KV_EVENTS_STALE_AFTER) {
                tracing::warn!(
                    publisher_id,
                    after = ?KV_EVENTS_STALE_AFTER,
                    "kv-events publisher unreachable for too long; its ranks' blocks were cleared"
                );
            }
            indexer.index().stats()
        };
        for (what, value) in [
            ("nodes", stats.nodes),
            ("ownerships", stats.ownerships),
            ("ranks", stats.ranks),
            ("bytes", stats.heap_bytes),
        ] {
            gauges.with_label_values(&[what]).set(i64::try_from(value).unwrap_or(i64::MAX));
        }
    }
}
