//! The Fleet stream over real gRPC on loopback: convergence, slow replicas, refusals.

use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_control_plane::fleet::{DELTA_LOG_CAPACITY, FleetChange, FleetPublisher, SAMPLE_LAG};
use continuum_control_plane::grpc::REPLICA_QUEUE_CAPACITY;
use continuum_proto::convert::{Update, update_from_wire};
use continuum_proto::model::{Backlog, DataPlaneConfig, Load, LoadKey, LoadSample, ReportsFolded, WorkerKey};
use continuum_proto::pb::{self, fleet_client::FleetClient, watch_request::Kind};
use continuum_proto::view::FleetView;
use continuum_proto::{MAX_FLEET_MESSAGE_BYTES, MAX_INBOUND_FLEET_MESSAGE_BYTES};
use continuum_tests::{TestControlPlane, publisher, start_replicas, wait_for_version, worker};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

const CONVERGE: Duration = Duration::from_secs(20);

/// One random change: mostly upserts and removals, with some load samples and config edits.
fn random_change(rng: &mut StdRng, view: &FleetView) -> FleetChange {
    let id = rng.random_range(1..=400u64);
    match rng.random_range(0..10) {
        0..=4 => FleetChange {
            upsert: vec![worker("dynamo", id, &format!("m{}", rng.random_range(0..3)))],
            ..Default::default()
        },
        5..=7 => FleetChange { remove: vec![WorkerKey::new("dynamo", id)], ..Default::default() },
        8 => {
            let loads = view
                .workers()
                .values()
                .take(3)
                .map(|w| {
                    let load = Load { kv_used_blocks: Some(rng.random_range(0..1024)), ..Load::default() };
                    (
                        LoadKey { worker: w.key.clone(), dp_rank: w.dp_start_rank },
                        LoadSample { load, received_at: Instant::now() },
                    )
                })
                .collect();
            FleetChange { loads, ..Default::default() }
        }
        _ => {
            let mut config = DataPlaneConfig::default();
            config.model_map.insert("alias".into(), format!("m{}", rng.random_range(0..3)));
            FleetChange { config: Some(Arc::new(config)), ..Default::default() }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_replicas_converge_after_ten_thousand_random_changes() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let replicas = start_replicas(8, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), CONVERGE).await?;

    let mut rng = StdRng::seed_from_u64(7);
    let mut applied = 0;
    for _ in 0..10_000 {
        let change = random_change(&mut rng, control.publisher.current().view());
        applied += usize::from(control.publisher.apply(change).is_some());
    }
    assert!(applied > 5_000, "the random stream must mostly change the fleet ({applied} changes applied)");

    let expected = control.publisher.current();
    wait_for_version(&replicas, expected.version(), CONVERGE).await?;
    for replica in &replicas {
        let view = replica.fleet.view().ok_or_else(|| anyhow::anyhow!("replica holds no view"))?;
        assert!(view.same_content(expected.view()), "replica content differs from the control plane");
        assert!(!view.workers().is_empty());
    }
    for replica in replicas {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(())
}

async fn open_watch(
    url: &str,
    replica_id: &str,
) -> anyhow::Result<(mpsc::Sender<pb::WatchRequest>, Streaming<pb::FleetUpdate>)> {
    let mut client = FleetClient::connect(url.to_string()).await?.max_decoding_message_size(MAX_FLEET_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(16);
    let hello = pb::Hello { replica_id: replica_id.into(), version: None };
    tx.send(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }).await?;
    let updates = client.watch(ReceiverStream::new(rx)).await?.into_inner();
    Ok((tx, updates))
}

/// The stream's next update within [`CONVERGE`]; an error if it ended.
async fn next_update(updates: &mut Streaming<pb::FleetUpdate>) -> anyhow::Result<pb::FleetUpdate> {
    tokio::time::timeout(CONVERGE, updates.message()).await??.ok_or_else(|| anyhow::anyhow!("the stream ended"))
}

/// The status the stream ends with, past the updates before it; an error if it ends cleanly.
async fn end_status(updates: &mut Streaming<pb::FleetUpdate>) -> anyhow::Result<tonic::Status> {
    loop {
        match tokio::time::timeout(CONVERGE, updates.message()).await? {
            Ok(Some(_)) => continue,
            Ok(None) => anyhow::bail!("the stream ended as if cleanly"),
            Err(status) => return Ok(status),
        }
    }
}

fn ack(update: &pb::FleetUpdate) -> pb::WatchRequest {
    pb::WatchRequest { kind: Some(Kind::Ack(pb::Ack { version: update.version, nonce: update.nonce.clone() })) }
}

fn is_snapshot(update: &pb::FleetUpdate) -> bool {
    matches!(update.body, Some(pb::fleet_update::Body::Snapshot(_)))
}

/// Applies an update to a test replica's view.
fn fold(view: Option<FleetView>, update: pb::FleetUpdate) -> anyhow::Result<FleetView> {
    match update_from_wire(update, Instant::now())? {
        Update::Snapshot(view) => Ok(view),
        Update::Delta(delta) => Ok(view.ok_or_else(|| anyhow::anyhow!("delta before snapshot"))?.apply(&delta)?),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_reading_resumes_with_a_snapshot_and_its_queue_stays_bounded() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "stalled").await?;
    let first = next_update(&mut updates).await?;
    assert!(is_snapshot(&first), "the first update on a stream is a full snapshot");
    // Applied and acknowledged, as a replica does, before it stops reading.
    replies.send(ack(&first)).await?;
    let mut view = fold(None, first)?;

    // Large workers, so the changes overflow HTTP/2 buffers and the delta log while the
    // replica reads nothing. Until the queue fills, each change waits for the session to take
    // it: on a busy machine the session's task could otherwise run behind every change and
    // send one snapshot, and the stall would never reach the queue.
    let status = control.replicas.list().into_iter().next().ok_or_else(|| anyhow::anyhow!("no session"))?;
    let high_water = || status.queue_high_water.load(std::sync::atomic::Ordering::Relaxed);
    let big_model = "x".repeat(4096);
    let changes = DELTA_LOG_CAPACITY as u64 * 8;
    for id in 0..changes {
        control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", id, &big_model)], ..Default::default() });
        let version = control.publisher.current().version();
        let deadline = Instant::now() + CONVERGE;
        while high_water() < REPLICA_QUEUE_CAPACITY
            && status.sent_version.load(std::sync::atomic::Ordering::Relaxed) < version
        {
            anyhow::ensure!(Instant::now() < deadline, "the session took no change for {CONVERGE:?}");
            tokio::task::yield_now().await;
        }
    }
    // The queue is bounded by construction; what this shows is that the stall reached it.
    assert_eq!(high_water(), REPLICA_QUEUE_CAPACITY, "the stalled replica's queue filled");

    let expected = control.publisher.current();
    let (mut resynced, mut read) = (false, 0u64);
    while view.version() != expected.version() {
        let update = next_update(&mut updates).await?;
        resynced |= is_snapshot(&update);
        read += 1;
        replies.send(ack(&update)).await?;
        view = fold(Some(view), update)?;
    }
    assert!(resynced, "a replica that fell behind the delta log is resynced with a snapshot");
    assert!(view.same_content(expected.view()));
    // What waited for the replica was its queue and the HTTP/2 buffers, not every change.
    assert!(read < changes / 4, "the replica read {read} updates for {changes} changes");
    control.stop().await;
    Ok(())
}

/// A replica that reads slowly while the fleet outruns the delta log between its reads is sent
/// a snapshot only once it has applied the last one: never several in flight, each older than
/// the fleet by the time it is read (with a 16,384-worker fleet, a megabyte each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_behind_the_delta_log_has_one_snapshot_in_flight_at_most() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "slow").await?;
    let first = next_update(&mut updates).await?;
    replies.send(ack(&first)).await?;
    let mut view = fold(None, first)?;
    let status = control.replicas.list().into_iter().next().ok_or_else(|| anyhow::anyhow!("no session"))?;
    let sent = || status.snapshots_sent.load(std::sync::atomic::Ordering::Relaxed);
    // Eight workers whose model names change: every change a version, every update large.
    let big = "x".repeat(64 << 10);
    let mut version = 0u64;
    let mut change = || {
        version += 1;
        let model = format!("{big}{version}");
        control
            .publisher
            .apply(FleetChange { upsert: vec![worker("dynamo", version % 8, &model)], ..Default::default() });
    };
    let (mut snapshots_read, mut most_ahead) = (1u64, 0u64);
    let expected = loop {
        if snapshots_read < 6 {
            for _ in 0..DELTA_LOG_CAPACITY + 8 {
                change();
            }
            // The session's turn: under the old rule it sent a snapshot into every slot the
            // last read freed, while the replica was still to read the one before.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let update = next_update(&mut updates).await?;
        snapshots_read += u64::from(is_snapshot(&update));
        most_ahead = most_ahead.max(sent().saturating_sub(snapshots_read));
        replies.send(ack(&update)).await?;
        view = fold(Some(view), update)?;
        let expected = control.publisher.current();
        if snapshots_read >= 6 && view.version() == expected.version() {
            break expected;
        }
    };
    assert!(view.same_content(expected.view()));
    assert!(snapshots_read >= 6, "a replica past the delta log is resynced with snapshots");
    assert_eq!(most_ahead, 1, "at most one snapshot sent and not yet read");
    control.stop().await;
    Ok(())
}

/// Its first snapshot too: a replica still applying it (as every replica is after a control
/// plane restart, when the fleet moves fastest) is sent no second one, whatever the fleet does
/// meanwhile, until it acknowledges the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_yet_to_acknowledge_its_first_snapshot_is_sent_no_second() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "starting").await?;
    let first = next_update(&mut updates).await?;
    assert!(is_snapshot(&first));
    let status = control.replicas.list().into_iter().next().ok_or_else(|| anyhow::anyhow!("no session"))?;
    let sent = || status.snapshots_sent.load(std::sync::atomic::Ordering::Relaxed);
    // Large updates, as in the test above: each change a version of its own.
    let big = "x".repeat(64 << 10);
    let (mut version, mut held) = (0u64, Vec::new());
    for _ in 0..3 {
        for _ in 0..DELTA_LOG_CAPACITY + 8 {
            version += 1;
            let upsert = vec![worker("dynamo", version % 8, &format!("{big}{version}"))];
            control.publisher.apply(FleetChange { upsert, ..Default::default() });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Reading (not yet applying) what was queued frees room the session could fill.
        let mut read = Vec::new();
        while let Ok(update) = tokio::time::timeout(Duration::from_millis(200), updates.message()).await {
            read.push(update?.ok_or_else(|| anyhow::anyhow!("ended"))?);
        }
        assert_eq!(sent(), 1, "the first snapshot is not acknowledged yet");
        held.extend(read);
    }
    replies.send(ack(&first)).await?;
    let mut view = fold(None, first)?;
    for update in held {
        replies.send(ack(&update)).await?;
        view = fold(Some(view), update)?;
    }
    let expected = control.publisher.current();
    while view.version() != expected.version() {
        let update = next_update(&mut updates).await?;
        replies.send(ack(&update)).await?;
        view = fold(Some(view), update)?;
    }
    assert!(view.same_content(expected.view()), "it converges once it acknowledged the first");
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_is_answered_with_a_full_snapshot() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "refuser").await?;
    let first = next_update(&mut updates).await?;
    replies.send(ack(&first)).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 1, "m")], ..Default::default() });
    let delta = updates.message().await?.ok_or_else(|| anyhow::anyhow!("no delta"))?;
    assert!(!is_snapshot(&delta));
    let nack = pb::Nack { version: delta.version, nonce: delta.nonce.clone(), reason: "test refuses it".into() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Nack(nack)) }).await?;
    let resync = next_update(&mut updates).await?;
    assert!(is_snapshot(&resync), "a refused delta is followed by a full snapshot");
    assert_eq!(resync.version, control.publisher.current().version());
    let nacks = control.metrics.replica_replies.with_label_values(&["nack"]).get();
    assert_eq!(nacks, 1);

    // A refusal of what the snapshot replaced (late, or repeated) asks for nothing more.
    let stale = pb::Nack { version: delta.version, nonce: delta.nonce.clone(), reason: "again".into() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Nack(stale)) }).await?;
    replies.send(ack(&resync)).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 2, "m")], ..Default::default() });
    let next = next_update(&mut updates).await?;
    assert!(!is_snapshot(&next), "a delta, not another snapshot");

    // Another refused delta so soon after the resync ends the stream: one snapshot per refusal
    // would let a replica that refuses every delta (a bug, or a peer holding the token) have
    // the fleet encoded whole for each reply of a few bytes.
    let nack = pb::Nack { version: next.version, nonce: next.nonce.clone(), reason: "test refuses it".into() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Nack(nack)) }).await?;
    let ended = ended_status(&mut updates).await?;
    assert_eq!(ended.code(), tonic::Code::FailedPrecondition, "{ended:?}");
    assert!(ended.message().contains("test refuses it"), "the replica's reason is in the end's status: {ended:?}");
    assert_eq!(control.metrics.updates_sent.with_label_values(&["snapshot"]).get(), 2, "the first and one resync");
    assert_eq!(control.metrics.watch_refused.with_label_values(&["updates_refused"]).get(), 1);
    control.stop().await;
    Ok(())
}

