//! The Fleet service's codec: prost's, except that a message is judged from its wire bytes
//! before it is decoded.
//!
//! prost decodes a message whole, and the counts a receiver checks afterwards come too late
//! for memory: an empty entry of a repeated message field is two bytes on the wire and a
//! hundred or more once decoded, so a 4 MiB dispatch report of empty starts would be some
//! 240 MiB before the control plane could refuse it for starting too many. [`WireLimits`]
//! counts what a message would hold by walking its fields (no allocation) and refuses one past
//! the limits its receiver holds it to anyway, so what a message decodes to is bounded by
//! those limits, not by its size on the wire.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use prost::Message;
use prost::bytes::Buf;
use prost::encoding::{WireType, decode_key, decode_varint};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic_prost::ProstEncoder;

use crate::pb;
use crate::{
    MAX_LOOKUP_BLOCK_HASHES, MAX_LOOKUP_CONTENDERS, MAX_REPORT_BLOCK_HASHES, MAX_REPORT_ENDS, MAX_REPORT_STARTED,
};

/// The most a control message of a Watch stream (a hello, an acknowledgement, a refusal) may
/// take on the wire: ids, nonces and a reason, all short.
pub const MAX_WATCH_CONTROL_BYTES: usize = 8 << 10;

/// What a message may hold, judged from its wire bytes before it is decoded. A message only the
/// control plane sends is bounded by its size and, for a fleet's, by what it would decode to.
pub trait WireLimits {
    /// Refuses `wire` if the message it encodes holds more than its receiver allows.
    fn check(wire: &[u8]) -> Result<(), Status> {
        let _ = wire;
        Ok(())
    }
}

impl WireLimits for pb::GetSnapshotRequest {}
impl WireLimits for pb::FindMatchesResponse {}

/// The most a fleet update (or snapshot) may decode to, as its entries' sizes once decoded (a
/// struct each, besides the bytes they hold) and its bytes tell it. The largest a control plane
/// sends, 64 MiB of workers at the smallest a real one takes on the wire (its key, role and
/// model in some 40 bytes), decodes to well under it; 64 MiB of empty entries, two bytes each,
/// would decode to some 200 times their size, and every replica following would run out of
/// memory together. One past it ends the stream before it is decoded; the replica keeps its
/// view, and dials again.
pub const MAX_DECODED_FLEET_UPDATE_BYTES: usize = 1 << 30;

/// A snapshot's repeated message fields, by number, and what one entry of each decodes to
/// besides its bytes.
const SNAPSHOT_ENTRIES: [(u32, usize); 3] =
    [(2, size_of::<pb::Worker>()), (3, size_of::<pb::LoadSample>()), (5, size_of::<pb::Backlog>())];
/// A delta's.
const DELTA_ENTRIES: [(u32, usize); 6] = [
    (2, size_of::<pb::Worker>()),
    (3, size_of::<pb::WorkerKey>()),
    (4, size_of::<pb::LoadSample>()),
    (5, size_of::<pb::LoadKey>()),
    (7, size_of::<pb::Backlog>()),
    (8, size_of::<pb::LoadKey>()),
];

impl WireLimits for pb::FleetUpdate {
    fn check(wire: &[u8]) -> Result<(), Status> {
        let mut decoded = wire.len();
        for field in Fields(wire) {
            match field? {
                (3, Field::Len(snapshot)) => decoded = decoded.saturating_add(entries(snapshot, &SNAPSHOT_ENTRIES)?),
                (4, Field::Len(delta)) => decoded = decoded.saturating_add(entries(delta, &DELTA_ENTRIES)?),
                _ => {}
            }
        }
        within("a fleet update's bytes once decoded", decoded, MAX_DECODED_FLEET_UPDATE_BYTES)
    }
}

impl WireLimits for pb::Snapshot {
    fn check(wire: &[u8]) -> Result<(), Status> {
        let decoded = wire.len().saturating_add(entries(wire, &SNAPSHOT_ENTRIES)?);
        within("a fleet snapshot's bytes once decoded", decoded, MAX_DECODED_FLEET_UPDATE_BYTES)
    }
}

/// What the entries of `wire`'s repeated message fields `sizes` names take once decoded, besides
/// their bytes.
fn entries(wire: &[u8], sizes: &[(u32, usize)]) -> Result<usize, Status> {
    let mut decoded = 0usize;
    for field in Fields(wire) {
        if let (number, Field::Len(_)) = field?
            && let Some((_, size)) = sizes.iter().find(|(entry, _)| *entry == number)
        {
            decoded = decoded.saturating_add(*size);
        }
    }
    Ok(decoded)
}

