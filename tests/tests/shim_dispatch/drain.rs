//! Shutting a replica down the way a load balancer can follow: readiness fails first while
//! requests are still answered (each closing its connection), then accepting stops, and requests
//! in flight finish, with their ends reported, or are cut once the grace period is over.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use continuum_proto::model::{LoadKey, WorkerKey};
use continuum_tests::eventually;
use continuum_tests::shim_stub::StubShim;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{CONVERGE, DECODE_ID, Harness, MODEL, NAMESPACE, chat, config, disaggregated_fleet};

const DONE: &str = "data: [DONE]\n\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_fails_readiness_still_answers_then_lets_its_streams_finish_and_reports_their_ends()
-> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let gates = [shim.push_stream(), shim.push_stream()];
    let mut streams = [harness.post(&chat(MODEL, true)).await?, harness.post(&chat(MODEL, true)).await?];
    assert!(streams.iter().all(|s| s.status() == 200));
    let Harness { control, replica, http } = harness;
    let decode = LoadKey { worker: WorkerKey::new(NAMESPACE, DECODE_ID), dp_rank: 0 };
    let counted = || control.publisher.current().view().backlogs().get(&decode).map_or(0, |b| b.dispatches);
    eventually(CONVERGE, "the control plane counting both streams", || async { counted() == 2 }).await?;

    let addr = replica.local_addr;
    let url = |path: &str| format!("http://{addr}{path}");
    let draining = tokio::spawn(replica.drain(Duration::from_secs(6), Duration::from_secs(30)));

    // During the delay: not ready, yet a new connection is accepted and answered, and told to close.
    let ready = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let answer = http.get(url("/readyz")).send().await?;
            if answer.status() == 503 {
                return anyhow::Ok(answer.json::<Value>().await?);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await??;
    assert_eq!((&ready["ready"], &ready["draining"]), (&Value::Bool(false), &Value::Bool(true)), "{ready}");
    assert!(ready["reason"].as_str().is_some_and(|r| r.starts_with("draining")), "{ready}");
    let answer = reqwest::Client::new().post(url("/v1/chat/completions")).json(&chat(MODEL, false)).send().await?;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers().get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]));

    // After it: no new connection, while both streams go on and stay counted fleet-wide.
    eventually(Duration::from_secs(10), "accepting to stop", || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await?;
    assert_eq!(counted(), 2, "the fleet stream outlives accepting");

    // A stream that ends while the replica drains is reported as ended.
    let [first_gate, second_gate] = gates;
    first_gate.send(Ok(Bytes::from(DONE))).await?;
    drop(first_gate);
    let [first, second] = &mut streams;
    assert_eq!(first.chunk().await?.as_deref(), Some(DONE.as_bytes()));
    assert_eq!(first.chunk().await?, None);
    eventually(CONVERGE, "the control plane hearing of the first stream's end", || async { counted() == 1 }).await?;
    assert!(!draining.is_finished(), "the drain waits for the second stream");

    second_gate.send(Ok(Bytes::from(DONE))).await?;
    drop(second_gate);
    assert_eq!(second.chunk().await?.as_deref(), Some(DONE.as_bytes()));
    tokio::time::timeout(Duration::from_secs(10), draining).await??;
    control.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_open_when_the_grace_period_ends_is_cut_and_its_dispatch_ended() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let _gate = shim.push_stream();
    let mut stream = harness.post(&chat(MODEL, true)).await?;
    assert_eq!(stream.status(), 200);
    let Harness { control, replica, .. } = harness;
    let ledger = Arc::clone(&replica.ledger);
    assert_eq!(ledger.len(), 1);

    let grace = Duration::from_millis(300);
    tokio::time::timeout(Duration::from_secs(10), replica.drain(Duration::ZERO, grace)).await?;
    assert!(stream.chunk().await.is_err(), "the client sees its stream cut, not ended");
    assert!(ledger.is_empty(), "cutting the connection ended its dispatch");
    control.stop().await;
    Ok(())
}

/// A stream answered before the drain began said its connection stays open. If it ends during
/// the drain, the connection closes then, as every answer from the drain on says it will: kept
/// idle until accepting stops, it could take a request just as it closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_during_the_drain_closes_its_connection() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let harness = Harness::start(disaggregated_fleet(), config(&[("shim-a", shim.url())])).await?;
    let gate = shim.push_stream();
    let mut client = tokio::net::TcpStream::connect(harness.replica.local_addr).await?;
    let body = serde_json::to_vec(&chat(MODEL, true))?;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    client.write_all(&[head.as_bytes(), &body].concat()).await?;
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    while !received.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(CONVERGE, client.read(&mut chunk)).await??;
        anyhow::ensure!(n > 0, "closed before the answer's head");
        received.extend_from_slice(&chunk[..n]);
    }
    assert!(received.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&received));
    assert!(!String::from_utf8_lossy(&received).to_lowercase().contains("connection: close"));

    let Harness { control, replica, http } = harness;
    let readyz = format!("http://{}/readyz", replica.local_addr);
    let drain_delay = Duration::from_secs(5);
    let draining = tokio::spawn(replica.drain(drain_delay, Duration::from_secs(30)));
    // The stream ends once the replica is draining (its readiness fails), not before.
    eventually(drain_delay / 2, "the replica draining", || async {
        http.get(&readyz).send().await.is_ok_and(|answer| answer.status() == 503)
    })
    .await?;
    gate.send(Ok(Bytes::from(DONE))).await?;
    drop(gate);
    let closed = tokio::time::timeout(drain_delay / 2, async {
        loop {
            match client.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection stayed open after its stream ended, until accepting stopped");
    tokio::time::timeout(Duration::from_secs(15), draining).await??;
    control.stop().await;
    Ok(())
}
