//! The `continuum.fleet.v1.Fleet` service: admits Watch streams, answers GetSnapshot, and looks
//! up KV prefix overlap for FindMatches.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use continuum_kv_index::RankKey;
use continuum_proto::MAX_LOOKUP_PROMPT_TOKENS;
use continuum_proto::convert::snapshot_to_wire;
use continuum_proto::pb::{self, fleet_server::Fleet, watch_request::Kind};
use futures::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::gate::{Gate, Presented, retired};
use super::lookup_budget::{LookupBudget, MAX_LOOKUP_BYTES_IN_FLIGHT, MAX_LOOKUP_BYTES_PER_CONNECTION, Refusals};
use super::session::{Queued, REPLICA_QUEUE_CAPACITY, ReplicaStatus, Session};
use super::turns::Turns;
use crate::bearer;
use crate::fleet::{ActiveIndex, BacklogBook, BookCounters, FleetPublisher};
use crate::kv::{KvHandle, LookupKey, Suggestion};
use crate::metrics::Metrics;

/// How long a new stream may take to send its Hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Watch streams read for their Hello at once. Until its Hello has come, a stream holds no
/// stream place, but what it has sent of its first message (up to the inbound message bound);
/// others wait their turn within the Hello's deadline. An honest Hello is read in well under a
/// millisecond, so a reconnecting fleet hardly waits.
const MAX_PENDING_HELLOS: usize = 64;
/// How long a stream may hold its turn for its Hello: an honest one was sent as the stream
/// opened, so streams that hold turns without one cannot keep the others out for long.
const HELLO_TURN: Duration = Duration::from_secs(1);

use continuum_proto::MAX_REPLICA_ID_BYTES;

/// Watch streams open at once, one per replica: each holds a queue of updates and up to
/// [`MAX_DISPATCHES_PER_REPLICA`](crate::fleet::MAX_DISPATCHES_PER_REPLICA) dispatches, so a
/// caller opening stream after stream (with the token) could otherwise hold without bound.
pub const MAX_WATCH_SESSIONS: usize = 1024;
/// Watch streams open at once, sessions and the streams of sessions over alike. A session ends
/// at once (its replica read nothing for the stall limit, say), but its stream, with the
/// updates queued in it, lives until the replica's HTTP/2 stack lets go of it: a client that
/// never grants window holds it for as long as its connection answers pings. So each stream
/// holds a place until it is dropped, and there are twice as many places as sessions.
pub const MAX_WATCH_STREAMS: usize = 2 * MAX_WATCH_SESSIONS;

/// The replicas with an open Watch stream, for the admin API and tests.
#[derive(Debug, Default, Clone)]
pub struct Replicas {
    inner: Arc<Mutex<BTreeMap<u64, Open>>>,
    next_id: Arc<AtomicU64>,
}

/// One open Watch stream: what the admin API reads, and how to end the session early.
#[derive(Debug)]
struct Open {
    status: Arc<ReplicaStatus>,
    ended: CancellationToken,
    /// A later session of the replica has queued its departure for the book: another would
    /// only repeat it. With its own goodbye, a session departs at most twice, the room the
    /// book's queue keeps for departures; without the mark, k reconnects in a row while their
    /// predecessors linger would queue on the order of k² of them.
    forgotten: bool,
}

impl Replicas {
    /// The live sessions: one ended (superseded by its replica's reconnect, or going) is not
    /// listed while it is being removed, so a replica is listed once and `/readyz` counts it once.
    pub fn list(&self) -> Vec<Arc<ReplicaStatus>> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.values().filter(|open| !open.ended.is_cancelled()).map(|open| open.status.clone()).collect()
    }

    /// Admits a session under a new id, ending every open session of the same replica id: a
    /// replica that reconnects has given up its old stream, whatever this side has noticed,
    /// and the dispatches reported on it are in flight under the new stream's count. Returns
    /// the new id, how many live sessions it superseded, and the ids of the replica's sessions
    /// not yet removed nor handed to an earlier successor (whose dispatches the book must
    /// forget before the new session's first report); `None`, changing nothing, when
    /// [`MAX_WATCH_SESSIONS`] other replicas hold one.
    fn insert(&self, status: Arc<ReplicaStatus>, ended: CancellationToken) -> Option<(u64, usize, Vec<u64>)> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // A session already ended but not yet removed is not ended again (nor counted).
        let live = |open: &&Open| !open.ended.is_cancelled();
        let mine = |open: &&Open| open.status.replica_id == status.replica_id;
        if inner.values().filter(live).filter(|open| !mine(open)).count() >= MAX_WATCH_SESSIONS {
            return None;
        }
        let mut superseded = 0;
        for open in inner.values().filter(live).filter(mine) {
            open.ended.cancel();
            superseded += 1;
        }
        let mut previous = Vec::new();
        for (id, open) in
            inner.iter_mut().filter(|(_, open)| !open.forgotten && open.status.replica_id == status.replica_id)
        {
            open.forgotten = true;
            previous.push(*id);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        inner.insert(id, Open { status, ended, forgotten: false });
        Some((id, superseded, previous))
    }

    fn remove(&self, id: u64) {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    }
}

