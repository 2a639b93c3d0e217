//! The discovery supervisor: runs the configured source and replaces it on reload, following
//! the reload classes of `reload`. Stopping a watcher waits up to [`STOP_GRACE`] before
//! aborting it, so a transition never hangs on a stuck etcd call.

use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::registry::Registry;
use super::reload::{DiscoveryReload, RegistryOnRestart, classify};
use super::simulator::{ShimSocket, Simulator, SimulatorError};
use super::{etcd, static_fleet};
use crate::config::{Config, DiscoverySource};
use crate::discovery::Fleet;
use crate::metrics::Metrics;

/// How long a stopping watcher may take to finish before it is aborted.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// A source this build cannot run.
#[derive(Debug, thiserror::Error)]
#[error("discovery source `{0}` is not available in this build yet; use `static`, `simulator` or `etcd`")]
pub struct SourceUnavailable(pub &'static str);

/// Why a discovery source could not start.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Unavailable(#[from] SourceUnavailable),
    #[error(transparent)]
    Simulator(#[from] SimulatorError),
}

#[derive(Debug)]
pub struct DiscoverySupervisor {
    registry: Registry,
    metrics: Metrics,
    config: Config,
    running: Option<(CancellationToken, JoinHandle<()>)>,
    /// The simulated shim's socket while the simulator is the source: a simulator restarted on
    /// the same address listens on it again ([`ShimSocket`]).
    shim_socket: Option<ShimSocket>,
    shutdown: CancellationToken,
    /// The etcd resyncs counted when the fleet was last emptied (at start, or by a reload that
    /// reset the registry): the fleet is seeded again only past them.
    resyncs_when_emptied: u64,
}

impl DiscoverySupervisor {
    /// Starts discovery as `config` says.
    pub fn start(
        config: &Config,
        registry: Registry,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Result<Self, SourceError> {
        check_available(config)?;
        let resyncs_when_emptied = resyncs(&metrics);
        let mut supervisor = Self {
            registry,
            metrics,
            config: config.clone(),
            running: None,
            shim_socket: None,
            shutdown,
            resyncs_when_emptied,
        };
        supervisor.launch(None)?;
        Ok(supervisor)
    }

    /// The etcd resyncs counted when the fleet was last emptied: an etcd fleet is seeded once
    /// `continuum_dynamo_discovery_events_total{kind="resync"}` passes it.
    pub fn resyncs_when_emptied(&self) -> u64 {
        self.resyncs_when_emptied
    }

    /// The source name for the admin API.
    pub fn source(&self) -> &'static str {
        if self.config.dynamo.enabled { self.config.dynamo.discovery.source.as_str() } else { "disabled" }
    }

    /// Applies a new configuration's discovery section ([`Self::prepare`], then
    /// [`Self::apply`]).
    pub async fn reload(&mut self, new: &Config) -> Result<(), SourceError> {
        let prepared = self.prepare(new)?;
        self.apply(new, prepared).await
    }

    /// What may refuse `new` is checked, and taken, while the running source runs on
    /// untouched: the source is one this build runs, and a new simulator's shim port is bound.
    /// A caller with changes of its own to make (the Fleet tokens) makes them between this
    /// and [`Self::apply`], so that a refused reload changes nothing at all.
    pub fn prepare(&mut self, new: &Config) -> Result<Prepared, SourceError> {
        check_available(new)?;
        let bound = match classify(&self.config, new) {
            DiscoveryReload::Restart { .. } => self.bind_new_simulator(new)?,
            DiscoveryReload::Keep | DiscoveryReload::Stop => None,
        };
        Ok(Prepared { bound })
    }

    /// Applies a new configuration's discovery section, `prepared` for it. A new source that
    /// fails to start gives way to the one that ran before, and the error says why: the reload
    /// is refused whole, and the next one is judged against the configuration still running.
    pub async fn apply(&mut self, new: &Config, prepared: Prepared) -> Result<(), SourceError> {
        let action = classify(&self.config, new);
        let previous = std::mem::replace(&mut self.config, new.clone());
        match action {
            DiscoveryReload::Keep => {}
            DiscoveryReload::Stop => {
                self.stop().await;
                self.shim_socket = None;
                self.registry.publish(Fleet::default());
                tracing::info!("discovery stopped: dynamo.enabled is false");
            }
            DiscoveryReload::Restart { reason, registry } => {
                // A new simulator took its shim's port before the running source stops
                // (`prepare`), so a port that is taken refused the reload with the fleet untouched.
                let bound = prepared.bound;
                tracing::info!(reason = reason.as_str(), "replacing the discovery watcher");
                self.metrics.discovery_events.with_label_values(&["restart"]).inc();
                self.stop().await;
                if !simulates(new) {
                    self.shim_socket = None;
                }
                match registry {
                    RegistryOnRestart::Keep => {}
                    RegistryOnRestart::Reset => {
                        self.registry.publish(Fleet::default());
                        self.resyncs_when_emptied = resyncs(&self.metrics);
                    }
                    RegistryOnRestart::Prune { keep } => self.registry.prune_namespaces(&keep),
                }
                if let Err(error) = self.launch(bound) {
                    self.config = previous;
                    if let Err(again) = self.launch(None) {
                        tracing::error!(error = %again, "the discovery source that ran before failed to start again");
                    }
                    return Err(error.into());
                }
            }
        }
        Ok(())
    }

    /// Stops the running watcher: cancel, wait up to [`STOP_GRACE`], then abort.
    pub async fn stop(&mut self) {
        if let Some((cancel, mut task)) = self.running.take() {
            cancel.cancel();
            if tokio::time::timeout(STOP_GRACE, &mut task).await.is_err() {
                tracing::warn!("discovery watcher did not stop within {STOP_GRACE:?}; aborting it");
                task.abort();
                // Aborting takes effect at the task's next await: until then it could still
                // publish the fleet it was folding, over the one published after this returns.
                let _ = task.await;
            }
        }
        // Even without a task: a static fleet, which has none, read as connected while served.
        self.metrics.discovery_connected.set(0);
    }

    /// The simulator `new` runs, if any, bound while the running source still runs. On the
    /// running simulator's shim address it listens on the socket kept for it.
    fn bind_new_simulator(&mut self, new: &Config) -> Result<Option<Simulator>, SimulatorError> {
        if !simulates(new) {
            return Ok(None);
        }
        Simulator::bind_keeping(&new.dynamo.discovery.simulator, &mut self.shim_socket).map(Some)
    }

    /// Starts the configured source; a simulator already bound (`bound`) is the one run.
    fn launch(&mut self, bound: Option<Simulator>) -> Result<(), SimulatorError> {
        if !self.config.dynamo.enabled {
            tracing::info!("discovery is disabled (dynamo.enabled: false)");
            return Ok(());
        }
        let discovery = &self.config.dynamo.discovery;
        match discovery.source {
            DiscoverySource::Static => {
                let previous = &self.registry.current().fleet;
                self.registry.publish(static_fleet::static_fleet(&discovery.static_fleet, SystemTime::now(), previous));
                // Nothing to lose touch with: an alert on a disconnected source must not fire.
                self.metrics.discovery_connected.set(1);
            }
            DiscoverySource::Etcd => {
                let cancel = self.shutdown.child_token();
                let task = tokio::spawn(etcd::run(
                    discovery.etcd.clone(),
                    self.config.namespaces(),
                    self.registry.clone(),
                    self.metrics.clone(),
                    cancel.clone(),
                ));
                self.running = Some((cancel, task));
            }
            DiscoverySource::Simulator => {
                let simulator = match bound {
                    Some(simulator) => simulator,
                    None => Simulator::bind_keeping(&discovery.simulator, &mut self.shim_socket)?,
                };
                let cancel = self.shutdown.child_token();
                let task = tokio::spawn(simulator.run(self.registry.clone(), cancel.clone()));
                self.running = Some((cancel, task));
                self.metrics.discovery_connected.set(1);
            }
            // Refused by `check_available` before we get here.
            DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods => {}
        }
        Ok(())
    }
}

/// What [`DiscoverySupervisor::prepare`] took for a reload: the new simulator, bound.
#[derive(Debug)]
pub struct Prepared {
    bound: Option<Simulator>,
}

fn simulates(config: &Config) -> bool {
    config.dynamo.enabled && config.dynamo.discovery.source == DiscoverySource::Simulator
}

fn resyncs(metrics: &Metrics) -> u64 {
    metrics.discovery_events.with_label_values(&["resync"]).get()
}

fn check_available(config: &Config) -> Result<(), SourceUnavailable> {
    match config.dynamo.discovery.source {
        DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods if config.dynamo.enabled => {
            Err(SourceUnavailable(config.dynamo.discovery.source.as_str()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::load_str;
    use crate::fleet::FleetPublisher;

    fn config(yaml: &str) -> Config {
        load_str(yaml, &|_| None).unwrap_or_else(|error| panic!("{error:?}")).config
    }

    /// `continuum_dynamo_discovery_connected` is what the admin API reports as `connected`: a
    /// static fleet is connected while served, and discovery switched off is not connected.
    #[tokio::test]
    async fn the_connected_gauge_follows_the_source_on_and_off() {
        let metrics = Metrics::new().expect("metrics");
        let registry = Registry::new(FleetPublisher::new(Arc::default()));
        let on = config(
            "dynamo: {enabled: true, discovery: {source: static, static: {workers: [{instance_id: 1, role: decode, model: m}]}}}",
        );
        let mut supervisor =
            DiscoverySupervisor::start(&on, registry, metrics.clone(), CancellationToken::new()).expect("started");
        assert_eq!((supervisor.source(), metrics.discovery_connected.get()), ("static", 1));
        supervisor.reload(&config("dynamo: {enabled: false}")).await.expect("reloaded");
        assert_eq!((supervisor.source(), metrics.discovery_connected.get()), ("disabled", 0));
    }
}
