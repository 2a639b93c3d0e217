//! `continuum-control-plane [--config FILE] [--grpc-listen ADDR] [--admin-listen ADDR] [--simulator-shim-listen ADDR]`
//! `continuum-control-plane config validate FILE` · `continuum-control-plane config show FILE`

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use continuum_control_plane::app::{ControlPlane, FILE_READ_WAIT, ListenOverrides};
use continuum_control_plane::config::{self, ConfigError};
use tokio::signal::unix::{self, SignalKind};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Continuum's control plane: discovery, load signals and the Fleet stream",
    after_help = "Also read from the environment:\n  [env: RUST_LOG] the log filter (default: info)\n  \
        and any variable the configuration names as ${VAR}"
)]
struct Args {
    /// The YAML configuration. Without it, the embedded default runs: a simulated demo fleet
    /// and shim that need no etcd, Kubernetes or GPU (refused inside a Kubernetes pod).
    #[arg(long, env = "CONTINUUM_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `control_plane.grpc_listen`.
    #[arg(long, env = "CONTINUUM_GRPC_LISTEN")]
    grpc_listen: Option<SocketAddr>,
    /// Overrides `admin.listen`.
    #[arg(long, env = "CONTINUUM_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Overrides `dynamo.discovery.simulator.shim_listen`, and moves the backends that pointed
    /// at the old address with it (only with `dynamo.discovery.source: simulator`; otherwise
    /// ignored, with a warning).
    #[arg(long, env = "CONTINUUM_SIMULATOR_SHIM_LISTEN")]
    simulator_shim_listen: Option<SocketAddr>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check or print a configuration file.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Print every error and warning with its key path; exit non-zero on errors.
    Validate { file: PathBuf },
    /// Print the effective configuration (defaults filled in) with secrets masked.
    Show { file: PathBuf },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(file) = file_given_as_command(&argv, |path| path.is_file()) {
        let file = file.display();
        eprintln!("error: {file} is a file, not a command; to run on it: continuum-control-plane --config {file}");
        return ExitCode::from(2);
    }
    let args = Args::parse_from(argv);
    match args.command {
        Some(Command::Config { action: ConfigAction::Validate { file } }) => validate(&file),
        Some(Command::Config { action: ConfigAction::Show { file } }) => show(&file),
        None => {
            // Subscriptions (up to 1,024 of loads and as many of kv events) and replica streams
            // are descriptors each.
            if let (open_files, Some(error)) = continuum_proto::os::raise_open_file_limit() {
                tracing::warn!(%error, open_files, "could not raise the open-file limit to its hard limit");
            }
            let listen = ListenOverrides { grpc: args.grpc_listen, admin: args.admin_listen };
            run(args.config.as_deref(), listen, args.simulator_shim_listen).await
        }
    }
}

fn validate(file: &Path) -> ExitCode {
    match config::load_file(file) {
        Ok(loaded) => {
            for diagnostic in &loaded.diagnostics {
                println!("{diagnostic}");
            }
            println!("{}: valid ({} warning(s))", file.display(), loaded.diagnostics.len());
            ExitCode::SUCCESS
        }
        Err(error) => {
            report(file, &error);
            ExitCode::FAILURE
        }
    }
}

fn show(file: &Path) -> ExitCode {
    match config::load_file(file) {
        Ok(loaded) => {
            print!("{}", loaded.config.to_masked_yaml());
            ExitCode::SUCCESS
        }
        Err(error) => {
            report(file, &error);
            ExitCode::FAILURE
        }
    }
}

fn report(file: &Path, error: &ConfigError) {
    match error {
        ConfigError::Invalid(diagnostics) => {
            for diagnostic in diagnostics {
                println!("{diagnostic}");
            }
            let errors = diagnostics.iter().filter(|d| d.is_error()).count();
            eprintln!("{}: invalid ({errors} error(s))", file.display());
        }
        other => eprintln!("error: {other}"),
    }
}

