//! Stopping subscriptions: concurrently, each within the grace; and which publishers depart
//! when a reload changes the dial policy and the fleet together.

use super::*;
use crate::config::LoadTransport;
use crate::discovery::PublisherKey;
use crate::discovery::Topic;
use continuum_proto::model::Role;

fn gauge() -> prometheus::IntGaugeVec {
    prometheus::IntGaugeVec::new(prometheus::Opts::new("g", "g"), &["state", "transport"]).unwrap()
}

/// Publisher `id`, speaking for worker `id`.
fn publisher(id: u64) -> Publisher {
    crate::discovery::test_publisher(id, Some(continuum_proto::model::WorkerKey::new("dynamo", id)))
}

/// A fleet of `publishers` and the workers they name (the supervisor dials only those).
fn fleet_of(publishers: impl IntoIterator<Item = Publisher>) -> Fleet {
    let mut fleet = Fleet::default();
    for publisher in publishers {
        if let Some(worker) = &publisher.worker {
            let (key, worker) =
                crate::discovery::test_worker(&worker.namespace, worker.instance_id, Role::Aggregated, "m");
            fleet.workers.insert(key, worker);
        }
        fleet.publishers.insert(publisher.key(), publisher);
    }
    fleet
}

fn running(id: u64, task: JoinHandle<()>, cancel: CancellationToken) -> Running {
    let key = PublisherKey { namespace: "dynamo".into(), publisher_id: id };
    let status = Arc::new(SubscriptionStatus::new("kv_metrics", key, None, LoadTransport::Direct, gauge()));
    Running { publisher: publisher(id), status, cancel, task, since: std::time::Instant::now() }
}

