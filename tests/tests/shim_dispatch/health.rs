//! Shim replica health: connection failures move on to another replica of the pool with the same
//! pins; consecutive failures open a replica's breaker, and a probe after the cooldown closes it;
//! a replica failing its liveness probes is skipped until it answers again; a worker whose
//! pinned requests keep failing is skipped for a while.

use std::time::Duration;

use continuum_data_plane::dispatch::budget::MAX_ATTEMPTS;
use continuum_data_plane::dispatch::{BreakerSettings, DispatchSettings, ProbeSettings};
use continuum_tests::eventually;
use continuum_tests::shim_stub::{RefusingPort, StubShim};

use continuum_data_plane::routing::picker::EJECT_AFTER;
use continuum_proto::model::Role;

use super::{DECODE_ID, Harness, MODEL, PREFILL_ID, chat, config, disaggregated_fleet, error_of, sample, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_failures_retry_on_another_replica_with_the_same_pins() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    let dead = RefusingPort::reserve()?;
    let harness =
        Harness::start(disaggregated_fleet(), config(&[("shim-dead", dead.url()), ("shim-live", shim.url())])).await?;
    // Rotation starts every other request on the dead replica; all must succeed.
    for stream in [false, true, false, true] {
        let response = harness.post(&chat(MODEL, stream)).await?;
        assert_eq!(response.status(), 200);
        response.bytes().await?;
    }
    let received = shim.received();
    assert_eq!(received.len(), 4, "each request reached the live replica exactly once");
    for request in received {
        assert_eq!(request.header("x-dynamo-worker-instance-id"), Some(DECODE_ID.to_string().as_str()));
        assert_eq!(request.header("x-dynamo-prefill-instance-id"), Some(PREFILL_ID.to_string().as_str()));
    }
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim-live"}"#), Some(0.0));
    assert_eq!(
        sample(&metrics, "continuum_shim_retries_total"),
        Some(2.0),
        "the two requests that started on the dead replica moved on"
    );
    assert_eq!(sample(&metrics, r#"disaggregated_errors_total{phase="decode"}"#), Some(0.0));
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    Ok(())
}

/// Retries on another replica are paid from the retry budget: once it is spent, a send that
/// failed to connect is not moved on, its client gets the failure, and the refusal is counted
/// (a spent budget told apart from an unreachable pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_budget_cannot_pay_is_not_made_and_is_counted() -> anyhow::Result<()> {
    const REQUESTS: usize = 60;
    let shim = StubShim::start().await?;
    let dead = RefusingPort::reserve()?;
    // A breaker that never opens, and probes too far apart to take the dead replica out: every
    // request starting on it needs a retry, however slowly the machine runs them.
    let breaker = BreakerSettings { failure_threshold: u32::MAX, ..BreakerSettings::default() };
    let probe = ProbeSettings { interval: Duration::from_secs(3600), ..ProbeSettings::default() };
    let settings = DispatchSettings { breaker, probe, ..DispatchSettings::default() };
    let pool = config(&[("shim-dead", dead.url()), ("shim-live", shim.url())]);
    let harness = Harness::start_with(disaggregated_fleet(), pool, settings).await?;
    let mut failed = 0;
    for _ in 0..REQUESTS {
        let response = harness.post(&chat(MODEL, false)).await?;
        failed += usize::from(response.status() != 200);
        response.bytes().await?;
    }
    let metrics = harness.metrics().await?;
    let retried = sample(&metrics, "continuum_shim_retries_total").unwrap_or(0.0);
    let refused = sample(&metrics, "continuum_shim_retries_refused_total").unwrap_or(0.0);
    assert_eq!(retried + refused, (REQUESTS / 2) as f64, "every other request started on the dead replica");
    assert!(refused > 0.0, "the budget ran out: {retried} retried");
    assert_eq!(refused, failed as f64, "each refused retry is a failed request");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_opens_after_failures_and_closes_when_the_replica_returns() -> anyhow::Result<()> {
    let refusing = RefusingPort::reserve()?;
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(3) };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", refusing.url())]), settings).await?;
    let state = r#"continuum_shim_replica_state{backend="shim-a"}"#;

    for _ in 0..2 {
        let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
        assert_eq!(
            (status, code.as_str()),
            (503, "disaggregated_decode_failed"),
            "the pool's only replica refuses connections"
        );
    }
    assert_eq!(sample(&harness.metrics().await?, state), Some(2.0), "open after two consecutive failures");
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (503, "shim_unavailable"), "an open breaker leaves no usable replica");

    let shim = StubShim::start_on(&refusing.release().to_string()).await?;
    eventually(Duration::from_secs(20), "the half-open probe to succeed", || async {
        harness.post(&chat(MODEL, false)).await.is_ok_and(|r| r.status() == 200)
    })
    .await?;
    assert_eq!(sample(&harness.metrics().await?, state), Some(0.0), "closed again");
    assert!(!shim.received().is_empty());
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_tries_at_most_the_attempt_bound_of_replicas() -> anyhow::Result<()> {
    let refusing = (0..MAX_ATTEMPTS + 2).map(|_| RefusingPort::reserve()).collect::<anyhow::Result<Vec<_>>>()?;
    let names: Vec<String> = (0..refusing.len()).map(|i| format!("dead-{i}")).collect();
    let pool: Vec<(&str, String)> =
        names.iter().map(String::as_str).zip(refusing.iter().map(RefusingPort::url)).collect();
    let harness = Harness::start(disaggregated_fleet(), config(&pool)).await?;
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (503, "disaggregated_decode_failed"));
    let retries = sample(&harness.metrics().await?, "continuum_shim_retries_total");
    assert_eq!(retries, Some((MAX_ATTEMPTS - 1) as f64), "the first attempt and MAX_ATTEMPTS - 1 retries");
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_that_never_answers_times_out_instead_of_hanging() -> anyhow::Result<()> {
    // Accepts connections and reads nothing, answers nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", silent.local_addr()?);
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            connections.push(socket);
        }
    });
    let timeout = Duration::from_millis(300);
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    let settings = DispatchSettings {
        buffered_timeout: timeout,
        stream_head_timeout: timeout,
        breaker,
        ..DispatchSettings::default()
    };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-silent", url)]), settings).await?;
    for stream in [false, true] {
        let (status, code) = error_of(harness.post(&chat(MODEL, stream)).await?).await?;
        assert_eq!((status, code.as_str()), (504, "disaggregated_decode_failed"), "stream={stream}");
    }
    // It answered nothing at all: its own failure, whatever the workers.
    let state = sample(&harness.metrics().await?, r#"continuum_shim_replica_state{backend="shim-silent"}"#);
    assert_eq!(state, Some(2.0), "open after two head timeouts with no answer between");
    assert!(harness.replica.ledger.is_empty());
    // And its alone: blamed on the pins, a hung shim would eject workers every other shim
    // reaches well.
    assert!(harness.replica.ledger.outliers().is_empty(), "no strike against the pinned workers");
    harness.stop().await;
    held.abort();
    Ok(())
}

