//! Starting and stopping one replica: the fleet client and the HTTP server, wired together.
//! The binary and the tests both start replicas through [`Replica::start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{DispatchSettings, Dispatcher, probe};
use crate::fleet::{
    self, ClientTls, DispatchReporter, EndpointError, FIND_MATCHES_DEADLINE, FleetClientConfig, FleetHandle,
    MatchesClient, TLS_RENEWAL_INTERVAL,
};
use crate::http::{self, AppState, KvSelection};
use crate::metrics::Metrics;
use crate::routing::picker::{DispatchLedger, LoadBasedPicker};
use crate::server;

/// How long requests in flight may take to finish once a replica stops accepting, before their
/// connections are cut: under the 30 s Kubernetes gives a pod between SIGTERM and SIGKILL, less
/// the default drain delay of the binary.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot follow the control plane at {url:?}: {source}")]
    ControlPlaneUrl { url: String, source: EndpointError },
}

/// How long a drained replica waits for its background tasks (the fleet stream, the probes,
/// the TLS renewal) to stop before it abandons them.
const TASK_STOP_WAIT: Duration = Duration::from_secs(2);
/// How long the binary's runtime waits, as it shuts down, for blocking work still running (a
/// TLS file read stalled on its volume) before it exits anyway.
pub const RUNTIME_SHUTDOWN_WAIT: Duration = Duration::from_secs(1);
/// The most a replica takes to exit past its drain delay and shutdown grace: a pod's
/// termination grace period must leave room for it beside them.
pub const EXIT_AFTER_GRACE: Duration = TASK_STOP_WAIT.saturating_add(RUNTIME_SHUTDOWN_WAIT);

