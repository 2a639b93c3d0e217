//! The etcd discovery source: the effectful shell around the pure `discovery::Reducer`.
//!
//! Read-only by construction: this module issues range gets and watches and nothing else (no
//! put, delete, lease grant or keep-alive). One pass connects, range-gets the four prefixes of
//! every watched namespace at one revision, folds them as a resync, opens a watch on each prefix
//! from the revision after it (gapless: the gets hold that revision's writes), and folds every event
//! until a stream ends. Then it waits a bounded,
//! jittered backoff and starts over from scratch, which also recovers from compaction.
//!
//! Nothing etcd holds can stop discovery for good:
//! - Prefixes are read in pages of at most [`PAGE_KEYS`] keys, all at one revision, so no
//!   response has to hold a whole keyspace. A page past [`MAX_ETCD_MESSAGE_BYTES`] is
//!   asked for again at half the keys; a single value past it is stepped over (its key read
//!   alone, without its value) and counted as `oversized`. Each page is listed into what the
//!   resync can use as it arrives (`Reducer::list`), so a listing holds no more than the
//!   reducer's own bounds allow, whatever etcd holds.
//! - Watches ask etcd to split a large revision into fragments, and refuse to run on a member
//!   that has lost its leader (`require_leader`: etcd then cancels them, and the pass resyncs).
//! - A watch must be heard from: every [`WatchHealth::progress_every`] each stream is asked for
//!   its progress. One silent for [`WatchHealth::silent_after`] is checked against the member
//!   (see `heard`): a member that does not answer within [`WatchHealth::confirm_within`], or
//!   that holds a write under the stream's prefix the stream has still not delivered a check
//!   later, ends the pass. An idle keyspace passes (no newer write); a frozen member or proxy,
//!   or one stream stalled while the others and the reads go on, does not.

use std::time::{Duration, Instant, SystemTime};

use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, KvClient, TlsOptions, WatchClient, WatchOptions,
};
use futures::StreamExt;
use futures::stream::SelectAll;
use tokio_util::sync::CancellationToken;

use super::registry::Registry;
use crate::config::EtcdConfig;
use crate::discovery::{Applied, KeyValue, Listing, Reducer, WatchEvent, keys};
use crate::metrics::Metrics;

/// Dialling and authenticating, each page of the listing, and opening each watch must each
/// finish within this (a listing that keeps moving is never cut: a large fleet over a slow link
/// takes as many of these as it has pages); the watches after it are unbounded.
pub const SEED_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest etcd response accepted. Above `MAX_RECORD_BYTES` (16 MiB), so an oversized
/// record reaches the reducer to be refused and counted instead of breaking the stream for
/// every record beside it.
pub const MAX_ETCD_MESSAGE_BYTES: usize = 64 << 20;
/// Keys one range-get page asks for at most (fewer after a page too large to accept).
pub const PAGE_KEYS: i64 = 256;

mod heard;

pub use heard::WatchHealth;
use heard::{Heard, Verdict};

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("connecting to etcd, or one page of its listing, took longer than {SEED_TIMEOUT:?}")]
    SeedTimeout,
    /// Its text says the whole cause: tonic's own would repeat it as a debug dump.
    #[error("etcd: {}", etcd_reason(.0))]
    Etcd(etcd_client::Error),
    #[error("reading TLS material {path}: {source}")]
    Tls { path: String, source: std::io::Error },
    #[error("etcd cancelled the watch: {0}")]
    Cancelled(String),
    #[error("etcd compacted past revision {0}; resyncing")]
    Compacted(i64),
    #[error("a watch stream ended")]
    Ended,
    #[error(
        "the watch on {prefix} went unheard for {after:?}, progress requests included, and etcd did not answer a check of it in time (or no longer holds the revision it delivered); resyncing"
    )]
    Silent { prefix: String, after: Duration },
    #[error("the watch on {prefix} went unheard while etcd holds writes under it past revision {revision}; resyncing")]
    Stalled { prefix: String, revision: i64 },
    #[error("a full discovery keyspace has room again; listing it anew for the keys it refused")]
    RoomFreed,
}

