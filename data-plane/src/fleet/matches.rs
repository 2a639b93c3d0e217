//! `FindMatches`: asks the control plane's KV index how much of a request's prefix each rank
//! holds, under a deadline tight enough to sit on the request path. Any miss (deadline, error,
//! the index switched off) is the caller's cue to pick without the KV term.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use continuum_proto::pb::{self, fleet_client::FleetClient};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::client::{EndpointError, FleetClientConfig};
use super::credentials::{ClientTls, Credentials};
use crate::routing::picker::{RankOverlap, Suggested};

/// The default deadline of one lookup (seed: "the FindMatches call under a deadline (default
/// ≤ 2 ms)"): past it the request is scored without overlap credit.
pub const FIND_MATCHES_DEADLINE: Duration = Duration::from_millis(2);
/// Connecting to the control plane for lookups, and its answer to a keep-alive ping.
const MATCHES_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum MatchesError {
    #[error("FindMatches took longer than {0:?}")]
    Deadline(Duration),
    #[error("FindMatches failed: {0}")]
    Status(#[from] tonic::Status),
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
    /// The last lookup number handed out (shared by clones).
    numbered: Arc<AtomicU64>,
    /// When a refused token was last warned about: seconds since `started` (0: never).
    warned_at: Arc<AtomicU64>,
    started: Instant,
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
        let (numbered, warned_at, started) = (Arc::default(), Arc::default(), Instant::now());
        Ok(Self { client, deadline, replica_id, numbered, warned_at, started })
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
        let Ok(mut seen) = stamp().await else { return };
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let Ok(now) = stamp().await else { continue };
            if now == seen {
                continue;
            }
            // A set that does not load (a half-written pair) is tried again at the next change.
            seen = now;
            let (client, renewed) = (self.clone(), config.clone());
            match tokio::task::spawn_blocking(move || client.renew(&renewed)).await {
                Ok(Ok(())) => tracing::info!("KV lookups: reconnecting with the renewed --control-plane TLS files"),
                Ok(Err(error)) => {
                    tracing::warn!(%error, "KV lookups: the renewed --control-plane TLS files do not load; keeping the current connection")
                }
                Err(error) => {
                    tracing::warn!(%error, "KV lookups: renewing the TLS connection failed; keeping the current one")
                }
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
        let now = self.started.elapsed().as_secs();
        let last = self.warned_at.load(Ordering::Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= 60;
        if due && self.warned_at.compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            tracing::warn!(
                "the control plane refused this replica's token for KV lookups: routing without overlap \
                 credit until --control-plane-token matches control_plane.token (or previous_token)"
            );
        }
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// A number for the next lookup, 1, 2, 3…: the replica reports it with the dispatch the
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
        let mut client = Client::clone(&self.client.load());
        let contenders = contenders.iter().map(|&(instance_id, dp_rank)| pb::RankId { instance_id, dp_rank }).collect();
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
        let reply =
            tokio::time::timeout(self.deadline, call).await.map_err(|_| MatchesError::Deadline(self.deadline))?;
        let reply = reply.inspect_err(|status| self.refused(status))?.into_inner();
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
