//! The data plane's Prometheus metrics. One registry per replica (not the global default), so
//! tests can run several replicas in one process. Every label set is closed.

use std::sync::{Arc, OnceLock};

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::dispatch::disclosure::RefusalBody;
use crate::fleet::FleetStatus;
use crate::routing::picker::KvSelectionResult;
use crate::server::head::HeadError;

#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// 1 while the Watch stream to the control plane is up.
    pub stream_connected: IntGauge,
    /// Fleet updates received, by `result` (applied, refused).
    pub updates: IntCounterVec,
    /// Times the replica reconnected to the control plane.
    pub reconnects: IntCounter,
    /// Version of the fleet view held.
    pub view_version: IntGauge,
    /// Workers in the fleet view held.
    pub view_workers: IntGauge,
    /// How long the view has been last-known-good rather than current (0 while connected).
    pub snapshot_age_seconds: Gauge,
    /// Shim dispatch failures by `phase` ([`ErrorPhase`]).
    pub disaggregated_errors: IntCounterVec,
    /// Routed requests by `routing_path` ([`RoutingPath`]), once per request.
    pub disaggregated_requests: IntCounterVec,
    /// Time until the response head, by `ingress` ([`Ingress`]) and `status_class` (1xx..5xx).
    pub request_duration: HistogramVec,
    /// Each shim replica's circuit breaker by `backend` (configured names): 0 closed, 1
    /// half-open, 2 open.
    pub shim_replica_state: IntGaugeVec,
    /// Sends moved on to another shim replica after a connection failure.
    pub shim_retries: IntCounter,
    pub shim_retries_refused: IntCounter,
    /// Sends to each shim replica (and unified backend) by `backend` and `outcome`.
    pub shim_attempts: IntCounterVec,
    /// Fallbacks to the unified backends not made because the retry budget was spent.
    pub fallbacks_refused: IntCounter,
    /// Fleet streams ended because an operation found the report queue full.
    pub dispatch_reports_dropped: IntCounter,
    /// Dispatches in flight reported again when a new stream to the control plane opened.
    pub dispatches_replayed: IntCounter,
    /// Dispatches the local ledger would not hold (at its capacity).
    pub ledger_refused: IntCounter,
    /// The learnt ratio of counted to estimated prompt tokens, by `model` (load-only sizing).
    pub prompt_estimate_ratio: GaugeVec,
    /// Worker selections for shim dispatch, by `role` (prefill, decode) and `reason` (load,
    /// round_robin_stale, no_prefill_pool, kv_aware, conditional_bypass); see
    /// `routing::picker::Reason`.
    pub selections: IntCounterVec,
    /// KV-aware selections by `result` (overlap, no_overlap, bypass, or why there was no KV
    /// term); see `routing::picker::KvSelectionResult`.
    pub kv_selections: IntCounterVec,
    /// KV tokenizer artifact outcomes by `result`; see `kv::artifacts::ArtifactResult`.
    pub kv_artifacts: IntCounterVec,
    /// Time the KV term of a selection took, by `stage` ([`KV_TERM_STAGES`]): what KV-aware
    /// routing adds to a request's latency before the pick.
    pub kv_term_seconds: HistogramVec,
    /// Client connections open.
    pub http_connections: IntGauge,
    /// `continuum_http_connections_waiting`: of those, the ones waiting for the first byte of
    /// their next request (nginx's "Waiting").
    pub http_connections_waiting: IntGauge,
    /// `continuum_http_connection_capacity`: client connections served at once at most, as
    /// the open-file limit allows.
    pub http_connection_capacity: IntGauge,
    /// Bytes charged to the process-wide body budgets, by `budget` (request, answer): read at
    /// each scrape from [`crate::memory`].
    body_bytes_held: IntGaugeVec,
    /// `continuum_http_write_stalls_total`: connections dropped because the client took none
    /// of a response for the write-stall timeout, or took it too slowly.
    http_write_stalls: IntCounter,
    /// `continuum_http_connections_shed_total`: idle connections closed early because they
    /// began waiting with the connection slots nearly all taken.
    pub http_connections_shed: IntCounter,
    /// `continuum_http_requests_abandoned_total`: requests whose client closed its connection
    /// before their answer's head (nginx logs them as 499).
    http_requests_abandoned: IntCounter,
    /// Backend refusals of a client's request (4xx) passed to the client, by what became of
    /// their `body` ([`RefusalBody`]).
    backend_refusals: IntCounterVec,
    /// Client requests refused before routing because they could not be read, by `reason`
    /// (`HEAD_REFUSALS`).
    pub http_refused: IntCounterVec,
    /// Chat completions answered with the replica's own error, by its OpenAI `code`.
    chat_refusals: IntCounterVec,
    /// Streamed answers of unpinned requests cut off mid-stream (pinned ones count in
    /// `disaggregated_errors{phase="decode"}`).
    pub unpinned_stream_failures: IntCounter,
    /// Seconds from a streamed request's send to the shim until its first answer event.
    pub stream_first_event: Histogram,
    /// The request path's series, looked up once rather than hashed by label on every request.
    hot: Arc<Hot>,
}