/// The prefixes watched for one Dynamo namespace: instances, model cards, event channels, and
/// the event sources that map a kv-events publisher to its worker and dp rank.
pub fn prefixes(namespace: &str) -> [String; 4] {
    let ns = keys::encode_segment(namespace);
    [
        format!("v1/instances/{namespace}/"),
        format!("v1/mdc/{namespace}/"),
        format!("v1/event_channels/namespace/{ns}/"),
        format!("v1/event_sources/namespace/{ns}/"),
    ]
}

/// Runs passes until `cancel` fires. The reducer lives across passes, so `first_seen` survives.
pub async fn run(
    config: EtcdConfig,
    namespaces: Vec<String>,
    registry: Registry,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    run_with(config, namespaces, registry, metrics, WatchHealth::default(), cancel).await;
}

/// [`run`], telling stalled watches by `health`.
pub async fn run_with(
    config: EtcdConfig,
    namespaces: Vec<String>,
    registry: Registry,
    metrics: Metrics,
    health: WatchHealth,
    cancel: CancellationToken,
) {
    // A reload that replaced the watcher: the workers it finds again keep their first sighting.
    let mut reducer = Reducer::succeeding(namespaces.clone(), &registry.current().fleet);
    let backoff = &config.watch_reconnect_backoff;
    let mut delay = backoff.initial;
    let mut timing = PassTiming { relists: RelistPacing::new(backoff.initial, backoff.max), watching_since: None };
    loop {
        timing.watching_since = None;
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = pass(&config, &namespaces, &mut reducer, &registry, &metrics, health, &mut timing) => outcome,
        };
        let sleep = match outcome {
            // Planned, not a failure: the relist leaves the failure backoff as it was, and
            // discovery still reads as connected (an alert on it must not fire). The pass
            // waited out the relist's pacing while it still watched, so it starts at once.
            Err(PassError::RoomFreed) => Duration::ZERO,
            outcome => {
                metrics.discovery_connected.set(0);
                if let Err(error) = outcome {
                    let error = continuum_proto::error_chain(&error);
                    tracing::warn!(%error, "etcd discovery pass ended; resyncing after backoff");
                }
                // The floor comes back only after the watches held for a whole backoff ceiling,
                // so an etcd (or proxy) that serves gets but drops watches cannot drive a
                // reconnect storm.
                if timing.watching_since.is_some_and(|since: Instant| since.elapsed() >= backoff.max) {
                    delay = backoff.initial;
                }
                let sleep = delay.mul_f64(0.5 + rand::random::<f64>() / 2.0);
                delay = delay.saturating_mul(2).min(backoff.max);
                sleep
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(sleep) => {}
        }
    }
}

