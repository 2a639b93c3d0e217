use continuum_proto::model::{Backend, LoadKey, ShimPool, WorkerKey};
use continuum_proto::view::FleetView;
use prometheus::IntCounter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::fleet::DispatchReporter;
use crate::routing::picker::{DispatchLedger, EJECT_AFTER, Pin, PromptChain, Reason};

/// A backend that answers every request on its first connection with a small 200.
async fn answering_backend() -> std::io::Result<ShimReplica> {
    answering_with("{}").await
}

/// A backend that answers every request it reads with `body`.
async fn answering_with(body: &'static str) -> std::io::Result<ShimReplica> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let Ok((mut socket, _)) = listener.accept().await else { return };
        let mut read = vec![0; 64 * 1024];
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        while socket.read(&mut read).await.is_ok_and(|n| n > 0) {
            if socket.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    Ok(replica("unified", &url))
}

fn replica(name: &str, url: &str) -> ShimReplica {
    ShimReplica::for_tests(name, url)
}

/// A pinned plan to `replicas`, recorded in a ledger of its own, falling through to
/// `unified` (never resent there on failure).
fn pinned_plan(replicas: &[ShimReplica], unified: Option<ShimReplica>) -> Plan {
    pinned_plan_in(&Arc::new(DispatchLedger::new()), replicas, unified)
}

/// [`pinned_plan`], recorded in `ledger`.
fn pinned_plan_in(ledger: &Arc<DispatchLedger>, replicas: &[ShimReplica], unified: Option<ShimReplica>) -> Plan {
    let reporter = Arc::new(DispatchReporter::new(IntCounter::new("dropped", "dropped").expect("counter")));
    let view = FleetView::new(1, [], [], Arc::new(DataPlaneConfig::default())).expect("view");
    let selection = Selection {
        namespace: "dynamo".into(),
        model: "tiny".into(),
        decode: Pin { worker: WorkerKey::new("dynamo", 2), dp_rank: None },
        prefill: Some(Pin { worker: WorkerKey::new("dynamo", 1), dp_rank: None }),
        decode_reason: Reason::Load,
        prefill_reason: Reason::Load,
        cached_tokens: 0,
    };
    let dispatch = DispatchEnd::record(ledger, &reporter, &view, &selection, 10, &PromptChain::default(), true);
    let fallback =
        unified.map(|unified| Box::new(Fallback { replicas: [unified].into(), body: None, on_failure: false }));
    let route = Route::Pinned(Pinned { selection, replicas: replicas.into(), fallback, dispatch });
    Plan {
        body: OutboundBody::for_tests(b"{}"),
        stream: false,
        disclose: false,
        tenant: None,
        trace: Vec::new(),
        route,
    }
}

/// A dispatcher whose one shim replica's breaker has opened (the replica is never dialled:
/// the breaker turns requests away first), and when it opened.
fn with_open_breaker() -> anyhow::Result<(Dispatcher, ShimReplica, Instant)> {
    let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
    let shim = replica("shim", "http://127.0.0.1:9");
    let now = Instant::now();
    for _ in 0..BreakerSettings::default().failure_threshold {
        dispatcher.health.at(&shim.name, &shim.url).failed((now, now));
    }
    Ok((dispatcher, shim, now))
}

/// Two requests picked in the same namespace while its one replica's breaker lets a
/// single trial through: the one that loses the trial reached no shim and no worker, so it
/// falls through to the model's unified backends, as selection would have sent it a
/// moment later, or is refused as a shim unavailable: not a decode failure.
#[tokio::test]
async fn a_pinned_request_no_replica_would_take_falls_through_and_fails_no_decode() -> anyhow::Result<()> {
    let (dispatcher, shim, now) = with_open_breaker()?;
    dispatcher.record_probe(&shim.name, &shim.url, true);
    assert!(dispatcher.usable(&shim, now), "its trial is open to whichever request comes first");
    assert!(dispatcher.health.at(&shim.name, &shim.url).admit(now), "another request took the trial");

    let response = dispatcher.run(pinned_plan(std::slice::from_ref(&shim), Some(answering_backend().await?))).await;
    assert_eq!(response.map(|r| r.status()).ok(), Some(StatusCode::OK), "the unified backend answered");
    let refused = dispatcher.run(pinned_plan(std::slice::from_ref(&shim), None)).await;
    assert!(matches!(refused, Err(DispatchError::NoShim)), "{refused:?}");

    let counted = |vector: &prometheus::IntCounterVec, label: &str| vector.with_label_values(&[label]).get();
    assert_eq!(counted(&dispatcher.metrics.disaggregated_errors, ErrorPhase::Decode.as_str()), 0);
    assert_eq!(
        counted(&dispatcher.metrics.disaggregated_requests, RoutingPath::Unified.as_str()),
        1,
        "the refused one went nowhere"
    );
    assert_eq!(counted(&dispatcher.metrics.disaggregated_requests, RoutingPath::Disaggregated.as_str()), 0);
    Ok(())
}

/// A pinned request whose send failed has ended its dispatch before it falls through to
/// the unified backends: the pinned workers do not carry it while another backend takes
/// it, for as long as that answer takes.
#[tokio::test]
async fn a_pinned_dispatch_that_failed_ends_before_its_fall_through() -> anyhow::Result<()> {
    let (dispatcher, shim, _) = with_open_breaker()?;
    // A unified backend that says when the request reached it, and answers when told.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let unified = replica("unified", &format!("http://{}", listener.local_addr()?));
    let (reached, mut heard) = tokio::sync::mpsc::channel(1);
    let answer = Arc::new(tokio::sync::Notify::new());
    let told = Arc::clone(&answer);
    tokio::spawn(async move {
        let Ok((mut socket, _)) = listener.accept().await else { return };
        let mut read = vec![0; 64 * 1024];
        if socket.read(&mut read).await.is_ok_and(|n| n > 0) {
            let _ = reached.send(()).await;
            told.notified().await;
            let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
            let _ = socket.write_all(answer.as_bytes()).await;
        }
    });
    let ledger = Arc::new(DispatchLedger::new());
    let plan = pinned_plan_in(&ledger, std::slice::from_ref(&shim), Some(unified));
    assert_eq!(ledger.len(), 1, "recorded when picked");
    let run = tokio::spawn(async move { dispatcher.run(plan).await.map(|response| response.status()) });
    heard.recv().await.expect("the unified backend was reached");
    assert_eq!(ledger.len(), 0, "the pinned dispatch ended before the unified backend took the request");
    answer.notify_one();
    assert_eq!(run.await?.ok(), Some(StatusCode::OK));
    Ok(())
}

/// A buffered answer's dispatch ends once the answer is written (its body dropped), as a
/// stream's ends with its last event, and its usage calibrates the estimate then: the
/// ledger's and the report's work for the end follows the client's answer.
#[tokio::test]
async fn a_buffered_answers_dispatch_ends_once_the_answer_is_written() -> anyhow::Result<()> {
    use http_body_util::BodyExt;
    let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
    let usage = r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1}}"#;
    let shim = answering_with(usage).await?;
    let ledger = Arc::new(DispatchLedger::new());
    let mut plan = pinned_plan_in(&ledger, std::slice::from_ref(&shim), None);
    let Route::Pinned(Pinned { dispatch, .. }) = &mut plan.route else { unreachable!("a pinned plan") };
    dispatch.sized_by_estimate("tiny", 10);

    let response = dispatcher.run(plan).await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(ledger.len(), 1, "answered, not yet written: the dispatch still loads its workers");
    assert_eq!(ledger.prompt_sizes().factor("tiny"), 1.0, "nothing learnt before the answer is written");

    let written = response.into_body().collect().await?.to_bytes();
    assert_eq!(written, usage.as_bytes());
    assert_eq!(ledger.len(), 0, "the dispatch ended with its written body");
    let learnt = ledger.prompt_sizes().factor("tiny");
    assert!(learnt > 1.0, "the usage counted four times the estimate: {learnt}");
    Ok(())
}