async fn run(file: Option<&Path>, listen: ListenOverrides, shim: Option<SocketAddr>) -> ExitCode {
    // Installed first, so that no signal takes its default action (ending the process) while
    // the configuration is read or the control plane starts or reloads: a SIGHUP (a config
    // reloader's, say, during a restart) is a reload to run once started, a SIGTERM or SIGINT
    // a shutdown.
    let mut signals = match Signals::install() {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("error: cannot listen for SIGHUP, SIGTERM and SIGINT: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = match file {
        Some(file) => match read_first(file).await {
            Ok(loaded) => {
                for diagnostic in &loaded.diagnostics {
                    tracing::warn!("{diagnostic}");
                }
                loaded.config
            }
            Err(error) => {
                report(file, &error);
                return ExitCode::from(2);
            }
        },
        // A pod whose config went missing must not come up ready serving a simulated fleet's
        // made-up answers.
        None if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => {
            eprintln!(
                "error: no --config (or CONTINUUM_CONFIG) given inside a Kubernetes pod; the embedded default is a \
                 simulated demo fleet and is not started there (mount the configuration and point CONTINUUM_CONFIG at it)"
            );
            return ExitCode::from(2);
        }
        None => {
            tracing::info!("no --config given: running the embedded default (a simulated demo fleet)");
            config::embedded_default()
        }
    };
    if let Some(addr) = shim
        && let Err(moved) = move_shim(&mut config, addr)
    {
        let shown = file.unwrap_or(Path::new("the embedded default"));
        report(shown, &ConfigError::Invalid(moved));
        return ExitCode::from(2);
    }
    // The overrides bypass the file's validation, and with it the warning for a listener
    // reachable off-host without its token.
    let tokens = [
        ("--grpc-listen", listen.grpc, "control_plane.token", config.control_plane.token.is_some()),
        ("--admin-listen", listen.admin, "admin.token", config.admin.token.is_some()),
    ];
    for (flag, addr, key, has_token) in tokens {
        if let Some(addr) = addr.filter(|addr| !addr.ip().is_loopback() && !has_token) {
            tracing::warn!(%addr, "{flag} is not a loopback address and {key} is unset: anyone who reaches it is served");
        }
    }
    let mut control_plane = match ControlPlane::start(config, listen).await {
        Ok(control_plane) => control_plane,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "continuum-control-plane: Fleet gRPC on {}, admin HTTP on {}",
        control_plane.grpc_addr, control_plane.admin_addr
    );
    // A stop signal during a reload abandons it: a reload waiting on a stalled volume must not
    // leave the process deaf to the signals that end it.
    let failed = control_plane.failed();
    tokio::pin!(failed);
    let mut code = 0;
    loop {
        tokio::select! {
            signal = signals.recv() => match signal {
                Signal::Stop => break,
                Signal::Hangup => tokio::select! {
                    () = reload(&mut control_plane, file, shim) => {}
                    () = signals.stop() => {
                        tracing::warn!("a stop signal during a reload: abandoning the reload");
                        break;
                    }
                    () = &mut failed => {
                        code = 1;
                        break;
                    }
                },
            },
            () = &mut failed => {
                code = 1;
                break;
            }
        }
    }
    tracing::info!("shutting down");
    tokio::select! {
        () = control_plane.shutdown() => {}
        () = signals.stop() => {
            tracing::warn!("a second stop signal: exiting without finishing the shutdown");
            code = 1;
        }
    }
    // Exits here rather than returning: returning drops the runtime, which waits for every
    // blocking task, and a file read stalled on its volume would hold the process forever.
    std::process::exit(code)
}

enum Signal {
    Hangup,
    Stop,
}

/// SIGHUP (reload), and SIGTERM (what Kubernetes sends) or SIGINT (stop).
struct Signals {
    hangup: unix::Signal,
    terminate: unix::Signal,
    interrupt: unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        Ok(Self {
            hangup: unix::signal(SignalKind::hangup())?,
            terminate: unix::signal(SignalKind::terminate())?,
            interrupt: unix::signal(SignalKind::interrupt())?,
        })
    }

    /// The next signal; a stop comes first when both are pending.
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            biased;
            _ = self.terminate.recv() => Signal::Stop,
            _ = self.interrupt.recv() => Signal::Stop,
            _ = self.hangup.recv() => Signal::Hangup,
        }
    }

    async fn stop(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

/// SIGHUP: re-read the configuration file and apply it; an invalid file changes nothing.
/// Counted on `continuum_config_reloads_total{result}`.
async fn reload(control_plane: &mut ControlPlane, file: Option<&Path>, shim: Option<SocketAddr>) {
    let Some(file) = file else {
        tracing::warn!("SIGHUP ignored: running the embedded default, there is no file to re-read");
        return;
    };
    let applied = apply_file(control_plane, file, shim).await;
    let result = if applied { "applied" } else { "refused" };
    control_plane.metrics.config_reloads.with_label_values(&[result]).inc();
}

/// Moves the simulator's shim to `addr` (`--simulator-shim-listen`) and checks the result, which
/// the file's own validation did not see; the diagnostics when the move made it invalid.
fn move_shim(config: &mut config::Config, addr: SocketAddr) -> Result<(), Vec<config::Diagnostic>> {
    config.move_simulator_shim(addr);
    let moved = config.validate();
    if moved.iter().any(|d| d.is_error()) {
        return Err(moved);
    }
    // The file's warnings were logged as it loaded; the moved shim's (off loopback) are new.
    for diagnostic in moved.iter().filter(|d| d.path.ends_with("simulator.shim_listen")) {
        tracing::warn!("{diagnostic}");
    }
    Ok(())
}

/// Loads `file` as the control plane starts, on the blocking pool: a volume that stalls it (a
/// network mount gone away) ends the process with a clear error within [`FILE_READ_WAIT`],
/// rather than leave it up, serving nothing, with no word of why. It exits at once: the read
/// stalled holds a thread the runtime would otherwise wait on as it shuts down.
async fn read_first(file: &Path) -> Result<config::Loaded, ConfigError> {
    let path = file.to_path_buf();
    match tokio::time::timeout(FILE_READ_WAIT, tokio::task::spawn_blocking(move || config::load_file(&path))).await {
        Ok(Ok(loaded)) => loaded,
        Ok(Err(error)) => {
            eprintln!("error: reading {} failed: {error}", file.display());
            std::process::exit(2)
        }
        Err(_) => {
            eprintln!(
                "error: {} did not read within {FILE_READ_WAIT:?} (a stalled volume?); not starting",
                file.display()
            );
            std::process::exit(2)
        }
    }
}

/// Loads `file` (on the blocking pool: its volume may stall) and applies it; whether it was
/// applied.
async fn apply_file(control_plane: &mut ControlPlane, file: &Path, shim: Option<SocketAddr>) -> bool {
    let path = file.to_path_buf();
    let load = tokio::task::spawn_blocking(move || config::load_file(&path));
    let loaded = match tokio::time::timeout(FILE_READ_WAIT, load).await {
        Ok(Ok(loaded)) => loaded,
        Ok(Err(error)) => {
            tracing::error!(%error, "reading the configuration failed; keeping the running configuration");
            return false;
        }
        Err(_) => {
            tracing::error!(
                file = %file.display(), wait = ?FILE_READ_WAIT,
                "the configuration did not read in time (a stalled volume?); keeping the running configuration"
            );
            return false;
        }
    };
    match loaded {
        Ok(mut loaded) => {
            for diagnostic in &loaded.diagnostics {
                tracing::warn!("{diagnostic}");
            }
            if let Some(addr) = shim
                && let Err(moved) = move_shim(&mut loaded.config, addr)
            {
                for diagnostic in moved.iter().filter(|d| d.is_error()) {
                    tracing::error!("{diagnostic}");
                }
                tracing::error!(
                    "--simulator-shim-listen makes the reloaded configuration invalid; keeping the running one"
                );
                return false;
            }
            match control_plane.reload(loaded.config).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::error!(%error, "configuration reload refused; keeping the running configuration");
                    false
                }
            }
        }
        Err(ConfigError::Invalid(diagnostics)) => {
            for diagnostic in diagnostics.iter().filter(|d| d.is_error()) {
                tracing::error!("{diagnostic}");
            }
            tracing::error!(file = %file.display(), "configuration reload refused; keeping the running configuration");
            false
        }
        Err(error) => {
            tracing::error!(%error, "configuration reload refused; keeping the running configuration");
            false
        }
    }
}

