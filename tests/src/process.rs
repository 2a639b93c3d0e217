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
    /// Starts the binary with `config` and waits for its "listening" line.
    pub async fn start(config: &Path, grpc_addr: SocketAddr) -> anyhow::Result<Self> {
        let mut child = Command::new(tools::binary("continuum-control-plane"))
            .arg("--config")
            .arg(config)
            .arg("--grpc-listen")
            .arg(grpc_addr.to_string())
            .arg("--admin-listen")
            .arg("127.0.0.1:0")
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

/// A loopback port that was free a moment ago (for a server that must come back on it).
pub fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}
