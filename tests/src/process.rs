//! The real `continuum-control-plane` binary as a child process, for tests that kill it.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::tools;

/// A running control-plane process; killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct ControlPlaneProcess {
    pub child: Child,
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
}

impl ControlPlaneProcess {
    /// Starts the binary with `config` and waits for its "listening" line. With port 0 in
    /// `grpc_addr`, the port it bound is read from that line: no other test can take it in
    /// between, as one chosen free beforehand could be.
    pub async fn start(config: &Path, grpc_addr: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(config, grpc_addr, &[]).await
    }

    /// [`Self::start`], with more arguments.
    pub async fn start_with(config: &Path, grpc_addr: SocketAddr, args: &[&str]) -> anyhow::Result<Self> {
        let mut child = Command::new(tools::binary("continuum-control-plane"))
            .arg("--config")
            .arg(config)
            .arg("--grpc-listen")
            .arg(grpc_addr.to_string())
            .arg("--admin-listen")
            .arg("127.0.0.1:0")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let banner = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .map_err(|_| anyhow::anyhow!("control plane printed nothing within 20s"))??
            .ok_or_else(|| anyhow::anyhow!("control plane exited before listening"))?;
        // "continuum-control-plane: Fleet gRPC on 127.0.0.1:1, admin HTTP on 127.0.0.1:2"
        let admin = banner.rsplit(' ').next().unwrap_or_default().parse()?;
        let grpc = banner.split("Fleet gRPC on ").nth(1).and_then(|rest| rest.split(',').next());
        let grpc_addr = grpc.ok_or_else(|| anyhow::anyhow!("no gRPC address in {banner:?}"))?.parse()?;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, grpc_addr, admin_addr: admin })
    }

    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// SIGKILL, and wait for the process to be gone.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// Any loopback port, for a server that reports the one it bound.
pub const ANY_PORT: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// A loopback port that was free a moment ago, for a server that is started (or restarted) on
/// it later. It is drawn below the kernel's ephemeral range, where no other test's outgoing
/// connection can be given it as its local port in the meantime (a port from `bind(0)` could);
/// only another server binding the same port could still take it.
pub fn free_port() -> anyhow::Result<SocketAddr> {
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let port = rng.random_range(FIXED_PORTS);
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return Ok(listener.local_addr()?);
        }
    }
    anyhow::bail!("no free loopback port in {FIXED_PORTS:?} after 1000 tries")
}

/// Below Linux's default ephemeral range (32768–60999) and above the ports services commonly
/// take.
const FIXED_PORTS: std::ops::Range<u16> = 20_000..32_000;