#[tokio::test(start_paused = true)]
async fn stopping_cancels_all_at_once_and_aborts_what_outlives_the_grace() {
    let mut all = Vec::new();
    let (stopped, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let cancel = CancellationToken::new();
    let polite = cancel.clone();
    all.push(running(
        1,
        tokio::spawn(async move {
            polite.cancelled().await;
            let _ = stopped.send(());
        }),
        cancel,
    ));
    let (dropped_tx, mut dropped_rx) = tokio::sync::mpsc::channel::<()>(2);
    for id in [2, 3] {
        let guard = dropped_tx.clone();
        // Ignores cancellation; its guard drops only when the task is aborted.
        let task = tokio::spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        all.push(running(id, task, CancellationToken::new()));
    }
    drop(dropped_tx);
    let started = tokio::time::Instant::now();
    stop_all(all, STOP_GRACE).await;
    assert_eq!(started.elapsed(), STOP_GRACE, "two stuck tasks cost one grace, not two");
    assert!(stopped_rx.await.is_ok(), "the cancellable task ended on its own");
    assert!(dropped_rx.recv().await.is_none(), "both stuck tasks were aborted");
}

/// A feed that records the publishers whose subscriptions stopped for good.
struct Recording {
    gauge: prometheus::IntGaugeVec,
    left_out: prometheus::IntGauge,
    session_ends: crate::load::SessionEnds,
    departed: tokio::sync::mpsc::UnboundedSender<u64>,
}

impl Recording {
    fn new(departed: tokio::sync::mpsc::UnboundedSender<u64>) -> Self {
        let session_ends = crate::load::SessionEnds::unregistered(Topic::KvMetrics);
        Self { gauge: gauge(), left_out: prometheus::IntGauge::new("l", "l").unwrap(), session_ends, departed }
    }
}

impl Feed for Recording {
    type Session = ();

    fn topic(&self) -> Topic {
        Topic::KvMetrics
    }
    fn gauge(&self) -> &prometheus::IntGaugeVec {
        &self.gauge
    }
    fn left_out(&self) -> &prometheus::IntGauge {
        &self.left_out
    }
    fn session_ends(&self) -> &crate::load::SessionEnds {
        &self.session_ends
    }
    async fn connected(&self, _publisher: &Publisher) {}
    async fn message(
        &self,
        _publisher: &Publisher,
        _session: &mut (),
        _message: Result<crate::load::zmtp::Message<'_>, crate::load::Dropped>,
    ) {
    }
    fn refused(&self, _refusal: crate::load::Refusal) {}
    async fn departed(&self, publisher: &Publisher) {
        let _ = self.departed.send(publisher.publisher_id);
    }
    async fn set_live(&self, _generation: &Generation) {}
}

fn generation(generation: u64, ids: &[u64]) -> Arc<Generation> {
    Arc::new(Generation { generation, fleet: fleet_of(ids.iter().map(|id| publisher(*id))) })
}

/// One reload that removes a publisher and changes the dial policy: the actor sees both at
/// once and takes the policy first. The removed publisher still departs (its samples and ranks
/// go), and the one that stays restarts without departing.
#[tokio::test]
async fn a_publisher_removed_by_the_reload_that_changes_the_policy_departs() {
    let (registry_tx, registry) = tokio::sync::watch::channel(generation(1, &[7, 8]));
    let (departed_tx, mut departed) = tokio::sync::mpsc::unbounded_channel();
    let feed = Recording::new(departed_tx);
    // Broker subscriptions wait without dialling, so nothing here touches the network.
    let broker = DialPolicy { transport: LoadTransport::Broker, allow: None };
    let cancel = CancellationToken::new();
    let mut supervisor = Supervisor::start(feed, broker, LoadOptions::default(), registry, cancel);
    let mut statuses = supervisor.statuses();
    statuses.wait_for(|running| running.len() == 2).await.unwrap();

    registry_tx.send_replace(generation(2, &[8]));
    supervisor.set_policy(DialPolicy { transport: LoadTransport::Broker, allow: Some(Arc::from(Vec::new())) });
    statuses.wait_for(|running| running.len() == 1).await.unwrap();
    let removed = tokio::time::timeout(Duration::from_secs(10), departed.recv()).await;
    assert_eq!(removed.ok().flatten(), Some(7), "the removed publisher departs");
    supervisor.stop().await;
    let mut rest = Vec::new();
    while let Ok(id) = departed.try_recv() {
        rest.push(id);
    }
    assert!(rest.is_empty(), "the publisher that stays restarts without departing: {rest:?}");
}

#[test]
fn a_restart_within_a_stable_session_waits_a_growing_backoff_and_a_late_one_none() {
    let options = LoadOptions::default();
    let mut starts = Starts::new(&options);
    let key: AdmissionKey = (7, Arc::from("dynamo"));
    let t0 = Instant::now();
    assert_eq!(starts.wait(&key, t0), Duration::ZERO, "a first start dials at once");
    let waits: Vec<Duration> = (1..=8).map(|i| starts.wait(&key, t0 + Duration::from_millis(i))).collect();
    assert!(waits.iter().all(|w| *w >= options.backoff_initial && *w <= options.backoff_max), "{waits:?}");
    // Each wait is drawn below a ceiling that doubles (full jitter): the ceiling, not a draw.
    let ceiling = starts.by_key.get(&key).map(|start| start.backoff.ceiling());
    assert!(ceiling.is_some_and(|c| c >= 8 * options.backoff_initial), "the ceiling doubled: {ceiling:?}, {waits:?}");
    assert_eq!(starts.wait(&(8, Arc::from("dynamo")), t0), Duration::ZERO, "each publisher its own");
    let late = t0 + Duration::from_millis(8) + options.stable_session;
    assert_eq!(starts.wait(&key, late), Duration::ZERO, "a stable session later, forgotten");
}

/// Past the starts remembered, the oldest is forgotten for a new one, not every one: a
/// publisher restarting all along keeps its backoff through a churn of others.
#[test]
fn a_full_memory_of_starts_forgets_its_oldest_not_a_flapping_publisher() {
    let options = LoadOptions::default();
    let mut starts = Starts::new(&options);
    let t0 = Instant::now();
    let flapping: AdmissionKey = (0, Arc::from("dynamo"));
    assert_eq!(starts.wait(&flapping, t0), Duration::ZERO);
    let oldest: AdmissionKey = (1, Arc::from("dynamo"));
    starts.wait(&oldest, t0);
    for (id, at) in (2..).zip(1..MAX_REMEMBERED_STARTS as u64 - 1) {
        starts.wait(&(id, Arc::from("dynamo")), t0 + Duration::from_micros(at));
    }
    assert_eq!(starts.by_key.len(), MAX_REMEMBERED_STARTS);
    let later = t0 + Duration::from_millis(10);
    assert!(starts.wait(&flapping, later) >= options.backoff_initial, "remembered: it waits");
    starts.wait(&(u64::MAX, Arc::from("dynamo")), later);
    assert_eq!(starts.by_key.len(), MAX_REMEMBERED_STARTS);
    assert!(!starts.by_key.contains_key(&oldest), "the oldest start made room");
    assert!(starts.wait(&flapping, later) >= options.backoff_initial, "the flapping one still waits");
}

/// A publisher whose record flips between two addresses every few milliseconds: each change
/// restarts its subscription, and the restarts wait their backoff instead of dialling at the
/// rate of the changes.
#[tokio::test]
async fn a_record_that_keeps_changing_is_not_redialled_at_its_rate() {
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut addresses = Vec::new();
    for host in ["127.0.0.1", "127.0.0.2"] {
        let listener = tokio::net::TcpListener::bind((host, 0)).await.unwrap();
        addresses.push(format!("tcp://{}", listener.local_addr().unwrap()));
        let counted = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                drop(conn);
            }
        });
    }
    let at = |generation: u64, address: &str| {
        let publisher = Publisher { address: address.into(), ..publisher(7) };
        Arc::new(Generation { generation, fleet: fleet_of([publisher]) })
    };
    let (registry_tx, registry) = tokio::sync::watch::channel(at(1, &addresses[0]));
    let (departed_tx, _departed) = tokio::sync::mpsc::unbounded_channel();
    let feed = Recording::new(departed_tx);
    let direct = DialPolicy { transport: LoadTransport::Direct, allow: None };
    let options = LoadOptions::default();
    let began = std::time::Instant::now();
    let mut supervisor = Supervisor::start(feed, direct, options, registry, CancellationToken::new());
    for generation in 2..=40 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        registry_tx.send_replace(at(generation, &addresses[usize::try_from(generation % 2).unwrap()]));
    }
    supervisor.statuses().wait_for(|running| running.len() == 1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    supervisor.stop().await;
    // The first start dials at once; every restart after it waits at least the initial
    // backoff (500 ms), so the changes (about 400 ms, longer on a loaded machine) allow one
    // dial more per backoff they lasted, not one per change.
    let windows = usize::try_from(began.elapsed().as_millis() / options.backoff_initial.as_millis()).unwrap();
    let dialled = accepted.load(std::sync::atomic::Ordering::Relaxed);
    assert!((1..=2 + windows).contains(&dialled), "{dialled} connections for 40 changes in {windows} backoffs");
}

