//! Duplicate identities: two or more keys claiming an identity from which upstream derives a
//! single key. The router cannot tell a genuine record from a forged one, so the whole set is
//! refused (by [`super::store::Claim::Contested`]); this module only reports it.
//!
//! Each distinct conflicting key set is logged and counted once. When the set shrinks below
//! two the conflict is forgotten, so a later recurrence is reported again.

use std::collections::{BTreeMap, BTreeSet};

use super::store::{EtcdKey, Identity, Store};

/// The most keys a duplicate warning lists.
pub const MAX_LOGGED_KEYS: usize = 4;

/// Conflicts already reported, with the key set each was reported for.
#[derive(Clone, Debug, Default)]
pub(super) struct Conflicts {
    reported: BTreeMap<Identity, BTreeSet<EtcdKey>>,
}

impl Conflicts {
    /// Re-examines `identity` after its claimants changed; `true` when a new conflicting key
    /// set appeared (and was logged).
    pub fn check(&mut self, store: &Store, identity: &Identity) -> bool {
        match store.claimants(identity) {
            Some(keys) if keys.len() > 1 => {
                if self.reported.get(identity) == Some(keys) {
                    return false;
                }
                warn(identity, keys);
                self.reported.insert(identity.clone(), keys.clone());
                true
            }
            _ => {
                self.reported.remove(identity);
                false
            }
        }
    }
}

fn warn(identity: &Identity, keys: &BTreeSet<EtcdKey>) {
    let listed: Vec<&str> = keys.iter().take(MAX_LOGGED_KEYS).map(|k| &**k).collect();
    // Budgeted: a writer can keep changing the set of conflicting keys. Escaped: a card's
    // component and endpoint are the fleet's.
    continuum_proto::warn_limited!(
        kind = identity.record_kind(),
        identity = ?identity.to_string(),
        conflicts = keys.len(),
        keys = ?listed,
        "several etcd keys claim one identity; all of them are refused until the extra keys are deleted"
    );
}
