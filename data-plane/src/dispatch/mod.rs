//! Shim dispatch: sends a picked request to a replica of its namespace's
//! `dynamo.frontend --router-mode direct` pool with the pins written, and turns the answer into
//! the response the client gets, per the seed's failure semantics.
//!
//! - Connection failures retry on another replica of the pool with the same pins, within
//!   [`budget::MAX_ATTEMPTS`] and the [`RetryBudget`]; workers are never re-selected.
//! - Each replica has a circuit breaker ([`breaker`]) fed by those outcomes.
//! - A refusal naming the missing prefill id is a 503; every other failure takes the decode arm:
//!   an unpinned resend to the backends serving the model when `fallback_to_unified`, else
//!   `disaggregated_decode_failed`.
//! - A pinned dispatch is recorded in the ledger and ended when its response ends ([`DispatchEnd`]).

mod attempt;
pub mod breaker;
pub mod budget;
pub mod classify;
mod client;
mod connections;
pub mod disclosure;
mod error;
mod ledger;
pub mod pool;
pub mod probe;
pub mod relay;
mod resolve;
mod respond;
pub mod shim_body;
pub mod wire;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use continuum_proto::model::DataPlaneConfig;
use futures::future::Either;
use prometheus::core::Collector;

pub use breaker::{BreakerSettings, HealthSlot, ShimHealth};
pub use budget::RetryBudget;
pub use client::{ExchangeError, SendError, ShimClient};
pub use connections::{IDLE_TIMEOUT, MAX_IDLE_PER_AUTHORITY};
pub use error::{DispatchError, Failure};
pub use ledger::DispatchEnd;
pub use pool::{PoolCache, ShimPools, ShimReplica};
pub use probe::ProbeSettings;
pub use respond::{ERROR_BODY_TIMEOUT, MAX_BUFFERED_RESPONSE_BYTES, MAX_ERROR_BODY_BYTES};

use crate::boxed::built_in_box;
use crate::ingress::request::OutboundBody;
use crate::metrics::{ErrorPhase, Metrics, RoutingPath};
use crate::routing::headers::{Pins, TENANT_ID, disclose_backend, mark_routing_path, pins};
use crate::routing::picker::{Few, Selection};
use respond::{Answer, Answered};

/// Connecting to a shim replica; past it the next replica is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A buffered request's whole exchange: the frontend answers only once generation is done.
pub const BUFFERED_RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);
/// A streaming request's response head, which the frontend sends once the stream starts.
pub const STREAM_HEAD_TIMEOUT: Duration = Duration::from_secs(60);

/// The most of a liveness answer read (Dynamo's is `{"status":"live"}`); a longer one closes
/// its connection.
const MAX_PROBE_BODY_BYTES: usize = 4096;

/// Bounds and timeouts of dispatch; the defaults are the named constants.
#[derive(Debug, Clone, Copy)]
pub struct DispatchSettings {
    pub connect_timeout: Duration,
    pub buffered_timeout: Duration,
    pub stream_head_timeout: Duration,
    pub stream_idle_timeout: Duration,
    pub breaker: BreakerSettings,
    pub probe: ProbeSettings,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        Self {
            connect_timeout: CONNECT_TIMEOUT,
            buffered_timeout: BUFFERED_RESPONSE_TIMEOUT,
            stream_head_timeout: STREAM_HEAD_TIMEOUT,
            stream_idle_timeout: relay::STREAM_IDLE_TIMEOUT,
            breaker: BreakerSettings::default(),
            probe: ProbeSettings::default(),
        }
    }
}

/// One request, ready to send: the outbound body (the client's, stripped of routing) and where.
#[derive(Debug)]
pub struct Plan {
    /// Only a body the ingress's hygiene made can be sent.
    pub body: OutboundBody,
    pub stream: bool,
    /// The client asked (`x-backend`) to see the chosen backend and workers.
    pub disclose: bool,
    /// The client's tenant (`x-tenant-id`), sent on as it came: the frontend salts the
    /// prompt's KV blocks with it over the body's salt.
    pub tenant: Option<HeaderValue>,
    /// The client's tracing headers, sent on as they came.
    pub trace: Vec<(HeaderName, HeaderValue)>,
    pub route: Route,
}

/// How an unpinned send answers: `relay_errors`, any HTTP answer passed on as the backend
/// gave it (plain unified routing), or only a success (a fallback); `disclose`, the backend's
/// name on the answer (the client sent `x-backend`).
#[derive(Clone, Copy, Debug)]
struct Unpinned {
    relay_errors: bool,
    disclose: bool,
}

