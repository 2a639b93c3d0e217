//! ZMTP 3.x bytes without I/O: the greeting, frame headers, and the commands a SUB exchanges
//! with a PUB (READY, PING/PONG, ERROR). Everything here is a pure function of its input.

use super::ZmtpError;

pub const GREETING_BYTES: usize = 64;
const SIGNATURE_BYTES: usize = 10;
const MECHANISM: std::ops::Range<usize> = 12..32;
const NULL_MECHANISM: &[u8] = b"NULL";

/// Frame flag bits (ZMTP 3.x section "Framing").
pub const FLAG_MORE: u8 = 0x01;
pub const FLAG_LONG: u8 = 0x02;
pub const FLAG_COMMAND: u8 = 0x04;
const FLAG_RESERVED: u8 = 0xF8;

/// Our greeting: ZMTP 3.0 (so the peer expects subscription messages, not SUBSCRIBE commands),
/// NULL mechanism, client. The padding carries the ZMTP 1.0 length byte as libzmq's does.
pub fn greeting() -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[MECHANISM.start..MECHANISM.start + NULL_MECHANISM.len()].copy_from_slice(NULL_MECHANISM);
    g
}

/// Checks the peer's greeting: a ZMTP 3.x signature offering NULL security.
pub fn parse_greeting(g: &[u8; GREETING_BYTES]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[SIGNATURE_BYTES - 1] & 0x01 == 0 {
        return Err(ZmtpError::Protocol("the greeting has no ZMTP signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Protocol("the peer speaks ZMTP before 3.0"));
    }
    let mechanism = &g[MECHANISM];
    let (name, padding) = mechanism.split_at(NULL_MECHANISM.len());
    if name != NULL_MECHANISM || padding.iter().any(|&b| b != 0) {
        return Err(ZmtpError::Protocol("the peer asks for a security mechanism other than NULL"));
    }
    Ok(())
}

/// A frame header: flags and the declared body length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub more: bool,
    pub command: bool,
    pub long: bool,
}

/// Reads the flags byte; the length follows in 1 or 8 bytes.
pub fn parse_flags(flags: u8) -> Result<FrameHeader, ZmtpError> {
    if flags & FLAG_RESERVED != 0 {
        return Err(ZmtpError::Protocol("reserved frame flag bits are set"));
    }
    let header =
        FrameHeader { more: flags & FLAG_MORE != 0, command: flags & FLAG_COMMAND != 0, long: flags & FLAG_LONG != 0 };
    if header.command && header.more {
        return Err(ZmtpError::Protocol("a command frame has the MORE flag"));
    }
    Ok(header)
}

/// A command the peer sent, borrowed from the frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// READY with the peer's socket type.
    Ready {
        socket_type: &'a [u8],
    },
    /// PING's context, to echo in PONG.
    Ping {
        context: &'a [u8],
    },
    Pong,
    Error {
        reason: &'a [u8],
    },
    /// A command a PUB does not send to a SUB; ignored.
    Other,
}

const MAX_PING_CONTEXT: usize = 16;

pub fn parse_command(body: &[u8]) -> Result<Command<'_>, ZmtpError> {
    let (&name_len, rest) = body.split_first().ok_or(ZmtpError::Protocol("an empty command frame"))?;
    let name_len = usize::from(name_len);
    if rest.len() < name_len {
        return Err(ZmtpError::Protocol("a command name runs past its frame"));
    }
    let (name, data) = rest.split_at(name_len);
    Ok(match name {
        b"READY" => Command::Ready { socket_type: socket_type(data)? },
        b"PING" => {
            let context = data.get(2..).ok_or(ZmtpError::Protocol("PING without its TTL"))?;
            if context.len() > MAX_PING_CONTEXT {
                return Err(ZmtpError::Protocol("PING context longer than 16 bytes"));
            }
            Command::Ping { context }
        }
        b"PONG" => Command::Pong,
        b"ERROR" => {
            let reason = data.split_first().map_or(&[][..], |(&len, r)| &r[..usize::from(len).min(r.len())]);
            Command::Error { reason }
        }
        _ => Command::Other,
    })
}

/// The `Socket-Type` property of READY's metadata.
fn socket_type(mut data: &[u8]) -> Result<&[u8], ZmtpError> {
    const TRUNCATED: ZmtpError = ZmtpError::Protocol("READY metadata runs past its frame");
    let mut found = None;
    while let Some((&name_len, rest)) = data.split_first() {
        let (name, rest) = split(rest, usize::from(name_len)).ok_or(TRUNCATED)?;
        let (len_bytes, rest) = split(rest, 4).ok_or(TRUNCATED)?;
        let value_len = u32::from_be_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]);
        let (value, rest) = split(rest, usize::try_from(value_len).unwrap_or(usize::MAX)).ok_or(TRUNCATED)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            found = Some(value);
        }
        data = rest;
    }
    found.ok_or(ZmtpError::Protocol("READY without a Socket-Type"))
}

fn split(bytes: &[u8], at: usize) -> Option<(&[u8], &[u8])> {
    (at <= bytes.len()).then(|| bytes.split_at(at))
}

/// Whether a SUB may talk to this socket type.
pub fn is_publisher(socket_type: &[u8]) -> bool {
    socket_type == b"PUB" || socket_type == b"XPUB"
}

/// Encodes a short command frame into `out`; returns the bytes written.
fn command(out: &mut [u8], name: &[u8], data: &[&[u8]]) -> usize {
    let body = 1 + name.len() + data.iter().map(|d| d.len()).sum::<usize>();
    out[0] = FLAG_COMMAND;
    out[1] = u8::try_from(body).unwrap_or(u8::MAX);
    out[2] = u8::try_from(name.len()).unwrap_or(u8::MAX);
    let mut at = 3;
    for part in std::iter::once(name).chain(data.iter().copied()) {
        out[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    at
}

/// READY announcing a SUB socket (27 bytes).
pub fn ready_sub(out: &mut [u8]) -> usize {
    let name = b"Socket-Type";
    command(out, b"READY", &[&[11], name, &3u32.to_be_bytes(), b"SUB"])
}

/// PONG echoing a PING's context (at most 23 bytes).
pub fn pong(out: &mut [u8], context: &[u8]) -> usize {
    command(out, b"PONG", &[context])
}

/// A ZMTP 3.0 subscription message: one frame, `0x01` then the topic prefix.
pub fn subscribe(out: &mut [u8], topic: &[u8]) -> usize {
    out[0] = 0;
    out[1] = u8::try_from(1 + topic.len()).unwrap_or(u8::MAX);
    out[2] = 0x01;
    out[3..3 + topic.len()].copy_from_slice(topic);
    3 + topic.len()
}
