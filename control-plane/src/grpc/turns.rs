//! The turn `FindMatches` gives each lookup: its place among the lookups answered for the same
//! model, across every replica. Replicas rotate tied candidates by it, so picks among the same
//! workers that see the same tie at once take different ones. Counting per model keeps the
//! turns of one model's picks consecutive while other models' lookups interleave: with one
//! sequence for the fleet, two simultaneous picks for a model would take the same worker of two
//! whenever another model's lookup fell between them.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Models counted at once. A new model past it takes the place of the models no lookup has
/// named for `IDLE`; while none has idled so long, its lookups go unnumbered (turn 0, and
/// replicas rotate ties by their own cursors). The names come from replicas: a flood of
/// invented ones cannot start the sequences of the models in use over.
pub const MAX_TURN_MODELS: usize = 4096;
/// How long a model goes without a lookup before its sequence may be let go.
const IDLE: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct Turns {
    /// Keyed by the model name's hash, so a long name costs no more memory than a short one;
    /// seeded per process, since the names come over the network.
    hasher: RandomState,
    counted: Mutex<Counted>,
}

#[derive(Debug, Default)]
struct Counted {
    /// Per model, its last turn and when a lookup last named it.
    next: HashMap<u64, (u64, Instant)>,
    /// Full with none idle: no model idles out before then, so no pass looks for one.
    full_until: Option<Instant>,
}

impl Turns {
    /// The next turn for `model`: 1, 2, 3…, or 0 (unnumbered) while the bound is taken by
    /// models in use.
    pub fn next(&self, model: &str, now: Instant) -> u64 {
        let key = self.hasher.hash_one(model);
        let mut counted = self.counted.lock().unwrap_or_else(PoisonError::into_inner);
        let Counted { next, full_until } = &mut *counted;
        if next.len() >= MAX_TURN_MODELS && !next.contains_key(&key) {
            if full_until.is_some_and(|until| now < until) {
                return 0;
            }
            next.retain(|_, (_, named)| now.saturating_duration_since(*named) < IDLE);
            if next.len() >= MAX_TURN_MODELS {
                *full_until = next.values().map(|(_, named)| *named + IDLE).min();
                return 0;
            }
        }
        let (turn, named) = next.entry(key).or_insert((0, now));
        *turn = turn.wrapping_add(1).max(1);
        *named = now;
        *turn
    }

    /// Models counted now.
    #[cfg(test)]
    fn models(&self) -> usize {
        self.counted.lock().unwrap_or_else(PoisonError::into_inner).next.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_counts_from_one_whatever_the_others_do() {
        let (turns, now) = (Turns::default(), Instant::now());
        let taken: Vec<u64> = ["a", "b", "a", "a", "b", ""].iter().map(|model| turns.next(model, now)).collect();
        assert_eq!(taken, [1, 1, 2, 3, 2, 1]);
    }

    /// Invented names past the bound go unnumbered and leave the models in use counting on;
    /// models idle past `IDLE` make room.
    #[test]
    fn past_the_model_bound_new_models_go_unnumbered_until_others_idle_out() {
        let (turns, now) = (Turns::default(), Instant::now());
        turns.next("in use", now);
        for model in 1..MAX_TURN_MODELS {
            turns.next(&model.to_string(), now);
        }
        let later = now + IDLE / 2;
        assert_eq!(turns.next("invented", later), 0, "no room: unnumbered");
        assert_eq!(turns.next("in use", later), 2, "a counted model goes on at the bound");
        assert_eq!(turns.next("another", later), 0);
        assert_eq!(turns.models(), MAX_TURN_MODELS);

        // The others idle out; the one named since stays and counts on.
        let idle = now + IDLE;
        assert_eq!(turns.next("new", idle), 1);
        assert_eq!(turns.models(), 2);
        assert_eq!(turns.next("in use", idle), 3);
        assert_eq!(turns.next("1", idle), 1, "an idled-out model starts over");
    }
}
