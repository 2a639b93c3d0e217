//! A raw ZMTP 3.x PUB peer on a loopback port, for tests that need a publisher which says
//! exactly what they script: well-formed Dynamo kv_metrics messages, or hostile bytes.
//!
//! Each accepted connection completes the PUB side of the handshake (greeting, READY as PUB,
//! the SUB's READY and its subscription) before the test gets it, so a test sees only
//! subscribed connections.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A listening publisher; [`Self::connection`] yields each subscribed connection.
#[derive(Debug)]
pub struct RawPublisher {
    pub addr: SocketAddr,
    connections: mpsc::UnboundedReceiver<PeerConnection>,
    task: JoinHandle<()>,
}

impl Drop for RawPublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawPublisher {
    pub async fn bind() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, connections) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    if let Ok(connection) = PeerConnection::accept(stream).await {
                        let _ = tx.send(connection);
                    }
                });
            }
        });
        Ok(Self { addr, connections, task })
    }

    /// `tcp://127.0.0.1:port`, as a discovery record would announce it.
    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// The next subscribed connection, or an error after `timeout`.
    pub async fn connection(&mut self, timeout: Duration) -> anyhow::Result<PeerConnection> {
        tokio::time::timeout(timeout, self.connections.recv())
            .await
            .context("no subscriber connected")?
            .context("the listener stopped")
    }

    /// A connection if one is already subscribed.
    pub fn try_connection(&mut self) -> Option<PeerConnection> {
        self.connections.try_recv().ok()
    }
}

/// One subscribed connection.
#[derive(Debug)]
pub struct PeerConnection {
    stream: TcpStream,
    /// The subscription message's body (`0x01` + topic).
    pub subscription: Vec<u8>,
}

impl PeerConnection {
    async fn accept(mut stream: TcpStream) -> anyhow::Result<Self> {
        let mut greeting = [0u8; 64];
        stream.read_exact(&mut greeting).await?;
        if greeting[0] != 0xFF || &greeting[12..16] != b"NULL" {
            bail!("not a ZMTP NULL greeting");
        }
        stream.write_all(&pub_handshake()).await?;
        let ready = read_frame(&mut stream).await?;
        if !ready.windows(3).any(|w| w == b"SUB") {
            bail!("the client's READY is not SUB");
        }
        let subscription = read_frame(&mut stream).await?;
        Ok(Self { stream, subscription })
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.stream.write_all(bytes).await?;
        Ok(())
    }

    pub async fn send_frames(&mut self, frames: &[Vec<u8>]) -> anyhow::Result<()> {
        self.send_raw(&encode_message(frames)).await
    }

    /// Whether the subscriber has closed its end (reads EOF or an error within `wait`).
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        let mut byte = [0u8; 1];
        matches!(tokio::time::timeout(wait, self.stream.read(&mut byte)).await, Ok(Ok(0) | Err(_)))
    }
}

/// What a PUB sends first: a ZMTP 3.1 NULL greeting as server, then READY as PUB.
pub fn pub_handshake() -> Vec<u8> {
    let mut greeting = vec![0u8; 64];
    greeting[0] = 0xFF;
    greeting[9] = 0x7F;
    greeting[10] = 3;
    greeting[11] = 1;
    greeting[12..16].copy_from_slice(b"NULL");
    greeting[32] = 1;
    greeting.extend(ready_pub());
    greeting
}

fn ready_pub() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut frame = vec![0x04, u8::try_from(body.len()).unwrap_or(u8::MAX)];
    frame.extend(body);
    frame
}

async fn read_frame(stream: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let mut header = [0u8; 2];
    stream.read_exact(&mut header).await?;
    if header[0] & 0x02 != 0 {
        bail!("unexpected long frame from the subscriber");
    }
    let mut body = vec![0u8; usize::from(header[1])];
    stream.read_exact(&mut body).await?;
    Ok(body)
}

/// ZMTP framing of a multipart message (short or long frames as needed).
pub fn encode_message(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { 0x01 } else { 0 };
        match u8::try_from(frame.len()) {
            Ok(len) => out.extend([more, len]),
            Err(_) => {
                out.push(more | 0x02);
                out.extend_from_slice(&u64::try_from(frame.len()).unwrap_or(u64::MAX).to_be_bytes());
            }
        }
        out.extend_from_slice(frame);
    }
    out
}

/// An ActiveLoad sample as Dynamo 1.6.1 publishes it (named maps, nil scheduler fields).
#[derive(Debug, Clone, Copy)]
pub struct KvMetricsSample {
    pub publisher_id: u64,
    pub sequence: u64,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub kv_used_blocks: u64,
}

impl KvMetricsSample {
    /// The four frames, byte for byte in the layout of the captured fixtures.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        let payload = [
            vec![0x85],
            mp_str("worker_id"),
            mp_u64(self.worker_id),
            mp_str("dp_rank"),
            mp_u64(u64::from(self.dp_rank)),
            mp_str("active_decode_blocks"),
            vec![0xc0],
            mp_str("active_prefill_tokens"),
            vec![0xc0],
            mp_str("kv_used_blocks"),
            mp_u64(self.kv_used_blocks),
        ]
        .concat();
        let envelope = envelope(self.publisher_id, self.sequence, "kv_metrics", &payload);
        let mut frame = vec![1];
        frame.extend_from_slice(&u32::try_from(envelope.len()).unwrap_or(u32::MAX).to_be_bytes());
        frame.extend(envelope);
        vec![
            b"kv_metrics".to_vec(),
            self.publisher_id.to_be_bytes().to_vec(),
            self.sequence.to_be_bytes().to_vec(),
            frame,
        ]
    }
}

/// Dynamo's envelope map around `payload`.
pub fn envelope(publisher_id: u64, sequence: u64, topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut bin = vec![0xc5];
    bin.extend_from_slice(&u16::try_from(payload.len()).unwrap_or(u16::MAX).to_be_bytes());
    bin.extend_from_slice(payload);
    [
        vec![0x85],
        mp_str("publisher_id"),
        mp_u64(publisher_id),
        mp_str("sequence"),
        mp_u64(sequence),
        mp_str("published_at"),
        mp_u64(1_795_976_071_340),
        mp_str("topic"),
        mp_str(topic),
        mp_str("payload"),
        bin,
    ]
    .concat()
}

fn mp_str(s: &str) -> Vec<u8> {
    let mut out = vec![0xa0 | u8::try_from(s.len()).unwrap_or(31)];
    out.extend_from_slice(s.as_bytes());
    out
}

fn mp_u64(v: u64) -> Vec<u8> {
    let mut out = vec![0xcf];
    out.extend_from_slice(&v.to_be_bytes());
    out
}
