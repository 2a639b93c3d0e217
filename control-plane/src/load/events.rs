//! What happened to each kv_metrics message, as counted by
//! `continuum_dynamo_load_events_total{result}`. The label set is closed.

/// The result of one received message (or one refused session or dial).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadEvent {
    /// The sample reached the store (and goes on to the replicas).
    Applied,
    /// Not four frames, id frames not 8 bytes, a length that disagrees with its frame, or
    /// msgpack that does not decode.
    Malformed,
    /// The frame header's version byte is not 1.
    UnknownVersion,
    /// Frame 0 or the envelope's topic is not `kv_metrics`.
    TopicMismatch,
    /// The declared payload (or a frame) exceeds its ceiling; refused unread.
    Oversized,
    /// Frame and envelope publisher ids disagree, the id is not the discovery record's, or the
    /// sample's worker (and rank) is not the publisher's live worker.
    IdentityMismatch,
    /// The load store is at its entry limit.
    OverCapacity,
    /// A sequence at or below one already seen on this stream, or held for this (worker, rank).
    Duplicate,
    /// A sequence past the next expected one: changes were missed, so the publisher's held
    /// samples were dropped before this one was applied.
    SequenceGap,
    /// The publisher broke ZMTP or a transport bound; the session was closed.
    TransportRefused,
    /// The publisher's address resolves only outside `dynamo.load.direct_allow_cidrs`.
    NotAllowed,
}

impl LoadEvent {
    pub const ALL: [LoadEvent; 11] = [
        LoadEvent::Applied,
        LoadEvent::Malformed,
        LoadEvent::UnknownVersion,
        LoadEvent::TopicMismatch,
        LoadEvent::Oversized,
        LoadEvent::IdentityMismatch,
        LoadEvent::OverCapacity,
        LoadEvent::Duplicate,
        LoadEvent::SequenceGap,
        LoadEvent::TransportRefused,
        LoadEvent::NotAllowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LoadEvent::Applied => "applied",
            LoadEvent::Malformed => "malformed",
            LoadEvent::UnknownVersion => "unknown_version",
            LoadEvent::TopicMismatch => "topic_mismatch",
            LoadEvent::Oversized => "oversized",
            LoadEvent::IdentityMismatch => "identity_mismatch",
            LoadEvent::OverCapacity => "over_capacity",
            LoadEvent::Duplicate => "duplicate",
            LoadEvent::SequenceGap => "sequence_gap",
            LoadEvent::TransportRefused => "transport_refused",
            LoadEvent::NotAllowed => "not_allowed",
        }
    }
}
