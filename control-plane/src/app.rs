//! Starting and stopping the control plane: the fleet publisher, its discovery source, the
//! Fleet gRPC server and the admin HTTP server. The binary and the tests both go through
//! [`ControlPlane::start`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminSettings, AdminState, Seeded};
use crate::bearer;
use crate::config::{Config, ControlPlaneConfig, DiscoverySource};
use crate::fleet::{FleetChange, FleetPublisher};
use crate::gauges;
use crate::grpc::tls::{self, TlsError};
use crate::grpc::{self, FleetService, Replicas, ServerTls};
use crate::kv::{KvSupervisor, kv_options};
use crate::listen::{Guard, GuardedListener};
use crate::load::{LoadOptions, LoadSupervisor};
use crate::metrics::Metrics;
use crate::sources::{DiscoverySupervisor, Registry, SourceError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen for {what} on {addr}: {source} (is another process using the port?)")]
    Bind { what: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("control_plane.tls: {0}")]
    Tls(#[from] TlsError),
}

/// Where to listen, when the command line overrides the configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct ListenOverrides {
    pub grpc: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
}

/// How long shutdown waits for each server (gRPC, admin) to finish its open streams.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub publisher: FleetPublisher,
    pub replicas: Replicas,
    pub metrics: Metrics,
    config: Config,
    discovery: DiscoverySupervisor,
    load: LoadSupervisor,
    kv: KvSupervisor,
    settings: watch::Sender<AdminSettings>,
    fleet_tokens: watch::Sender<Vec<bearer::Token>>,
    tls: Option<ServerTls>,
    cancel: CancellationToken,
    /// Cancelled when a server (gRPC or admin) stops before the shutdown asked it to.
    failed: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("control_plane.tls: {0}")]
    Tls(#[from] TlsError),
    #[error("dynamo.discovery.etcd.tls: {0}")]
    EtcdTls(String),
}

/// The tokens `config` leaves unset for listeners bound off-host, with their addresses.
fn untokened_off_host(config: &Config, grpc: SocketAddr, admin: SocketAddr) -> Vec<(&'static str, SocketAddr)> {
    [
        ("control_plane.token", grpc, config.control_plane.token.is_some()),
        ("admin.token", admin, config.admin.token.is_some()),
    ]
    .into_iter()
    .filter(|(_, addr, has_token)| !addr.ip().is_loopback() && !has_token)
    .map(|(key, addr, _)| (key, addr))
    .collect()
}

fn admin_settings(config: &Config, discovery: &DiscoverySupervisor) -> AdminSettings {
    AdminSettings {
        token: config.admin.token.as_ref().map(|t| bearer::Token::new(t.expose())),
        source: discovery.source(),
        namespaces: config.namespaces().into(),
        resyncs_when_emptied: discovery.resyncs_when_emptied(),
    }
}

/// The tokens the Fleet service accepts: `token`, and `previous_token` during a rotation.
fn fleet_tokens(config: &Config) -> Vec<bearer::Token> {
    let ControlPlaneConfig { token, previous_token, .. } = &config.control_plane;
    [token, previous_token].into_iter().flatten().map(|t| bearer::Token::new(t.expose())).collect()
}

