//! Dynamo's own single-threaded indexer (`dynamo_kv_router::RadixTree`, 1.6.1), fed the same
//! events in its own types. Its actor (`KvIndexer`) wraps this tree behind a channel; comparing
//! the trees compares the data structures alone.

use continuum_kv_index::RankKey;
use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};

use crate::workload::Event;

pub fn events(events: &[Event]) -> Vec<RouterEvent> {
    events.iter().enumerate().map(|(i, e)| event(i as u64, e)).collect()
}

fn event(event_id: u64, event: &Event) -> RouterEvent {
    let (rank, data) = match event {
        Event::Stored { rank, parent, blocks } => (
            *rank,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: blocks
                    .iter()
                    .map(|&(block_hash, tokens_hash)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(block_hash),
                        tokens_hash: LocalBlockHash(tokens_hash),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        ),
        Event::Removed { rank, hashes } => (
            *rank,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: hashes.iter().copied().map(ExternalSequenceBlockHash).collect(),
            }),
        ),
    };
    RouterEvent::new(rank.worker_id, KvCacheEvent { event_id, data, dp_rank: rank.dp_rank })
}

pub fn query(tokens: &[u64]) -> Vec<LocalBlockHash> {
    tokens.iter().copied().map(LocalBlockHash).collect()
}

/// Applies the events; returns how many it refused.
pub fn apply(tree: &mut RadixTree, events: impl IntoIterator<Item = RouterEvent>) -> usize {
    let mut refused = 0;
    for event in events {
        refused += usize::from(tree.apply_event(event).is_err());
    }
    refused
}

/// Scores with zero-score ranks left out, sorted, to compare with ours.
pub fn scores(tree: &RadixTree, query: Vec<LocalBlockHash>) -> Vec<(RankKey, u32)> {
    let mut scores: Vec<_> = tree
        .find_matches(query, false)
        .scores
        .into_iter()
        .filter(|(_, s)| *s > 0)
        .map(|(w, s)| (RankKey { worker_id: w.worker_id, dp_rank: w.dp_rank }, s))
        .collect();
    scores.sort();
    scores
}
