//! How many of the load store's entries each worker holds, so that a full store can make room
//! for a worker holding few by giving up an entry of the one holding most: a few workers whose
//! cards claim a thousand ranks each must not shut every later worker out of the store (a
//! refused worker reads as idle and draws traffic).

use std::collections::{BTreeMap, HashMap, HashSet};

use continuum_proto::model::WorkerKey;

#[derive(Debug, Default)]
pub struct Shares {
    held: HashMap<WorkerKey, u32>,
    /// The workers holding each count: the largest share is the last bucket.
    by_count: BTreeMap<u32, HashSet<WorkerKey>>,
}

impl Shares {
    /// Entries `worker` holds.
    pub fn of(&self, worker: &WorkerKey) -> u32 {
        self.held.get(worker).copied().unwrap_or(0)
    }

    /// A worker holding the most entries, and how many.
    pub fn largest(&self) -> Option<(&WorkerKey, u32)> {
        let (count, workers) = self.by_count.last_key_value()?;
        Some((workers.iter().next()?, *count))
    }

    /// `worker` took one more entry.
    pub fn add(&mut self, worker: &WorkerKey) {
        let before = self.of(worker);
        self.moved(worker, before, before.saturating_add(1));
    }

    /// `worker` gave one entry up.
    pub fn remove(&mut self, worker: &WorkerKey) {
        let before = self.of(worker);
        if before > 0 {
            self.moved(worker, before, before - 1);
        }
    }

    fn moved(&mut self, worker: &WorkerKey, from: u32, to: u32) {
        if let Some(bucket) = self.by_count.get_mut(&from) {
            bucket.remove(worker);
            if bucket.is_empty() {
                self.by_count.remove(&from);
            }
        }
        if to == 0 {
            self.held.remove(worker);
            return;
        }
        self.held.insert(worker.clone(), to);
        self.by_count.entry(to).or_default().insert(worker.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_share_follows_adds_and_removals() {
        let (a, b) = (WorkerKey::new("dynamo", 1), WorkerKey::new("dynamo", 2));
        let mut shares = Shares::default();
        assert_eq!(shares.largest(), None);
        shares.add(&a);
        shares.add(&a);
        shares.add(&b);
        assert_eq!(shares.largest(), Some((&a, 2)));
        shares.remove(&a);
        shares.remove(&a);
        assert_eq!((shares.of(&a), shares.largest()), (0, Some((&b, 1))));
        shares.remove(&a);
        shares.remove(&b);
        assert_eq!(shares.largest(), None, "nothing held, nothing kept");
        assert!(shares.held.is_empty() && shares.by_count.is_empty());
    }
}