async fn pass(
    config: &EtcdConfig,
    namespaces: &[String],
    reducer: &mut Reducer,
    registry: &Registry,
    metrics: &Metrics,
    health: WatchHealth,
    timing: &mut PassTiming,
) -> Result<(), PassError> {
    let prefixes: Vec<String> = namespaces.iter().flat_map(|ns| prefixes(ns)).collect();
    let (mut kv, mut watcher, seeded) = seed(config, &prefixes, reducer).await?;
    metrics.discovery_events.with_label_values(&["oversized"]).inc_by(seeded.stepped_over);
    off_the_runtime(|| {
        let applied = reducer.resync(seeded.listing, SystemTime::now());
        publish(reducer, &applied, registry, metrics);
    });

    let mut streams = SelectAll::new();
    let mut askers = Vec::with_capacity(prefixes.len());
    let revision = seeded.revision;
    for (index, prefix) in prefixes.iter().enumerate() {
        // From the revision after the listing's: the listing holds that one already, and a
        // value it stepped over (past what one message may carry) would fail every watch
        // that replayed it, for as long as it stayed the newest write. Until the next write
        // anywhere, etcd leaves progress requests of a watch starting past its revision
        // unanswered: the confirming read below tells that quiet from a frozen member.
        let options = WatchOptions::new().with_prefix().with_start_revision(revision.saturating_add(1)).with_fragment();
        let opened = tokio::time::timeout(SEED_TIMEOUT, watcher.watch(prefix.as_str(), Some(options))).await;
        let (asker, responses) = opened.map_err(|_| PassError::SeedTimeout)??.split();
        askers.push(asker);
        // `SelectAll` drops a stream that ends and goes on with the others; one prefix's
        // watch ending must end the pass, or that prefix would go unwatched.
        let ended = futures::stream::once(std::future::ready(Err(PassError::Ended)));
        let responses = responses.map(|response| response.map_err(PassError::from)).chain(ended);
        streams.push(responses.map(move |response| (index, response)));
    }
    metrics.discovery_connected.set(1);
    timing.watching_since = Some(Instant::now());
    let mut heard = Heard::new(prefixes.len(), revision, Instant::now());
    // Not at once: a watch still catching up may leave the request unanswered.
    let first = tokio::time::Instant::now() + health.progress_every;
    let mut progress = tokio::time::interval_at(first, health.progress_every);
    progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When a full keyspace freed room, the relist that lists its refused keys waits its pacing
    // while this pass goes on watching: the keys held keep updating and deleted workers keep
    // leaving the fleet until it starts.
    let mut relist_at: Option<tokio::time::Instant> = None;
    loop {
        let (index, response) = tokio::select! {
            next = streams.next() => next.ok_or(PassError::Ended)?,
            () = until(relist_at) => return Err(PassError::RoomFreed),
            _ = progress.tick() => {
                for (index, delivered) in heard.silent(Instant::now(), health.silent_after) {
                    let prefix = &prefixes[index];
                    let Some(checked) = writes_after(&mut kv, prefix, delivered, health.confirm_within).await else {
                        return Err(PassError::Silent { prefix: prefix.clone(), after: health.silent_after });
                    };
                    if heard.checked(index, checked, Instant::now()) == Verdict::Stalled {
                        return Err(PassError::Stalled { prefix: prefix.clone(), revision: delivered });
                    }
                }
                for asker in &mut askers {
                    asker.request_progress().await?;
                }
                continue;
            }
        };
        let response = response?;
        heard.from(index, delivered(&response), Instant::now());
        if response.compact_revision() > 0 {
            return Err(PassError::Compacted(response.compact_revision()));
        }
        if response.canceled() {
            return Err(PassError::Cancelled(response.cancel_reason().to_string()));
        }
        let bytes: usize = response.events().iter().filter_map(|e| e.kv()).map(|kv| kv.value().len()).sum();
        let relist_wanted = if bytes > ON_THE_RUNTIME_BYTES {
            off_the_runtime(|| apply_events(&response, reducer, registry, metrics))
        } else {
            apply_events(&response, reducer, registry, metrics)
        };
        if relist_wanted && relist_at.is_none() {
            let watched = timing.watching_since.map_or(Duration::ZERO, |since| since.elapsed());
            relist_at = Some(tokio::time::Instant::now() + timing.relists.next(watched));
        }
    }
}

/// Fires at `deadline`; never without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Folds one watch response's events into the reducer, publishing the fleet if it changed.
/// Whether one of them freed room in a keyspace that refused keys, which only a relist lists.
fn apply_events(
    response: &etcd_client::WatchResponse,
    reducer: &mut Reducer,
    registry: &Registry,
    metrics: &Metrics,
) -> bool {
    let now = SystemTime::now();
    let mut changed = false;
    let mut relist_wanted = false;
    for event in response.events() {
        let Some(kv) = event.kv() else { continue };
        let folded = match event.event_type() {
            etcd_client::EventType::Put => WatchEvent::Put(record(kv)),
            etcd_client::EventType::Delete => WatchEvent::Delete { key: kv.key().to_vec() },
        };
        let applied = reducer.apply(folded, now);
        changed |= applied.fleet_changed();
        relist_wanted |= applied.relist_wanted();
        count(&applied, metrics);
    }
    // Heartbeat re-puts change nothing; only a changed fleet is rebuilt and published.
    if changed {
        registry.publish(reducer.fleet());
    }
    relist_wanted
}

/// What one pass leaves to those after it.
#[derive(Debug)]
struct PassTiming {
    relists: RelistPacing,
    /// When this pass's watches opened, if they did.
    watching_since: Option<Instant>,
}

/// How long a pass goes on watching before the relist asked for because a full keyspace freed
/// room: the backoff's floor, doubling (to its ceiling) for each relist asked for by a pass
/// that had watched for less than the ceiling. A keyspace full under churn frees room at every
/// deletion, and a relist reads every key; a relist now and then waits only the floor.
#[derive(Debug)]
struct RelistPacing {
    floor: Duration,
    ceiling: Duration,
    next: Duration,
}

