//! The replica's HTTP surface: the traffic ingresses ([`crate::ingress`]), health, readiness
//! with the fleet view's detail, and metrics.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;

use crate::dispatch::Dispatcher;
use crate::fleet::{DispatchReporter, FleetHandle, MatchesClient};
use crate::ingress;
use crate::ingress::KvRouting;
use crate::kv::render::Renderer;
use crate::metrics::Metrics;
use crate::routing::picker::{DispatchLedger, KvAwarePicker, Picker};
use crate::server::Draining;

#[derive(Debug, Clone)]
pub struct AppState {
    pub fleet: Arc<FleetHandle>,
    pub metrics: Metrics,
    pub picker: Arc<dyn Picker>,
    /// The pins this replica has in flight; the picker reads it, dispatch records and ends them.
    pub ledger: Arc<DispatchLedger>,
    /// Where pins and their ends are reported for fleet-wide accounting.
    pub reporter: Arc<DispatchReporter>,
    pub dispatcher: Arc<Dispatcher>,
    /// KV-aware selection, used while the fleet's configuration turns it on (`dynamo.kv.enabled`).
    pub kv: Arc<KvSelection>,
    /// Set once the replica starts shutting down: readiness fails from then on.
    pub draining: Draining,
}

#[cfg(test)]
impl AppState {
    /// A replica's state with no fleet view and a control plane that answers nothing.
    pub(crate) fn for_tests() -> Self {
        use std::time::Duration;

        use crate::dispatch::DispatchSettings;
        use crate::fleet::FleetClientConfig;
        use crate::routing::picker::LoadBasedPicker;

        let metrics = Metrics::new().expect("metrics");
        let ledger = Arc::new(DispatchLedger::new());
        let matches =
            MatchesClient::new(&FleetClientConfig::new("http://127.0.0.1:9", "test"), Duration::from_millis(10))
                .expect("url");
        let kv = KvSelection::new(matches, &ledger, &metrics);
        AppState {
            fleet: Arc::new(FleetHandle::default()),
            picker: Arc::new(LoadBasedPicker::new(Arc::clone(&ledger), metrics.selections.clone())),
            ledger,
            reporter: Arc::new(DispatchReporter::new(metrics.dispatch_reports_dropped.clone())),
            dispatcher: Arc::new(Dispatcher::new(DispatchSettings::default(), metrics.clone())),
            kv: Arc::new(kv),
            metrics,
            draining: Default::default(),
        }
    }
}

/// The KV term's machinery and the picker that scores with it.
#[derive(Debug)]
pub struct KvSelection {
    pub routing: KvRouting,
    pub picker: KvAwarePicker,
}

impl KvSelection {
    /// Asking the control plane's index through `matches`, scoring on `ledger`'s dispatches
    /// and counting on `metrics`.
    pub fn new(matches: MatchesClient, ledger: &Arc<DispatchLedger>, metrics: &Metrics) -> Self {
        Self {
            routing: KvRouting::new(
                matches,
                Renderer::default(),
                metrics.kv_artifacts.clone(),
                &metrics.kv_term_seconds,
            ),
            picker: KvAwarePicker::new(Arc::clone(ledger), metrics.selections.clone(), metrics.kv_selections.clone()),
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let routes = ingress::routes()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics));
    ingress::no_endpoint(routes).with_state(state)
}

/// Ready once a fleet view is held, even a stale one: last-known-good keeps routing while the
/// control plane is away. The detail says how old it is. A draining replica is not ready, so
/// load balancers stop choosing it while it finishes what it has.
async fn readyz(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let status = state.fleet.status(Instant::now());
    let draining = state.draining.is_on();
    let reason = if draining {
        Some("draining: the replica is shutting down")
    } else if status.version.is_none() {
        Some("no fleet snapshot from the control plane yet")
    } else {
        None
    };
    let body = json!({
        "ready": reason.is_none(),
        "draining": draining,
        "fleet": {
            "version": status.version,
            "workers": status.workers,
            "connected": status.connected,
            "snapshot_age_seconds": status.snapshot_age.map(|a| a.as_secs_f64()),
        },
        "reason": reason,
    });
    let code = if reason.is_none() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, axum::Json(body))
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    if let Some(view) = state.fleet.view() {
        state.dispatcher.export_health(view.config());
    }
    let text = state.metrics.render(state.fleet.status(Instant::now()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}
