//! The KV side of the control plane at run time: kv-events subscriptions feeding the shared
//! index while `dynamo.kv.enabled`, a sweeper that drops publishers down past
//! [`KV_EVENTS_STALE_AFTER`], prunes provisional chains and exports both indexes' sizes, and
//! the [`KvHandle`] the Fleet service answers `FindMatches` from and credits dispatched
//! prefixes to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use continuum_kv_index::{IndexStats, Limits, Matches, RankKey};
use prometheus::{IntCounterVec, IntGaugeVec};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::feed::{KvFeed, SharedKvIndexer, clear_each};
use super::indexer::{KV_EVENTS_STALE_AFTER, KvIndexer};
use super::provisional::{Folded, ProvisionalIndex, ProvisionalResult};
use super::recent_lookups::{LookupKey, RecentLookups, Suggestion};
use crate::config::Config;
use crate::discovery::Topic;
use crate::load::SessionEnds;
use crate::load::zmtp::ZmtpLimits;
use crate::load::{LoadOptions, Subscriptions, Supervisor, dial_policy};
use crate::metrics::Metrics;
use crate::sources::Generation;

/// How often stale publishers are looked for and the index gauges refreshed.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// What `FindMatches` reads: the index, when the KV term is on.
#[derive(Debug, Clone, Default)]
pub struct KvHandle {
    indexer: SharedKvIndexer,
    enabled: Arc<AtomicBool>,
    /// Lock order: the indexer's lock, then this one (a credit and the sweep hold both).
    /// Never take the indexer's lock while holding this one.
    provisional: Arc<Mutex<ProvisionalIndex>>,
    /// Where each lookup is numbered and a rank suggested to it.
    lookups: Arc<Mutex<RecentLookups>>,
}

impl KvHandle {
    /// A handle around an index built elsewhere, answering while `enabled`. The supervisor
    /// builds its own; this is for benchmarks and tests that fill an index directly (through
    /// [`KvIndexer::apply_events`], so the identity gate still applies) and serve it with
    /// `FleetService::with_kv`.
    pub fn new(indexer: SharedKvIndexer, enabled: bool) -> Self {
        Self {
            indexer,
            enabled: Arc::new(AtomicBool::new(enabled)),
            provisional: Arc::default(),
            lookups: Arc::default(),
        }
    }

    /// The index's size now (a read lock held for a handful of loads).
    pub fn stats(&self) -> IndexStats {
        self.indexer.read().index().stats()
    }

    /// Each rank's contiguous prefix overlap in the index, or `None` while `dynamo.kv.enabled`
    /// is false.
    pub fn find_matches(&self, block_hashes: &[u64]) -> Option<Matches> {
        self.enabled.load(Ordering::Relaxed).then(|| self.indexer.read().find_matches(block_hashes))
    }