impl RelistPacing {
    fn new(floor: Duration, ceiling: Duration) -> Self {
        Self { floor, ceiling, next: floor }
    }

    /// The wait before this relist, the pass asking for it having watched for `watched`.
    fn next(&mut self, watched: Duration) -> Duration {
        if watched >= self.ceiling {
            self.next = self.floor;
        }
        let wait = self.next;
        self.next = self.next.saturating_mul(2).min(self.ceiling);
        wait
    }
}

/// A watch response whose values add up to more than this is folded off the runtime: parsing
/// megabytes of cards would hold up the Fleet streams and subscriptions beside it.
const ON_THE_RUNTIME_BYTES: usize = 64 << 10;

/// Runs `work` where the runtime can hand this thread's other tasks to another one meanwhile
/// (a multi-threaded runtime, as the control plane's is); elsewhere, as it comes.
fn off_the_runtime<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|runtime| runtime.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// What a check of a silent stream's prefix found ([`writes_after`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    /// The prefix changed after the revision the stream delivered.
    pub changed: bool,
    /// The store's revision the check read at: unchanged, the stream has all up to it.
    pub at: i64,
}

/// Whether `prefix` changed after `revision`, by linearizable reads answered within `within`,
/// all at the store's revision as the check began: a key written since (one at most, without
/// its value; not a count, since etcd counts a range before it filters it by revision), or else
/// a count of the prefix unlike its count then, since a delete (a worker's lease expiring)
/// leaves no key to find. `None` when the member does not answer in time (one cut off from its
/// cluster, `require_leader`, or frozen), or no longer holds that revision (compacted past what
/// the stream delivered: a quiet check moves the stream's revision to its own, so a stream
/// that stays quiet is checked at a recent one).
pub async fn writes_after(kv: &mut KvClient, prefix: &str, revision: i64, within: Duration) -> Option<Checked> {
    let check = async {
        let newer = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_min_mod_revision(revision.saturating_add(1))
            .with_limit(1);
        let found = kv.get(prefix, Some(newer)).await?;
        let at = found.header().map_or(revision, |header| header.revision());
        if !found.kvs().is_empty() {
            return Ok(Checked { changed: true, at });
        }
        let count = |at: i64| GetOptions::new().with_prefix().with_count_only().with_revision(at);
        let now = kv.get(prefix, Some(count(at))).await?.count();
        let then = kv.get(prefix, Some(count(revision))).await?.count();
        Ok::<_, etcd_client::Error>(Checked { changed: now != then, at })
    };
    match tokio::time::timeout(within, check).await {
        Ok(Ok(checked)) => Some(checked),
        _ => None,
    }
}

/// The revision up to which a watch response shows its prefix's writes: its events' newest,
/// or for a progress answer (no events) the revision it reports the watch caught up to.
fn delivered(response: &etcd_client::WatchResponse) -> i64 {
    let events = response.events().iter().filter_map(|event| event.kv()).map(|kv| kv.mod_revision()).max();
    delivered_by(events, response.created(), response.header().map_or(0, |header| header.revision()))
}

/// [`delivered`] from a response's newest event, whether it answers the watch's creation, and
/// its header's revision. The answer to a creation carries the store's revision as the watch
/// opened, not what the stream has delivered: writes made since the listing may still be on
/// their way, and taking it would let a stream that stalls before them pass as quiet. It
/// delivers nothing (0: the stream keeps the revision it had).
fn delivered_by(newest_event: Option<i64>, created: bool, header: i64) -> i64 {
    match newest_event {
        Some(newest) => newest,
        None if created => 0,
        None => header,
    }
}

/// What a seed read: its records as far as the reducer can use them, the one revision they
/// were read at, and how many values were too large to read at all.
struct Seeded {
    listing: Listing,
    revision: i64,
    stepped_over: u64,
}