#[derive(Clone)]
pub struct FleetService {
    publisher: FleetPublisher,
    replicas: Replicas,
    metrics: Metrics,
    /// Ends every session, so a graceful shutdown is not held open by long-lived streams.
    shutdown: CancellationToken,
    book: BacklogBook,
    /// The blocks the book's dispatches in flight hold, for `FindMatches`' active overlaps.
    active: ActiveIndex,
    kv: KvHandle,
    /// Each answer's `turn`, per model.
    turns: Arc<Turns>,
    /// Whether discovery has seeded the fleet; a Watch opened before is refused.
    seeded: Arc<dyn Fn() -> bool + Send + Sync>,
    /// `control_plane.token` (and `previous_token`): every call must present one when set.
    tokens: watch::Receiver<Vec<bearer::Token>>,
    /// Changes of the client CA ([`FleetService::with_trust`]).
    trust: watch::Receiver<u64>,
    /// The places of the Watch streams open ([`MAX_WATCH_STREAMS`]).
    streams: Arc<Semaphore>,
    /// The turns of the streams read for their Hello ([`MAX_PENDING_HELLOS`]).
    hellos: Arc<Semaphore>,
    /// The bytes of lookups in flight, charged by the server's [`Budgeted`](super::Budgeted) wrapper.
    lookups: Arc<LookupBudget>,
}

impl std::fmt::Debug for FleetService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetService").field("publisher", &self.publisher).finish_non_exhaustive()
    }
}

impl FleetService {
    /// The service, with its fleet-wide dispatch book (a task that lives until `shutdown`).
    pub fn new(publisher: FleetPublisher, replicas: Replicas, metrics: Metrics, shutdown: CancellationToken) -> Self {
        let active = ActiveIndex::default();
        let book = BacklogBook::spawn(
            publisher.clone(),
            active.clone(),
            BookCounters {
                refused: metrics.dispatches_refused.clone(),
                chains_dropped: metrics.dispatch_chains_dropped.clone(),
                replayed: metrics.dispatches_replayed.clone(),
                restarts: metrics.dispatch_book_restarts.clone(),
            },
            shutdown.clone(),
        );
        let turns = Arc::default();
        let seeded = Arc::new(|| true);
        let (tokens, trust) = (watch::channel(Vec::new()).1, watch::channel(0).1);
        let kv = KvHandle::default();
        let (streams, hellos) =
            (Arc::new(Semaphore::new(MAX_WATCH_STREAMS)), Arc::new(Semaphore::new(MAX_PENDING_HELLOS)));
        let lookups = lookups_budget(&metrics, (MAX_LOOKUP_BYTES_IN_FLIGHT, MAX_LOOKUP_BYTES_PER_CONNECTION));
        Self {
            publisher,
            replicas,
            metrics,
            shutdown,
            book,
            active,
            kv,
            turns,
            seeded,
            tokens,
            trust,
            streams,
            hellos,
            lookups,
        }
    }

    /// Holds at most `bytes` of lookups in flight, `per_connection` of them for one
    /// connection's calls (else [`MAX_LOOKUP_BYTES_IN_FLIGHT`] and
    /// [`MAX_LOOKUP_BYTES_PER_CONNECTION`]).
    #[cfg(test)]
    pub fn with_lookup_budget(self, (bytes, per_connection): (usize, usize)) -> Self {
        Self { lookups: lookups_budget(&self.metrics, (bytes, per_connection)), ..self }
    }

    /// The budget the server charges this service's lookups to.
    pub fn lookup_budget(&self) -> Arc<LookupBudget> {
        Arc::clone(&self.lookups)
    }

