//! Hashing for tables whose keys are already hashes.
//!
//! Engine block hashes and tokens hashes are XXH3 outputs, so a full hasher (SipHash) would spend
//! most of an insert re-mixing well-mixed bits. One folded 64×64→128 multiply and a short
//! finishing round spread them over a table's slot bits (the low ones) and hashbrown's tag bits
//! (the top 7). The keys come from the fleet, though, so the mix is keyed by a per-index random
//! seed and multiplier: a worker that sends crafted hashes cannot aim them at one bucket chain
//! without knowing both (it would need to, to turn inserts quadratic), and keys sharing all but
//! a few bits, which it can send knowing neither, spread as random ones do.

use std::hash::{BuildHasher, RandomState};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Mixer {
    seed: u64,
    multiplier: u64,
}

impl Mixer {
    /// A mixer with a fresh random seed and multiplier.
    pub(crate) fn random() -> Mixer {
        let state = RandomState::new();
        Mixer { seed: state.hash_one(0x5eed_u64), multiplier: state.hash_one(0xfeed_u64) | 1 }
    }

    /// The hash of one 64-bit key.
    #[inline]
    pub(crate) fn one(&self, key: u64) -> u64 {
        finish(fold(key ^ self.seed, self.multiplier))
    }

    /// The hash of a 64-bit key under a 32-bit context (a tree edge: parent node and tokens hash).
    #[inline]
    pub(crate) fn pair(&self, key: u64, context: u32) -> u64 {
        finish(fold(key ^ self.seed, (self.multiplier ^ (u64::from(context) << 1)) | 1))
    }
}

/// One more round over a folded product. Its low bits pick a lookup's home slot, and without
/// it they would depend on bits a key differs in high up only through a 10-bit window of the
/// multiplier: for keys differing only there (`k << 45`, a publisher choosing its block
/// hashes), an even window puts them all on a few slots, each lookup probing past every one.
/// An xor-shift, a multiply by an odd constant and an xor-shift spread every bit over the
/// low ones (about a nanosecond a hash).
#[inline]
fn finish(folded: u64) -> u64 {
    let mixed = (folded ^ (folded >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    mixed ^ (mixed >> 32)
}

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequential keys, and one key under sequential contexts, reach most of hashbrown's 128
    /// tag values (the top 7 bits of a hash) under any mixer, even one multiplying by 1, whose
    /// folded product alone leaves the top bits of small keys equal: one tag for all of them.
    #[test]
    fn sequential_keys_spread_over_the_tags_whatever_the_multiplier() {
        let tags = |hashes: &mut dyn Iterator<Item = u64>| {
            hashes.map(|hash| hash >> 57).collect::<std::collections::HashSet<u64>>().len()
        };
        for mixer in [Mixer { seed: 0, multiplier: 1 }, Mixer::random(), Mixer::random()] {
            assert!(tags(&mut (0..1024u64).map(|key| mixer.one(key))) >= 100, "{mixer:?}");
            assert!(tags(&mut (0..1024u32).map(|context| mixer.pair(7, context))) >= 100, "{mixer:?}");
        }
        assert!(tags(&mut (0..1024u64).map(|key| fold(key, 1))) < 4, "the folded product alone does not");
    }

    /// Keys differing only in a run of 10 bits anywhere (as a publisher choosing its block
    /// hashes could send) spread over the slots the hash's low bits pick, under every mixer:
    /// 1024 such keys take more than 400 of 1024 slots (a random function takes about 647),
    /// where the folded product alone put them on as few as 12 under one draw in twenty.
    #[test]
    fn keys_differing_in_any_ten_bits_spread_over_the_slots() {
        for _ in 0..20 {
            let mixer = Mixer::random();
            for shift in (0..=54).step_by(3) {
                let slots = |hash: &dyn Fn(u64) -> u64| {
                    (0..1024u64).map(|k| hash(k << shift) & 1023).collect::<std::collections::HashSet<u64>>().len()
                };
                let (one, pair) = (slots(&|key| mixer.one(key)), slots(&|key| mixer.pair(key, 7)));
                assert!(
                    one > 400 && pair > 400,
                    "keys differing in bits {shift}..{}: {one} and {pair} slots",
                    shift + 10
                );
            }
        }
    }
}