/// An acknowledgement of a version the stream never sent would count as the acknowledgement
/// of every snapshot to come, which then would never wait for the replica to take the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_of_a_version_never_sent_ends_the_stream_and_is_counted() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "early-acker").await?;
    let first = next_update(&mut updates).await?;
    replies.send(ack(&first)).await?;
    let future = pb::Ack { version: first.version + 1_000, nonce: String::new() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Ack(future)) }).await?;
    let ended = ended_status(&mut updates).await?;
    assert_eq!(ended.code(), tonic::Code::InvalidArgument, "{ended:?}");
    assert!(ended.message().contains("never sent"), "{ended:?}");
    assert_eq!(control.metrics.watch_refused.with_label_values(&["bad_ack"]).get(), 1);
    control.stop().await;
    Ok(())
}

/// A replica that refuses a delta refuses the ones already on their way behind it too (none fits
/// its view any more): those refusals wait for the resync the first one asked for, whichever
/// the session reads first, the refusal or room to send the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_the_deltas_behind_a_refused_one_await_its_resync() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let mut next_id = 100;
    // Each round on a stream of its own: the session reads the second refusal before or after
    // it sends the resync, as its turn falls; a round that ended the stream would fail.
    for round in 0..8 {
        let (replies, mut updates) = open_watch(&control.url(), &format!("refuser-{round}")).await?;
        let first = next_update(&mut updates).await?;
        replies.send(ack(&first)).await?;
        let mut deltas = Vec::new();
        for _ in 0..2 {
            next_id += 1;
            control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", next_id, "m")], ..Default::default() });
            let delta = next_update(&mut updates).await?;
            anyhow::ensure!(!is_snapshot(&delta), "a delta");
            deltas.push(delta);
        }
        for delta in &deltas {
            let nack = pb::Nack { version: delta.version, nonce: delta.nonce.clone(), reason: "refused".into() };
            replies.send(pb::WatchRequest { kind: Some(Kind::Nack(nack)) }).await?;
        }
        let resync = tokio::time::timeout(CONVERGE, updates.message()).await??;
        let resync = resync.ok_or_else(|| anyhow::anyhow!("round {round}: the stream ended"))?;
        anyhow::ensure!(is_snapshot(&resync), "round {round}: a resync");
        replies.send(ack(&resync)).await?;
        // Still open: the next change comes as a delta.
        next_id += 1;
        control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", next_id, "m")], ..Default::default() });
        let after = tokio::time::timeout(CONVERGE, updates.message()).await?;
        let after = after.map_err(|status| anyhow::anyhow!("round {round}: the stream ended: {status:?}"))?;
        anyhow::ensure!(after.is_some_and(|update| !is_snapshot(&update)), "round {round}: a delta after the resync");
    }
    control.stop().await;
    Ok(())
}

/// A refused snapshot cannot be mended by another: the stream ends, and the replica reconnects
/// with its backoff (under load, snapshots would otherwise go out back to back). A refusal of
/// a version the stream never sent is no refusal of anything: it ends the stream too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_snapshot_or_a_refusal_of_nothing_sent_ends_the_stream() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (replies, mut updates) = open_watch(&control.url(), "refuser").await?;
    let snapshot = next_update(&mut updates).await?;
    let nack = pb::Nack { version: snapshot.version, nonce: snapshot.nonce.clone(), reason: "refused".into() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Nack(nack)) }).await?;
    let ended = ended_status(&mut updates).await?;
    assert_eq!(ended.code(), tonic::Code::FailedPrecondition, "{ended:?}");

    let (replies, mut updates) = open_watch(&control.url(), "refuser").await?;
    let snapshot = next_update(&mut updates).await?;
    let nack = pb::Nack { version: u64::MAX, nonce: snapshot.nonce.clone(), reason: "never sent".into() };
    replies.send(pb::WatchRequest { kind: Some(Kind::Nack(nack)) }).await?;
    let ended = ended_status(&mut updates).await?;
    assert_eq!(ended.code(), tonic::Code::InvalidArgument, "{ended:?}");
    control.stop().await;
    Ok(())
}

