//! Namespaces that serve one model from aggregated workers beside prefill or decode workers.
//!
//! The picker never pairs a prefill worker with an aggregated one, and in a namespace with
//! prefill and decode workers the aggregated ones are no decode candidates: they sit idle.
//! Dynamo 1.5.0's `dynamo.frontend --router-mode direct` cannot serve such a fleet at all (it
//! picks one worker set at random per request and refuses an instance id from the other). So
//! the registry warns, once, as a (namespace, model) pair starts mixing, with the workers of
//! each role; not again while it stays mixed. Model names come from etcd: one publish names at
//! most [`MAX_NAMED_PAIRS`] pairs, and sums up the rest (the seed's rule).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use continuum_proto::model::{Role, Worker};

use crate::discovery::{Change, DiscoveredWorker, Fleet};

/// Pairs one publish names in warnings of their own; the rest share one.
pub const MAX_NAMED_PAIRS: usize = 8;

type Pair = (Arc<str>, String);

/// The routable workers of each (namespace, model), by role, and whether the pair was warned
/// about as mixed.
#[derive(Debug, Default)]
pub struct Mixing {
    pairs: HashMap<Pair, Roles>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    pub prefill: u32,
    pub decode: u32,
    pub aggregated: u32,
    warned: bool,
}

impl Roles {
    fn is_mixed(&self) -> bool {
        self.aggregated > 0 && (self.prefill > 0 || self.decode > 0)
    }

    fn is_empty(&self) -> bool {
        self.prefill == 0 && self.decode == 0 && self.aggregated == 0
    }
}

/// A pair that started mixing, with its workers by role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixedPair {
    pub namespace: Arc<str>,
    pub model: String,
    pub roles: Roles,
}

impl Mixing {
    /// Follows the fleet from `older` to `newer` (only the workers that changed are looked at)
    /// and returns the pairs that started mixing, ordered by namespace and model.
    pub fn update(&mut self, older: &Fleet, newer: &Fleet) -> Vec<MixedPair> {
        let mut touched: HashSet<Pair> = HashSet::new();
        for change in newer.workers.changes_since(&older.workers) {
            let key = match &change {
                Change::Upserted(discovered) => &discovered.worker.key,
                Change::Removed(key) => *key,
            };
            if let Some(worker) = older.workers.get(key).and_then(routable) {
                self.count(worker, false, &mut touched);
            }
            if let Change::Upserted(discovered) = change
                && let Some(worker) = routable(discovered)
            {
                self.count(worker, true, &mut touched);
            }
        }
        let mut mixed = Vec::new();
        for pair in touched {
            let Some(roles) = self.pairs.get_mut(&pair) else { continue };
            if roles.is_empty() {
                self.pairs.remove(&pair);
            } else if !roles.is_mixed() {
                roles.warned = false;
            } else if !roles.warned {
                roles.warned = true;
                mixed.push(MixedPair { namespace: pair.0, model: pair.1, roles: *roles });
            }
        }
        mixed.sort_by(|a, b| (&a.namespace, &a.model).cmp(&(&b.namespace, &b.model)));
        mixed
    }

    fn count(&mut self, worker: &Worker, added: bool, touched: &mut HashSet<Pair>) {
        let pair = (Arc::clone(&worker.key.namespace), worker.model.clone());
        let roles = self.pairs.entry(pair.clone()).or_default();
        let count = match worker.role {
            Role::Prefill => &mut roles.prefill,
            Role::Decode => &mut roles.decode,
            Role::Aggregated => &mut roles.aggregated,
            Role::Unknown => return,
        };
        *count = if added { count.saturating_add(1) } else { count.saturating_sub(1) };
        touched.insert(pair);
    }
}

/// A worker the picker may route to: not excluded, with a known role.
fn routable(discovered: &DiscoveredWorker) -> Option<&Worker> {
    (discovered.excluded.is_none() && discovered.worker.role != Role::Unknown).then_some(&discovered.worker)
}