    /// Every call must present `authorization: Bearer <token>` with one of `tokens`, while it
    /// holds any: the stream, the fleet it carries (worker and shim addresses), the dispatch
    /// reports and the lookups are all the replicas'. The check is the [`Gate`] this service is
    /// served behind ([`FleetService::gate`]); a change applies to calls made after it, and
    /// ends the Watch streams opened with a token no longer accepted.
    pub fn with_tokens(self, tokens: watch::Receiver<Vec<bearer::Token>>) -> Self {
        Self { tokens, ..self }
    }

    /// Ends the Watch streams opened before each change `trust` counts (the client CA's,
    /// [`super::ServerTls::trust_changes`]): their connections were verified against a CA that
    /// may no longer trust them, and they reconnect to be verified against the new one.
    pub fn with_trust(self, trust: watch::Receiver<u64>) -> Self {
        Self { trust, ..self }
    }

    /// The token check to serve this service behind, run before a call's message is read.
    pub fn gate(&self) -> Gate {
        Gate { tokens: self.tokens.clone(), unauthenticated: self.metrics.unauthenticated.clone() }
    }

    /// Where calls of kind `call` refused for want of room are counted.
    pub fn calls_refused(&self, call: &str) -> prometheus::IntCounter {
        self.metrics.calls_refused.with_label_values(&[call])
    }

    /// Answers `FindMatches` from `kv` (without it, every call is refused as disabled).
    pub fn with_kv(self, kv: KvHandle) -> Self {
        Self { kv, ..self }
    }

    /// Refuses new Watch streams (`UNAVAILABLE`) while `seeded` says discovery has not produced
    /// a full view since the fleet was last emptied: the first snapshot a replica takes
    /// replaces everything it holds, so a control plane that just restarted would otherwise
    /// hand every reconnecting replica an empty fleet in place of its last-known-good one.
    pub fn with_seeded(self, seeded: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self { seeded: Arc::new(seeded), ..self }
    }

    #[cfg(test)]
    fn with_stream_places(self, places: usize) -> Self {
        Self { streams: Arc::new(Semaphore::new(places)), ..self }
    }

    #[cfg(test)]
    fn with_hello_turns(self, hellos: Arc<Semaphore>) -> Self {
        Self { hellos, ..self }
    }

    /// The first message of a stream must be a Hello naming the replica, within
    /// [`HELLO_TIMEOUT`], read in one of [`MAX_PENDING_HELLOS`] turns.
    async fn read_hello(&self, inbound: &mut Streaming<pb::WatchRequest>) -> Result<pb::Hello, Status> {
        let deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
        let refused = |reason: &str, status: Status| {
            self.metrics.watch_refused.with_label_values(&[reason]).inc();
            status
        };
        let Ok(Ok(_turn)) = tokio::time::timeout_at(deadline, self.hellos.acquire()).await else {
            return Err(refused(
                "too_many_hellos",
                Status::resource_exhausted(format!(
                    "{MAX_PENDING_HELLOS} other Watch streams were read for their Hello for {HELLO_TIMEOUT:?}; retry later"
                )),
            ));
        };
        let read_by = deadline.min(tokio::time::Instant::now() + HELLO_TURN);
        let first = tokio::time::timeout_at(read_by, inbound.message()).await;
        let hello = match first {
            Err(_) => {
                return Err(refused(
                    "no_hello",
                    Status::deadline_exceeded(format!(
                        "no Hello within {HELLO_TIMEOUT:?} of opening Watch, or {HELLO_TURN:?} of its turn to be read"
                    )),
                ));
            }
            // One that could not be decoded (malformed, or past the message bound).
            Ok(Err(status)) => return Err(refused("bad_hello", status)),
            Ok(Ok(None)) => return Err(refused("no_hello", Status::cancelled("stream closed before its Hello"))),
            Ok(Ok(Some(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }))) => hello,
            Ok(Ok(Some(_))) => {
                return Err(refused("bad_hello", Status::invalid_argument("the first Watch message must be a Hello")));
            }
        };
        if !continuum_proto::valid_replica_id(&hello.replica_id) {
            return Err(refused(
                "bad_hello",
                Status::invalid_argument(format!(
                    "Hello.replica_id must be 1 to {MAX_REPLICA_ID_BYTES} printable ASCII characters, without spaces"
                )),
            ));
        }
        Ok(hello)
    }
}