impl WireLimits for pb::WatchRequest {
    fn check(wire: &[u8]) -> Result<(), Status> {
        // A field given more than once is merged into one by the decoder, its lists joined:
        // every occurrence's counts add up.
        let mut report = ReportCounts::default();
        for field in Fields(wire) {
            match field? {
                // `dispatches`: a report, as large as its counts allow.
                (4, Field::Len(part)) => report.add(part)?,
                (_, Field::Len(control)) if control.len() > MAX_WATCH_CONTROL_BYTES => {
                    return Err(refused(format!(
                        "a watch control message of {} bytes; at most {MAX_WATCH_CONTROL_BYTES}",
                        control.len()
                    )));
                }
                _ => {}
            }
        }
        report.check()
    }
}

/// Lookups refused before they were decoded, since the process started.
static LOOKUPS_REFUSED: AtomicU64 = AtomicU64::new(0);

/// How many lookups this process refused before decoding them (a control plane's
/// `continuum_dynamo_kv_find_matches_total{result="too_large"}`).
pub fn lookups_refused() -> u64 {
    LOOKUPS_REFUSED.load(Ordering::Relaxed)
}

impl WireLimits for pb::FindMatchesRequest {
    fn check(wire: &[u8]) -> Result<(), Status> {
        let checked = check_lookup(wire);
        if checked.is_err() {
            LOOKUPS_REFUSED.fetch_add(1, Ordering::Relaxed);
        }
        checked
    }
}

fn check_lookup(wire: &[u8]) -> Result<(), Status> {
    let (mut hashes, mut contenders) = (0, 0);
    for field in Fields(wire) {
        match field? {
            (1, field) => hashes += field.varints(),
            (3, Field::Len(_)) => contenders += 1,
            _ => {}
        }
    }
    within("a lookup's block hashes", hashes, MAX_LOOKUP_BLOCK_HASHES)?;
    within("a lookup's contenders", contenders, MAX_LOOKUP_CONTENDERS)
}

/// What a `DispatchReport` holds: its starts and their ranks, their block hashes, its ends
/// and first tokens, each to be within the count the control plane refuses a decoded report
/// past (hashes past the report's bound it would cut; no replica sends them).
#[derive(Default)]
struct ReportCounts {
    started: usize,
    ranks: usize,
    ended: usize,
    prefilled: usize,
    hashes: usize,
}

impl ReportCounts {
    /// Counts one occurrence of the report's bytes.
    fn add(&mut self, wire: &[u8]) -> Result<(), Status> {
        for field in Fields(wire) {
            match field? {
                (1, Field::Len(start)) => {
                    self.started += 1;
                    for field in Fields(start) {
                        if let (5, field) = field? {
                            self.hashes += field.varints();
                        }
                    }
                }
                (2, field) => self.ended += field.varints(),
                (3, field) => self.prefilled += field.varints(),
                (6, Field::Len(_)) => self.ranks += 1,
                _ => {}
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), Status> {
        within("a dispatch report's starts", self.started, MAX_REPORT_STARTED)?;
        within("a dispatch report's ranks", self.ranks, MAX_REPORT_STARTED)?;
        within("a dispatch report's ends", self.ended, MAX_REPORT_ENDS)?;
        within("a dispatch report's first tokens", self.prefilled, MAX_REPORT_ENDS)?;
        within("a dispatch report's block hashes", self.hashes, MAX_REPORT_BLOCK_HASHES)
    }
}

fn within(what: &str, count: usize, limit: usize) -> Result<(), Status> {
    if count > limit {
        return Err(refused(format!("{what} number {count}; at most {limit}")));
    }
    Ok(())
}

/// Refused before decoding: the receiver ends the call, or the stream, as for a message it
/// cannot read.
fn refused(why: String) -> Status {
    Status::invalid_argument(why)
}

/// One field of a message on the wire, as much of it as counting needs.
enum Field<'a> {
    Varint,
    Len(&'a [u8]),
    Fixed,
}

impl Field<'_> {
    /// The integers a repeated integer field holds in this occurrence: one unpacked, or as many
    /// as a packed run has final bytes.
    fn varints(&self) -> usize {
        match self {
            Field::Varint | Field::Fixed => 1,
            Field::Len(packed) => packed.iter().filter(|byte| **byte < 0x80).count(),
        }
    }
}

/// The fields of a message, in wire order, each with its number; a malformed one ends them.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Field<'a>), Status>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = next_field(&mut self.0);
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

fn next_field<'a>(wire: &mut &'a [u8]) -> Result<(u32, Field<'a>), Status> {
    let malformed = |what: &str| refused(format!("a malformed message: {what}"));
    let (number, wire_type) = decode_key(wire).map_err(|_| malformed("a bad field key"))?;
    let field = match wire_type {
        WireType::Varint => {
            decode_varint(wire).map_err(|_| malformed("a bad varint"))?;
            Field::Varint
        }
        WireType::LengthDelimited => {
            let len = decode_varint(wire).map_err(|_| malformed("a bad length"))?;
            let len =
                usize::try_from(len).ok().filter(|len| *len <= wire.len()).ok_or_else(|| malformed("truncated"))?;
            let (value, rest) = wire.split_at(len);
            *wire = rest;
            Field::Len(value)
        }
        WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
            let len = if wire_type == WireType::SixtyFourBit { 8 } else { 4 };
            if wire.len() < len {
                return Err(malformed("truncated"));
            }
            wire.advance(len);
            Field::Fixed
        }
        // No Fleet message has a group.
        WireType::StartGroup | WireType::EndGroup => return Err(malformed("a group")),
    };
    Ok((number, field))
}

