//! A kv-events message as Dynamo 1.6.1 sends it, decoded into a batch of router events.
//!
//! ```text
//! envelope = see crate::load::envelope (4 frames, 0x01 | len | msgpack {…, payload: bin})
//! payload  = msgpack [RouterEvent…]
//! RouterEvent = {worker_id, storage_tier, residency_domain, event: {event_id, data, dp_rank}}
//! data        = {stored: {parent_hash, start_position, blocks: [{block_hash, tokens_hash,
//!                mm_extra_info}]}} | {removed: {block_hashes: […]}} | "cleared"
//! ```
//!
//! `dp_rank` sits inside `event` (upstream's `KvCacheEvent`); a missing one is rank 0, a missing
//! `storage_tier` is the device tier. Every struct is accepted as a named map or a positional
//! array in the order above, unknown map keys are ignored, and hashes are full u64. The
//! multimodal `mm_extra_info` is skipped: the engine already folds it into `tokens_hash`.
//!
//! A batch holds at most [`MAX_EVENTS_PER_BATCH`] events and [`MAX_BLOCKS_PER_BATCH`] block
//! hashes (stored blocks plus removed hashes), the bounds Dynamo's publisher splits batches at; a
//! batch of one event may hold up to [`MAX_BLOCKS_PER_EVENT`]. Larger batches are refused whole.
//! Elements past a ceiling are skipped without being kept, so decoding holds at most the two
//! ceilings' worth of blocks.

use std::marker::PhantomData;

pub use continuum_kv_index::StoredBlock;
use serde::Deserialize;
use serde::de::{IgnoredAny, SeqAccess, Visitor};

use crate::load::envelope::{EnvelopeError, Expected, bounded, open};
use crate::load::zmtp::{DYNAMO_FRAME_HEADER_BYTES, KV_EVENTS_MAX_FRAME_BYTES};

/// The topic of kv-events, in frame 0 and in the envelope.
pub const KV_EVENTS_TOPIC: &str = "kv-events";
/// Events one message may carry (seed: "batches of up to 128 events or 8192 blocks").
pub const MAX_EVENTS_PER_BATCH: usize = 128;
/// Stored blocks plus removed hashes one message of several events may carry.
pub const MAX_BLOCKS_PER_BATCH: usize = 8_192;
/// Stored blocks or removed hashes a message of one event may carry. Dynamo's publisher splits
/// its batches at the two bounds above but sends an event larger than the block bound whole
/// (one prompt of 131,088 tokens at 16 per block is such an event); refusing it would clear the
/// publisher's ranks at every long prompt. A megabyte frame holds about 18,000 blocks as Dynamo
/// encodes them, so this bound only caps what a terser encoding could make decoding keep.
pub const MAX_BLOCKS_PER_EVENT: usize = 65_536;
/// The largest envelope: the 1 MiB transport frame minus Dynamo's 5-byte header.
pub const KV_EVENTS_MAX_ENVELOPE_BYTES: usize = KV_EVENTS_MAX_FRAME_BYTES - DYNAMO_FRAME_HEADER_BYTES;

/// Why a whole message was refused. The label set is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeError {
    /// Bad frame shape, lengths that disagree, msgpack that does not decode, or a field of the
    /// wrong type.
    Malformed,
    /// The frame header's version byte is not 1.
    UnknownVersion,
    /// Frame 0 or the envelope's topic is not `kv-events`.
    TopicMismatch,
    /// The declared envelope exceeds [`KV_EVENTS_MAX_ENVELOPE_BYTES`]; refused unread.
    Oversized,
    /// Frame and envelope publisher ids disagree, or the id is not the discovery record's.
    IdentityMismatch,
    /// More than [`MAX_EVENTS_PER_BATCH`] events.
    TooManyEvents,
    /// More than [`MAX_BLOCKS_PER_BATCH`] blocks across the batch's events, or more than
    /// [`MAX_BLOCKS_PER_EVENT`] in a batch of one.
    TooManyBlocks,
}

impl DecodeError {
    /// Whether the message was the publisher's kv-events, refused: its events are lost. A
    /// message of another topic or naming another publisher was not this stream's to lose.
    pub const fn loses_events(self) -> bool {
        !matches!(self, DecodeError::TopicMismatch | DecodeError::IdentityMismatch)
    }

    pub const ALL: [DecodeError; 7] = [
        DecodeError::Malformed,
        DecodeError::UnknownVersion,
        DecodeError::TopicMismatch,
        DecodeError::Oversized,
        DecodeError::IdentityMismatch,
        DecodeError::TooManyEvents,
        DecodeError::TooManyBlocks,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DecodeError::Malformed => "malformed",
            DecodeError::UnknownVersion => "unknown_version",
            DecodeError::TopicMismatch => "topic_mismatch",
            DecodeError::Oversized => "oversized",
            DecodeError::IdentityMismatch => "identity_mismatch",
            DecodeError::TooManyEvents => "too_many_events",
            DecodeError::TooManyBlocks => "too_many_blocks",
        }
    }
}