/// Connects and range-gets every prefix, all at the store's revision as the seed starts, each
/// page listed into what `reducer`'s resync will use as it comes: what a listing holds is
/// bounded by the reducer's bounds, not by what etcd holds.
async fn seed(
    config: &EtcdConfig,
    prefixes: &[String],
    reducer: &Reducer,
) -> Result<(KvClient, WatchClient, Seeded), PassError> {
    let connect = async { Ok(Client::connect(&config.endpoints, Some(connect_options_read(config).await?)).await?) };
    let client = within_seed_timeout(connect).await?;
    let mut kv = client.kv_client().max_decoding_message_size(MAX_ETCD_MESSAGE_BYTES);
    let watcher = client.watch_client().max_decoding_message_size(MAX_ETCD_MESSAGE_BYTES);
    let first = prefixes.first().map_or("v1/", String::as_str);
    let count = GetOptions::new().with_prefix().with_count_only();
    let counted = within_seed_timeout(async { Ok(kv.get(first, Some(count)).await?) }).await?;
    let revision = counted.header().map_or(0, |h| h.revision());
    let mut seeded = Seeded { listing: Listing::default(), revision, stepped_over: 0 };
    for prefix in prefixes {
        list(&mut kv, prefix.as_bytes(), reducer, &mut seeded).await?;
    }
    Ok((kv, watcher, seeded))
}

/// Reads every key under `prefix` in pages, all at the seed's revision.
async fn list(kv: &mut KvClient, prefix: &[u8], reducer: &Reducer, seeded: &mut Seeded) -> Result<(), PassError> {
    let revision = seeded.revision;
    let end = prefix_end(prefix);
    let mut from = prefix.to_vec();
    let mut limit = PAGE_KEYS;
    loop {
        let page = GetOptions::new().with_range(end.clone()).with_limit(limit).with_revision(revision);
        let response = match tokio::time::timeout(SEED_TIMEOUT, kv.get(from.clone(), Some(page))).await {
            Err(_) => return Err(PassError::SeedTimeout),
            Ok(response) => response,
        };
        let response = match response {
            Err(error) if too_large(&error) && limit > 1 => {
                limit /= 2;
                continue;
            }
            Err(error) if too_large(&error) => {
                // One value alone is past the bound: step over its key, read without it.
                let key_only = GetOptions::new().with_range(end.clone()).with_limit(1).with_revision(revision);
                let keys_only = kv.get(from.clone(), Some(key_only.with_keys_only()));
                let response = within_seed_timeout(async { Ok(keys_only.await?) }).await?;
                let Some(skipped) = response.kvs().first() else { return Ok(()) };
                continuum_proto::warn_limited!(
                    // Cut and escaped, as the reducer logs keys: the fleet writes them.
                    key = ?crate::discovery::records::excerpt(&String::from_utf8_lossy(skipped.key())),
                    limit = MAX_ETCD_MESSAGE_BYTES,
                    "an etcd value is too large to read; refused"
                );
                seeded.stepped_over += 1;
                from = after(skipped.key());
                limit = PAGE_KEYS;
                continue;
            }
            outcome => outcome?,
        };
        let bytes: usize = response.kvs().iter().map(|kv| kv.value().len()).sum();
        let mut page = || {
            for kv in response.kvs() {
                reducer.list(&mut seeded.listing, record(kv));
            }
        };
        // Parsing a page of cards can take milliseconds: off the runtime, as for a watch response.
        if bytes > ON_THE_RUNTIME_BYTES {
            off_the_runtime(page)
        } else {
            page()
        }
        match response.kvs().last() {
            Some(last) if response.more() => from = after(last.key()),
            _ => return Ok(()),
        }
        limit = (limit * 2).min(PAGE_KEYS);
    }
}

/// `step`'s outcome, unless it takes longer than [`SEED_TIMEOUT`].
async fn within_seed_timeout<T>(step: impl Future<Output = Result<T, PassError>>) -> Result<T, PassError> {
    tokio::time::timeout(SEED_TIMEOUT, step).await.map_err(|_| PassError::SeedTimeout)?
}

/// Whether tonic refused an answer for exceeding [`MAX_ETCD_MESSAGE_BYTES`].
fn too_large(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status)
        if status.code() == tonic::Code::OutOfRange && status.message().contains("too large"))
}

/// The first key after `key`.
fn after(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

/// The end of the range of keys starting with `prefix`: its last byte below 0xff, plus one.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte is 0xff (or none): to the end of the keyspace.
    vec![0]
}