/// The status a stream ends with; no snapshot may come before it.
async fn ended_status(updates: &mut tonic::Streaming<pb::FleetUpdate>) -> anyhow::Result<tonic::Status> {
    loop {
        match tokio::time::timeout(CONVERGE, updates.message()).await? {
            Ok(Some(update)) => anyhow::ensure!(!is_snapshot(&update), "no snapshot before the stream ends"),
            Ok(None) => anyhow::bail!("the stream ended without a status"),
            Err(status) => return Ok(status),
        }
    }
}

/// A replica whose messages never stop coming (reports faster than they are folded, or a
/// flood) still gets its updates: reading its stream does not starve writing to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_flooding_its_stream_still_gets_its_updates() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let mut client = FleetClient::connect(control.url()).await?.max_decoding_message_size(MAX_FLEET_MESSAGE_BYTES);
    let hello = pb::WatchRequest { kind: Some(Kind::Hello(pb::Hello { replica_id: "flood".into(), version: None })) };
    // Of version 0, sent before any: an acknowledgement of a version not yet sent would end
    // the stream (`an_ack_of_a_version_never_sent_ends_the_stream_and_is_counted`).
    let stale = pb::WatchRequest { kind: Some(Kind::Ack(pb::Ack { version: 0, nonce: "stale".into() })) };
    // Never pending: every poll has the next message ready.
    let flood = tokio_stream::iter(std::iter::once(hello).chain(std::iter::repeat(stale)));
    let mut updates = client.watch(flood).await?.into_inner();
    let first = tokio::time::timeout(CONVERGE, updates.message()).await??;
    assert!(first.as_ref().is_some_and(is_snapshot), "the first update is a snapshot");
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 1, "m")], ..Default::default() });
    let next = tokio::time::timeout(Duration::from_secs(5), updates.message())
        .await
        .map_err(|_| anyhow::anyhow!("no update within 5 s while the replica's messages kept coming"))??;
    assert!(next.is_some_and(|update| !is_snapshot(&update)), "the change, as a delta");
    control.stop().await;
    Ok(())
}

/// A replica id goes into log lines as it is: one that could forge a line is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_whose_replica_id_would_forge_log_lines_is_refused() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let mut client = FleetClient::connect(control.url()).await?;
    for (refused, id) in [("a line break", "r1\nINFO forged"), ("a space", "r 1"), ("nothing", "")] {
        let (tx, rx) = mpsc::channel(1);
        tx.send(pb::WatchRequest { kind: Some(Kind::Hello(pb::Hello { replica_id: id.into(), version: None })) })
            .await?;
        let status = client.watch(ReceiverStream::new(rx)).await.err().ok_or_else(|| anyhow::anyhow!("{refused}"))?;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{refused}");
        assert!(!status.message().contains(id) || id.is_empty(), "not echoed: {}", status.message());
    }
    assert_eq!(control.metrics.watch_refused.with_label_values(&["bad_hello"]).get(), 3);
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_hello_is_refused() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let mut client = FleetClient::connect(control.url()).await?;
    let (tx, rx) = mpsc::channel(1);
    tx.send(pb::WatchRequest { kind: Some(Kind::Ack(pb::Ack { version: 1, nonce: "x".into() })) }).await?;
    let status = client.watch(ReceiverStream::new(rx)).await.err().ok_or_else(|| anyhow::anyhow!("accepted"))?;
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(control.metrics.watch_refused.with_label_values(&["bad_hello"]).get(), 1);
    control.stop().await;
    Ok(())
}

/// A message past the inbound bound after the hello ends the session with the reason, counted,
/// rather than as a clean end of stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_the_bound_ends_the_stream_with_its_reason() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (tx, mut updates) = open_watch(&control.url(), "big").await?;
    assert!(is_snapshot(&next_update(&mut updates).await?));
    let huge = "x".repeat(MAX_INBOUND_FLEET_MESSAGE_BYTES + 1);
    tx.send(pb::WatchRequest { kind: Some(Kind::Ack(pb::Ack { version: 1, nonce: huge })) }).await?;
    let status = end_status(&mut updates).await?;
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status}");
    assert_eq!(control.metrics.watch_refused.with_label_values(&["bad_message"]).get(), 1);
    control.stop().await;
    Ok(())
}

/// Messages within the byte bound whose counts are past the limits are refused before they are
/// decoded: two million empty starts (4 MiB on the wire, some 240 MiB decoded) end the session,
/// and a lookup of too many hashes fails its call, each counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_past_their_counts_are_refused_before_they_are_decoded() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (tx, mut updates) = open_watch(&control.url(), "empty").await?;
    assert!(is_snapshot(&next_update(&mut updates).await?));
    let empty_starts = (MAX_INBOUND_FLEET_MESSAGE_BYTES - 64) / 2;
    let report =
        pb::DispatchReport { started: vec![pb::DispatchStarted::default(); empty_starts], ..Default::default() };
    tx.send(pb::WatchRequest { kind: Some(Kind::Dispatches(report)) }).await?;
    let status = end_status(&mut updates).await?;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    assert!(status.message().contains(&format!("starts number {empty_starts}; at most 1024")), "{status}");
    assert_eq!(control.metrics.watch_refused.with_label_values(&["bad_message"]).get(), 1);

    let lookup =
        pb::FindMatchesRequest { block_hashes: vec![7; 65_537], replica_id: "empty".into(), ..Default::default() };
    let mut client = FleetClient::connect(control.url()).await?;
    let refused = client.find_matches(lookup).await.expect_err("too many hashes");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    let rendered = control.metrics.render();
    assert!(
        rendered
            .lines()
            .any(|l| l.starts_with("continuum_dynamo_kv_find_matches_total{result=\"too_large\"} ")
                && !l.ends_with(" 0")),
        "counted: {rendered}"
    );
    control.stop().await;
    Ok(())
}

