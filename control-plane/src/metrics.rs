//! The control plane's Prometheus metrics. One registry per process (not the global default),
//! so tests can run several control planes side by side. Every label set is closed.

use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::config::LoadTransport;
use crate::discovery::Topic;
use crate::grpc::tls::HandshakeFailure;
use crate::kv::{KvEventResult, ProvisionalResult};
use crate::load::zmtp::LARGE_MESSAGES;
use crate::load::{EndReason, LoadEvent, LoadGauges, SubscriptionState, transport_label};

#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Version of the published fleet view.
    pub fleet_version: IntGauge,
    /// Workers in the published fleet view.
    pub fleet_workers: IntGauge,
    /// Open Watch streams.
    pub replicas_connected: IntGauge,
    /// Updates sent to replicas, by `kind` (snapshot, delta; too_large: a snapshot refused).
    pub updates_sent: IntCounterVec,
    /// Replies from replicas, by `result` (ack, nack).
    pub replica_replies: IntCounterVec,
    /// Watch streams refused, by `reason` (every value is in docs/architecture.md's table).
    pub watch_refused: IntCounterVec,
    /// Watch streams ended because their replica id opened a new one.
    pub watch_superseded: IntCounter,
    /// Watch streams ended because their replica read nothing for `REPLICA_STALL_LIMIT`.
    pub watch_stalled: IntCounter,
    /// Fleet calls refused for want of `control_plane.token`.
    pub unauthenticated: IntCounter,
    /// gRPC calls refused because as many of their kind were in flight as the process allows,
    /// by `call` (health_check: `MAX_OPEN_CALLS`; get_snapshot: `MAX_SNAPSHOT_CALLS`).
    pub calls_refused: IntCounterVec,
    /// Admin API calls refused for want of `admin.token`.
    pub admin_unauthenticated: IntCounter,
    pub watch_retired: IntCounter,
    /// Re-reads of `control_plane.tls`'s files that changed them, by `result` (applied, refused).
    pub fleet_tls_reloads: IntCounterVec,
    /// When the served Fleet certificate expires (Unix seconds); 0 without TLS.
    pub fleet_tls_certificate_not_after: IntGauge,
    /// Fleet connections whose TLS handshake did not complete, by `reason`
    /// (see `grpc::tls::HandshakeFailure`).
    pub fleet_tls_handshakes_failed: IntCounterVec,
    /// Connections a listener closed itself, by `listener` (fleet, admin) and `reason` (see
    /// `listen::Closed`, and docs/architecture.md's table).
    pub connections_closed: IntCounterVec,
    /// Dispatch reports dropped because the backlog book was a full queue behind.
    pub dispatch_reports_dropped: IntCounter,
    /// Reported dispatches the book refused: an unknown rank, or past a replica's bound.
    pub dispatches_refused: IntCounterVec,
    /// Reported prefix chains the book did not hold past its hash bound (their blocks count whole).
    pub dispatch_chains_dropped: IntCounter,
    /// Dispatches replicas reported again on a new stream (started before it opened).
    pub dispatches_replayed: IntCounter,
    /// Times the dispatch book started over empty after a panic in its task.
    pub dispatch_book_restarts: IntCounter,
    /// Discovery events by `kind` (put, delete, resync, malformed, oversized, over_capacity,
    /// duplicate, unsupported, skipped, restart).
    pub discovery_events: IntCounterVec,
    /// 1 while every discovery watch is open.
    pub discovery_connected: IntGauge,
    /// SIGHUP reloads by `result` (applied, refused).
    pub config_reloads: IntCounterVec,
    /// Discovered workers by `role` (prefill, decode, aggregated, unknown, excluded).
    pub registry_workers: IntGaugeVec,
    /// Discovered event publishers by `topic` (kv_metrics, kv-events).
    pub registry_publishers: IntGaugeVec,
    /// The discovery registry's generation.
    pub registry_generation: IntGauge,
    /// kv_metrics messages by `result` (see `load::LoadEvent`).
    pub load_events: IntCounterVec,
    /// Running kv_metrics subscriptions by `state` and `transport`.
    pub load_subscriptions: IntGaugeVec,
    /// Per-rank load fields, labelled `namespace`, `worker` (hex) and `dp_rank`.
    pub load_gauges: LoadGauges,
    /// kv-events events (and refused messages and sessions) by `result` (see `kv::KvEventResult`).
    pub kv_events: IntCounterVec,
    /// Running kv-events subscriptions by `state` and `transport`.
    pub kv_subscriptions: IntGaugeVec,
    /// Publishers of a `topic` (kv_metrics, kv-events) past the subscription cap, not subscribed.
    pub subscriptions_left_out: IntGaugeVec,
    /// Subscription sessions ended, by `topic` and `reason` (see `load::EndReason`).
    pub subscription_sessions_ended: IntCounterVec,
    /// The KV index's size: `nodes`, `ownerships`, `ranks`, `bytes`.
    pub kv_index: IntGaugeVec,
    /// What ZMTP message buffers borrow from the budget for large messages; read at each scrape.
    zmtp_borrowed: IntGauge,
    /// FindMatches calls by `result` (ok, disabled, too_large, over_budget,
    /// over_connection_budget). `too_large` is the codec's count of lookups refused before
    /// they were decoded, read at each scrape.
    pub kv_find_matches: IntCounterVec,
    /// FindMatches answers that suggested a rank weighed against recent lookups (some had gone
    /// to a contender); tie-breaks are not counted.
    pub kv_find_matches_suggested: IntCounter,
    /// The bytes the lookups in flight hold of their budget (`grpc::MAX_LOOKUP_BYTES_IN_FLIGHT`).
    pub kv_lookup_bytes_held: IntGauge,
    /// Provisional prefix chains by `result` (see `kv::ProvisionalResult`).
    pub kv_provisional: IntCounterVec,
    /// Provisional chains held: `chains`, `hashes`.
    pub kv_provisional_held: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let metrics = Self {
            fleet_version: IntGauge::new("continuum_fleet_version", "Version of the published fleet view")?,
            fleet_workers: IntGauge::new("continuum_fleet_workers", "Workers in the published fleet view")?,
            replicas_connected: IntGauge::new("continuum_fleet_replicas_connected", "Open Fleet Watch streams")?,
            updates_sent: IntCounterVec::new(
                Opts::new("continuum_fleet_updates_sent_total", "Fleet updates sent to data-plane replicas"),
                &["kind"],
            )?,
            replica_replies: IntCounterVec::new(
                Opts::new("continuum_fleet_replica_replies_total", "Acks and nacks received from replicas"),
                &["result"],
            )?,
            watch_refused: IntCounterVec::new(
                Opts::new(
                    "continuum_fleet_watch_refused_total",
                    "Watch streams refused, by reason: before the first update (bad_hello, not_seeded, too_many_sessions, ...), or later for a message that could not be read (bad_message: past the size bound, or not decodable) or that ends the session (bad_ack, bad_nack: a version never sent; report_too_large; reports_behind: the book's queue had no room; book_restarted; snapshot_refused; updates_refused: twice within the resync interval)",
                ),
                &["reason"],
            )?,
            watch_superseded: IntCounter::new(
                "continuum_fleet_watch_superseded_total",
                "Watch streams ended because the same replica id opened a new one",
            )?,
            watch_stalled: IntCounter::new(
                "continuum_fleet_watch_stalled_total",
                "Watch streams ended because their replica read nothing (or acknowledged no snapshot) for 10 s while updates waited",
            )?,
            admin_unauthenticated: IntCounter::new(
                "continuum_admin_unauthenticated_total",
                "Admin API calls refused because they did not present admin.token",
            )?,
            unauthenticated: IntCounter::new(
                "continuum_fleet_unauthenticated_total",
                "Fleet gRPC calls refused because they did not present control_plane.token",
            )?,
            calls_refused: IntCounterVec::new(
                Opts::new(
                    "continuum_fleet_calls_refused_total",
                    "gRPC calls refused because as many of their kind were in flight as the process allows (health_check: 64, get_snapshot: 4)",
                ),
                &["call"],
            )?,
            watch_retired: IntCounter::new(
                "continuum_fleet_watch_retired_total",
                "Watch streams ended because the credential they were opened with is no longer accepted (a retired token, a changed client CA)",
            )?,
            fleet_tls_reloads: IntCounterVec::new(
                Opts::new(
                    "continuum_fleet_tls_reloads_total",
                    "Changed control_plane.tls files read again, applied or refused (the running ones kept)",
                ),
                &["result"],
            )?,
            fleet_tls_certificate_not_after: IntGauge::new(
                "continuum_fleet_tls_certificate_not_after_seconds",
                "When the certificate the Fleet service serves expires, in Unix seconds (0 without TLS)",
            )?,
            fleet_tls_handshakes_failed: IntCounterVec::new(
                Opts::new(
                    "continuum_fleet_tls_handshakes_failed_total",
                    "Fleet connections whose TLS handshake did not complete, by reason",
                ),
                &["reason"],
            )?,
            connections_closed: IntCounterVec::new(
                Opts::new(
                    "continuum_connections_closed_total",
                    "Connections a listener closed itself, by listener (fleet, admin) and reason: full (its most connections held already), peer_full (its address held its most), silent (nothing sent at all for 30 s), idle (nothing more for 30 s), no_call (a fleet connection that opened no admitted call within 30 s), head_timeout (an admin request head not whole within 10 s) or unread (it read nothing of what was written to it for 30 s)",
                ),
                &["listener", "reason"],
            )?,
            dispatch_reports_dropped: IntCounter::new(
                "continuum_fleet_dispatch_reports_dropped_total",
                "Replica dispatch reports dropped, ending the replica's session: past a report's bounds, past the session's share of the backlog book's queue, or with no room in the queue for 2 s",
            )?,
            dispatches_refused: IntCounterVec::new(
                Opts::new(
                    "continuum_fleet_dispatches_refused_total",
                    "Reported dispatches the backlog book refused, by reason: unknown_rank (none named, or one the fleet does not have), implausible (more tokens or blocks than any request), replica_full (past a replica's bound), book_full (past the book's, for a replica holding its share)",
                ),
                &["reason"],
            )?,
            dispatch_chains_dropped: IntCounter::new(
                "continuum_fleet_dispatch_chains_dropped_total",
                "Dispatch prefix chains not held past the book's hash bound (their blocks count whole)",
            )?,
            dispatches_replayed: IntCounter::new(
                "continuum_fleet_dispatches_replayed_total",
                "Dispatch legs (one per pinned worker rank) replicas reported again on a new stream, started before it opened",
            )?,
            dispatch_book_restarts: IntCounter::new(
                "continuum_fleet_dispatch_book_restarts_total",
                "Times the fleet-wide dispatch book started over empty after an internal fault (a panic), ending every replica's stream so that it reports its dispatches again (past 3 in a minute it gives up and drops reports unread)",
            )?,
            discovery_events: IntCounterVec::new(
                Opts::new("continuum_dynamo_discovery_events_total", "Discovery events by kind"),
                &["kind"],
            )?,
            config_reloads: IntCounterVec::new(
                Opts::new("continuum_config_reloads_total", "Configuration reloads on SIGHUP, by result"),
                &["result"],
            )?,
            discovery_connected: IntGauge::new(
                "continuum_dynamo_discovery_connected",
                "1 while discovery serves a fleet: every etcd watch open, or a static or simulated fleet; 0 when discovery is off or a watch is down",
            )?,
            registry_workers: IntGaugeVec::new(
                Opts::new("continuum_dynamo_workers", "Discovered workers by role"),
                &["role"],
            )?,
            registry_publishers: IntGaugeVec::new(
                Opts::new("continuum_dynamo_publishers", "Discovered event publishers by topic"),
                &["topic"],
            )?,
            registry_generation: IntGauge::new(
                "continuum_dynamo_registry_generation",
                "Generation of the discovery registry",
            )?,
            load_events: IntCounterVec::new(
                Opts::new("continuum_dynamo_load_events_total", "kv_metrics messages and sessions by result"),
                &["result"],
            )?,
            load_subscriptions: IntGaugeVec::new(
                Opts::new(
                    "continuum_dynamo_load_subscriptions",
                    "Running kv_metrics subscriptions by state and transport",
                ),
                &["state", "transport"],
            )?,
            load_gauges: LoadGauges::new()?,
            kv_events: IntCounterVec::new(
                Opts::new("continuum_dynamo_kv_events_total", "kv-events events, messages and sessions by result"),
                &["result"],
            )?,
            kv_subscriptions: IntGaugeVec::new(
                Opts::new(
                    "continuum_dynamo_kv_subscriptions",
                    "Running kv-events subscriptions by state and transport",
                ),
                &["state", "transport"],
            )?,
            subscriptions_left_out: IntGaugeVec::new(
                Opts::new(
                    "continuum_dynamo_subscriptions_left_out",
                    "Publishers past the subscription cap, not subscribed, by topic",
                ),
                &["topic"],
            )?,
            subscription_sessions_ended: IntCounterVec::new(
                Opts::new(
                    "continuum_dynamo_subscription_sessions_ended_total",
                    "kv_metrics and kv-events sessions ended, by topic and reason",
                ),
                &["topic", "reason"],
            )?,
            kv_index: IntGaugeVec::new(
                Opts::new("continuum_dynamo_kv_index", "Size of the KV radix index"),
                &["what"],
            )?,
            zmtp_borrowed: IntGauge::new(
                "continuum_dynamo_zmtp_borrowed_bytes",
                "Bytes lent from the budget for large messages: ZMTP message buffers past their own 64 KiB, and decoded kv-events batches past their frames while applied",
            )?,
            kv_find_matches: IntCounterVec::new(
                Opts::new("continuum_dynamo_kv_find_matches_total", "FindMatches calls by result"),
                &["result"],
            )?,
            kv_find_matches_suggested: IntCounter::new(
                "continuum_dynamo_kv_find_matches_suggested_total",
                "FindMatches answers that suggested a rank, weighing the lookups of the last few milliseconds",
            )?,
            kv_lookup_bytes_held: IntGauge::new(
                "continuum_dynamo_kv_lookup_bytes_held",
                "Bytes the FindMatches calls in flight hold of their budget: the length each message declares",
            )?,
            kv_provisional: IntCounterVec::new(
                Opts::new(
                    "continuum_dynamo_kv_provisional_total",
                    "Provisional prefix credits from pinned dispatches by result",
                ),
                &["result"],
            )?,
            kv_provisional_held: IntGaugeVec::new(
                Opts::new(
                    "continuum_dynamo_kv_provisional_held",
                    "Provisional prefix chains held, and their block hashes",
                ),
                &["what"],
            )?,
            registry,
        };
        for event in LoadEvent::ALL {
            metrics.load_events.with_label_values(&[event.as_str()]);
        }
        for result in ["applied", "refused"] {
            metrics.config_reloads.with_label_values(&[result]);
            metrics.fleet_tls_reloads.with_label_values(&[result]);
        }
        for failure in HandshakeFailure::ALL {
            metrics.fleet_tls_handshakes_failed.with_label_values(&[failure.as_str()]);
        }
        for result in KvEventResult::ALL {
            metrics.kv_events.with_label_values(&[result.as_str()]);
        }
        for reason in crate::fleet::Refusal::ALL {
            metrics.dispatches_refused.with_label_values(&[reason.as_str()]);
        }
        for result in ProvisionalResult::ALL {
            metrics.kv_provisional.with_label_values(&[result.as_str()]);
        }
        for topic in [Topic::KvMetrics, Topic::KvEvents] {
            for reason in EndReason::ALL {
                metrics.subscription_sessions_ended.with_label_values(&[topic.as_str(), reason.as_str()]);
            }
        }
        for state in SubscriptionState::ALL {
            for transport in [LoadTransport::Direct, LoadTransport::Broker] {
                metrics.load_subscriptions.with_label_values(&[state.as_str(), transport_label(transport)]);
                metrics.kv_subscriptions.with_label_values(&[state.as_str(), transport_label(transport)]);
            }
        }
        for collector in [
            Box::new(metrics.fleet_version.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.fleet_workers.clone()),
            Box::new(metrics.replicas_connected.clone()),
            Box::new(metrics.updates_sent.clone()),
            Box::new(metrics.replica_replies.clone()),
            Box::new(metrics.watch_refused.clone()),
            Box::new(metrics.watch_superseded.clone()),
            Box::new(metrics.watch_stalled.clone()),
            Box::new(metrics.unauthenticated.clone()),
            Box::new(metrics.calls_refused.clone()),
            Box::new(metrics.admin_unauthenticated.clone()),
            Box::new(metrics.watch_retired.clone()),
            Box::new(metrics.fleet_tls_reloads.clone()),
            Box::new(metrics.fleet_tls_certificate_not_after.clone()),
            Box::new(metrics.fleet_tls_handshakes_failed.clone()),
            Box::new(metrics.connections_closed.clone()),
            Box::new(metrics.dispatch_reports_dropped.clone()),
            Box::new(metrics.dispatches_refused.clone()),
            Box::new(metrics.dispatch_chains_dropped.clone()),
            Box::new(metrics.dispatches_replayed.clone()),
            Box::new(metrics.dispatch_book_restarts.clone()),
            Box::new(metrics.discovery_events.clone()),
            Box::new(metrics.config_reloads.clone()),
            Box::new(metrics.discovery_connected.clone()),
            Box::new(metrics.registry_workers.clone()),
            Box::new(metrics.registry_publishers.clone()),
            Box::new(metrics.registry_generation.clone()),
            Box::new(metrics.load_events.clone()),
            Box::new(metrics.load_subscriptions.clone()),
            Box::new(metrics.load_gauges.active_decode_blocks.clone()),
            Box::new(metrics.load_gauges.active_prefill_tokens.clone()),
            Box::new(metrics.load_gauges.kv_used_blocks.clone()),
            Box::new(metrics.kv_events.clone()),
            Box::new(metrics.kv_subscriptions.clone()),
            Box::new(metrics.subscriptions_left_out.clone()),
            Box::new(metrics.subscription_sessions_ended.clone()),
            Box::new(metrics.kv_index.clone()),
            Box::new(metrics.zmtp_borrowed.clone()),
            Box::new(metrics.kv_find_matches.clone()),
            Box::new(metrics.kv_find_matches_suggested.clone()),
            Box::new(metrics.kv_lookup_bytes_held.clone()),
            Box::new(metrics.kv_provisional.clone()),
            Box::new(metrics.kv_provisional_held.clone()),
        ] {
            metrics.registry.register(collector)?;
        }
        Ok(metrics)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        self.zmtp_borrowed.set(i64::try_from(LARGE_MESSAGES.lent()).unwrap_or(i64::MAX));
        let too_large = self.kv_find_matches.with_label_values(&["too_large"]);
        too_large.inc_by(continuum_proto::codec::lookups_refused().saturating_sub(too_large.get()));
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for the text format; an error would only lose a scrape.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
