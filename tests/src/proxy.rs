//! A loopback TCP proxy that can be paused. While paused it moves no bytes either way, so both
//! peers' socket buffers and HTTP/2 flow-control windows fill as they would behind a stalled
//! network, while the connections themselves stay open. It also counts the connections it
//! accepted, which tells a test how often a client dialled through it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// A running proxy to one upstream address; stops, closing every connection, when dropped.
#[derive(Debug)]
pub struct Proxy {
    pub addr: SocketAddr,
    running: watch::Sender<bool>,
    connections: Arc<AtomicUsize>,
    _stop: DropGuard,
}

impl Proxy {
    /// Listens on a fresh loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (running, watching) = watch::channel(true);
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        tokio::spawn(accept(listener, upstream, watching, connections.clone(), stop.clone()));
        Ok(Self { addr, running, connections, _stop: stop.drop_guard() })
    }

    /// Stops forwarding in both directions; bytes already read are held until `resume`.
    pub fn pause(&self) {
        self.running.send_replace(false);
    }

    pub fn resume(&self) {
        self.running.send_replace(true);
    }

    /// How many connections the proxy has accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    running: watch::Receiver<bool>,
    connections: Arc<AtomicUsize>,
    stop: CancellationToken,
) {
    loop {
        let client = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(error) => {
                    tracing::warn!(%error, "test proxy accept failed");
                    continue;
                }
            },
        };
        connections.fetch_add(1, Ordering::SeqCst);
        let (running, stop) = (running.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                result = relay(client, upstream, running) => {
                    if let Err(error) = result {
                        tracing::debug!(%error, "test proxy connection ended");
                    }
                }
            }
        });
    }
}

async fn relay(client: TcpStream, upstream: SocketAddr, running: watch::Receiver<bool>) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (up, down) =
        tokio::join!(pump(client_read, server_write, running.clone()), pump(server_read, client_write, running));
    up.and(down)
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut running: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut buf = vec![0; 64 * 1024];
    loop {
        if running.wait_for(|r| *r).await.is_err() {
            return Ok(());
        }
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        if running.wait_for(|r| *r).await.is_err() {
            return Ok(());
        }
        to.write_all(&buf[..n]).await?;
    }
}