/// A lookup whose request never comes whole is given up after the call timeout, not held for
/// as long as its connection lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_request_never_comes_whole_is_given_up() -> anyhow::Result<()> {
    use continuum_control_plane::grpc::CALL_TIMEOUT;

    let control = TestControlPlane::start(publisher()).await?;
    let channel = tonic::transport::Endpoint::from_shared(control.url())?.connect().await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/continuum.fleet.v1.Fleet/FindMatches");
    let codec = tonic_prost::ProstCodec::<pb::FindMatchesRequest, pb::FindMatchesResponse>::default();
    // A request stream that never yields: the server waits on a body that never comes.
    let never = futures::stream::pending::<pb::FindMatchesRequest>();
    let started = std::time::Instant::now();
    let call = grpc.client_streaming(tonic::Request::new(never), path, codec);
    let outcome = tokio::time::timeout(CALL_TIMEOUT * 2, call).await?;
    assert!(outcome.is_err(), "given up, not answered");
    assert!(started.elapsed() >= CALL_TIMEOUT - Duration::from_secs(1), "after the call timeout");
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_snapshot_returns_the_published_view() -> anyhow::Result<()> {
    let publisher = FleetPublisher::starting_at(41, Arc::new(DataPlaneConfig::default()));
    publisher.apply(FleetChange { upsert: vec![worker("dynamo", u64::MAX - 5, "tiny")], ..Default::default() });
    let control = TestControlPlane::start(publisher).await?;
    let mut client = FleetClient::connect(control.url()).await?;
    let snapshot = client.get_snapshot(pb::GetSnapshotRequest {}).await?.into_inner();
    assert_eq!(snapshot.version, 42);
    let key = snapshot.workers[0].key.clone().ok_or_else(|| anyhow::anyhow!("no key"))?;
    assert_eq!(key.instance_id, u64::MAX - 5, "ids above 2^53 survive exactly");
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatches_reported_by_one_replica_reach_every_replica_until_they_end() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 7, "m")], ..Default::default() });
    let replicas = start_replicas(2, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), CONVERGE).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    let backlog_at = |replica: &continuum_data_plane::replica::Replica| {
        replica.fleet.view().and_then(|v| v.backlogs().get(&rank).copied())
    };

    let first = replicas[0].reporter.operation(|report| report.started(&rank, 160, 10, Vec::new()));
    let second = replicas[0].reporter.operation(|report| report.started(&rank, 32, 2, Vec::new()));
    continuum_tests::eventually(CONVERGE, "the other replica seeing both dispatches", || async {
        backlog_at(&replicas[1]).is_some_and(|b| b.dispatches == 2 && b.prefill_tokens == 192 && b.decode_blocks == 12)
    })
    .await?;
    // Each replica is told which of its own operations the sums hold: the reporting replica
    // its two, the other none.
    let folded =
        |replica: &continuum_data_plane::replica::Replica| replica.fleet.view().and_then(|v| v.reports_folded());
    continuum_tests::eventually(CONVERGE, "the reporting replica told its operations are summed", || async {
        folded(&replicas[0]) == Some(ReportsFolded { first_op: 1, last_op: 2 })
    })
    .await?;
    assert_eq!(folded(&replicas[1]), None);

    replicas[0].reporter.operation(|report| report.ended(first));
    continuum_tests::eventually(CONVERGE, "the ended dispatch leaving", || async {
        backlog_at(&replicas[1]).is_some_and(|b| b.dispatches == 1 && b.prefill_tokens == 32)
    })
    .await?;

    // A load sample: what it shows beyond the 2 blocks in flight is foreign load (once the
    // ended dispatch's blocks can no longer be in it).
    tokio::time::sleep(SAMPLE_LAG).await;
    let sample = |kv_used_blocks| {
        // An engine that also counts its queued prompts, ten tokens per block here.
        let load = Load {
            kv_used_blocks: Some(kv_used_blocks),
            active_prefill_tokens: Some(kv_used_blocks * 10),
            ..Load::default()
        };
        FleetChange {
            loads: vec![(rank.clone(), LoadSample { load, received_at: Instant::now() })],
            ..Default::default()
        }
    };
    control.publisher.apply(sample(4));
    continuum_tests::eventually(CONVERGE, "the sample measured", || async {
        // Of its 40 queued tokens, 32 are the dispatch awaiting its first token.
        backlog_at(&replicas[1]).is_some_and(|b| {
            b.foreign_decode_blocks == Some(2) && b.decode_blocks == 2 && b.foreign_prefill_tokens == Some(8)
        })
    })
    .await?;
    replicas[0].reporter.operation(|report| report.prefilled(second));
    continuum_tests::eventually(CONVERGE, "the prompt prefilled", || async {
        backlog_at(&replicas[1]).is_some_and(|b| b.prefill_tokens == 0 && b.decode_blocks == 2)
    })
    .await?;
    replicas[0].reporter.operation(|report| report.ended(second));
    continuum_tests::eventually(CONVERGE, "nothing in flight", || async {
        backlog_at(&replicas[1]).is_some_and(|b| b.dispatches == 0 && b.decode_blocks == 0)
    })
    .await?;
    // A sample the lag after the last end shows the worker as it is: the rank's sums go, and
    // only its place in the fleet's dispatch order (the second dispatch the book numbered) stays.
    tokio::time::sleep(SAMPLE_LAG).await;
    control.publisher.apply(sample(0));
    let settled = Backlog { last_dispatch: 2, ..Backlog::default() };
    continuum_tests::eventually(CONVERGE, "the settled backlog leaving", || async {
        backlog_at(&replicas[1]) == Some(settled) && backlog_at(&replicas[0]) == Some(settled)
    })
    .await?;
    for replica in replicas {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_dispatches_share_through_different_replicas_counts_once() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 7, "m")], ..Default::default() });
    let replicas = start_replicas(2, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), CONVERGE).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    let decode_blocks = |replica: &continuum_data_plane::replica::Replica| {
        replica.fleet.view().and_then(|v| v.backlogs().get(&rank).map(|b| (b.dispatches, b.decode_blocks)))
    };
    // Two users of one 8-block system prompt, each with 2 blocks of their own, one per replica.
    let system: Vec<u64> = (1..=8).collect();
    let chain = |user: u64| system.iter().copied().chain([user, user + 1]).collect::<Vec<u64>>();
    let first = replicas[0].reporter.operation(|report| report.started(&rank, 0, 10, chain(100)));
    replicas[1].reporter.operation(|report| report.started(&rank, 0, 10, chain(200)));
    continuum_tests::eventually(CONVERGE, "both replicas counting the shared prompt once", || async {
        replicas.iter().all(|r| decode_blocks(r) == Some((2, 8 + 2 + 2)))
    })
    .await?;
    replicas[0].reporter.operation(|report| report.ended(first));
    continuum_tests::eventually(CONVERGE, "the prompt held by the request still running", || async {
        replicas.iter().all(|r| decode_blocks(r) == Some((1, 10)))
    })
    .await?;
    for replica in replicas {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loses_the_control_plane_keeps_its_workers_but_not_the_frozen_backlogs() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 7, "m")], ..Default::default() });
    let replicas = start_replicas(2, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), CONVERGE).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    // A dispatch whose end the other replica will never learn of: the control plane dies first.
    replicas[0].reporter.operation(|report| report.started(&rank, 160, 10, Vec::new()));
    continuum_tests::eventually(CONVERGE, "the other replica seeing the dispatch", || async {
        replicas[1].fleet.view().is_some_and(|v| v.backlogs().contains_key(&rank))
    })
    .await?;

    control.stop().await;
    continuum_tests::eventually(CONVERGE, "the frozen backlog dropped", || async {
        replicas[1].fleet.view().is_some_and(|v| v.backlogs().is_empty())
    })
    .await?;
    let view = replicas[1].fleet.view().expect("last-known-good");
    anyhow::ensure!(view.worker(&rank.worker).is_some(), "the worker stays routable on last-known-good");
    for replica in replicas {
        replica.shutdown().await;
    }
    Ok(())
}

/// A replica whose stream broke reconnects before the control plane has noticed: the old
/// stream, still open on this side, is ended at once and its dispatches forgotten. The
/// replica counts them itself from then on, so keeping them would count them twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_replica_supersedes_its_open_stream_and_its_dispatches() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 7, "m")], ..Default::default() });
    let observers = start_replicas(1, &control.url()).await?;
    wait_for_version(&observers, control.publisher.current().version(), CONVERGE).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    let dispatches =
        || observers[0].fleet.view().and_then(|v| v.backlogs().get(&rank).map(|b| b.dispatches)).unwrap_or(0);

    let (old_tx, mut old_updates) = open_watch(&control.url(), "replica-a").await?;
    let started = pb::DispatchStarted {
        id: 1,
        rank: Some(pb::LoadKey {
            worker: Some(pb::WorkerKey { namespace: "dynamo".into(), instance_id: 7 }),
            dp_rank: 0,
        }),
        prefill_tokens: 16,
        decode_blocks: 2,
        ..Default::default()
    };
    let report = pb::DispatchReport { started: vec![started], first_op: 1, last_op: 1, ..Default::default() };
    old_tx.send(pb::WatchRequest { kind: Some(Kind::Dispatches(report)) }).await?;
    continuum_tests::eventually(CONVERGE, "the observer seeing the old stream's dispatch", || async {
        dispatches() == 1
    })
    .await?;

    // Another replica's stream is left alone; the same id's is not.
    let (_other_tx, _other_updates) = open_watch(&control.url(), "replica-b").await?;
    assert_eq!(control.metrics.watch_superseded.get(), 0);
    let (_new_tx, _new_updates) = open_watch(&control.url(), "replica-a").await?;
    let streams_of = |id: &str| control.replicas.list().iter().filter(|r| r.replica_id == id).count();
    assert_eq!(streams_of("replica-a"), 1, "the superseded session is not listed beside its successor");
    continuum_tests::eventually(CONVERGE, "the old stream's dispatch forgotten", || async { dispatches() == 0 })
        .await?;
    assert_eq!(control.metrics.watch_superseded.get(), 1);
    // Ended, though its client never closed it, and saying why: a second replica running with
    // the same id reads how to stop the churn.
    let ended = end_status(&mut old_updates).await?;
    anyhow::ensure!(ended.code() == tonic::Code::Aborted && ended.message().contains("--replica-id"), "{ended:?}");
    continuum_tests::eventually(CONVERGE, "one stream listed per replica id", || async {
        streams_of("replica-a") == 1 && streams_of("replica-b") == 1
    })
    .await?;
    drop(old_tx);
    for replica in observers {
        replica.shutdown().await;
    }
    control.stop().await;
    Ok(())
}

/// The embedded default with every listener on a free loopback port.
fn embedded_on_loopback() -> continuum_control_plane::config::Config {
    let mut config = continuum_control_plane::config::embedded_default();
    let any_port = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    config.move_simulator_shim(any_port);
    config.control_plane.grpc_listen = any_port;
    config.admin.listen = any_port;
    config
}

/// Mutual TLS for the Fleet service: `pki`'s server certificate, and its CA for clients.
fn mutual_tls(pki: &continuum_tests::pki::Pki) -> continuum_control_plane::config::ListenerTlsConfig {
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    ListenerTlsConfig {
        cert: Some(pki.server_cert.clone()),
        key: Some(Secret::new(pki.server_key.display().to_string())),
        client_ca: Some(pki.ca_cert.clone()),
    }
}

