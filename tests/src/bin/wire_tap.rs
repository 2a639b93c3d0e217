//! A byte-transparent TCP relay that records what reaches the upstream: every byte a client
//! sends on connection N is appended to `<dir>/conn-N` before it is forwarded, so a test can
//! read what the server behind it was sent (the real Dynamo frontend, which cannot tell it).
//! Answers go back unrecorded. Once it listens it creates `<dir>/listening`. It runs inside a
//! test's network namespace until killed.
//!
//! `wire-tap --listen 127.0.0.1:8010 --upstream 127.0.0.1:8000 --dir <dir>`

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

fn main() -> anyhow::Result<()> {
    let listen: SocketAddr = value("--listen")?.parse()?;
    let upstream: SocketAddr = value("--upstream")?.parse()?;
    let dir = PathBuf::from(value("--dir")?);
    std::fs::create_dir_all(&dir)?;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(serve(listen, upstream, dir))
}

fn value(flag: &str) -> anyhow::Result<String> {
    let mut args = std::env::args().skip_while(|a| a != flag);
    args.nth(1).with_context(|| format!("wire-tap needs {flag} <value>"))
}

async fn serve(listen: SocketAddr, upstream: SocketAddr, dir: PathBuf) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    std::fs::File::create(dir.join("listening"))?;
    for n in 0u64.. {
        let (client, _) = listener.accept().await?;
        let record = dir.join(format!("conn-{n}"));
        tokio::spawn(async move {
            if let Err(error) = relay(client, upstream, &record).await {
                eprintln!("wire-tap: connection {n}: {error:#}");
            }
        });
    }
    Ok(())
}

async fn relay(client: TcpStream, upstream: SocketAddr, record: &Path) -> anyhow::Result<()> {
    let server = TcpStream::connect(upstream).await.with_context(|| format!("cannot reach {upstream}"))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let file = std::fs::File::create(record)?;
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (up, down) = tokio::join!(pump(client_read, server_write, Some(file)), pump(server_read, client_write, None));
    up.and(down)
}

/// Copies until end of stream, recording each read before forwarding it.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut record: Option<std::fs::File>,
) -> anyhow::Result<()> {
    let mut buf = vec![0; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        if let Some(file) = record.as_mut() {
            file.write_all(&buf[..n])?;
        }
        to.write_all(&buf[..n]).await?;
    }
}
