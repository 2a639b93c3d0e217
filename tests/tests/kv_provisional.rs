//! Provisional overlap over the Fleet gRPC service: a prefix one replica reports with a pinned
//! dispatch (`DispatchStarted.block_hashes`) is what another replica's `FindMatches` sees on
//! that rank at once, before any kv-event, until `dynamo.kv.provisional_ttl` passes; with the
//! TTL at 0s the same report credits nothing. That shared answer is what makes simultaneous
//! requests for a new prefix through different replicas pick the same rank: each replica's
//! KV-aware picker scores the rank with the overlap `FindMatches` returns. The same reports
//! tell `FindMatches` which of those blocks requests in flight hold (`active_blocks`), until
//! they end.

use std::time::Duration;

use anyhow::Context;
use continuum_control_plane::config::{self, Config};
use continuum_control_plane::grpc::{self, FleetService, Replicas};
use continuum_control_plane::kv::{KvSupervisor, kv_options};
use continuum_control_plane::listen::Guard;
use continuum_control_plane::metrics::Metrics;
use continuum_control_plane::sources::Registry;
use continuum_kv_index::RankKey;
use continuum_proto::pb::{self, fleet_client::FleetClient, watch_request::Kind};
use continuum_tests::eventually;
use continuum_tests::load::{NAMESPACE, fleet, worker};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const WAIT: Duration = Duration::from_secs(20);
/// Long enough that a report crosses a loaded machine well within it.
const TTL: Duration = Duration::from_secs(5);
const FIRST: u64 = 0x51;
const SECOND: u64 = 0x52;

fn kv_config(ttl: &str) -> anyhow::Result<Config> {
    // Discovery is the test's own registry; the endpoint only satisfies validation.
    let yaml = format!(
        "dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"http://127.0.0.1:9\"]\n  \
         load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  kv:\n    enabled: true\n    provisional_ttl: {ttl}\n"
    );
    Ok(config::load_str(&yaml, &|_| None).map_err(|e| anyhow::anyhow!("{e:?}"))?.config)
}

/// A control plane serving Fleet with a KV supervisor whose live workers are `FIRST` and
/// `SECOND`, one rank each.
struct Plane {
    url: String,
    metrics: Metrics,
    supervisor: KvSupervisor,
    _registry: Registry,
    cancel: CancellationToken,
}

impl Plane {
    async fn start(ttl: &str) -> anyhow::Result<Self> {
        // One publisher: the backlog book holds dispatches only for ranks the fleet has.
        let publisher = continuum_tests::publisher();
        let registry = Registry::new(publisher.clone());
        let metrics = Metrics::new()?;
        let cancel = CancellationToken::new();
        let supervisor =
            KvSupervisor::start(&kv_config(ttl)?, kv_options(), registry.subscribe(), &metrics, cancel.child_token());
        registry.publish(fleet(vec![worker(FIRST, 1), worker(SECOND, 1)], vec![]));
        let handle = supervisor.handle();
        eventually(WAIT, "both workers are live in the KV index", || async {
            handle.find_matches(&[]).is_some()
                && [FIRST, SECOND].iter().all(|w| {
                    // A throwaway chain no query below shares: refused until the rank is live.
                    let rank = RankKey { worker_id: *w, dp_rank: 0 };
                    handle.credit_provisional(rank, &[u64::MAX - w]).as_str() != "refused"
                })
        })
        .await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let service =
            FleetService::new(publisher, Replicas::default(), metrics.clone(), cancel.clone()).with_kv(handle);
        tokio::spawn(grpc::serve((listener, Guard::fleet(&metrics)), service, None, cancel.clone()));
        Ok(Self { url, metrics, supervisor, _registry: registry, cancel })
    }

