//! nginx (the Debian package) as a keep-alive reverse proxy in front of one upstream, run as a
//! child process from a generated configuration in its own temporary directory; the benchmarks'
//! reference proxy. Killed by its PID when dropped, and by the kernel when the process that
//! started it dies without dropping it (a SIGTERM runs no destructor).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;

use crate::process::free_port;

/// Idle keep-alive connections nginx keeps to the upstream (its `keepalive` directive).
pub const UPSTREAM_KEEPALIVE: usize = 256;
/// How long nginx may take to accept connections after it starts.
const STARTUP: Duration = Duration::from_secs(10);

/// A running nginx proxying `127.0.0.1:<port>` to an upstream.
#[derive(Debug)]
pub struct Nginx {
    pub addr: SocketAddr,
    pub version: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// The `nginx` binary on `PATH` (or `/usr/sbin`), or how to install it.
    pub fn binary() -> anyhow::Result<PathBuf> {
        on_path("nginx").ok_or_else(|| {
            anyhow::anyhow!("nginx is not installed; install the Debian package: apt-get install -y nginx")
        })
    }

    /// Starts nginx (one process, one event loop) in front of `upstream` and waits until it
    /// accepts connections.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let binary = Self::binary()?;
        let dir = tempfile::tempdir()?;
        let addr = free_port()?;
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, config(dir.path(), addr, upstream))?;
        let child = dies_with_parent(&binary)
            .arg("-p")
            .arg(dir.path())
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut nginx = Self { addr, version: version(&binary), child, dir };
        nginx.wait_until_listening().await?;
        Ok(nginx)
    }

    async fn wait_until_listening(&mut self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + STARTUP;
        while tokio::net::TcpStream::connect(self.addr).await.is_err() {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default();
                anyhow::bail!("nginx exited with {status} before listening:\n{log}");
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "nginx did not listen on {} within {STARTUP:?}",
                self.addr
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

impl Nginx {
    /// The one nginx process (`master_process off`): its worker.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGKILL by PID: with `master_process off` there is no worker left behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A single-process, foreground nginx: every file it writes stays in `dir`, no access log, and
/// keep-alive on both sides (HTTP/1.1 upstream with an idle pool) so it is a fair proxy.
fn config(dir: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let dir = dir.display();
    format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n\
         \x20 client_body_temp_path {dir}/client_body;\n  proxy_temp_path {dir}/proxy;\n\
         \x20 fastcgi_temp_path {dir}/fastcgi;\n  uwsgi_temp_path {dir}/uwsgi;\n  scgi_temp_path {dir}/scgi;\n\
         \x20 keepalive_requests 1000000;\n\
         \x20 upstream stub {{ server {upstream}; keepalive {UPSTREAM_KEEPALIVE}; keepalive_requests 1000000; }}\n\
         \x20 server {{\n    listen {listen};\n    location / {{\n\
         \x20     proxy_pass http://stub;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n\
         \x20   }}\n  }}\n}}\n"
    )
}

/// `name` on `PATH` or in `/usr/sbin`.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// A command running `binary` that the kernel kills (SIGKILL) when the thread that spawned it
/// ends: through util-linux's `setpriv --pdeathsig`, which sets the signal and then executes
/// `binary` in its place (same PID). The workspace forbids the `unsafe` a `pre_exec` hook takes.
/// Without `setpriv` (it is in an essential Debian package), a plain command.
fn dies_with_parent(binary: &Path) -> Command {
    match on_path("setpriv") {
        Some(setpriv) => {
            let mut command = Command::new(setpriv);
            command.args(["--pdeathsig", "KILL", "--"]).arg(binary);
            command
        }
        None => Command::new(binary),
    }
}

/// `nginx -v` prints e.g. "nginx version: nginx/1.22.1" on stderr.
fn version(binary: &Path) -> String {
    Command::new(binary)
        .arg("-v")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stderr).ok())
        .and_then(|v| v.trim().rsplit(' ').next().map(str::to_string))
        .unwrap_or_else(|| "nginx".into())
}
