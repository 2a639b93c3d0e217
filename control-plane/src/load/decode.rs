//! A kv_metrics message as Dynamo 1.6.1 sends it, decoded into an ActiveLoad sample.
//!
//! ```text
//! [ topic ][ publisher_id: u64 BE ][ sequence: u64 BE ][ 0x01 | len: u32 BE | envelope ]
//! envelope = msgpack {publisher_id, sequence, published_at, topic, payload: bin}
//! payload  = msgpack ActiveLoad {worker_id, dp_rank, active_decode_blocks,
//!                                active_prefill_tokens, kv_used_blocks}
//! ```
//!
//! Both msgpack layers are accepted as named maps or positional arrays (Dynamo's N-2 window),
//! unknown map keys are ignored, and nil or missing load fields stay absent. Checks run in the
//! order of their cost: frame shape, topic, version, declared length (before any parsing),
//! then msgpack, then identities. Nothing here allocates: the envelope borrows its bytes.

use continuum_proto::model::Load;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::events::LoadEvent;
use super::zmtp::{DYNAMO_FRAME_HEADER_BYTES, KV_METRICS_MAX_PAYLOAD_BYTES};

/// The topic of ActiveLoad samples, in frame 0 and in the envelope.
pub const KV_METRICS_TOPIC: &str = "kv_metrics";
/// The only frame header version Dynamo has defined.
pub const FRAME_VERSION: u8 = 1;
/// Nesting allowed in either msgpack layer. ActiveLoad needs 1; the rest is room for unknown
/// fields. rmp-serde's default (1,024) recurses deep enough to overflow a 2 MiB task stack.
pub const MAX_MSGPACK_DEPTH: usize = 16;

/// One decoded ActiveLoad sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvMetrics {
    pub publisher_id: u64,
    pub sequence: u64,
    /// The publisher's clock, Unix ms; informational (age is judged on receipt).
    pub published_at: u64,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub load: Load,
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

#[derive(Deserialize)]
struct ActiveLoad {
    worker_id: u64,
    #[serde(default)]
    dp_rank: Option<u32>,
    #[serde(default)]
    active_decode_blocks: Option<u64>,
    #[serde(default)]
    active_prefill_tokens: Option<u64>,
    #[serde(default)]
    kv_used_blocks: Option<u64>,
}

/// Decodes the frames of one message from the publisher whose discovery record says
/// `expected_publisher`; the error is the label to count it under.
pub fn decode_kv_metrics<'a>(
    frames: impl IntoIterator<Item = &'a [u8]>,
    expected_publisher: u64,
) -> Result<KvMetrics, LoadEvent> {
    let mut frames = frames.into_iter();
    let (Some(topic), Some(publisher), Some(sequence), Some(frame), None) =
        (frames.next(), frames.next(), frames.next(), frames.next(), frames.next())
    else {
        return Err(LoadEvent::Malformed);
    };
    if topic != KV_METRICS_TOPIC.as_bytes() {
        return Err(LoadEvent::TopicMismatch);
    }
    let publisher_id = u64_frame(publisher)?;
    let sequence = u64_frame(sequence)?;
    let envelope_bytes = envelope_bytes(frame)?;
    let envelope: Envelope<'_> = {
        let mut de = rmp_serde::Deserializer::from_read_ref(envelope_bytes);
        de.set_max_depth(MAX_MSGPACK_DEPTH);
        Envelope::deserialize(&mut de).map_err(|_| LoadEvent::Malformed)?
    };
    if envelope.topic != KV_METRICS_TOPIC {
        return Err(LoadEvent::TopicMismatch);
    }
    if envelope.sequence != sequence {
        return Err(LoadEvent::Malformed);
    }
    if envelope.publisher_id != publisher_id || publisher_id != expected_publisher {
        return Err(LoadEvent::IdentityMismatch);
    }
    let load: ActiveLoad = bounded(envelope.payload)?;
    Ok(KvMetrics {
        publisher_id,
        sequence,
        published_at: envelope.published_at,
        worker_id: load.worker_id,
        dp_rank: load.dp_rank.unwrap_or(0),
        load: Load {
            active_decode_blocks: load.active_decode_blocks,
            active_prefill_tokens: load.active_prefill_tokens,
            kv_used_blocks: load.kv_used_blocks,
        },
    })
}

fn bounded<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, LoadEvent> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_MSGPACK_DEPTH);
    T::deserialize(&mut de).map_err(|_| LoadEvent::Malformed)
}

fn u64_frame(frame: &[u8]) -> Result<u64, LoadEvent> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| LoadEvent::Malformed)?;
    Ok(u64::from_be_bytes(bytes))
}

/// The envelope inside Dynamo's frame, after its version and declared length are checked.
fn envelope_bytes(frame: &[u8]) -> Result<&[u8], LoadEvent> {
    let (&version, rest) = frame.split_first().ok_or(LoadEvent::Malformed)?;
    if version != FRAME_VERSION {
        return Err(LoadEvent::UnknownVersion);
    }
    let (len, body) = rest.split_at_checked(DYNAMO_FRAME_HEADER_BYTES - 1).ok_or(LoadEvent::Malformed)?;
    let declared = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
    if usize::try_from(declared).map_or(true, |d| d > KV_METRICS_MAX_PAYLOAD_BYTES) {
        return Err(LoadEvent::Oversized);
    }
    if usize::try_from(declared).ok() != Some(body.len()) {
        return Err(LoadEvent::Malformed);
    }
    Ok(body)
}

#[cfg(test)]
mod tests;