/// The publishers of `publishers` a supervisor capped at `cap` subscriptions admits, by id
/// (brokered: none is dialled).
async fn admitted_past_the_cap(publishers: impl IntoIterator<Item = Publisher>, cap: usize) -> Vec<u64> {
    let fleet = fleet_of(publishers);
    let (_registry_tx, registry) = tokio::sync::watch::channel(Arc::new(Generation { generation: 1, fleet }));
    let (departed_tx, _departed) = tokio::sync::mpsc::unbounded_channel();
    let feed = Recording::new(departed_tx);
    let broker = DialPolicy { transport: LoadTransport::Broker, allow: None };
    let options = LoadOptions { max_subscriptions: cap, ..LoadOptions::default() };
    let mut supervisor = Supervisor::start(feed, broker, options, registry, CancellationToken::new());
    let mut statuses = supervisor.statuses();
    statuses.wait_for(|running| running.len() == cap).await.unwrap();
    let admitted = statuses.borrow().iter().map(|s| s.publisher.publisher_id).collect();
    supervisor.stop().await;
    admitted
}

/// Records that name no worker, or one the fleet does not hold, are never dialled (every
/// message of theirs would be refused after it was read), whatever their ids; the channel is
/// dialled once its worker registers.
#[tokio::test]
async fn only_publishers_of_workers_in_the_fleet_are_dialled() {
    let anonymous = crate::discovery::test_publisher(1, None);
    let unknown = crate::discovery::test_publisher(2, Some(continuum_proto::model::WorkerKey::new("dynamo", 99)));
    let mut fleet = fleet_of([anonymous, publisher(1 << 50)]);
    fleet.publishers.insert(unknown.key(), unknown.clone());
    let (registry_tx, registry) =
        tokio::sync::watch::channel(Arc::new(Generation { generation: 1, fleet: fleet.clone() }));
    let (departed_tx, _departed) = tokio::sync::mpsc::unbounded_channel();
    let feed = Recording::new(departed_tx);
    let broker = DialPolicy { transport: LoadTransport::Broker, allow: None };
    let mut supervisor = Supervisor::start(feed, broker, LoadOptions::default(), registry, CancellationToken::new());
    let mut statuses = supervisor.statuses();
    let ids = |statuses: &tokio::sync::watch::Receiver<Subscriptions>| -> Vec<u64> {
        let mut ids: Vec<u64> = statuses.borrow().iter().map(|s| s.publisher.publisher_id).collect();
        ids.sort_unstable();
        ids
    };
    statuses.wait_for(|running| !running.is_empty()).await.unwrap();
    assert_eq!(ids(&statuses), [1 << 50], "only the publisher of a worker in the fleet");
    let (key, worker) = crate::discovery::test_worker("dynamo", 99, Role::Aggregated, "m");
    fleet.workers.insert(key, worker);
    registry_tx.send_replace(Arc::new(Generation { generation: 2, fleet }));
    statuses.wait_for(|running| running.len() == 2).await.unwrap();
    assert_eq!(ids(&statuses), [2, 1 << 50], "its worker registered: dialled");
    supervisor.stop().await;
}

