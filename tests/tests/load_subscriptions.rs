//! The load supervisor against many in-process publishers over loopback TCP: the 1,024 cap and
//! its admission order, the dial allow-list, and the transport switch.

use std::collections::BTreeSet;
use std::time::Duration;

use continuum_control_plane::config::{LoadConfig, LoadTransport};
use continuum_control_plane::load::{LoadOptions, SubscriptionState};
use continuum_tests::eventually;
use continuum_tests::load::{TestLoad, fleet, kv_metrics_publisher, loopback_config, test_options, worker};
use continuum_tests::zmtp_peer::{KvMetricsSample, PeerConnection, RawPublisher};

const WAIT: Duration = Duration::from_secs(30);

fn states(load: &TestLoad) -> Vec<(u64, Option<SubscriptionState>)> {
    load.view.subscriptions().iter().map(|s| (s.publisher.publisher_id, s.state())).collect()
}

fn ended(load: &TestLoad, reason: &str) -> u64 {
    load.metrics.subscription_sessions_ended.with_label_values(&["kv_metrics", reason]).get()
}

fn gauge(load: &TestLoad, state: &str, transport: &str) -> i64 {
    load.metrics.load_subscriptions.with_label_values(&[state, transport]).get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_1100_publishers_the_1024_lowest_ids_are_admitted_and_removing_100_admits_the_rest() -> anyhow::Result<()> {
    const PUBLISHERS: u64 = 1100;
    let mut peers = Vec::new();
    for _ in 0..PUBLISHERS {
        peers.push(RawPublisher::bind().await?);
    }
    // Publisher ids descend as ports ascend, so admission by id is not admission by address.
    let id = |i: u64| 10_000 + (PUBLISHERS - i) * 7;
    let workers = (0..PUBLISHERS).map(|i| worker(1 + i, 1)).collect();
    let publishers =
        (0..PUBLISHERS).map(|i| kv_metrics_publisher(id(i), 1 + i, peers[i as usize].endpoint())).collect();
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet(workers, publishers));

    let mut all_ids: Vec<u64> = (0..PUBLISHERS).map(id).collect();
    all_ids.sort();
    let lowest: BTreeSet<u64> = all_ids[..1024].iter().copied().collect();
    eventually(WAIT, "1,024 connected subscriptions", || async { gauge(&load, "connected", "direct") == 1024 }).await?;
    let admitted: BTreeSet<u64> = states(&load).iter().map(|(id, _)| *id).collect();
    assert_eq!(admitted, lowest, "exactly the 1,024 lowest publisher ids");
    let left_out = || load.metrics.subscriptions_left_out.with_label_values(&["kv_metrics"]).get();
    assert_eq!(left_out(), 76, "the publishers past the cap are counted");

    let mut held = Vec::new();
    let mut connected = BTreeSet::new();
    accept_until(&mut peers, id, &mut held, &mut connected, &lowest).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    accept_until(&mut peers, id, &mut held, &mut connected, &lowest).await?;
    assert_eq!(connected, lowest, "only admitted publishers were dialled");

    let removed: BTreeSet<u64> = all_ids[..100].iter().copied().collect();
    let mut current = load.registry.current().fleet.clone();
    current.publishers.retain(|_, p| !removed.contains(&p.publisher_id));
    let started = std::time::Instant::now();
    load.registry.publish(current);
    eventually(WAIT, "the 76 left out so far connected", || async { gauge(&load, "connected", "direct") == 1000 })
        .await?;
    let stopped_and_admitted_in = started.elapsed();
    let admitted: BTreeSet<u64> = states(&load).iter().map(|(id, _)| *id).collect();
    assert_eq!(admitted, all_ids[100..].iter().copied().collect::<BTreeSet<u64>>());
    assert_eq!(left_out(), 0, "none left out once there is room");
    let everyone: BTreeSet<u64> = all_ids.iter().copied().collect();
    accept_until(&mut peers, id, &mut held, &mut connected, &everyone).await?;
    println!("1,024 admitted; removing 100 stopped them and admitted 76 more in {stopped_and_admitted_in:?}");
    load.stop().await;
    Ok(())
}