// Pinned is nearly every request's route, made once and moved into the dispatch: boxing it
// would cost every request an allocation to spare the rare unified one a few hundred bytes.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Route {
    Pinned(Pinned),
    /// Unpinned, to the backends serving the model: disaggregated serving is off, or no Dynamo
    /// worker with a usable shim serves the model (the seed's fall-through).
    Unified {
        replicas: Arc<[ShimReplica]>,
    },
}

#[derive(Debug)]
pub struct Pinned {
    pub selection: Selection,
    /// The selection's namespace pool.
    pub replicas: Arc<[ShimReplica]>,
    /// The backends serving the model unpinned, if any: where a request goes that no replica
    /// of the pool took, and, with `fallback_to_unified`, a failed one once more. Boxed: few
    /// deployments have them, and every request's future holds the field.
    pub fallback: Option<Box<Fallback>>,
    pub dispatch: DispatchEnd,
}

/// The model's unpinned backends, for the seed's fall-through and
/// `disaggregated_serving.fallback_to_unified`'s one unpinned resend.
#[derive(Debug)]
pub struct Fallback {
    /// The backends serving the model unpinned (`backends[].models`). Not the pool: a
    /// direct-mode frontend refuses every request without pins (1.6.1 answers 500 or 400).
    pub replicas: Arc<[ShimReplica]>,
    /// The body to send when it differs from the pinned one: without the router's
    /// `nvext.token_data`, which only a shim reads.
    pub body: Option<OutboundBody>,
    /// `fallback_to_unified`: a pinned request that failed is resent here.
    pub on_failure: bool,
}

/// A pinned send's result: final (relayed, or refused without fallback), or a failure that
/// takes the decode arm.
#[derive(Debug)]
enum PinnedOutcome {
    Final(Result<Response, DispatchError>),
    Failed(Failure),
}

/// The replica's dispatcher: one pooled client, the breakers and the retry budget.
#[derive(Debug)]
pub struct Dispatcher {
    client: ShimClient,
    health: Arc<ShimHealth>,
    budget: RetryBudget,
    settings: DispatchSettings,
    cursor: AtomicUsize,
    metrics: Metrics,
    pools: PoolCache,
    /// The headers of a buffered and of a streaming request ([`attempt::shim_headers`]).
    headers: [HeaderMap; 2],
}

/// A pinned request's routing path, counted once however the request ends: answered, failed,
/// or dropped mid-way when its client left (under the path it had taken by then). `None`: it
/// went nowhere, and is counted on no path.
struct CountedPath<'a> {
    metrics: &'a Metrics,
    path: Option<RoutingPath>,
}

/// A plain unpinned request's failure.
fn unified_failed(failure: Failure) -> DispatchError {
    match failure {
        Failure::Overloaded => DispatchError::Overloaded,
        failure => DispatchError::UnifiedFailed(failure),
    }
}

impl Drop for CountedPath<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.path {
            self.metrics.routed(path);
        }
    }
}

impl Dispatcher {
    pub fn new(settings: DispatchSettings, metrics: Metrics) -> Self {
        Self {
            client: ShimClient::new(settings.connect_timeout),
            health: Arc::new(ShimHealth::new(settings.breaker)),
            budget: RetryBudget::default(),
            settings,
            cursor: AtomicUsize::new(0),
            metrics,
            pools: PoolCache::default(),
            headers: [false, true].map(attempt::shim_headers),
        }
    }

    /// The shim pools of `config`, resolved once per configuration.
    pub fn pools(&self, config: &Arc<DataPlaneConfig>) -> Arc<ShimPools> {
        self.pools.get(config)
    }

    pub fn settings(&self) -> &DispatchSettings {
        &self.settings
    }

