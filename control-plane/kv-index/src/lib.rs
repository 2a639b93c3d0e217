//! The bounded radix index of the KV cache blocks each Dynamo worker rank holds on device.
//!
//! A pure data structure with no I/O and no async: the control plane's KV supervisor feeds it
//! decoded kv-events, the picker asks it for overlap scores, and the standalone benchmark in
//! `tests/kv-index-bench` measures it against `dynamo-kv-router`'s own indexer.
//!
//! # Model
//!
//! - A [`RankKey`] (`worker_id`, `dp_rank`) owns blocks.
//! - Tree blocks are keyed by `tokens_hash` (Dynamo's `LocalBlockHash`, the hash of one block's
//!   tokens) as a path from the root, so two ranks holding the same prompt prefix share blocks.
//!   The tree is path-compressed: a node is a run of consecutive blocks with one owner set, split
//!   only where owners diverge or a branch starts, so a shared prefix costs one node and one
//!   owner entry per rank, not one per block (see `tree.rs`). Runs are not joined again when
//!   their owners converge: a prefix whose blocks its ranks drop and store again one at a time
//!   ends as that many runs, each matched with an owner-set intersection of its own, until
//!   its ranks let it go (memory stays under the ceilings).
//! - Each rank has a lookup from its engine `block_hash` (Dynamo's `ExternalSequenceBlockHash`)
//!   to a block; events name blocks by engine hash.
//!
//! # Events
//!
//! - [`KvIndex::apply_stored`]`(rank, parent_hash, blocks)`: `blocks` (each a [`StoredBlock`]:
//!   engine hash + tokens hash) form a chain under `parent_hash`, an engine hash the rank already
//!   holds, or the root for `None`. A parent the rank does not hold refuses the whole event (every
//!   block counts as `unknown_parent`; nothing is inserted). Storing a block the rank already
//!   holds at the same block is `duplicate` and changes nothing, so replaying an event is
//!   idempotent. Storing a held engine hash under a different prefix moves it (`applied`). A
//!   second engine hash naming a block the rank already owns adds a reference: the rank keeps
//!   owning the block until its last such hash is removed.
//! - [`KvIndex::apply_removed`]`(rank, block_hashes)`: drops those engine hashes (`applied`), or
//!   counts `unknown_block` for hashes the rank does not hold. The rank keeps the block's
//!   descendants it holds while another rank still holds the block (they no longer score for
//!   it, matches being contiguous, but still anchor later `stored` events that name them as
//!   parent). A block whose last owner removes it (or moves its hash away, or is cleared)
//!   takes everything under it, for every rank, as Dynamo's router clears its children: no
//!   match can pass a block no rank holds, and the hashes naming what went are unknown from
//!   then on.
//! - [`KvIndex::clear_rank`] drops everything a rank holds (`cleared` events, gaps);
//!   [`KvIndex::retain_ranks`] clears the ranks a predicate rejects (departed workers).
//!
//! A block lives while a rank owns it: every block in the tree is some rank's, so the tree holds
//! no more blocks than the ranks' shares add up to. The last owner leaving a block frees it, what
//! lies under it, and every ancestor left empty. A rank that holds nothing is forgotten.
//!
//! # Bounds
//!
//! [`Limits`] (default: the seed's [`MAX_INDEX_BLOCKS`], [`MAX_BLOCKS_PER_RANK`],
//! [`MAX_INDEX_OWNERSHIPS`], [`MAX_OWNERS_PER_NODE`]). A block that would exceed any ceiling is
//! refused as `over_capacity`, and so is the rest of its chain (it could not anchor). The index
//! never panics on event content and never exceeds a ceiling; a refusal changes nothing.
//! [`IndexStats::heap_bytes`] reports the heap held; [`IndexStats::nodes`] counts blocks (what
//! [`MAX_INDEX_BLOCKS`] bounds), [`IndexStats::runs`] the compressed nodes holding them.
//!
//! # Results
//!
//! Event functions return an [`Outcome`]: how many blocks ended with each [`KvResult`]
//! (`applied`, `duplicate`, `over_capacity`, `unknown_parent`, `unknown_block`; labels from
//! [`KvResult::as_str`]). [`Outcome::summary`] gives one label per event (the most severe).
//!
//! # Matching
//!
//! [`KvIndex::find_matches`]`(tokens_hashes)` walks from the root along a request's block tokens
//! hashes and returns, for every rank holding at least its first block, the length of its longest
//! contiguous prefix from the root (a rank holding blocks 0, 1 and 3 scores 2), in [`Matches`]
//! ordered by ascending score. [`KvIndex::find_matches_into`] reuses a caller's buffers.
//!
//! The index is single-threaded (`&mut self` to apply, `&self` to match): its owner decides how
//! readers see it (one actor task, or a lock).

mod hash;
mod index;
mod limits;
mod lookup;
mod matches;
mod outcome;
mod owners;
mod ranks;
mod tree;

pub use index::{IndexStats, KvIndex, StoredBlock};
pub use limits::{Limits, MAX_BLOCKS_PER_RANK, MAX_INDEX_BLOCKS, MAX_INDEX_OWNERSHIPS, MAX_OWNERS_PER_NODE};
pub use matches::Matches;
pub use outcome::{KvResult, Outcome};
pub use ranks::RankKey;

#[cfg(test)]
mod tests;
