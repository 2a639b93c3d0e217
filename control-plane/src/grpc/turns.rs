//! The turn `FindMatches` gives each lookup: its place among the lookups answered for the same
//! model, across every replica. Replicas rotate tied candidates by it, so picks among the same
//! workers that see the same tie at once take different ones. Counting per model keeps the
//! turns of one model's picks consecutive while other models' lookups interleave: with one
//! sequence for the fleet, two simultaneous picks for a model would take the same worker of two
//! whenever another model's lookup fell between them.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};

/// Models counted at once. A new model past it starts every sequence over: a turn is only a
/// rotation's starting point, so a restart costs at most one tie split the same way.
pub const MAX_TURN_MODELS: usize = 4096;

#[derive(Debug, Default)]
pub struct Turns {
    /// Keyed by the model name's hash, so a long name costs no more memory than a short one;
    /// seeded per process, since the names come over the network.
    hasher: RandomState,
    next: Mutex<HashMap<u64, u64>>,
}

impl Turns {
    /// The next turn for `model`: 1, 2, 3… (never 0, which means unnumbered).
    pub fn next(&self, model: &str) -> u64 {
        let key = self.hasher.hash_one(model);
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        if next.len() >= MAX_TURN_MODELS && !next.contains_key(&key) {
            next.clear();
        }
        let turn = next.entry(key).or_default();
        *turn = turn.wrapping_add(1).max(1);
        *turn
    }

    /// Models counted now.
    #[cfg(test)]
    fn models(&self) -> usize {
        self.next.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_counts_from_one_whatever_the_others_do() {
        let turns = Turns::default();
        let taken: Vec<u64> = ["a", "b", "a", "a", "b", ""].iter().map(|model| turns.next(model)).collect();
        assert_eq!(taken, [1, 1, 2, 3, 2, 1]);
    }

    #[test]
    fn past_the_model_bound_the_sequences_start_over() {
        let turns = Turns::default();
        for model in 0..MAX_TURN_MODELS {
            turns.next(&model.to_string());
        }
        assert_eq!(turns.next("0"), 2, "a counted model goes on at the bound");
        assert_eq!(turns.models(), MAX_TURN_MODELS);
        assert_eq!(turns.next("new"), 1);
        assert_eq!(turns.models(), 1);
        assert_eq!(turns.next("0"), 1, "started over");
    }
}
