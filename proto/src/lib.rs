//! The `continuum.fleet.v1` contract between the control plane and its data-plane replicas:
//! the generated gRPC code ([`pb`]), the domain types both planes hold ([`model`]), the fleet
//! view with its deltas ([`view`]), the conversions between wire and domain ([`convert`]) and
//! the count of a rank's blocks in flight both planes keep ([`active`]).

pub mod active;
pub mod codec;
pub mod convert;
mod error_chain;
pub mod fast_hash;
pub mod log_budget;
pub mod model;
pub mod net;
pub mod os;
pub mod view;

pub use error_chain::error_chain;

/// Generated `continuum.fleet.v1` messages, client and server.
#[allow(missing_debug_implementations, clippy::all)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/continuum.fleet.v1.rs"));
}

/// The encoded descriptor set of every Continuum `.proto`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fleet_descriptor.bin"));

/// The longest `max_staleness` a fleet view may carry: the control plane's configuration
/// refuses a longer one, and a replica refuses it on the wire (sample ages are clamped at an
/// hour, which must stay stale under any staleness allowed).
pub const MAX_STALENESS: std::time::Duration = std::time::Duration::from_secs(300);

/// The largest Fleet message either side accepts. A full snapshot of 16,384 workers encodes
/// to well under 4 MiB (see docs/benchmarks.md); the headroom covers long model names and
/// large load tables without letting a broken peer make the other side buffer without bound.
pub const MAX_FLEET_MESSAGE_BYTES: usize = 64 << 20;

/// Largest message a control plane reads from a replica. What replicas send is small: a
/// dispatch report of at most [`MAX_REPORT_STARTED`] dispatches and 65,536 block hashes, or a
/// lookup of 65,536 hashes, each under 1 MiB. What a message within it decodes to is bounded
/// by its counts, which the [`codec`] checks on its wire bytes before decoding it.
pub const MAX_INBOUND_FLEET_MESSAGE_BYTES: usize = 4 << 20;

/// Requests one replica holds in flight at most (its ledger's capacity); each is reported as a
/// start on every rank it pins, two at most (a prefill and a decode worker), so the control
/// plane's book holds twice this many starts for one replica before it refuses one.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 65_536;
/// A dispatch its rank leaves unanswered this long (no first token, no sample since) may mean
/// a stalled engine: the seed's rule, applied by each replica to its own dispatches and by the
/// control plane to the fleet's.
pub const STALL_AFTER: std::time::Duration = std::time::Duration::from_secs(5);
/// Requests of fewer blocks never mark a rank stalled: one may change nothing a sample shows.
pub const STALL_MIN_BLOCKS: u64 = 2;

/// Dispatches one report may start: a replica batches at most 512 events and never splits an
/// operation, so twice that leaves room; a report past it is refused whole, before it is
/// decoded ([`codec`]).
pub const MAX_REPORT_STARTED: usize = 1024;

/// Ends (and, separately, first tokens) one report may carry: a replica batches at most 512
/// events, so this leaves wide room (a replica that finds its queue full ends the stream rather
/// than keep ends aside); a report past it is refused whole, before it is decoded.
pub const MAX_REPORT_ENDS: usize = 16_384;

/// Block hashes one lookup asks about at most: a replica renders at most 1,048,576 tokens, in
/// blocks of 16 at least. A lookup past it is refused before it is decoded ([`codec`]).
pub const MAX_LOOKUP_BLOCK_HASHES: usize = 65_536;

/// Contenders one lookup names at most: the control plane weighs no more for a suggestion, so
/// a replica with more names none; a lookup naming more is refused before it is decoded.
pub const MAX_LOOKUP_CONTENDERS: usize = 64;

/// Tokens a lookup may say its prompt has, as many as a replica renders (1,048,576); a larger
/// claim is taken as this many, so one lookup cannot outweigh every other on its rank.
pub const MAX_LOOKUP_PROMPT_TOKENS: u64 = 1 << 20;

/// Data-parallel ranks a worker may declare: each is a candidate every replica weighs, a load
/// store entry and a KV cursor. The control plane excludes a card past it; a replica refuses an
/// update carrying one (it would walk billions of ranks), keeping the view it holds.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;

/// Longest replica id a control plane accepts in a Hello; it appears in logs and the admin API.
pub const MAX_REPLICA_ID_BYTES: usize = 128;

/// Whether `id` may name a replica: 1 to [`MAX_REPLICA_ID_BYTES`] printable ASCII characters,
/// no spaces (pod and host names, with a process id). It is written into log lines as it is,
/// so a line break in it would forge lines of its own.
pub fn valid_replica_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_REPLICA_ID_BYTES && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A dispatch reported with more decode blocks than this (16 Mi tokens at 16 a block) is
/// refused by the control plane: no request is that long, and sums of it would drown every
/// real one on its rank. A replica reports at most this.
pub const MAX_REPORTED_DECODE_BLOCKS: u64 = 1 << 20;
/// A dispatch reported with more prompt tokens to prefill than this is refused, likewise.
pub const MAX_REPORTED_PREFILL_TOKENS: u64 = 1 << 24;

/// Block hashes one `DispatchStarted` carries at most: a 65,536-token prefix in 16-token
/// blocks. A replica cuts longer chains; the control plane cuts what a peer sends past it.
pub const MAX_DISPATCH_BLOCK_HASHES: usize = 4_096;
/// Block hashes one `DispatchReport` carries at most (512 KiB), so a burst of long prompts
/// cannot make a report large; dispatches past it are reported without their hashes.
pub const MAX_REPORT_BLOCK_HASHES: usize = 65_536;
