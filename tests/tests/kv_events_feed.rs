//! The control plane's kv-events path over loopback TCP: discovery publishers → bounded ZMTP
//! subscriptions → the identity-gated index → `FindMatches`, replaying the real Dynamo 1.6.1
//! capture of an aggregated worker evicting under load.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use continuum_control_plane::admin::{self, AdminSettings, AdminState};
use continuum_control_plane::config::{self, Config};
use continuum_control_plane::discovery::{Publisher, PublisherKey, Topic};
use continuum_control_plane::grpc::Replicas;
use continuum_control_plane::kv::{
    KvCounts, KvEventResult, KvIndexer, KvSupervisor, LiveWorker, PublisherMapping, kv_options,
};
use continuum_control_plane::load::zmtp::{BudgetRef, MessageBudget, ZmtpLimits};
use continuum_control_plane::load::{LoadOptions, LoadSupervisor};
use continuum_control_plane::metrics::Metrics;
use continuum_control_plane::sources::Registry;
use continuum_kv_index::Limits;
use continuum_proto::model::WorkerKey;
use continuum_tests::eventually;
use continuum_tests::load::{NAMESPACE, fleet, worker};
use continuum_tests::tools::captured_messages;
use continuum_tests::zmtp_peer::{PeerConnection, RawPublisher};
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// One captured kv-events message: its publisher, worker, rank and raw frames.
#[derive(Clone)]
struct Captured {
    publisher_id: u64,
    worker_id: u64,
    dp_rank: u32,
    frames: Vec<Vec<u8>>,
}

fn captured_stream() -> anyhow::Result<Vec<Captured>> {
    let mut out = Vec::new();
    let messages = captured_messages("agg/zmq-messages-under-load-evictions.jsonl")?;
    for message in messages.into_iter().filter(|m| m.topic == "kv-events") {
        let first = &message.decoded["payload"][0];
        out.push(Captured {
            publisher_id: message.decoded["publisher_id_frame_u64be"].as_u64().context("publisher id")?,
            worker_id: first["worker_id"].as_u64().context("worker_id")?,
            dp_rank: u32::try_from(first["event"]["dp_rank"].as_u64().unwrap_or(0))?,
            frames: message.frames,
        });
    }
    Ok(out)
}

fn kv_publisher(c: &Captured, worker_id: u64, address: String) -> Publisher {
    Publisher {
        publisher_id: c.publisher_id,
        namespace: NAMESPACE.into(),
        component: Some("backend".into()),
        endpoint: Some("generate".into()),
        topic: Topic::KvEvents,
        worker: Some(WorkerKey::new(NAMESPACE, worker_id)),
        dp_rank: Some(c.dp_rank),
        address,
    }
}