/// Returns once the client CA changes; never if it cannot (no TLS, or the control plane is
/// stopping).
async fn trust_changed(mut trust: watch::Receiver<u64>) {
    if trust.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

#[tonic::async_trait]
impl Fleet for FleetService {
    type WatchStream = WatchUpdates;

    async fn watch(
        &self,
        request: Request<Streaming<pb::WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        // Served without the gate (in tests), a call presented nothing.
        let presented = request.extensions().get::<Presented>().and_then(|presented| presented.0);
        if !(self.seeded)() {
            self.metrics.watch_refused.with_label_values(&["not_seeded"]).inc();
            return Err(Status::unavailable(
                "discovery has not produced a fleet view yet; keep the view held and retry",
            ));
        }
        let mut inbound = request.into_inner();
        let hello = self.read_hello(&mut inbound).await?;
        // Taken once the hello came: a stream without one holds nothing past `HELLO_TIMEOUT`.
        let Ok(place) = Arc::clone(&self.streams).try_acquire_owned() else {
            self.metrics.watch_refused.with_label_values(&["too_many_streams"]).inc();
            return Err(Status::resource_exhausted(format!(
                "the control plane holds {MAX_WATCH_STREAMS} Watch streams (some of sessions over, their clients reading nothing); retry later"
            )));
        };
        tracing::info!(replica = %hello.replica_id, held = ?hello.version, "replica connected");
        let (tx, rx) = mpsc::channel(REPLICA_QUEUE_CAPACITY);
        // Says why, when the stream is ended for its token.
        let goodbye = tx.clone();
        let status = Arc::new(ReplicaStatus::new(hello.replica_id));
        let (replicas, metrics, shutdown, book) =
            (self.replicas.clone(), self.metrics.clone(), self.shutdown.clone(), self.book.clone());
        let ended = shutdown.child_token();
        let Some((id, superseded, previous)) = replicas.insert(Arc::clone(&status), ended.clone()) else {
            metrics.watch_refused.with_label_values(&["too_many_sessions"]).inc();
            continuum_proto::warn_limited!(replica = %status.replica_id, "refusing a Watch stream: {MAX_WATCH_SESSIONS} replicas hold one");
            return Err(Status::resource_exhausted(format!(
                "the control plane serves at most {MAX_WATCH_SESSIONS} replicas at once; retry later"
            )));
        };
        if superseded > 0 {
            // Two live replicas configured with one id would take turns ending each other's
            // stream: the warning and the counter name it.
            continuum_proto::warn_limited!(
                replica = %status.replica_id,
                superseded,
                "replica reconnected while its previous stream was open; ending that stream and \
                 forgetting its dispatches (if two replicas share this id, give each its own)"
            );
            metrics.watch_superseded.inc_by(superseded as u64);
        }
        let session = Session::new(
            self.publisher.subscribe(),
            (inbound, tx),
            Arc::clone(&status),
            metrics.clone(),
            (book.session(), id),
            self.kv.clone(),
        );
        metrics.replicas_connected.inc();
        // On a task of its own from here, so that nothing awaited can be dropped with the call
        // and leave the session listed.
        let forget = book.clone();
        let tokens = self.tokens.clone();
        let mut trust = self.trust.clone();
        // Changes before this stream opened are not its own.
        trust.mark_unchanged();
        let replica = Arc::clone(&status);
        tokio::spawn(async move {
            let serve = async move {
                // Forgotten ahead of anything the new stream reports: it reports the same
                // dispatches again, and the old sessions' own goodbyes may come later (they
                // are idempotent).
                for old in previous {
                    forget.replica_gone(old).await;
                }
                // A panic in the session must not skip the goodbye below: the book would hold
                // its dispatches, and list it among the stream's sharers, until they aged out.
                if AssertUnwindSafe(session.run()).catch_unwind().await.is_err() {
                    tracing::error!(replica = %replica.replica_id, "a Watch session panicked; forgetting it as if its stream had ended");
                }
            };
            // Biased, the credential's arms first: a stream whose token is retired, or whose
            // client CA changed, ends before its session sends anything more (a reload swaps
            // the tokens before it publishes the new fleet).
            tokio::select! {
                biased;
                () = retired(tokens, presented) => {
                    metrics.watch_retired.inc();
                    tracing::warn!(replica = %status.replica_id, "ending a Watch stream: the token it was opened with is no longer accepted");
                    let status = Status::unauthenticated(
                        "the token this stream was opened with is no longer accepted; reconnect with control_plane.token",
                    );
                    super::session::say_goodbye(&goodbye, status).await;
                }
                () = trust_changed(trust) => {
                    metrics.watch_retired.inc();
                    tracing::warn!(replica = %status.replica_id, "ending a Watch stream: the client CA it was verified against changed");
                    // Not a refusal: a replica the new CA trusts reconnects at its usual pace.
                    let status = Status::unavailable(
                        "the control plane's client CA changed; reconnect to be verified against the new one",
                    );
                    super::session::say_goodbye(&goodbye, status).await;
                }
                () = ended.cancelled() => {
                    if shutdown.is_cancelled() {
                        // The replica keeps routing on its last view, as it knows to from
                        // here on, and dials again.
                        let status = Status::unavailable("the control plane is shutting down");
                        super::session::say_goodbye(&goodbye, status).await;
                    } else {
                        // A newer stream of the same replica id replaced this one. Its own
                        // replica has left it and reads nothing; another replica configured
                        // with the same id learns why it lost its stream.
                        let status = Status::aborted(format!(
                            "a newer Watch stream of replica id {} replaced this one; if another replica runs with \
                             the same id, give each its own (--replica-id)",
                            status.replica_id
                        ));
                        super::session::say_goodbye(&goodbye, status).await;
                    }
                }
                () = serve => {}
            }
            // The stream ends here, not once the book has forgotten the session.
            drop(goodbye);
            // Off the list first: a stream its replica opens from here on is no second replica
            // of the same id. Its replay, were it folded before this goodbye, has the book
            // forget this session first (`Book::report`).
            replicas.remove(id);
            book.replica_gone(id).await;
            metrics.replicas_connected.dec();
            tracing::info!(replica = %status.replica_id, "replica disconnected");
        });
        Ok(Response::new(WatchUpdates { updates: ReceiverStream::new(rx), _place: place }))
    }

    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        let state = self.publisher.current();
        Ok(Response::new(snapshot_to_wire(state.view(), Instant::now())))
    }

    async fn find_matches(
        &self,
        request: Request<pb::FindMatchesRequest>,
    ) -> Result<Response<pb::FindMatchesResponse>, Status> {
        let pb::FindMatchesRequest { block_hashes: hashes, model, contenders, prompt_tokens, replica_id, lookup } =
            request.into_inner();
        let count = |result: &str| self.metrics.kv_find_matches.with_label_values(&[result]).inc();
        let Some(overlaps) = self.kv.overlaps(&hashes) else {
            count("disabled");
            return Err(Status::failed_precondition("the KV index is off: dynamo.kv.enabled is false"));
        };
        count("ok");
        // A rank holding blocks in flight holds them in its cache (or provisionally), so the
        // ranks listed are the only ones whose active overlap can matter.
        let active = self.active.depths(&hashes, overlaps.iter().copied());
        let overlaps = overlaps
            .into_iter()
            .zip(active)
            .map(|((rank, blocks), active_blocks)| pb::RankOverlap {
                instance_id: rank.worker_id,
                dp_rank: rank.dp_rank,
                blocks,
                active_blocks,
            })
            .collect();
        // Numbered last, so that two lookups answered in one order carry turns in that order.
        // Replicas rotate ties by it: a fleet-wide cursor that costs no round trip of its own.
        let turn = self.turns.next(&model, Instant::now());
        // At most `MAX_LOOKUP_CONTENDERS` (the codec refused more) and as many hashes.
        let contenders: Vec<RankKey> =
            contenders.iter().map(|c| RankKey { worker_id: c.instance_id, dp_rank: c.dp_rank }).collect();
        let prompt_tokens = prompt_tokens.min(MAX_LOOKUP_PROMPT_TOKENS);
        // A key that is no replica id (`Hello` refuses it) names no session's lookups; answered
        // all the same.
        let valid = continuum_proto::valid_replica_id(&replica_id);
        let key = valid.then_some(LookupKey { replica: &replica_id, lookup });
        let suggestion = self.kv.answer_lookup(key, &contenders, prompt_tokens);
        // A caller's id that is none is not logged whole: it may be megabytes.
        let replica = if valid { replica_id.as_str() } else { "(not a replica id)" };
        tracing::debug!(target: "continuum_control_plane::lookups", replica, lookup, turn, ?suggestion, "lookup answered");
        let wire = |rank: RankKey| Some(pb::RankId { instance_id: rank.worker_id, dp_rank: rank.dp_rank });
        let (suggestion, tie_break, reserved_tokens) = match suggestion {
            Some(Suggestion::Weighed { rank, reserved_tokens }) => {
                self.metrics.kv_find_matches_suggested.inc();
                (wire(rank), None, reserved_tokens)
            }
            Some(Suggestion::TieBreak(rank)) => (None, wire(rank), 0),
            None => (None, None, 0),
        };
        let answer = pb::FindMatchesResponse { overlaps, turn, suggestion, tie_break, reserved_tokens };
        Ok(Response::new(answer))
    }
}