    /// Sends a health probe on the pooled client; its status, or why there was none. Its short
    /// body is read, so the connection goes back to the pool instead of being closed unread.
    pub async fn send_probe(
        &self,
        request: axum::http::Request<Bytes>,
        timeout: Duration,
    ) -> Result<StatusCode, SendError> {
        use http_body_util::BodyExt;
        let response = self.client.send(request, timeout).await?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MAX_PROBE_BODY_BYTES);
        let _ = tokio::time::timeout(timeout, body.collect()).await;
        Ok(status)
    }

    pub fn record_probe(&self, name: &str, url: &str, live: bool) {
        self.health.at(name, url).record_probe(live);
    }

    /// See [`ShimHealth::clear_probes_except`].
    pub fn clear_probes_except(&self, probed: impl Fn(&str) -> bool) {
        self.health.clear_probes_except(probed);
    }

    /// Whether a request to `replica` would be let through now.
    pub fn usable(&self, replica: &ShimReplica, now: Instant) -> bool {
        self.health.of(replica).usable(now)
    }

    /// The dispatch's future, built in its box ([`built_in_box`]): it is most of a request's,
    /// and every future that awaits one holds it inline, so each of them would copy its
    /// kilobytes as it starts. Not an `async fn`: the caller awaits the box itself, not a
    /// future around it holding the plan.
    pub fn run(&self, plan: Plan) -> impl Future<Output = Result<Response, DispatchError>> + '_ {
        let Plan { body, stream, disclose, tenant, trace, route } = plan;
        // Once a request, however many sends it takes (a fall-through or a fallback to the
        // unified backends is a send of its own, paid from the budget as a retry is).
        self.budget.deposit();
        let headers = self.request_headers(stream, tenant, trace);
        match route {
            Route::Pinned(pinned) => {
                Either::Left(built_in_box(|| self.pinned(body.into_bytes(), stream, disclose, headers, pinned)))
            }
            Route::Unified { replicas } => {
                self.metrics.routed(RoutingPath::Unified);
                let relay = Unpinned { relay_errors: true, disclose };
                Either::Right(Box::pin(async move {
                    self.unpinned(body.bytes(), stream, &headers, replicas, relay).await.map_err(unified_failed)
                }))
            }
        }
    }

    /// The headers of a request to a shim: the dispatcher's own ([`attempt::shim_headers`]),
    /// the client's tenant when it named one, and its tracing headers.
    fn request_headers(
        &self,
        stream: bool,
        tenant: Option<HeaderValue>,
        trace: Vec<(HeaderName, HeaderValue)>,
    ) -> Cow<'_, HeaderMap> {
        let own = &self.headers[usize::from(stream)];
        if tenant.is_none() && trace.is_empty() {
            return Cow::Borrowed(own);
        }
        let mut headers = own.clone();
        if let Some(tenant) = tenant {
            headers.insert(TENANT_ID, tenant);
        }
        headers.extend(trace.into_iter().map(|(name, value)| (Some(name), value)));
        Cow::Owned(headers)
    }

    /// Not an `async fn`: its arguments would stay in the future beside the locals made from
    /// them, and this future is a request's largest.
    fn pinned<'a>(
        &'a self,
        body: Bytes,
        stream: bool,
        disclose: bool,
        headers: Cow<'a, HeaderMap>,
        pinned: Pinned,
    ) -> impl Future<Output = Result<Response, DispatchError>> + 'a {
        let Pinned { selection, replicas, fallback, dispatch } = pinned;
        async move {
            let path = if selection.prefill.is_some() { RoutingPath::Disaggregated } else { RoutingPath::Aggregated };
            let mut counted = CountedPath { metrics: &self.metrics, path: Some(path) };
            let ledger = Arc::clone(dispatch.ledger());
            // Made where an outcome needs them, not held across the awaits (a future holds every
            // local that lives across one).
            let ranks = || -> Few<_> {
                selection.prefill.iter().chain([&selection.decode]).map(|pin| pin.rank_key()).collect()
            };
            let sent = Instant::now();
            let timed_from = tokio::time::Instant::from_std(sent);
            // The pinned send and what its answer means, and whether a refusal blames the pinned
            // workers. `dispatch` ends with the relayed body, or here for anything else: before a
            // fallback's resend, which may take as long as a generation. Inline rather than a
            // function of its own: each `async fn` level builds and moves its callee's future,
            // kilobytes a request.
            let (outcome, blames_pins) = match self.send(&replicas, (&headers, pins(&selection)), &body, stream).await {
                Err(failure) => {
                    drop(dispatch);
                    (PinnedOutcome::Failed(failure), false)
                }
                Ok((replica, response)) => {
                    let shown = disclose.then_some((replica.name.as_str(), &selection));
                    let timed = (stream, timed_from);
                    let Answered { mut answer, blames_pins, refused } =
                        self.answer(response, timed, Some(dispatch), (replica, shown)).await;
                    if let Answer::Relay(response) = &mut answer {
                        mark_routing_path(response.headers_mut(), &selection);
                    }
                    if let Some(fate) = refused {
                        self.metrics.refusal_relayed(fate);
                    }
                    let outcome = match answer {
                        Answer::Relay(response) => PinnedOutcome::Final(Ok(response)),
                        Answer::PrefillRefused => {
                            self.metrics.error(ErrorPhase::Orchestration);
                            let namespace = selection.namespace.clone();
                            PinnedOutcome::Final(Err(DispatchError::PrefillRefused { namespace }))
                        }
                        Answer::Failed(failure) => PinnedOutcome::Failed(failure),
                    };
                    (outcome, blames_pins)
                }
            };
            // A refusal that blames the pins makes the pinned workers suspects, and so does an
            // answer that never came or never finished in time, if they answered nothing else
            // since it was sent (`Outliers::failed_unless_answering`): a buffered answer's head
            // comes only once generation is done, so a hung worker shows as a head that never
            // came, but so does a request merely too long; and a frontend that lost its workers
            // refuses every pin while they answer through other replicas. A shim that could not
            // be reached, or answered nothing at all, or whose connection broke under the body,
            // says nothing about them (it is charged with it), nor does a refusal of the
            // client's request.
            let unanswered = matches!(
                outcome,
                PinnedOutcome::Failed(Failure::BodyTimeout(_) | Failure::Send(SendError::HeadTimeout(_)))
            );
            if blames_pins || unanswered {
                ledger.outliers().failed_unless_answering(&ranks(), sent, Instant::now());
            }
            let failure = match outcome {
                PinnedOutcome::Final(outcome) => {
                    // A stream's workers are acquitted or blamed by how it ends (`RelayBody`).
                    if !stream && outcome.as_ref().is_ok_and(|response| response.status().is_success()) {
                        ledger.outliers().succeeded(&ranks(), Instant::now());
                    }
                    return outcome;
                }
                // The workers answered; this replica had no room to hold the answer. Not theirs
                // to count, nor worth sending again.
                PinnedOutcome::Failed(Failure::Overloaded) => return Err(DispatchError::Overloaded),
                // No replica of the pool would take it (a half-open breaker's one trial went to
                // another request picked at the same time): nothing reached a shim or a worker, so
                // it is no decode failure but what selection would have decided a moment later,
                // the seed's fall-through to the model's unified backends.
                PinnedOutcome::Failed(Failure::NoReplica) => {
                    let Some(unified) = fallback else {
                        counted.path = None;
                        return Err(DispatchError::NoShim);
                    };
                    counted.path = Some(RoutingPath::Unified);
                    let plain = Unpinned { relay_errors: true, disclose };
                    return self.to_unified(*unified, body, (stream, &headers), plain).await.map_err(unified_failed);
                }
                PinnedOutcome::Failed(failure) => failure,
            };
            // The decode arm. The pinned dispatch has ended, whatever the fallback does.
            self.metrics.error(ErrorPhase::Decode);
            // An answer too large to buffer would be as large again from another backend. The
            // resend is a retry too, paid from the same budget: a pool failing every request
            // (overloaded, answering 429) must not double the load on the unified backends.
            // After a timeout, a broken body or a 5xx the pinned workers may have generated the
            // answer already, so the resend may generate it twice: the seed's price of an answer
            // (`fallback_to_unified`), paid only where `on_failure` is set.
            let fallback = fallback
                .filter(|unified| unified.on_failure && !matches!(failure, Failure::TooLarge(_)))
                .filter(|_| {
                    let paid = self.budget.withdraw();
                    if !paid {
                        self.metrics.fallbacks_refused.inc();
                    }
                    paid
                });
            let fallback_to_unified = fallback.is_some();
            // Once per failed request, which a client's body the frontend refuses can cause at
            // its request rate: `disaggregated_errors_total` counts them all.
            continuum_proto::warn_limited!(
                namespace = %selection.namespace,
                error = %failure,
                fallback_to_unified,
                "pinned shim dispatch failed"
            );
            // Of the refusals that blame the pins, the 400s refused the pins themselves (an id the
            // frontend no longer knows, a rank out of bounds); a 5xx is the workers failing.
            let stale_pins = blames_pins && matches!(failure, Failure::Status(StatusCode::BAD_REQUEST));
            let Some(fallback) = fallback else {
                return Err(DispatchError::DecodeFailed { cause: failure, fallback: None, stale_pins });
            };
            counted.path = Some(RoutingPath::UnifiedFallback);
            let resend = Unpinned { relay_errors: false, disclose };
            let resent = self.to_unified(*fallback, body, (stream, &headers), resend).await;
            // Nothing was sent (no unified replica would take it): no retry was made.
            if matches!(resent, Err(Failure::NoReplica)) {
                self.budget.refund();
            }
            resent.map_err(|fallback| DispatchError::DecodeFailed {
                cause: failure,
                fallback: Some(fallback),
                stale_pins,
            })
        }
    }

    /// A pinned request sent unpinned to the model's unified backends instead: its body, or the
    /// one made for them (without the router's tokens). Boxed: it is rare, and inline its
    /// future would enlarge every request's.
    async fn to_unified(
        &self,
        unified: Fallback,
        body: Bytes,
        (stream, headers): (bool, &HeaderMap),
        how: Unpinned,
    ) -> Result<Response, Failure> {
        let Fallback { replicas, body: made, .. } = unified;
        let body = made.map_or(body, OutboundBody::into_bytes);
        Box::pin(self.unpinned(&body, stream, headers, replicas, how)).await
    }

    /// Sends without pins, and names the backend that answered when the client asked.
    async fn unpinned(
        &self,
        body: &Bytes,
        stream: bool,
        headers: &HeaderMap,
        replicas: Arc<[ShimReplica]>,
        how: Unpinned,
    ) -> Result<Response, Failure> {
        let sent = tokio::time::Instant::now();
        let (replica, response) = self.send(&replicas, (headers, Pins::default()), body, stream).await?;
        let mut response = if how.relay_errors {
            self.pass_through(response, (stream, sent), replica).await?
        } else {
            match self.answer(response, (stream, sent), None, (replica, None)).await.answer {
                Answer::Relay(response) if response.status().is_success() => response,
                Answer::Relay(response) => return Err(Failure::Status(response.status())),
                Answer::PrefillRefused => return Err(Failure::Status(StatusCode::SERVICE_UNAVAILABLE)),
                Answer::Failed(failure) => return Err(failure),
            }
        };
        if how.disclose {
            disclose_backend(response.headers_mut(), &replica.name);
        }
        Ok(response)
    }

    /// Refreshes the breaker gauge: every replica of a configured pool, and no other. Health
    /// is forgotten only for backends no longer configured: a backend outside every pool still
    /// serves unified requests, behind its own breaker.
    pub fn export_health(&self, config: &DataPlaneConfig) {
        let states = self.health.states(|name, url| config.backends.iter().any(|b| b.name == name && b.url == url));
        let gauge = &self.metrics.shim_replica_state;
        let mut values: BTreeMap<&str, i64> =
            config.shim_pools.iter().flat_map(|p| &p.backends).map(|name| (name.as_str(), 0)).collect();
        for (name, state) in states.iter().filter(|(name, _)| pool::is_pooled(config, name)) {
            values.insert(name, state.gauge_value());
        }
        // Set in place, never reset: a scrape gathering meanwhile must not find the gauge empty.
        for (name, value) in &values {
            gauge.with_label_values(&[name]).set(*value);
        }
        let gone: Vec<String> = series_labels(gauge)
            .into_iter()
            .filter_map(|labels| labels.into_iter().next())
            .filter(|name| !values.contains_key(name.as_str()))
            .collect();
        for name in gone {
            let _ = gauge.remove_label_values(&[&name]);
        }
        // A backend no longer configured takes its attempt counts with it (Envoy drops a removed
        // cluster's stats), so that renamed or churned backends do not pile up series.
        let attempts = &self.metrics.shim_attempts;
        let configured = |name: &str| config.backends.iter().any(|b| b.name == name);
        for labels in series_labels(attempts).into_iter().filter(|labels| !configured(&labels[0])) {
            let _ = attempts.remove_label_values(&labels.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }

    fn next_start(&self) -> usize {
        self.cursor.fetch_add(1, Ordering::Relaxed)
    }
}

/// The label values of each series a metric vector exports, in its labels' order.
fn series_labels(vector: &impl Collector) -> Vec<Vec<String>> {
    let families = vector.collect();
    let metrics = families.iter().flat_map(|family| family.get_metric());
    metrics.map(|metric| metric.get_label().iter().map(|label| label.value().to_string()).collect()).collect()
}

#[cfg(test)]
mod tests;