/// The file a newcomer gave where a command goes (`continuum-control-plane fleet.yaml`), which
/// clap would refuse only as an unknown subcommand: the first argument, when it is no flag, no
/// command and names a file (`is_file`).
fn file_given_as_command(argv: &[std::ffi::OsString], is_file: impl Fn(&Path) -> bool) -> Option<&Path> {
    let first = Path::new(argv.get(1)?);
    let named = first.to_str().unwrap_or_default();
    let subcommand = Args::command().get_subcommands().any(|command| command.get_name() == named);
    let command = named.starts_with('-') || named == "help" || subcommand;
    (!command && is_file(first)).then_some(first)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::Path;

    use super::file_given_as_command;

    #[test]
    fn a_file_where_a_command_goes_is_pointed_to_its_flag() {
        let argv = |args: &[&str]| -> Vec<OsString> { args.iter().map(OsString::from).collect() };
        let any_file = |_: &Path| true;
        let given = argv(&["continuum-control-plane", "fleet.yaml"]);
        assert_eq!(file_given_as_command(&given, any_file), Some(Path::new("fleet.yaml")));
        let missing = argv(&["continuum-control-plane", "nonsense"]);
        assert_eq!(file_given_as_command(&missing, |_| false), None, "clap's own error for what is no file");
        for fine in [
            &["continuum-control-plane"][..],
            &["continuum-control-plane", "--config", "fleet.yaml"],
            &["continuum-control-plane", "config", "validate", "fleet.yaml"],
        ] {
            assert_eq!(file_given_as_command(&argv(fine), any_file), None, "{fine:?}");
        }
    }
}
