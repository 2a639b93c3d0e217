//! A simulated worker's publisher (kv_metrics or kv-events): a minimal ZMTP 3.1 PUB server
//! (NULL mechanism) on a loopback port. Per connection it greets, sends READY as PUB, reads the
//! subscriber's READY and its subscription (a 3.0 subscription message or a 3.1 SUBSCRIBE
//! command), then sends every message the worker publishes from then on until the peer goes
//! (nothing from before: a PUB socket keeps nothing for late subscribers, so a kv-events
//! publisher starts its worker's cache over instead; see [`Resync`]).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio_util::sync::CancellationToken;

use super::wire::Message;
use super::workers::SimulatedWorker;
use crate::load::zmtp::GREETING_BYTES;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Longest handshake frame accepted (READY with its properties, a subscription).
pub const MAX_HANDSHAKE_FRAME: usize = 255;
/// Handshake frames read before giving up on a peer that never subscribes.
pub const MAX_HANDSHAKE_FRAMES: usize = 8;
/// How long a peer may take to greet and subscribe.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// For a kv-events publisher, its worker: when a subscriber joins or falls behind, the worker's
/// cache starts over with `cleared` (see [`SimulatedWorker::clear_kv`]). A kv_metrics
/// publisher needs nothing: the next sample replaces every earlier one.
pub type Resync = Option<Arc<SimulatedWorker>>;

/// Accepts subscribers on `listener` until `cancel`, each sent what `messages` carries from
/// its subscription on.
pub async fn serve(
    listener: TcpListener,
    messages: broadcast::Sender<Message>,
    resync: Resync,
    cancel: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "simulated publisher: accept failed");
                    continue;
                }
            },
        };
        let (messages, resync, cancel) = (messages.clone(), resync.clone(), cancel.clone());
        tokio::spawn(async move {
            if let Err(error) = session(stream, messages, resync, cancel).await {
                tracing::debug!(%error, "simulated publisher's subscriber left");
            }
        });
    }
}

async fn session(
    mut stream: TcpStream,
    messages: broadcast::Sender<Message>,
    resync: Resync,
    cancel: CancellationToken,
) -> io::Result<()> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut stream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the subscriber did not subscribe in time"))??;
    let mut later = messages.subscribe();
    let resync = || resync.iter().for_each(|worker| worker.clear_kv());
    resync();
    let mut sink = [0u8; 256];
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(()),
            read = stream.read(&mut sink) => if read? == 0 { return Ok(()) },
            message = later.recv() => match message {
                Ok(message) => stream.write_all(&encode(&message)).await?,
                Err(RecvError::Lagged(_)) => resync(),
                Err(RecvError::Closed) => return Ok(()),
            },
        }
    }
}

async fn handshake(stream: &mut TcpStream) -> io::Result<()> {
    stream.write_all(&greeting()).await?;
    let mut peer = [0u8; GREETING_BYTES];
    stream.read_exact(&mut peer).await?;
    if peer[0] != 0xFF || peer[9] & 0x01 == 0 || peer[10] < 3 {
        return Err(protocol("the peer's greeting is not ZMTP 3.x"));
    }
    stream.write_all(&ready_pub()).await?;
    for _ in 0..MAX_HANDSHAKE_FRAMES {
        let (flags, body) = read_short_frame(stream).await?;
        let subscribed =
            if flags & FLAG_COMMAND != 0 { body.starts_with(b"\x09SUBSCRIBE") } else { body.first() == Some(&1) };
        if subscribed {
            return Ok(());
        }
    }
    Err(protocol("the peer sent no subscription"))
}

async fn read_short_frame(stream: &mut TcpStream) -> io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; 2];
    stream.read_exact(&mut header).await?;
    if header[0] & FLAG_LONG != 0 || usize::from(header[1]) > MAX_HANDSHAKE_FRAME {
        return Err(protocol("a handshake frame is longer than 255 bytes"));
    }
    let mut body = vec![0u8; usize::from(header[1])];
    stream.read_exact(&mut body).await?;
    Ok((header[0], body))
}

fn protocol(message: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// ZMTP 3.1, NULL mechanism, as server.
fn greeting() -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1;
    g
}

fn ready_pub() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut frame = vec![FLAG_COMMAND, u8::try_from(body.len()).unwrap_or(u8::MAX)];
    frame.extend(body);
    frame
}

/// ZMTP framing of one multipart message, short or long frames as needed.
fn encode(message: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.iter().map(|f| f.len() + 9).sum());
    for (index, frame) in message.iter().enumerate() {
        let more = if index + 1 < message.len() { FLAG_MORE } else { 0 };
        match u8::try_from(frame.len()) {
            Ok(len) => out.extend([more, len]),
            Err(_) => {
                out.push(more | FLAG_LONG);
                out.extend_from_slice(&u64::try_from(frame.len()).unwrap_or(u64::MAX).to_be_bytes());
            }
        }
        out.extend_from_slice(frame);
    }
    out
}