/// Logs the pairs that started mixing: [`MAX_NAMED_PAIRS`] by name, the rest summed up.
pub fn warn(mixed: &[MixedPair]) {
    for pair in mixed.iter().take(MAX_NAMED_PAIRS) {
        // Budgeted: a worker toggled in and out would warn each time. Escaped: the model's
        // name is the card's.
        continuum_proto::warn_limited!(
            namespace = ?pair.namespace,
            model = ?pair.model,
            prefill = pair.roles.prefill,
            decode = pair.roles.decode,
            aggregated = pair.roles.aggregated,
            "a namespace serves this model from aggregated workers beside prefill or decode workers: the \
             aggregated ones are not picked while prefill and decode workers serve it, and Dynamo 1.5.0's \
             direct-mode frontend cannot serve such a fleet; give each its own namespace"
        );
    }
    if mixed.len() > MAX_NAMED_PAIRS {
        continuum_proto::warn_limited!(
            shown = MAX_NAMED_PAIRS,
            suppressed = mixed.len() - MAX_NAMED_PAIRS,
            "more (namespace, model) pairs started mixing aggregated workers with prefill or decode workers"
        );
    }
}

#[cfg(test)]
mod tests {
    use continuum_proto::model::WorkerKey;

    use super::*;
    use crate::discovery::Exclusion;

    use crate::discovery::test_worker as worker;

    fn with(fleet: &Fleet, workers: impl IntoIterator<Item = (WorkerKey, DiscoveredWorker)>) -> Fleet {
        let mut next = fleet.clone();
        for (key, worker) in workers {
            next.workers.insert(key, worker);
        }
        next
    }

    fn named(mixed: &[MixedPair]) -> Vec<(String, String, (u32, u32, u32))> {
        let roles = |r: &Roles| (r.prefill, r.decode, r.aggregated);
        mixed.iter().map(|p| (p.namespace.to_string(), p.model.clone(), roles(&p.roles))).collect()
    }

    #[test]
    fn a_pair_is_named_once_as_it_starts_mixing_and_again_only_after_it_stopped() {
        let mut mixing = Mixing::default();
        let empty = Fleet::default();
        let disaggregated = with(&empty, [worker("a", 1, Role::Prefill, "m"), worker("a", 2, Role::Decode, "m")]);
        assert!(mixing.update(&empty, &disaggregated).is_empty(), "prefill and decode alone are the usual fleet");
        // An aggregated worker joins them, and one serving another model, and one elsewhere.
        let mixed = with(
            &disaggregated,
            [
                worker("a", 3, Role::Aggregated, "m"),
                worker("a", 4, Role::Aggregated, "other"),
                worker("b", 5, Role::Aggregated, "m"),
            ],
        );
        assert_eq!(named(&mixing.update(&disaggregated, &mixed)), [("a".into(), "m".into(), (1, 1, 1))]);
        let more = with(&mixed, [worker("a", 6, Role::Aggregated, "m")]);
        assert!(mixing.update(&mixed, &more).is_empty(), "not repeated while it stays mixed");

        // It stops mixing (the aggregated ones leave or are excluded), then starts again.
        let mut calm = more.clone();
        calm.workers.remove(&WorkerKey::new("a", 3));
        let (key, mut excluded) = worker("a", 6, Role::Aggregated, "m");
        excluded.excluded = Some(Exclusion::RoleDisagreement { component: Role::Prefill, card: Role::Aggregated });
        let calm = with(&calm, [(key, excluded)]);
        assert!(mixing.update(&more, &calm).is_empty());
        let again = with(&calm, [worker("a", 7, Role::Aggregated, "m")]);
        assert_eq!(named(&mixing.update(&calm, &again)), [("a".into(), "m".into(), (1, 1, 1))]);
        assert!(mixing.update(&again, &Fleet::default()).is_empty());
        assert!(mixing.pairs.is_empty(), "a fleet emptied holds no pair");
    }

    #[test]
    fn every_pair_starting_at_once_is_returned_for_the_warning_to_cut() {
        let mut mixing = Mixing::default();
        let pairs = (0..MAX_NAMED_PAIRS as u64 + 3).flat_map(|i| {
            let model = format!("m{i:02}");
            [worker("a", 2 * i + 1, Role::Decode, &model), worker("a", 2 * i + 2, Role::Aggregated, &model)]
        });
        let fleet = with(&Fleet::default(), pairs);
        let mixed = mixing.update(&Fleet::default(), &fleet);
        assert_eq!(mixed.len(), MAX_NAMED_PAIRS + 3);
        assert_eq!(mixed[0].model, "m00", "in order, so the ones named are the same each time");
        warn(&mixed);
    }
}
