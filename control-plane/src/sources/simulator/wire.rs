//! The frames of one message a simulated worker publishes, in Dynamo 1.6.1's wire format (see
//! `crate::load::envelope`): the topic, the publisher id and the sequence (both big-endian),
//! then a versioned frame holding the msgpack envelope around the topic's msgpack payload.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Serialize, Serializer};

use crate::load::decode::FRAME_VERSION;

/// One encoded message: its four frames.
pub type Message = Arc<[Vec<u8>; 4]>;

struct Bin<'a>(&'a [u8]);

impl Serialize for Bin<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    topic: &'a str,
    payload: Bin<'a>,
}

/// `payload` (already msgpack) as message `sequence` of `publisher_id` on `topic`.
pub fn message(topic: &str, publisher_id: u64, sequence: u64, payload: &[u8]) -> Message {
    let published_at =
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
    let envelope = Envelope { publisher_id, sequence, published_at, topic, payload: Bin(payload) };
    // Integers, a string and a byte string into a Vec: serializing cannot fail.
    let envelope = rmp_serde::to_vec_named(&envelope).unwrap_or_default();
    let mut frame = Vec::with_capacity(5 + envelope.len());
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&u32::try_from(envelope.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend(envelope);
    Arc::new([topic.as_bytes().to_vec(), publisher_id.to_be_bytes().to_vec(), sequence.to_be_bytes().to_vec(), frame])
}
