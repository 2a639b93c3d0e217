//! Gauges that mirror published state: they follow the fleet publisher and the discovery
//! registry, so the code that changes state never has to remember to update them.

use std::sync::Arc;

use continuum_proto::model::Role;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::discovery::Topic;
use crate::fleet::FleetState;
use crate::metrics::Metrics;
use crate::sources::Generation;

/// `continuum_fleet_version` and `continuum_fleet_workers`.
pub async fn follow_fleet(states: watch::Receiver<Arc<FleetState>>, metrics: Metrics, cancel: CancellationToken) {
    follow(states, cancel, |state| {
        metrics.fleet_version.set(gauge(state.version()));
        metrics.fleet_workers.set(gauge(state.view().workers().len()));
    })
    .await;
}

/// `continuum_dynamo_workers{role}`, `continuum_dynamo_publishers{topic}` and
/// `continuum_dynamo_registry_generation`.
pub async fn follow_registry(
    generations: watch::Receiver<Arc<Generation>>,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    follow(generations, cancel, |current| {
        let workers = &current.fleet.workers;
        let role = |role: Role| workers.iter().filter(|w| w.excluded.is_none() && w.worker.role == role).count();
        for r in [Role::Prefill, Role::Decode, Role::Aggregated, Role::Unknown] {
            metrics.registry_workers.with_label_values(&[r.as_str()]).set(gauge(role(r)));
        }
        let excluded = workers.iter().filter(|w| w.excluded.is_some()).count();
        metrics.registry_workers.with_label_values(&["excluded"]).set(gauge(excluded));
        for topic in [Topic::KvMetrics, Topic::KvEvents] {
            let n = current.fleet.publishers.iter().filter(|p| p.topic == topic).count();
            metrics.registry_publishers.with_label_values(&[topic.as_str()]).set(gauge(n));
        }
        metrics.registry_generation.set(gauge(current.generation));
    })
    .await;
}

async fn follow<T>(mut rx: watch::Receiver<T>, cancel: CancellationToken, mut update: impl FnMut(&T)) {
    loop {
        update(&rx.borrow_and_update());
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = rx.changed() => if changed.is_err() { return },
        }
    }
}

fn gauge(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}