impl ControlPlane {
    pub async fn start(config: Config, listen: ListenOverrides) -> Result<Self, StartError> {
        let metrics = Metrics::new()?;
        // Before anything starts: a certificate that does not load leaves nothing running.
        let tls = config.control_plane.tls.as_ref().map(|paths| ServerTls::load(paths, &metrics)).transpose()?;
        let grpc_listener =
            bind("the Fleet gRPC service", listen.grpc.unwrap_or(config.control_plane.grpc_listen)).await?;
        let admin_listener = bind("admin HTTP", listen.admin.unwrap_or(config.admin.listen)).await?;
        let grpc_addr = local_addr("the Fleet gRPC service", &grpc_listener)?;
        let admin_addr = local_addr("admin HTTP", &admin_listener)?;

        let publisher = FleetPublisher::new(Arc::new(config.data_plane_config()));
        let replicas = Replicas::default();
        let cancel = CancellationToken::new();
        // Whatever was started is stopped again if a later step fails.
        let started = cancel.clone().drop_guard();
        let registry = Registry::new(publisher.clone());
        let mut tasks = vec![
            tokio::spawn(gauges::follow_fleet(publisher.subscribe(), metrics.clone(), cancel.clone())),
            tokio::spawn(gauges::follow_registry(registry.subscribe(), metrics.clone(), cancel.clone())),
        ];
        let load = LoadSupervisor::start(
            &config.dynamo.load,
            LoadOptions::default(),
            registry.subscribe(),
            publisher.clone(),
            &metrics,
            cancel.child_token(),
        );
        let registry = registry.with_loads(load.view().store);
        let kv = KvSupervisor::start(&config, kv_options(), registry.subscribe(), &metrics, cancel.child_token());
        let discovery = DiscoverySupervisor::start(&config, registry.clone(), metrics.clone(), cancel.clone())?;
        let (settings, settings_rx) = watch::channel(admin_settings(&config, &discovery));

        let seeded = Seeded::new(settings_rx.clone(), &metrics);
        let (fleet_tokens, fleet_tokens_rx) = watch::channel(fleet_tokens(&config));
        let service = FleetService::new(publisher.clone(), replicas.clone(), metrics.clone(), cancel.clone())
            .with_kv(kv.handle())
            .with_seeded(move || seeded.check())
            .with_tokens(fleet_tokens_rx);
        let service = match &tls {
            Some(tls) => service.with_trust(tls.trust_changes()),
            None => service,
        };
        if let Some(tls) = &tls {
            tasks.push(tokio::spawn(tls.clone().follow_files(tls::RELOAD_INTERVAL, cancel.clone())));
        }
        let failed = CancellationToken::new();
        let (shutdown, serving_tls) = (cancel.clone(), tls.clone());
        let (fleet_guard, admin_guard) = (Guard::fleet(&metrics), Guard::admin(&metrics));
        let serving = grpc::serve((grpc_listener, fleet_guard), service, serving_tls, shutdown);
        tasks.push(tokio::spawn(watch_server("the Fleet gRPC server", serving, cancel.clone(), failed.clone())));

        let admin_state = AdminState {
            registry,
            publisher: publisher.clone(),
            replicas: replicas.clone(),
            metrics: metrics.clone(),
            settings: settings_rx,
            load: load.view(),
            kv: kv.view(),
        };
        let listener = GuardedListener::new(admin_listener, admin_guard);
        let serving = listener.serve(admin::router(admin_state), cancel.clone()).map(Ok::<(), Infallible>);
        tasks.push(tokio::spawn(watch_server("the admin HTTP server", serving, cancel.clone(), failed.clone())));
        tracing::info!(%grpc_addr, %admin_addr, source = discovery.source(), "control plane started");
        started.disarm();
        Ok(Self {
            grpc_addr,
            admin_addr,
            publisher,
            replicas,
            metrics,
            config,
            discovery,
            load,
            kv,
            settings,
            fleet_tokens,
            tls,
            cancel,
            failed,
            tasks,
        })
    }