    /// What `FindMatches` answers: each rank's larger of its indexed and provisional overlap,
    /// ascending by score, or `None` while `dynamo.kv.enabled` is false.
    pub fn overlaps(&self, block_hashes: &[u64]) -> Option<Vec<(RankKey, u32)>> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        // Folded before any lock. The index is read once for the whole answer: a lookup runs
        // on the runtime's threads, and each read of a lock some kv-events batch is queued to
        // write would wait out that batch's turn again.
        let query = Folded::of(block_hashes);
        let indexer = self.indexer.read();
        let indexed = indexer.find_matches(block_hashes);
        let mut merged = {
            let mut provisional = self.provisional();
            // Taken and forgotten under the provisional lock, as one step: a lookup that took
            // the notes and waited for the lock would otherwise leave another, merging first,
            // to answer chains the clears had voided.
            provisional.forget_cleared(&indexer.take_cleared());
            provisional.merge(&query, indexed.as_slice(), Instant::now())
        };
        // A departed rank's chains go at the next sweep; until then it is not answered.
        merged.retain(|(rank, _)| indexer.is_live(*rank));
        Some(merged)
    }

    /// Credits a dispatched request's prefix chain to the live `rank` that prefills it, for
    /// `dynamo.kv.provisional_ttl` (see [`ProvisionalIndex`]).
    pub fn credit_provisional(&self, rank: RankKey, block_hashes: &[u64]) -> ProvisionalResult {
        if !self.enabled.load(Ordering::Relaxed) || block_hashes.is_empty() {
            return ProvisionalResult::Refused;
        }
        // Folded before any lock; the index's read lock is held while crediting, so the rank
        // cannot depart in between and keep the chain.
        let chain = Folded::of(block_hashes);
        let indexer = self.indexer.read();
        self.provisional().credit(rank, &chain, indexer.is_live(rank), Instant::now())
    }

    /// Sets how long credited chains count (zero: off, and drops what is held). The supervisor
    /// sets it from `dynamo.kv.provisional_ttl`; a handle built with [`KvHandle::new`] starts off.
    pub fn set_provisional_ttl(&self, ttl: Duration) {
        self.provisional().set_ttl(ttl);
    }

    /// Suggests one of `contenders` to the lookup `key` names, for a prompt of `tokens` whose
    /// request one of them will prefill, and reserves it (see [`RecentLookups`]). Only live
    /// ranks are weighed: the contenders are a replica's to name, and invented ones would take
    /// the places of the fleet's in what the lookups remember. (A worker that just joined is
    /// live once the KV feed has taken the fleet it joined, a moment after replicas see it.)
    pub fn answer_lookup(&self, key: Option<LookupKey<'_>>, contenders: &[RankKey], tokens: u64) -> Option<Suggestion> {
        let live: Vec<RankKey> = {
            let indexer = self.indexer.read();
            contenders.iter().copied().filter(|rank| indexer.is_live(*rank)).collect()
        };
        self.lookups().answer(key, &live, tokens, Instant::now())
    }

    /// Sets how long a lookup's reservation stands; for tests, which cannot count on a
    /// report crossing a busy machine within the control plane's few milliseconds.
    pub fn set_lookup_window(&self, window: Duration) {
        self.lookups().set_window(window);
    }

    /// A dispatch report says which rank the request of the lookup `key` names went to; one
    /// that names no live rank says nothing the lookups may keep.
    pub fn lookup_reported(&self, key: LookupKey<'_>, rank: RankKey) {
        if self.indexer.read().is_live(rank) {
            self.lookups().reported(key, rank, Instant::now());
        }
    }

    fn lookups(&self) -> MutexGuard<'_, RecentLookups> {
        self.lookups.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn provisional(&self) -> MutexGuard<'_, ProvisionalIndex> {
        self.provisional.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the admin API reads: the index and whichever kv-events subscriptions are running. It
/// outlives a reload that stops or restarts them.
#[derive(Debug, Clone)]
pub struct KvView {
    handle: KvHandle,
    subscriptions: watch::Receiver<Option<watch::Receiver<Subscriptions>>>,
}

impl KvView {
    /// Whether `dynamo.kv.enabled` (with discovery on) has the subscriptions running.
    pub fn enabled(&self) -> bool {
        self.handle.enabled.load(Ordering::Relaxed)
    }

    /// The running kv-events subscriptions (none while the KV term is off).
    pub fn subscriptions(&self) -> Subscriptions {
        self.subscriptions.borrow().as_ref().map_or_else(|| Subscriptions::from(Vec::new()), |s| s.borrow().clone())
    }

    pub fn stats(&self) -> IndexStats {
        self.handle.stats()
    }
}

/// Runs the kv-events subscriptions while `dynamo.kv.enabled` and keeps the index tidy.
#[derive(Debug)]
pub struct KvSupervisor {
    handle: KvHandle,
    /// The running subscriptions' statuses, for [`KvView`].
    statuses: watch::Sender<Option<watch::Receiver<Subscriptions>>>,
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
    left_out: prometheus::IntGauge,
    session_ends: SessionEnds,
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
        let handle = KvHandle {
            indexer: SharedKvIndexer::new(KvIndexer::new(Limits::default())),
            enabled: Arc::default(),
            provisional: Arc::new(Mutex::new(ProvisionalIndex::new(config.dynamo.kv.provisional_ttl))),
            lookups: Arc::default(),
        };
        let sweep_metrics = SweepMetrics {
            index: metrics.kv_index.clone(),
            provisional: metrics.kv_provisional.clone(),
            provisional_held: metrics.kv_provisional_held.clone(),
        };
        let sweeper = tokio::spawn(sweep(handle.clone(), sweep_metrics, cancel.clone()));
        let mut supervisor = Self {
            handle,
            statuses: watch::Sender::new(None),
            feed_parts: FeedParts {
                events: metrics.kv_events.clone(),
                gauge: metrics.kv_subscriptions.clone(),
                left_out: metrics.subscriptions_left_out.with_label_values(&[Topic::KvEvents.as_str()]),
                session_ends: SessionEnds::new(&metrics.subscription_sessions_ended, Topic::KvEvents),
            },
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

    /// What the admin API shows; it follows reloads.
    pub fn view(&self) -> KvView {
        KvView { handle: self.handle.clone(), subscriptions: self.statuses.subscribe() }
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
            self.statuses.send_replace(None);
            running.stop().await;
            self.handle.enabled.store(false, Ordering::Relaxed);
            // The old index (tens of megabytes) is freed off the lock and the runtime.
            let old = std::mem::replace(&mut *self.handle.indexer.write(), KvIndexer::new(Limits::default()));
            tokio::task::spawn_blocking(move || drop(old));
            self.handle.provisional().clear();
            tracing::info!("dynamo.kv disabled: kv-events subscriptions stopped and the index emptied");
        }
        self.apply(config);
    }