/// A buffered exchange has one budget, the head's wait and the body's read together: a head
/// that comes late does not earn the body a budget of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_answer_must_arrive_whole_within_one_timeout_from_the_send() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Long enough that a runtime stalled by the machine's other tests does not bring the
    // body and the deadline due together.
    let timeout = Duration::from_secs(2);
    let slow = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", slow.local_addr()?);
    let served = tokio::spawn(async move {
        let Ok((mut socket, _)) = slow.accept().await else { return };
        let mut request = [0; 4096];
        let _ = socket.read(&mut request).await;
        // The head at 2/3 of the budget, the body at twice it: a deadline that fires late on a
        // loaded machine still fires before the body comes.
        tokio::time::sleep(timeout * 2 / 3).await;
        let _ =
            socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n").await;
        tokio::time::sleep(timeout * 4 / 3).await;
        let _ = socket.write_all(b"{}").await;
        tokio::time::sleep(timeout).await;
    });
    let settings = DispatchSettings { buffered_timeout: timeout, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-slow", url)]), settings).await?;
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (504, "disaggregated_decode_failed"));
    assert!(harness.replica.ledger.is_empty());
    harness.stop().await;
    served.abort();
    Ok(())
}

/// A buffered answer whose connection breaks after its head (sent only once generation is done)
/// is the shim's failure, or the network's: no strike against the workers that generated it,
/// and a shim that cuts every answer so opens its breaker, its heads notwithstanding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_broken_under_its_head_counts_against_the_shim_not_the_workers() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cutting = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", cutting.local_addr()?);
    let served = tokio::spawn(async move {
        while let Ok((mut socket, _)) = cutting.accept().await {
            let mut request = [0; 4096];
            let _ = socket.read(&mut request).await;
            let head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
            let _ = socket.write_all(head).await;
            let _ = socket.write_all(b"{\"id\":").await;
        }
    });
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-cutting", url)]), settings).await?;
    for _ in 0..2 {
        let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
        assert_eq!((status, code.as_str()), (502, "disaggregated_decode_failed"));
    }
    assert!(harness.replica.ledger.outliers().is_empty(), "no strike against the pinned workers");
    let state = sample(&harness.metrics().await?, r#"continuum_shim_replica_state{backend="shim-cutting"}"#);
    assert_eq!(state, Some(2.0), "open after two answers cut under their heads, one after the other");
    harness.stop().await;
    served.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_failing_its_liveness_probes_is_skipped_before_any_request_fails_and_returns_when_live()
-> anyhow::Result<()> {
    let (sick, well) = (StubShim::start().await?, StubShim::start().await?);
    let probe = ProbeSettings { interval: Duration::from_millis(50), timeout: Duration::from_millis(500) };
    let settings = DispatchSettings { probe, ..DispatchSettings::default() };
    let pool = config(&[("shim-sick", sick.url()), ("shim-well", well.url())]);
    let harness = Harness::start_with(disaggregated_fleet(), pool, settings).await?;
    let state = r#"continuum_shim_replica_state{backend="shim-sick"}"#;

    sick.set_live(false);
    eventually(Duration::from_secs(10), "the sick replica taken out by its probes", || async {
        harness.metrics().await.is_ok_and(|m| sample(&m, state) == Some(2.0))
    })
    .await?;
    for stream in [false, true, false, true] {
        let response = harness.post(&chat(MODEL, stream)).await?;
        assert_eq!(response.status(), 200);
        response.bytes().await?;
    }
    assert!(sick.received().is_empty(), "no request was sent to the replica its probes took out");
    assert_eq!(well.received().len(), 4);
    assert_eq!(sample(&harness.metrics().await?, "continuum_shim_retries_total"), Some(0.0), "nothing had to fail");

    sick.set_live(true);
    eventually(Duration::from_secs(10), "the replica back after a live probe", || async {
        harness.metrics().await.is_ok_and(|m| sample(&m, state) == Some(0.0))
    })
    .await?;
    for _ in 0..4 {
        harness.post(&chat(MODEL, false)).await?.bytes().await?;
    }
    assert!(!sick.received().is_empty(), "rotation uses the replica again");
    harness.stop().await;
    Ok(())
}

/// A probe reads its answer, so its connection goes back to the pool: probes every 50 ms
/// reuse one connection rather than open one each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_probes_reuse_their_connection() -> anyhow::Result<()> {
    let shim = StubShim::start().await?;
    // A probe past its timeout gives up its connection: a generous one, so that a loaded
    // machine's slow probe does not open a second.
    let probe = ProbeSettings { interval: Duration::from_millis(50), timeout: Duration::from_secs(5) };
    let settings = DispatchSettings { probe, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim-a", shim.url())]), settings).await?;
    eventually(Duration::from_secs(10), "five probes", || async { shim.probes().0 >= 5 }).await?;
    assert_eq!(shim.probes().1, 1, "{:?} (probes, connections): one connection for them all", shim.probes());
    harness.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_pinned_requests_keep_failing_is_skipped_by_the_replica_on_its_own() -> anyhow::Result<()> {
    const DEAD: u64 = 0x5eed_0001;
    const ALIVE: u64 = 0x5eed_0002;
    let shim = StubShim::start().await?;
    shim.fail_worker(DEAD);
    let fleet = vec![worker(DEAD, Role::Aggregated, MODEL, 0), worker(ALIVE, Role::Aggregated, MODEL, 0)];
    // The control plane never removes the dead worker here, as when it is unreachable.
    let harness = Harness::start(fleet, config(&[("shim", shim.url())])).await?;
    let mut answered = 0;
    for _ in 0..12 {
        let response = harness.post(&chat(MODEL, false)).await?;
        if response.status() == 200 {
            answered += 1;
        }
        response.bytes().await?;
    }
    let to_dead = shim
        .received()
        .iter()
        .filter(|r| r.header("x-dynamo-worker-instance-id") == Some(DEAD.to_string().as_str()))
        .count();
    assert_eq!(to_dead, EJECT_AFTER as usize, "after {EJECT_AFTER} failures the dead worker is skipped");
    assert_eq!(answered, 12 - to_dead, "every other request was served by the live worker");
    harness.stop().await;
    Ok(())
}

/// A hung worker sends no answer head for a buffered request (the frontend answers only once
/// generation is done): its timeouts make it a suspect like any failure, and say nothing
/// against the shim that serves every other worker well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_buffered_answers_never_come_is_skipped_and_the_shim_stays_closed() -> anyhow::Result<()> {
    const HUNG: u64 = 0x5eed_0003;
    const ALIVE: u64 = 0x5eed_0004;
    let shim = StubShim::start().await?;
    shim.hang_worker(HUNG);
    let fleet = vec![worker(HUNG, Role::Aggregated, MODEL, 0), worker(ALIVE, Role::Aggregated, MODEL, 0)];
    // A breaker that two failures in a row would open: the hung worker's timeouts must not.
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    // Long enough that no live worker's answer, on a loaded machine, comes after it.
    let settings =
        DispatchSettings { buffered_timeout: Duration::from_secs(3), breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(fleet, config(&[("shim", shim.url())]), settings).await?;
    let to_hung = || {
        let pinned = |r: &continuum_tests::shim_stub::Received| {
            r.header("x-dynamo-worker-instance-id") == Some(HUNG.to_string().as_str())
        };
        shim.received().iter().filter(|r| pinned(r)).count()
    };
    // A burst first: several requests wait on the hung worker at once, and time out in a row
    // while the shim answers the others.
    let burst = (0..6).map(|_| async { harness.post(&chat(MODEL, false)).await.map(|r| r.status()) });
    let mut timed_out = 0;
    for status in futures::future::join_all(burst).await {
        timed_out += usize::from(status? == 504);
    }
    assert!(timed_out >= EJECT_AFTER as usize, "the burst reached the hung worker {timed_out} times");
    assert_eq!(timed_out, to_hung(), "every other request was served by the live worker");
    // Its timeouts ejected it: the next requests all go to the live worker.
    for _ in 0..6 {
        assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200);
    }
    assert_eq!(to_hung(), timed_out, "nothing more reached the hung worker");
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim"}"#), Some(0.0), "closed");
    harness.stop().await;
    Ok(())
}

/// A client that gives up before its answer's head (its worker hung) ends the dispatch at once,
/// and is counted as nginx would log a 499; its send too, without blame on the shim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_its_answer_ends_its_dispatch_and_is_counted() -> anyhow::Result<()> {
    const HUNG: u64 = 0x5eed_0003;
    let shim = StubShim::start().await?;
    shim.hang_worker(HUNG);
    // One failure would open the breaker: were the client's leaving blamed on the shim, the
    // state below would say so.
    let breaker = BreakerSettings { failure_threshold: 1, ..BreakerSettings::default() };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let fleet = vec![worker(HUNG, Role::Aggregated, MODEL, 0)];
    let harness = Harness::start_with(fleet, config(&[("shim", shim.url())]), settings).await?;
    let mut received = shim.count();
    let body = chat(MODEL, false);
    let waiting = harness.post(&body);
    let gave_up = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::select! {
            _ = waiting => false,
            _ = received.wait_for(|n| *n == 1) => true,
        }
    });
    assert!(gave_up.await?, "the request reached the shim and waits on its hung worker");
    let ledger = &harness.replica.ledger;
    eventually(Duration::from_secs(10), "the abandoned dispatch to end", || async { ledger.is_empty() }).await?;
    // Counted as the connection's task ends, a moment after the dispatch.
    eventually(Duration::from_secs(10), "the abandoned request counted", || async {
        harness.metrics().await.is_ok_and(|m| sample(&m, "continuum_http_requests_abandoned_total") == Some(1.0))
    })
    .await?;
    let metrics = harness.metrics().await?;
    let left = r#"continuum_shim_attempts_total{backend="shim",outcome="client_left"}"#;
    assert_eq!(sample(&metrics, left), Some(1.0), "its send counted, as cut short by its client");
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim"}"#), Some(0.0), "no blame");
    harness.stop().await;
    Ok(())
}

