//! A bounded ZMTP 3.x SUB client: just enough of ZeroMQ to receive one topic from a PUB socket
//! whose address, and every byte it sends, the fleet authors.
//!
//! The `zeromq` crate allocates whatever frame length the wire declares; this client checks
//! every declared length against a ceiling before it allocates or reads, holds at most one
//! message, and keeps an idle subscription at 2,624 bytes of buffers. It supports NULL security,
//! READY as SUB, ZMTP 3.0 subscription messages (`0x01` + topic), and PING (answered with PONG).
//! PONG and commands it does not know are skipped (ZMTP lets peers add commands); a second
//! READY, an ERROR, a malformed command or frame, or a command past 512 bytes ends the session.
//!
//! | bound | kv_metrics | kv-events | why |
//! |---|---|---|---|
//! | [`ZmtpLimits::max_frame_bytes`] | 16,389 B (16 KiB payload + 5 B header) | 1 MiB | Dynamo's frame: `0x01`, u32 length, envelope |
//! | [`MAX_TOPIC_BYTES`] | 255 B | 255 B | a topic is a short frame; known topics are ≤ 23 B |
//! | [`ZmtpLimits::max_message_bytes`] | topic + 2 ids + frame = 16,660 B | 1 MiB + 271 B | one 4-frame message |
//! | [`MAX_FRAMES_PER_MESSAGE`] | 4 | 4 | topic, publisher id, sequence, frame |
//! | [`MAX_COMMAND_BYTES`] | 512 B | 512 B | READY with a few properties; PING carries ≤ 16 B |
//! | [`ZmtpLimits::max_discard_bytes`] | 1 MiB | 16 MiB | larger frames are skipped unread up to here, past it the session ends; so do a message's skipped frames together |
//! | [`MAX_SKIPPED_FRAMES`] | 64 | 64 | frames of one message skipped unread; past it the session ends |
//! | [`INITIAL_BUFFER_BYTES`] | 512 B, doubling up to the message ceiling | same | grow on demand |
//! | [`LARGE_MESSAGE_BYTES`] | (never reached: a message fits the free 64 KiB) | 64 MiB, all subscriptions together | message buffers past 64 KiB borrow from one budget |
//! | [`READ_BUFFER_BYTES`] / [`WRITE_BUFFER_BYTES`] | 2 KiB / 64 B | same | the greeting is exactly 64 B |
//! | [`CONNECT_TIMEOUT`] | 10 s | 10 s | resolving the host and the TCP connect |
//! | [`HANDSHAKE_TIMEOUT`] | 10 s | 10 s | greeting, READY both ways and the subscription (slowloris) |
//! | [`MESSAGE_TIMEOUT`] | 30 s | 30 s | a message's first byte to its last (slowloris, after the handshake) |
//! | [`LOAN_DEADLINE`] | (never borrows) | 2 s | a message's first borrowed byte to its last (trickled or paused loans) |
//!
//! Between messages a session waits without a deadline (publishers speak when something
//! changes); the dialled connection keeps TCP keepalive on ([`KEEPALIVE`]) and gives up on bytes
//! left unacknowledged ([`UNACKNOWLEDGED_LIMIT`]), so a peer gone without a word (a partition,
//! an expired NAT entry) ends the session within about a minute.
//! A frame over `max_frame_bytes` (or a message over `max_message_bytes`, or a fifth frame) is
//! not buffered: its bytes are read through the 2 KiB read buffer and dropped, and the message is
//! reported as [`Dropped`], so one bad message does not end a healthy session. A declared length
//! over `max_discard_bytes` (a frame length of 2^63, say) ends the session at once, and so does a
//! message whose skipped frames add up to more, or number more than [`MAX_SKIPPED_FRAMES`]: a
//! publisher sending one endless message of frames just under the bound would otherwise keep the
//! control plane reading and dropping them for as long as it liked. A frame
//! whose room the process-wide budget for large messages cannot lend (`budget`) is skipped
//! the same way, its message reported as [`Dropped::OverBudget`].

mod budget;
mod buffer;
mod subscriber;
mod wire;

use std::time::Duration;

pub use budget::{
    BORROWER_SHARE, Borrower, BudgetRef, FREE_BUFFER_BYTES, LARGE_MESSAGE_BYTES, LARGE_MESSAGES, LOAN_DEADLINE, Loan,
    MessageBudget,
};
pub use buffer::MessageBuffer;
pub use subscriber::{Dropped, Incoming, Message, ZmtpSubscriber};
pub use wire::{GREETING_BYTES, greeting, parse_greeting};

