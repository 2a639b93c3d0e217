//! The set of ranks that own one node, by interned rank id.
//!
//! Most nodes are owned by one rank (a conversation's own blocks), so one owner is stored inline.
//! A few more are a sorted list. A shared prefix (a system prompt) is owned by a large part of
//! the fleet: once a bitset over rank ids is no bigger than the list, it becomes one, so adding,
//! testing and removing an owner stay O(1) however popular the prefix (a 1,024-rank fleet costs
//! 128 bytes a node).

#[derive(Debug, Default, Clone)]
pub(crate) enum Owners {
    #[default]
    Empty,
    One(u32),
    /// Either a strictly ascending list of at least two ids, or, when its first element is
    /// `BITS`, a bitset (bit `id % 32` of word `1 + id / 32`) with at least one bit set. One
    /// variant for both keeps `Owners` (and so every node) the size of one `Vec`.
    Many(Vec<u32>),
}

/// Marks a `Many` as a bitset. Rank ids never reach it: they are bounded by the ownership ceiling.
const BITS: u32 = u32::MAX;
/// A list shorter than this never becomes a bitset (small lists are cheap to scan).
const MIN_BITS_OWNERS: usize = 32;

impl Owners {
    pub(crate) fn len(&self) -> usize {
        match self {
            Owners::Empty => 0,
            Owners::One(_) => 1,
            Owners::Many(v) => match bitset(v) {
                Some(words) => words.iter().map(|w| w.count_ones() as usize).sum(),
                None => v.len(),
            },
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Owners::Empty)
    }

    #[inline]
    pub(crate) fn contains(&self, id: u32) -> bool {
        match self {
            Owners::Empty => false,
            Owners::One(one) => *one == id,
            Owners::Many(v) => match bitset(v) {
                Some(words) => words.get(id as usize / 32).is_some_and(|w| w & bit(id) != 0),
                None => v.binary_search(&id).is_ok(),
            },
        }
    }

    /// Adds `id`; false if it was already there.
    pub(crate) fn insert(&mut self, id: u32) -> bool {
        match self {
            Owners::Empty => *self = Owners::One(id),
            Owners::One(one) if *one == id => return false,
            Owners::One(one) => {
                let (a, b) = if *one < id { (*one, id) } else { (id, *one) };
                *self = Owners::Many(vec![a, b]);
            }
            Owners::Many(v) if is_bitset(v) => {
                let word = 1 + id as usize / 32;
                if word >= v.len() {
                    // A high id would stretch the bitset past twice the list it stands for (a
                    // node's memory would follow the largest rank id, not its owners): back to
                    // a list, which takes the id.
                    let owners: usize = v[1..].iter().map(|w| w.count_ones() as usize).sum();
                    if word + 1 > 2 * (owners + 1) {
                        *self = from_bits(v);
                        return self.insert(id);
                    }
                    v.resize(word + 1, 0);
                }
                if v[word] & bit(id) != 0 {
                    return false;
                }
                v[word] |= bit(id);
            }
            Owners::Many(ids) => match ids.binary_search(&id) {
                Ok(_) => return false,
                Err(at) => {
                    ids.insert(at, id);
                    if let Some(bits) = as_bits(ids) {
                        *ids = bits;
                    }
                }
            },
        }
        true
    }

