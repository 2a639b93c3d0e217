//! Hashing for tables whose keys are already hashes.
//!
//! Engine block hashes and tokens hashes are XXH3 outputs, so a full hasher (SipHash) would spend
//! most of an insert re-mixing well-mixed bits. One folded 64×64→128 multiply is enough to spread
//! them over hashbrown's bucket and tag bits. The keys come from the fleet, though, so the mix is
//! keyed by a per-index random seed: a worker that sends crafted hashes cannot aim them at one
//! bucket chain without knowing the seed (it would need to, to turn inserts quadratic).

use std::hash::{BuildHasher, RandomState};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Mixer {
    seed: u64,
    multiplier: u64,
}

/// Of hashbrown's 128 tag values, how many 1,024 sequential keys must reach under a mixer.
const SPREAD: usize = 100;

impl Mixer {
    /// A mixer with a fresh random seed and multiplier. About one random odd multiplier in
    /// twenty folds structured keys (sequential ids, near-equal hashes) into a few dozen tag
    /// values or fewer, which would slow every probe of the tables it keys; such a draw is
    /// refused and drawn again.
    pub(crate) fn random() -> Mixer {
        let state = RandomState::new();
        let mut attempt = 0u64;
        loop {
            let mixer = Mixer {
                seed: state.hash_one((0x5eed_u64, attempt)),
                multiplier: state.hash_one((0xfeed_u64, attempt)) | 1,
            };
            if mixer.spreads() {
                return mixer;
            }
            attempt += 1;
        }
    }

    /// Whether sequential keys, and one key under sequential contexts, reach at least
    /// [`SPREAD`] of hashbrown's tag values (the top 7 bits of a hash).
    fn spreads(&self) -> bool {
        let distinct_tags = |hashes: &mut dyn Iterator<Item = u64>| {
            let mut seen = [false; 128];
            for hash in hashes {
                seen[(hash >> 57) as usize] = true;
            }
            seen.iter().filter(|seen| **seen).count()
        };
        distinct_tags(&mut (0..1024u64).map(|key| self.one(key))) >= SPREAD
            && distinct_tags(&mut (0..1024u32).map(|context| self.pair(7, context))) >= SPREAD
    }

    /// The hash of one 64-bit key.
    #[inline]
    pub(crate) fn one(&self, key: u64) -> u64 {
        fold(key ^ self.seed, self.multiplier)
    }

    /// The hash of a 64-bit key under a 32-bit context (a tree edge: parent node and tokens hash).
    #[inline]
    pub(crate) fn pair(&self, key: u64, context: u32) -> u64 {
        fold(key ^ self.seed, (self.multiplier ^ (u64::from(context) << 1)) | 1)
    }
}

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multiplier_that_clusters_structured_keys_is_refused() {
        // Multiplying by 1 leaves the top bits of small keys equal: one tag for all of them.
        assert!(!Mixer { seed: 0, multiplier: 1 }.spreads());
        assert!((0..200).all(|_| Mixer::random().spreads()), "every drawn mixer spreads");
    }

    #[test]
    fn small_integers_spread_over_the_tag_bits() {
        // hashbrown takes its 7-bit tags from the top of the hash: sequential keys must not share them.
        let mixer = Mixer::random();
        let tags: std::collections::HashSet<u64> = (0..1024u64).map(|k| mixer.one(k) >> 57).collect();
        assert!(tags.len() > 64, "only {} distinct tags", tags.len());
        let tags: std::collections::HashSet<u64> = (0..1024u32).map(|p| mixer.pair(7, p) >> 57).collect();
        assert!(tags.len() > 64, "only {} distinct tags", tags.len());
    }
}