/// Replaces `to` with a copy of `from` whole, by a rename, as the kubelet does a Secret's
/// files: a poll never reads half of one.
fn replace(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    let staged = to.with_extension("staged");
    std::fs::copy(from, &staged)?;
    std::fs::rename(staged, to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_set_only_callers_presenting_it_reach_the_fleet_and_a_reload_rotates_it_with_the_old_one_beside()
-> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::Secret;
    use continuum_data_plane::fleet::{Credentials, FleetClientConfig};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use tonic::Code;

    let mut config = embedded_on_loopback();
    config.control_plane.token = Some(Secret::new("first-s3cret"));
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    let url = format!("http://{}", control.grpc_addr);
    let follow = async |name: &str, token: Option<&str>| -> anyhow::Result<Replica> {
        let mut follow = FleetClientConfig::new(url.clone(), name);
        if let Some(token) = token {
            follow.credentials = Credentials::bearer(token)?;
        }
        Ok(Replica::start("127.0.0.1:0", follow).await?)
    };
    let workers = |replica: &Replica| replica.fleet.view().map_or(0, |view| view.workers().len());
    let open = |control: &ControlPlane| {
        let mut ids: Vec<String> = control.replicas.list().iter().map(|s| s.replica_id.clone()).collect();
        ids.sort();
        ids
    };

    let bare = follow("bare", None).await?;
    let wrong = follow("wrong", Some("guess")).await?;
    let first = follow("first", Some("first-s3cret")).await?;
    eventually(CONVERGE, "the replica with the token holds the fleet", || async { workers(&first) == 4 }).await?;
    let refused = control.metrics.unauthenticated.clone();
    eventually(CONVERGE, "both other replicas refused", || async { refused.get() >= 2 }).await?;
    assert!(bare.fleet.view().is_none() && wrong.fleet.view().is_none(), "neither was sent the fleet");
    assert_eq!(open(&control), ["first"]);

    // Every call, not only the stream: the snapshot and the KV lookups are the replicas' too.
    let raw = |token: Option<&'static str>| {
        let url = url.clone();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(url)?.connect().await?;
            let credentials = token.map(Credentials::bearer).transpose()?.unwrap_or_default();
            anyhow::Ok(pb::fleet_client::FleetClient::with_interceptor(channel, credentials))
        }
    };
    let mut anonymous = raw(None).await?;
    let status = anonymous.get_snapshot(pb::GetSnapshotRequest::default()).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(status.message().contains("control_plane.token"), "says what to send: {}", status.message());
    let lookup = pb::FindMatchesRequest { model: "tiny".into(), ..Default::default() };
    let status = anonymous.find_matches(lookup.clone()).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unauthenticated);
    // Refused from its headers, before its message is read: one past what the service would
    // read at all is refused for its token, not its size.
    let hashes = continuum_proto::MAX_INBOUND_FLEET_MESSAGE_BYTES / 8 + 1;
    let oversized = pb::FindMatchesRequest { block_hashes: vec![u64::MAX; hashes], ..lookup.clone() };
    let status = anonymous.find_matches(oversized).await.expect_err("refused");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(raw(Some("first-s3cret")).await?.get_snapshot(pb::GetSnapshotRequest::default()).await.is_ok());

    // The refused replicas stop retrying, so the count below is this test's calls alone.
    bare.shutdown().await;
    wrong.shutdown().await;

    // A rotation: the new token, with the old one accepted beside it until every replica has
    // moved; the open stream keeps running and the old token's lookups still answer.
    config.control_plane.token = Some(Secret::new("second-s3cret"));
    config.control_plane.previous_token = Some(Secret::new("first-s3cret"));
    control.reload(config.clone()).await?;
    let second = follow("second", Some("second-s3cret")).await?;
    eventually(CONVERGE, "a replica with the new token holds the fleet", || async { workers(&second) == 4 }).await?;
    assert_eq!(open(&control), ["first", "second"]);
    let answered = raw(Some("first-s3cret")).await?.find_matches(lookup.clone()).await;
    assert!(answered.is_ok(), "the previous token still answers: {answered:?}");

    // The rotation done, the old token is refused, counted, and the stream opened with it
    // ends: whoever held a leaked token is locked out of the fleet it was following.
    config.control_plane.previous_token = None;
    control.reload(config).await?;
    let before = refused.get();
    let status = raw(Some("first-s3cret")).await?.find_matches(lookup).await.expect_err("the old token is refused");
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(refused.get() > before, "counted");
    let retired = control.metrics.watch_retired.clone();
    eventually(CONVERGE, "the stream opened with the old token ends", || async {
        open(&control) == ["second"] && retired.get() == 1
    })
    .await?;

    for replica in [first, second] {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_only_replicas_holding_a_certificate_of_the_client_ca_follow_the_fleet() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_data_plane::fleet::{FleetClientConfig, client_tls};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(dir.path())?;
    let mut config = embedded_on_loopback();
    config.control_plane.tls = Some(mutual_tls(&pki));
    let control = ControlPlane::start(config, ListenOverrides::default()).await?;
    let port = control.grpc_addr.port();
    let follow = async |name: &str, scheme: &str, identity: Option<(&std::path::Path, &std::path::Path)>| {
        let mut follow = FleetClientConfig::new(format!("{scheme}://127.0.0.1:{port}"), name);
        if scheme == "https" {
            follow.tls = Some(client_tls(&pki.ca_cert, identity)?.domain_name("localhost").into());
        }
        anyhow::Ok(Replica::start("127.0.0.1:0", follow).await?)
    };
    let workers = |replica: &Replica| replica.fleet.view().map_or(0, |view| view.workers().len());

    let mutual = follow("mutual", "https", Some((&pki.client_cert, &pki.client_key))).await?;
    let anonymous = follow("anonymous", "https", None).await?;
    let plaintext = follow("plaintext", "http", None).await?;
    eventually(CONVERGE, "the replica with a certificate holds the fleet", || async { workers(&mutual) == 4 }).await?;
    for refused in [&anonymous, &plaintext] {
        let failed = refused.metrics.reconnects.clone();
        eventually(CONVERGE, "a refused stream", || async { failed.get() > 0 }).await?;
        assert_eq!(workers(refused), 0, "never sent the fleet");
    }
    let ids: Vec<String> = control.replicas.list().iter().map(|s| s.replica_id.clone()).collect();
    assert_eq!(ids, ["mutual"]);
    // TLS settings beside an http:// URL would go unused (tonic speaks plaintext): refused.
    let mut mixed = FleetClientConfig::new(format!("http://127.0.0.1:{port}"), "mixed");
    mixed.tls = Some(client_tls(&pki.ca_cert, Some((&pki.client_cert, &pki.client_key)))?.into());
    let error = Replica::start("127.0.0.1:0", mixed).await.expect_err("TLS over http:// is refused").to_string();
    assert!(error.contains("need an https://"), "{error}");

    for replica in [mutual, anonymous, plaintext] {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(())
}

/// A control plane that accepts the connection and then says nothing (frozen, or behind a
/// silent middlebox) holds neither the TLS handshake nor the reconnect loop: each attempt
/// gives up after the handshake timeout and the replica tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_peer_times_out_the_handshake_and_the_replica_tries_again() -> anyhow::Result<()> {
    use continuum_data_plane::fleet::{FleetClientConfig, TLS_HANDSHAKE_TIMEOUT, client_tls};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(dir.path())?;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = silent.local_addr()?.port();
    // Accepts every connection and holds it without a byte, counting them.
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let held = tokio::spawn({
        let accepted = std::sync::Arc::clone(&accepted);
        async move {
            let mut open = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                open.push(stream);
            }
        }
    });
    let mut follow = FleetClientConfig::new(format!("https://127.0.0.1:{port}"), "patient");
    follow.tls = Some(client_tls(&pki.ca_cert, None)?.domain_name("localhost").into());
    let replica = Replica::start("127.0.0.1:0", follow).await?;
    let reconnects = replica.metrics.reconnects.clone();
    let started = std::time::Instant::now();
    eventually(3 * TLS_HANDSHAKE_TIMEOUT, "an attempt given up", || async { reconnects.get() > 0 }).await?;
    assert!(started.elapsed() >= TLS_HANDSHAKE_TIMEOUT / 2, "not refused at once: the handshake was waited on");
    let redialled = || async { accepted.load(std::sync::atomic::Ordering::Relaxed) >= 2 };
    eventually(3 * TLS_HANDSHAKE_TIMEOUT, "a second connection", redialled).await?;
    replica.shutdown().await;
    held.abort();
    Ok(())
}