/// Children of the vectors above for the label sets every request touches. The vectors are
/// never reset, so these stay the registered series.
#[derive(Debug)]
struct Hot {
    /// By [`Ingress`] then status class (an index into [`STATUS_CLASSES`]); created on first use,
    /// as `with_label_values` would, so the exposition lists only classes that occurred.
    durations: [[OnceLock<Histogram>; STATUS_CLASSES.len()]; Ingress::ALL.len()],
    /// In [`RoutingPath::ALL`] order.
    routed: [IntCounter; RoutingPath::ALL.len()],
    /// In [`ErrorPhase::ALL`] order.
    errors: [IntCounter; ErrorPhase::ALL.len()],
}

/// Where a shim dispatch failed: `orchestration` (the frontend refused the pinned pair) or
/// `decode` (every other shim failure, mid-stream breaks included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorPhase {
    Orchestration,
    Decode,
}

impl ErrorPhase {
    pub const ALL: [ErrorPhase; 2] = [ErrorPhase::Orchestration, ErrorPhase::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorPhase::Orchestration => "orchestration",
            ErrorPhase::Decode => "decode",
        }
    }
}

/// How a request was finally sent: pinned to a prefill and a decode worker, pinned to one
/// aggregated (or lone decode) worker, unpinned because disaggregated serving is off, or
/// unpinned as the fallback after a pinned failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutingPath {
    Disaggregated,
    Aggregated,
    Unified,
    UnifiedFallback,
}

impl RoutingPath {
    pub const ALL: [RoutingPath; 4] =
        [RoutingPath::Disaggregated, RoutingPath::Aggregated, RoutingPath::Unified, RoutingPath::UnifiedFallback];

    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPath::Disaggregated => "disaggregated",
            RoutingPath::Aggregated => "aggregated",
            RoutingPath::Unified => "unified",
            RoutingPath::UnifiedFallback => "unified_fallback",
        }
    }
}

/// The traffic ingresses, for the latency histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingress {
    ChatCompletions,
    Models,
}

impl Ingress {
    pub const ALL: [Ingress; 2] = [Ingress::ChatCompletions, Ingress::Models];

    pub fn as_str(self) -> &'static str {
        match self {
            Ingress::ChatCompletions => "chat_completions",
            Ingress::Models => "models",
        }
    }
}