/// Takes subscribed connections (kept open in `held`) until the publishers connected so far
/// are exactly `want`; fails if they are not within [`WAIT`].
async fn accept_until(
    peers: &mut [RawPublisher],
    id: impl Fn(u64) -> u64,
    held: &mut Vec<PeerConnection>,
    connected: &mut BTreeSet<u64>,
    want: &BTreeSet<u64>,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        for (i, peer) in peers.iter_mut().enumerate() {
            while let Some(connection) = peer.try_connection() {
                connected.insert(id(i as u64));
                held.push(connection);
            }
        }
        if connected == want {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            let (missing, unexpected) = (want.difference(connected).count(), connected.difference(want).count());
            anyhow::bail!("after {WAIT:?}: {missing} expected publishers never connected, {unexpected} others did");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_outside_direct_allow_cidrs_is_never_dialled() -> anyhow::Result<()> {
    let mut peer = RawPublisher::bind().await?;
    let config = LoadConfig { direct_allow_cidrs: Some(vec!["10.0.0.0/8".into()]), ..LoadConfig::default() };
    let load = TestLoad::start(&config, test_options())?;
    load.registry.publish(fleet(vec![worker(1, 1)], vec![kv_metrics_publisher(7, 1, peer.endpoint())]));
    eventually(WAIT, "a not_allowed refusal", || async { load.events("not_allowed") > 0 }).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(peer.try_connection().is_none(), "nothing connected to a 127.0.0.1 publisher under 10.0.0.0/8");
    assert!(ended(&load, "not_allowed") > 0);
    assert_eq!((ended(&load, "dial_failed"), ended(&load, "lost")), (0, 0));
    assert!(matches!(
        load.subscription(7).and_then(|s| s.state()),
        Some(SubscriptionState::Backoff | SubscriptionState::Connecting)
    ));
    load.stop().await;
    Ok(())
}

/// Why sessions end is counted: a publisher nobody listens for as a failed dial, one that
/// hangs up after its handshake as a session lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_that_end_are_counted_by_why() -> anyhow::Result<()> {
    let mut peer = RawPublisher::bind().await?;
    // Port 1: nothing listens there, nor can a test beside this one take it (a port bound and
    // let go could be).
    let gone = "tcp://127.0.0.1:1".to_string();
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet(
        vec![worker(1, 1), worker(2, 1)],
        vec![kv_metrics_publisher(7, 1, peer.endpoint()), kv_metrics_publisher(8, 2, gone)],
    ));
    eventually(WAIT, "a failed dial counted", || async { ended(&load, "dial_failed") > 0 }).await?;
    assert_eq!(ended(&load, "lost"), 0, "the listening publisher's session goes on");
    drop(peer.connection(WAIT).await?);
    eventually(WAIT, "the hang-up counted", || async { ended(&load, "lost") == 1 }).await?;
    assert_eq!((ended(&load, "refused"), ended(&load, "not_allowed")), (0, 0));
    load.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_the_transport_restarts_only_subscriptions_and_each_reconnect_drops_held_samples()
-> anyhow::Result<()> {
    let mut peer = RawPublisher::bind().await?;
    let mut config = loopback_config();
    let load = TestLoad::start(&config, test_options())?;
    load.registry.publish(fleet(vec![worker(1, 1)], vec![kv_metrics_publisher(7, 1, peer.endpoint())]));
    let mut connection = peer.connection(WAIT).await?;
    let sample = |sequence| KvMetricsSample { publisher_id: 7, sequence, worker_id: 1, dp_rank: 0, kv_used_blocks: 4 };
    connection.send_frames(&sample(40).frames()).await?;
    let key =
        continuum_proto::model::LoadKey { worker: continuum_proto::model::WorkerKey::new("dynamo", 1), dp_rank: 0 };
    eventually(WAIT, "the sample in the store", || async { load.view.store.lock().get(&key).is_some() }).await?;
    eventually(WAIT, "the sample on the fleet stream", || async {
        load.publisher.current().view().loads().contains_key(&key)
    })
    .await?;
    let generation = load.registry.current().generation;

    config.transport = LoadTransport::Broker;
    load.supervisor.reload(&config);
    // The gauges follow the state a moment later (the old status drops its gauge when it goes).
    eventually(WAIT, "the subscription pending under broker, on the gauges too", || async {
        load.subscription(7).and_then(|s| s.state()) == Some(SubscriptionState::Pending)
            && gauge(&load, "pending", "broker") == 1
            && gauge(&load, "connected", "direct") == 0
    })
    .await?;
    assert!(connection.closed_within(WAIT).await, "the direct session was stopped");
    assert!(load.view.store.lock().get(&key).is_some(), "a transport switch does not clear the store");
    assert_eq!(load.registry.current().generation, generation, "discovery was not touched");

    config.transport = LoadTransport::Direct;
    load.supervisor.reload(&config);
    let _connection = peer.connection(WAIT).await?;
    eventually(WAIT, "the reconnect dropping the held sample", || async { load.view.store.lock().get(&key).is_none() })
        .await?;
    eventually(WAIT, "the replicas told to drop it too", || async {
        !load.publisher.current().view().loads().contains_key(&key)
    })
    .await?;
    eventually(WAIT, "the gauges back on direct", || async {
        gauge(&load, "connected", "direct") == 1 && gauge(&load, "pending", "broker") == 0
    })
    .await?;

    let mut staleness = config.clone();
    staleness.max_staleness = Duration::from_millis(250);
    load.supervisor.reload(&staleness);
    eventually(WAIT, "max_staleness applied at once", || async {
        load.view.store.lock().max_staleness() == Duration::from_millis(250)
    })
    .await?;
    assert_eq!(gauge(&load, "connected", "direct"), 1, "a max_staleness change restarts nothing");
    load.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_worker_loses_its_samples_and_its_subscription() -> anyhow::Result<()> {
    let mut peer = RawPublisher::bind().await?;
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet(vec![worker(1, 2)], vec![kv_metrics_publisher(7, 1, peer.endpoint())]));
    let mut connection = peer.connection(WAIT).await?;
    for (sequence, rank) in [(0, 0), (1, 1)] {
        let sample = KvMetricsSample {
            publisher_id: 7,
            sequence,
            worker_id: 1,
            dp_rank: rank,
            kv_used_blocks: 3 + u64::from(rank),
        };
        connection.send_frames(&sample.frames()).await?;
    }
    eventually(WAIT, "both ranks on the fleet stream", || async { load.publisher.current().view().loads().len() == 2 })
        .await?;
    let text = load.metrics.render();
    assert!(
        text.contains("continuum_dynamo_worker_kv_used_blocks{dp_rank=\"1\",namespace=\"dynamo\",worker=\"1\"} 4"),
        "{text}"
    );

    load.registry.publish(fleet(vec![], vec![]));
    eventually(WAIT, "the store emptied", || async { load.view.store.lock().is_empty() }).await?;
    eventually(WAIT, "the subscription stopped", || async { load.view.subscriptions().is_empty() }).await?;
    assert!(connection.closed_within(WAIT).await);
    assert!(
        !load.metrics.render().contains("continuum_dynamo_worker_kv_used_blocks{"),
        "the series left with the worker"
    );
    assert_eq!(gauge(&load, "connected", "direct"), 0);
    load.stop().await;
    Ok(())
}

/// A publisher record whose address nothing answers must not hold a place under the cap while
/// another publisher waits: it yields its place, and gets it back when there is room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_publisher_that_never_connects_yields_its_place_to_one_waiting() -> anyhow::Result<()> {
    // Nothing listens on port 1 (a port freed by this test could be bound by another test's
    // publisher before it is dialled).
    let dead = "tcp://127.0.0.1:1".to_string();
    let live = RawPublisher::bind().await?;
    let options = LoadOptions { max_subscriptions: 1, yield_after: Duration::from_millis(300), ..test_options() };
    let load = TestLoad::start(&loopback_config(), options)?;
    let workers = vec![worker(1, 1), worker(2, 1)];
    let both =
        fleet(workers.clone(), vec![kv_metrics_publisher(5, 1, dead), kv_metrics_publisher(9, 2, live.endpoint())]);
    load.registry.publish(both.clone());
    let admitted = |load: &TestLoad| states(load).iter().map(|(id, _)| *id).collect::<Vec<u64>>();
    eventually(WAIT, "the lower id admitted first", || async { admitted(&load) == [5] }).await?;
    eventually(WAIT, "the waiting publisher admitted and connected", || async {
        states(&load) == [(9, Some(SubscriptionState::Connected))]
    })
    .await?;

    // With room again, the publisher that yielded is admitted at once.
    let mut alone = both.clone();
    alone.publishers.retain(|_, p| p.publisher_id == 5);
    load.registry.publish(alone);
    eventually(WAIT, "the yielded publisher back when there is room", || async { admitted(&load) == [5] }).await?;

    // Stopped while one is left out, the family leaves out nobody: a later supervisor of it
    // writes the gauge only when its own count moves from zero.
    let left_out = load.metrics.subscriptions_left_out.with_label_values(&["kv_metrics"]);
    load.registry.publish(both);
    eventually(WAIT, "one left out again", || async { left_out.get() == 1 }).await?;
    load.stop().await;
    assert_eq!(left_out.get(), 0);
    Ok(())
}