fn kv_config() -> anyhow::Result<Config> {
    // Discovery is the test's own registry; the endpoint only satisfies validation.
    let yaml = "dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"http://127.0.0.1:9\"]\n  \
                load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  kv:\n    enabled: true\n";
    Ok(config::load_str(yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?.config)
}

fn options() -> LoadOptions {
    LoadOptions {
        limits: ZmtpLimits { handshake_timeout: Duration::from_secs(5), ..ZmtpLimits::KV_EVENTS },
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
        ..kv_options()
    }
}

struct TestKv {
    registry: Registry,
    metrics: Metrics,
    supervisor: KvSupervisor,
}

impl TestKv {
    fn start() -> anyhow::Result<Self> {
        Self::start_with(options())
    }

    fn start_with(options: LoadOptions) -> anyhow::Result<Self> {
        let registry = Registry::new(continuum_tests::publisher());
        let metrics = Metrics::new()?;
        let supervisor =
            KvSupervisor::start(&kv_config()?, options, registry.subscribe(), &metrics, CancellationToken::new());
        Ok(Self { registry, metrics, supervisor })
    }

    /// Every event and message counted so far, whatever its result.
    fn counted(&self) -> u64 {
        KvEventResult::ALL.iter().map(|r| self.events(r.as_str())).sum()
    }

    fn events(&self, result: &str) -> u64 {
        self.metrics.kv_events.with_label_values(&[result]).get()
    }
}

async fn send_all(connection: &mut PeerConnection, messages: &[&Captured]) -> anyhow::Result<()> {
    for m in messages {
        connection.send_frames(&m.frames).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_eviction_stream_indexed_over_zmtp_matches_the_same_stream_applied_in_process() -> anyhow::Result<()> {
    let stream = captured_stream()?;
    let first = stream.first().context("the capture holds kv-events")?;
    let ours: Vec<&Captured> = stream.iter().filter(|c| c.publisher_id == first.publisher_id).collect();
    assert!(ours.len() > 20, "a long stream: {} messages", ours.len());

    // The reference: the same frames applied in-process to a bare indexer.
    let mut reference = KvIndexer::new(Limits::default());
    let live = LiveWorker { namespace: "dynamo".into(), ranks: 0..2, publishing: 2 };
    reference.set_live([(first.worker_id, live)].into_iter().collect());
    let publisher = PublisherKey { namespace: "dynamo".into(), publisher_id: first.publisher_id };
    let mapping = PublisherMapping { publisher, worker_id: first.worker_id, dp_rank: Some(first.dp_rank) };
    let mut expected = KvCounts::default();
    for m in &ours {
        expected.merge(&reference.apply_message(&mapping, m.frames.iter().map(Vec::as_slice)));
    }
    let summary: Vec<_> = expected.iter().filter(|(_, n)| *n > 0).map(|(r, n)| (r.as_str(), n)).collect();
    assert!(reference.index().stats().nodes > 0, "the stream leaves blocks in the index: {summary:?}");
    assert!(expected.get(KvEventResult::Applied) > 20, "mostly applied events");

    let kv = TestKv::start()?;
    let mut peer = RawPublisher::bind().await?;
    kv.registry
        .publish(fleet(vec![worker(first.worker_id, 2)], vec![kv_publisher(first, first.worker_id, peer.endpoint())]));
    let mut connection = peer.connection(WAIT).await?;
    send_all(&mut connection, &ours).await?;
    let handle = kv.supervisor.handle();
    // Every event reaches the same result over ZMTP as in process.
    eventually(WAIT, "every event counted as in process", || async {
        KvEventResult::ALL.iter().all(|r| kv.events(r.as_str()) == u64::from(expected.get(*r)))
    })
    .await?;

    // Every chain the stream stored scores the same in both indexes.
    let mut compared = 0;
    for m in &ours {
        let decoded =
            continuum_control_plane::kv::decode::decode_kv_events(m.frames.iter().map(Vec::as_slice), m.publisher_id)
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        for event in &decoded.events {
            if let continuum_control_plane::kv::decode::KvEventData::Stored(stored) = &event.data {
                let hashes: Vec<u64> = stored.blocks.iter().map(|b| b.tokens_hash).collect();
                let over_zmtp = handle.find_matches(&hashes).context("kv enabled")?;
                assert_eq!(over_zmtp.as_slice(), reference.find_matches(&hashes).as_slice());
                compared += 1;
            }
        }
    }
    assert!(compared > 10, "compared {compared} chains");
    assert_eq!(kv.events("identity_mismatch"), 0);
    assert_eq!(kv.events("malformed"), 0);
    Ok(())
}

/// The block hashes a captured message stores.
fn stored_hashes(c: &Captured) -> anyhow::Result<Vec<u64>> {
    let decoded =
        continuum_control_plane::kv::decode::decode_kv_events(c.frames.iter().map(Vec::as_slice), c.publisher_id)
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let hashes: Vec<u64> = decoded
        .events
        .iter()
        .filter_map(|e| match &e.data {
            continuum_control_plane::kv::decode::KvEventData::Stored(s) => Some(s.blocks.iter().map(|b| b.tokens_hash)),
            _ => None,
        })
        .flatten()
        .collect();
    anyhow::ensure!(!hashes.is_empty(), "the message stores blocks");
    Ok(hashes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_or_mislabelled_publisher_is_counted_and_its_healthy_neighbour_keeps_indexing_until_its_worker_departs()
-> anyhow::Result<()> {
    let stream = captured_stream()?;
    let first = stream.first().context("the capture holds kv-events")?;
    let hashes = stored_hashes(first)?;

    let kv = TestKv::start()?;
    let (mut healthy, mut hostile) = (RawPublisher::bind().await?, RawPublisher::bind().await?);
    // The hostile publisher's record names another worker, and a publisher id its frames do
    // not carry.
    let other_worker = first.worker_id ^ 0xffff;
    let hostile_record = Captured { publisher_id: first.publisher_id + 1, frames: Vec::new(), ..*first };
    let publishers = vec![
        kv_publisher(first, first.worker_id, healthy.endpoint()),
        kv_publisher(&hostile_record, other_worker, hostile.endpoint()),
    ];
    kv.registry.publish(fleet(vec![worker(first.worker_id, 2), worker(other_worker, 1)], publishers));
    let mut good = healthy.connection(WAIT).await?;
    let mut bad = hostile.connection(WAIT).await?;
    // Garbage in the hostile publisher's own name, then a message claiming another publisher:
    // each counted under its own label, one at a time.
    let own_id = hostile_record.publisher_id.to_be_bytes().to_vec();
    let garbage = [b"kv-events".to_vec(), own_id, vec![0; 8], vec![1, 0, 0, 0, 3, 0xc1, 0xc1, 0xc1]];
    bad.send_frames(&garbage).await?;
    eventually(WAIT, "the garbage counted malformed", || async { kv.events("malformed") == 1 }).await?;
    assert_eq!(kv.events("identity_mismatch"), 0);
    bad.send_frames(&first.frames).await?;
    eventually(WAIT, "the borrowed message counted", || async { kv.events("identity_mismatch") == 1 }).await?;
    assert_eq!(kv.events("malformed"), 1);
    good.send_frames(&first.frames).await?;
    let handle = kv.supervisor.handle();
    eventually(WAIT, "the healthy rank holds the chain", || async {
        handle.find_matches(&hashes).is_some_and(|m| {
            m.as_slice().iter().any(|(r, n)| r.worker_id == first.worker_id && *n as usize == hashes.len())
        })
    })
    .await?;

    // The worker departs: its rank's blocks go with it.
    kv.registry.publish(fleet(vec![worker(other_worker, 1)], vec![]));
    eventually(WAIT, "the departed worker's blocks are gone", || async {
        handle.find_matches(&hashes).is_some_and(|m| m.is_empty())
    })
    .await?;
    Ok(())
}

/// A raw publisher of `first`'s channel, connected to `kv`, once the index holds the chain its
/// first message stored; and whether the index still holds it.
async fn indexing_first(
    kv: &TestKv,
    first: &Captured,
) -> anyhow::Result<(RawPublisher, PeerConnection, impl Fn() -> bool + use<>)> {
    let mut peer = RawPublisher::bind().await?;
    kv.registry
        .publish(fleet(vec![worker(first.worker_id, 2)], vec![kv_publisher(first, first.worker_id, peer.endpoint())]));
    let mut connection = peer.connection(WAIT).await?;
    connection.send_frames(&first.frames).await?;
    let (handle, hashes) = (kv.supervisor.handle(), stored_hashes(first)?);
    let holds_chain = move || handle.find_matches(&hashes).is_some_and(|m| !m.is_empty());
    eventually(WAIT, "the rank holds the chain", || async { holds_chain() }).await?;
    Ok((peer, connection, holds_chain))
}

/// Past its own 64 KiB a message buffer borrows from the budget every subscription shares. A
/// message the budget cannot hold is read through, counted as `over_budget`, and loses its
/// publisher's ranks as any lost message does; the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_shared_budget_cannot_hold_is_counted_and_clears_its_publishers_ranks() -> anyhow::Result<()> {
    let stream = captured_stream()?;
    let first = stream.first().context("the capture holds kv-events")?;
    let second = stream.iter().filter(|c| c.publisher_id == first.publisher_id).nth(1).context("a second message")?;
    // Nothing to lend: every message must fit a buffer's free part (the captured ones do).
    let budget = BudgetRef(Box::leak(Box::new(MessageBudget::new(0))));
    let mut options = options();
    options.limits.budget = budget;
    let kv = TestKv::start_with(options)?;
    let (_peer, mut connection, holds_chain) = indexing_first(&kv, first).await?;

    // The same message with a 100 KiB frame, within every ceiling but not the budget.
    let mut large = first.frames.clone();
    large[3] = vec![1; 100 * 1024];
    connection.send_frames(&large).await?;
    eventually(WAIT, "the message counted as over_budget", || async { kv.events("over_budget") == 1 }).await?;
    assert!(!holds_chain(), "its events are lost, so the publisher's rank was cleared");
    assert_eq!(kv.events("gap"), 1, "one rank cleared");

    let counted = kv.counted();
    connection.send_frames(&second.frames).await?;
    eventually(WAIT, "the next message reaches the index", || async { kv.counted() > counted }).await?;
    assert_eq!(kv.events("transport_refused"), 0, "the session went on");
    assert_eq!(budget.lent(), 0);
    Ok(())
}

/// A message of five frames is dropped by the transport unread, like one past a ceiling: it is
/// counted `malformed` and, since it may have held the publisher's events, clears its ranks as
/// a four-frame message the decoder refuses does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_five_frames_is_malformed_and_clears_its_publishers_ranks() -> anyhow::Result<()> {
    let stream = captured_stream()?;
    let first = stream.first().context("the capture holds kv-events")?;
    let kv = TestKv::start()?;
    let (_peer, mut connection, holds_chain) = indexing_first(&kv, first).await?;

    let mut five = first.frames.clone();
    five.push(b"fifth".to_vec());
    connection.send_frames(&five).await?;
    eventually(WAIT, "the message counted as malformed", || async { kv.events("malformed") == 1 }).await?;
    assert!(!holds_chain(), "its events are lost, so the publisher's rank was cleared");
    assert_eq!(kv.events("gap"), 1, "one rank cleared");
    assert_eq!(kv.events("transport_refused"), 0, "the session went on");
    Ok(())
}

/// `GET /admin/dynamo/workers` lists the kv-events subscription beside the kv_metrics ones
/// (state, sessions, buffer high water, never the publisher's address) and the index's size,
/// and follows a reload that switches the KV term off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_workers_listing_shows_kv_events_subscriptions_and_the_index_size_without_addresses()
-> anyhow::Result<()> {
    let stream = captured_stream()?;
    let first = stream.first().context("the capture holds kv-events")?;
    let ours: Vec<&Captured> = stream.iter().filter(|c| c.publisher_id == first.publisher_id).collect();
    let mut kv = TestKv::start()?;
    let mut peer = RawPublisher::bind().await?;
    let address = peer.endpoint();
    kv.registry
        .publish(fleet(vec![worker(first.worker_id, 2)], vec![kv_publisher(first, first.worker_id, address.clone())]));
    let mut connection = peer.connection(WAIT).await?;
    send_all(&mut connection, &ours).await?;
    eventually(WAIT, "the stream applied", || async { kv.events("applied") > 20 }).await?;

    let cancel = CancellationToken::new();
    let admin = start_admin(&kv, cancel.clone()).await?;
    let url = format!("http://{admin}/admin/dynamo/workers");
    let body: Value = reqwest::get(&url).await?.json().await?;
    let text = body.to_string();
    assert!(!text.contains(&address) && !text.contains("127.0.0.1"), "the listing exported an address: {text}");
    assert_eq!(body["kv_event_publishers"], 1, "{body}");
    let subscriptions = body["subscriptions"].as_array().context("subscriptions")?;
    let kv_events: Vec<&Value> = subscriptions.iter().filter(|s| s["family"] == "kv-events").collect();
    assert_eq!(kv_events.len(), 1, "{body}");
    let subscription = kv_events[0];
    assert_eq!(subscription["publisher_id"], first.publisher_id.to_string());
    assert_eq!(subscription["state"], "connected");
    assert_eq!(subscription["transport"], "direct");
    assert_eq!(subscription["sessions"], 1);
    let high_water = subscription["buffer_high_water_bytes"].as_u64().context("buffer_high_water_bytes")?;
    assert!(high_water >= 512, "the session's message buffer grew from 512 bytes: {subscription}");

    let stats = kv.supervisor.handle().stats();
    let index = &body["kv_index"];
    assert_eq!(index["enabled"], true);
    assert!(stats.nodes > 0 && stats.ownerships >= stats.nodes, "{stats:?}");
    assert_eq!(index["nodes"].as_u64(), Some(stats.nodes as u64), "{index}");
    assert_eq!(index["ownerships"].as_u64(), Some(stats.ownerships as u64), "{index}");
    assert_eq!(index["ranks"].as_u64(), Some(stats.ranks as u64), "{index}");
    assert_eq!(index["bytes"].as_u64(), Some(stats.heap_bytes as u64), "{index}");

    // Switching the KV term off stops the subscription and empties the index: the listing
    // follows without a restart of the admin server.
    let off = config::load_str(
        "dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"http://127.0.0.1:9\"]\n  \
         load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  kv:\n    enabled: false\n",
        &|_| None,
    )
    .map_err(|e| anyhow::anyhow!("{e:?}"))?
    .config;
    kv.supervisor.reload(&off).await;
    let body: Value = reqwest::get(&url).await?.json().await?;
    let subscriptions = body["subscriptions"].as_array().context("subscriptions")?;
    assert!(subscriptions.iter().all(|s| s["family"] != "kv-events"), "{body}");
    assert_eq!(body["kv_index"]["enabled"], false, "{body}");
    assert_eq!(body["kv_index"]["nodes"], 0, "{body}");
    cancel.cancel();
    kv.supervisor.stop().await;
    Ok(())
}

/// The control plane's admin router over the test's registry, metrics and KV supervisor (no
/// token), on a loopback port; it stops with `cancel`.
async fn start_admin(kv: &TestKv, cancel: CancellationToken) -> anyhow::Result<std::net::SocketAddr> {
    let publisher = continuum_tests::publisher();
    let load = LoadSupervisor::start(
        &kv_config()?.dynamo.load,
        LoadOptions::default(),
        kv.registry.subscribe(),
        publisher.clone(),
        &kv.metrics,
        cancel.child_token(),
    );
    let settings = AdminSettings {
        token: None,
        source: "etcd",
        namespaces: Arc::from(vec![NAMESPACE.to_string()]),
        resyncs_when_emptied: 0,
    };
    let state = AdminState {
        registry: kv.registry.clone(),
        publisher,
        replicas: Replicas::default(),
        metrics: kv.metrics.clone(),
        settings: watch::channel(settings).1,
        load: load.view(),
        kv: kv.supervisor.view(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _load = load;
        let _ = axum::serve(listener, admin::router(state)).with_graceful_shutdown(cancel.cancelled_owned()).await;
    });
    Ok(addr)
}
