//! The replica's HTTP surface: health, readiness with the fleet view's detail, and metrics.
//! Traffic ingresses join this router in the routing module.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;

use crate::fleet::FleetHandle;
use crate::metrics::Metrics;

#[derive(Debug, Clone)]
pub struct AppState {
    pub fleet: Arc<FleetHandle>,
    pub metrics: Metrics,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Ready once a fleet view is held, even a stale one: last-known-good keeps routing while the
/// control plane is away. The detail says how old it is.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let status = state.fleet.status(Instant::now());
    let ready = status.version.is_some();
    let body = json!({
        "ready": ready,
        "fleet": {
            "version": status.version,
            "workers": status.workers,
            "connected": status.connected,
            "snapshot_age_seconds": status.snapshot_age.map(|a| a.as_secs_f64()),
        },
        "reason": (!ready).then_some("no fleet snapshot from the control plane yet"),
    });
    let code = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, axum::Json(body))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let text = state.metrics.render(state.fleet.status(Instant::now()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}