/// A trial request whose client leaves before its answer says nothing of the replica: it hands
/// the trial to the next request instead of keeping the replica out for another cooldown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trial_whose_client_leaves_hands_the_trial_to_the_next_request() -> anyhow::Result<()> {
    use continuum_tests::shim_stub::Reply;
    let shim = StubShim::start().await?;
    // One failure opens the breaker for a minute; a live probe lets the next request through
    // as its trial (`Breaker::end_cooldown`) within the probe's 50 ms.
    let breaker = BreakerSettings { failure_threshold: 1, cooldown: Duration::from_secs(60) };
    let probe = ProbeSettings { interval: Duration::from_millis(50), timeout: Duration::from_secs(5) };
    let settings = DispatchSettings { breaker, probe, ..DispatchSettings::default() };
    let fleet = vec![worker(DECODE_ID, Role::Aggregated, MODEL, 0)];
    let harness = Harness::start_with(fleet, config(&[("shim", shim.url())]), settings).await?;
    let state = r#"continuum_shim_replica_state{backend="shim"}"#;
    shim.push(Reply::Fixed { status: axum::http::StatusCode::BAD_GATEWAY, content_type: None, body: "down".into() });
    assert_ne!(harness.post(&chat(MODEL, false)).await?.status(), 200, "the shim's gateway failure");
    eventually(Duration::from_secs(10), "a live probe to let a trial through", || async {
        harness.metrics().await.is_ok_and(|m| sample(&m, state) == Some(1.0))
    })
    .await?;

    // The trial hangs, and its client leaves.
    shim.push(Reply::Hang);
    let mut received = shim.count();
    let sent = *received.borrow();
    let body = chat(MODEL, false);
    let trial = harness.post(&body);
    let gave_up = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::select! {
            _ = trial => false,
            _ = received.wait_for(|n| *n > sent) => true,
        }
    });
    assert!(gave_up.await?, "the trial reached the shim and hangs");
    eventually(Duration::from_secs(10), "the abandoned trial counted", || async {
        let left = r#"continuum_shim_attempts_total{backend="shim",outcome="client_left"}"#;
        harness.metrics().await.is_ok_and(|m| sample(&m, left) == Some(1.0))
    })
    .await?;

    // Well within the cooldown, the next request is the trial, and its answer closes the breaker.
    let next = harness.post(&chat(MODEL, false)).await?;
    assert_eq!(next.status(), 200, "the next request went through as the trial");
    assert_eq!(sample(&harness.metrics().await?, state), Some(0.0), "closed by its answer");
    harness.stop().await;
    Ok(())
}

