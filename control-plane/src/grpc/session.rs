//! One replica's Watch stream: sends a full snapshot, then deltas, and reads its acks.
//!
//! The session never queues more than [`REPLICA_QUEUE_CAPACITY`] updates for its replica. It
//! waits for room in that queue *before* deciding what to send, so what it sends is always
//! computed against the newest state: a replica that reads slowly receives fewer, larger deltas,
//! and one that fell behind the delta log receives one fresh snapshot, never a backlog.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use continuum_kv_index::RankKey;
use continuum_proto::convert::{delta_to_wire, snapshot_to_wire};
use continuum_proto::pb::{self, fleet_update::Body, watch_request::Kind};
use continuum_proto::{MAX_DISPATCH_BLOCK_HASHES, MAX_FLEET_MESSAGE_BYTES, MAX_REPORT_BLOCK_HASHES};
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};

use crate::fleet::{Catchup, FleetState, NotQueued, SessionReports, fit, plausible};
use crate::kv::{KvHandle, LookupKey};
use crate::metrics::Metrics;

/// Updates buffered for one replica at most (besides what HTTP/2 flow control holds).
pub const REPLICA_QUEUE_CAPACITY: usize = 4;
/// How long a replica behind the fleet may leave its stream without room for the next update.
/// One whose connection stays up (its HTTP/2 pings answered) but that reads nothing for this
/// long is following nothing: its session ends, and the replica, if it lives, dials again and
/// starts over from a snapshot. A replica reads its stream within milliseconds.
pub const REPLICA_STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
/// A refused delta is mended with a full snapshot at most once in this long: a replica that
/// refuses another delta sooner ends its session, and reconnects at its backoff's pace. Each
/// refusal is a few bytes, a snapshot up to the Fleet message bound.
pub const RESYNC_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) type Outbound = mpsc::Sender<Result<Queued, Status>>;

/// How long the status that ends a session waits for room in its replica's queue: the replica
/// learns why its stream ended (a retired token, a refused snapshot) rather than only that it
/// did, unless it has stopped reading.
const GOODBYE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Queues `status` as the last thing the replica reads, waiting briefly for room.
pub(crate) async fn say_goodbye(outbound: &Outbound, status: Status) {
    let _ = tokio::time::timeout(GOODBYE_WAIT, outbound.send(Err(status))).await;
}

/// Why a session ends on a replica's message: the `reason` label of
/// `continuum_fleet_watch_refused_total`, and the status the replica is told.
#[derive(Debug)]
struct Refused {
    reason: &'static str,
    status: Status,
}

impl Refused {
    fn new(reason: &'static str, status: Status) -> Self {
        Self { reason, status }
    }
}

/// An update waiting for its replica's stream to take it. Its samples' ages were measured when
/// it was built; [`Queued::taken`] adds the time it waited, so a replica slow to read (a
/// throttled CPU, a stalled network) does not take a sample for seconds fresher than it is.
#[derive(Debug)]
pub struct Queued {
    built: Instant,
    update: pb::FleetUpdate,
}

/// Bytes a sample may grow by as [`Queued::taken`] ages it: its age from nothing (an age of 0
/// is not written) to a tag and ten bytes, and its own length prefix by one.
const AGING_BYTES_PER_SAMPLE: usize = 12;

/// What `update` may take on the wire once its samples are aged by its wait in the queue.
fn bytes_once_aged(update: &pb::FleetUpdate) -> usize {
    let samples = match &update.body {
        Some(Body::Snapshot(snapshot)) => snapshot.loads.len(),
        Some(Body::Delta(delta)) => delta.loads.len(),
        None => 0,
    };
    prost::Message::encoded_len(update).saturating_add(samples.saturating_mul(AGING_BYTES_PER_SAMPLE))
}

impl Queued {
    pub(crate) fn new(update: pb::FleetUpdate) -> Self {
        Self { built: Instant::now(), update }
    }

    /// The update as the stream takes it, its samples aged by the time it waited.
    pub(crate) fn taken(self) -> pb::FleetUpdate {
        let waited = u64::try_from(self.built.elapsed().as_millis()).unwrap_or(u64::MAX);
        let mut update = self.update;
        if waited > 0 {
            let loads = match &mut update.body {
                Some(Body::Snapshot(snapshot)) => &mut snapshot.loads,
                Some(Body::Delta(delta)) => &mut delta.loads,
                None => return update,
            };
            for sample in loads {
                sample.age_ms = sample.age_ms.saturating_add(waited);
            }
        }
        update
    }
}

