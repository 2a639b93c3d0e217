//! Dynamo's `KvIndexer` (1.6.1): the actor a Dynamo KV router runs. Events go over its bounded
//! mutation channel to a thread that owns a `RadixTree`; matches go over another channel. This
//! measures the tree plus that plumbing, the way the router pays for it.

use std::sync::Arc;
use std::time::Duration;

use continuum_kv_index::RankKey;
use dynamo_kv_router::indexer::{KvIndexer, KvIndexerInterface, KvIndexerMetrics};
use dynamo_kv_router::protocols::{LocalBlockHash, OverlapScores, RouterEvent};
use tokio_util::sync::CancellationToken;

/// Only `find_matches_for_request` (token hashing) reads it; the events carry hashes already.
const KV_BLOCK_SIZE: u32 = 16;

pub fn new() -> KvIndexer {
    KvIndexer::new(CancellationToken::new(), KV_BLOCK_SIZE, Arc::new(KvIndexerMetrics::new_unregistered()))
}

/// Sends every event through the router's own sender, then waits on `flush_and_wait`, which
/// drains all mutations accepted before it: when it returns, the tree holds every event.
pub async fn apply(indexer: &KvIndexer, events: Vec<RouterEvent>) {
    let sender = indexer.event_sender();
    for event in events {
        if sender.send(event).await.is_err() {
            panic!("KvIndexer thread is gone");
        }
    }
    if let Err(e) = indexer.flush_and_wait().await {
        panic!("KvIndexer flush failed: {e}");
    }
}

/// Applies the events one acknowledged round trip at a time; returns how many the tree refused.
/// Untimed: the plain sender does not report refusals.
pub async fn apply_counting_refusals(indexer: &KvIndexer, events: Vec<RouterEvent>) -> usize {
    let mut refused = 0;
    for event in events {
        refused += usize::from(indexer.apply_event_and_wait(event).await.is_err());
    }
    refused
}

pub async fn find_matches(indexer: &KvIndexer, query: Vec<LocalBlockHash>) -> OverlapScores {
    match indexer.find_matches(query).await {
        Ok(scores) => scores,
        Err(e) => panic!("KvIndexer find_matches failed: {e}"),
    }
}

/// Scores with zero-score ranks left out, sorted, to compare with ours.
pub async fn scores(indexer: &KvIndexer, query: Vec<LocalBlockHash>) -> Vec<(RankKey, u32)> {
    let mut scores: Vec<_> = find_matches(indexer, query)
        .await
        .scores
        .into_iter()
        .filter(|(_, s)| *s > 0)
        .map(|(w, s)| (RankKey { worker_id: w.worker_id, dp_rank: w.dp_rank }, s))
        .collect();
    scores.sort();
    scores
}

/// Threads of this process. Dropping a `KvIndexer` only cancels its thread, which then frees the
/// tree on its own; waiting for the thread count to fall back keeps that free out of the next
/// measurement.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Drops the indexer and waits (up to 10 s) for its thread to finish freeing the tree.
pub fn shut_down(indexer: KvIndexer, threads_before: usize) {
    drop(indexer);
    for _ in 0..10_000 {
        if threads() <= threads_before {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!("KvIndexer thread still running after 10 s");
}
