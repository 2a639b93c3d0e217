//! `continuum-data-plane --listen ADDR --control-plane URL [--replica-id ID] [--control-plane-token TOKEN]
//! [--control-plane-ca PEM [--control-plane-cert PEM --control-plane-key PEM]] [--find-matches-deadline 2ms]
//! [--worker-threads N] [--drain-delay 5s] [--shutdown-grace 20s]`

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use continuum_data_plane::clear_text::in_the_clear;
use continuum_data_plane::dispatch::DispatchSettings;
use continuum_data_plane::fleet::{ClientTls, Credentials, FleetClientConfig, TlsFiles};
use continuum_data_plane::replica::Replica;
use continuum_proto::MAX_REPLICA_ID_BYTES;
use tokio::signal::unix::{self, SignalKind};

/// The request path allocates and frees small buffers on every request; mimalloc's per-thread
/// pages make that a few instructions (see "Data plane vs nginx" in docs/benchmark-notes.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long an idle blocking-pool thread lives (tokio's default: 10 s). Large request bodies
/// parse on these threads (at most 16 at once, `ingress::request`), and artifact files are read
/// on them: a burst of large bodies after a quiet spell finds its threads started. (Prompts
/// render on threads of their own, `kv/render/threads.rs`, which never exit.)
const BLOCKING_THREAD_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(600);

// No `Debug`: it would print `--control-plane-token`.
#[derive(Parser)]
#[command(
    version,
    about = "A stateless Continuum data-plane replica",
    after_help = "Also read from the environment:\n  \
        [env: RUST_LOG] the log filter (default: info)\n  \
        [env: CONTINUUM_ARTIFACT_CA_FILE] a PEM bundle trusted beside the compiled-in Mozilla roots when fetching tokenizer files\n  \
        [env: HF_ENDPOINT] the Hugging Face endpoint for hf:// artifacts (with dynamo.kv.allow_hf_artifacts)\n  \
        [env: HF_TOKEN] the token sent to it"
)]
struct Args {
    /// Address to serve traffic, /healthz, /readyz and /metrics on.
    #[arg(long, env = "CONTINUUM_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// The control plane's gRPC URL, e.g. http://127.0.0.1:50051 (https:// with
    /// `control_plane.tls` there, and --control-plane-ca here).
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE")]
    control_plane: String,
    /// For an https:// control plane: the CA (PEM) that signed its certificate.
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE_CA")]
    control_plane_ca: Option<PathBuf>,
    /// This replica's certificate (PEM), for a control plane with `control_plane.tls.client_ca`.
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE_CERT", requires = "control_plane_key")]
    control_plane_cert: Option<PathBuf>,
    /// The private key (PEM) of --control-plane-cert.
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE_KEY", requires = "control_plane_cert")]
    control_plane_key: Option<PathBuf>,
    /// This replica's name in the control plane's logs and admin API: 1 to 128 printable ASCII
    /// characters without spaces (default: host-pid).
    #[arg(long, env = "CONTINUUM_REPLICA_ID")]
    replica_id: Option<String>,
    /// The control plane's `control_plane.token`, presented on every Fleet call. Prefer the
    /// environment variable: a command line is visible to every user of the host.
    #[arg(long, env = "CONTINUUM_CONTROL_PLANE_TOKEN", hide_env_values = true)]
    control_plane_token: Option<String>,
    /// How long a KV overlap lookup may hold a request before it is scored without a fresh answer
    /// (on the replica's recent answer for the prompt's prefix, else without overlap credit);
    /// 1ms to 10s.
    #[arg(long, env = "CONTINUUM_FIND_MATCHES_DEADLINE", default_value = "2ms", value_parser = humantime::parse_duration)]
    find_matches_deadline: std::time::Duration,
    /// Threads serving requests, 1 to 1024 (default: one per core). With 1 the replica runs on a
    /// single thread with no work stealing: the least CPU per request, as `bench-proxy` measures it.
    #[arg(long, env = "CONTINUUM_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// On SIGTERM, how long readiness fails while the replica still answers, so load balancers
    /// stop choosing it before it stops accepting. Ctrl-C (SIGINT) skips it.
    #[arg(long, env = "CONTINUUM_DRAIN_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    drain_delay: std::time::Duration,
    /// Once accepting stops, how long requests in flight may take to finish before their
    /// connections are cut. Keep delay + grace + 3s (the replica's exit after the grace) under
    /// the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "CONTINUUM_SHUTDOWN_GRACE", default_value = "20s", value_parser = humantime::parse_duration)]
    shutdown_grace: std::time::Duration,
}