/// What the control plane knows about one connected replica; read by the admin API.
#[derive(Debug)]
pub struct ReplicaStatus {
    pub replica_id: String,
    pub sent_version: AtomicU64,
    pub acked_version: AtomicU64,
    pub nacks: AtomicU64,
    pub snapshots_sent: AtomicU64,
    pub queue_depth: AtomicUsize,
    /// The deepest the replica's queue has been; never above [`REPLICA_QUEUE_CAPACITY`].
    pub queue_high_water: AtomicUsize,
}

impl ReplicaStatus {
    pub fn new(replica_id: String) -> Self {
        Self {
            replica_id,
            sent_version: AtomicU64::new(0),
            acked_version: AtomicU64::new(0),
            nacks: AtomicU64::new(0),
            snapshots_sent: AtomicU64::new(0),
            queue_depth: AtomicUsize::new(0),
            queue_high_water: AtomicUsize::new(0),
        }
    }
}

enum Event<'a> {
    Inbound(Result<Option<pb::WatchRequest>, Status>),
    Room(mpsc::Permit<'a, Result<Queued, Status>>),
}

/// A snapshot sent, to match the reply that answers it.
#[derive(Debug, Clone)]
struct Sent {
    version: u64,
    nonce: String,
}

impl Sent {
    fn answered_by(&self, nack: &pb::Nack) -> bool {
        self.version == nack.version && self.nonce == nack.nonce
    }

    /// Whether `nack` refuses an update sent before this snapshot, which replaced it. After a
    /// snapshot at version V the next update is newer than V, so one at V with another nonce
    /// came before it.
    fn replaced(&self, nack: &pb::Nack) -> bool {
        nack.version < self.version || (nack.version == self.version && nack.nonce != self.nonce)
    }
}

pub(crate) struct Session {
    state: watch::Receiver<Arc<FleetState>>,
    inbound: Streaming<pb::WatchRequest>,
    outbound: Outbound,
    status: Arc<ReplicaStatus>,
    metrics: Metrics,
    /// Where the replica's dispatch reports go, under this session's id.
    book: SessionReports,
    session_id: u64,
    /// Where the reported dispatches' prefix chains are credited provisionally.
    kv: KvHandle,
    /// The version the replica holds, as far as the session knows.
    held: Option<u64>,
    /// The last snapshot sent: refusals of earlier updates are stale, and a refusal of it ends
    /// the session.
    last_snapshot: Option<Sent>,
    /// When a refused delta last brought a snapshot ([`RESYNC_INTERVAL`]).
    last_resync: Option<Instant>,
}

impl Session {
    pub(crate) fn new(
        state: watch::Receiver<Arc<FleetState>>,
        (inbound, outbound): (Streaming<pb::WatchRequest>, Outbound),
        status: Arc<ReplicaStatus>,
        metrics: Metrics,
        (book, session_id): (SessionReports, u64),
        kv: KvHandle,
    ) -> Self {
        Self {
            state,
            inbound,
            outbound,
            status,
            metrics,
            book,
            session_id,
            kv,
            held: None,
            last_snapshot: None,
            last_resync: None,
        }
    }

