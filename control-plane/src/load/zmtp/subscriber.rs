//! One SUB session over any byte stream (a TCP connection, or later a broker's relayed
//! stream): the handshake, then messages one at a time, each borrowed from the session's
//! buffer until the next is read.

use std::future::Future;
use std::ops::Range;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use super::budget::{Borrower, LOAN_DEADLINE};
use super::buffer::MessageBuffer;
use super::wire::{self, Command, GREETING_BYTES};
use super::{
    MAX_COMMAND_BYTES, MAX_FRAMES_PER_MESSAGE, MAX_SKIPPED_FRAMES, MAX_TOPIC_BYTES, READ_BUFFER_BYTES,
    WRITE_BUFFER_BYTES,
};
use super::{ZmtpError, ZmtpLimits};

/// A message that arrived but was not buffered; the session goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// A frame over `max_frame_bytes`, or a message over `max_message_bytes`.
    Oversized,
    /// More than [`MAX_FRAMES_PER_MESSAGE`] frames.
    TooManyFrames,
    /// A first frame longer than [`MAX_TOPIC_BYTES`]: no topic we subscribe to.
    TopicTooLong,
    /// A frame within the ceilings whose room the process-wide budget for large messages
    /// could not lend just then (other subscriptions held it).
    OverBudget,
}

/// What [`ZmtpSubscriber::recv`] returns.
#[derive(Debug)]
pub enum Incoming<'a> {
    Message(Message<'a>),
    Dropped(Dropped),
}

/// A whole multipart message, borrowed from the session.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    bytes: &'a [u8],
    frames: &'a [Range<usize>],
}

impl<'a> Message<'a> {
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    pub fn frame(&self, index: usize) -> Option<&'a [u8]> {
        self.frames.get(index).and_then(|r| self.bytes.get(r.clone()))
    }
}

/// What [`ZmtpSubscriber::frames_of_next`] read.
enum Next {
    /// A command, answered; the message is still to come.
    Command,
    /// A whole message, or why it was dropped unread.
    Message(Option<Dropped>),
}

/// A subscribed ZMTP session.
#[derive(Debug)]
pub struct ZmtpSubscriber<S> {
    stream: S,
    limits: ZmtpLimits,
    read: Box<[u8]>,
    /// Unconsumed bytes of `read`.
    window: Range<usize>,
    write: [u8; WRITE_BUFFER_BYTES],
    message: MessageBuffer,
    frames: Vec<Range<usize>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> ZmtpSubscriber<S> {
    /// Greets the publisher, exchanges READY and subscribes to `topic`, all within
    /// `limits.handshake_timeout`. Large messages borrow from `limits.budget` against
    /// `borrower`'s share of it.
    pub async fn handshake(stream: S, limits: ZmtpLimits, topic: &[u8], borrower: Borrower) -> Result<Self, ZmtpError> {
        if topic.len() + 3 > WRITE_BUFFER_BYTES {
            return Err(ZmtpError::Protocol("the subscription topic does not fit a write"));
        }
        let mut session = Self {
            stream,
            limits,
            read: vec![0; READ_BUFFER_BYTES].into_boxed_slice(),
            window: 0..0,
            write: [0; WRITE_BUFFER_BYTES],
            message: MessageBuffer::new(limits.buffer_ceiling(), limits.budget, borrower),
            frames: Vec::with_capacity(MAX_FRAMES_PER_MESSAGE),
        };
        match tokio::time::timeout(limits.handshake_timeout, session.greet(topic)).await {
            Ok(result) => result.map(|()| session),
            Err(_) => Err(ZmtpError::HandshakeTimeout(limits.handshake_timeout)),
        }
    }

    /// Bytes of buffer this session holds (read, write and message buffers).
    pub fn buffered_capacity(&self) -> usize {
        self.read.len() + self.write.len() + self.message.capacity()
    }

    /// The message buffer's capacity and ceiling.
    pub fn message_capacity(&self) -> (usize, usize) {
        (self.message.capacity(), self.message.ceiling())
    }

    /// Each write is flushed before a read waits on the peer's answer to it: over a buffered
    /// stream (a broker's relay, say) the greeting or READY would otherwise wait unsent while
    /// the handshake timed out.
    async fn greet(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        self.stream.write_all(&wire::greeting()).await?;
        self.stream.flush().await?;
        let mut peer = [0u8; GREETING_BYTES];
        self.read_exact(&mut peer).await?;
        wire::parse_greeting(&peer)?;
        let n = wire::ready_sub(&mut self.write);
        self.stream.write_all(&self.write[..n]).await?;
        self.stream.flush().await?;
        let (header, size) = self.frame_header().await?;
        if !header.command {
            return Err(ZmtpError::Protocol("the peer sent a message before READY"));
        }
        let body = self.read_command(size).await?;
        match wire::parse_command(self.message.as_slice().get(body).unwrap_or_default())? {
            Command::Ready { socket_type } if wire::is_publisher(socket_type) => {}
            Command::Ready { .. } => return Err(ZmtpError::Protocol("the peer is not a PUB socket")),
            Command::Error { reason } => return Err(ZmtpError::PeerError(peer_reason(reason))),
            _ => return Err(ZmtpError::Protocol("the peer's first command is not READY")),
        }
        self.message.reset();
        let n = wire::subscribe(&mut self.write, topic);
        self.stream.write_all(&self.write[..n]).await?;
        self.stream.flush().await?;
        Ok(())
    }

    /// The next message. Commands in between are answered (PING) or ignored. The wait for a
    /// message's first byte is not bounded; from it, the whole message must arrive within
    /// [`ZmtpLimits::message_timeout`].
    pub async fn recv(&mut self) -> Result<Incoming<'_>, ZmtpError> {
        let deadline = self.limits.message_timeout;
        // The last message is done with: a large one's buffer goes now, not when the next one
        // begins (a publisher may stay silent for as long as it likes).
        self.message.reset();
        let dropped = loop {
            self.fill().await?;
            match tokio::time::timeout(deadline, self.frames_of_next()).await {
                Err(_) => return Err(ZmtpError::MessageTimeout(deadline)),
                Ok(Err(error)) => return Err(error),
                Ok(Ok(Next::Command)) => continue,
                Ok(Ok(Next::Message(dropped))) => break dropped,
            }
        };
        Ok(match dropped {
            Some(reason) => Incoming::Dropped(reason),
            None => Incoming::Message(Message { bytes: self.message.as_slice(), frames: &self.frames }),
        })
    }