    /// Resolves when a server stopped before the shutdown asked it to (logged as it happened):
    /// a control plane that serves no replicas must end with a failure for its supervisor to
    /// restart it, not idle on as if healthy.
    pub fn failed(&self) -> impl Future<Output = ()> + Send + 'static {
        self.failed.clone().cancelled_owned()
    }

    /// Applies a new configuration without a restart: the data plane's part goes out on the
    /// Fleet stream at once, discovery follows its reload class, and the admin token, the
    /// listing, the Fleet service's token (ending the streams opened with a token it retires)
    /// and its certificate files change. Listen addresses, and whether the Fleet service runs TLS at all, need a
    /// restart; a change to them is logged and ignored.
    pub async fn reload(&mut self, mut config: Config) -> Result<(), ReloadError> {
        let running_tls = self.config.control_plane.tls.clone();
        // Files that moved are read and checked before anything changes: a refused reload
        // changes nothing, and what was checked is what is served.
        let moved_tls = match (&self.tls, &config.control_plane.tls) {
            (Some(_), Some(paths)) if running_tls.as_ref() != Some(paths) => {
                let paths = paths.clone();
                let read = tokio::time::timeout(FILE_READ_WAIT, read_tls_files(move || tls::prepare(&paths))).await;
                Some(read.map_err(|_| TlsError::Config(not_read_in_time()))??)
            }
            _ => None,
        };
        // A new etcd connection's TLS files too (on the blocking pool, as a stalled volume may
        // hold a read): one that could never connect is refused, not put in the running
        // watcher's place.
        let (running, next) = (&self.config.dynamo, &config.dynamo);
        let (was, etcd) = (&running.discovery.etcd, &next.discovery.etcd);
        // As the reload classes have it: a watcher is replaced for a new connection only.
        let connects_anew = !running.enabled
            || running.discovery.source != next.discovery.source
            || (&was.endpoints, &was.tls, &was.auth) != (&etcd.endpoints, &etcd.tls, &etcd.auth);
        if next.enabled && next.discovery.source == DiscoverySource::Etcd && etcd.tls.is_some() && connects_anew {
            let etcd = etcd.clone();
            let check = tokio::task::spawn_blocking(move || crate::sources::etcd::check_tls_files(&etcd));
            let checked = tokio::time::timeout(FILE_READ_WAIT, check).await.map_err(|_| not_read_in_time());
            checked
                .and_then(|joined| joined.unwrap_or_else(|error| Err(error.to_string())))
                .map_err(ReloadError::EtcdTls)?;
        }
        // What may refuse the reload in discovery is checked first: the tokens, once replaced,
        // have ended the streams opened with one they retire, which putting them back would
        // not reopen.
        let prepared = self.discovery.prepare(&config)?;
        // Before discovery publishes from the new configuration (and the data-plane config goes
        // out): a replica holding a token being revoked must not be sent either first. A
        // source that then fails to start puts the running tokens back.
        let running_tokens = self.fleet_tokens.send_replace(fleet_tokens(&config));
        if let Err(error) = self.discovery.apply(&config, prepared).await {
            self.fleet_tokens.send_replace(running_tokens);
            return Err(error.into());
        }
        // At once: the restart gate reads the source and when the fleet was emptied from these,
        // and a replica let in on stale ones while the rest reloads would be sent the emptied
        // fleet in place of its last-known-good view.
        self.settings.send_replace(admin_settings(&config, &self.discovery));
        self.load.reload(&config.dynamo.load);
        // Out with the fleet discovery just published, not after KV's reload, which waits (up
        // to 5 s) for the kv-events subscriptions to stop when KV is switched off: replicas
        // would hold the new workers beside the old pools and model map meanwhile. Switched
        // off, they stop looking prefixes up at once; switched on, the index starts without a
        // wait.
        self.publisher
            .apply(FleetChange { config: Some(Arc::new(config.data_plane_config())), ..FleetChange::default() });
        self.kv.reload(&config).await;
        // The bound addresses are named: a command-line override may have replaced the file's.
        for (what, old, new, serving) in [
            (
                "control_plane.grpc_listen",
                self.config.control_plane.grpc_listen,
                config.control_plane.grpc_listen,
                self.grpc_addr,
            ),
            ("admin.listen", self.config.admin.listen, config.admin.listen, self.admin_addr),
        ] {
            if old != new {
                tracing::warn!(key = what, %new, %serving, "listen addresses change only on restart; still serving where bound");
            }
        }
        let serving = match (&self.tls, &config.control_plane.tls) {
            (Some(tls), Some(_)) => match moved_tls {
                Some(prepared) => {
                    tls.apply(prepared);
                    true
                }
                // A reload is also the operator's way to say the files were renewed: they are
                // read now rather than at the next poll, and a refusal said here too.
                // Bounded: a volume stalled on its read must not hold the reload (and every reload
                // after it) open; the poll reads the files again later.
                None => {
                    let tls = tls.clone();
                    match tokio::time::timeout(FILE_READ_WAIT, read_tls_files(move || tls.refresh())).await {
                        Ok(refreshed) => refreshed.inspect_err(warn_kept).is_ok(),
                        Err(_) => {
                            tracing::warn!(wait = ?FILE_READ_WAIT, "reload: control_plane.tls's files did not read in time; still serving the running certificate");
                            true
                        }
                    }
                }
            },
            (Some(_), None) => {
                tracing::warn!("turning control_plane.tls off needs a restart; still serving TLS");
                false
            }
            (None, Some(_)) => {
                tracing::warn!("turning control_plane.tls on needs a restart; still serving plaintext");
                false
            }
            (None, None) => true,
        };
        // What runs is what the configuration reads back, and what the next reload compares.
        if !serving {
            config.control_plane.tls = running_tls;
        }
        config.control_plane.grpc_listen = self.config.control_plane.grpc_listen;
        config.admin.listen = self.config.admin.listen;
        // The file's validation saw its own addresses, not the running ones (a command-line
        // override among them), so a token taken away is warned of here.
        for (key, addr) in untokened_off_host(&config, self.grpc_addr, self.admin_addr) {
            tracing::warn!(%addr, "reload: {key} is unset and the listener is not a loopback address: anyone who reaches it is served");
        }
        self.config = config;
        tracing::info!("configuration reloaded");
        Ok(())
    }

    /// Ends every Watch stream, stops discovery, the subscriptions and the servers, and waits
    /// for the servers [`SHUTDOWN_GRACE`] at most in all: a client holding a stream open (a
    /// gRPC health `Watch`, which ends only with the server) must not keep the process from
    /// exiting.
    pub async fn shutdown(mut self) {
        // The Watch streams end first, so that no replica reads as connected to a control
        // plane whose discovery has stopped: each knows at once that it routes on its last
        // view, counting its own dispatches. Everything stops at once, each part as it can.
        self.cancel.cancel();
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        tokio::join!(self.discovery.stop(), self.load.stop(), self.kv.stop());
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!(grace = ?SHUTDOWN_GRACE, "a server did not stop within its grace; closing it");
                task.abort();
            }
        }
    }
}