    async fn client(&self) -> anyhow::Result<FleetClient<Channel>> {
        let mut last = None;
        for _ in 0..50 {
            match FleetClient::connect(self.url.clone()).await {
                Ok(client) => return Ok(client),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(last.context("no connection attempt")?.into())
    }

    fn provisional(&self, result: &str) -> u64 {
        self.metrics.kv_provisional.with_label_values(&[result]).get()
    }
}

/// A replica's Watch stream: its Hello sent, ready for dispatch reports.
async fn watch(client: &mut FleetClient<Channel>, replica_id: &str) -> anyhow::Result<mpsc::Sender<pb::WatchRequest>> {
    let (tx, rx) = mpsc::channel(8);
    tx.send(pb::WatchRequest { kind: Some(Kind::Hello(pb::Hello { replica_id: replica_id.into(), version: None })) })
        .await?;
    let mut updates = client.watch(ReceiverStream::new(rx)).await?.into_inner();
    // Keep reading so the session never stalls on a full queue.
    tokio::spawn(async move { while let Ok(Some(_)) = updates.message().await {} });
    Ok(tx)
}

fn started(id: u64, worker_id: u64, block_hashes: Vec<u64>) -> pb::WatchRequest {
    let rank =
        pb::LoadKey { worker: Some(pb::WorkerKey { namespace: NAMESPACE.into(), instance_id: worker_id }), dp_rank: 0 };
    let started = pb::DispatchStarted {
        id,
        rank: Some(rank),
        prefill_tokens: 64,
        decode_blocks: 4,
        block_hashes,
        ..Default::default()
    };
    pb::WatchRequest {
        kind: Some(Kind::Dispatches(pb::DispatchReport { started: vec![started], ..Default::default() })),
    }
}

fn ended(id: u64) -> pb::WatchRequest {
    pb::WatchRequest { kind: Some(Kind::Dispatches(pb::DispatchReport { ended: vec![id], ..Default::default() })) }
}

async fn overlaps(client: &mut FleetClient<Channel>, hashes: &[u64]) -> anyhow::Result<Vec<(u64, u32)>> {
    Ok(held(client, hashes).await?.into_iter().map(|(rank, blocks, _)| (rank, blocks)).collect())
}

/// Each rank's (instance id, blocks, active blocks).
async fn held(client: &mut FleetClient<Channel>, hashes: &[u64]) -> anyhow::Result<Vec<(u64, u32, u32)>> {
    let reply = client
        .find_matches(pb::FindMatchesRequest { block_hashes: hashes.to_vec(), ..Default::default() })
        .await?
        .into_inner();
    Ok(reply.overlaps.into_iter().map(|o| (o.instance_id, o.blocks, o.active_blocks)).collect())
}

/// Waits until `FindMatches` for `hashes` answers `want` as [`overlaps`] reads it.
async fn until_overlaps(
    client: &FleetClient<Channel>,
    hashes: &[u64],
    want: &[(u64, u32)],
    what: &str,
) -> anyhow::Result<()> {
    eventually(WAIT, what, || {
        let mut client = client.clone();
        async move { overlaps(&mut client, hashes).await.is_ok_and(|o| o == want) }
    })
    .await
}

/// Waits until `FindMatches` for `hashes` answers `want` as [`held`] reads it.
async fn until_held(
    client: &FleetClient<Channel>,
    hashes: &[u64],
    want: &[(u64, u32, u32)],
    what: &str,
) -> anyhow::Result<()> {
    eventually(WAIT, what, || {
        let mut client = client.clone();
        async move { held(&mut client, hashes).await.is_ok_and(|o| o == want) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_one_replica_pins_is_credited_to_its_rank_for_every_replica_until_the_ttl_passes() -> anyhow::Result<()>
{
    let plane = Plane::start("5s").await?;
    let (mut first, mut second) = (plane.client().await?, plane.client().await?);
    let reporter = watch(&mut first, "replica-a").await?;
    let _other = watch(&mut second, "replica-b").await?;

    // A new prefix: no worker has published it, so neither replica sees it anywhere yet.
    let prefix: Vec<u64> = (1_000..1_012).collect();
    let mut query = prefix.clone();
    query.extend([9_001, 9_002]);
    assert!(overlaps(&mut second, &query).await?.is_empty());

    // Replica A pins a request for it to FIRST; replica B's lookup now credits FIRST with the
    // whole prefix (not the blocks past it), and SECOND with nothing.
    // Taken before the send: the control plane may credit the pin before the send returns.
    let t0 = std::time::Instant::now();
    reporter.send(started(1, FIRST, prefix.clone())).await?;
    until_overlaps(&second, &query, &[(FIRST, 12)], "replica B sees A's pin as FIRST's overlap").await?;
    // A query sharing only the first blocks scores only those.
    assert_eq!(overlaps(&mut second, &prefix[..5]).await?, [(FIRST, 5)]);

    // The TTL passes with no kv-event confirming it: the credit is gone for everyone.
    until_overlaps(&first, &query, &[], "the credit expires").await?;
    assert!(t0.elapsed() >= TTL - Duration::from_millis(100), "not before the TTL: {:?}", t0.elapsed());
    eventually(WAIT, "the sweep counts it expired", || async { plane.provisional("expired") >= 1 }).await?;
    assert!(plane.provisional("credited") >= 1);
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_ttl_reloaded_in_turns_the_credit_off_so_the_same_report_credits_nothing() -> anyhow::Result<()> {
    // Long enough that a loaded machine's late report still finds the credit on.
    let mut plane = Plane::start("60s").await?;
    let mut client = plane.client().await?;
    let reporter = watch(&mut client, "replica-a").await?;
    let prefix: Vec<u64> = (2_000..2_008).collect();
    reporter.send(started(1, SECOND, prefix.clone())).await?;
    until_overlaps(&client, &prefix, &[(SECOND, 8)], "credited while on").await?;

    // Off: what was held goes at once, and a new report is refused (and counted).
    plane.supervisor.reload(&kv_config("0s")?).await;
    assert!(overlaps(&mut client, &prefix).await?.is_empty(), "turning it off drops held chains");
    let refused_before = plane.provisional("refused");
    let fresh: Vec<u64> = (3_000..3_008).collect();
    reporter.send(started(2, SECOND, fresh.clone())).await?;
    eventually(WAIT, "the report reached the control plane and was refused", || async {
        plane.provisional("refused") > refused_before
    })
    .await?;
    assert!(overlaps(&mut client, &fresh).await?.is_empty(), "off: requests for a new prefix may split");
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_blocks_a_dispatch_in_flight_holds_are_its_ranks_active_overlap_until_it_ends() -> anyhow::Result<()> {
    let plane = Plane::start("60s").await?;
    let mut client = plane.client().await?;
    let reporter = watch(&mut client, "replica-a").await?;
    let prefix: Vec<u64> = (4_000..4_012).collect();
    // A decode dispatch of 4 blocks (`started` reports 4) of a 12-block chain: FIRST holds
    // all 12 provisionally, and its request in flight holds the first 4.
    reporter.send(started(1, FIRST, prefix.clone())).await?;
    until_held(&client, &prefix, &[(FIRST, 12, 4)], "the dispatch's blocks are FIRST's active overlap").await?;
    // A prompt that leaves the chain after 2 blocks shares only those.
    assert_eq!(held(&mut client, &[4_000, 4_001, 7]).await?, [(FIRST, 2, 2)]);

    // Its end frees them; the provisional credit stays until its TTL.
    reporter.send(ended(1)).await?;
    until_held(&client, &prefix, &[(FIRST, 12, 0)], "nothing in flight holds them").await?;
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_for_a_rank_the_fleet_lacks_is_refused_and_counted_by_an_idle_book() -> anyhow::Result<()> {
    let plane = Plane::start("60s").await?;
    let mut client = plane.client().await?;
    let reporter = watch(&mut client, "replica-a").await?;
    // The book holds nothing, so it has no window to wake for but the count it owes.
    reporter.send(started(1, 0x99, vec![7_000, 7_001])).await?;
    let refused = || plane.metrics.dispatches_refused.with_label_values(&["unknown_rank"]).get();
    eventually(WAIT, "the refusal is counted", || async { refused() == 1 }).await?;
    assert!(held(&mut client, &[7_000, 7_001]).await?.is_empty(), "a refused dispatch holds nothing");
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_through_any_replica_are_numbered_per_model_in_the_order_they_are_answered() -> anyhow::Result<()> {
    let plane = Plane::start("60s").await?;
    let (mut first, mut second) = (plane.client().await?, plane.client().await?);
    // One sequence per model, whichever replica asks: what lets replicas that see the same tie
    // rotate it between them instead of each taking its own first contender. Another model's
    // lookups in between leave it consecutive.
    let mut turns = Vec::new();
    for _ in 0..3 {
        turns.push(turn(&mut first, "tiny").await?);
        turn(&mut second, "other").await?;
        turns.push(turn(&mut second, "tiny").await?);
    }
    assert_eq!(turns, [1, 2, 3, 4, 5, 6]);
    assert_eq!(turn(&mut first, "other").await?, 4);
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test]
async fn a_lookup_made_while_another_replicas_pick_is_unfolded_is_suggested_the_other_rank() -> anyhow::Result<()> {
    let plane = Plane::start("10s").await?;
    // The control plane's window is a few milliseconds; here a report must cross a busy test
    // machine inside it.
    plane.supervisor.handle().set_lookup_window(Duration::from_secs(60));
    let (mut first, mut second) = (plane.client().await?, plane.client().await?);
    let reports = watch(&mut first, "first").await?;

    // Nothing stands yet: a tie-break, the first contender, reserved for this lookup.
    let opening = suggest(&mut first, "first", 1).await?;
    assert_eq!((opening.suggestion, opening.tie_break), (None, Some(FIRST)));
    // The replica's own costs sent the request to SECOND: its report names the lookup (and
    // credits a chain, by which the test sees the report has arrived).
    let mut report = started(1, SECOND, vec![0xfeed]);
    if let Some(Kind::Dispatches(dispatches)) = &mut report.kind {
        dispatches.started[0].lookup = 1;
    }
    reports.send(report).await?;
    until_overlaps(&second, &[0xfeed], &[(SECOND, 1)], "the report is in").await?;

    // Lookups through the other replica are weighed against it, as one process picking both
    // requests would weigh them; equal reservations go to the rank reserved longest ago.
    let mut went = Vec::new();
    for lookup in 1..=3 {
        let answer = suggest(&mut second, "second", lookup).await?;
        assert_eq!(answer.tie_break, None);
        went.push(answer.suggestion.context("a weighed suggestion")?);
    }
    assert_eq!(went, [FIRST, SECOND, FIRST]);
    assert_eq!(plane.metrics.kv_find_matches_suggested.get(), 3, "tie-breaks are not counted");
    plane.cancel.cancel();
    Ok(())
}

#[tokio::test]
async fn a_report_moves_only_the_reservations_of_its_own_replicas_lookups() -> anyhow::Result<()> {
    let plane = Plane::start("10s").await?;
    plane.supervisor.handle().set_lookup_window(Duration::from_secs(60));
    let (mut first, mut second) = (plane.client().await?, plane.client().await?);
    let intruder = watch(&mut second, "second").await?;

    let opening = suggest(&mut first, "first", 1).await?;
    assert_eq!(opening.tie_break, Some(FIRST), "reserved on FIRST for replica first's lookup 1");
    // Replica second numbers its own lookups: its dispatch under number 1 is not first's.
    let mut report = started(1, SECOND, vec![0xbeef]);
    if let Some(Kind::Dispatches(dispatches)) = &mut report.kind {
        dispatches.started[0].lookup = 1;
    }
    intruder.send(report).await?;
    until_overlaps(&first, &[0xbeef], &[(SECOND, 1)], "the report is in").await?;
    let next = suggest(&mut second, "second", 2).await?;
    assert_eq!(next.suggestion, Some(SECOND), "first's reservation still stands on FIRST");
    plane.cancel.cancel();
    Ok(())
}

/// What `FindMatches` suggests to a lookup among `FIRST` and `SECOND` (instance ids).
struct Suggested {
    suggestion: Option<u64>,
    tie_break: Option<u64>,
}

/// Replica `replica_id`'s lookup number `lookup`.
async fn suggest(client: &mut FleetClient<Channel>, replica_id: &str, lookup: u64) -> anyhow::Result<Suggested> {
    let contenders = [FIRST, SECOND].map(|instance_id| pb::RankId { instance_id, dp_rank: 0 }).to_vec();
    let request = pb::FindMatchesRequest {
        block_hashes: vec![7_000],
        model: "tiny".into(),
        contenders,
        prompt_tokens: 64,
        replica_id: replica_id.into(),
        lookup,
    };
    let answer = client.find_matches(request).await?.into_inner();
    let id = |rank: Option<pb::RankId>| rank.map(|rank| rank.instance_id);
    Ok(Suggested { suggestion: id(answer.suggestion), tie_break: id(answer.tie_break) })
}

/// The turn `FindMatches` numbers a lookup for `model` with.
async fn turn(client: &mut FleetClient<Channel>, model: &str) -> anyhow::Result<u64> {
    let lookup = pb::FindMatchesRequest { block_hashes: vec![5_000], model: model.into(), ..Default::default() };
    Ok(client.find_matches(lookup).await?.into_inner().turn)
}

#[tokio::test]
async fn what_one_caller_sends_is_bounded_before_it_is_believed() -> anyhow::Result<()> {
    let plane = Plane::start("10s").await?;
    plane.supervisor.handle().set_lookup_window(Duration::from_secs(60));
    let mut client = plane.client().await?;

    // A prompt of every token there is reserves no more than the largest rendered one.
    let only_first = vec![pb::RankId { instance_id: FIRST, dp_rank: 0 }];
    let huge = pb::FindMatchesRequest {
        block_hashes: vec![7_000],
        model: "tiny".into(),
        contenders: only_first,
        prompt_tokens: u64::MAX,
        ..Default::default()
    };
    client.find_matches(huge).await?;
    let both = [FIRST, SECOND].map(|instance_id| pb::RankId { instance_id, dp_rank: 0 }).to_vec();
    let next = pb::FindMatchesRequest {
        block_hashes: vec![7_000],
        model: "tiny".into(),
        contenders: both,
        prompt_tokens: 64,
        ..Default::default()
    };
    let answer = client.find_matches(next).await?.into_inner();
    assert_eq!(answer.suggestion.map(|r| r.instance_id), Some(SECOND));
    assert_eq!(answer.reserved_tokens, continuum_proto::MAX_LOOKUP_PROMPT_TOKENS, "the claim is taken at the bound");

    // A message past what any replica sends is refused before it is decoded.
    let flood = pb::FindMatchesRequest { block_hashes: vec![0; 5 << 20], ..Default::default() };
    let refused = client.find_matches(flood).await.map(|_| ()).map_err(|status| status.code());
    assert_eq!(refused, Err(tonic::Code::OutOfRange), "5 Mi hashes (5 MiB on the wire) are not decoded");

    // A report starting more dispatches than a replica batches ends its session, and so does
    // one ending more than a replica ever ends at once.
    let many = (0..=continuum_proto::MAX_REPORT_STARTED as u64).map(|id| started(id, FIRST, vec![]));
    let started: Vec<pb::DispatchStarted> = many
        .filter_map(|request| match request.kind {
            Some(Kind::Dispatches(report)) => report.started.into_iter().next(),
            _ => None,
        })
        .collect();
    let ended = (0..=continuum_proto::MAX_REPORT_ENDS as u64).collect();
    // A start names one rank at most: a table of more ranks than starts is no report.
    let key =
        pb::LoadKey { worker: Some(pb::WorkerKey { namespace: "dynamo".into(), instance_id: FIRST }), dp_rank: 0 };
    let one = started.first().cloned().into_iter().collect();
    let oversized = [
        ("flood", pb::DispatchReport { started, ..Default::default() }),
        ("ends", pb::DispatchReport { ended, ..Default::default() }),
        ("ranks", pb::DispatchReport { started: one, ranks: vec![key; 2], ..Default::default() }),
    ];
    let mut reporter = plane.client().await?;
    for (replica_id, report) in oversized {
        let (tx, rx) = mpsc::channel(8);
        let hello = pb::Hello { replica_id: replica_id.into(), version: None };
        tx.send(pb::WatchRequest { kind: Some(Kind::Hello(hello)) }).await?;
        let mut updates = reporter.watch(ReceiverStream::new(rx)).await?.into_inner();
        tx.send(pb::WatchRequest { kind: Some(Kind::Dispatches(report)) }).await?;
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match updates.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return None,
                    Err(status) => return Some(status.code()),
                }
            }
        })
        .await?;
        assert_eq!(ended, Some(tonic::Code::InvalidArgument), "{replica_id}");
    }
    plane.cancel.cancel();
    Ok(())
}
