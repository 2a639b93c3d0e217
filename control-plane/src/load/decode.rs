//! A kv_metrics message as Dynamo 1.6.1 sends it, decoded into an ActiveLoad sample.
//!
//! ```text
//! envelope = see super::envelope (4 frames, 0x01 | len | msgpack {…, payload: bin})
//! payload  = msgpack ActiveLoad {worker_id, dp_rank, active_decode_blocks,
//!                                active_prefill_tokens, kv_used_blocks}
//! ```
//!
//! Both msgpack layers are accepted as named maps or positional arrays (Dynamo's N-2 window),
//! unknown map keys are ignored, and nil or missing load fields stay absent. Nothing here
//! allocates: the envelope borrows its bytes.

use continuum_proto::model::Load;
use serde::Deserialize;

use super::envelope::{EnvelopeError, Expected, bounded, open};
pub use super::envelope::{FRAME_VERSION, MAX_MSGPACK_DEPTH};
use super::events::LoadEvent;
use super::zmtp::KV_METRICS_MAX_PAYLOAD_BYTES;

/// The topic of ActiveLoad samples, in frame 0 and in the envelope.
pub const KV_METRICS_TOPIC: &str = "kv_metrics";

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
    let expected = Expected {
        topic: KV_METRICS_TOPIC,
        max_envelope_bytes: KV_METRICS_MAX_PAYLOAD_BYTES,
        publisher_id: expected_publisher,
    };
    let envelope = open(frames, expected).map_err(LoadEvent::from)?;
    let load: ActiveLoad = bounded(envelope.payload).map_err(|_| LoadEvent::Malformed)?;
    Ok(KvMetrics {
        publisher_id: envelope.publisher_id,
        sequence: envelope.sequence,
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

impl From<EnvelopeError> for LoadEvent {
    fn from(e: EnvelopeError) -> Self {
        match e {
            EnvelopeError::Malformed => LoadEvent::Malformed,
            EnvelopeError::UnknownVersion => LoadEvent::UnknownVersion,
            EnvelopeError::TopicMismatch => LoadEvent::TopicMismatch,
            EnvelopeError::Oversized => LoadEvent::Oversized,
            EnvelopeError::IdentityMismatch => LoadEvent::IdentityMismatch,
        }
    }
}

#[cfg(test)]
mod tests;
