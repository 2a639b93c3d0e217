//! Fleet-wide unanswered-dispatch accounting.
//!
//! Every replica reports the requests it pins (and their end) on its Watch stream. The book sums
//! them per rank and publishes the sums as backlogs in the fleet view, so every replica sees the
//! requests all replicas sent since a rank's last load sample. Without it N replicas choose the
//! same "least loaded" worker between two samples (Dynamo #589; SGLang's gateway shares the
//! problem). A dispatch leaves the backlog when it ends, when a load sample received after it
//! answers its rank, when its replica disconnects, or after [`DISPATCH_MAX_AGE`].
//!
//! One task owns the book (commands over a bounded channel); changes are published at most once
//! per [`BACKLOG_WINDOW`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_proto::model::{Backlog, LoadKey};
use continuum_proto::pb;
use prometheus::IntCounter;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{FleetChange, FleetPublisher, FleetState};

/// A dispatch no sample has answered counts this long at most (the seed's 30 seconds).
pub const DISPATCH_MAX_AGE: Duration = Duration::from_secs(30);
/// Outstanding dispatches one replica may hold in the book; more are refused and counted.
pub const MAX_DISPATCHES_PER_REPLICA: usize = 65_536;
/// Backlog changes are published at most this often: short, so a burst spreads across replicas.
pub const BACKLOG_WINDOW: Duration = Duration::from_millis(2);
/// Reports waiting for the book; a full queue drops the report (and counts it) rather than
/// stalling a Watch session.
const COMMAND_QUEUE: usize = 4096;

enum Command {
    Report { replica: u64, report: pb::DispatchReport, at: Instant },
    ReplicaGone { replica: u64 },
}

/// The handle sessions use.
#[derive(Debug, Clone)]
pub struct BacklogBook {
    tx: mpsc::Sender<Command>,
}

impl BacklogBook {
    /// Starts the book's task; `refused` counts dispatches the book would not hold.
    pub fn spawn(publisher: FleetPublisher, refused: IntCounter, cancel: CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        tokio::spawn(run(publisher, rx, refused, cancel));
        Self { tx }
    }

    /// Records a replica's report; `false` when the book is a full queue behind.
    pub fn report(&self, replica: u64, report: pb::DispatchReport) -> bool {
        self.tx.try_send(Command::Report { replica, report, at: Instant::now() }).is_ok()
    }

    pub fn replica_gone(&self, replica: u64) {
        // Best effort: if the queue is full, the dispatches age out instead.
        let _ = self.tx.try_send(Command::ReplicaGone { replica });
    }
}

#[derive(Debug, Clone, Copy)]
struct Dispatch {
    prefill_tokens: u64,
    decode_blocks: u64,
    at: Instant,
}

/// The book itself: pure, driven by the task below.
#[derive(Debug, Default)]
struct Book {
    by_rank: HashMap<LoadKey, BTreeMap<(u64, u64), Dispatch>>,
    where_is: HashMap<(u64, u64), LoadKey>,
    per_replica: HashMap<u64, usize>,
    dirty: BTreeSet<LoadKey>,
    /// Dispatches refused: for a rank the fleet does not have, or past the replica's bound.
    refused: u64,
}

impl Book {
    fn report(&mut self, replica: u64, report: pb::DispatchReport, at: Instant, state: &FleetState) {
        for id in report.ended {
            self.end((replica, id));
        }
        for started in report.started {
            let Some(key) = started.rank.and_then(|k| LoadKey::try_from(k).ok()) else { continue };
            // Only ranks the fleet has: a report cannot make the book grow with invented keys.
            let known = state.view().worker(&key.worker).is_some_and(|w| w.dp_ranks().any(|r| r == key.dp_rank));
            let held = self.per_replica.entry(replica).or_default();
            if !known || *held >= MAX_DISPATCHES_PER_REPLICA {
                self.refused += 1;
                continue;
            }
            *held += 1;
            let dispatch =
                Dispatch { prefill_tokens: started.prefill_tokens, decode_blocks: started.decode_blocks, at };
            self.by_rank.entry(key.clone()).or_default().insert((replica, started.id), dispatch);
            self.where_is.insert((replica, started.id), key.clone());
            self.dirty.insert(key);
        }
    }

    fn end(&mut self, id: (u64, u64)) {
        let Some(key) = self.where_is.remove(&id) else { return };
        if let Some(dispatches) = self.by_rank.get_mut(&key) {
            dispatches.remove(&id);
            if dispatches.is_empty() {
                self.by_rank.remove(&key);
            }
        }
        if let Some(held) = self.per_replica.get_mut(&id.0) {
            *held = held.saturating_sub(1);
        }
        self.dirty.insert(key);
    }

    fn replica_gone(&mut self, replica: u64) {
        let ids: Vec<(u64, u64)> = self.where_is.keys().filter(|(r, _)| *r == replica).copied().collect();
        for id in ids {
            self.end(id);
        }
        self.per_replica.remove(&replica);
    }

    /// Drops dispatches answered by a sample received after them, or older than the limit.
    fn expire(&mut self, state: &FleetState, now: Instant) {
        let mut done = Vec::new();
        for (key, dispatches) in &self.by_rank {
            let answered_at = state.view().loads().get(key).map(|s| s.received_at);
            for (id, dispatch) in dispatches {
                let answered = answered_at.is_some_and(|at| at > dispatch.at);
                if answered || now.saturating_duration_since(dispatch.at) >= DISPATCH_MAX_AGE {
                    done.push(*id);
                }
            }
        }
        for id in done {
            self.end(id);
        }
    }

    /// The published change for every rank whose sum moved.
    fn take_change(&mut self) -> FleetChange {
        let mut change = FleetChange::default();
        for key in std::mem::take(&mut self.dirty) {
            match self.by_rank.get(&key) {
                Some(dispatches) => change.backlogs.push((key, sum(dispatches.values()))),
                None => change.backlogs_removed.push(key),
            }
        }
        change
    }
}

fn sum<'a>(dispatches: impl Iterator<Item = &'a Dispatch>) -> Backlog {
    dispatches.fold(Backlog::default(), |acc, d| Backlog {
        prefill_tokens: acc.prefill_tokens.saturating_add(d.prefill_tokens),
        decode_blocks: acc.decode_blocks.saturating_add(d.decode_blocks),
        dispatches: acc.dispatches.saturating_add(1),
    })
}

async fn run(
    publisher: FleetPublisher,
    mut rx: mpsc::Receiver<Command>,
    refused: IntCounter,
    cancel: CancellationToken,
) {
    let mut book = Book::default();
    let mut exported = 0;
    let mut states: watch::Receiver<Arc<FleetState>> = publisher.subscribe();
    let mut tick = tokio::time::interval(BACKLOG_WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            command = rx.recv() => match command {
                Some(Command::Report { replica, report, at }) => book.report(replica, report, at, &states.borrow()),
                Some(Command::ReplicaGone { replica }) => book.replica_gone(replica),
                None => return,
            },
            _ = tick.tick() => {
                if !book.by_rank.is_empty() {
                    let state = Arc::clone(&states.borrow_and_update());
                    book.expire(&state, Instant::now());
                }
                if !book.dirty.is_empty() {
                    publisher.apply(book.take_change());
                }
                refused.inc_by(book.refused - exported);
                exported = book.refused;
            }
        }
    }
}

#[cfg(test)]
mod tests;
