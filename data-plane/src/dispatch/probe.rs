//! Active health checks of the shim replicas: every [`PROBE_INTERVAL`], a `GET /live` to each
//! replica of the configuration in force, all at once, each bounded by [`PROBE_TIMEOUT`]. Only a
//! 2xx answer is live. Verdicts go to the replicas' health beside the passive breakers, so a
//! replica that stops answering is skipped before a request has to fail on it, and one that
//! comes back is used again without waiting for a breaker cooldown.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, Request, Uri};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::Dispatcher;
use crate::fleet::FleetHandle;

/// Dynamo's frontend answers liveness here (200 `{"status":"live"}`).
pub const PROBE_PATH: &str = "/live";
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeSettings {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for ProbeSettings {
    fn default() -> Self {
        Self { interval: PROBE_INTERVAL, timeout: PROBE_TIMEOUT }
    }
}

/// Probes until `cancel` fires.
pub async fn run(dispatcher: Arc<Dispatcher>, fleet: Arc<FleetHandle>, cancel: CancellationToken) {
    let settings = dispatcher.settings().probe;
    let mut every = tokio::time::interval(settings.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = every.tick() => {}
        }
        let Some(view) = fleet.view() else { continue };
        // Every pooled replica once, by name (the health key), with the URL in force.
        let replicas: BTreeMap<String, String> = dispatcher
            .pools(view.config())
            .iter()
            .flat_map(|(_, replicas)| replicas.iter().map(|r| (r.name.clone(), r.url.clone())))
            .collect();
        dispatcher.clear_probes_except(|name| replicas.contains_key(name));
        let probes = replicas.into_iter().map(|(name, url)| {
            let dispatcher = Arc::clone(&dispatcher);
            async move {
                let live = probe(&dispatcher, &url, settings.timeout).await;
                dispatcher.record_probe(&name, &url, live);
            }
        });
        futures::future::join_all(probes).await;
    }
}

async fn probe(dispatcher: &Dispatcher, base: &str, timeout: Duration) -> bool {
    let Ok(uri) = format!("{}{PROBE_PATH}", base.trim_end_matches('/')).parse::<Uri>() else {
        return false;
    };
    let Ok(request) = Request::builder().method(Method::GET).uri(uri).body(Bytes::new()) else {
        return false;
    };
    dispatcher.send_probe(request, timeout).await.is_ok_and(|status| status.is_success())
}
