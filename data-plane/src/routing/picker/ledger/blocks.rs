//! What a dispatch holds on its decode rank, in blocks: its prompt's prefix chain as the KV
//! term hashed it, and the block size it is counted at.

use continuum_proto::MAX_REPORTED_DECODE_BLOCKS;
use continuum_proto::view::FleetView;

use super::FALLBACK_BLOCK_SIZE;
use crate::routing::picker::{Pin, Selection};

/// A prompt's prefix chain: the hashes of its full blocks at `block_size`, as the KV term
/// computed them (empty without one), and this replica's number for the `FindMatches` lookup
/// made for them (0: none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptChain {
    pub block_size: u32,
    pub hashes: Vec<u64>,
    pub lookup: u64,
}

impl PromptChain {
    /// The chain as a rank of `block_size` holds it: none when its blocks are another size.
    pub fn at_block_size(&self, block_size: u32) -> &[u64] {
        if block_size == self.block_size { &self.hashes } else { &[] }
    }
}

/// A dispatch's blocks on its decode rank as it is reported and recorded: its prompt's, at most
/// what the control plane takes from one start ([`MAX_REPORTED_DECODE_BLOCKS`]), so that the
/// ledger holds what the report said and a replay of it is never refused as implausible.
pub fn reported_blocks(prompt_tokens: u64, block_size: u32) -> u64 {
    prompt_blocks(prompt_tokens, block_size).min(MAX_REPORTED_DECODE_BLOCKS)
}

/// The blocks a prompt of `prompt_tokens` fills at `block_size` (0 counts as 1): what its
/// dispatch holds on its decode rank.
fn prompt_blocks(prompt_tokens: u64, block_size: u32) -> u64 {
    prompt_tokens.div_ceil(u64::from(block_size.max(1)))
}

/// The block size to record a dispatch with: the decode worker's (see [`pin_block_size`]).
pub fn dispatch_block_size(view: &FleetView, selection: &Selection) -> u32 {
    pin_block_size(view, &selection.decode)
}

/// A pinned worker's block size, else `FALLBACK_BLOCK_SIZE`.
pub fn pin_block_size(view: &FleetView, pin: &Pin) -> u32 {
    view.worker(&pin.worker)
        .and_then(|worker| worker.block_size)
        .filter(|size| *size > 0)
        .unwrap_or(FALLBACK_BLOCK_SIZE)
}
