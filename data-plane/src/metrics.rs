//! The data plane's Prometheus metrics. One registry per replica (not the global default), so
//! tests can run several replicas in one process. Every label set is closed.

use prometheus::{Encoder, Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use crate::fleet::FleetStatus;

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
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
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
            snapshot_age_seconds: Gauge::new(
                "continuum_fleet_snapshot_age_seconds",
                "Seconds the fleet view has been last-known-good instead of current (0 while connected)",
            )?,
        };
        for collector in [
            Box::new(metrics.stream_connected.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.updates.clone()),
            Box::new(metrics.reconnects.clone()),
            Box::new(metrics.view_version.clone()),
            Box::new(metrics.view_workers.clone()),
            Box::new(metrics.snapshot_age_seconds.clone()),
        ] {
            metrics.registry.register(collector)?;
        }
        Ok(metrics)
    }

    /// The text exposition, with the fleet gauges brought up to date first.
    pub fn render(&self, fleet: FleetStatus) -> String {
        self.view_version.set(fleet.version.map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX)));
        self.view_workers.set(i64::try_from(fleet.workers).unwrap_or(i64::MAX));
        self.snapshot_age_seconds.set(fleet.snapshot_age.map_or(0.0, |a| a.as_secs_f64()));
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for the text format; an error would only lose a scrape.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
