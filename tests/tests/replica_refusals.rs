//! A data-plane replica facing a control plane that sends updates it cannot apply: each is
//! NACKed with a reason, the replica's view stays as it was, and the resync is applied.

use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_data_plane::replica::Replica;
use continuum_proto::convert::{delta_to_wire, snapshot_to_wire};
use continuum_proto::model::{DataPlaneConfig, Load, LoadKey, LoadSample, WorkerKey};
use continuum_proto::pb::{
    self, fleet_server::Fleet, fleet_server::FleetServer, fleet_update::Body, watch_request::Kind,
};
use continuum_proto::view::{FleetDelta, FleetView};
use continuum_tests::{start_replicas, wait_for_version, worker};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// A control plane that plays a script and reports every reply it receives; it sends the next
/// update only when the test says so, so the test can inspect the replica in between.
struct Scripted {
    script: Vec<pb::FleetUpdate>,
    replies: mpsc::UnboundedSender<pb::WatchRequest>,
    next: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<()>>>,
}

#[tonic::async_trait]
impl Fleet for Scripted {
    type WatchStream = ReceiverStream<Result<pb::FleetUpdate, Status>>;

    async fn watch(
        &self,
        request: Request<Streaming<pb::WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let (script, replies, next) = (self.script.clone(), self.replies.clone(), Arc::clone(&self.next));
        tokio::spawn(async move {
            // The hello, then one reply per scripted update, sent one at a time.
            let _hello = inbound.message().await;
            for update in script {
                if next.lock().await.recv().await.is_none() {
                    return;
                }
                if tx.send(Ok(update)).await.is_err() {
                    return;
                }
                match inbound.message().await {
                    Ok(Some(reply)) => {
                        let _ = replies.send(reply);
                    }
                    _ => return,
                }
            }
            // Hold the stream open so the replica stays connected.
            std::future::pending::<()>().await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn find_matches(
        &self,
        _: Request<pb::FindMatchesRequest>,
    ) -> Result<Response<pb::FindMatchesResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }
}

fn snapshot(version: u64, ids: &[u64]) -> pb::FleetUpdate {
    let workers = ids.iter().map(|id| worker("dynamo", *id, "tiny"));
    let view = FleetView::new(version, workers, [], Arc::new(DataPlaneConfig::default())).unwrap_or_default();
    pb::FleetUpdate {
        version,
        nonce: format!("s{version}"),
        body: Some(Body::Snapshot(snapshot_to_wire(&view, Instant::now()))),
        reports_folded: None,
    }
}

fn delta(base: u64, version: u64, delta: FleetDelta) -> pb::FleetUpdate {
    let delta = FleetDelta { base_version: base, version, ..delta };
    pb::FleetUpdate {
        version,
        nonce: format!("d{version}"),
        body: Some(Body::Delta(delta_to_wire(&delta, Instant::now()))),
        reports_folded: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_that_do_not_apply_are_nacked_and_the_view_is_kept_until_the_resync() -> anyhow::Result<()> {
    let sample = LoadSample { load: Load { kv_used_blocks: Some(3), ..Load::default() }, received_at: Instant::now() };
    let script = vec![
        snapshot(10, &[1]),
        // Based on a version the replica does not hold.
        delta(99, 100, FleetDelta { upserted: vec![worker("dynamo", 2, "tiny")], ..FleetDelta::default() }),
        // A sample for a worker the view does not have.
        delta(
            10,
            11,
            FleetDelta {
                loads: vec![(LoadKey { worker: WorkerKey::new("dynamo", 9), dp_rank: 0 }, sample)],
                ..FleetDelta::default()
            },
        ),
        // No body at all.
        pb::FleetUpdate { version: 11, nonce: "empty".into(), body: None, reports_folded: None },
        // A worker without a role.
        {
            let mut bad =
                delta(10, 11, FleetDelta { upserted: vec![worker("dynamo", 3, "tiny")], ..FleetDelta::default() });
            if let Some(Body::Delta(d)) = bad.body.as_mut() {
                d.upserted[0].role = pb::Role::Unspecified.into();
            }
            bad
        },
        // The resync.
        snapshot(12, &[1, 4]),
    ];
    let (replies_tx, mut replies) = mpsc::unbounded_channel();
    let (next_tx, next_rx) = mpsc::unbounded_channel();
    let next = Arc::new(tokio::sync::Mutex::new(next_rx));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(Scripted { script, replies: replies_tx, next }))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let replica = start_replicas(1, &url).await?.remove(0);

    let mut reasons = Vec::new();
    for expected_ack in [true, false, false, false, false, true] {
        next_tx.send(())?;
        let reply = tokio::time::timeout(Duration::from_secs(10), replies.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("no reply"))?;
        match reply.kind {
            Some(Kind::Ack(ack)) => assert!(expected_ack, "acked {ack:?}"),
            Some(Kind::Nack(nack)) => {
                assert!(!expected_ack, "nacked {nack:?}");
                let view = replica.fleet.view().ok_or_else(|| anyhow::anyhow!("no view"))?;
                assert_eq!(view.version(), 10, "a refused update leaves the view unchanged");
                reasons.push(nack.reason);
            }
            other => anyhow::bail!("unexpected reply {other:?}"),
        }
    }
    assert!(reasons[0].contains("based on version 99"), "{reasons:?}");
    assert!(reasons[1].contains("no such worker"), "{reasons:?}");
    assert!(reasons[2].contains("body is missing"), "{reasons:?}");
    assert!(reasons[3].contains("role is unspecified"), "{reasons:?}");

    wait_for_version(std::slice::from_ref(&replica), 12, Duration::from_secs(10)).await?;
    let ids: Vec<u64> =
        replica.fleet.view().map(|v| v.workers().keys().map(|k| k.instance_id).collect()).unwrap_or_default();
    assert_eq!(ids, [1, 4]);
    let refused = replica.metrics.updates.with_label_values(&["refused"]).get();
    assert_eq!(refused, 4);
    replica.shutdown().await;
    server.abort();
    Ok(())
}

/// A replica following a scripted control plane that sends one snapshot and, once it is
/// acknowledged, holds the stream open and neither reads nor sends anything more (a stuck
/// session task, its connection's pings still answered).
async fn following_a_stuck_control_plane(
    folding: bool,
) -> anyhow::Result<(Replica, tokio::task::JoinHandle<Result<(), tonic::transport::Error>>)> {
    let (replies_tx, mut replies) = mpsc::unbounded_channel();
    let (next_tx, next_rx) = mpsc::unbounded_channel();
    let next = Arc::new(tokio::sync::Mutex::new(next_rx));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    // `folding`: the snapshot says the control plane folds this stream's reports (a book that
    // gave up never says so).
    let mut first = snapshot(10, &[7]);
    first.reports_folded = folding.then_some(pb::ReportsFolded { first_op: 0, last_op: 0 });
    let script = vec![first];
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(Scripted { script, replies: replies_tx, next }))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let replica = start_replicas(1, &url).await?.remove(0);
    next_tx.send(())?;
    let ack = tokio::time::timeout(Duration::from_secs(10), replies.recv()).await?;
    anyhow::ensure!(matches!(ack.and_then(|r| r.kind), Some(Kind::Ack(_))), "the snapshot is acked");
    Ok((replica, server))
}

/// A control plane that reads the hello and nothing more, yet keeps sending: a snapshot, then
/// an empty delta every 100 ms (so an update always follows a report, and only the replies
/// stall).
struct Deaf;

#[tonic::async_trait]
impl Fleet for Deaf {
    type WatchStream = ReceiverStream<Result<pb::FleetUpdate, Status>>;

    async fn watch(
        &self,
        request: Request<Streaming<pb::WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let _hello = inbound.message().await;
            let mut update = snapshot(10, &[7]);
            for version in 11.. {
                if tx.send(Ok(update)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                update = delta(version - 1, version, FleetDelta::default());
            }
            drop(inbound);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        Err(Status::unimplemented("deaf"))
    }

    async fn find_matches(
        &self,
        _: Request<pb::FindMatchesRequest>,
    ) -> Result<Response<pb::FindMatchesResponse>, Status> {
        Err(Status::unimplemented("deaf"))
    }
}

/// A control plane that keeps its connection up, and sends, but stops reading the stream (a
/// stuck reader): the replica's replies back up, and once one has waited [`REPLY_STALL_LIMIT`]
/// the replica leaves the stream instead of routing on its frozen fleet-wide backlogs for as
/// long as the control plane stays stuck. Updates keep coming and no report is dropped: the
/// replies' stall alone ends the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leaves_a_stream_the_control_plane_stopped_reading() -> anyhow::Result<()> {
    use continuum_data_plane::fleet::REPLY_STALL_LIMIT;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(Deaf))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let replica = start_replicas(1, &url).await?.remove(0);
    wait_for_version(std::slice::from_ref(&replica), 10, Duration::from_secs(10)).await?;

    // Reports of 32 KiB each fill the stream's flow-control window and the reply queue.
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    for n in 0..200u64 {
        replica.reporter.operation(|report| report.started(&rank, 16, 1, (n << 12..(n + 1) << 12).collect()));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(replica.metrics.reconnects.get(), 0, "the stream is still up");
    continuum_tests::eventually(REPLY_STALL_LIMIT + Duration::from_secs(10), "the replica leaving", || async {
        replica.metrics.reconnects.get() >= 1
    })
    .await?;
    assert_eq!(replica.metrics.dispatch_reports_dropped.get(), 0, "left for the stalled replies, not a full queue");
    // Updates were waiting whenever the replica could read: no report went unanswered by one.
    let applied = replica.metrics.updates.with_label_values(&["applied"]).get();
    assert!(applied >= 2, "deltas followed the snapshot: {applied} applied");
    replica.shutdown().await;
    server.abort();
    Ok(())
}

/// A control plane stuck with its connection up (its pings answered) sends no update after
/// the replica reports a dispatch, which it would fold into the fleet-wide backlogs and publish
/// within milliseconds: the replica leaves the stream within [`REPLY_STALL_LIMIT`] of the report,
/// long before a quiet replica's few bytes could fill the stream's window. A replica with
/// nothing to report stays on a quiet stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leaves_a_stream_that_answers_its_reports_with_no_update() -> anyhow::Result<()> {
    use continuum_data_plane::fleet::REPLY_STALL_LIMIT;
    let (replica, server) = following_a_stuck_control_plane(true).await?;

    tokio::time::sleep(REPLY_STALL_LIMIT + Duration::from_secs(1)).await;
    assert_eq!(replica.metrics.reconnects.get(), 0, "a quiet stream with nothing reported is kept");
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    let reported = Instant::now();
    replica.reporter.operation(|report| report.started(&rank, 16, 1, vec![]));
    continuum_tests::eventually(REPLY_STALL_LIMIT + Duration::from_secs(5), "the replica leaving", || async {
        replica.metrics.reconnects.get() >= 1
    })
    .await?;
    assert!(reported.elapsed() >= REPLY_STALL_LIMIT, "not before the limit: {:?}", reported.elapsed());
    replica.shutdown().await;
    server.abort();
    Ok(())
}

/// A control plane whose dispatch book gave up (it reads reports and drops them, by design)
/// never says it folds this stream's reports: the replica stays on its stream, counting its own
/// dispatches alone, rather than leave it every few seconds and replay them all for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stays_on_a_stream_that_never_said_it_folds_reports() -> anyhow::Result<()> {
    use continuum_data_plane::fleet::REPLY_STALL_LIMIT;
    let (replica, server) = following_a_stuck_control_plane(false).await?;
    let rank = LoadKey { worker: WorkerKey::new("dynamo", 7), dp_rank: 0 };
    replica.reporter.operation(|report| report.started(&rank, 16, 1, vec![]));
    tokio::time::sleep(REPLY_STALL_LIMIT + Duration::from_secs(2)).await;
    assert_eq!(replica.metrics.reconnects.get(), 0, "kept though its report went unanswered");
    replica.shutdown().await;
    server.abort();
    Ok(())
}