fn record(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue::new(kv.key(), kv.value()).with_lease(u64::try_from(kv.lease()).unwrap_or(0))
}

/// [`connect_options`], whose TLS files are read on the blocking pool: a stalled volume must
/// hold no runtime thread, nor keep the seed's timeout (which fires only at an await) or a
/// stop from ending the pass.
async fn connect_options_read(config: &EtcdConfig) -> Result<ConnectOptions, PassError> {
    if config.tls.is_none() {
        return connect_options(config);
    }
    let config = config.clone();
    tokio::task::spawn_blocking(move || connect_options(&config)).await.unwrap_or_else(|error| {
        Err(PassError::Tls { path: "the TLS files".to_owned(), source: std::io::Error::other(error) })
    })
}

fn connect_options(config: &EtcdConfig) -> Result<ConnectOptions, PassError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(10))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(10))
        // A member cut off from its cluster cancels the watches (and refuses the gets) rather
        // than serve a view that no longer changes.
        .with_require_leader(true);
    if let Some(auth) = &config.auth {
        // etcd's tokens expire unused (`--auth-token-ttl`, 300 s by default), and a quiet fleet
        // may use this one only for the read that confirms a quiet watch: renewed, that read is
        // answered instead of ending the pass as if the member had gone silent.
        options = options.with_user(auth.username.clone(), auth.password.expose()).with_auto_token_refresh(true);
    }
    if let Some(tls) = &config.tls {
        let mut tls_options = TlsOptions::new();
        if let Some(ca) = &tls.ca_cert {
            tls_options = tls_options.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
            // The key's path is configured as a secret: an error names it masked.
            let key = std::fs::read(key.expose())
                .map_err(|source| PassError::Tls { path: crate::config::MASK.to_string(), source })?;
            tls_options = tls_options.identity(Identity::from_pem(read(cert)?, key));
        }
        if let Some(name) = &tls.server_name {
            tls_options = tls_options.domain_name(name.clone());
        }
        options = options.with_tls(tls_options);
    }
    Ok(options)
}

/// Reads and parses `config`'s TLS files as a pass would use them, saying what is wrong: a
/// reload checks them before it stops the running watcher, rather than start one that could
/// never connect (and, keeping the fleet it read last, would publish it with no watch behind).
pub fn check_tls_files(config: &EtcdConfig) -> Result<(), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let Some(tls) = &config.tls else { return Ok(()) };
    let certificates = |what: &str, path: &std::path::Path| {
        let pem = std::fs::read(path).map_err(|error| format!("{what} {}: {error}", path.display()))?;
        match CertificateDer::pem_slice_iter(&pem).next() {
            Some(Ok(_)) => Ok(()),
            Some(Err(error)) => Err(format!("{what} {} is not PEM ({error})", path.display())),
            None => Err(format!("{what} {} holds no PEM certificate", path.display())),
        }
    };
    if let Some(ca) = &tls.ca_cert {
        certificates("ca_cert", ca)?;
    }
    if let Some(cert) = &tls.client_cert {
        certificates("client_cert", cert)?;
    }
    if let Some(key) = &tls.client_key {
        // The key's path is configured as a secret: named masked.
        let masked = crate::config::MASK;
        let pem = std::fs::read(key.expose()).map_err(|error| format!("client_key {masked}: {error}"))?;
        PrivateKeyDer::from_pem_slice(&pem).map_err(|_| format!("client_key {masked} holds no PEM private key"))?;
    }
    Ok(())
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, PassError> {
    std::fs::read(path).map_err(|source| PassError::Tls { path: path.display().to_string(), source })
}

/// Publishes the fleet a resync left, then counts it. Published first: the restart gate reads
/// a counted resync as a seeded fleet, and a replica let in before the publisher held it would
/// be sent the empty startup fleet.
fn publish(reducer: &Reducer, applied: &Applied, registry: &Registry, metrics: &Metrics) {
    registry.publish(reducer.fleet());
    count(applied, metrics);
}

fn count(applied: &Applied, metrics: &Metrics) {
    for (kind, n) in applied.iter() {
        metrics.discovery_events.with_label_values(&[kind.as_str()]).inc_by(n);
    }
}

impl From<etcd_client::Error> for PassError {
    fn from(error: etcd_client::Error) -> Self {
        Self::Etcd(error)
    }
}