/// More runtime threads than any machine has cores: a typo, refused before tokio allocates
/// queues for them.
const MAX_WORKER_THREADS: usize = 1024;
/// `--find-matches-deadline`'s bounds: under a millisecond no lookup answers in time (the KV
/// term would be off without a word), and past ten seconds (a test on a loaded machine waits
/// two) every KV-scored request would wait that long on a control plane that accepts and never
/// answers.
const MIN_FIND_MATCHES_DEADLINE: std::time::Duration = std::time::Duration::from_millis(1);
const MAX_FIND_MATCHES_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    if !(MIN_FIND_MATCHES_DEADLINE..=MAX_FIND_MATCHES_DEADLINE).contains(&args.find_matches_deadline) {
        eprintln!(
            "error: --find-matches-deadline must be within {MIN_FIND_MATCHES_DEADLINE:?}..={MAX_FIND_MATCHES_DEADLINE:?}: \
             a KV-scored request waits for its lookup that long at most, got {:?}",
            args.find_matches_deadline
        );
        return ExitCode::from(2);
    }
    let mut builder = match args.worker_threads {
        Some(threads) if !(1..=MAX_WORKER_THREADS).contains(&threads) => {
            eprintln!("error: --worker-threads must be within 1..={MAX_WORKER_THREADS}, got {threads}");
            return ExitCode::from(2);
        }
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(threads);
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = builder.enable_all().thread_keep_alive(BLOCKING_THREAD_KEEP_ALIVE).build();
    match runtime {
        Ok(runtime) => {
            let code = runtime.block_on(run(args));
            // A blocking read stalled on a volume (the TLS files) would otherwise hold the
            // process past its grace period: dropping a runtime waits for its blocking pool.
            runtime.shutdown_timeout(continuum_data_plane::replica::RUNTIME_SHUTDOWN_WAIT);
            code
        }
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> ExitCode {
    let tls = match fleet_tls(&args) {
        Ok(tls) => tls,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let replica_id = args.replica_id.unwrap_or_else(default_replica_id);
    if !continuum_proto::valid_replica_id(&replica_id) {
        eprintln!(
            "error: --replica-id must be 1 to {MAX_REPLICA_ID_BYTES} printable ASCII characters without spaces, got {replica_id:?}"
        );
        return ExitCode::from(2);
    }
    let credentials = match args.control_plane_token.as_deref().map(Credentials::bearer).transpose() {
        Ok(credentials) => credentials.unwrap_or_default(),
        Err(error) => {
            eprintln!("error: --control-plane-token: {error}");
            return ExitCode::from(2);
        }
    };
    if args.control_plane_token.is_some() && in_the_clear(&args.control_plane) {
        tracing::warn!(
            control_plane = %args.control_plane,
            "--control-plane-token goes in the clear over http:// to a host that is not this one; use https:// \
             (--control-plane-ca) unless the network between them is trusted"
        );
    }
    let config = FleetClientConfig { credentials, tls, ..FleetClientConfig::new(args.control_plane, replica_id) };
    // Before the start, so a SIGTERM while starting drains once started instead of killing.
    let mut signals = match Signals::install() {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("error: cannot listen for SIGTERM and SIGINT: {error}");
            return ExitCode::FAILURE;
        }
    };
    let started = Replica::start_full(&args.listen, config, DispatchSettings::default(), args.find_matches_deadline);
    let replica = match started.await {
        Ok(replica) => replica,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let delay = match signals.recv().await {
        Signal::Terminate => args.drain_delay,
        Signal::Interrupt => std::time::Duration::ZERO,
    };
    tracing::info!(drain_delay = ?delay, grace = ?args.shutdown_grace, "shutting down");
    tokio::select! {
        clean = replica.drain(delay, args.shutdown_grace) => if clean { ExitCode::SUCCESS } else { ExitCode::FAILURE },
        _ = signals.recv() => {
            tracing::warn!("a second signal: exiting without finishing the drain");
            ExitCode::FAILURE
        }
    }
}

/// TLS to the control plane, from the URL's scheme and the TLS flags, which must agree. The
/// files are checked now and read again at every connection, so renewed ones need no restart.
fn fleet_tls(args: &Args) -> Result<Option<ClientTls>, String> {
    let identity = args.control_plane_cert.as_deref().zip(args.control_plane_key.as_deref());
    if args.control_plane.starts_with("http://") {
        if args.control_plane_ca.is_some() || identity.is_some() {
            return Err("--control-plane-ca, --control-plane-cert and --control-plane-key need an https:// \
                        --control-plane"
                .into());
        }
        return Ok(None);
    }
    if !args.control_plane.starts_with("https://") {
        return Err(format!("--control-plane must be an http:// or https:// URL, got {:?}", args.control_plane));
    }
    let ca = args.control_plane_ca.as_deref().ok_or("an https:// --control-plane needs --control-plane-ca")?;
    let files = TlsFiles { ca: ca.into(), identity: identity.map(|(cert, key)| (cert.into(), key.into())) };
    // Each file is checked now; whether the key pairs with the certificate, as the replica
    // starts (it builds its lookups' connection then).
    files.load().map_err(|error| error.to_string())?;
    Ok(Some(ClientTls::Files(files)))
}

fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let host = if host.is_empty() { "replica".to_string() } else { host };
    format!("{host}-{}", std::process::id())
}

/// Which signal asked the replica to stop.
enum Signal {
    /// SIGTERM: what Kubernetes sends; the replica drains first.
    Terminate,
    /// SIGINT: Ctrl-C at a terminal; no load balancer to wait for.
    Interrupt,
}

/// SIGTERM and SIGINT, listened for from the start to the exit: a signal that arrives while
/// nothing awaits one (between the first and the drain's watch for a second) is kept for the
/// next `recv`, not lost.
struct Signals {
    terminate: unix::Signal,
    interrupt: unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Self {
            terminate: unix::signal(SignalKind::terminate())?,
            interrupt: unix::signal(SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.terminate.recv() => Signal::Terminate,
            _ = self.interrupt.recv() => Signal::Interrupt,
        }
    }
}
