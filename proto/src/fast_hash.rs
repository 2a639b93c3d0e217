//! A small multiplicative hasher (the Fx scheme, with a finalizer) for the hot maps of the
//! request path and of the control plane's backlog book, whose keys are worker ranks, dispatch
//! ids and backend names: all from the fleet or a replica holding the control plane's token,
//! never chosen by a client, so SipHash's keyed flooding resistance costs a noticeable share of
//! a request for little. The finalizer still spreads keys of any shape over a table's buckets.
//!
//! Keys a replica chooses outright (its dispatch ids) go in a [`SeededMap`], whose hashers start
//! from a secret drawn once per process: every step of the hash is invertible, so ids chosen to
//! share a bucket could otherwise be computed, and every lookup would probe them all.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::OnceLock;

const K: u64 = 0x517c_c1b7_2722_0a95;

#[derive(Debug, Default, Clone, Copy)]
pub struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        let mut word = [0; 8];
        word[..rest.len()].copy_from_slice(rest);
        self.add(u64::from_le_bytes(word) ^ (rest.len() as u64) << 56);
    }

    fn write_u8(&mut self, n: u8) {
        self.add(n.into());
    }

    fn write_u32(&mut self, n: u32) {
        self.add(n.into());
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    /// The state mixed so that every bit of it reaches the low bits: a table takes its bucket
    /// from them, and a product's low bits depend only on a key's own low bits, so ids that
    /// differ only above them (a replica may number its dispatches so) would all share one
    /// bucket, and every lookup would probe them all. (Murmur3's finalizer, short.)
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
}

pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A [`FastMap`] for keys a peer chooses: see the module documentation.
pub type SeededMap<K, V> = HashMap<K, V, Seeded>;

/// Builds [`FastHasher`]s that start from the process's secret.
#[derive(Debug, Clone, Copy)]
pub struct Seeded(u64);

impl Default for Seeded {
    fn default() -> Self {
        static SECRET: OnceLock<u64> = OnceLock::new();
        // The standard library's hasher is keyed from the operating system's randomness.
        Self(*SECRET.get_or_init(|| RandomState::new().hash_one(0x5eed_u64)))
    }
}

impl BuildHasher for Seeded {
    type Hasher = FastHasher;

    fn build_hasher(&self) -> FastHasher {
        FastHasher(self.0)
    }
}

/// A map keeps the room of its fullest moment: one that held a flood of entries and now holds
/// a few gives most of it back. Called after removals; amortised, since a map shrunk to twice
/// its entries must lose half of them again before it shrinks again.
pub fn shrink_when_sparse<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    const KEPT_ROOM: usize = 1024;
    if map.capacity() > KEPT_ROOM && map.len() * 4 < map.capacity() {
        map.shrink_to(KEPT_ROOM.max(map.len() * 2));
    }
}

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::*;

    #[test]
    fn a_map_emptied_after_a_flood_gives_its_room_back() {
        let mut map: FastMap<u64, u64> = (0..100_000).map(|k| (k, k)).collect();
        let flooded = map.capacity();
        for k in 0..99_990 {
            map.remove(&k);
            shrink_when_sparse(&mut map);
        }
        assert!(flooded >= 100_000 && map.capacity() <= 2048, "{flooded} then {}", map.capacity());
        assert_eq!(map.len(), 10);
        let mut small: FastMap<u64, u64> = (0..100).map(|k| (k, k)).collect();
        small.clear();
        let room = small.capacity();
        shrink_when_sparse(&mut small);
        assert_eq!(small.capacity(), room, "a small map keeps its room: no churn of allocations");
    }

    #[test]
    fn distinct_keys_hash_apart_and_equal_keys_together() {
        let (build, other) = (BuildHasherDefault::<FastHasher>::default(), BuildHasherDefault::<FastHasher>::default());
        // Equal keys of different owners and places, through two builders: one hash.
        let owned = (String::from("xns").split_off(1), 7u64);
        assert_eq!(build.hash_one(&owned), other.hash_one(("ns", 7u64)));
        assert_ne!(build.hash_one(("ns", 7u64)), build.hash_one(("ns", 8u64)));
        assert_ne!(build.hash_one("abcdefgh"), build.hash_one("abcdefgh\0"));
    }

    #[test]
    fn seeded_hashers_share_one_secret_that_moves_every_hash() {
        let (one, other) = (Seeded::default(), Seeded::default());
        assert_eq!(one.hash_one((1u64, 7u64)), other.hash_one((1u64, 7u64)), "one secret per process");
        let plain = BuildHasherDefault::<FastHasher>::default();
        let moved = (0..64u64).filter(|id| one.hash_one((1u64, *id)) != plain.hash_one((1u64, *id))).count();
        assert_eq!(moved, 64, "the secret is in every hash");
    }

    #[test]
    fn ids_that_differ_only_in_their_high_bits_spread_over_a_tables_buckets() {
        let build = BuildHasherDefault::<FastHasher>::default();
        for shift in [0, 20, 40, 54] {
            let buckets: std::collections::HashSet<u64> =
                (0..1024u64).map(|i| build.hash_one(i << shift) & 1023).collect();
            assert!(buckets.len() > 512, "ids << {shift}: {} of 1,024 buckets", buckets.len());
        }
    }
}