/// A peer that accepts the connection and answers HTTP/2 but never opens the Watch stream;
/// it counts the calls.
struct NeverOpens(Arc<std::sync::atomic::AtomicUsize>);

#[tonic::async_trait]
impl Fleet for NeverOpens {
    type WatchStream = ReceiverStream<Result<pb::FleetUpdate, Status>>;

    async fn watch(&self, _: Request<Streaming<pb::WatchRequest>>) -> Result<Response<Self::WatchStream>, Status> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::future::pending().await
    }

    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        Err(Status::unimplemented("never"))
    }

    async fn find_matches(
        &self,
        _: Request<pb::FindMatchesRequest>,
    ) -> Result<Response<pb::FindMatchesResponse>, Status> {
        Err(Status::unimplemented("never"))
    }
}

/// The replica does not wait on such a peer for good: it gives up the call and dials again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_call_never_answered_is_given_up_and_dialled_again() -> anyhow::Result<()> {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(NeverOpens(Arc::clone(&calls))))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let replica = start_replicas(1, &url).await?.remove(0);
    // The first call given up is counted before the next dial: the peer seeing a second call
    // is what says the replica dialled again.
    continuum_tests::eventually(Duration::from_secs(60), "a second call", || async {
        calls.load(std::sync::atomic::Ordering::Relaxed) >= 2
    })
    .await?;
    assert!(replica.metrics.reconnects.get() >= 1, "the first given up, counted");
    replica.shutdown().await;
    server.abort();
    Ok(())
}