/// Unpinned requests (disaggregated serving off) follow the same rule: long generations timing
/// out together say nothing against a backend that answered other requests meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpinned_head_timeouts_of_a_backend_answering_others_leave_its_breaker_closed() -> anyhow::Result<()> {
    use continuum_tests::shim_stub::Reply;
    let shim = StubShim::start().await?;
    let mut config = config(&[("shim", shim.url())]);
    config.disaggregated_serving.enabled = false;
    config.backends[0].models = vec![MODEL.into()];
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    // Long enough that the request answered meanwhile is, on a loaded machine, before the two
    // hung ones time out.
    let settings =
        DispatchSettings { buffered_timeout: Duration::from_secs(3), breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config, settings).await?;
    shim.push(Reply::Hang);
    shim.push(Reply::Hang);
    let long = async {
        let requests = (0..2).map(|_| async { harness.post(&chat(MODEL, false)).await.map(|r| r.status()) });
        futures::future::join_all(requests).await
    };
    let answered_meanwhile = async {
        shim.count().wait_for(|n| *n >= 2).await?;
        harness.post(&chat(MODEL, false)).await.map(|r| r.status())
    };
    let (long, meanwhile) = tokio::join!(long, answered_meanwhile);
    assert_eq!(meanwhile?, 200);
    for status in long {
        assert_eq!(status?, 504);
    }
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim"}"#), Some(0.0), "closed");
    assert_eq!(harness.post(&chat(MODEL, false)).await?.status(), 200);
    harness.stop().await;
    Ok(())
}