/// A renewal on a running control plane: the files replaced in place (as cert-manager or a
/// Secret volume do) and a reload. New connections get the new certificate, open streams keep
/// theirs, and files that do not pair are refused while the running certificate stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_reaches_new_connections_while_open_streams_keep_running() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    use continuum_data_plane::fleet::{FleetClientConfig, client_tls};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let (old, new) = (Pki::generate(&dir.path().join("old"))?, Pki::generate(&dir.path().join("new"))?);
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let install = |pki: &Pki| -> std::io::Result<()> {
        replace(&pki.server_cert, &cert)?;
        replace(&pki.server_key, &key)
    };
    install(&old)?;
    let mut config = embedded_on_loopback();
    let key_path = Secret::new(key.display().to_string());
    config.control_plane.tls =
        Some(ListenerTlsConfig { cert: Some(cert.clone()), key: Some(key_path), client_ca: None });
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    let url = format!("https://127.0.0.1:{}", control.grpc_addr.port());
    let follow = async |name: &str, trusting: &Pki| {
        let mut follow = FleetClientConfig::new(url.clone(), name);
        follow.tls = Some(client_tls(&trusting.ca_cert, None)?.domain_name("localhost").into());
        anyhow::Ok(Replica::start("127.0.0.1:0", follow).await?)
    };
    let workers = |replica: &Replica| replica.fleet.view().map_or(0, |view| view.workers().len());
    let tls_reloads = control.metrics.fleet_tls_reloads.clone();
    let reloads = |result: &str| tls_reloads.with_label_values(&[result]).get();

    let before = follow("before", &old).await?;
    eventually(CONVERGE, "a replica trusting the first CA follows", || async { workers(&before) == 4 }).await?;

    // Halfway through a renewal: the new certificate beside the old key. Refused, counted once
    // whether the poll or the reload reads it first.
    replace(&new.server_cert, &cert)?;
    control.reload(config.clone()).await?;
    assert_eq!((reloads("applied"), reloads("refused")), (0, 1));
    let still_old = follow("still-old", &old).await?;
    eventually(CONVERGE, "the running certificate is still served", || async { workers(&still_old) == 4 }).await?;

    install(&new)?;
    control.reload(config).await?;
    assert_eq!((reloads("applied"), reloads("refused")), (1, 1));
    let after = follow("after", &new).await?;
    let stale = follow("stale", &old).await?;
    eventually(CONVERGE, "a replica trusting the new CA follows", || async { workers(&after) == 4 }).await?;
    let failed = control.metrics.fleet_tls_handshakes_failed.with_label_values(&["refused"]);
    eventually(CONVERGE, "one trusting only the old CA is refused", || async { failed.get() > 0 }).await?;
    assert_eq!(workers(&stale), 0, "never sent the fleet");
    assert_eq!(before.metrics.reconnects.get(), 0, "the stream opened under the old certificate kept running");
    let mut ids: Vec<String> = control.replicas.list().iter().map(|s| s.replica_id.clone()).collect();
    ids.sort();
    assert_eq!(ids, ["after", "before", "still-old"]);

    for replica in [before, still_old, after, stale] {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(())
}

/// Rotating the client CA ends the Watch streams verified against the old one: a replica whose
/// certificate the new CA does not sign (revoked by rotating its CA out) loses the fleet at
/// once, not whenever its connection happens to drop; one the new CA signs follows on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_client_ca_ends_the_streams_verified_against_the_old_one() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    use continuum_data_plane::fleet::{FleetClientConfig, client_tls};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let (old, new) = (Pki::generate(&dir.path().join("old"))?, Pki::generate(&dir.path().join("new"))?);
    let client_ca = dir.path().join("client-ca.pem");
    replace(&old.ca_cert, &client_ca)?;
    let mut config = embedded_on_loopback();
    config.control_plane.tls = Some(ListenerTlsConfig {
        cert: Some(old.server_cert.clone()),
        key: Some(Secret::new(old.server_key.display().to_string())),
        client_ca: Some(client_ca.clone()),
    });
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    let url = format!("https://127.0.0.1:{}", control.grpc_addr.port());
    let follow = async |name: &str, identity: &Pki| {
        let mut follow = FleetClientConfig::new(url.clone(), name);
        let client = Some((identity.client_cert.as_path(), identity.client_key.as_path()));
        follow.tls = Some(client_tls(&old.ca_cert, client)?.domain_name("localhost").into());
        anyhow::Ok(Replica::start("127.0.0.1:0", follow).await?)
    };
    let workers = |replica: &Replica| replica.fleet.view().map_or(0, |view| view.workers().len());
    let revoked = follow("revoked", &old).await?;
    eventually(CONVERGE, "a replica of the first CA follows", || async { workers(&revoked) == 4 }).await?;
    // A connection of the old CA that stays open, as a replica's lookups' does.
    let tls = client_tls(&old.ca_cert, Some((old.client_cert.as_path(), old.client_key.as_path())))?;
    let channel = tonic::transport::Endpoint::from_shared(url.clone())?
        .tls_config(tls.domain_name("localhost"))?
        .connect()
        .await?;
    let mut open = FleetClient::new(channel);
    open.get_snapshot(pb::GetSnapshotRequest {}).await?;

    replace(&new.ca_cert, &client_ca)?;
    control.reload(config).await?;
    let retired = control.metrics.watch_retired.clone();
    eventually(CONVERGE, "its stream is ended", || async { retired.get() == 1 }).await?;
    let listed = || control.replicas.list().iter().map(|s| s.replica_id.clone()).collect::<Vec<_>>();
    eventually(CONVERGE, "and it is not let back", || async { listed().is_empty() }).await?;
    let refused = control.metrics.fleet_tls_handshakes_failed.with_label_values(&["refused"]);
    eventually(CONVERGE, "its handshakes are refused", || async { refused.get() > 0 }).await?;
    let call = tokio::time::timeout(CONVERGE, open.get_snapshot(pb::GetSnapshotRequest {})).await?;
    assert!(call.is_err(), "a call on a connection the old CA verified is not answered");
    let renewed = follow("renewed", &new).await?;
    eventually(CONVERGE, "a replica of the new CA follows", || async { workers(&renewed) == 4 }).await?;
    assert_eq!(listed(), ["renewed"]);

    for replica in [revoked, renewed] {
        replica.shutdown().await;
    }
    control.shutdown().await;
    Ok(())
}

/// A client certificate is good for its validity, not for as long as its connection lasts:
/// a replica's connection never goes quiet (its pings answered every 10 s), so one verified
/// with a certificate that then expires is ended when it does, its Watch stream with it, and
/// the replica must dial again with a valid one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_ends_when_the_client_certificate_it_was_verified_with_expires() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_data_plane::fleet::client_tls;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let pki = Pki::generate_with_client_lifetime(dir.path(), Some(Duration::from_secs(3)))?;
    let mut config = embedded_on_loopback();
    config.control_plane.tls = Some(mutual_tls(&pki));
    let control = ControlPlane::start(config, ListenOverrides::default()).await?;
    let url = format!("https://127.0.0.1:{}", control.grpc_addr.port());
    let tls = client_tls(&pki.ca_cert, Some((pki.client_cert.as_path(), pki.client_key.as_path())))?;
    let channel =
        tonic::transport::Endpoint::from_shared(url)?.tls_config(tls.domain_name("localhost"))?.connect().await?;
    let mut client = FleetClient::new(channel).max_decoding_message_size(MAX_FLEET_MESSAGE_BYTES);
    client.get_snapshot(pb::GetSnapshotRequest {}).await?;
    let (replies, rx) = mpsc::channel(16);
    let hello = pb::Hello { replica_id: "short-lived".into(), version: None };
    replies.send(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }).await?;
    let mut updates = client.watch(ReceiverStream::new(rx)).await?.into_inner();
    let first = next_update(&mut updates).await?;
    replies.send(ack(&first)).await?;

    // The certificate expires (its validity counts whole seconds): the stream ends with its
    // connection, and every later call is refused.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match updates.message().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await;
    assert!(matches!(ended, Ok(Err(_)) | Ok(Ok(()))), "the Watch stream ended: {ended:?}");
    eventually(CONVERGE, "calls are refused", || {
        let mut client = client.clone();
        async move { client.get_snapshot(pb::GetSnapshotRequest {}).await.is_err() }
    })
    .await?;
    control.shutdown().await;
    Ok(())
}

/// A replica following `control` over TLS (trusting `pki`'s CA) with the token `first-s3cret`,
/// once it holds the embedded fleet's four workers.
async fn replica_over_tls(
    control: &continuum_control_plane::app::ControlPlane,
    pki: &continuum_tests::pki::Pki,
) -> anyhow::Result<continuum_data_plane::replica::Replica> {
    use continuum_data_plane::fleet::{Credentials, FleetClientConfig, client_tls};
    let mut follow = FleetClientConfig::new(format!("https://127.0.0.1:{}", control.grpc_addr.port()), "first");
    follow.tls = Some(client_tls(&pki.ca_cert, None)?.domain_name("localhost").into());
    follow.credentials = Credentials::bearer("first-s3cret")?;
    let replica = continuum_data_plane::replica::Replica::start("127.0.0.1:0", follow).await?;
    let workers = || replica.fleet.view().map_or(0, |view| view.workers().len());
    continuum_tests::eventually(CONVERGE, "the replica holds the fleet", || async { workers() == 4 }).await?;
    Ok(replica)
}

