//! The envelope every Dynamo 1.6.1 event-plane message travels in, shared by `kv_metrics` and
//! `kv-events`.
//!
//! ```text
//! [ topic ][ publisher_id: u64 BE ][ sequence: u64 BE ][ 0x01 | len: u32 BE | envelope ]
//! envelope = msgpack {publisher_id, sequence, published_at, topic, payload: bin}
//! ```
//!
//! The envelope is accepted as a named map or a positional array, and unknown keys are ignored.
//! Checks run in the order of their cost: frame shape, topic, version, declared length (before
//! any parsing), then msgpack, then identities. Nothing here allocates: the envelope borrows.

use serde::Deserialize;

use super::zmtp::DYNAMO_FRAME_HEADER_BYTES;

/// The only frame header version Dynamo has defined.
pub const FRAME_VERSION: u8 = 1;
/// Nesting allowed in any msgpack layer. A kv-events block's multimodal info, the deepest known
/// field, sits at 12; the rest is room for unknown fields. rmp-serde's default (1,024) recurses
/// deep enough to overflow a 2 MiB task stack.
pub const MAX_MSGPACK_DEPTH: usize = 16;

/// Why a message's frames or envelope were refused, before its payload was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EnvelopeError {
    /// Not four frames, id frames not 8 bytes, a length that disagrees with its frame, msgpack
    /// that does not decode, or frame and envelope sequences that disagree.
    Malformed,
    /// The frame header's version byte is not 1.
    UnknownVersion,
    /// Frame 0 or the envelope's topic is not the subscription's.
    TopicMismatch,
    /// The declared envelope length exceeds the family's ceiling; refused unread.
    Oversized,
    /// Frame and envelope publisher ids disagree, or the id is not the discovery record's.
    IdentityMismatch,
}

/// One opened message: its ids and the payload bytes, still msgpack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened<'a> {
    pub publisher_id: u64,
    pub sequence: u64,
    /// The publisher's clock, Unix ms; informational (age is judged on receipt).
    pub published_at: u64,
    pub payload: &'a [u8],
}

/// What a subscription expects of every message it receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expected<'t> {
    pub topic: &'t str,
    /// The largest envelope (the frame minus its 5-byte header) this family accepts.
    pub max_envelope_bytes: usize,
    /// The publisher id of the discovery record the subscription was opened for.
    pub publisher_id: u64,
}

#[derive(Deserialize)]
struct Envelope<'a> {
    publisher_id: u64,
    sequence: u64,
    #[serde(default)]
    published_at: u64,
    #[serde(borrow)]
    topic: &'a str,
    #[serde(borrow)]
    payload: &'a [u8],
}

/// Checks the frames of one message against `expected` and returns its payload.
pub fn open<'a>(
    frames: impl IntoIterator<Item = &'a [u8]>,
    expected: Expected<'_>,
) -> Result<Opened<'a>, EnvelopeError> {
    let mut frames = frames.into_iter();
    let (Some(topic), Some(publisher), Some(sequence), Some(frame), None) =
        (frames.next(), frames.next(), frames.next(), frames.next(), frames.next())
    else {
        return Err(EnvelopeError::Malformed);
    };
    if topic != expected.topic.as_bytes() {
        return Err(EnvelopeError::TopicMismatch);
    }
    let publisher_id = u64_frame(publisher)?;
    let sequence = u64_frame(sequence)?;
    let envelope: Envelope<'a> =
        bounded(envelope_bytes(frame, expected.max_envelope_bytes)?).map_err(|_| EnvelopeError::Malformed)?;
    if envelope.topic != expected.topic {
        return Err(EnvelopeError::TopicMismatch);
    }
    if envelope.sequence != sequence {
        return Err(EnvelopeError::Malformed);
    }
    if envelope.publisher_id != publisher_id || publisher_id != expected.publisher_id {
        return Err(EnvelopeError::IdentityMismatch);
    }
    Ok(Opened { publisher_id, sequence, published_at: envelope.published_at, payload: envelope.payload })
}

/// Decodes msgpack with the nesting capped at [`MAX_MSGPACK_DEPTH`].
pub fn bounded<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_MSGPACK_DEPTH);
    T::deserialize(&mut de)
}

fn u64_frame(frame: &[u8]) -> Result<u64, EnvelopeError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| EnvelopeError::Malformed)?;
    Ok(u64::from_be_bytes(bytes))
}

/// The envelope inside Dynamo's frame, after its version and declared length are checked.
fn envelope_bytes(frame: &[u8], max_envelope_bytes: usize) -> Result<&[u8], EnvelopeError> {
    let (&version, rest) = frame.split_first().ok_or(EnvelopeError::Malformed)?;
    if version != FRAME_VERSION {
        return Err(EnvelopeError::UnknownVersion);
    }
    let (len, body) = rest.split_at_checked(DYNAMO_FRAME_HEADER_BYTES - 1).ok_or(EnvelopeError::Malformed)?;
    let declared = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
    if usize::try_from(declared).map_or(true, |d| d > max_envelope_bytes) {
        return Err(EnvelopeError::Oversized);
    }
    if usize::try_from(declared).ok() != Some(body.len()) {
        return Err(EnvelopeError::Malformed);
    }
    Ok(body)
}
