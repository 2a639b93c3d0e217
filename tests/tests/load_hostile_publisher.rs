//! A hostile kv_metrics publisher beside a healthy one, both over real loopback TCP through the
//! real supervisor, subscription tasks, bounded ZMTP client and load store. Each hostile case is
//! counted under its own label, the hostile subscription's buffer stays within its ceiling, and
//! the healthy subscription keeps updating throughout.

use std::time::Duration;

use anyhow::Context;
use continuum_control_plane::discovery::PublisherKey;
use continuum_control_plane::load::zmtp::ZmtpLimits;
use continuum_proto::model::{LoadKey, WorkerKey};
use continuum_tests::eventually;
use continuum_tests::load::{NAMESPACE, TestLoad, fleet, kv_metrics_publisher, loopback_config, test_options, worker};
use continuum_tests::zmtp_peer::{KvMetricsSample, PeerConnection, RawPublisher};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

const HEALTHY_WORKER: u64 = 0x100;
const HEALTHY_PUBLISHER: u64 = 1000;
const HOSTILE_WORKER: u64 = 0x200;
const HOSTILE_PUBLISHER: u64 = 2000;
const SLOW_WORKER: u64 = 0x300;
const SLOW_PUBLISHER: u64 = 3000;
/// Past the 10 s handshake deadline the slowloris case waits on, with room for a loaded machine.
const WAIT: Duration = Duration::from_secs(15);

const LABELS: [&str; 11] = [
    "applied",
    "malformed",
    "unknown_version",
    "topic_mismatch",
    "oversized",
    "identity_mismatch",
    "over_capacity",
    "duplicate",
    "sequence_gap",
    "transport_refused",
    "not_allowed",
];

fn key(worker: u64, rank: u32) -> LoadKey {
    LoadKey { worker: WorkerKey::new(NAMESPACE, worker), dp_rank: rank }
}

fn hostile(sequence: u64, rank: u32, used: u64) -> Vec<Vec<u8>> {
    KvMetricsSample {
        publisher_id: HOSTILE_PUBLISHER,
        sequence,
        worker_id: HOSTILE_WORKER,
        dp_rank: rank,
        kv_used_blocks: used,
    }
    .frames()
}

struct Harness {
    load: TestLoad,
}

impl Harness {
    fn counts(&self) -> Vec<u64> {
        LABELS.iter().map(|l| self.load.events(l)).collect()
    }

    fn healthy_sequence(&self) -> Option<u64> {
        self.load.view.store.lock().get(&key(HEALTHY_WORKER, 0)).map(|h| h.sequence)
    }

    /// Runs `case`, then waits until `label` went up (by exactly one when `exact`; a refused
    /// handshake repeats with backoff) and nothing but `applied` (the healthy publisher) moved
    /// besides; the healthy sample must advance meanwhile.
    async fn expect(
        &self,
        case: &str,
        label: &str,
        exact: bool,
        run: impl AsyncFnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let before = self.counts();
        let healthy_before = self.healthy_sequence();
        run().await.with_context(|| case.to_string())?;
        let index = LABELS.iter().position(|l| *l == label).context("label")?;
        eventually(WAIT, &format!("{case} counted as {label}"), || async { self.load.events(label) > before[index] })
            .await?;
        eventually(WAIT, &format!("the healthy subscription updating after {case}"), || async {
            self.healthy_sequence() > healthy_before
        })
        .await?;
        let after = self.counts();
        for (i, l) in LABELS.iter().enumerate() {
            let moved = after[i] - before[i];
            match *l {
                "applied" => {}
                l if l == label => assert!(moved == 1 || (!exact && moved > 1), "{case}: {l} moved by {moved}"),
                l => assert_eq!(moved, 0, "{case}: {l} moved by {moved} as well"),
            }
        }
        let status = self.load.subscription(HOSTILE_PUBLISHER).context("hostile subscription")?;
        let ceiling = ZmtpLimits::KV_METRICS.buffer_ceiling();
        assert!(
            status.buffer_high_water() <= 1024,
            "{case}: the hostile buffer grew to {}",
            status.buffer_high_water()
        );
        assert!(status.buffer_high_water() <= ceiling);
        Ok(())
    }
}

