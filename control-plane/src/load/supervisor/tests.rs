//! Stopping subscriptions: concurrently, each within the grace.

use super::*;
use crate::config::LoadTransport;
use crate::discovery::PublisherKey;
use crate::discovery::Topic;

fn running(id: u64, task: JoinHandle<()>, cancel: CancellationToken) -> Running {
    let gauge = prometheus::IntGaugeVec::new(prometheus::Opts::new("g", "g"), &["state", "transport"]).unwrap();
    let key = PublisherKey { namespace: "dynamo".into(), publisher_id: id };
    let status = Arc::new(SubscriptionStatus::new("kv_metrics", key, None, LoadTransport::Direct, gauge));
    let publisher = Publisher {
        publisher_id: id,
        namespace: "dynamo".into(),
        component: None,
        endpoint: None,
        topic: Topic::KvMetrics,
        worker: None,
        dp_rank: None,
        address: String::new(),
    };
    Running { publisher, status, cancel, task, since: std::time::Instant::now() }
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
