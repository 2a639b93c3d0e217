//! `continuum-data-plane --listen ADDR --control-plane URL [--replica-id ID] [--find-matches-deadline 2ms]`

use std::process::ExitCode;

use clap::Parser;
use continuum_data_plane::dispatch::DispatchSettings;
use continuum_data_plane::fleet::FleetClientConfig;
use continuum_data_plane::replica::Replica;

#[derive(Debug, Parser)]
#[command(version, about = "A stateless Continuum data-plane replica")]
struct Args {
    /// Address to serve traffic, /healthz, /readyz and /metrics on.
    #[arg(long, env = "CONTINUUM_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// The control plane's gRPC URL, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE")]
    control_plane: String,
    /// This replica's name in the control plane's logs and admin API (default: host-pid).
    #[arg(long, env = "CONTINUUM_REPLICA_ID")]
    replica_id: Option<String>,
    /// How long a KV overlap lookup may hold a request before it is scored on load alone.
    #[arg(long, env = "CONTINUUM_FIND_MATCHES_DEADLINE", default_value = "2ms", value_parser = humantime::parse_duration)]
    find_matches_deadline: std::time::Duration,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    if !(args.control_plane.starts_with("http://") || args.control_plane.starts_with("https://")) {
        eprintln!("error: --control-plane must be an http:// or https:// URL, got {:?}", args.control_plane);
        return ExitCode::from(2);
    }
    let replica_id = args.replica_id.unwrap_or_else(default_replica_id);
    let config = FleetClientConfig { control_plane: args.control_plane, replica_id };
    let started = Replica::start_full(&args.listen, config, DispatchSettings::default(), args.find_matches_deadline);
    let replica = match started.await {
        Ok(replica) => replica,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    shutdown_signal().await;
    replica.shutdown().await;
    ExitCode::SUCCESS
}

fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let host = if host.is_empty() { "replica".to_string() } else { host };
    format!("{host}-{}", std::process::id())
}

/// SIGINT or SIGTERM (what Kubernetes sends).
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}