/// A proxy in front of a shim answering 502 or 504 could not reach it: the shim's failure,
/// which opens its breaker, and not the pinned workers'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_502_counts_against_the_shim_not_its_workers() -> anyhow::Result<()> {
    use continuum_tests::shim_stub::Reply;
    let shim = StubShim::start().await?;
    let breaker = BreakerSettings { failure_threshold: 2, cooldown: Duration::from_secs(60) };
    let settings = DispatchSettings { breaker, ..DispatchSettings::default() };
    let harness = Harness::start_with(disaggregated_fleet(), config(&[("shim", shim.url())]), settings).await?;
    for status in [axum::http::StatusCode::BAD_GATEWAY, axum::http::StatusCode::GATEWAY_TIMEOUT] {
        shim.push(Reply::Fixed { status, content_type: None, body: "<html>upstream down</html>".into() });
        let (answered, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
        assert_eq!((answered, code.as_str()), (502, "disaggregated_decode_failed"), "{status}");
    }
    // Open now: a third request reaches no replica, and no attempt is counted for it.
    let (status, code) = error_of(harness.post(&chat(MODEL, false)).await?).await?;
    assert_eq!((status, code.as_str()), (503, "shim_unavailable"));
    let metrics = harness.metrics().await?;
    assert_eq!(sample(&metrics, r#"continuum_shim_replica_state{backend="shim"}"#), Some(2.0), "open");
    assert!(harness.replica.ledger.outliers().is_empty(), "no strike against the pinned workers");
    let attempts: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("continuum_shim_attempts_total{"))
        .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    let gateway = r#"continuum_shim_attempts_total{backend="shim",outcome="gateway_failure"}"#;
    assert_eq!((sample(&metrics, gateway), attempts), (Some(2.0), 2.0), "each send counted by what came back");
    harness.stop().await;
    Ok(())
}