/// Runs a server to its end; an end (an error, a panic) before `shutdown` is logged and
/// cancels `failed`.
async fn watch_server<E: std::fmt::Display>(
    what: &'static str,
    serving: impl Future<Output = Result<(), E>>,
    shutdown: CancellationToken,
    failed: CancellationToken,
) {
    let Ok(result) = std::panic::AssertUnwindSafe(serving).catch_unwind().await else {
        tracing::error!("{what} panicked; the control plane exits");
        failed.cancel();
        return;
    };
    if shutdown.is_cancelled() {
        if let Err(error) = result {
            tracing::warn!(%error, "{what} failed while shutting down");
        }
        return;
    }
    match result {
        Ok(()) => tracing::error!("{what} stopped on its own; the control plane exits"),
        Err(error) => tracing::error!(%error, "{what} failed; the control plane exits"),
    }
    failed.cancel();
}

/// How long a reload waits for a file it reads (its configuration, TLS certificates and keys):
/// a volume stalled on a read must not hold the reload, and every reload after it, open.
pub const FILE_READ_WAIT: Duration = Duration::from_secs(5);

/// Reads TLS files on the blocking pool: a stalled volume must not hold a runtime thread (and
/// the Fleet streams on it), here no more than in `ServerTls::follow_files`.
async fn read_tls_files<T: Send + 'static>(
    read: impl FnOnce() -> Result<T, TlsError> + Send + 'static,
) -> Result<T, TlsError> {
    tokio::task::spawn_blocking(read).await.unwrap_or_else(|error| Err(TlsError::Config(error.to_string())))
}

