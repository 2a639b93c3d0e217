//! The bounded ZMTP client against real ZeroMQ PUB implementations on loopback: libzmq 4.3
//! (pyzmq), heartbeating with PING every 100 ms so the client must answer PONG to stay
//! connected, and the `zeromq` crate. Both publish Dynamo's kv_metrics layout.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use continuum_proto::model::{LoadKey, WorkerKey};
use continuum_tests::load::{NAMESPACE, TestLoad, fleet, kv_metrics_publisher, loopback_config, test_options, worker};
use continuum_tests::zmtp_peer::KvMetricsSample;
use continuum_tests::{eventually, tools};

use tokio::io::{AsyncBufReadExt, BufReader};
use zeromq::{Socket, SocketSend, ZmqMessage};

const WAIT: Duration = Duration::from_secs(10);

/// A libzmq PUB: prints its port, then publishes a sample every 20 ms with PINGs every 100 ms
/// and a 2 s heartbeat timeout (a client that never answers PONG is disconnected).
const LIBZMQ_PUB: &str = r#"
import sys, time, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.HEARTBEAT_IVL, 100)
pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2000)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
frames = [bytes.fromhex(h) for h in sys.argv[1:]]
seq = 0
while True:
    time.sleep(0.02)
    seq += 1
    envelope = frames[3]
    pub.send_multipart([frames[0], frames[1], seq.to_bytes(8, "big"), envelope.replace(b"SEQUENCE", seq.to_bytes(8, "big"))])
"#;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn key(worker: u64) -> LoadKey {
    LoadKey { worker: WorkerKey::new(NAMESPACE, worker), dp_rank: 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libzmq_publisher_with_heartbeats_keeps_one_session_and_every_sample_applies() -> anyhow::Result<()> {
    // The script swaps the envelope's sequence (a u64 after 0xcf) for the frame's.
    let mut frames =
        KvMetricsSample { publisher_id: 77, sequence: 0, worker_id: 5, dp_rank: 0, kv_used_blocks: 2 }.frames();
    let marker = [0xcfu8, 0, 0, 0, 0, 0, 0, 0, 0];
    let at = frames[3].windows(9).position(|w| w == marker).context("the sequence field")?;
    frames[3].splice(at + 1..at + 9, *b"SEQUENCE");
    let mut child = tokio::process::Command::new(tools::python())
        .arg("-c")
        .arg(LIBZMQ_PUB)
        .args(frames.iter().map(|f| hex(f)))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let port: u16 =
        tokio::time::timeout(WAIT, lines.next_line()).await??.context("no port (is pyzmq installed?)")?.parse()?;

    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry
        .publish(fleet(vec![worker(5, 1)], vec![kv_metrics_publisher(77, 5, format!("tcp://127.0.0.1:{port}"))]));
    eventually(WAIT, "samples from libzmq", || async { load.events("applied") > 5 }).await?;
    // Well past the 2 s heartbeat timeout: PONGs kept the one session alive.
    let before = load.events("applied");
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let applied = load.events("applied") - before;
    if applied == 0 {
        bail!("no samples in 4 s: the session did not stay up");
    }
    for label in ["transport_refused", "malformed", "duplicate", "sequence_gap", "identity_mismatch"] {
        assert_eq!(load.events(label), 0, "{label}");
    }
    let held = load.view.store.lock().get(&key(5)).map(|h| h.sample.load.kv_used_blocks);
    assert_eq!(held, Some(Some(2)));
    let status = load.subscription(77).context("subscription")?;
    assert_eq!(status.state().map(|s| s.as_str()), Some("connected"));
    assert_eq!(status.sessions(), 1, "libzmq never dropped the session");
    load.stop().await;
    child.kill().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeromq_crate_publisher_is_read_like_a_dynamo_worker() -> anyhow::Result<()> {
    let mut socket = zeromq::PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await?;
    let load = TestLoad::start(&loopback_config(), test_options())?;
    load.registry.publish(fleet(vec![worker(6, 1)], vec![kv_metrics_publisher(88, 6, endpoint.to_string())]));
    // A PUB drops what it sends before the subscription arrives: send until one lands.
    let deadline = std::time::Instant::now() + WAIT;
    let mut sent = 0;
    for sequence in 1.. {
        sent = sequence;
        let frames =
            KvMetricsSample { publisher_id: 88, sequence, worker_id: 6, dp_rank: 0, kv_used_blocks: sequence }.frames();
        let message = ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>())
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        socket.send(message).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if load.view.store.lock().get(&key(6)).is_some() {
            break;
        }
        if std::time::Instant::now() > deadline {
            bail!("no sample from the zeromq crate's PUB within {WAIT:?}");
        }
    }
    assert_eq!(load.events("transport_refused"), 0);
    // Each sample says as many used blocks as its sequence number: the one held is one sent.
    let held = load.view.store.lock().get(&key(6)).and_then(|h| h.sample.load.kv_used_blocks);
    assert!(held.is_some_and(|blocks| (1..=sent).contains(&blocks)), "held {held:?} of samples 1..={sent}");
    load.stop().await;
    Ok(())
}
