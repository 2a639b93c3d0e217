//! `continuum_kv_index::KvIndex` with the seed's default limits, fed the same events.

use continuum_kv_index::{KvIndex, KvResult, Outcome, RankKey, StoredBlock};

use crate::workload::Event;

pub enum OurEvent {
    Stored { rank: RankKey, parent: Option<u64>, blocks: Vec<StoredBlock> },
    Removed { rank: RankKey, hashes: Vec<u64> },
}

pub fn events(events: &[Event]) -> Vec<OurEvent> {
    events
        .iter()
        .map(|e| match e {
            Event::Stored { rank, parent, blocks } => OurEvent::Stored {
                rank: *rank,
                parent: *parent,
                blocks: blocks
                    .iter()
                    .map(|&(block_hash, tokens_hash)| StoredBlock { block_hash, tokens_hash })
                    .collect(),
            },
            Event::Removed { rank, hashes } => OurEvent::Removed { rank: *rank, hashes: hashes.clone() },
        })
        .collect()
}

/// Applies the events (dropping each after use, as a caller owning decoded events would); returns
/// the blocks per result.
pub fn apply(index: &mut KvIndex, events: impl IntoIterator<Item = OurEvent>) -> Outcome {
    let mut total = Outcome::default();
    for event in events {
        let outcome = match &event {
            OurEvent::Stored { rank, parent, blocks } => index.apply_stored(*rank, *parent, blocks),
            OurEvent::Removed { rank, hashes } => index.apply_removed(*rank, hashes),
        };
        total.merge(&outcome);
    }
    total
}

pub fn refused(outcome: &Outcome) -> u32 {
    outcome.blocks() - outcome.get(KvResult::Applied) - outcome.get(KvResult::Duplicate)
}

pub fn scores(index: &KvIndex, query: &[u64]) -> Vec<(RankKey, u32)> {
    let mut scores = index.find_matches(query).into_vec();
    scores.sort();
    scores
}
