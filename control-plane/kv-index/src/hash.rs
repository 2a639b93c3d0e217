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

impl Mixer {
    pub(crate) fn random() -> Mixer {
        let state = RandomState::new();
        Mixer { seed: state.hash_one(0x5eed_u64), multiplier: state.hash_one(0xfeed_u64) | 1 }
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
    fn small_integers_spread_over_the_tag_bits() {
        // hashbrown takes its 7-bit tags from the top of the hash: sequential keys must not share them.
        let mixer = Mixer::random();
        let tags: std::collections::HashSet<u64> = (0..1024u64).map(|k| mixer.one(k) >> 57).collect();
        assert!(tags.len() > 64, "only {} distinct tags", tags.len());
        let tags: std::collections::HashSet<u64> = (0..1024u32).map(|p| mixer.pair(7, p) >> 57).collect();
        assert!(tags.len() > 64, "only {} distinct tags", tags.len());
    }
}