impl From<EnvelopeError> for DecodeError {
    fn from(e: EnvelopeError) -> Self {
        match e {
            EnvelopeError::Malformed => DecodeError::Malformed,
            EnvelopeError::UnknownVersion => DecodeError::UnknownVersion,
            EnvelopeError::TopicMismatch => DecodeError::TopicMismatch,
            EnvelopeError::Oversized => DecodeError::Oversized,
            EnvelopeError::IdentityMismatch => DecodeError::IdentityMismatch,
        }
    }
}

/// One decoded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventBatch {
    pub publisher_id: u64,
    pub sequence: u64,
    /// The publisher's clock, Unix ms; informational.
    pub published_at: u64,
    pub events: Vec<KvEvent>,
}

/// One RouterEvent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    pub worker_id: u64,
    pub dp_rank: u32,
    /// Monotonic per publisher.
    pub event_id: u64,
    pub storage_tier: StorageTier,
    pub residency_domain: ResidencyDomain,
    pub data: KvEventData,
}

impl KvEvent {
    /// Whether the event is about the worker rank's own device (GPU) cache, the only one the
    /// router credits. A clear names a domain, not a tier (upstream sends `device` as a
    /// placeholder), so only its domain is judged.
    pub fn is_worker_device(&self) -> bool {
        let worker_domain = matches!(self.residency_domain, ResidencyDomain::Unspecified | ResidencyDomain::Worker);
        worker_domain && (self.data == KvEventData::Cleared || self.storage_tier == StorageTier::Device)
    }

    /// Bytes the decoded event holds for its blocks.
    pub fn held_bytes(&self) -> usize {
        match &self.data {
            KvEventData::Stored(stored) => stored.blocks.capacity() * std::mem::size_of::<StoredBlock>(),
            KvEventData::Removed(hashes) => hashes.capacity() * std::mem::size_of::<u64>(),
            KvEventData::Cleared => 0,
        }
    }

    /// Block hashes the event names (stored blocks or removed hashes).
    pub fn blocks(&self) -> usize {
        match &self.data {
            KvEventData::Stored(stored) => stored.blocks.len(),
            KvEventData::Removed(hashes) => hashes.len(),
            KvEventData::Cleared => 0,
        }
    }
}

/// Upstream's `StorageTier`, snake_case on the wire; a missing tier is the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageTier {
    Device,
    HostPinned,
    Disk,
    External,
    /// A tier this build does not know.
    Unknown,
}

impl StorageTier {
    fn parse(tier: Option<&str>) -> Self {
        match tier {
            None | Some("device") => StorageTier::Device,
            Some("host_pinned") => StorageTier::HostPinned,
            Some("disk") => StorageTier::Disk,
            Some("external") => StorageTier::External,
            Some(_) => StorageTier::Unknown,
        }
    }
}

/// Upstream's `residency_domain`: which lifetime owns the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResidencyDomain {
    /// Absent or nil: a legacy, worker-owned event.
    Unspecified,
    Worker,
    /// A persistent cache owner, not the worker's own cache.
    CacheOwner,
    Unknown,
}

impl ResidencyDomain {
    fn parse(domain: Option<&str>) -> Self {
        match domain {
            None => ResidencyDomain::Unspecified,
            Some("worker") => ResidencyDomain::Worker,
            Some("cache_owner") => ResidencyDomain::CacheOwner,
            Some(_) => ResidencyDomain::Unknown,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEventData {
    Stored(Stored),
    /// Engine block hashes the rank no longer holds.
    Removed(Vec<u64>),
    /// The rank holds nothing any more.
    Cleared,
}

/// A chain of blocks stored under `parent_hash` (or at the root when it is absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The engine block hash of the chain's parent.
    pub parent_hash: Option<u64>,
    pub start_position: Option<u32>,
    /// Engine block hash and tokens hash of each block, root-most first.
    pub blocks: Vec<StoredBlock>,
}

/// Decodes the frames of one message from the publisher whose discovery record says
/// `expected_publisher`; the error is the label to count the message under.
pub fn decode_kv_events<'a>(
    frames: impl IntoIterator<Item = &'a [u8]>,
    expected_publisher: u64,
) -> Result<KvEventBatch, DecodeError> {
    let expected = Expected {
        topic: KV_EVENTS_TOPIC,
        max_envelope_bytes: KV_EVENTS_MAX_ENVELOPE_BYTES,
        publisher_id: expected_publisher,
    };
    let envelope = open(frames, expected)?;
    let batch: WireBatch<'_> = bounded(envelope.payload).map_err(|_| DecodeError::Malformed)?;
    if batch.events_seen > MAX_EVENTS_PER_BATCH {
        return Err(DecodeError::TooManyEvents);
    }
    let max_blocks = if batch.events_seen == 1 { MAX_BLOCKS_PER_EVENT } else { MAX_BLOCKS_PER_BATCH };
    if batch.blocks_seen > max_blocks {
        return Err(DecodeError::TooManyBlocks);
    }
    Ok(KvEventBatch {
        publisher_id: envelope.publisher_id,
        sequence: envelope.sequence,
        published_at: envelope.published_at,
        events: batch.events.into_iter().map(KvEvent::from).collect(),
    })
}

/// The payload array. Events past a ceiling are counted and skipped, not kept.
struct WireBatch<'a> {
    events: Vec<WireEvent<'a>>,
    events_seen: usize,
    blocks_seen: usize,
}