/// A running replica.
#[derive(Debug)]
pub struct Replica {
    pub local_addr: SocketAddr,
    pub fleet: Arc<FleetHandle>,
    /// Where dispatches are reported for fleet-wide accounting.
    pub reporter: Arc<DispatchReporter>,
    pub metrics: Metrics,
    /// The pins this replica has in flight.
    pub ledger: Arc<DispatchLedger>,
    stages: server::Stages,
    server: JoinHandle<()>,
    /// Everything but the server: the fleet client, probes, prewarming, TLS renewal. Stopped
    /// last, so dispatches that end while the server drains are still reported.
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Replica {
    /// Binds `listen` and starts following the control plane.
    pub async fn start(listen: &str, config: FleetClientConfig) -> Result<Self, StartError> {
        Self::start_with(listen, config, DispatchSettings::default()).await
    }

    /// [`Replica::start`] with dispatch bounds other than the defaults (tests shorten them).
    pub async fn start_with(
        listen: &str,
        config: FleetClientConfig,
        dispatch: DispatchSettings,
    ) -> Result<Self, StartError> {
        Self::start_full(listen, config, dispatch, FIND_MATCHES_DEADLINE).await
    }

    /// Every knob: also the deadline of a `FindMatches` lookup on the request path.
    pub async fn start_full(
        listen: &str,
        config: FleetClientConfig,
        dispatch: DispatchSettings,
        find_matches_deadline: Duration,
    ) -> Result<Self, StartError> {
        let listener =
            TcpListener::bind(listen).await.map_err(|source| StartError::Bind { addr: listen.to_string(), source })?;
        let local_addr =
            listener.local_addr().map_err(|source| StartError::Bind { addr: listen.to_string(), source })?;
        let fleet = Arc::new(FleetHandle::default());
        let metrics = Metrics::new()?;
        let cancel = CancellationToken::new();
        let stages = server::Stages::default();
        let reporter = Arc::new(DispatchReporter::new(metrics.dispatch_reports_dropped.clone()));
        let matches = MatchesClient::new(&config, find_matches_deadline)
            .map_err(|source| StartError::ControlPlaneUrl { url: config.control_plane.clone(), source })?;
        // The Watch stream reads TLS files at every connection; the lookups' long-lived
        // connection is renewed when they change.
        let renewal = matches!(config.tls, Some(ClientTls::Files(_))).then(|| {
            tokio::spawn(matches.clone().follow_tls_files(config.clone(), TLS_RENEWAL_INTERVAL, cancel.clone()))
        });
        let client = tokio::spawn(fleet::run(
            config,
            Arc::clone(&fleet),
            Arc::clone(&reporter),
            metrics.clone(),
            cancel.clone(),
        ));
        let ledger = Arc::new(DispatchLedger::with_metrics(
            metrics.ledger_refused.clone(),
            metrics.prompt_estimate_ratio.clone(),
        ));
        // A new stream to the control plane reports the dispatches in flight again.
        reporter.replay_from(Arc::clone(&ledger) as Arc<dyn fleet::InFlight>);
        let picker = Arc::new(LoadBasedPicker::new(Arc::clone(&ledger), metrics.selections.clone()));
        let dispatcher = Arc::new(Dispatcher::new(dispatch, metrics.clone()));
        let prober = tokio::spawn(probe::run(Arc::clone(&dispatcher), Arc::clone(&fleet), cancel.clone()));
        let kv = Arc::new(KvSelection::new(matches, &ledger, &metrics));
        let prewarm = tokio::spawn(prewarm_kv(Arc::clone(&kv), Arc::clone(&fleet), cancel.clone()));
        let state = AppState {
            fleet: Arc::clone(&fleet),
            metrics: metrics.clone(),
            picker,
            ledger: Arc::clone(&ledger),
            reporter: Arc::clone(&reporter),
            dispatcher,
            kv,
            draining: stages.draining.clone(),
        };
        let state = Arc::new(state);
        let app = server::App { router: http::router(Arc::clone(&state)), state };
        let server = tokio::spawn(server::serve(listener, app, stages.clone()));
        tracing::info!(%local_addr, "data-plane replica listening");
        let tasks = [client, prober, prewarm].into_iter().chain(renewal).collect();
        Ok(Self { local_addr, fleet, reporter, metrics, ledger, stages, server, cancel, tasks })
    }

    /// Stops at once: accepting ends and requests in flight get [`SHUTDOWN_GRACE`] to finish.
    pub async fn shutdown(self) {
        self.drain(Duration::ZERO, SHUTDOWN_GRACE).await;
    }

    /// Shuts down the way a load balancer can follow. For `delay`, readiness fails while the
    /// replica still accepts and answers, each answer closing its connection, so clients move
    /// to other replicas as their load balancer stops choosing this one (Kubernetes removes a
    /// terminating pod's endpoints a moment after it signals it). Then accepting stops, idle
    /// connections close, and requests in flight get `grace` to finish before their
    /// connections are cut. The fleet stream runs to the end, so the control plane hears of
    /// every dispatch that ends meanwhile. Whether the server stopped as it should (not by a
    /// panic), for the exit code.
    pub async fn drain(mut self, delay: Duration, grace: Duration) -> bool {
        self.stages.draining.start();
        if !delay.is_zero() {
            tracing::info!(?delay, "draining: readiness fails; still answering while load balancers catch up");
            tokio::time::sleep(delay).await;
        }
        self.stages.closing.cancel();
        let server = match tokio::time::timeout(grace, &mut self.server).await {
            Ok(stopped) => stopped,
            Err(_) => {
                self.stages.cut.cancel();
                (&mut self.server).await
            }
        };
        if let Err(error) = &server {
            tracing::error!(%error, "the server's task failed while draining");
        }
        self.cancel.cancel();
        // Each stops at its next turn, but one may be waiting on the blocking pool (a stalled
        // volume under the TLS files): they get one short wait together, not the grace again.
        let stopped = tokio::time::Instant::now() + TASK_STOP_WAIT;
        for mut task in self.tasks {
            if tokio::time::timeout_at(stopped, &mut task).await.is_err() {
                task.abort();
            }
        }
        server.is_ok()
    }
}

/// Prewarms the KV term for each new view (cheap unless its workers or policy changed).
async fn prewarm_kv(kv: Arc<KvSelection>, fleet: Arc<FleetHandle>, cancel: CancellationToken) {
    let mut versions = fleet.subscribe();
    loop {
        if let Some(view) = fleet.view() {
            kv.routing.prewarm(&view);
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = versions.changed() => if changed.is_err() { return },
        }
    }
}
