//! The compiled-in ceilings of the index (seed: "Index structure and compiled-in bounds").
//!
//! Every ceiling counts something that costs memory, so together they bound the index's heap
//! whatever the fleet sends: tree blocks (and so runs and segments), per-rank block lookups, and
//! owner lists.

/// Distinct prefix blocks (tree positions, however they are grouped in runs) the index holds at
/// most.
pub const MAX_INDEX_BLOCKS: usize = 1_048_576;
/// Engine block hashes one `(worker_id, dp_rank)` may hold at most.
pub const MAX_BLOCKS_PER_RANK: usize = 262_144;
/// `(rank, engine block)` ownerships across all ranks at most.
pub const MAX_INDEX_OWNERSHIPS: usize = 8_388_608;
/// Distinct ranks that may own one node at most.
pub const MAX_OWNERS_PER_NODE: usize = 4_096;

/// The ceilings one index enforces. [`Limits::default`] is the seed's; tests shrink them to hit
/// each one with a handful of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// See [`MAX_INDEX_BLOCKS`].
    pub max_blocks: usize,
    /// See [`MAX_BLOCKS_PER_RANK`].
    pub max_blocks_per_rank: usize,
    /// See [`MAX_INDEX_OWNERSHIPS`].
    pub max_ownerships: usize,
    /// See [`MAX_OWNERS_PER_NODE`].
    pub max_owners_per_node: usize,
}

impl Limits {
    /// The seed's ceilings.
    pub const SEED: Limits = Limits {
        max_blocks: MAX_INDEX_BLOCKS,
        max_blocks_per_rank: MAX_BLOCKS_PER_RANK,
        max_ownerships: MAX_INDEX_OWNERSHIPS,
        max_owners_per_node: MAX_OWNERS_PER_NODE,
    };

    /// Run and segment indices are `u32` (run 0 is the root, and `u32::MAX` marks free and empty
    /// slots), and there are never more runs or segments than blocks, so no configuration may
    /// ask for more blocks than that leaves; larger values are clamped rather than trusted.
    pub(crate) fn clamped(self) -> Limits {
        let node_cap = (u32::MAX - 1) as usize;
        Limits { max_blocks: self.max_blocks.min(node_cap), ..self }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::SEED
    }
}