/// What an etcd call's failure says, readably: tonic prints a status's transport cause as a
/// debug dump (`tonic::transport::Error(Transport, ConnectError(…))`), where its message, its
/// code and the cause at the root (`Connection refused (os error 111)`) say it all.
/// A transport error (a TLS setting it could not use, say) is told with its root cause too: the
/// client's error reports no source, so no chain would reach it.
fn etcd_reason(error: &etcd_client::Error) -> String {
    let (mut reason, cause) = match error {
        etcd_client::Error::GRpcStatus(status) if status.message().is_empty() => {
            (format!("{:?}", status.code()), std::error::Error::source(status))
        }
        etcd_client::Error::GRpcStatus(status) => {
            (format!("{} ({:?})", status.message(), status.code()), std::error::Error::source(status))
        }
        etcd_client::Error::TransportError(transport) => (error.to_string(), std::error::Error::source(transport)),
        other => return other.to_string(),
    };
    let root = std::iter::successors(cause, |cause| cause.source()).last().map(ToString::to_string);
    if let Some(root) = root.filter(|root| !reason.contains(root.as_str())) {
        reason.push_str(": ");
        reason.push_str(&root);
    }
    reason
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relists in a row (a full keyspace under churn) wait longer each time, to the ceiling; a
    /// relist after a pass that watched for the ceiling waits the floor again.
    #[test]
    fn relists_in_a_row_are_spaced_out() {
        let (floor, ceiling) = (Duration::from_millis(500), Duration::from_secs(5));
        let mut pacing = RelistPacing::new(floor, ceiling);
        let brief = Duration::from_millis(10);
        let waits: Vec<u64> = (0..6).map(|_| pacing.next(brief).as_millis() as u64).collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 5000, 5000]);
        assert_eq!(pacing.next(ceiling), floor, "after a pass that watched long enough");
        assert_eq!(pacing.next(brief), 2 * floor);
    }

    /// A failure is logged with its message, its code and the cause at its root, once each:
    /// not tonic's debug dump of the transport error, nor "transport error" twice.
    #[test]
    fn an_etcd_failure_says_its_message_code_and_root_cause() {
        let mut status = tonic::Status::unavailable("tcp connect error");
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)");
        status.set_source(std::sync::Arc::new(refused));
        let error = PassError::from(etcd_client::Error::GRpcStatus(status));
        assert_eq!(
            continuum_proto::error_chain(&error),
            "etcd: tcp connect error (Unavailable): Connection refused (os error 111)"
        );
        let mut silent = tonic::Status::unavailable("");
        silent.set_source(std::sync::Arc::new(std::io::Error::other("Connection reset by peer (os error 104)")));
        let error = PassError::from(etcd_client::Error::GRpcStatus(silent));
        assert_eq!(continuum_proto::error_chain(&error), "etcd: Unavailable: Connection reset by peer (os error 104)");
        let certificate = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let error = PassError::from(etcd_client::Error::IoError(certificate));
        assert_eq!(continuum_proto::error_chain(&error), "etcd: io error: invalid peer certificate: UnknownIssuer");
    }

    #[test]
    fn a_watch_creation_delivers_nothing_and_a_progress_answer_its_revision() {
        assert_eq!(delivered_by(None, true, 105), 0, "the store's revision as the watch opened");
        assert_eq!(delivered_by(None, false, 105), 105, "a progress answer");
        assert_eq!(delivered_by(Some(103), false, 105), 103, "events: the newest one's");
        assert_eq!(delivered_by(Some(103), true, 105), 103);
    }

    #[test]
    fn a_prefix_range_ends_at_its_last_byte_plus_one() {
        assert_eq!(prefix_end(b"v1/mdc/ns/"), b"v1/mdc/ns0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), [0]);
        assert_eq!(after(b"k"), b"k\0");
    }

    #[test]
    fn prefixes_percent_encode_the_event_channel_namespace_only() {
        assert_eq!(
            prefixes("ns.one"),
            [
                "v1/instances/ns.one/".to_string(),
                "v1/mdc/ns.one/".to_string(),
                "v1/event_channels/namespace/ns%2Eone/".to_string(),
                "v1/event_sources/namespace/ns%2Eone/".to_string(),
            ]
        );
    }
}
