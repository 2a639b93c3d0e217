//! The `continuum.fleet.v1` contract between the control plane and its data-plane replicas:
//! the generated gRPC code ([`pb`]), the domain types both planes hold ([`model`]), the fleet
//! view with its deltas ([`view`]), the conversions between wire and domain ([`convert`]) and
//! the count of a rank's blocks in flight both planes keep ([`active`]).

pub mod active;
pub mod convert;
pub mod fast_hash;
pub mod model;
pub mod view;

/// Generated `continuum.fleet.v1` messages, client and server.
#[allow(missing_debug_implementations, clippy::all)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/continuum.fleet.v1.rs"));
}

/// The encoded descriptor set of every Continuum `.proto`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fleet_descriptor.bin"));

/// The largest Fleet message either side accepts. A full snapshot of 16,384 workers encodes
/// to well under 4 MiB (see docs/benchmarks.md); the headroom covers long model names and
/// large load tables without letting a broken peer make the other side buffer without bound.
pub const MAX_FLEET_MESSAGE_BYTES: usize = 64 << 20;

/// Longest replica id a control plane accepts in a Hello; it appears in logs and the admin API.
pub const MAX_REPLICA_ID_BYTES: usize = 128;

/// Block hashes one `DispatchStarted` carries at most: a 65,536-token prefix in 16-token
/// blocks. A replica cuts longer chains; the control plane cuts what a peer sends past it.
pub const MAX_DISPATCH_BLOCK_HASHES: usize = 4_096;
/// Block hashes one `DispatchReport` carries at most (512 KiB), so a burst of long prompts
/// cannot make a report large; dispatches past it are reported without their hashes.
pub const MAX_REPORT_BLOCK_HASHES: usize = 65_536;