/// prost's codec with [`WireLimits`] checked before each decode (`tonic-prost-build`'s
/// `codec_path` for the Fleet service: its client and server both use it).
#[derive(Debug, Clone)]
pub struct BoundedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for BoundedCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for BoundedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + WireLimits + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BoundedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BoundedDecoder(PhantomData)
    }
}

#[derive(Debug, Clone)]
pub struct BoundedDecoder<U>(PhantomData<U>);

impl<U: Message + Default + WireLimits> Decoder for BoundedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The message's bytes, split off tonic's buffer without a copy.
        let wire = buf.copy_to_bytes(buf.remaining());
        U::check(&wire)?;
        // As prost's codec maps a decode error.
        U::decode(wire).map(Some).map_err(|error| Status::internal(error.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(report: pb::DispatchReport) -> Vec<u8> {
        pb::WatchRequest { kind: Some(pb::watch_request::Kind::Dispatches(report)) }.encode_to_vec()
    }

    fn started(hashes: usize) -> pb::DispatchStarted {
        pb::DispatchStarted { id: 1, block_hashes: (0..hashes as u64).map(|h| h << 40).collect(), ..Default::default() }
    }

    /// A report at every limit passes; one past any is refused before it is decoded. Empty
    /// starts are the cheapest on the wire: two bytes each, over a hundred decoded.
    #[test]
    fn a_report_past_a_count_is_refused_from_its_wire_bytes() {
        let full = pb::DispatchReport {
            started: (0..MAX_REPORT_STARTED).map(|_| started(MAX_REPORT_BLOCK_HASHES / MAX_REPORT_STARTED)).collect(),
            ranks: vec![pb::LoadKey::default(); MAX_REPORT_STARTED],
            ended: (0..MAX_REPORT_ENDS as u64).collect(),
            prefilled: vec![u64::MAX; MAX_REPORT_ENDS],
            ..Default::default()
        };
        assert!(pb::WatchRequest::check(&report(full.clone())).is_ok());
        let over = [
            pb::DispatchReport {
                started: vec![pb::DispatchStarted::default(); MAX_REPORT_STARTED + 1],
                ..Default::default()
            },
            pb::DispatchReport { ranks: vec![pb::LoadKey::default(); MAX_REPORT_STARTED + 1], ..Default::default() },
            pb::DispatchReport { ended: vec![0; MAX_REPORT_ENDS + 1], ..Default::default() },
            pb::DispatchReport { prefilled: vec![1 << 63; MAX_REPORT_ENDS + 1], ..Default::default() },
            pb::DispatchReport { started: vec![started(MAX_REPORT_BLOCK_HASHES + 1)], ..Default::default() },
            pb::DispatchReport { started: vec![started(MAX_REPORT_BLOCK_HASHES / 2 + 1); 2], ..full },
        ];
        for (i, report) in over.into_iter().enumerate() {
            let refused = pb::WatchRequest::check(&self::report(report)).expect_err("over a limit");
            assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{i}: {refused}");
        }
    }

    /// A report given in several parts (the decoder joins them) is counted whole.
    #[test]
    fn a_report_in_parts_is_counted_whole() {
        let half = report(pb::DispatchReport {
            started: vec![pb::DispatchStarted::default(); MAX_REPORT_STARTED / 2 + 1],
            ..Default::default()
        });
        assert!(pb::WatchRequest::check(&half).is_ok());
        let twice = [half.clone(), half].concat();
        let joined = pb::WatchRequest::decode(twice.as_slice()).expect("decodes");
        let Some(pb::watch_request::Kind::Dispatches(joined)) = joined.kind else { panic!("a report") };
        assert_eq!(joined.started.len(), MAX_REPORT_STARTED + 2, "prost joins the parts");
        assert!(pb::WatchRequest::check(&twice).is_err(), "and so does the count");
    }

    /// Unpacked integers (each its own field, as prost also accepts) count one each.
    #[test]
    fn unpacked_ends_count_one_each() {
        let watch = |ends: u64| {
            let mut report = Vec::new();
            for id in 0..ends {
                prost::encoding::uint64::encode(2, &id, &mut report);
            }
            let mut wire = Vec::new();
            prost::encoding::bytes::encode(4, &report, &mut wire);
            pb::WatchRequest::check(&wire)
        };
        assert!(watch(MAX_REPORT_ENDS as u64).is_ok());
        let refused = watch(MAX_REPORT_ENDS as u64 + 1).expect_err("one end too many");
        assert!(refused.message().contains("ends number 16385"), "{refused}");
    }

    #[test]
    fn control_messages_are_small_and_lookups_bounded() {
        let hello = |id: String| pb::WatchRequest {
            kind: Some(pb::watch_request::Kind::Hello(pb::Hello { replica_id: id, version: None })),
        };
        assert!(pb::WatchRequest::check(&hello("replica-1".into()).encode_to_vec()).is_ok());
        assert!(pb::WatchRequest::check(&hello("x".repeat(MAX_WATCH_CONTROL_BYTES)).encode_to_vec()).is_err());
        let lookup = |hashes: usize, contenders: usize| pb::FindMatchesRequest {
            block_hashes: vec![u64::MAX; hashes],
            contenders: vec![pb::RankId::default(); contenders],
            ..Default::default()
        };
        let check = |l: pb::FindMatchesRequest| pb::FindMatchesRequest::check(&l.encode_to_vec());
        assert!(check(lookup(MAX_LOOKUP_BLOCK_HASHES, MAX_LOOKUP_CONTENDERS)).is_ok());
        assert!(check(lookup(MAX_LOOKUP_BLOCK_HASHES + 1, 0)).is_err());
        assert!(check(lookup(0, MAX_LOOKUP_CONTENDERS + 1)).is_err());
    }

    /// What cannot be walked is refused, not passed on to a decoder that might read it
    /// otherwise; trailing garbage and truncations alike.
    /// A fleet update is judged by what it would decode to: a snapshot of real workers passes,
    /// one as large of empty entries (two bytes each on the wire) is refused before it is
    /// decoded, in a snapshot or a delta, sent alone or in an update.
    #[test]
    fn a_fleet_update_past_what_it_may_decode_to_is_refused_from_its_wire_bytes() {
        let worker = |id: u64| pb::Worker {
            key: Some(pb::WorkerKey { namespace: "dynamo".into(), instance_id: id }),
            model: "Qwen/Qwen3-0.6B".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            ..Default::default()
        };
        let fleet = pb::Snapshot { workers: (0..16_384).map(worker).collect(), ..Default::default() };
        let update = |body| pb::FleetUpdate { body: Some(body), ..Default::default() }.encode_to_vec();
        assert!(pb::FleetUpdate::check(&update(pb::fleet_update::Body::Snapshot(fleet.clone()))).is_ok());
        assert!(pb::Snapshot::check(&fleet.encode_to_vec()).is_ok());
        // Empty entries of one field, by hand: a length-delimited field of length zero each.
        let empties = |field: u8, count: usize| [field << 3 | 2, 0].repeat(count);
        let enough = MAX_DECODED_FLEET_UPDATE_BYTES / size_of::<pb::Worker>() + 1;
        let wrapped = |field: u8, body: Vec<u8>| {
            let mut wire = vec![field << 3 | 2];
            prost::encoding::encode_varint(body.len() as u64, &mut wire);
            wire.extend(body);
            wire
        };
        for (what, wire) in [
            ("a snapshot's workers", wrapped(3, empties(2, enough))),
            ("a delta's upserted workers", wrapped(4, empties(2, enough))),
        ] {
            let refused = pb::FleetUpdate::check(&wire).expect_err(what);
            assert!(refused.message().contains("once decoded"), "{what}: {refused}");
        }
        assert!(pb::Snapshot::check(&empties(2, enough)).is_err(), "a snapshot alone");
        let removed = MAX_DECODED_FLEET_UPDATE_BYTES / size_of::<pb::WorkerKey>() + 1;
        assert!(pb::FleetUpdate::check(&wrapped(4, empties(3, removed))).is_err(), "a delta's removed keys");
    }

    #[test]
    fn malformed_wire_is_refused() {
        let mut wire = report(pb::DispatchReport { started: vec![started(3)], ..Default::default() });
        for cut in 1..wire.len() {
            // Every cut of a report's frame leaves its length past the bytes left.
            assert!(pb::WatchRequest::check(&wire[..cut]).is_err(), "cut at {cut}");
        }
        wire.push(0x0b); // field 1 as a group
        assert!(pb::WatchRequest::check(&wire).is_err());
    }
}