/// Why a reload was refused when its files would not read.
fn not_read_in_time() -> String {
    format!("the files did not read within {FILE_READ_WAIT:?} (a stalled volume?); the reload changed nothing")
}

fn warn_kept(error: &TlsError) {
    tracing::warn!(%error, "reload: control_plane.tls's files do not load; still serving the running certificate");
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { what, addr, source })
}

fn local_addr(what: &'static str, listener: &TcpListener) -> Result<SocketAddr, StartError> {
    listener.local_addr().map_err(|source| StartError::Bind { what, addr: SocketAddr::from(([0, 0, 0, 0], 0)), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn listeners_off_host_without_their_token_are_named() {
        let (on_host, off_host): (SocketAddr, SocketAddr) =
            (([127, 0, 0, 1], 9090).into(), ([0, 0, 0, 0], 9090).into());
        let mut config = Config::default();
        assert!(untokened_off_host(&config, on_host, on_host).is_empty());
        assert_eq!(
            untokened_off_host(&config, off_host, off_host),
            [("control_plane.token", off_host), ("admin.token", off_host)]
        );
        config.admin.token = Some(Secret::new("t"));
        assert_eq!(untokened_off_host(&config, on_host, off_host), []);
    }

    /// A reload that discovery refuses changes nothing, the Fleet tokens included: replaced
    /// even for a moment, they would end the streams opened with one the reload retires, and
    /// putting them back would not reopen those.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_discovery_refuses_never_touches_the_fleet_tokens() -> anyhow::Result<()> {
        let mut config = crate::config::embedded_default();
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        config.move_simulator_shim(any_port);
        config.control_plane.grpc_listen = any_port;
        config.admin.listen = any_port;
        config.control_plane.token = Some(Secret::new("first-s3cret"));
        config.control_plane.previous_token = Some(Secret::new("old-s3cret"));
        let mut control = ControlPlane::start(config.clone(), ListenOverrides::default()).await?;
        let mut tokens = control.fleet_tokens.subscribe();
        tokens.mark_unchanged();
        let mut refused = config.clone();
        refused.control_plane.previous_token = None;
        refused.dynamo.discovery.source = crate::config::DiscoverySource::Kubernetes;
        assert!(control.reload(refused).await.is_err(), "a source this build does not have");
        assert!(!tokens.has_changed()?, "the Fleet tokens were never replaced");
        control.shutdown().await;
        Ok(())
    }

    /// A server that stops on its own, with or without an error, fails the control plane; one
    /// that stops because the shutdown asked it to does not.
    #[tokio::test]
    async fn a_server_that_stops_before_the_shutdown_fails_the_control_plane() {
        for result in [Ok(()), Err("the listener broke")] {
            let (shutdown, failed) = (CancellationToken::new(), CancellationToken::new());
            watch_server("a server", async { result }, shutdown.clone(), failed.clone()).await;
            assert!(failed.is_cancelled(), "{result:?} before the shutdown");
        }
        let (shutdown, failed) = (CancellationToken::new(), CancellationToken::new());
        let panics = futures::future::lazy(|_| -> Result<(), &str> { panic!("a bug in a server") });
        watch_server("a server", panics, shutdown, failed.clone()).await;
        assert!(failed.is_cancelled(), "a panic");
        let (shutdown, failed) = (CancellationToken::new(), CancellationToken::new());
        shutdown.cancel();
        watch_server("a server", async { Err("closed mid-stream") }, shutdown, failed.clone()).await;
        assert!(!failed.is_cancelled(), "an end the shutdown asked for");
    }
}