/// A reload whose certificate files do not read (a volume stalled on them) still applies: the
/// running certificate is kept, and a token the reload revokes is revoked, within the read's
/// bound rather than whenever the volume answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_stalled_on_its_certificate_files_still_revokes_a_token() -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;

    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"))?;
    let cert = dir.path().join("tls.crt");
    replace(&pki.server_cert, &cert)?;
    let mut config = embedded_on_loopback();
    config.control_plane.token = Some(Secret::new("first-s3cret"));
    config.control_plane.tls = Some(ListenerTlsConfig {
        cert: Some(cert.clone()),
        key: Some(Secret::new(pki.server_key.display().to_string())),
        client_ca: None,
    });
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    let first = replica_over_tls(&control, &pki).await?;

    std::fs::remove_file(&cert)?;
    anyhow::ensure!(std::process::Command::new("mkfifo").arg(&cert).status()?.success(), "mkfifo");
    config.control_plane.token = Some(Secret::new("second-s3cret"));
    let reloaded = tokio::time::timeout(Duration::from_secs(15), control.reload(config)).await;
    let retired = control.metrics.watch_retired.clone();
    let revoked = eventually(CONVERGE, "the stream of the revoked token ended", || async { retired.get() == 1 }).await;
    // Whatever happened, nothing stays blocked on the FIFO: release its readers, then put the
    // certificate back for the polls to come.
    let release = || std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(&cert).is_ok();
    let mut released = 0;
    while release() {
        released += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let restored = dir.path().join("restored.crt");
    std::fs::copy(&pki.server_cert, &restored)?;
    std::fs::rename(&restored, &cert)?;
    reloaded.map_err(|_| anyhow::anyhow!("the reload waited on the stalled files"))??;
    // A writer could open the FIFO only while a reader had it open: the reload did try the
    // stalled file (and was still stuck in it when it went on without it).
    anyhow::ensure!(released > 0, "the reload never opened the stalled certificate file");
    revoked?;
    first.shutdown().await;
    control.shutdown().await;
    Ok(())
}

/// A reload that moves the certificate files to a volume stalled on them is refused within the
/// read's bound, whole: the running certificate and tokens stay, and later reloads are not
/// held behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moving_its_certificate_files_to_a_stalled_volume_is_refused_in_time() -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;

    use continuum_control_plane::app::{ControlPlane, FILE_READ_WAIT, ListenOverrides, ReloadError};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let pki = Pki::generate(&dir.path().join("pki"))?;
    let mut config = embedded_on_loopback();
    config.control_plane.token = Some(Secret::new("first-s3cret"));
    let tls = |cert: &std::path::Path| ListenerTlsConfig {
        cert: Some(cert.to_path_buf()),
        key: Some(Secret::new(pki.server_key.display().to_string())),
        client_ca: None,
    };
    config.control_plane.tls = Some(tls(&pki.server_cert));
    let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
    let replica = replica_over_tls(&control, &pki).await?;
    let stalled = dir.path().join("stalled.crt");
    anyhow::ensure!(std::process::Command::new("mkfifo").arg(&stalled).status()?.success(), "mkfifo");
    let mut moved = config.clone();
    moved.control_plane.tls = Some(tls(&stalled));
    moved.control_plane.token = Some(Secret::new("second-s3cret"));
    let reloaded = tokio::time::timeout(FILE_READ_WAIT * 3, control.reload(moved)).await;
    // Release the reader left on the FIFO, whatever happened.
    while std::fs::OpenOptions::new().write(true).custom_flags(0o4000).open(&stalled).is_ok() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = reloaded.map_err(|_| anyhow::anyhow!("the reload waited on the stalled files"))?;
    assert!(
        matches!(&refused, Err(ReloadError::Tls(error)) if error.to_string().contains("did not read")),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(control.metrics.watch_retired.get(), 0, "the running token kept: its stream goes on");
    assert_eq!(control.replicas.list().len(), 1);
    control.reload(config).await?;
    replica.shutdown().await;
    control.shutdown().await;
    Ok(())
}

/// A replica's own certificate renewed in place: its Watch stream reads the files at every
/// connection, and its lookups' connection is renewed when they change. No restart either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_uses_its_renewed_certificate_files_without_a_restart() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};
    use continuum_data_plane::fleet::{ClientTls, FleetClientConfig, MatchesClient, TlsFiles};
    use continuum_data_plane::replica::Replica;
    use continuum_tests::eventually;
    use continuum_tests::pki::Pki;

    let dir = tempfile::tempdir()?;
    let (trusted, stranger) = (Pki::generate(&dir.path().join("trusted"))?, Pki::generate(&dir.path().join("other"))?);
    let (cert, key) = (dir.path().join("replica.crt"), dir.path().join("replica.key"));
    let install = |pki: &Pki| -> std::io::Result<()> {
        replace(&pki.client_cert, &cert)?;
        replace(&pki.client_key, &key)
    };
    install(&stranger)?;
    let mut config = embedded_on_loopback();
    config.control_plane.tls = Some(ListenerTlsConfig {
        cert: Some(trusted.server_cert.clone()),
        key: Some(Secret::new(trusted.server_key.display().to_string())),
        client_ca: Some(trusted.ca_cert.clone()),
    });
    let control = ControlPlane::start(config, ListenOverrides::default()).await?;
    let mut follow = FleetClientConfig::new(format!("https://127.0.0.1:{}", control.grpc_addr.port()), "renewing");
    follow.tls =
        Some(ClientTls::Files(TlsFiles { ca: trusted.ca_cert.clone(), identity: Some((cert.clone(), key.clone())) }));

    // A certificate beside another pair's key fails the start, before anything runs.
    let mut mismatched = follow.clone();
    let identity = Some((trusted.client_cert.clone(), stranger.client_key.clone()));
    mismatched.tls = Some(ClientTls::Files(TlsFiles { ca: trusted.ca_cert.clone(), identity }));
    let error = Replica::start("127.0.0.1:0", mismatched).await.expect_err("a key of another pair").to_string();
    assert!(error.contains("cannot follow the control plane"), "{error}");

    let lookups = MatchesClient::new(&follow, Duration::from_secs(5))?;
    let lookup = || lookups.find_matches(0, vec![1, 2], "tiny", &[], 0);
    assert!(lookup().await.is_err(), "a certificate of another CA is refused");
    // What the replica runs for its own lookups every 10 s, here more often: without it, the
    // lookups' connection would keep the files it was made with.
    let (stop, every) = (tokio_util::sync::CancellationToken::new(), Duration::from_millis(50));
    let renewing = tokio::spawn(lookups.clone().follow_tls_files(follow.clone(), every, stop.clone()));
    let replica = Replica::start("127.0.0.1:0", follow.clone()).await?;
    let refused = replica.metrics.reconnects.clone();
    eventually(CONVERGE, "the replica's stream refused", || async { refused.get() > 0 }).await?;
    assert!(replica.fleet.view().is_none());

    install(&trusted)?;
    let workers = || replica.fleet.view().map_or(0, |view| view.workers().len());
    eventually(CONVERGE, "the next connection presents the renewed certificate", || async { workers() == 4 }).await?;
    eventually(CONVERGE, "lookups renewed once the files changed", || async { lookup().await.is_ok() }).await?;
    stop.cancel();
    renewing.await?;

    replica.shutdown().await;
    control.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_certificate_that_does_not_load_fails_the_start_and_says_which() -> anyhow::Result<()> {
    use continuum_control_plane::app::{ControlPlane, ListenOverrides};
    use continuum_control_plane::config::{ListenerTlsConfig, Secret};

    let dir = tempfile::tempdir()?;
    let garbage = dir.path().join("cert.pem");
    std::fs::write(&garbage, "not a certificate")?;
    let tls = |cert: std::path::PathBuf| {
        let mut config = embedded_on_loopback();
        let key = Some(Secret::new(garbage.display().to_string()));
        config.control_plane.tls = Some(ListenerTlsConfig { cert: Some(cert), key, client_ca: None });
        config
    };
    let missing = ControlPlane::start(tls(dir.path().join("absent.pem")), ListenOverrides::default()).await;
    let error = missing.expect_err("no certificate file").to_string();
    assert!(error.contains("control_plane.tls") && error.contains("absent.pem"), "{error}");
    let unreadable = ControlPlane::start(tls(garbage.clone()), ListenOverrides::default()).await;
    let error = unreadable.expect_err("not PEM").to_string();
    assert!(error.contains("control_plane.tls"), "{error}");
    Ok(())
}

