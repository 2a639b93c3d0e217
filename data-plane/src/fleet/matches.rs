//! `FindMatches`: asks the control plane's KV index how much of a request's prefix each rank
//! holds, under a deadline tight enough to sit on the request path. Any miss (deadline, error,
//! the index switched off) is the caller's cue to pick without the KV term.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use continuum_proto::MAX_LOOKUP_CONTENDERS;
use continuum_proto::pb::{self, fleet_client::FleetClient};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::backoff::Backoff;
use super::client::{EndpointError, FleetClientConfig, RECONNECT_INITIAL, RECONNECT_MAX};
use super::credentials::{ClientTls, Credentials};
use crate::routing::picker::{RankOverlap, Suggested};

/// The default deadline of one lookup (seed: "the FindMatches call under a deadline (default
/// ≤ 2 ms)"): past it the request is scored without overlap credit. Tokio's timer counts in
/// whole milliseconds, rounding up, so a lookup is given up 2 to 3 ms after it began.
pub const FIND_MATCHES_DEADLINE: Duration = Duration::from_millis(2);
/// Connecting to the control plane for lookups, and its answer to a keep-alive ping.
const MATCHES_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum MatchesError {
    #[error("FindMatches took longer than {0:?}")]
    Deadline(Duration),
    #[error("FindMatches failed: {0}")]
    Status(#[from] tonic::Status),
    #[error("the control plane could not be reached for lookups; trying again after a backoff")]
    Unreachable,
}

/// A lazily connected client on its own HTTP/2 connection, so lookups never queue behind a
/// large snapshot on the Watch stream.
#[derive(Debug, Clone)]
pub struct MatchesClient {
    /// Replaced when the replica's TLS files are renewed ([`MatchesClient::follow_tls_files`]).
    client: Arc<ArcSwap<Client>>,
    deadline: Duration,
    /// This replica's id, which with a lookup's number names its reservation.
    replica_id: Arc<str>,
    /// The last lookup number handed out (shared by clones). It starts at a random number: the
    /// control plane takes a `FindMatches` call's replica id as the call states it, so numbers
    /// another replica could guess would let it stand its lookups in for this one's.
    numbered: Arc<AtomicU64>,
    /// When a refused token was last warned about.
    refusal_warned: Arc<OncePerMinute>,
    /// Whether lookups are worth making (shared by clones).
    reach: Arc<Reach>,
    started: Instant,
}

/// A control plane that cannot be reached (gone, restarting, refusing connections) is tried
/// again after a full-jitter backoff, not by every KV-scored request: a lazy channel that
/// failed to connect connects anew for the next call, so a fleet of busy replicas would
/// otherwise send it (and its DNS) a connection attempt per request for the whole outage.
/// Requests meanwhile are picked without the KV term, as after any missed lookup. A control
/// plane that answers nothing at all (stopped, overloaded) backs lookups off the same way once
/// [`UNANSWERED_FOR_MS`] has passed without an answer, rather than costing every request its
/// whole deadline for the outage.
#[derive(Debug)]
struct Reach {
    /// Lookups are skipped until this many milliseconds after the client's start (0: none).
    skip_until_ms: AtomicU64,
    /// Since when lookups have gone unanswered (each out of its deadline), in milliseconds
    /// after the client's start (0: the last one was answered).
    unanswered_since_ms: AtomicU64,
    /// When the last lookup ran out of its deadline: a silence is the lookups' in a row, not
    /// one timeout and another an hour later.
    timed_out_ms: AtomicU64,
    /// When the backoff was last warned of.
    warned: OncePerMinute,
    backoff: Mutex<Backoff>,
}

/// When a warning was last given, in milliseconds after the client's start (0: never): one a
/// minute at most, however many requests meet its cause.
#[derive(Debug, Default)]
struct OncePerMinute(AtomicU64);

impl OncePerMinute {
    /// Whether a warning is due at `now_ms`; taken, if so, by this caller alone.
    fn due(&self, now_ms: u64) -> bool {
        let last = self.0.load(Ordering::Relaxed);
        (last == 0 || now_ms.saturating_sub(last) >= 60_000)
            && self.0.compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// How long lookups may go unanswered (each out of its deadline) before they back off.
const UNANSWERED_FOR_MS: u64 = 1_000;

impl Default for Reach {
    fn default() -> Self {
        let backoff = Mutex::new(Backoff::new(RECONNECT_INITIAL, RECONNECT_MAX));
        let (unanswered_since_ms, timed_out_ms) = (AtomicU64::new(0), AtomicU64::new(0));
        let (skip_until_ms, warned) = (AtomicU64::new(0), OncePerMinute::default());
        Self { skip_until_ms, unanswered_since_ms, timed_out_ms, warned, backoff }
    }
}

impl Reach {
    fn skipping(&self, now_ms: u64) -> bool {
        now_ms < self.skip_until_ms.load(Ordering::Relaxed)
    }

    /// A lookup ran out of its deadline: a miss only once lookups have gone unanswered for
    /// [`UNANSWERED_FOR_MS`] (a control plane merely slow for one lookup is no outage, nor are
    /// the first lookups, which wait for the connection).
    fn timed_out(&self, now_ms: u64) {
        let previous = self.timed_out_ms.swap(now_ms.max(1), Ordering::Relaxed);
        let since = self.unanswered_since_ms.load(Ordering::Relaxed);
        // A gap the backoff's own window made (it ran past the last timeout) is no pause: the
        // silence goes on, and the next window follows at once.
        let paused = now_ms.saturating_sub(previous) >= UNANSWERED_FOR_MS
            && self.skip_until_ms.load(Ordering::Relaxed) <= previous;
        if since == 0 || paused {
            // The first lookup out of time since an answer, or since a pause in the lookups.
            self.unanswered_since_ms.store(now_ms.max(1), Ordering::Relaxed);
        } else if now_ms.saturating_sub(since) >= UNANSWERED_FOR_MS {
            self.missed(now_ms);
        }
    }

    /// A lookup could not reach the control plane: skip lookups for the next backoff delay.
    /// The lookups in flight when it went fail together and count as one failure.
    fn missed(&self, now_ms: u64) {
        let mut backoff = self.backoff.lock().unwrap_or_else(PoisonError::into_inner);
        if self.skipping(now_ms) {
            return;
        }
        let delay = u64::try_from(backoff.next_delay().as_millis()).unwrap_or(u64::MAX);
        self.skip_until_ms.store(now_ms.saturating_add(delay.max(1)), Ordering::Relaxed);
        // Every request loses its KV term meanwhile: said, but not at every window.
        if self.warned.due(now_ms) {
            tracing::warn!(
                "KV lookups: the control plane could not be reached, or answered none within \
                 --find-matches-deadline for a second; routing without overlap credit and trying again \
                 with backoff (if it is slow rather than away, a longer deadline may suit)"
            );
        }
    }

    /// A lookup was answered: the next failure starts the backoff over.
    fn reached(&self) {
        // Relaxed loads only on the common path: nothing to clear while nothing failed.
        if self.unanswered_since_ms.load(Ordering::Relaxed) != 0 {
            self.unanswered_since_ms.store(0, Ordering::Relaxed);
        }
        if self.skip_until_ms.load(Ordering::Relaxed) != 0 {
            // Under the lock, so that a miss of the same moment is not erased half-made.
            let mut backoff = self.backoff.lock().unwrap_or_else(PoisonError::into_inner);
            backoff.reset();
            self.skip_until_ms.store(0, Ordering::Relaxed);
        }
    }
}

type Client = FleetClient<InterceptedService<Channel, Credentials>>;

/// How often a replica with `--control-plane` TLS files looks for renewed ones.
pub const TLS_RENEWAL_INTERVAL: Duration = Duration::from_secs(10);

/// How often an idle lookup connection is pinged: a control plane gone without a word (its node
/// lost) costs the lookups of this long and a second, each waiting out its deadline.
const MATCHES_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The largest lookup answer taken: [`MAX_ANSWERED_RANKS`] overlaps are about 200 KiB on the
/// wire. A peer's larger answer is refused before it is decoded, where one empty overlap, two
/// bytes on the wire, takes a few dozen in memory.
const MAX_FIND_MATCHES_REPLY_BYTES: usize = 1 << 20;

/// Ranks an answer names at most: the index's owners of a block are at most 4,096, and its
/// provisional chains at most 4,096 more. Beyond, the answer is cut to its best-scored ranks:
/// every answer is cached for reuse, so each must stay small.
const MAX_ANSWERED_RANKS: usize = 8_192;

/// A lookup client of the control plane, connecting when first used.
fn connect(config: &FleetClientConfig) -> Result<Client, EndpointError> {
    // Bounded connects and keep-alive answers: a control plane that moved or went silent is
    // found out in seconds, not after the kernel's two-minute SYN timeout, so lookups stop
    // missing soon after it is back. (Each lookup is bounded by its deadline anyway.)
    let channel = config
        .endpoint()?
        .tcp_nodelay(true)
        .connect_timeout(MATCHES_CONNECT_TIMEOUT)
        .http2_keep_alive_interval(MATCHES_KEEP_ALIVE)
        .keep_alive_timeout(MATCHES_CONNECT_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_lazy();
    Ok(FleetClient::with_interceptor(channel, config.credentials.clone())
        .max_decoding_message_size(MAX_FIND_MATCHES_REPLY_BYTES))
}

impl MatchesClient {
    /// A client for the replica `config.replica_id` (its `Hello.replica_id`).
    pub fn new(config: &FleetClientConfig, deadline: Duration) -> Result<Self, EndpointError> {
        let client = Arc::new(ArcSwap::from_pointee(connect(config)?));
        let replica_id = config.replica_id.as_str().into();
        // Below 2^62: no replica hands out enough numbers to wrap to 0 (no lookup).
        let numbered = Arc::new(AtomicU64::new(rand::random::<u64>() >> 2));
        let (refusal_warned, reach, started) = (Arc::default(), Arc::default(), Instant::now());
        Ok(Self { client, deadline, replica_id, numbered, refusal_warned, reach, started })
    }

    /// Connects anew with `config`'s TLS files as they are now; lookups under way finish on
    /// the old connection. On an error the old connection stays.
    fn renew(&self, config: &FleetClientConfig) -> Result<(), EndpointError> {
        self.client.store(Arc::new(connect(config)?));
        Ok(())
    }

    /// Renews the connection whenever `config`'s TLS files change, looking every `interval`,
    /// until `cancel`. Nothing to do for TLS without files. The files are looked at and read on
    /// the blocking pool: a stalled volume must not hold a runtime thread.
    pub async fn follow_tls_files(self, config: FleetClientConfig, interval: Duration, cancel: CancellationToken) {
        let Some(ClientTls::Files(files)) = config.tls.clone() else { return };
        let stamp = || {
            let files = files.clone();
            tokio::task::spawn_blocking(move || files.stamp())
        };
        let Ok(seen) = stamp().await else { return };
        let mut renewal = Renewal { seen, warned: None };
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let Ok(now) = stamp().await else { continue };
            if !renewal.due(&now) {
                continue;
            }
            let (client, renewed) = (self.clone(), config.clone());
            let failed = match tokio::task::spawn_blocking(move || client.renew(&renewed)).await {
                Ok(Ok(())) => {
                    tracing::info!("KV lookups: reconnecting with the renewed --control-plane TLS files");
                    renewal.loaded(now);
                    continue;
                }
                Ok(Err(error)) => format!("the renewed --control-plane TLS files do not load: {error}"),
                Err(error) => format!("renewing the TLS connection failed: {error}"),
            };
            if renewal.failed(now) {
                tracing::warn!("KV lookups: {failed}; keeping the current connection, trying again until they load");
            }
        }
    }

    /// A refused token costs every request its KV term, and the Watch stream opened with it is
    /// ended too (a rotation finished without this replica), so it is said loudly, at most once
    /// a minute.
    fn refused(&self, status: &tonic::Status) {
        if status.code() != tonic::Code::Unauthenticated {
            return;
        }
        if self.refusal_warned.due(self.now_ms()) {
            tracing::warn!(
                "the control plane refused this replica's token for KV lookups: routing without overlap \
                 credit until --control-plane-token matches control_plane.token (or previous_token)"
            );
        }
    }

    /// Milliseconds since the client's start: the clock of its backoff and warnings.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// A number for the next lookup, one past the last: the replica reports it with the dispatch the
    /// lookup scored, answered in time or not, and the control plane moves the reservation it
    /// made for the lookup to the rank taken.
    pub fn number_lookup(&self) -> u64 {
        self.numbered.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Each rank's contiguous overlap with `block_hashes` and the part of it the fleet's
    /// requests in flight hold, with the lookup's fleet-wide turn among `model`'s, and the
    /// control plane's suggestion among `contenders` (instance id, dp rank: the ranks that
    /// would prefill this prompt of `prompt_tokens`). `lookup` is the lookup's number
    /// ([`MatchesClient::number_lookup`]; 0: none).
    pub async fn find_matches(
        &self,
        lookup: u64,
        block_hashes: Vec<u64>,
        model: &str,
        contenders: &[(u64, u32)],
        prompt_tokens: u64,
    ) -> Result<Matches, MatchesError> {
        if self.reach.skipping(self.now_ms()) {
            return Err(MatchesError::Unreachable);
        }
        let mut client = Client::clone(&self.client.load());
        // The control plane weighs at most this many for a suggestion, and refuses a lookup
        // naming more: past it, none are named.
        let named = if contenders.len() <= MAX_LOOKUP_CONTENDERS { contenders } else { &[] };
        let contenders = named.iter().map(|&(instance_id, dp_rank)| pb::RankId { instance_id, dp_rank }).collect();
        // No rank can hold more of the prefix than was asked about: a reply claiming more
        // would win every pick, so it is taken at the chain's length.
        let asked = u32::try_from(block_hashes.len()).unwrap_or(u32::MAX);
        let request = pb::FindMatchesRequest {
            block_hashes,
            model: model.to_string(),
            contenders,
            prompt_tokens,
            replica_id: self.replica_id.to_string(),
            lookup,
        };
        let call = client.find_matches(request);
        let Ok(reply) = tokio::time::timeout(self.deadline, call).await else {
            self.reach.timed_out(self.now_ms());
            return Err(MatchesError::Deadline(self.deadline));
        };
        let reply = match reply {
            Ok(reply) => {
                self.reach.reached();
                reply.into_inner()
            }
            Err(status) => {
                if unreached(&status) {
                    self.reach.missed(self.now_ms());
                } else {
                    // Refused, but answered: the control plane is there.
                    self.reach.reached();
                }
                self.refused(&status);
                return Err(status.into());
            }
        };
        // Ascending by score: a cut keeps the best.
        let cut = reply.overlaps.len().saturating_sub(MAX_ANSWERED_RANKS);
        let overlaps = reply
            .overlaps
            .into_iter()
            .skip(cut)
            .map(|o| RankOverlap {
                instance_id: o.instance_id,
                dp_rank: o.dp_rank,
                blocks: o.blocks.min(asked),
                active: o.active_blocks.min(asked),
            })
            .collect();
        let rank = |rank: pb::RankId| (rank.instance_id, rank.dp_rank);
        let suggestion = match (reply.suggestion, reply.tie_break) {
            (Some(weighed), _) => {
                Some(Suggested::Weighed { rank: rank(weighed), reserved_tokens: reply.reserved_tokens })
            }
            (None, Some(tie_break)) => Some(Suggested::TieBreak(rank(tie_break))),
            (None, None) => None,
        };
        Ok(Matches { overlaps, turn: reply.turn, suggestion })
    }
}

/// Whether a lookup failed for want of a connection (refused, dropped, lost: tonic says so as
/// `Unavailable`, or as the transport's error under another code); the control plane's own
/// refusals (a wrong token, a malformed lookup) are answers.
fn unreached(status: &tonic::Status) -> bool {
    use std::error::Error;
    status.code() == tonic::Code::Unavailable
        || status.source().is_some_and(|source| source.is::<tonic::transport::Error>())
}

/// One lookup's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matches {
    /// Ranks holding none of the prefix are absent.
    pub overlaps: Vec<RankOverlap>,
    /// The lookup's place among those the control plane has answered for the model
    /// (0: unnumbered), by which the picker rotates ties.
    pub turn: u64,
    /// The contender (instance id, dp rank) the control plane suggests.
    pub suggestion: Option<Suggested>,
}

/// When the lookups' TLS files are read again: whenever their stamp differs from the set
/// loaded last. A set that does not load (a half-written pair, a read that failed) is tried
/// again at every look until it does, and said once: taken as seen at its first failure, a set
/// whose read failed for a moment would never be tried again, and the certificate in use would
/// expire under it.
#[derive(Debug)]
struct Renewal<S> {
    /// The stamp of the set in use.
    seen: S,
    /// The stamp of the last set said to have failed.
    warned: Option<S>,
}

impl<S: PartialEq> Renewal<S> {
    fn due(&self, now: &S) -> bool {
        *now != self.seen
    }

    fn loaded(&mut self, now: S) {
        (self.seen, self.warned) = (now, None);
    }

    /// Whether to say so: the first failure of this set.
    fn failed(&mut self, now: S) -> bool {
        let first = self.warned.as_ref() != Some(&now);
        self.warned = Some(now);
        first
    }
}

#[cfg(test)]
mod tests {
    /// A set that failed is tried again at every look until it loads, and said once; a
    /// loaded one is not read again until it changes.
    #[test]
    fn tls_files_that_failed_to_load_are_tried_again_and_said_once() {
        let mut renewal = super::Renewal { seen: 1, warned: None };
        assert!(!renewal.due(&1));
        assert!(renewal.due(&2));
        assert!(renewal.failed(2), "said");
        assert!(renewal.due(&2), "tried again though unchanged");
        assert!(!renewal.failed(2), "not said again");
        assert!(renewal.failed(3), "a new set's failure is said");
        renewal.loaded(3);
        assert!(!renewal.due(&3));
        assert!(renewal.due(&4) && renewal.failed(4), "a later failure is said again");
    }

    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A control plane that takes connections and drops them at once (a process going down,
    /// a proxy with no backend): the lookups that find it so back off, instead of connecting
    /// anew for every request.
    #[tokio::test]
    async fn lookups_back_off_from_a_control_plane_that_cannot_be_reached() -> anyhow::Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&accepted);
        let server = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                drop(conn);
            }
        });
        let client = MatchesClient::new(&FleetClientConfig::new(url, "r1"), Duration::from_millis(200))?;
        let (mut unavailable, mut skipped) = (0, 0);
        for _ in 0..200 {
            match client.find_matches(0, vec![1, 2, 3], "m", &[], 48).await {
                Err(MatchesError::Status(status)) if unreached(&status) => unavailable += 1,
                Err(MatchesError::Unreachable) => skipped += 1,
                other => anyhow::bail!("neither a failed nor a skipped lookup: {other:?}"),
            }
        }
        server.abort();
        // The first backoff is at most RECONNECT_INITIAL: the loop may outlast a few of them.
        assert!(unavailable >= 1 && skipped >= 150, "{unavailable} tried, {skipped} skipped");
        assert!(accepted.load(Ordering::Relaxed) <= 10, "{} connections", accepted.load(Ordering::Relaxed));
        Ok(())
    }

    /// Lookup numbers run on from a random start, one replica's unlike another's: no replica
    /// can guess the numbers another will report its dispatches with.
    #[tokio::test]
    async fn lookup_numbers_start_where_no_other_replica_can_guess() -> anyhow::Result<()> {
        let config = FleetClientConfig::new("http://127.0.0.1:1", "r1");
        let (a, b) = (
            MatchesClient::new(&config, Duration::from_secs(1))?,
            MatchesClient::new(&config, Duration::from_secs(1))?,
        );
        let first = a.number_lookup();
        assert_eq!(a.number_lookup(), first + 1, "one past the last");
        assert_ne!(b.number_lookup(), first, "each client starts at its own");
        assert!(first != 0 && first < 1 << 62);
        Ok(())
    }

    /// A port nobody listens on: refused connections back off too.
    #[tokio::test]
    async fn lookups_back_off_from_a_refused_port() -> anyhow::Result<()> {
        let port = tokio::net::TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
        let client =
            MatchesClient::new(&FleetClientConfig::new(format!("http://{port}"), "r1"), Duration::from_secs(1))?;
        let first = client.find_matches(0, vec![1], "m", &[], 16).await;
        assert!(matches!(&first, Err(MatchesError::Status(status)) if unreached(status)), "{first:?}");
        let mut skipped = 0;
        for _ in 0..50 {
            skipped += usize::from(matches!(
                client.find_matches(0, vec![1], "m", &[], 16).await,
                Err(MatchesError::Unreachable)
            ));
        }
        // Each failure skips lookups for a draw of up to 100 ms, then 200, 400…
        assert!(skipped >= 40, "{skipped} of 50 skipped");
        Ok(())
    }

    /// The control plane's answer that refuses a lookup is no reason to stop asking.
    #[test]
    fn a_refusal_is_an_answer() {
        assert!(!unreached(&tonic::Status::unauthenticated("a wrong token")));
        assert!(!unreached(&tonic::Status::invalid_argument("too many hashes")));
        assert!(unreached(&tonic::Status::unavailable("connection refused")));
    }

    #[test]
    fn an_answer_ends_the_backoff_and_lookups_failing_together_count_once() {
        let reach = Reach::default();
        assert!(!reach.skipping(0));
        reach.missed(1_000);
        let until = reach.skip_until_ms.load(Ordering::Relaxed);
        assert!(reach.skipping(1_000) && until <= 1_000 + RECONNECT_INITIAL.as_millis() as u64, "{until}");
        // Another lookup of the same moment failing: the same window, no doubling.
        reach.missed(1_000);
        assert_eq!(reach.skip_until_ms.load(Ordering::Relaxed), until);
        reach.reached();
        assert!(!reach.skipping(1_000), "answered: lookups go on at once");
        // Lookups out of time, even long after the last answer: a miss only once they have
        // gone a second unanswered.
        reach.timed_out(60_000);
        assert!(!reach.skipping(60_000), "a control plane slow for one lookup is no outage");
        reach.timed_out(60_500);
        assert!(!reach.skipping(60_500));
        reach.timed_out(61_000);
        assert!(reach.skipping(61_000), "a second unanswered backs off");
        reach.reached();
        reach.timed_out(61_100);
        assert!(!reach.skipping(61_100), "an answer ends the silence and the backoff: the clock starts over");
        // One out of time, then nothing for an hour, then another: no silence of a second.
        reach.timed_out(3_700_000);
        assert!(!reach.skipping(3_700_000), "lookups out of time an hour apart are no outage");
    }

    /// Lookups backing off are warned of when they start, and again no sooner than a minute
    /// later however many windows open meanwhile.
    #[test]
    fn a_backoff_is_warned_of_at_most_once_a_minute() {
        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || writer.clone()).finish();
        tracing::subscriber::with_default(subscriber, || {
            let reach = Reach::default();
            for now in [1, 30_000, 59_000, 61_000, 70_000] {
                reach.reached();
                reach.missed(now);
                assert!(reach.skipping(now));
            }
        });
        let text = String::from_utf8_lossy(&lines.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned();
        assert_eq!(text.matches("KV lookups: the control plane could not be reached").count(), 2, "{text}");
    }

    /// The backoff's windows are no pause in the lookups: one out of time as a window ends
    /// opens the next at once, however long the window was, and not after another second of
    /// lookups each waiting out its deadline.
    #[test]
    fn a_lookup_out_of_time_after_a_window_opens_the_next() {
        let reach = Reach::default();
        for now in [1, 500, 1_001] {
            reach.timed_out(now);
        }
        assert!(reach.skipping(1_001));
        let mut longest = 0;
        // Windows grow toward 5 s: within twenty, some are past a second.
        for _ in 0..20 {
            let until = reach.skip_until_ms.load(Ordering::Relaxed);
            let window = until - reach.timed_out_ms.load(Ordering::Relaxed);
            longest = longest.max(window);
            reach.timed_out(until);
            assert!(reach.skipping(until), "a window of {window} ms ended: the next opens");
        }
        assert!(longest >= UNANSWERED_FOR_MS, "a window past a second was drawn: {longest} ms");
    }

    /// A control plane that takes the connection and then answers nothing (stopped, or
    /// overloaded): without a backoff every lookup would wait out its deadline for the whole
    /// outage; after a second of silence they are skipped, as for a refusal.
    #[tokio::test]
    async fn lookups_back_off_from_a_control_plane_that_answers_nothing() -> anyhow::Result<()> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        let client = MatchesClient::new(&FleetClientConfig::new(url, "r1"), FIND_MATCHES_DEADLINE)?;
        // Until a lookup is skipped: a second past the first out of time, and more on a
        // machine that stalls this test's runtime, but bounded.
        let until = Instant::now() + Duration::from_secs(15);
        let (mut timed_out, mut skipped) = (0, 0);
        while skipped == 0 && Instant::now() < until {
            match client.find_matches(0, vec![1], "m", &[], 16).await {
                Err(MatchesError::Deadline(_)) => timed_out += 1,
                Err(MatchesError::Unreachable) => skipped += 1,
                other => anyhow::bail!("neither timed out nor skipped: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        server.abort();
        assert!(timed_out > 0 && skipped > 0, "{timed_out} lookups timed out, {skipped} skipped");
        Ok(())
    }
}