    fn apply(&mut self, config: &Config) {
        self.handle.set_provisional_ttl(config.dynamo.kv.provisional_ttl);
        let policy = dial_policy(&config.dynamo.load);
        match &self.subscriptions {
            Some(running) => running.set_policy(policy),
            None if kv_on(config) => {
                let feed = KvFeed {
                    indexer: self.handle.indexer.clone(),
                    events: self.feed_parts.events.clone(),
                    gauge: self.feed_parts.gauge.clone(),
                    left_out: self.feed_parts.left_out.clone(),
                    session_ends: self.feed_parts.session_ends.clone(),
                    ambiguous: Default::default(),
                };
                let running =
                    Supervisor::start(feed, policy, self.options, self.registry.clone(), self.cancel.child_token());
                self.statuses.send_replace(Some(running.statuses()));
                self.subscriptions = Some(running);
                self.handle.enabled.store(true, Ordering::Relaxed);
            }
            None => {}
        }
    }

    pub async fn stop(&mut self) {
        self.statuses.send_replace(None);
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

/// What the sweep exports.
#[derive(Debug)]
struct SweepMetrics {
    index: IntGaugeVec,
    provisional: IntCounterVec,
    provisional_held: IntGaugeVec,
}

async fn sweep(handle: KvHandle, metrics: SweepMetrics, cancel: CancellationToken) {
    let indexer = &handle.indexer;
    let mut every = tokio::time::interval(SWEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = every.tick() => {}
        }
        // One stale publisher to a hold of the lock, lookups between: a partition that took
        // many away at once would otherwise hold the index for all their clears in a row.
        let stale = indexer.read().stale(Instant::now(), KV_EVENTS_STALE_AFTER);
        for publisher in stale {
            let Some(ranks) = indexer.write().take_if_stale(&publisher, Instant::now(), KV_EVENTS_STALE_AFTER) else {
                continue;
            };
            clear_each(indexer, ranks).await;
            tracing::warn!(
                %publisher,
                after = ?KV_EVENTS_STALE_AFTER,
                "kv-events publisher unreachable for too long; its ranks' blocks were cleared"
            );
        }
        let stats = indexer.read().index().stats();
        for (what, value) in [
            ("nodes", stats.nodes),
            ("ownerships", stats.ownerships),
            ("ranks", stats.ranks),
            ("bytes", stats.heap_bytes),
        ] {
            metrics.index.with_label_values(&[what]).set(i64::try_from(value).unwrap_or(i64::MAX));
        }
        sweep_provisional(&handle, &metrics);
    }
}

/// Drops expired chains and those of departed ranks, and exports the provisional counts.
fn sweep_provisional(handle: &KvHandle, metrics: &SweepMetrics) {
    let (counts, (chains, hashes)) = {
        let indexer = handle.indexer.read();
        let mut provisional = handle.provisional();
        provisional.expire(Instant::now());
        provisional.retain_live(|rank| indexer.is_live(rank));
        (provisional.take_counts(), provisional.size())
    };
    for (result, n) in counts.iter() {
        metrics.provisional.with_label_values(&[result.as_str()]).inc_by(n);
    }
    for (what, value) in [("chains", chains), ("hashes", hashes)] {
        metrics.provisional_held.with_label_values(&[what]).set(i64::try_from(value).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use continuum_kv_index::Limits;

    use super::*;
    use crate::kv::{KvIndexer, LiveWorker};

    fn live(ranks: std::ops::Range<u32>) -> LiveWorker {
        LiveWorker { namespace: "dynamo".into(), publishing: ranks.len(), ranks }
    }

    /// A worker that departs takes its provisional chains out of `FindMatches` answers at once,
    /// not at the next sweep.
    #[test]
    fn a_departed_ranks_provisional_chain_is_not_answered() {
        let indexer = SharedKvIndexer::new(KvIndexer::new(Limits::default()));
        indexer.write().set_live([(7, live(0..1)), (8, live(0..1))].into_iter().collect());
        let handle = KvHandle::new(indexer.clone(), true);
        handle.set_provisional_ttl(Duration::from_secs(60));
        for worker_id in [7, 8] {
            let credited = handle.credit_provisional(RankKey { worker_id, dp_rank: 0 }, &[1, 2, 3]);
            assert_eq!(credited, ProvisionalResult::Credited);
        }
        let answered = |handle: &KvHandle| -> Vec<u64> {
            handle.overlaps(&[1, 2, 3]).unwrap_or_default().iter().map(|(rank, _)| rank.worker_id).collect()
        };
        assert_eq!(answered(&handle), [7, 8]);
        indexer.write().set_live([(8, live(0..1))].into_iter().collect());
        assert_eq!(answered(&handle), [8], "worker 7 left");
        let refused = handle.credit_provisional(RankKey { worker_id: 7, dp_rank: 0 }, &[1, 2, 3]);
        assert_eq!(refused, ProvisionalResult::Refused, "and earns no new credit");
    }

    /// A lookup's contenders and the rank its request went to are a replica's to name: ranks
    /// no live worker declares are neither weighed nor kept, so they cannot take the places of
    /// the fleet's in what the lookups remember.
    #[test]
    fn lookups_weigh_and_keep_live_ranks_only() {
        let indexer = SharedKvIndexer::new(KvIndexer::new(Limits::default()));
        indexer.write().set_live([(7, live(0..1)), (8, live(0..1))].into_iter().collect());
        let handle = KvHandle::new(indexer, true);
        let rank = |worker_id| RankKey { worker_id, dp_rank: 0 };
        let suggested = |contenders: &[RankKey], key| handle.answer_lookup(key, contenders, 100).map(Suggestion::rank);
        assert_eq!(suggested(&[rank(99)], None), None, "no live contender: no suggestion");

        // Reported before its answer, to an invented rank: not kept, so the lookup's
        // reservation stands on the rank it suggests, and the next lookup goes elsewhere.
        let key = LookupKey { replica: "replica-1", lookup: 1 };
        handle.lookup_reported(key, rank(99));
        assert_eq!(suggested(&[rank(99), rank(7), rank(8)], Some(key)), Some(rank(7)));
        assert_eq!(suggested(&[rank(7), rank(8)], None), Some(rank(8)), "7 holds the first reservation");
    }

    /// A rank whose blocks are cleared after a credit (here its own `cleared` event) is answered
    /// without it from the next lookup: what the credit promised may have gone with them. A
    /// credit after the clear stands.
    #[test]
    fn a_cleared_ranks_provisional_chain_is_not_answered() {
        use crate::kv::decode::{KvEvent, KvEventData, ResidencyDomain, StorageTier};
        use crate::kv::indexer::PublisherMapping;

        let indexer = SharedKvIndexer::new(KvIndexer::new(Limits::default()));
        indexer.write().set_live([(7, live(0..1)), (8, live(0..1))].into_iter().collect());
        let handle = KvHandle::new(indexer.clone(), true);
        handle.set_provisional_ttl(Duration::from_secs(60));
        let rank = |worker_id| RankKey { worker_id, dp_rank: 0 };
        for worker_id in [7, 8] {
            assert_eq!(handle.credit_provisional(rank(worker_id), &[1, 2, 3]), ProvisionalResult::Credited);
        }
        let answered = |handle: &KvHandle| -> Vec<u64> {
            handle.overlaps(&[1, 2, 3]).unwrap_or_default().iter().map(|(rank, _)| rank.worker_id).collect()
        };
        assert_eq!(answered(&handle), [7, 8]);
        let publisher = crate::discovery::PublisherKey { namespace: "dynamo".into(), publisher_id: 70 };
        let mapping = PublisherMapping { publisher, worker_id: 7, dp_rank: Some(0) };
        let cleared = KvEvent {
            worker_id: 7,
            dp_rank: 0,
            event_id: 1,
            storage_tier: StorageTier::Device,
            residency_domain: ResidencyDomain::Unspecified,
            data: KvEventData::Cleared,
        };
        indexer.write().apply_events(&mapping, &[cleared]);
        assert_eq!(answered(&handle), [8], "worker 7's credit went with its blocks");
        assert_eq!(handle.credit_provisional(rank(7), &[1, 2, 3]), ProvisionalResult::Credited);
        assert_eq!(answered(&handle), [7, 8], "a credit after the clear stands");
    }
}
