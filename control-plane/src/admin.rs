//! The control plane's admin HTTP: `/healthz`, `/readyz`, `/metrics` (open, for probes and
//! scrapers) and `/admin/…` (behind `admin.token` when one is configured).
//!
//! Nothing here exports an internal address or a raw model card.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use continuum_proto::log_budget::{LINES_PER_MINUTE, LogBudget};
use continuum_proto::model::{LoadKey, LoadSample};
use prometheus::IntCounter;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::bearer;
use crate::discovery::{DiscoveredWorker, Topic};
use crate::fleet::FleetPublisher;
use crate::grpc::Replicas;
use crate::kv::KvView;
use crate::listen::Peer;
use crate::load::{LoadView, Reading, SubscriptionStatus, transport_label};
use crate::metrics::Metrics;
use crate::sources::Registry;

#[derive(Debug, Clone)]
pub struct AdminState {
    pub registry: Registry,
    pub publisher: FleetPublisher,
    pub replicas: Replicas,
    pub metrics: Metrics,
    /// What a configuration reload may change.
    pub settings: watch::Receiver<AdminSettings>,
    /// The load store and the running load subscriptions.
    pub load: LoadView,
    /// The KV index and the running kv-events subscriptions.
    pub kv: KvView,
}

/// The reloadable part of the admin API's state.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// Bearer token for `/admin/…`; `None` leaves the admin API open (validation warns).
    pub token: Option<bearer::Token>,
    /// Which discovery source feeds the fleet, for the workers listing.
    pub source: &'static str,
    pub namespaces: Arc<[String]>,
    /// Discovery's etcd resyncs when the fleet was last emptied (at start or by a reload that
    /// reset it): an etcd fleet is ready once a resync follows.
    pub resyncs_when_emptied: u64,
}

pub fn router(state: AdminState) -> Router {
    // Every `/admin/…` call is behind the token and audited, an unknown path's too: a probe
    // of paths that do not exist is a call worth a line.
    let admin = Router::new()
        .route("/dynamo/workers", get(workers))
        .route("/dynamo/loads", get(loads))
        .route("/fleet/replicas", get(replicas))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(middleware::from_fn_with_state(state.clone(), require_token));
    // Audited outside the nest, where the path is still whole.
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .nest("/admin", admin)
        .layer(middleware::from_fn(audit))
        .with_state(state)
}

/// Renders of the whole fleet (`/metrics`, the workers and loads listings) at once: each
/// copies every worker or sample and builds its text on a runtime thread, and the loads copy
/// holds the lock every kv_metrics sample takes. The admin listener's 256 connections asking
/// together wait their turn rather than take every core and gigabytes between them.
static RENDERS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

/// A turn to render; the semaphore is never closed.
async fn render_turn() -> Option<tokio::sync::SemaphorePermit<'static>> {
    RENDERS.acquire().await.ok()
}

async fn require_token(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.settings.borrow().token else { return next.run(request).await };
    let presented = request.headers().get(header::AUTHORIZATION).map(|value| value.as_bytes());
    match bearer::accepts(presented, &expected) {
        true => next.run(request).await,
        false => {
            state.metrics.admin_unauthenticated.inc();
            refuse_unauthenticated()
        }
    }
}

/// One line per admin call, under target `continuum::audit`: who called (the peer's address),
/// what (method and path), the outcome (status: 401 a token refused) and how long it took.
/// Never a credential: no header is logged.
async fn audit(request: Request, next: Next) -> Response {
    // Probes and scrapes are not admin calls.
    if !is_admin_path(request.uri().path()) {
        return next.run(request).await;
    }
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let peer = request.extensions().get::<Peer>().map_or_else(|| "unknown".to_owned(), |peer| peer.0.to_string());
    let started = Instant::now();
    let response = next.run(request).await;
    let status = response.status();
    let millis = started.elapsed().as_secs_f64() * 1000.0;
    // A path is the caller's to choose, up to the head's bound: each line shows the start of it.
    let path = &path[..path.floor_char_boundary(MAX_PATH_LOGGED)];
    let status_code = status.as_u16();
    if status != StatusCode::UNAUTHORIZED {
        tracing::info!(target: "continuum::audit", %method, path, %peer, status = status_code, millis, "admin call");
        return response;
    }
    // A refused call needs no credential: whoever reaches the port can make them at will. A
    // few a minute are kept, and the next line says how many were held back.
    static REFUSED: LogBudget = LogBudget::per_minute(LINES_PER_MINUTE);
    if let Some(held_back) = REFUSED.admit() {
        tracing::info!(target: "continuum::audit", %method, path, %peer, status = status_code, millis, held_back, "admin call");
    }
    response
}