/// Latency buckets from a cached reply to a long buffered generation.
const LATENCY_BUCKETS: [f64; 14] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 120.0];
/// A first token's wait: queueing and a prefill, from milliseconds to a long prompt's minute.
const FIRST_EVENT_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.5, 5.0, 15.0, 60.0];
/// `stage`s of `continuum_dynamo_kv_term_seconds`: rendering, tokenizing and hashing the
/// prompt, then asking the control plane's index which ranks hold its prefix; and, within
/// the first, the wait before the render ran (for a permit and a render thread) and
/// the render's own run on that thread.
pub const KV_TERM_STAGES: [&str; 4] = ["prepare", "find_matches", "queue", "render"];
/// From a cached prompt's tens of microseconds to the lookup deadlines operators set.
const KV_TERM_BUCKETS: [f64; 12] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25];
/// The `reason`s of `continuum_http_requests_refused_total`.
const HEAD_REFUSALS: [&str; 12] = [
    "malformed",
    "head_too_large",
    "target_too_long",
    "unsupported_coding",
    "body_too_large",
    "framing",
    "malformed_body",
    "timeout",
    "busy",
    "not_found",
    "method_not_allowed",
    "pipelined_too_far",
];
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let disaggregated_errors = IntCounterVec::new(
            Opts::new("disaggregated_errors_total", "Shim dispatch failures, by phase"),
            &["phase"],
        )?;
        let disaggregated_requests = IntCounterVec::new(
            Opts::new("disaggregated_requests_total", "Routed requests, by the path they finally took"),
            &["routing_path"],
        )?;
        let hot = Arc::new(Hot {
            durations: Default::default(),
            routed: RoutingPath::ALL.map(|path| disaggregated_requests.with_label_values(&[path.as_str()])),
            errors: ErrorPhase::ALL.map(|phase| disaggregated_errors.with_label_values(&[phase.as_str()])),
        });
        let metrics = Self {
            registry: Registry::new(),
            stream_connected: IntGauge::new(
                "continuum_fleet_stream_connected",
                "1 while the Watch stream to the control plane is up",
            )?,
            updates: IntCounterVec::new(
                Opts::new("continuum_fleet_updates_total", "Fleet updates received from the control plane"),
                &["result"],
            )?,
            reconnects: IntCounter::new("continuum_fleet_reconnects_total", "Reconnections to the control plane")?,
            view_version: IntGauge::new("continuum_fleet_view_version", "Version of the fleet view held")?,
            view_workers: IntGauge::new("continuum_fleet_view_workers", "Workers in the fleet view held")?,
            dispatch_reports_dropped: IntCounter::new(
                "continuum_fleet_dispatch_reports_dropped_total",
                "Fleet streams ended because a dispatch operation found the report queue full (the next stream reports again what is in flight)",
            )?,
            dispatches_replayed: IntCounter::new(
                "continuum_fleet_dispatches_replayed_total",
                "Dispatch legs in flight (one per pinned worker rank) reported again when a new stream to the control plane opened",
            )?,
            snapshot_age_seconds: Gauge::new(
                "continuum_fleet_snapshot_age_seconds",
                "Seconds the fleet view has been last-known-good instead of current (0 while connected, infinite before the first snapshot)",
            )?,
            disaggregated_errors,
            disaggregated_requests,
            request_duration: HistogramVec::new(
                HistogramOpts::new("continuum_request_duration_seconds", "Time from request to response head")
                    .buckets(LATENCY_BUCKETS.to_vec()),
                &["ingress", "status_class"],
            )?,
            shim_replica_state: IntGaugeVec::new(
                Opts::new(
                    "continuum_shim_replica_state",
                    "Shim replica circuit breaker: 0 closed, 1 half-open, 2 open",
                ),
                &["backend"],
            )?,
            prompt_estimate_ratio: GaugeVec::new(
                Opts::new(
                    "continuum_prompt_estimate_ratio",
                    "Prompt tokens the model counted over the load-only estimate, learnt from answers' usage",
                ),
                &["model"],
            )?,
            ledger_refused: IntCounter::new(
                "continuum_dispatch_ledger_refused_total",
                "Dispatches the replica's ledger refused because it held its maximum",
            )?,
            shim_retries: IntCounter::new(
                "continuum_shim_retries_total",
                "Sends moved on to another shim replica after a connection failure",
            )?,
            shim_retries_refused: IntCounter::new(
                "continuum_shim_retries_refused_total",
                "Sends not moved on to another shim replica after a connection failure because the retry budget was spent",
            )?,
            shim_attempts: IntCounterVec::new(
                Opts::new(
                    "continuum_shim_attempts_total",
                    "Requests sent to each configured backend (shim replica or unified backend), by what came back: success, client_error (4xx), server_error (5xx), gateway_failure (502 or 504 from a proxy in front), timeout (no head in time), connect_failed, broken (the exchange failed after the connection), other (3xx), client_left (the send went before its head came: its client left, or a shutdown cut it)",
                ),
                &["backend", "outcome"],
            )?,
            fallbacks_refused: IntCounter::new(
                "continuum_unified_fallbacks_refused_total",
                "Failed pinned dispatches not resent to the unified backends: the retry budget was spent",
            )?,
            selections: IntCounterVec::new(
                Opts::new(
                    "continuum_dynamo_selection_total",
                    "Worker selections for shim dispatch, by role and reason",
                ),
                &["role", "reason"],
            )?,
            kv_selections: IntCounterVec::new(
                Opts::new("continuum_dynamo_kv_selection_total", "KV-aware worker selections, by result"),
                &["result"],
            )?,
            kv_artifacts: IntCounterVec::new(
                Opts::new("continuum_dynamo_kv_artifacts_total", "KV tokenizer and template artifacts, by outcome"),
                &["result"],
            )?,
            kv_term_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "continuum_dynamo_kv_term_seconds",
                    "Time the KV term of a selection took, by stage: prepare (render, tokenize, hash the prompt), find_matches (the control plane's index lookup); queue is the part of prepare spent waiting for a render permit and a render thread, render the part spent running on that thread",
                )
                .buckets(KV_TERM_BUCKETS.to_vec()),
                &["stage"],
            )?,
            http_connections: IntGauge::new("continuum_http_connections", "Client connections open")?,
            http_connections_waiting: IntGauge::new(
                "continuum_http_connections_waiting",
                "Client connections open and waiting for the first byte of their next request (keep-alive between requests, or opened and silent)",
            )?,
            http_connection_capacity: IntGauge::new(
                "continuum_http_connection_capacity",
                "Client connections served at once at most: 16,384, or fewer when the open-file limit leaves room for fewer",
            )?,
            body_bytes_held: IntGaugeVec::new(
                Opts::new(
                    "continuum_body_bytes_held",
                    "Bytes of large request bodies (request) and buffered answers (answer) held against the process-wide budgets",
                ),
                &["budget"],
            )?,
            http_connections_shed: IntCounter::new(
                "continuum_http_connections_shed_total",
                "Idle client connections (keep-alive between requests, or opened and silent) closed after 2 s instead of 75 s because they began waiting with no more than a sixteenth of the connection slots free",
            )?,
            http_requests_abandoned: IntCounter::new(
                "continuum_http_requests_abandoned_total",
                "Requests whose client closed its connection before their answer's head (nginx's 499); their dispatch was ended",
            )?,
            http_write_stalls: IntCounter::new(
                "continuum_http_write_stalls_total",
                format!(
                    "Client connections dropped because the client read none of a response for {} seconds, or a write of it slower than {} KiB/s on average past them",
                    crate::server::WRITE_STALL_TIMEOUT.as_secs(),
                    crate::server::MIN_WRITE_BYTES_PER_SECOND >> 10
                ),
            )?,
            http_refused: IntCounterVec::new(
                Opts::new(
                    "continuum_http_requests_refused_total",
                    "Client requests refused before routing, by reason: unreadable as HTTP/1.1, no room for a large body, no endpoint, or pipelined past the 64 KiB kept while an answer is made (pipelined_too_far counts connections, each closed after that answer)",
                ),
                &["reason"],
            )?,
            chat_refusals: IntCounterVec::new(
                Opts::new(
                    "continuum_chat_refusals_total",
                    "Chat completions answered with the replica's own error (a request it could not take, no worker or backend for it, a dispatch that failed), by the error's code",
                ),
                &["code"],
            )?,
            unpinned_stream_failures: IntCounter::new(
                "continuum_unpinned_stream_failures_total",
                "Streamed answers of unpinned requests (unified routing, or the fallback of a pinned one) cut off mid-stream: broken, idle past the timeout, or an event past the bound",
            )?,
            stream_first_event: Histogram::with_opts(
                HistogramOpts::new(
                    "continuum_stream_first_event_seconds",
                    "Time from a streamed request's send to a backend until its first answer event (the first token, as its client sees it less the router's own time before the send)",
                )
                .buckets(FIRST_EVENT_BUCKETS.to_vec()),
            )?,
            backend_refusals: IntCounterVec::new(
                Opts::new(
                    "continuum_backend_refusals_total",
                    "Backend refusals (4xx) of a client's request passed to the client, by body: relayed as it came, unreadable, or withheld (not a JSON object, or naming an address, a path or a worker id) and explained by the router",
                ),
                &["body"],
            )?,
            hot,
        };
        for body in RefusalBody::ALL {
            metrics.backend_refusals.with_label_values(&[body.as_str()]);
        }
        for reason in HEAD_REFUSALS {
            metrics.http_refused.with_label_values(&[reason]);
        }
        for result in crate::kv::artifacts::ArtifactResult::ALL {
            metrics.kv_artifacts.with_label_values(&[result.as_str()]);
        }
        for result in KvSelectionResult::ALL {
            metrics.kv_selections.with_label_values(&[result.as_str()]);
        }
        for stage in KV_TERM_STAGES {
            metrics.kv_term_seconds.with_label_values(&[stage]);
        }
        for collector in [
            Box::new(metrics.stream_connected.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.updates.clone()),
            Box::new(metrics.reconnects.clone()),
            Box::new(metrics.view_version.clone()),
            Box::new(metrics.view_workers.clone()),
            Box::new(metrics.snapshot_age_seconds.clone()),
            Box::new(metrics.dispatch_reports_dropped.clone()),
            Box::new(metrics.dispatches_replayed.clone()),
            Box::new(metrics.ledger_refused.clone()),
            Box::new(metrics.prompt_estimate_ratio.clone()),
            Box::new(metrics.disaggregated_errors.clone()),
            Box::new(metrics.disaggregated_requests.clone()),
            Box::new(metrics.request_duration.clone()),
            Box::new(metrics.shim_replica_state.clone()),
            Box::new(metrics.shim_retries.clone()),
            Box::new(metrics.shim_retries_refused.clone()),
            Box::new(metrics.fallbacks_refused.clone()),
            Box::new(metrics.shim_attempts.clone()),
            Box::new(metrics.http_refused.clone()),
            Box::new(metrics.backend_refusals.clone()),
            Box::new(metrics.chat_refusals.clone()),
            Box::new(metrics.unpinned_stream_failures.clone()),
            Box::new(metrics.stream_first_event.clone()),
            Box::new(metrics.http_connections.clone()),
            Box::new(metrics.http_connections_waiting.clone()),
            Box::new(metrics.http_connection_capacity.clone()),
            Box::new(metrics.body_bytes_held.clone()),
            Box::new(metrics.http_write_stalls.clone()),
            Box::new(metrics.http_connections_shed.clone()),
            Box::new(metrics.http_requests_abandoned.clone()),
            Box::new(metrics.selections.clone()),
            Box::new(metrics.kv_selections.clone()),
            Box::new(metrics.kv_artifacts.clone()),
            Box::new(metrics.kv_term_seconds.clone()),
        ] {
            metrics.registry.register(collector)?;
        }
        Ok(metrics)
    }

    pub fn error(&self, phase: ErrorPhase) {
        self.hot.errors[phase as usize].inc();
    }

    pub fn routed(&self, path: RoutingPath) {
        self.hot.routed[path as usize].inc();
    }

    /// Counts a request for no endpoint under its error's code: `not_found` (a path not served)
    /// or `method_not_allowed` (not with its method), both in `HEAD_REFUSALS`.
    pub fn no_endpoint(&self, code: &'static str) {
        self.http_refused.with_label_values(&[code]).inc();
    }

    /// Counts a connection dropped because its client stopped reading a response.
    pub fn write_stalled(&self) {
        self.http_write_stalls.inc();
    }

    /// Counts a request its client left before its answer's head.
    pub fn abandoned(&self) {
        self.http_requests_abandoned.inc();
    }

    /// Counts a connection closed after its answer because its client pipelined requests past
    /// the bound kept while the answer was made (the ones past it dropped).
    pub fn pipelined_too_far(&self) {
        self.http_refused.with_label_values(&["pipelined_too_far"]).inc();
    }

    /// Counts an idle connection closed to free its slot.
    pub fn connection_shed(&self) {
        self.http_connections_shed.inc();
    }

    /// Counts a failed write to a client if it failed by stalling (a closed connection is the
    /// client's to close).
    pub fn write_failed(&self, error: &std::io::Error) {
        if error.kind() == std::io::ErrorKind::TimedOut {
            self.write_stalled();
        }
    }

    /// Counts a backend's refusal passed to the client, by what became of its body.
    /// Counts a chat completion answered with the replica's own error `code` (a closed set of
    /// static codes, so the label stays bounded).
    pub fn chat_refused(&self, code: &'static str) {
        self.chat_refusals.with_label_values(&[code]).inc();
    }

    pub fn refusal_relayed(&self, body: RefusalBody) {
        self.backend_refusals.with_label_values(&[body.as_str()]).inc();
    }

    /// Counts a request refused because it could not be read.
    pub fn refused(&self, error: &HeadError) {
        let reason = match error {
            HeadError::Malformed(_) => "malformed",
            HeadError::TooLarge => "head_too_large",
            HeadError::TargetTooLong => "target_too_long",
            HeadError::FieldTooLong(_) => "field_too_long",
            HeadError::Version => "version",
            HeadError::UnsupportedCoding => "unsupported_coding",
            HeadError::BodyTooLarge => "body_too_large",
            HeadError::Framing(_) => "framing",
            HeadError::Body(_) => "malformed_body",
            HeadError::Timeout => "timeout",
            HeadError::Busy => "busy",
        };
        self.http_refused.with_label_values(&[reason]).inc();
    }

    pub fn observe(&self, ingress: Ingress, status: u16, seconds: f64) {
        // 1xx..5xx; a status outside them counts as 5xx.
        let class = usize::from(status / 100).checked_sub(1).filter(|c| *c < STATUS_CLASSES.len()).unwrap_or(4);
        let histogram = self.hot.durations[ingress as usize][class].get_or_init(|| {
            self.request_duration.with_label_values(&[ingress.as_str(), STATUS_CLASSES.get(class).unwrap_or(&"5xx")])
        });
        histogram.observe(seconds);
    }

    /// The text exposition, with the fleet gauges brought up to date first.
    pub fn render(&self, fleet: FleetStatus) -> String {
        self.view_version.set(fleet.version.map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX)));
        self.view_workers.set(i64::try_from(fleet.workers).unwrap_or(i64::MAX));
        // No view at all is older than any stale one: an alert on the age fires for a replica
        // that never got a snapshot, which 0 would have shown as current.
        self.snapshot_age_seconds.set(fleet.snapshot_age.map_or(f64::INFINITY, |a| a.as_secs_f64()));
        for (budget, held) in
            [("request", &crate::memory::REQUEST_BODIES), ("answer", &crate::memory::BUFFERED_ANSWERS)]
        {
            self.body_bytes_held.with_label_values(&[budget]).set(i64::try_from(held.charged()).unwrap_or(i64::MAX));
        }
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for the text format; an error would only lose a scrape.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The gauge's value as a scrape shows it (the encoder writes infinity as `inf`, which
    /// Prometheus reads as Go's `ParseFloat` does).
    fn scraped_age(metrics: &Metrics, status: FleetStatus) -> f64 {
        let text = metrics.render(status);
        let line = text.lines().find(|line| line.starts_with("continuum_fleet_snapshot_age_seconds ")).unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    #[test]
    fn the_snapshot_age_is_infinite_until_a_snapshot_arrives() {
        let metrics = Metrics::new().unwrap();
        let status = |snapshot_age| FleetStatus { version: None, workers: 0, connected: false, snapshot_age };
        assert_eq!(scraped_age(&metrics, status(None)), f64::INFINITY);
        let current = FleetStatus { version: Some(7), connected: true, ..status(Some(Duration::ZERO)) };
        assert_eq!(scraped_age(&metrics, current), 0.0);
        let stale = FleetStatus { version: Some(7), ..status(Some(Duration::from_millis(2500))) };
        assert_eq!(scraped_age(&metrics, stale), 2.5);
    }
}