/// The healthy publisher: a sample every 20 ms, rank 0, sequences counting up.
async fn healthy(mut peer: RawPublisher) {
    let mut sequence = 0;
    loop {
        let Ok(mut connection) = peer.connection(Duration::from_secs(60)).await else { return };
        while send(
            &mut connection,
            KvMetricsSample {
                publisher_id: HEALTHY_PUBLISHER,
                sequence,
                worker_id: HEALTHY_WORKER,
                dp_rank: 0,
                kv_used_blocks: sequence % 50,
            },
        )
        .await
        {
            sequence += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn send(connection: &mut PeerConnection, sample: KvMetricsSample) -> bool {
    connection.send_frames(&sample.frames()).await.is_ok()
}

/// Accepts connections and dribbles a greeting one byte every 50 ms, never finishing it.
async fn slowloris(listener: TcpListener) {
    while let Ok((mut stream, _)) = listener.accept().await {
        tokio::spawn(async move {
            for _ in 0..10_000 {
                if stream.write_all(&[0xFF]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hostile_message_is_counted_under_its_label_within_bounds_while_a_healthy_publisher_keeps_updating()
-> anyhow::Result<()> {
    let healthy_peer = RawPublisher::bind().await?;
    let mut hostile_peer = RawPublisher::bind().await?;
    let slow = TcpListener::bind("127.0.0.1:0").await?;
    let slow_address = format!("tcp://{}", slow.local_addr()?);
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet(
        vec![worker(HEALTHY_WORKER, 1), worker(HOSTILE_WORKER, 2), worker(SLOW_WORKER, 1)],
        vec![
            kv_metrics_publisher(HEALTHY_PUBLISHER, HEALTHY_WORKER, healthy_peer.endpoint()),
            kv_metrics_publisher(HOSTILE_PUBLISHER, HOSTILE_WORKER, hostile_peer.endpoint()),
        ],
    ));
    let healthy_task = tokio::spawn(healthy(healthy_peer));
    let h = Harness { load };
    eventually(WAIT, "the healthy publisher's first sample", || async { h.healthy_sequence().is_some() }).await?;

    let mut conn = hostile_peer.connection(WAIT).await?;
    assert_eq!(conn.subscription, b"\x01kv_metrics", "a ZMTP 3.0 subscription to the bare topic");
    conn.send_frames(&hostile(1, 0, 3)).await?;
    eventually(WAIT, "the hostile publisher's well-formed sample", || async {
        h.load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).is_some()
    })
    .await?;

    h.expect("a 17 KiB payload", "oversized", true, async || {
        let mut frames = hostile(2, 0, 3);
        let payload = vec![0x90u8; 17 * 1024];
        let mut frame = vec![1];
        frame.extend_from_slice(&u32::try_from(payload.len())?.to_be_bytes());
        frame.extend(payload);
        frames[3] = frame;
        conn.send_frames(&frames).await
    })
    .await?;
    // Unread, the message may have held a change: the publisher's samples go as on a gap.
    eventually(WAIT, "the refusal dropping the hostile publisher's held sample", || async {
        h.load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).is_none()
    })
    .await?;

    h.expect("version byte 2", "unknown_version", true, async || {
        let mut frames = hostile(3, 0, 3);
        frames[3][0] = 2;
        conn.send_frames(&frames).await
    })
    .await?;

    h.expect("invalid msgpack", "malformed", true, async || {
        let mut frames = hostile(4, 0, 3);
        frames[3] = vec![1, 0, 0, 0, 3, 0xc1, 0xc1, 0xc1];
        conn.send_frames(&frames).await
    })
    .await?;

    h.expect("a publisher id that differs from the discovery record", "identity_mismatch", true, async || {
        let forged = KvMetricsSample {
            publisher_id: HOSTILE_PUBLISHER + 1,
            sequence: 5,
            worker_id: HOSTILE_WORKER,
            dp_rank: 0,
            kv_used_blocks: 9,
        };
        conn.send_frames(&forged.frames()).await
    })
    .await?;

    h.expect("five frames", "malformed", true, async || {
        let mut frames = hostile(6, 0, 3);
        frames.push(b"fifth".to_vec());
        conn.send_frames(&frames).await
    })
    .await?;

    h.expect("a sequence gap", "sequence_gap", true, async || {
        conn.send_frames(&hostile(2, 1, 4)).await?;
        conn.send_frames(&hostile(4, 0, 5)).await
    })
    .await?;
    {
        let store = h.load.view.store.lock();
        assert!(store.get(&key(HOSTILE_WORKER, 1)).is_none(), "the gap dropped the sample held for rank 1");
        assert_eq!(store.get(&key(HOSTILE_WORKER, 0)).map(|s| s.sequence), Some(4), "the sample after the gap is held");
    }

    h.expect("a replayed sequence", "duplicate", true, async || {
        conn.send_frames(&hostile(5, 0, 6)).await?;
        conn.send_frames(&hostile(5, 0, 7)).await
    })
    .await?;
    assert_eq!(
        h.load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).map(|s| s.sample.load.kv_used_blocks),
        Some(Some(6))
    );

    h.expect("a frame length of 2^63", "transport_refused", true, async || {
        let mut bytes = vec![0x02];
        bytes.extend_from_slice(&(1u64 << 63).to_be_bytes());
        conn.send_raw(&bytes).await
    })
    .await?;
    assert!(conn.closed_within(WAIT).await, "the session was closed");
    let mut conn = hostile_peer.connection(WAIT).await.context("the hostile subscription reconnects with backoff")?;
    assert_eq!(
        h.load.subscription(HEALTHY_PUBLISHER).map(|s| s.sessions()),
        Some(1),
        "the healthy session never dropped"
    );
    eventually(WAIT, "the reconnect dropping the hostile publisher's held samples", || async {
        h.load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).is_none()
    })
    .await?;
    conn.send_frames(&hostile(0, 0, 1)).await?;
    eventually(WAIT, "a new connection starting its own sequence", || async {
        h.load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).is_some_and(|s| s.sequence == 0)
    })
    .await?;

    h.expect("an endless greeting (slowloris)", "transport_refused", false, async || {
        tokio::spawn(slowloris(slow));
        let mut current = h.load.registry.current().fleet.clone();
        let slow = kv_metrics_publisher(SLOW_PUBLISHER, SLOW_WORKER, slow_address);
        current.publishers.insert(PublisherKey { namespace: NAMESPACE.into(), publisher_id: SLOW_PUBLISHER }, slow);
        h.load.registry.publish(current);
        Ok(())
    })
    .await?;

    healthy_task.abort();
    h.load.stop().await;
    Ok(())
}

/// Channel records that name no worker, or a worker the fleet does not hold, are never dialled:
/// every sample of theirs would be refused, and reading their messages would take from the
/// large-message budget the fleet's workers share. The fleet's own channel beside them is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_that_names_no_worker_in_the_fleet_is_not_dialled() -> anyhow::Result<()> {
    let (mut nameless_peer, mut strange_peer) = (RawPublisher::bind().await?, RawPublisher::bind().await?);
    let healthy_peer = RawPublisher::bind().await?;
    let load = TestLoad::start(&loopback_config(), test_options())?;
    // A channel record with no lease and no event source: discovery can name no worker for it.
    let nameless = continuum_control_plane::discovery::Publisher {
        worker: None,
        ..kv_metrics_publisher(HOSTILE_PUBLISHER, HOSTILE_WORKER, nameless_peer.endpoint())
    };
    // One naming a worker the fleet does not hold.
    let strange = kv_metrics_publisher(SLOW_PUBLISHER, SLOW_WORKER, strange_peer.endpoint());
    let healthy_publisher = kv_metrics_publisher(HEALTHY_PUBLISHER, HEALTHY_WORKER, healthy_peer.endpoint());
    load.registry.publish(fleet(
        vec![worker(HOSTILE_WORKER, 1), worker(HEALTHY_WORKER, 1)],
        vec![nameless, strange, healthy_publisher],
    ));
    let healthy_task = tokio::spawn(healthy(healthy_peer));
    eventually(WAIT, "the fleet's channel applied", || async { load.events("applied") > 0 }).await?;
    assert!(load.subscription(HOSTILE_PUBLISHER).is_none(), "the nameless channel has no subscription");
    assert!(load.subscription(SLOW_PUBLISHER).is_none(), "nor the one naming a worker not in the fleet");
    for peer in [&mut nameless_peer, &mut strange_peer] {
        assert!(peer.connection(Duration::from_millis(200)).await.is_err(), "never dialled");
    }
    assert!(load.view.store.lock().get(&key(HOSTILE_WORKER, 0)).is_none(), "no load was set for the worker");
    healthy_task.abort();
    load.stop().await;
    Ok(())
}
