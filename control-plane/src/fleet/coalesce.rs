//! Coalesces load samples over a short window before they become a fleet delta.
//!
//! Publishers send a sample on every change (debounced at 1 ms upstream), so a busy fleet of
//! thousands of ranks would otherwise bump the version thousands of times a second. Within a
//! window only the latest sample per (worker, rank) survives. A removal (the load store dropped
//! the rank's sample) travels the same queue, so it cannot overtake or be overtaken by a sample.

use std::collections::HashMap;
use std::time::Duration;

use continuum_proto::model::{LoadKey, LoadSample};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{FleetChange, FleetPublisher};

/// How long samples are gathered before they are published together.
pub const LOAD_COALESCE_WINDOW: Duration = Duration::from_millis(20);

/// Samples waiting for the next window. At most one entry per (worker, rank), so its size is
/// bounded by the fleet's ranks; the channel into it is bounded too.
const LOAD_CHANNEL_CAPACITY: usize = 4096;

/// The sending side: load subscriptions hand samples here.
#[derive(Debug, Clone)]
pub struct LoadCoalescer {
    tx: mpsc::Sender<(LoadKey, Option<LoadSample>)>,
}

impl LoadCoalescer {
    /// Starts the coalescing task; it runs until `cancel` fires or every sender is dropped.
    pub fn spawn(publisher: FleetPublisher, window: Duration, cancel: CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(LOAD_CHANNEL_CAPACITY);
        tokio::spawn(run(publisher, rx, window, cancel));
        Self { tx }
    }

    /// Queues a sample; waits when the coalescer is a full channel behind (backpressure on the
    /// subscriptions rather than unbounded memory).
    pub async fn submit(&self, key: LoadKey, sample: LoadSample) {
        // A closed channel means the control plane is shutting down; the sample has nowhere to go.
        let _ = self.tx.send((key, Some(sample))).await;
    }

    /// Queues the removal of ranks' samples (replicas then read them as never sampled).
    pub async fn remove(&self, keys: impl IntoIterator<Item = LoadKey>) {
        for key in keys {
            // As in `submit`: a closed channel means shutdown.
            let _ = self.tx.send((key, None)).await;
        }
    }
}

async fn run(
    publisher: FleetPublisher,
    mut rx: mpsc::Receiver<(LoadKey, Option<LoadSample>)>,
    window: Duration,
    cancel: CancellationToken,
) {
    let mut pending: HashMap<LoadKey, Option<LoadSample>> = HashMap::new();
    // Each window opens with the first sample after a flush.
    let window_end = tokio::time::sleep(window);
    tokio::pin!(window_end);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            // Before the queue: a queue that never empties would otherwise never let a window
            // end. Nothing pending, nothing to wake for.
            () = &mut window_end, if !pending.is_empty() => flush(&publisher, &mut pending),
            received = rx.recv() => match received {
                Some((key, sample)) => {
                    if pending.is_empty() {
                        window_end.as_mut().reset(tokio::time::Instant::now() + window);
                    }
                    pending.insert(key, sample);
                }
                None => { flush(&publisher, &mut pending); return; }
            },
        }
    }
}