    /// Removes `id`; false if it was not there.
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        match self {
            Owners::One(one) if *one == id => *self = Owners::Empty,
            Owners::Many(v) if is_bitset(v) => {
                let Some(word) = v.get_mut(1 + id as usize / 32).filter(|w| **w & bit(id) != 0) else {
                    return false;
                };
                *word &= !bit(id);
                // Back to a list once that is at most half the bitset's size (hysteresis: a rank
                // joining and leaving at the boundary does not convert every time).
                let len: usize = v[1..].iter().map(|w| w.count_ones() as usize).sum();
                if len * 2 <= v.len() {
                    *self = from_bits(v);
                }
            }
            Owners::Many(ids) => {
                let Ok(at) = ids.binary_search(&id) else { return false };
                ids.remove(at);
                if let [last] = ids.as_slice() {
                    *self = Owners::One(*last);
                } else if ids.len() * 4 <= ids.capacity() {
                    // A list that lost most of its owners gives the memory back.
                    ids.shrink_to(ids.len() * 2);
                }
            }
            _ => return false,
        }
        true
    }

    /// The owners in ascending id order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u32)) {
        match self {
            Owners::Empty => {}
            Owners::One(id) => f(*id),
            Owners::Many(v) => match bitset(v) {
                Some(words) => {
                    for (w, &word) in words.iter().enumerate() {
                        let mut rest = word;
                        while rest != 0 {
                            f(w as u32 * 32 + rest.trailing_zeros());
                            rest &= rest - 1;
                        }
                    }
                }
                None => v.iter().copied().for_each(f),
            },
        }
    }

    /// The bitset words (bit `id % 32` of word `id / 32`) when the owners are held as one.
    #[inline]
    pub(crate) fn bits(&self) -> Option<&[u32]> {
        match self {
            Owners::Many(v) => bitset(v),
            _ => None,
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Owners::Many(v) => v.capacity() * size_of::<u32>(),
            _ => 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn check(&self) {
        if let Owners::Many(v) = self {
            match bitset(v) {
                Some(words) => assert!(words.iter().any(|w| *w != 0), "empty owner bitset"),
                None => assert!(v.len() >= 2 && v.windows(2).all(|w| w[0] < w[1]), "bad owner list {v:?}"),
            }
        }
    }
}

#[inline]
fn is_bitset(v: &[u32]) -> bool {
    v.first() == Some(&BITS)
}

#[inline]
fn bitset(v: &[u32]) -> Option<&[u32]> {
    if is_bitset(v) { Some(&v[1..]) } else { None }
}

#[inline]
fn bit(id: u32) -> u32 {
    1 << (id % 32)
}

/// The bitset for sorted `ids` if it would take no more memory than the list.
fn as_bits(ids: &[u32]) -> Option<Vec<u32>> {
    let words = *ids.last()? as usize / 32 + 1;
    if ids.len() < MIN_BITS_OWNERS || 1 + words > ids.len() {
        return None;
    }
    let mut bits = vec![0u32; 1 + words];
    bits[0] = BITS;
    for &id in ids {
        bits[1 + id as usize / 32] |= bit(id);
    }
    Some(bits)
}

fn from_bits(v: &[u32]) -> Owners {
    let mut ids = Vec::new();
    Owners::Many(v.to_vec()).for_each(|id| ids.push(id));
    match ids.as_slice() {
        [] => Owners::Empty,
        [one] => Owners::One(*one),
        _ => Owners::Many(ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(owners: &Owners) -> Vec<u32> {
        let mut ids = Vec::new();
        owners.for_each(|id| ids.push(id));
        ids
    }

    #[test]
    fn stays_sorted_and_collapses_back_inline() {
        let mut owners = Owners::default();
        for id in [5, 1, 9, 1, 3] {
            owners.insert(id);
        }
        assert_eq!(ids(&owners), vec![1, 3, 5, 9]);
        assert!(!owners.insert(3));
        assert!(owners.remove(1) && owners.remove(9) && owners.remove(5));
        assert!(matches!(owners, Owners::One(3)));
        assert!(!owners.remove(4));
        assert!(owners.remove(3) && owners.is_empty());
        assert_eq!(owners.heap_bytes(), 0);
    }

    #[test]
    fn many_dense_owners_become_a_bitset_and_come_back() {
        let mut owners = Owners::default();
        for id in 0..200 {
            owners.insert(id * 3);
        }
        assert!(matches!(&owners, Owners::Many(v) if is_bitset(v)));
        assert_eq!(owners.len(), 200);
        assert!(owners.contains(597) && !owners.contains(598) && !owners.contains(100_000));
        assert_eq!(ids(&owners), (0..200).map(|i| i * 3).collect::<Vec<_>>());
        assert!(owners.heap_bytes() < 200 * 4);
        for id in 10..200 {
            assert!(owners.remove(id * 3));
        }
        assert!(matches!(&owners, Owners::Many(v) if !is_bitset(v)));
        assert_eq!(ids(&owners), (0..10).map(|i| i * 3).collect::<Vec<_>>());
    }

    #[test]
    fn sparse_owners_stay_a_list() {
        let mut owners = Owners::default();
        for id in 0..100 {
            owners.insert(id * 1000);
        }
        assert!(matches!(&owners, Owners::Many(v) if !is_bitset(v)));
        assert_eq!(owners.len(), 100);
    }

    #[test]
    fn a_bitset_becomes_a_list_again_rather_than_stretch_to_a_far_rank_id() {
        let mut owners = Owners::default();
        for id in 0..MIN_BITS_OWNERS as u32 {
            owners.insert(id);
        }
        assert!(owners.bits().is_some(), "dense low ids: a bitset");
        assert!(owners.insert(1_000_000));
        owners.check();
        assert!(owners.bits().is_none(), "one far id: a list again");
        assert!(owners.heap_bytes() <= 1024, "{} bytes, not a 125 KB bitset", owners.heap_bytes());
        assert_eq!(owners.len(), MIN_BITS_OWNERS + 1);
        assert!(owners.contains(1_000_000) && owners.contains(0) && !owners.contains(500));
        assert!(!owners.insert(1_000_000), "already there");
        // A near id still goes into the bitset.
        let mut dense = Owners::default();
        for id in 0..MIN_BITS_OWNERS as u32 + 1 {
            dense.insert(id);
        }
        dense.insert(40);
        assert!(dense.bits().is_some());
    }

    #[test]
    fn fits_in_a_vec() {
        assert_eq!(size_of::<Owners>(), size_of::<Vec<u32>>());
    }
}