    /// Reads the frames of the next message, or one command before it.
    async fn frames_of_next(&mut self) -> Result<Next, ZmtpError> {
        self.message.reset();
        self.frames.clear();
        let mut dropped = None;
        let mut index = 0usize;
        // Frames and bytes of this message skipped unread.
        let (mut skipped_frames, mut skipped_bytes) = (0usize, 0u64);
        // Set once the message borrows past a command's slack: the rest of it, headers and
        // commands between its frames included, must come by then.
        let mut loan: Option<Instant> = None;
        loop {
            let (header, size) = on_loan(loan, self.frame_header()).await?;
            if header.command {
                on_loan(loan, self.command(size)).await?;
                if index == 0 {
                    return Ok(Next::Command);
                }
                continue;
            }
            let admitted = self.admit(index, size)?;
            if admitted.is_some() || dropped.is_some() {
                skipped_frames += 1;
                skipped_bytes = skipped_bytes.saturating_add(size);
                let ceiling = self.limits.max_discard_bytes;
                if skipped_frames > MAX_SKIPPED_FRAMES || skipped_bytes > ceiling {
                    return Err(ZmtpError::SkippedTooMuch { frames: MAX_SKIPPED_FRAMES, ceiling });
                }
            }
            match admitted {
                Some(reason) => {
                    dropped.get_or_insert(reason);
                    on_loan(loan, self.discard(size)).await?;
                }
                None if dropped.is_some() => on_loan(loan, self.discard(size)).await?,
                None => {
                    let start = self.message.len();
                    let n = usize::try_from(size).map_err(|_| ZmtpError::Protocol("frame length"))?;
                    // Slack for a command, which may come before the next frame: it then never
                    // grows a borrowing buffer past what the budget lent.
                    if self.message.make_room(n, MAX_COMMAND_BYTES) {
                        if loan.is_none() && self.message.borrowed() > MAX_COMMAND_BYTES {
                            loan = Some(Instant::now() + LOAN_DEADLINE);
                        }
                        on_loan(loan, self.read_into_message(n)).await?;
                        self.frames.push(start..start + n);
                    } else {
                        dropped = Some(Dropped::OverBudget);
                        on_loan(loan, self.discard(size)).await?;
                    }
                }
            }
            index += 1;
            if !header.more {
                return Ok(Next::Message(dropped));
            }
        }
    }

    /// Whether frame `index` of `size` bytes may be buffered: `Some` to drop it unread, an
    /// error when even skipping it is beyond the bound.
    fn admit(&self, index: usize, size: u64) -> Result<Option<Dropped>, ZmtpError> {
        let limits = &self.limits;
        if size > limits.max_discard_bytes {
            return Err(ZmtpError::FrameTooLarge { declared: size, ceiling: limits.max_discard_bytes });
        }
        let too_big = |ceiling: usize| u64::try_from(ceiling).is_ok_and(|c| size > c);
        Ok(if index >= MAX_FRAMES_PER_MESSAGE {
            Some(Dropped::TooManyFrames)
        } else if index == 0 && too_big(MAX_TOPIC_BYTES) {
            Some(Dropped::TopicTooLong)
        } else if too_big(limits.max_frame_bytes)
            || !u64::try_from(limits.max_message_bytes.saturating_sub(self.message.len()))
                .is_ok_and(|room| size <= room)
        {
            Some(Dropped::Oversized)
        } else {
            None
        })
    }

