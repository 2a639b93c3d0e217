//! A persistent, ordered map of shared values: what the discovered fleet is made of.
//!
//! Cloning is `O(1)` and an update copies `O(log n)` (imbl's B-tree shares the rest), so the
//! reducer can hand out the whole fleet after every watch response without copying 16,384
//! workers, and comparing two generations skips every entry they still share.

use std::sync::Arc;

use imbl::OrdMap;

#[derive(Debug)]
pub struct Entries<K: Ord + Clone, V>(OrdMap<K, Arc<V>>);

impl<K: Ord + Clone, V> Clone for Entries<K, V> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<K: Ord + Clone, V> Default for Entries<K, V> {
    fn default() -> Self {
        Self(OrdMap::new())
    }
}

impl<K: Ord + Clone, V: PartialEq> PartialEq for Entries<K, V> {
    /// Equal keys and values; values still shared between the two are not compared.
    fn eq(&self, other: &Self) -> bool {
        self.0.ptr_eq(&other.0)
            || (self.0.len() == other.0.len()
                && self
                    .0
                    .iter()
                    .zip(other.0.iter())
                    .all(|((ka, a), (kb, b))| ka == kb && (Arc::ptr_eq(a, b) || a == b)))
    }
}

impl<K: Ord + Clone, V> Entries<K, V> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The values in key order.
    pub fn iter(&self) -> impl Iterator<Item = &V> {
        self.0.values().map(Arc::as_ref)
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.0.get(key).map(Arc::as_ref)
    }

    pub fn insert(&mut self, key: K, value: V) {
        self.0.insert(key, Arc::new(value));
    }

    pub fn remove(&mut self, key: &K) {
        self.0.remove(key);
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        let dropped: Vec<K> = self.0.iter().filter(|(k, v)| !keep(k, v)).map(|(k, _)| k.clone()).collect();
        for key in dropped {
            self.0.remove(&key);
        }
    }
}

/// One difference between two generations of entries.
#[derive(Debug, PartialEq)]
pub enum Change<'a, K, V> {
    /// Added, or replaced by a different value.
    Upserted(&'a V),
    Removed(&'a K),
}

impl<K: Ord + Clone, V: PartialEq> Entries<K, V> {
    /// What changed from `older` to `self`, in key order. A merge over both maps in which
    /// entries the two generations share cost a pointer comparison, so a one-worker change in
    /// a 16,384-worker fleet copies nothing and compares no worker.
    pub fn changes_since<'a>(&'a self, older: &'a Self) -> Vec<Change<'a, K, V>> {
        if self.0.ptr_eq(&older.0) {
            return Vec::new();
        }
        let mut changes = Vec::new();
        let (mut new, mut old) = (self.0.iter().peekable(), older.0.iter().peekable());
        loop {
            match (new.peek().copied(), old.peek().copied()) {
                (None, None) => return changes,
                (Some((_, v)), None) => {
                    changes.push(Change::Upserted(v.as_ref()));
                    new.next();
                }
                (None, Some((k, _))) => {
                    changes.push(Change::Removed(k));
                    old.next();
                }
                (Some((kn, vn)), Some((ko, vo))) => match kn.cmp(ko) {
                    std::cmp::Ordering::Less => {
                        changes.push(Change::Upserted(vn.as_ref()));
                        new.next();
                    }
                    std::cmp::Ordering::Greater => {
                        changes.push(Change::Removed(ko));
                        old.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if !Arc::ptr_eq(vn, vo) && vn != vo {
                            changes.push(Change::Upserted(vn.as_ref()));
                        }
                        new.next();
                        old.next();
                    }
                },
            }
        }
    }
}

impl<K: Ord + Clone, V: Clone> IntoIterator for Entries<K, V> {
    type Item = V;
    type IntoIter = std::vec::IntoIter<V>;

    /// The values in key order, copied out.
    fn into_iter(self) -> Self::IntoIter {
        self.0.values().map(|v| V::clone(v)).collect::<Vec<_>>().into_iter()
    }
}

impl<K: Ord + Clone, V> FromIterator<(K, V)> for Entries<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self(iter.into_iter().map(|(k, v)| (k, Arc::new(v))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(pairs: &[(u32, &str)]) -> Entries<u32, String> {
        pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
    }

    #[test]
    fn changes_since_lists_upserts_and_removals_in_key_order() {
        let old = entries(&[(1, "a"), (2, "b"), (3, "c")]);
        let mut new = old.clone();
        new.insert(2, "B".into());
        new.remove(&3);
        new.insert(4, "d".into());
        let (b, d) = ("B".to_string(), "d".to_string());
        let expected = vec![Change::Upserted(&b), Change::Removed(&3), Change::Upserted(&d)];
        assert_eq!(new.changes_since(&old), expected);
        assert!(old.changes_since(&old.clone()).is_empty());
    }

    #[test]
    fn an_equal_value_rebuilt_separately_is_not_a_change() {
        let old = entries(&[(1, "a")]);
        let rebuilt = entries(&[(1, "a")]);
        assert!(rebuilt.changes_since(&old).is_empty());
        assert_eq!(rebuilt, old);
    }
}