/// The most of an admin call's path its audit line shows.
const MAX_PATH_LOGGED: usize = 256;

fn is_admin_path(path: &str) -> bool {
    path == "/admin" || path.starts_with("/admin/")
}

fn refuse_unauthenticated() -> Response {
    let body = json!({"error": {"code": "unauthenticated", "message": "send Authorization: Bearer <admin.token>"}});
    (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], axum::Json(body)).into_response()
}

/// Whether discovery has produced a full view since the fleet was last emptied, at start or by
/// a reload that reset it (immediately for `static` and the simulator): until then a replica
/// would be handed an empty fleet. `/readyz` and the Fleet service's Watch both ask it.
#[derive(Clone, Debug)]
pub struct Seeded {
    settings: watch::Receiver<AdminSettings>,
    resyncs: IntCounter,
}

impl Seeded {
    pub fn new(settings: watch::Receiver<AdminSettings>, metrics: &Metrics) -> Self {
        Self { settings, resyncs: metrics.discovery_events.with_label_values(&["resync"]) }
    }

    pub fn check(&self) -> bool {
        let settings = self.settings.borrow();
        settings.source != "etcd" || self.resyncs.get() > settings.resyncs_when_emptied
    }
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    let current = state.publisher.current();
    let source = state.settings.borrow().source;
    let seeded = Seeded::new(state.settings.clone(), &state.metrics).check();
    let code = if seeded { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({
        "ready": seeded,
        "discovery": {"source": source, "connected": state.metrics.discovery_connected.get() == 1},
        "fleet": {"version": current.version(), "workers": current.view().workers().len()},
        "replicas": state.replicas.list().len(),
    });
    (code, axum::Json(body))
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    let _turn = render_turn().await;
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}

async fn workers(State(state): State<AdminState>) -> impl IntoResponse {
    let _turn = render_turn().await;
    let current = state.registry.current();
    let settings = state.settings.borrow().clone();
    let fleet = &current.fleet;
    let workers: Vec<Value> = fleet.workers.iter().map(worker_json).collect();
    let publishers = |topic| fleet.publishers.iter().filter(|p| p.topic == topic).count();
    // What the source can tell: etcd and the simulator declare capacities and publish kv_metrics; a static
    // fleet lists capacities but publishes no load; with discovery off there is nothing.
    let (load, capacity) = match settings.source {
        "etcd" | "simulator" => (true, true),
        "static" => (false, true),
        _ => (false, false),
    };
    axum::Json(json!({
        "enabled": settings.source != "disabled",
        // As `/readyz` says it: etcd while its watches run, a static fleet and the simulator
        // while served, nothing with discovery off.
        "connected": state.metrics.discovery_connected.get() == 1,
        "source": settings.source,
        "signals": {"load": load, "capacity": capacity},
        "namespace": settings.namespaces.first(),
        "namespaces": settings.namespaces.as_ref(),
        "generation": current.generation,
        "workers": workers,
        "load_publishers": publishers(Topic::KvMetrics),
        "kv_event_publishers": publishers(Topic::KvEvents),
        "subscriptions": state
            .load
            .subscriptions()
            .iter()
            .chain(state.kv.subscriptions().iter())
            .map(|s| subscription_json(s))
            .collect::<Vec<_>>(),
        "kv_index": kv_index_json(&state.kv),
    }))
}

/// The KV index's size: the same four figures as `continuum_dynamo_kv_index{what}`, read now.
fn kv_index_json(kv: &KvView) -> Value {
    let stats = kv.stats();
    json!({
        "enabled": kv.enabled(),
        "nodes": stats.nodes,
        "ownerships": stats.ownerships,
        "ranks": stats.ranks,
        "bytes": stats.heap_bytes,
    })
}

/// A running subscription (kv_metrics or kv_events) as the seed shows it: never the
/// publisher's address.
fn subscription_json(status: &SubscriptionStatus) -> Value {
    json!({
        "family": status.family,
        "publisher_id": status.publisher.publisher_id.to_string(),
        "namespace": status.publisher.namespace.as_ref(),
        "component": status.component,
        "state": status.state().map(|s| s.as_str()),
        "transport": transport_label(status.transport),
        "sessions": status.sessions(),
        "buffer_high_water_bytes": status.buffer_high_water(),
    })
}

/// Every held load sample with how a picker reads it, and every sample in the published fleet
/// view with its version, so an operator (or a test) can compare what the store holds with
/// what the replicas were sent.
async fn loads(State(state): State<AdminState>) -> impl IntoResponse {
    let _turn = render_turn().await;
    let now = Instant::now();
    let published = state.publisher.current();
    // Copied out under the store's lock, which every kv_metrics message takes; sorted and
    // serialised after it is released.
    let (mut entries, max_staleness) = {
        let store = state.load.store.lock();
        let entries: Vec<_> = store.iter().map(|(key, held)| (key.clone(), *held, store.reading(key, now))).collect();
        (entries, store.max_staleness())
    };
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let held: Vec<Value> = entries
        .into_iter()
        .map(|(key, held, reading)| {
            let mut entry = load_json(&key, &held.sample, now);
            entry["publisher_id"] = json!(held.publisher_id.to_string());
            entry["sequence"] = json!(held.sequence);
            entry["reading"] = json!(match reading {
                Reading::Fresh(_) => "fresh",
                Reading::Quiet => "quiet",
                Reading::SilentUnderLoad => "silent_under_load",
            });
            entry
        })
        .collect();
    let sent: Vec<Value> = published.view().loads().iter().map(|(key, sample)| load_json(key, sample, now)).collect();
    axum::Json(json!({
        "max_staleness_ms": u64::try_from(max_staleness.as_millis()).unwrap_or(u64::MAX),
        "store": held,
        "fleet": {"version": published.version(), "loads": sent},
    }))
}

fn load_json(key: &LoadKey, sample: &LoadSample, now: Instant) -> Value {
    json!({
        "namespace": key.worker.namespace.as_ref(),
        "worker_id": key.worker.instance_id.to_string(),
        "instance_id": format!("{:x}", key.worker.instance_id),
        "dp_rank": key.dp_rank,
        "active_decode_blocks": sample.load.active_decode_blocks,
        "active_prefill_tokens": sample.load.active_prefill_tokens,
        "kv_used_blocks": sample.load.kv_used_blocks,
        "age_ms": u64::try_from(sample.age(now).as_millis()).unwrap_or(u64::MAX),
    })
}

/// `endpoint` when it is a Dynamo endpoint path (`namespace/component/endpoint`, as in
/// `dynamo/prefill/generate`), which names no host; `None` for anything else, such as the
/// `host:port` of an SGLang bootstrap endpoint.
fn endpoint_path(endpoint: &str) -> Option<&str> {
    let mut segments = endpoint.split('/');
    let path = segments.by_ref().take(3).filter(|s| !s.is_empty() && !s.contains(':')).count() == 3;
    (path && segments.next().is_none()).then_some(endpoint)
}

/// The seed's worker shape: `instance_id` in lowercase hex, `worker_id` in decimal (as a
/// string: lease ids exceed 2^53 and would lose digits as JSON numbers in most clients).
/// Never the transport address or the raw card.
fn worker_json(discovered: &DiscoveredWorker) -> Value {
    let worker = &discovered.worker;
    let c = worker.capacity;
    // A Dynamo endpoint path as the seed shows it; an SGLang bootstrap endpoint is a Pod
    // address, so only that one is declared is shown.
    let disaggregated = worker.disaggregated_endpoint.as_deref().map(endpoint_path);
    let bootstrap = matches!(disaggregated, Some(None));
    json!({
        "instance_id": format!("{:x}", worker.key.instance_id),
        "namespace": worker.key.namespace.as_ref(),
        "worker_id": worker.key.instance_id.to_string(),
        "role": worker.role.as_str(),
        "model": worker.model,
        "component": worker.component,
        "endpoint": worker.endpoint,
        "dp_start_rank": worker.dp_start_rank,
        "dp_size": worker.dp_size,
        "block_size": worker.block_size,
        "capacity": {
            "total_kv_blocks": c.total_kv_blocks,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_num_seqs": c.max_num_seqs,
            "context_length": c.context_length,
        },
        "disaggregated_endpoint": disaggregated.flatten(),
        "disaggregated_bootstrap": bootstrap,
        "excluded": discovered.excluded.map(|e| e.to_string()),
        "first_seen": timestamp(discovered.first_seen),
        "last_updated": timestamp(discovered.last_updated),
    })
}

/// RFC 3339 to the second with the offset written out (`+00:00`), as the reference document
/// shows it: some readers (Python's `fromisoformat` before 3.11) refuse the `Z` form.
fn timestamp(at: std::time::SystemTime) -> String {
    let utc = humantime::format_rfc3339_seconds(at).to_string();
    match utc.strip_suffix('Z') {
        Some(time) => format!("{time}+00:00"),
        None => utc,
    }
}

async fn replicas(State(state): State<AdminState>) -> impl IntoResponse {
    let replicas: Vec<Value> = state
        .replicas
        .list()
        .iter()
        .map(|r| {
            json!({
                "replica_id": r.replica_id,
                "sent_version": r.sent_version.load(Ordering::Relaxed),
                "acked_version": r.acked_version.load(Ordering::Relaxed),
                "nacks": r.nacks.load(Ordering::Relaxed),
                "snapshots_sent": r.snapshots_sent.load(Ordering::Relaxed),
                "queue_depth": r.queue_depth.load(Ordering::Relaxed),
                "queue_high_water": r.queue_high_water.load(Ordering::Relaxed),
            })
        })
        .collect();
    axum::Json(json!({ "version": state.publisher.current().version(), "replicas": replicas }))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::{endpoint_path, timestamp};

    /// Every admin call leaves one audit line saying who called what and how it ended, a
    /// refused one too; the credential it presented is never written.
    #[test]
    fn every_admin_call_is_audited_without_its_credentials() {
        use axum::body::Body;
        use axum::http::{Request, StatusCode};
        use tower_service::Service;

        let refusing = |request: axum::extract::Request| async move {
            let authorized = request.headers().get("authorization").is_some_and(|v| v == "Bearer right");
            if authorized { StatusCode::OK } else { StatusCode::UNAUTHORIZED }
        };
        // Nested as the admin API is, with its fallback, and audited outside the nest: an
        // unknown admin path is audited too, a probe of `/healthz` is not.
        let admin = axum::Router::new()
            .route("/dynamo/workers", axum::routing::get(refusing))
            .fallback(|| async { StatusCode::NOT_FOUND });
        let mut router = axum::Router::new()
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .nest("/admin", admin)
            .layer(axum::middleware::from_fn(super::audit));
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let peer = super::Peer("10.1.2.3:4567".parse().expect("an address"));
        let (statuses, logged) = crate::test_logs::captured(|| {
            runtime.block_on(async {
                let mut statuses = Vec::new();
                let calls = [
                    ("/admin/dynamo/workers", "Bearer right"),
                    ("/admin/dynamo/workers", "Bearer wrong-secret-value"),
                    ("/admin/reload", "Bearer right"),
                    ("/healthz", "Bearer right"),
                ];
                for (path, token) in calls {
                    let mut request = Request::get(path).header("authorization", token);
                    request = request.extension(peer);
                    let response = router.call(request.body(Body::empty()).expect("a request")).await;
                    statuses.push(response.map(|r| r.status().as_u16()).ok());
                }
                statuses
            })
        });
        assert_eq!(statuses, [Some(200), Some(401), Some(404), Some(200)]);
        let lines: Vec<&str> = logged.lines().filter(|line| line.contains("continuum::audit")).collect();
        assert_eq!(lines.len(), 3, "{logged}");
        let expected = [
            ("/admin/dynamo/workers", "status=200"),
            ("/admin/dynamo/workers", "status=401"),
            ("/admin/reload", "status=404"),
        ];
        for (line, (path, status)) in lines.iter().zip(expected) {
            assert!(line.contains("method=GET") && line.contains(&format!("path=\"{path}\"")), "{line}");
            assert!(line.contains("peer=10.1.2.3:4567") && line.contains(status), "{line}");
        }
        assert!(!logged.contains("secret") && !logged.contains("right"), "no credential: {logged}");
    }

    /// Refused calls (no credential needed) are logged a few a minute, and the line after a
    /// pause says how many were held back; calls let in are all logged; every path cut short.
    #[test]
    fn refused_admin_calls_are_logged_a_few_a_minute_and_calls_let_in_every_time() {
        use axum::body::Body;
        use axum::extract::Request;
        use axum::http::StatusCode;
        use axum::middleware::Next;
        use axum::response::IntoResponse;
        use tower_service::Service;

        use super::{LINES_PER_MINUTE, MAX_PATH_LOGGED};

        let admin = axum::Router::new().route("/dynamo/workers", axum::routing::get(|| async { "[]" }));
        // The token is checked within the audit, as the admin API's is.
        let mut router = axum::Router::new()
            .nest("/admin", admin)
            .layer(axum::middleware::from_fn(|request: Request, next: Next| async move {
                let refused = request.headers().get("authorization").is_none();
                if refused { StatusCode::UNAUTHORIZED.into_response() } else { next.run(request).await }
            }))
            .layer(axum::middleware::from_fn(super::audit));
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        let long = format!("/admin/{}", "x".repeat(4096));
        let (_, logged) = crate::test_logs::captured(|| {
            runtime.block_on(async {
                for round in 0..30 {
                    let refused = Request::get(long.as_str()).body(Body::empty()).expect("a request");
                    let _ = router.call(refused).await;
                    if round % 10 == 0 {
                        let let_in = Request::get("/admin/dynamo/workers").header("authorization", "Bearer t");
                        let _ = router.call(let_in.body(Body::empty()).expect("a request")).await;
                    }
                    if round == 0 {
                        // Let in, to a path the API does not have: logged, and cut short too.
                        let let_in = Request::get(long.as_str()).header("authorization", "Bearer t");
                        let _ = router.call(let_in.body(Body::empty()).expect("a request")).await;
                    }
                }
            })
        });
        let lines = |status: &str| logged.lines().filter(|line| line.contains(status)).count();
        // The budget is the process's: another test run in the same process (`cargo test`)
        // may have spent a line of it on its own refused call.
        let refused = lines("status=401");
        assert!((LINES_PER_MINUTE as usize - 1..=LINES_PER_MINUTE as usize).contains(&refused), "{refused}: {logged}");
        assert_eq!((lines("status=200"), lines("status=404")), (3, 1), "{logged}");
        let longest = logged.lines().map(str::len).max().unwrap_or(0);
        assert!(longest < 200 + MAX_PATH_LOGGED, "every path is cut short: {longest} bytes");
    }

    #[test]
    fn timestamps_write_their_offset_as_the_reference_document_does() {
        let at = UNIX_EPOCH + Duration::from_secs(1_790_136_662);
        assert_eq!(timestamp(at), "2026-09-23T04:11:02+00:00");
    }

    #[test]
    fn only_a_dynamo_endpoint_path_is_shown() {
        let cases = [
            ("dynamo/prefill/generate", true),
            ("ns.one/prefill-0/generate_v2", true),
            ("10.0.0.4:8998", false),
            ("prefill-0.prefill.svc", false),
            ("dynamo/prefill", false),
            ("dynamo/prefill/generate/extra", false),
            ("dynamo//generate", false),
            ("host:1/prefill/generate", false),
            ("", false),
        ];
        for (endpoint, shown) in cases {
            assert_eq!(endpoint_path(endpoint).is_some(), shown, "{endpoint:?}");
        }
    }
}