/// Past the cap, workers are taken in turn: one that registers many channels under low ids
/// gets one place before any worker gets a second.
#[tokio::test]
async fn past_the_cap_each_worker_gets_a_place_before_any_gets_two() {
    let of = |id, worker| {
        crate::discovery::test_publisher(id, Some(continuum_proto::model::WorkerKey::new("dynamo", worker)))
    };
    let greedy = (1..=5).map(|id| of(id, 9));
    let mut admitted = admitted_past_the_cap(greedy.chain([of(100, 10), of(200, 11)]), 4).await;
    admitted.sort_unstable();
    assert_eq!(admitted, [1, 2, 100, 200], "the greedy worker's first two, and one each for the others");
}

/// A publisher that accepts and never greets fails every session at the handshake timeout,
/// which is longer here than a stable session: the time spent dialling and greeting is no
/// session, so the backoff keeps growing and some wait runs past its first ceiling.
#[tokio::test]
async fn a_handshake_that_times_out_is_no_stable_session() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("tcp://{}", listener.local_addr().unwrap());
    let (accepted_tx, mut accepted) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
            let _ = accepted_tx.send(tokio::time::Instant::now());
        }
    });
    let fleet = fleet_of([Publisher { address, ..publisher(7) }]);
    let (_registry_tx, registry) = tokio::sync::watch::channel(Arc::new(Generation { generation: 1, fleet }));
    let (departed_tx, _departed) = tokio::sync::mpsc::unbounded_channel();
    let feed = Recording::new(departed_tx);
    let handshake = Duration::from_millis(100);
    let options = LoadOptions {
        limits: ZmtpLimits { handshake_timeout: handshake, ..ZmtpLimits::KV_METRICS },
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_secs(10),
        stable_session: Duration::from_millis(50),
        ..LoadOptions::default()
    };
    let direct = DialPolicy { transport: LoadTransport::Direct, allow: None };
    let mut supervisor = Supervisor::start(feed, direct, options, registry, CancellationToken::new());
    // Were each failed greeting a stable session, every wait would be drawn from [20, 40] ms
    // and no gap between dials exceed 140 ms (plus scheduling). Growing, the ceilings run
    // 40, 80, 160, 320, … ms: all eight waits at most 100 ms has odds below 1 in 20,000.
    let mut last = accepted.recv().await.unwrap();
    let mut gaps = Vec::new();
    let waited_long = loop {
        let next = accepted.recv().await.unwrap();
        gaps.push(next - last);
        last = next;
        if gaps.iter().any(|gap| *gap > Duration::from_millis(200)) {
            break true;
        }
        if gaps.len() == 8 {
            break false;
        }
    };
    supervisor.stop().await;
    assert!(waited_long, "the backoff never grew: gaps between dials {gaps:?}");
}