/// A control plane whose lookups claim more of a prompt than the prompt has.
struct Overclaiming;

#[tonic::async_trait]
impl Fleet for Overclaiming {
    type WatchStream = ReceiverStream<Result<pb::FleetUpdate, Status>>;

    async fn watch(&self, _: Request<Streaming<pb::WatchRequest>>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("lookups only"))
    }

    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        Err(Status::unimplemented("lookups only"))
    }

    async fn find_matches(
        &self,
        _: Request<pb::FindMatchesRequest>,
    ) -> Result<Response<pb::FindMatchesResponse>, Status> {
        let overlap = pb::RankOverlap { instance_id: 7, dp_rank: 0, blocks: u32::MAX, active_blocks: u32::MAX };
        Ok(Response::new(pb::FindMatchesResponse { overlaps: vec![overlap], ..Default::default() }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_answer_claiming_more_than_the_prompt_is_taken_at_the_prompts_length() -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(Overclaiming))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let config = continuum_data_plane::fleet::FleetClientConfig::new(url, "overclaimed");
    let client = continuum_data_plane::fleet::MatchesClient::new(&config, Duration::from_secs(10))?;
    let matches = client.find_matches(1, vec![11, 12, 13], "tiny", &[(7, 0)], 48).await?;
    let overlap = &matches.overlaps[0];
    assert_eq!((overlap.blocks, overlap.active), (3, 3), "no more than the 3 blocks asked about");
    server.abort();
    Ok(())
}