    async fn command(&mut self, size: u64) -> Result<(), ZmtpError> {
        let body = self.read_command(size).await?;
        let start = body.start;
        let bytes = self.message.as_slice().get(body).unwrap_or_default();
        match wire::parse_command(bytes)? {
            Command::Ping { context } => {
                let n = wire::pong(&mut self.write, context);
                self.stream.write_all(&self.write[..n]).await?;
                self.stream.flush().await?;
            }
            Command::Pong | Command::Other => {}
            Command::Ready { .. } => return Err(ZmtpError::Protocol("a second READY")),
            Command::Error { reason } => return Err(ZmtpError::PeerError(peer_reason(reason))),
        }
        self.message.truncate(start);
        Ok(())
    }

    /// Reads a command body to the end of the message buffer; returns where it sits.
    async fn read_command(&mut self, size: u64) -> Result<Range<usize>, ZmtpError> {
        let n = usize::try_from(size).ok().filter(|&n| n <= MAX_COMMAND_BYTES);
        let n = n.ok_or(ZmtpError::Protocol("a command frame over 512 bytes"))?;
        let start = self.message.len();
        self.read_into_message(n).await?;
        Ok(start..start + n)
    }

    async fn frame_header(&mut self) -> Result<(wire::FrameHeader, u64), ZmtpError> {
        let mut flags = [0u8; 1];
        self.read_exact(&mut flags).await?;
        let header = wire::parse_flags(flags[0])?;
        let size = if header.long {
            let mut size = [0u8; 8];
            self.read_exact(&mut size).await?;
            u64::from_be_bytes(size)
        } else {
            let mut size = [0u8; 1];
            self.read_exact(&mut size).await?;
            u64::from(size[0])
        };
        Ok((header, size))
    }

    async fn read_into_message(&mut self, n: usize) -> Result<(), ZmtpError> {
        if !self.message.fits(u64::try_from(n).unwrap_or(u64::MAX)) {
            return Err(ZmtpError::Protocol("a frame past the message buffer's ceiling"));
        }
        let mut at = self.message.len();
        self.message.extend(n);
        let end = at + n;
        while at < end {
            if self.window.is_empty() && end - at >= READ_BUFFER_BYTES {
                // A large frame: read straight into the message instead of through `read`.
                let got = self.stream.read(self.message.slice_mut(at..end)).await?;
                if got == 0 {
                    return Err(ZmtpError::Closed);
                }
                at += got;
                continue;
            }
            self.fill().await?;
            let take = (end - at).min(self.window.len());
            let src = &self.read[self.window.start..self.window.start + take];
            self.message.slice_mut(at..at + take).copy_from_slice(src);
            self.window.start += take;
            at += take;
        }
        Ok(())
    }

    async fn read_exact(&mut self, out: &mut [u8]) -> Result<(), ZmtpError> {
        let mut filled = 0;
        while filled < out.len() {
            self.fill().await?;
            let take = (out.len() - filled).min(self.window.len());
            out[filled..filled + take].copy_from_slice(&self.read[self.window.start..self.window.start + take]);
            self.window.start += take;
            filled += take;
        }
        Ok(())
    }

    /// Skips `n` bytes without holding them.
    async fn discard(&mut self, mut n: u64) -> Result<(), ZmtpError> {
        while n > 0 {
            self.fill().await?;
            let take = usize::try_from(n).unwrap_or(usize::MAX).min(self.window.len());
            self.window.start += take;
            n -= u64::try_from(take).unwrap_or(n);
        }
        Ok(())
    }

    /// Refills the read buffer when it is empty.
    async fn fill(&mut self) -> Result<(), ZmtpError> {
        if !self.window.is_empty() {
            return Ok(());
        }
        let n = self.stream.read(&mut self.read).await?;
        if n == 0 {
            return Err(ZmtpError::Closed);
        }
        self.window = 0..n;
        Ok(())
    }
}

/// `read`, by the message's loan deadline when it holds one.
async fn on_loan<T>(loan: Option<Instant>, read: impl Future<Output = Result<T, ZmtpError>>) -> Result<T, ZmtpError> {
    match loan {
        None => read.await,
        Some(deadline) => {
            tokio::time::timeout_at(deadline, read).await.map_err(|_| ZmtpError::LoanTimeout(LOAN_DEADLINE))?
        }
    }
}

/// A peer's ERROR reason as it may be logged: control characters (a line break among them)
/// escaped, so a peer cannot forge log lines of its own.
fn peer_reason(reason: &[u8]) -> String {
    String::from_utf8_lossy(reason).escape_debug().to_string()
}