/// A budget of `bytes` for lookups in flight, `per_connection` of them for one connection's
/// calls; its refusals counted as `over_budget` and `over_connection_budget`.
fn lookups_budget(metrics: &Metrics, (bytes, per_connection): (usize, usize)) -> Arc<LookupBudget> {
    let counted = |result: &str| metrics.kv_find_matches.with_label_values(&[result]);
    let refused =
        Refusals { over_budget: counted("over_budget"), over_connection_budget: counted("over_connection_budget") };
    Arc::new(LookupBudget::new((bytes, per_connection), refused, metrics.kv_lookup_bytes_held.clone()))
}

/// A Watch stream's updates, holding the stream's place ([`MAX_WATCH_STREAMS`]) until tonic
/// drops it. Each is taken as the stream sends: samples are aged by the time their update
/// waited.
#[derive(Debug)]
pub struct WatchUpdates {
    updates: ReceiverStream<Result<Queued, Status>>,
    _place: OwnedSemaphorePermit,
}

impl tokio_stream::Stream for WatchUpdates {
    type Item = Result<pb::FleetUpdate, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.updates).poll_next(cx).map(|queued| queued.map(|queued| queued.map(Queued::taken)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams are read for their Hello a few at once: one that sends none holds its turn
    /// (until its deadline, or here until it closes), and the next waits for it.
    #[tokio::test]
    async fn streams_wait_their_turn_to_be_read_for_their_hello() -> anyhow::Result<()> {
        use continuum_proto::pb::fleet_client::FleetClient;

        let (service, metrics, cancel) = super::super::tests::empty_fleet_service()?;
        let turns = Arc::new(Semaphore::new(1));
        let url = super::super::tests::serving(service.with_hello_turns(Arc::clone(&turns)), &metrics, &cancel).await?;
        let (silent_tx, silent_rx) = mpsc::channel::<pb::WatchRequest>(1);
        let silent = {
            let url = url.clone();
            tokio::spawn(async move {
                let mut client = FleetClient::connect(url).await?;
                anyhow::Ok(client.watch(ReceiverStream::new(silent_rx)).await.map(|_| ()))
            })
        };
        let taken = tokio::time::timeout(Duration::from_secs(5), async {
            while turns.available_permits() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        taken.await?;
        let mut client = FleetClient::connect(url).await?;
        let (tx, rx) = mpsc::channel(1);
        let hello = pb::Hello { replica_id: "waiting".into(), version: None };
        tx.send(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }).await?;
        let waiting = client.watch(ReceiverStream::new(rx));
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(300), waiting.as_mut()).await;
        assert!(early.is_err(), "it waits while the silent stream holds the only turn");
        assert_eq!(metrics.replicas_connected.get(), 0, "no session was opened for it meanwhile");
        drop(silent_tx);
        let closed = silent.await??;
        // Closed without a Hello, or (on a slow machine) past its turn's second.
        let code = closed.err().map(|status| status.code());
        assert!(matches!(code, Some(tonic::Code::Cancelled | tonic::Code::DeadlineExceeded)), "{code:?}");
        let admitted = tokio::time::timeout(Duration::from_secs(5), waiting).await?;
        assert!(admitted.is_ok(), "then its turn came: {admitted:?}");
        assert_eq!(metrics.watch_refused.with_label_values(&["no_hello"]).get(), 1);
        cancel.cancel();
        Ok(())
    }

    /// An open stream holds its place; past the places a new stream is refused, counted, and
    /// the place comes back once the stream is dropped. (That a place outlives its session
    /// while the client holds a stream it never reads is the permit's: it goes with the
    /// response body, which hyper drops only once the stream is done.)
    #[tokio::test]
    async fn a_watch_stream_holds_its_place_until_it_is_dropped() -> anyhow::Result<()> {
        use continuum_proto::pb::fleet_client::FleetClient;

        let (service, metrics, cancel) = super::super::tests::empty_fleet_service()?;
        let url = super::super::tests::serving(service.with_stream_places(1), &metrics, &cancel).await?;
        let hello =
            |id: &str| pb::WatchRequest { kind: Some(Kind::Hello(pb::Hello { replica_id: id.into(), version: None })) };
        let open = |id: &'static str| {
            let url = url.clone();
            async move {
                let mut client = FleetClient::connect(url).await?;
                let (tx, rx) = mpsc::channel(1);
                tx.send(hello(id)).await?;
                let stream = client.watch(ReceiverStream::new(rx)).await.map(Response::into_inner);
                anyhow::Ok((stream, tx))
            }
        };
        let (first, first_tx) = open("a").await?;
        let mut first = first?;
        assert!(first.message().await?.is_some(), "the snapshot");
        let (refused, _) = open("b").await?;
        assert_eq!(refused.err().map(|status| status.code()), Some(tonic::Code::ResourceExhausted));
        assert_eq!(metrics.watch_refused.with_label_values(&["too_many_streams"]).get(), 1);
        drop((first, first_tx));
        let admitted = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let (Ok(_), tx) = open("b").await? {
                    return anyhow::Ok(tx);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        admitted.await??;
        cancel.cancel();
        Ok(())
    }

    /// A shutdown tells each Watch stream why it ends, and a client watching the server's
    /// health hears it go out of service before its stream is cut.
    #[tokio::test]
    async fn a_shutdown_says_so_on_each_watch_stream_and_to_health_watchers() -> anyhow::Result<()> {
        use continuum_proto::pb::fleet_client::FleetClient;
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

        let (service, metrics, cancel) = super::super::tests::empty_fleet_service()?;
        let url = super::super::tests::serving(service, &metrics, &cancel).await?;
        let channel = tonic::transport::Channel::from_shared(url)?.connect().await?;
        let mut health =
            HealthClient::new(channel.clone()).watch(HealthCheckRequest { service: String::new() }).await?.into_inner();
        let serving = health.message().await?.map(|answer| answer.status);
        assert_eq!(serving, Some(ServingStatus::Serving as i32));
        let (tx, rx) = mpsc::channel(1);
        let hello = pb::Hello { replica_id: "leaving".into(), version: None };
        tx.send(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }).await?;
        let mut updates = FleetClient::new(channel).watch(ReceiverStream::new(rx)).await?.into_inner();
        assert!(updates.message().await?.is_some(), "the snapshot");

        cancel.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match updates.message().await {
                    Ok(Some(_)) => continue,
                    ended => return ended.map(|_| ()),
                }
            }
        });
        let status = ended.await?.expect_err("the stream ends with a status");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("shutting down"), "{status:?}");
        let heard = tokio::time::timeout(Duration::from_secs(10), health.message()).await?;
        assert_eq!(heard?.map(|answer| answer.status), Some(ServingStatus::NotServing as i32));
        drop(tx);
        Ok(())
    }

    #[test]
    fn a_bounded_number_of_replicas_hold_a_stream_and_a_reconnecting_one_is_never_refused() {
        let replicas = Replicas::default();
        let open = |id: &str| replicas.insert(Arc::new(ReplicaStatus::new(id.to_string())), CancellationToken::new());
        for n in 0..MAX_WATCH_SESSIONS {
            assert!(open(&format!("replica-{n}")).is_some());
        }
        assert_eq!(open("one-too-many"), None, "a new replica past the bound is refused");
        assert_eq!(replicas.list().len(), MAX_WATCH_SESSIONS, "and nothing changed");
        // A replica reconnecting takes its own place: its old stream is superseded.
        let (_, superseded, previous) = open("replica-7").expect("a reconnect is admitted");
        assert_eq!((superseded, previous.len()), (1, 1));
        // Sessions superseded but not yet removed do not count against the bound: with the
        // newest replica-7 session gone, a newcomer finds room though two superseded ones are
        // still listed.
        let (id, _, previous) = open("replica-7").expect("admitted");
        assert_eq!(previous.len(), 1, "the one superseded before was handed to its successor: not again");
        replicas.remove(id);
        assert!(open("a-newcomer").is_some(), "superseded sessions take no place");
    }
}