impl<'de> Deserialize<'de> for WireBatch<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_seq(BatchVisitor)
    }
}

struct BatchVisitor;

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = WireBatch<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of RouterEvents")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let hint = seq.size_hint().unwrap_or(0).min(MAX_EVENTS_PER_BATCH);
        let mut batch = WireBatch { events: Vec::with_capacity(hint), events_seen: 0, blocks_seen: 0 };
        loop {
            let within = batch.events_seen < MAX_EVENTS_PER_BATCH && batch.blocks_seen <= MAX_BLOCKS_PER_BATCH;
            if within {
                let Some(event) = seq.next_element::<WireEvent<'de>>()? else { break };
                batch.blocks_seen = batch.blocks_seen.saturating_add(event.event.data.blocks_seen());
                batch.events.push(event);
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            batch.events_seen += 1;
        }
        Ok(batch)
    }
}

#[derive(Deserialize)]
struct WireEvent<'a> {
    worker_id: u64,
    #[serde(default, borrow)]
    storage_tier: Option<&'a str>,
    #[serde(default, borrow)]
    residency_domain: Option<&'a str>,
    event: WireKvEvent,
    // Later upstream fields, skipped; named so a positional array may carry them too.
    #[serde(default, rename = "state_source")]
    _state_source: IgnoredAny,
    #[serde(default, rename = "session_id")]
    _session_id: IgnoredAny,
}

#[derive(Deserialize)]
struct WireKvEvent {
    event_id: u64,
    data: WireData,
    #[serde(default)]
    dp_rank: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireData {
    Stored(WireStored),
    Removed(WireRemoved),
    Cleared,
}

impl WireData {
    fn blocks_seen(&self) -> usize {
        match self {
            WireData::Stored(stored) => stored.blocks.seen,
            WireData::Removed(removed) => removed.block_hashes.seen,
            WireData::Cleared => 0,
        }
    }
}

#[derive(Deserialize)]
struct WireStored {
    #[serde(default)]
    parent_hash: Option<u64>,
    #[serde(default)]
    start_position: Option<u32>,
    blocks: Capped<WireBlock>,
}

#[derive(Deserialize)]
struct WireRemoved {
    block_hashes: Capped<u64>,
}

#[derive(Deserialize)]
struct WireBlock {
    block_hash: u64,
    tokens_hash: u64,
    #[serde(default, rename = "mm_extra_info")]
    _mm_extra_info: IgnoredAny,
}

/// A block list that keeps at most [`MAX_BLOCKS_PER_EVENT`] elements and counts the rest, so a
/// hostile list costs no more memory than the largest legitimate event.
struct Capped<T> {
    items: Vec<T>,
    seen: usize,
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Capped<T> {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_seq(CappedVisitor(PhantomData))
    }
}

struct CappedVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for CappedVisitor<T> {
    type Value = Capped<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of blocks")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let hint = seq.size_hint().unwrap_or(0).min(MAX_BLOCKS_PER_BATCH);
        let mut capped = Capped { items: Vec::with_capacity(hint), seen: 0 };
        loop {
            if capped.items.len() < MAX_BLOCKS_PER_EVENT {
                let Some(item) = seq.next_element::<T>()? else { break };
                capped.items.push(item);
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
            capped.seen += 1;
        }
        Ok(capped)
    }
}

impl From<WireEvent<'_>> for KvEvent {
    fn from(wire: WireEvent<'_>) -> Self {
        let data = match wire.event.data {
            WireData::Stored(stored) => KvEventData::Stored(Stored {
                parent_hash: stored.parent_hash,
                start_position: stored.start_position,
                blocks: stored
                    .blocks
                    .items
                    .into_iter()
                    .map(|b| StoredBlock { block_hash: b.block_hash, tokens_hash: b.tokens_hash })
                    .collect(),
            }),
            WireData::Removed(removed) => KvEventData::Removed(removed.block_hashes.items),
            WireData::Cleared => KvEventData::Cleared,
        };
        KvEvent {
            worker_id: wire.worker_id,
            dp_rank: wire.event.dp_rank.unwrap_or(0),
            event_id: wire.event.event_id,
            storage_tier: StorageTier::parse(wire.storage_tier),
            residency_domain: ResidencyDomain::parse(wire.residency_domain),
            data,
        }
    }
}

#[cfg(test)]
mod tests;