    /// Runs until the replica goes away or the control plane shuts down.
    pub(crate) async fn run(mut self) {
        // A second handle, so a reserved permit does not borrow the session.
        let outbound = self.outbound.clone();
        // Since when the replica has been behind with no room in its stream for the update. (A
        // disabled select branch still builds its future: `idle` spares a clock read per wake.)
        let mut waiting_for_room: Option<tokio::time::Instant> = None;
        let idle = tokio::time::Instant::now();
        loop {
            let has_work = self.behind();
            let awaits_ack = has_work && self.awaits_ack();
            let stalled_at = match has_work {
                true => *waiting_for_room.get_or_insert_with(tokio::time::Instant::now) + REPLICA_STALL_LIMIT,
                false => {
                    waiting_for_room = None;
                    idle
                }
            };
            // Unbiased: a replica whose reports arrive without a pause must neither starve its
            // own updates nor keep the stall deadline from being looked at.
            let event = tokio::select! {
                message = self.inbound.message() => Event::Inbound(message),
                permit = outbound.reserve(), if has_work && !awaits_ack => match permit {
                    Ok(permit) => Event::Room(permit),
                    Err(_) => return,
                },
                () = tokio::time::sleep_until(stalled_at), if has_work => {
                    let stalled = if self.awaits_ack() { "acknowledged no snapshot sent" } else { "read nothing" };
                    tracing::warn!(replica = %self.status.replica_id, "the replica {stalled} for {REPLICA_STALL_LIMIT:?}; ending its session");
                    self.metrics.watch_stalled.inc();
                    // It reads nothing, so no goodbye would reach it.
                    return;
                }
                changed = self.state.changed(), if !has_work => match changed {
                    Ok(()) => continue,
                    Err(_) => return,
                },
            };
            match event {
                Event::Inbound(Ok(Some(request))) => {
                    if let Err(Refused { reason, status }) = self.on_request(request).await {
                        // Counted by reason; logged within a budget, since a replica holding
                        // the token may open stream after stream only to be refused.
                        self.metrics.watch_refused.with_label_values(&[reason]).inc();
                        continuum_proto::warn_limited!(replica = %self.status.replica_id, reason, %status, "ending the replica's session");
                        // The stream ends either way, and the replica reconnects.
                        say_goodbye(&self.outbound, status).await;
                        return;
                    }
                }
                Event::Inbound(Ok(None)) => return,
                Event::Inbound(Err(status)) if unreadable(&status) => {
                    // The replica's stack is alive but sent what cannot be read: it is told
                    // (not left to take the stream's end for a clean one), and it is counted.
                    continuum_proto::warn_limited!(replica = %self.status.replica_id, %status, "a message from the replica could not be read; ending its session");
                    self.metrics.watch_refused.with_label_values(&["bad_message"]).inc();
                    say_goodbye(&self.outbound, status).await;
                    return;
                }
                Event::Inbound(Err(status)) => {
                    tracing::debug!(replica = %self.status.replica_id, %status, "watch stream ended");
                    return;
                }
                // The fleet moved on while the session waited for room: the replica's update
                // became a snapshot, which waits for the last one's acknowledgement.
                Event::Room(_) if self.awaits_ack() => {}
                Event::Room(permit) => {
                    waiting_for_room = None;
                    match self.next_update() {
                        Ok(Some(update)) => {
                            permit.send(Ok(Queued::new(update)));
                            self.record_queue_depth();
                        }
                        Ok(None) => {}
                        Err(status) => {
                            permit.send(Err(status));
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Whether the replica's next update, a snapshot, waits until it has applied the last one:
    /// one slow to read would otherwise be sent a snapshot at every update it took, megabytes
    /// each, held in its queue and in flight at once, each older than the fleet by the time it
    /// is read. Its first snapshot too, before it has acknowledged anything: a mass reconnect
    /// (a control plane restarted) is when replicas are slowest to apply one and the fleet
    /// moves fastest. Every Continuum replica acknowledges what it applies; a client that does
    /// not (grpcurl) meets the stall limit once it has fallen behind the delta log, or is owed
    /// a snapshot in place of a change too large to send.
    fn awaits_ack(&self) -> bool {
        self.snapshot_unacked() && self.state.borrow().needs_snapshot(self.held)
    }

    /// Whether the last snapshot sent is still to be acknowledged.
    fn snapshot_unacked(&self) -> bool {
        let acked = self.status.acked_version.load(Ordering::Relaxed);
        self.last_snapshot.as_ref().is_some_and(|snapshot| acked < snapshot.version)
    }

    /// Whether the replica is behind the newest state: the cheap test of every wake-up (a
    /// replica slow to read wakes its session with every report it sends), where [`Self::pending`]
    /// merges deltas and runs only once there is room to send.
    fn behind(&self) -> bool {
        self.held != Some(self.state.borrow().version())
    }

    /// What the replica needs next against the newest state, if anything.
    fn pending(&self) -> Option<(Arc<FleetState>, Catchup)> {
        let state = Arc::clone(&self.state.borrow());
        match state.catchup(self.held) {
            Catchup::UpToDate => None,
            catchup => Some((state, catchup)),
        }
    }

    /// The next update for the replica, if it is behind; an error ends the session with it.
    fn next_update(&mut self) -> Result<Option<pb::FleetUpdate>, Status> {
        self.state.borrow_and_update();
        let Some((state, catchup)) = self.pending() else { return Ok(None) };
        // The fleet may have outrun the delta log since `awaits_ack` looked: the snapshot it
        // takes now waits for the last one's acknowledgement all the same.
        if matches!(catchup, Catchup::Snapshot(_)) && self.snapshot_unacked() {
            return Ok(None);
        }
        let now = Instant::now();
        let version = state.version();
        let reports_folded = state.reports_folded(self.session_id).map(pb::ReportsFolded::from);
        let nonce = format!("{:016x}", rand::random::<u64>());
        let with_body = |body| pb::FleetUpdate { version, nonce: nonce.clone(), body: Some(body), reports_folded };
        let mut update = match &catchup {
            Catchup::UpToDate => return Ok(None),
            Catchup::Snapshot(view) => with_body(Body::Snapshot(snapshot_to_wire(view, now))),
            Catchup::Delta(delta) => with_body(Body::Delta(delta_to_wire(delta, now))),
        };
        // Past the bound the stream could not carry it. A delta merged over the whole log can
        // outgrow the fleet it leads to (workers replaced over and over, others named only to
        // be removed): the snapshot says the same in fewer bytes.
        if matches!(catchup, Catchup::Delta(_)) && bytes_once_aged(&update) > MAX_FLEET_MESSAGE_BYTES {
            if self.snapshot_unacked() {
                // The replica needs a snapshot, which waits for the last one's acknowledgement:
                // said so, the session stops building this delta at every wake-up and the
                // stall limit runs while it waits.
                self.held = None;
                return Ok(None);
            }
            tracing::warn!(
                replica = %self.status.replica_id, limit = MAX_FLEET_MESSAGE_BYTES,
                "the changes since the replica's view are larger than a Fleet message may be; sending the fleet's snapshot instead"
            );
            update = with_body(Body::Snapshot(snapshot_to_wire(state.view(), now)));
        }
        let snapshot = matches!(update.body, Some(Body::Snapshot(_)));
        let kind = if snapshot { "snapshot" } else { "delta" };
        if snapshot {
            // The replica would be sent the same snapshot at every reconnect: say why, to the
            // operator and to the replica.
            let bytes = bytes_once_aged(&update);
            if bytes > MAX_FLEET_MESSAGE_BYTES {
                self.metrics.updates_sent.with_label_values(&["too_large"]).inc();
                tracing::error!(
                    replica = %self.status.replica_id, bytes, limit = MAX_FLEET_MESSAGE_BYTES,
                    "the fleet snapshot is larger than a Fleet message may be; replicas keep their last view \
                     until the fleet shrinks (fewer workers or dp ranks)"
                );
                return Err(Status::out_of_range(format!(
                    "the fleet snapshot is {bytes} bytes, more than a Fleet message may carry ({MAX_FLEET_MESSAGE_BYTES}); keep the last view"
                )));
            }
        }
        self.metrics.updates_sent.with_label_values(&[kind]).inc();
        if snapshot {
            self.status.snapshots_sent.fetch_add(1, Ordering::Relaxed);
            self.last_snapshot = Some(Sent { version, nonce });
        }
        self.status.sent_version.store(version, Ordering::Relaxed);
        self.held = Some(version);
        Ok(Some(update))
    }

    /// A reply (`what`, refused as `reason`) about `version`, which the stream must have sent.
    fn sent(&self, version: u64, (reason, what): (&'static str, &str)) -> Result<(), Refused> {
        let sent = self.status.sent_version.load(Ordering::Relaxed);
        if version <= sent {
            return Ok(());
        }
        Err(Refused::new(
            reason,
            Status::invalid_argument(format!(
                "{what} of version {version}, which this stream never sent (its newest is {sent})"
            )),
        ))
    }

    /// Takes one message from the replica; a refusal ends the session with its status.
    async fn on_request(&mut self, request: pb::WatchRequest) -> Result<(), Refused> {
        match request.kind {
            Some(Kind::Ack(ack)) => {
                self.metrics.replica_replies.with_label_values(&["ack"]).inc();
                // An acknowledgement of a version never sent would stand for every snapshot
                // to come, and hold none of them back until the replica took it.
                self.sent(ack.version, ("bad_ack", "an acknowledgement"))?;
                self.status.acked_version.fetch_max(ack.version, Ordering::Relaxed);
            }
            Some(Kind::Nack(nack)) => self.on_nack(nack)?,
            Some(Kind::Dispatches(mut report)) => {
                // Its starts, ends, first tokens and hashes are within their counts: the codec
                // refused it before decoding otherwise (`continuum_proto::codec`). A start names
                // one rank at most, so a longer table is no report's.
                if report.ranks.len() > report.started.len() {
                    self.metrics.dispatch_reports_dropped.inc();
                    return Err(Refused::new(
                        "report_too_large",
                        Status::invalid_argument(format!(
                            "a dispatch report names {} ranks for {} dispatches started; at most one each",
                            report.ranks.len(),
                            report.started.len()
                        )),
                    ));
                }
                self.credit_prefixes(&mut report);
                match self.book.report(self.session_id, report).await {
                    Ok(()) => {}
                    // The replica counts on the sums holding every operation up to the last one
                    // folded; with one missing they never would. A new session starts both
                    // sides over: the book forgets this one's dispatches, the replica its queue.
                    Err(NotQueued::Full) => {
                        self.metrics.dispatch_reports_dropped.inc();
                        return Err(Refused::new(
                            "reports_behind",
                            Status::resource_exhausted(
                                "the control plane fell behind folding dispatch reports and dropped one; reconnect",
                            ),
                        ));
                    }
                    Err(NotQueued::Restarted) => {
                        return Err(Refused::new(
                            "book_restarted",
                            Status::unavailable(
                                "the control plane's dispatch book started over after an internal fault and holds none of this stream's dispatches; reconnect to report them again",
                            ),
                        ));
                    }
                }
            }
            Some(Kind::Hello(_)) | None => {
                tracing::debug!(replica = %self.status.replica_id, "ignoring a repeated hello or empty message");
            }
        }
        self.record_queue_depth();
        Ok(())
    }

    /// Credits each started dispatch's prefix chain to its rank, and moves the reservation of
    /// the lookup that scored it to that rank; the chains stay in the report for the backlog
    /// book, which counts blocks shared by dispatches in flight once. Past the per-dispatch and
    /// per-report bounds a chain is cut; its prefix is still a chain.
    fn credit_prefixes(&self, report: &mut pb::DispatchReport) {
        let mut budget = MAX_REPORT_BLOCK_HASHES;
        let ranks = &report.ranks;
        for started in &mut report.started {
            started.block_hashes.truncate(MAX_DISPATCH_BLOCK_HASHES.min(budget));
            // What a cut chain no longer holds is given back: the book keeps it for minutes.
            fit(&mut started.block_hashes);
            budget -= started.block_hashes.len();
            let rank = started.rank_in(ranks).and_then(|k| Some((k.worker.as_ref()?.instance_id, k.dp_rank)));
            let Some((worker_id, dp_rank)) = rank else { continue };
            let rank = RankKey { worker_id, dp_rank };
            // Credited and reserved when it first started, on the stream before; an
            // implausible start, which the book refuses, is credited with nothing either.
            if started.replayed || !plausible(started) {
                continue;
            }
            if started.lookup != 0 {
                tracing::debug!(target: "continuum_control_plane::lookups", lookup = started.lookup, ?rank, "lookup reported");
                let key = LookupKey { replica: &self.status.replica_id, lookup: started.lookup };
                self.kv.lookup_reported(key, rank);
            }
            if !started.block_hashes.is_empty() {
                self.kv.credit_provisional(rank, &started.block_hashes);
            }
        }
    }

    /// A refused delta leaves the replica's state unknown: resync it with a full snapshot. A
    /// refusal of an update the last snapshot replaced needs nothing more. A refused snapshot
    /// cannot be mended by another (under load each would be refused as fast as it is encoded,
    /// megabytes at a time): the session ends, and the replica keeps its last view and
    /// reconnects with its backoff.
    fn on_nack(&mut self, nack: pb::Nack) -> Result<(), Refused> {
        self.metrics.replica_replies.with_label_values(&["nack"]).inc();
        self.status.nacks.fetch_add(1, Ordering::Relaxed);
        // The replica's words, logged: a line's worth of them.
        let reason: String = nack.reason.chars().take(256).collect();
        let replica = &self.status.replica_id;
        self.sent(nack.version, ("bad_nack", "a refusal"))?;
        match &self.last_snapshot {
            Some(snapshot) if snapshot.answered_by(&nack) => {
                // The refusal's reason goes in the status the session ends with, logged then.
                return Err(Refused::new(
                    "snapshot_refused",
                    Status::failed_precondition(format!(
                        "the replica refused the full snapshot at version {} ({reason:?}); reconnect",
                        nack.version
                    )),
                ));
            }
            Some(snapshot) if snapshot.replaced(&nack) => {
                tracing::debug!(%replica, version = nack.version, ?reason, "a refused update was already replaced");
                return Ok(());
            }
            _ => {}
        }
        if self.held.is_none() {
            // A resync is already due: the deltas sent before it (which the replica refuses
            // too, none fitting its view any more) are mended by the same snapshot.
            tracing::debug!(%replica, version = nack.version, ?reason, "a refused update awaits the resync already due");
            return Ok(());
        }
        let now = Instant::now();
        if self.last_resync.is_some_and(|at| now.duration_since(at) < RESYNC_INTERVAL) {
            return Err(Refused::new(
                "updates_refused",
                Status::failed_precondition(format!(
                    "the replica refused fleet updates twice within {RESYNC_INTERVAL:?} (the last at version {}: {reason:?}); reconnect",
                    nack.version
                )),
            ));
        }
        continuum_proto::warn_limited!(%replica, version = nack.version, ?reason, "replica refused a fleet update; resyncing it with a full snapshot");
        self.last_resync = Some(now);
        self.held = None;
        Ok(())
    }

    fn record_queue_depth(&self) {
        let depth = self.outbound.max_capacity() - self.outbound.capacity();
        self.status.queue_depth.store(depth, Ordering::Relaxed);
        self.status.queue_high_water.fetch_max(depth, Ordering::Relaxed);
    }
}

/// Whether a failed read of the replica's stream was a message that could not be read (past
/// the size bound, or not decodable), rather than the stream or its connection ending.
fn unreadable(status: &Status) -> bool {
    match status.code() {
        tonic::Code::OutOfRange | tonic::Code::InvalidArgument => true,
        // Also how tonic reports a stream reset by the peer's HTTP/2 stack: not a message.
        tonic::Code::Internal => !status.message().starts_with("h2 protocol error"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sample(age_ms: u64) -> pb::LoadSample {
        pb::LoadSample { age_ms, ..pb::LoadSample::default() }
    }

    /// An update that waited for its stream hands its samples on that much older: the replica
    /// judges staleness from when the worker published, not from when the update was built.
    #[test]
    fn a_queued_update_is_taken_with_its_samples_aged_by_the_wait() {
        let waited = Duration::from_millis(1500);
        let built = Instant::now().checked_sub(waited).expect("an earlier instant");
        let delta = pb::Delta { loads: vec![sample(10), sample(u64::MAX)], ..pb::Delta::default() };
        let update = pb::FleetUpdate { body: Some(Body::Delta(delta)), ..pb::FleetUpdate::default() };
        let taken = Queued { built, update }.taken();
        let Some(Body::Delta(delta)) = taken.body else { panic!("a delta") };
        let ages: Vec<u64> = delta.loads.iter().map(|s| s.age_ms).collect();
        assert!(ages[0] >= 1510 && ages[0] < 1510 + 60_000, "{ages:?}");
        assert_eq!(ages[1], u64::MAX, "saturates");

        let snapshot = pb::Snapshot { loads: vec![sample(0)], ..pb::Snapshot::default() };
        let update = pb::FleetUpdate { body: Some(Body::Snapshot(snapshot)), ..pb::FleetUpdate::default() };
        let Some(Body::Snapshot(snapshot)) = (Queued { built, update }.taken()).body else { panic!("a snapshot") };
        assert!(snapshot.loads[0].age_ms >= 1500);
    }

    /// The bound is checked on what the update may weigh once aged: samples of age 0 (not
    /// written) aged to the most a varint holds fit within what was counted.
    #[test]
    fn an_update_is_measured_as_large_as_its_wait_may_make_it() {
        // Samples of 123 bytes, whose length prefix grows to two bytes as they age.
        let key = pb::WorkerKey { namespace: "n".repeat(117), instance_id: 0 };
        let padded = pb::LoadSample { key: Some(pb::LoadKey { worker: Some(key), dp_rank: 0 }), ..sample(0) };
        assert_eq!(prost::Message::encoded_len(&padded), 123);
        let snapshot = pb::Snapshot { loads: vec![padded; 1000], ..pb::Snapshot::default() };
        let update = pb::FleetUpdate { body: Some(Body::Snapshot(snapshot)), ..pb::FleetUpdate::default() };
        let counted = bytes_once_aged(&update);
        let mut aged = update.clone();
        let Some(Body::Snapshot(snapshot)) = &mut aged.body else { panic!("a snapshot") };
        snapshot.loads.iter_mut().for_each(|s| s.age_ms = u64::MAX);
        assert!(prost::Message::encoded_len(&update) < counted);
        assert!(prost::Message::encoded_len(&aged) <= counted, "{} > {counted}", prost::Message::encoded_len(&aged));
    }
}