/// Longest topic frame buffered; longer first frames are dropped unread.
pub const MAX_TOPIC_BYTES: usize = 255;
/// Frames in one message: topic, publisher id, sequence, Dynamo frame.
pub const MAX_FRAMES_PER_MESSAGE: usize = 4;
/// Frames of one message skipped unread (past [`MAX_FRAMES_PER_MESSAGE`], or each too large)
/// before the session ends: no publisher here sends a message of more than four.
pub const MAX_SKIPPED_FRAMES: usize = 64;
/// Longest command frame (READY, PING, ERROR…) accepted.
pub const MAX_COMMAND_BYTES: usize = 512;
/// The message buffer's first capacity; it doubles on demand up to its ceiling.
pub const INITIAL_BUFFER_BYTES: usize = 512;
/// The socket read buffer.
pub const READ_BUFFER_BYTES: usize = 2048;
/// The socket write buffer: the greeting, READY, the subscription and PONG each fit.
pub const WRITE_BUFFER_BYTES: usize = 64;
/// Resolving the publisher's host and connecting to it.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// From the connection to the subscription being sent.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// From a message's first byte to its last.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);
/// TCP keepalive on a dialled publisher: the first probe after this long idle, then one every
/// [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_PROBES`] unanswered ones ending the connection.
pub const KEEPALIVE: Duration = Duration::from_secs(30);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
pub const KEEPALIVE_PROBES: u32 = 3;
/// Bytes sent to a publisher (a subscription, a PONG) unacknowledged this long end the
/// connection too: keepalive does not probe while they are in flight, and the kernel's own
/// retransmissions would keep a partitioned session up for a quarter of an hour.
pub const UNACKNOWLEDGED_LIMIT: Duration = Duration::from_secs(60);
/// Dynamo's frame header before the envelope: version byte and u32 length.
pub const DYNAMO_FRAME_HEADER_BYTES: usize = 5;
/// The largest kv_metrics envelope (the seed's 16 KiB).
pub const KV_METRICS_MAX_PAYLOAD_BYTES: usize = 16 * 1024;
/// The largest kv-events frame: batches of up to 128 events or 8,192 blocks.
pub const KV_EVENTS_MAX_FRAME_BYTES: usize = 1024 * 1024;
/// The two u64 frames after the topic.
const ID_FRAMES_BYTES: usize = 16;

/// The ceilings one subscription family runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZmtpLimits {
    /// Largest message frame buffered.
    pub max_frame_bytes: usize,
    /// Largest message (all frames) buffered.
    pub max_message_bytes: usize,
    /// Largest frame skipped without ending the session.
    pub max_discard_bytes: u64,
    pub connect_timeout: Duration,
    pub handshake_timeout: Duration,
    /// From a message's first byte to its last: a publisher that starts a message and stalls
    /// would hold its buffer, and the subscription, for as long as it chose.
    pub message_timeout: Duration,
    /// What message buffers borrow from past [`FREE_BUFFER_BYTES`]: the process's
    /// [`LARGE_MESSAGES`], shared by every family.
    pub budget: BudgetRef,
}

impl ZmtpLimits {
    /// ActiveLoad samples (`kv_metrics`).
    pub const KV_METRICS: Self =
        Self::for_frames(KV_METRICS_MAX_PAYLOAD_BYTES + DYNAMO_FRAME_HEADER_BYTES, 1024 * 1024);
    /// KV cache events (`kv-events`).
    pub const KV_EVENTS: Self = Self::for_frames(KV_EVENTS_MAX_FRAME_BYTES, 16 * 1024 * 1024);

    const fn for_frames(max_frame_bytes: usize, max_discard_bytes: u64) -> Self {
        Self {
            max_frame_bytes,
            max_message_bytes: MAX_TOPIC_BYTES + ID_FRAMES_BYTES + max_frame_bytes,
            max_discard_bytes,
            connect_timeout: CONNECT_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            message_timeout: MESSAGE_TIMEOUT,
            budget: BudgetRef(&LARGE_MESSAGES),
        }
    }

    /// The message buffer never grows past this: a whole message plus one command frame,
    /// which may arrive between two frames of it.
    pub const fn buffer_ceiling(&self) -> usize {
        self.max_message_bytes + MAX_COMMAND_BYTES
    }
}

/// Why a session ended. [`ZmtpError::is_violation`] tells the peer's faults (counted as
/// `transport_refused`) from the network's.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("the publisher closed the connection")]
    Closed,
    #[error("the handshake did not complete within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    #[error("a frame declares {declared} bytes, over the {ceiling}-byte ceiling")]
    FrameTooLarge { declared: u64, ceiling: u64 },
    #[error("a message's skipped frames pass {frames} frames or {ceiling} bytes")]
    SkippedTooMuch { frames: usize, ceiling: u64 },
    #[error("the publisher sent ERROR: {0}")]
    PeerError(String),
    #[error("a message began but was not whole within {0:?}")]
    MessageTimeout(Duration),
    #[error("a message borrowing from the shared budget was not whole within {0:?} of its loan")]
    LoanTimeout(Duration),
}

impl ZmtpError {
    /// The publisher broke the protocol or a bound (as opposed to a network failure).
    pub fn is_violation(&self) -> bool {
        !matches!(self, ZmtpError::Io(_) | ZmtpError::Closed)
    }
}

#[cfg(test)]
mod tests;