/// A shim replica that answers every request, on every connection, with 1.6.1's generic
/// 500: a frontend that lost its workers while its `/live` still answers. With `others`,
/// the pinned ranks answer other requests (through other replicas) as each one arrives.
async fn failing_every_pin(others: Option<Arc<DispatchLedger>>) -> std::io::Result<ShimReplica> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let others = others.clone();
            tokio::spawn(async move {
                let body = r#"{"message":"Failed to generate completions","type":"Internal Server Error","code":500}"#;
                let answer = format!(
                    "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let mut read = vec![0; 64 * 1024];
                while socket.read(&mut read).await.is_ok_and(|n| n > 0) {
                    if let Some(ledger) = &others {
                        ledger.outliers().answered(pinned_ranks().iter(), Instant::now());
                    }
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(replica("broken", &url))
}

/// The ranks [`pinned_plan`] pins.
fn pinned_ranks() -> [LoadKey; 2] {
    [1, 2].map(|id| Pin { worker: WorkerKey::new("dynamo", id), dp_rank: None }.rank_key())
}

/// Pinned failures through a replica whose workers answer other requests meanwhile
/// (through other replicas) are not theirs: a frontend that lost its workers must not eject
/// healthy ones every other replica serves. The same failures while the workers answer
/// nothing else are theirs, and eject them.
#[tokio::test]
async fn pinned_failures_eject_no_worker_that_answers_others_meanwhile() -> anyhow::Result<()> {
    for (workers_answer_others, paired) in [(true, true), (true, false), (false, true), (false, false)] {
        let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
        let ledger = Arc::new(DispatchLedger::new());
        let broken = failing_every_pin(workers_answer_others.then(|| Arc::clone(&ledger))).await?;
        for _ in 0..EJECT_AFTER {
            let mut plan = pinned_plan_in(&ledger, std::slice::from_ref(&broken), None);
            if let Route::Pinned(Pinned { selection, .. }) = &mut plan.route
                && !paired
            {
                // An aggregated worker's pin: the rank alone.
                selection.prefill = None;
            }
            let failed = dispatcher.run(plan).await.map(|response| response.status());
            assert!(!failed.as_ref().is_ok_and(StatusCode::is_success), "{failed:?}");
        }
        let ejected = ledger.outliers().any_ejected(Instant::now());
        assert_eq!(ejected, !workers_answer_others, "answering others: {workers_answer_others}, paired: {paired}");
    }
    Ok(())
}

/// Backend `pooled` in the `dynamo` namespace's shim pool, and `unified` outside every pool.
fn pooled_and_unified() -> DataPlaneConfig {
    let backend = |name: &str| Backend { name: name.into(), url: format!("http://{name}:8000"), models: vec![] };
    DataPlaneConfig {
        backends: vec![backend("pooled"), backend("unified")],
        shim_pools: vec![ShimPool { namespace: "dynamo".into(), backends: vec!["pooled".into()] }],
        ..DataPlaneConfig::default()
    }
}

#[test]
fn exporting_the_gauge_keeps_the_breakers_of_backends_outside_every_pool() -> anyhow::Result<()> {
    let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
    let config = pooled_and_unified();
    let now = Instant::now();
    for name in ["pooled", "unified", "removed"] {
        for _ in 0..BreakerSettings::default().failure_threshold {
            dispatcher.health.at(name, &format!("http://{name}:8000")).failed((now, now));
        }
    }
    dispatcher.export_health(&config);
    assert!(!dispatcher.health.at("unified", "http://unified:8000").usable(now), "its open breaker stands");
    assert!(!dispatcher.health.at("pooled", "http://pooled:8000").usable(now));
    assert!(dispatcher.health.at("removed", "http://removed:8000").usable(now), "a backend gone is forgotten");
    let families = prometheus::core::Collector::collect(&dispatcher.metrics.shim_replica_state);
    let on_gauge: Vec<&str> =
        families.iter().flat_map(|f| f.get_metric()).flat_map(|m| m.get_label()).map(|l| l.value()).collect();
    assert_eq!(on_gauge, ["pooled"], "only pooled replicas are on the gauge");
    Ok(())
}

#[test]
fn exporting_the_health_drops_the_attempt_counts_of_backends_no_longer_configured() -> anyhow::Result<()> {
    let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
    let config = pooled_and_unified();
    let attempts = &dispatcher.metrics.shim_attempts;
    for (name, outcome) in
        [("pooled", "success"), ("unified", "timeout"), ("removed", "success"), ("removed", "broken")]
    {
        attempts.with_label_values(&[name, outcome]).inc();
    }
    dispatcher.export_health(&config);
    let mut kept = series_labels(attempts);
    kept.sort();
    assert_eq!(kept, [vec!["pooled".to_string(), "success".into()], vec!["unified".into(), "timeout".into()]]);
    assert_eq!(attempts.with_label_values(&["unified", "timeout"]).get(), 1, "a configured backend's count stands");
    Ok(())
}

/// The gauge is set in place, never emptied (a scrape gathering meanwhile would find no
/// series): a pool's replica leaves it when the configuration drops it, and only then.
#[test]
fn exporting_the_gauge_again_keeps_the_replicas_still_pooled_and_drops_the_rest() -> anyhow::Result<()> {
    let dispatcher = Dispatcher::new(DispatchSettings::default(), Metrics::new()?);
    let backend = |name: &str| Backend { name: name.into(), url: format!("http://{name}:8000"), models: vec![] };
    let pooled = |names: &[&str]| DataPlaneConfig {
        backends: names.iter().map(|name| backend(name)).collect(),
        shim_pools: vec![ShimPool {
            namespace: "dynamo".into(),
            backends: names.iter().map(|n| n.to_string()).collect(),
        }],
        ..DataPlaneConfig::default()
    };
    let series = || -> Vec<(String, i64)> {
        let families = prometheus::core::Collector::collect(&dispatcher.metrics.shim_replica_state);
        let metrics = families.iter().flat_map(|f| f.get_metric().to_vec()).collect::<Vec<_>>();
        metrics.iter().map(|m| (m.get_label()[0].value().to_string(), m.get_gauge().get_value() as i64)).collect()
    };
    let now = Instant::now();
    for _ in 0..BreakerSettings::default().failure_threshold {
        dispatcher.health.at("b", "http://b:8000").failed((now, now));
    }
    dispatcher.export_health(&pooled(&["a", "b"]));
    assert_eq!(series(), [("a".to_string(), 0), ("b".to_string(), 2)]);
    dispatcher.export_health(&pooled(&["b", "c"]));
    assert_eq!(series(), [("b".to_string(), 2), ("c".to_string(), 0)], "a left the pool, c joined it");
    Ok(())
}
