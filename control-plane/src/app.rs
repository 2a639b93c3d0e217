//! Starting and stopping the control plane: the fleet publisher, its discovery source, the
//! Fleet gRPC server and the admin HTTP server. The binary and the tests both go through
//! [`ControlPlane::start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::config::{Config, DiscoverySource};
use crate::fleet::FleetPublisher;
use crate::grpc::{self, FleetService, Replicas};
use crate::metrics::Metrics;
use crate::sources::{self, Registry};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen for {what} on {addr}: {source} (is another process using the port?)")]
    Bind { what: &'static str, addr: SocketAddr, source: std::io::Error },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("discovery source `{0}` is not available in this build yet; use `static` or `etcd`")]
    SourceUnavailable(&'static str),
}

/// Where to listen, when the command line overrides the configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct ListenOverrides {
    pub grpc: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub publisher: FleetPublisher,
    pub replicas: Replicas,
    pub metrics: Metrics,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl ControlPlane {
    pub async fn start(config: Config, listen: ListenOverrides) -> Result<Self, StartError> {
        let grpc_listener = bind("the Fleet gRPC service", listen.grpc.unwrap_or(config.control_plane.grpc_listen)).await?;
        let admin_listener = bind("admin HTTP", listen.admin.unwrap_or(config.admin.listen)).await?;
        let grpc_addr = local_addr("the Fleet gRPC service", &grpc_listener)?;
        let admin_addr = local_addr("admin HTTP", &admin_listener)?;

        let metrics = Metrics::new()?;
        let publisher = FleetPublisher::new(Arc::new(config.data_plane_config()));
        let replicas = Replicas::default();
        let cancel = CancellationToken::new();
        let mut tasks = vec![tokio::spawn(follow_gauges(publisher.clone(), metrics.clone(), cancel.clone()))];

        let registry = Registry::new(publisher.clone());
        let source = match config.dynamo.discovery.source {
            DiscoverySource::Static => {
                registry.publish(sources::static_fleet(&config.dynamo.discovery.static_fleet, SystemTime::now()));
                "static"
            }
            DiscoverySource::Etcd => {
                let etcd = sources::etcd::run(
                    config.dynamo.discovery.etcd.clone(),
                    config.namespaces(),
                    registry.clone(),
                    metrics.clone(),
                    cancel.clone(),
                );
                tasks.push(tokio::spawn(etcd));
                "etcd"
            }
            other => return Err(StartError::SourceUnavailable(other.as_str())),
        };

        let service = FleetService::new(publisher.clone(), replicas.clone(), metrics.clone(), cancel.clone());
        let shutdown = cancel.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(error) = grpc::serve(grpc_listener, service, shutdown).await {
                tracing::error!(%error, "Fleet gRPC server stopped");
            }
        }));

        let admin_state = AdminState {
            registry,
            publisher: publisher.clone(),
            replicas: replicas.clone(),
            metrics: metrics.clone(),
            token: config.admin.token.as_ref().map(|t| Arc::from(t.expose())),
            source,
            namespaces: config.namespaces().into(),
        };
        let shutdown = cancel.clone();
        tasks.push(tokio::spawn(async move {
            let serve = axum::serve(admin_listener, admin::router(admin_state))
                .with_graceful_shutdown(shutdown.cancelled_owned());
            if let Err(error) = serve.await {
                tracing::error!(%error, "admin HTTP server stopped");
            }
        }));
        tracing::info!(%grpc_addr, %admin_addr, source, "control plane started");
        Ok(Self { grpc_addr, admin_addr, publisher, replicas, metrics, cancel, tasks })
    }

    /// Ends every Watch stream, stops the servers and waits for them.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { what, addr, source })
}

fn local_addr(what: &'static str, listener: &TcpListener) -> Result<SocketAddr, StartError> {
    listener.local_addr().map_err(|source| StartError::Bind { what, addr: SocketAddr::from(([0, 0, 0, 0], 0)), source })
}

/// Keeps the fleet gauges in step with the published view.
async fn follow_gauges(publisher: FleetPublisher, metrics: Metrics, cancel: CancellationToken) {
    let mut states = publisher.subscribe();
    loop {
        {
            let state = states.borrow_and_update();
            metrics.fleet_version.set(i64::try_from(state.version()).unwrap_or(i64::MAX));
            metrics.fleet_workers.set(i64::try_from(state.view().workers().len()).unwrap_or(i64::MAX));
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = states.changed() => if changed.is_err() { return },
        }
    }
}