/// Operations faster than the stream drains them fill the report queue: one is lost, so the
/// stream's reports can no longer be whole. The replica ends the stream and opens another,
/// and the control plane forgets the old one's dispatches, whose ends may never come (they
/// would otherwise weigh on the rank, for every replica, for ten minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_report_queue_fills_starts_over_on_a_new_stream() -> anyhow::Result<()> {
    use continuum_data_plane::fleet::REPORT_QUEUE;
    let control = TestControlPlane::start(publisher()).await?;
    control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 7, "m")], ..Default::default() });
    let replicas = start_replicas(1, &control.url()).await?;
    wait_for_version(&replicas, control.publisher.current().version(), CONVERGE).await?;
    let replica = &replicas[0];
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    let in_flight = || control.publisher.current().view().backlogs().get(&rank).map_or(0, |b| b.dispatches);
    for _ in 0..3 {
        replica.reporter.operation(|report| report.started(&rank, 16, 1, Vec::new()));
    }
    continuum_tests::eventually(CONVERGE, "the first stream's dispatches counted", || async { in_flight() == 3 })
        .await?;
    // Far faster than a report a millisecond of 512 events drains them: pushed until one
    // finds the queue full, however long this thread is preempted meanwhile.
    let dropped = || replica.metrics.dispatch_reports_dropped.get();
    for _ in 0..64 * REPORT_QUEUE {
        if dropped() > 0 {
            break;
        }
        replica.reporter.operation(|report| report.started(&rank, 16, 1, Vec::new()));
    }
    assert_eq!(dropped(), 1, "the queue filled once");
    continuum_tests::eventually(CONVERGE, "a new stream", || async {
        replica.metrics.reconnects.get() >= 1 && replica.metrics.stream_connected.get() == 1
    })
    .await?;
    continuum_tests::eventually(CONVERGE, "the old stream's dispatches forgotten", || async { in_flight() == 0 })
        .await?;
    Ok(())
}

/// A replica whose connection stays up but that reads nothing of its stream (a stuck task)
/// follows nothing: once its session has had no room for an update for the limit, the control
/// plane ends it rather than hold it, and its queued snapshots, for as long as the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_reading_its_stream_is_let_go() -> anyhow::Result<()> {
    use continuum_control_plane::grpc::REPLICA_STALL_LIMIT;
    let control = TestControlPlane::start(publisher()).await?;
    let (requests, unread) = open_watch(&control.url(), "stuck").await?;
    continuum_tests::eventually(CONVERGE, "the session open", || async { control.replicas.list().len() == 1 }).await?;
    // Workers with 32 KiB model names, 8 MiB in all: more than HTTP/2's windows (the client's
    // are 2 MiB a stream) and the queue hold.
    for id in 0..256 {
        let model = format!("{id}{}", "m".repeat(32 << 10));
        control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", id + 1, &model)], ..Default::default() });
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(control.replicas.list().len(), 1, "still held while within the limit");
    assert_eq!(control.metrics.watch_stalled.get(), 0);
    // The fleet goes on changing, so the session always has an update the replica is not
    // taking.
    let mut version = 0;
    continuum_tests::eventually(REPLICA_STALL_LIMIT + CONVERGE, "the session let go", || {
        version += 1;
        let model = format!("changed {version}");
        control.publisher.apply(FleetChange { upsert: vec![worker("dynamo", 1, &model)], ..Default::default() });
        async { control.replicas.list().is_empty() }
    })
    .await?;
    assert_eq!(control.metrics.watch_stalled.get(), 1, "counted");
    // The stream itself ends with the client: until then what it queued waits on the window.
    drop((requests, unread));
    control.stop().await;
    Ok(())
}

/// A fleet of `half` workers just past half what a Fleet message may carry, and the change
/// that replaces it whole (every worker re-registered under a new instance id), which names
/// each old worker and each new one. Namespaces of 32 KiB: a removal names its worker's key,
/// so the old workers weigh as much in the change as the new ones.
fn a_fleet_and_its_replacement() -> (FleetChange, FleetChange, u64) {
    let namespace = "n".repeat(32 << 10);
    let half = (MAX_FLEET_MESSAGE_BYTES as u64 >> 16) + 32;
    let old: Vec<_> = (1..=half).map(|id| worker(&namespace, id, "m")).collect();
    let new: Vec<_> = (half + 1..=2 * half).map(|id| worker(&namespace, id, "m")).collect();
    let remove = old.iter().map(|w| w.key.clone()).collect();
    let fleet = FleetChange { upsert: old, ..Default::default() };
    (fleet, FleetChange { upsert: new, remove, ..Default::default() }, half)
}

/// A change larger than a Fleet message may carry, to a fleet that is not, reaches the replica
/// as the fleet's snapshot: the whole fleet replaced at once (every worker re-registered under
/// a new instance id) names each old worker and each new one, twice what the fleet holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_larger_than_a_message_is_sent_as_the_smaller_snapshot() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    let (fleet, replaced, half) = a_fleet_and_its_replacement();
    control.publisher.apply(fleet);
    let (requests, mut updates) = open_watch(&control.url(), "replaced").await?;
    let first = next_update(&mut updates).await?;
    assert!(is_snapshot(&first));
    requests.send(ack(&first)).await?;
    let view = fold(None, first)?;
    continuum_tests::eventually(CONVERGE, "the snapshot acknowledged", || async {
        control
            .replicas
            .list()
            .first()
            .is_some_and(|r| r.acked_version.load(std::sync::atomic::Ordering::Relaxed) == view.version())
    })
    .await?;
    control.publisher.apply(replaced);
    let next = next_update(&mut updates).await?;
    assert!(is_snapshot(&next), "the snapshot in place of the delta");
    let view = fold(Some(view), next)?;
    assert_eq!(view.workers().len() as u64, half);
    assert!(view.workers().keys().all(|key| key.instance_id > half), "only the new workers");
    let sent = |kind: &str| control.metrics.updates_sent.with_label_values(&[kind]).get();
    assert_eq!((sent("snapshot"), sent("delta"), sent("too_large")), (2, 0, 0));
    control.stop().await;
    Ok(())
}

/// The same change while the replica has not acknowledged its first snapshot: the snapshot it
/// needs waits for that acknowledgement, and a replica that never gives it is let go at the
/// stall limit, as one that stops reading is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_owed_a_snapshot_in_place_of_a_large_change_is_let_go_if_it_never_acknowledges() -> anyhow::Result<()>
{
    use continuum_control_plane::grpc::REPLICA_STALL_LIMIT;
    let control = TestControlPlane::start(publisher()).await?;
    let (fleet, replaced, _) = a_fleet_and_its_replacement();
    control.publisher.apply(fleet);
    let (_requests, mut updates) = open_watch(&control.url(), "silent").await?;
    let first = next_update(&mut updates).await?;
    assert!(is_snapshot(&first));
    control.publisher.apply(replaced);
    // Reading on, so the queue always has room: only the acknowledgement is missing.
    let ended = tokio::time::timeout(REPLICA_STALL_LIMIT + CONVERGE, async {
        loop {
            match updates.message().await {
                Ok(Some(update)) => {
                    anyhow::ensure!(!is_snapshot(&update), "a second snapshot before the first was acknowledged")
                }
                Ok(None) | Err(_) => return Ok(()),
            }
        }
    })
    .await;
    ended.map_err(|_| anyhow::anyhow!("the session neither sent the snapshot nor let the replica go"))??;
    assert_eq!(control.metrics.watch_stalled.get(), 1, "let go at the stall limit");
    control.stop().await;
    Ok(())
}

/// A fleet whose snapshot is larger than a Fleet message may carry is not sent (it could not
/// be), nor counted as sent: the replica is told why, and keeps its last view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_too_large_to_send_is_refused_with_its_reason() -> anyhow::Result<()> {
    let control = TestControlPlane::start(publisher()).await?;
    // Workers with 32 KiB model names, past 64 MiB in all.
    let workers = (1..=(MAX_FLEET_MESSAGE_BYTES as u64 >> 15) + 64)
        .map(|id| worker("dynamo", id, &format!("{id}{}", "m".repeat(32 << 10))))
        .collect();
    control.publisher.apply(FleetChange { upsert: workers, ..Default::default() });
    let (_requests, mut updates) = open_watch(&control.url(), "far-too-large").await?;
    let refused = tokio::time::timeout(CONVERGE, updates.message()).await?.err();
    let status = refused.ok_or_else(|| anyhow::anyhow!("a snapshot past the bound was sent"))?;
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("snapshot"), "{status:?}");
    let sent = |kind: &str| control.metrics.updates_sent.with_label_values(&[kind]).get();
    assert_eq!((sent("snapshot"), sent("too_large")), (0, 1));
    control.stop().await;
    Ok(())
}