fn flush(publisher: &FleetPublisher, pending: &mut HashMap<LoadKey, Option<LoadSample>>) {
    if pending.is_empty() {
        return;
    }
    let (mut loads, mut loads_removed) = (Vec::new(), Vec::new());
    for (key, sample) in pending.drain() {
        match sample {
            Some(sample) => loads.push((key, sample)),
            None => loads_removed.push(key),
        }
    }
    publisher.apply(FleetChange { loads, loads_removed, ..FleetChange::default() });
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use continuum_proto::model::{DataPlaneConfig, Load, Worker, WorkerKey};

    use super::*;

    fn worker(id: u64) -> Arc<Worker> {
        crate::fleet::test_worker(id, 0)
    }

    #[tokio::test(start_paused = true)]
    async fn samples_within_a_window_become_one_version() {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        publisher.apply(FleetChange { upsert: vec![worker(1), worker(2)], ..FleetChange::default() });
        let before = publisher.current().version();
        let coalescer = LoadCoalescer::spawn(publisher.clone(), LOAD_COALESCE_WINDOW, CancellationToken::new());
        // Let the interval's immediate first tick pass with nothing pending.
        tokio::time::sleep(Duration::from_millis(1)).await;
        for used in 0..100u64 {
            let sample = LoadSample {
                load: Load { kv_used_blocks: Some(used), ..Load::default() },
                received_at: Instant::now(),
            };
            coalescer.submit(LoadKey { worker: WorkerKey::new("dynamo", 1 + used % 2), dp_rank: 0 }, sample).await;
        }
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        let state = publisher.current();
        assert_eq!(state.version(), before + 1, "100 samples in one window publish one version");
        let used: Vec<_> = state.view().loads().values().map(|s| s.load.kv_used_blocks).collect();
        assert_eq!(used, vec![Some(98), Some(99)], "the latest sample per rank wins");
    }

    /// A queue that never empties (thousands of subscriptions sending at once) still has its
    /// windows end on time: the window's end is looked at before the queue.
    #[tokio::test(start_paused = true)]
    async fn a_window_ends_on_time_however_full_the_queue() {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        publisher.apply(FleetChange { upsert: vec![worker(1)], ..FleetChange::default() });
        let before = publisher.current().version();
        let (tx, rx) = mpsc::channel(LOAD_CHANNEL_CAPACITY);
        tokio::spawn(run(publisher.clone(), rx, LOAD_COALESCE_WINDOW, CancellationToken::new()));
        let key = LoadKey { worker: WorkerKey::new("dynamo", 1), dp_rank: 0 };
        let sample = |used| {
            let load = Load { kv_used_blocks: Some(used), ..Load::default() };
            Some(LoadSample { load, received_at: Instant::now() })
        };
        tx.send((key.clone(), sample(0))).await.expect("open");
        tokio::task::yield_now().await;
        // The window is over, and the queue is full of later samples.
        tokio::time::advance(LOAD_COALESCE_WINDOW * 2).await;
        for used in 1..LOAD_CHANNEL_CAPACITY as u64 {
            tx.try_send((key.clone(), sample(used))).expect("room");
        }
        tokio::task::yield_now().await;
        assert_eq!(publisher.current().version(), before + 1, "published before the queue was read to its end");
    }

    #[tokio::test(start_paused = true)]
    async fn a_removal_reaches_the_view_and_a_later_sample_in_the_window_wins() {
        let publisher = FleetPublisher::starting_at(1, Arc::new(DataPlaneConfig::default()));
        publisher.apply(FleetChange { upsert: vec![worker(1), worker(2)], ..FleetChange::default() });
        let coalescer = LoadCoalescer::spawn(publisher.clone(), LOAD_COALESCE_WINDOW, CancellationToken::new());
        tokio::time::sleep(Duration::from_millis(1)).await;
        let key = |id| LoadKey { worker: WorkerKey::new("dynamo", id), dp_rank: 0 };
        let sample = |used| LoadSample {
            load: Load { kv_used_blocks: Some(used), ..Load::default() },
            received_at: Instant::now(),
        };
        coalescer.submit(key(1), sample(5)).await;
        coalescer.submit(key(2), sample(6)).await;
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        assert_eq!(publisher.current().view().loads().len(), 2);

        coalescer.remove([key(1), key(2)]).await;
        coalescer.submit(key(2), sample(7)).await;
        tokio::time::sleep(LOAD_COALESCE_WINDOW * 2).await;
        let state = publisher.current();
        let loads: Vec<_> =
            state.view().loads().iter().map(|(k, s)| (k.worker.instance_id, s.load.kv_used_blocks)).collect();
        assert_eq!(loads, vec![(2, Some(7))], "rank 1 removed; rank 2's later sample wins over its removal");
    }
}
