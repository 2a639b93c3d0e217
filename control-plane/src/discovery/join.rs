//! The join rules: which held records make a worker or a publisher, and what they say.
//!
//! * A worker is exactly one `generate` Endpoint record for its identity; contested → none.
//! * Its card is the base card scoped to the same component and endpoint, else a legacy card
//!   for the same instance. A contested card set leaves the worker cardless, never excluded.
//! * Component and card must agree on the role; a disagreement excludes the worker.
//! * A card declaring more data-parallel ranks, or records with longer names or paths, than a
//!   real worker has excludes it, and only its identity and role are kept.
//! * A publisher is exactly one supported channel for its id; its event source, when exactly
//!   one, gives the dp rank (and the worker, when the key had no lease).

use std::sync::Arc;
use std::time::SystemTime;

use continuum_proto::model::{Role, Worker, WorkerKey};

use super::card::Card;
use super::fleet::{
    DiscoveredWorker, Exclusion, MAX_DATA_PARALLEL_SIZE, MAX_NAME_BYTES, MAX_PATH_BYTES, Publisher, PublisherKey, Topic,
};
use super::records::{ChannelRecord, EndpointRecord, Parsed, SourceRecord};
use super::store::{CardScope, Claim, Entry, Identity, Store};

/// Materialises the worker `key` from `store`; `previous` supplies `first_seen`.
pub(super) fn worker(
    store: &Store,
    key: &WorkerKey,
    previous: Option<&DiscoveredWorker>,
    now: SystemTime,
) -> Option<DiscoveredWorker> {
    let Claim::Unique(instance_entry) = store.claim(&Identity::Instance(key.clone())) else {
        return None;
    };
    let Parsed::Endpoint(instance) = &instance_entry.parsed else {
        return None;
    };
    let card_entry = card(store, key, instance);
    let card = card_entry.and_then(|e| match &e.parsed {
        Parsed::Model(model) => Some(&model.card),
        _ => None,
    });
    let (worker, excluded) = describe(key, instance, card);
    let last_updated = card_entry.map_or(instance_entry.updated, |c| c.updated.max(instance_entry.updated));
    Some(DiscoveredWorker {
        worker,
        first_seen: previous.map_or(now, |p| p.first_seen),
        last_updated,
        card: card.and_then(|c| c.raw.clone()),
        excluded,
    })
}

/// The card entry that joins `instance`: scoped first, then legacy.
fn card<'a>(store: &'a Store, key: &WorkerKey, instance: &EndpointRecord) -> Option<&'a Entry> {
    let scope = CardScope::Scoped { component: instance.component.clone(), endpoint: instance.endpoint.clone() };
    match store.claim(&Identity::Card(key.clone(), scope)) {
        Claim::Unique(entry) => Some(entry),
        Claim::Contested => None,
        Claim::Unclaimed => match store.claim(&Identity::Card(key.clone(), CardScope::Legacy)) {
            Claim::Unique(entry) => Some(entry),
            Claim::Contested | Claim::Unclaimed => None,
        },
    }
}

/// The role a component name claims: `prefill` and `decode` do, other names (`backend`) don't.
pub fn component_role(component: &str) -> Option<Role> {
    match component {
        "prefill" => Some(Role::Prefill),
        "decode" => Some(Role::Decode),
        _ => None,
    }
}

/// Combines the component's and the card's role claims.
pub fn resolve_role(component: &str, card: Option<&Card>) -> Result<Role, Exclusion> {
    match (component_role(component), card.and_then(Card::role_claim)) {
        (Some(component), Some(card)) if component != card => Err(Exclusion::RoleDisagreement { component, card }),
        (Some(role), _) | (None, Some(role)) => Ok(role),
        (None, None) => Ok(Role::Unknown),
    }
}

fn describe(key: &WorkerKey, instance: &EndpointRecord, card: Option<&Card>) -> (Worker, Option<Exclusion>) {
    let (role, excluded) = match resolve_role(&instance.component, card) {
        Ok(role) => (role, None),
        Err(exclusion) => (Role::Unknown, Some(exclusion)),
    };
    let rc = card.map(Card::runtime_config);
    let worker = Worker {
        key: key.clone(),
        role,
        model: card.and_then(|c| c.typed.display_name.clone().or_else(|| c.typed.name.clone())).unwrap_or_default(),
        component: instance.component.clone(),
        endpoint: instance.endpoint.clone(),
        block_size: card.and_then(Card::block_size),
        capacity: card.map(Card::capacity).unwrap_or_default(),
        dp_start_rank: rc.and_then(|rc| rc.data_parallel_start_rank).unwrap_or(0),
        dp_size: rc.and_then(|rc| rc.data_parallel_size).unwrap_or(0),
        disaggregated_endpoint: rc.and_then(|rc| rc.disaggregated_endpoint.clone()),
        artifacts: card.and_then(Card::artifacts).map(Arc::new),
    };
    // Implausible first: a worker excluded for another reason (its roles disagree) must not
    // keep outsized fields or ranks past the bound either.
    let oversized = card.and_then(|c| c.oversized).map(|(field, bytes)| Exclusion::OversizedField { field, bytes });
    match implausible(&worker).or(oversized).or(excluded) {
        // Nothing of an implausible worker is kept beyond its identity and role: it is listed,
        // never routed, and must not carry its outsized fields into every snapshot.
        Some(
            exclusion @ (Exclusion::TooManyRanks { .. }
            | Exclusion::RanksOutOfRange { .. }
            | Exclusion::OversizedField { .. }),
        ) => {
            let bare = Worker {
                model: String::new(),
                component: String::new(),
                endpoint: String::new(),
                dp_start_rank: 0,
                dp_size: 0,
                disaggregated_endpoint: None,
                artifacts: None,
                ..worker
            };
            (bare, Some(exclusion))
        }
        excluded => (worker, excluded),
    }
}

/// Why `worker`'s records cannot describe a real worker, if they cannot.
fn implausible(worker: &Worker) -> Option<Exclusion> {
    if worker.dp_size > MAX_DATA_PARALLEL_SIZE {
        return Some(Exclusion::TooManyRanks { declared: worker.dp_size });
    }
    // Otherwise its ranks would be cut short (or none at all) without a word.
    if worker.dp_start_rank.checked_add(worker.dp_size.max(1)).is_none() {
        return Some(Exclusion::RanksOutOfRange { start: worker.dp_start_rank, size: worker.dp_size });
    }
    let names = [
        ("model name", Some(worker.model.as_str())),
        ("component", Some(worker.component.as_str())),
        ("endpoint", Some(worker.endpoint.as_str())),
        ("disaggregated endpoint", worker.disaggregated_endpoint.as_deref()),
    ];
    let files = worker.artifacts.iter().flat_map(|a| [&a.tokenizer, &a.tokenizer_config, &a.chat_template]).flatten();
    let paths = files.flat_map(|f| [("artifact path", f.uri.as_str()), ("artifact checksum", f.checksum.as_str())]);
    let too_long = |(field, bytes, bound): (&'static str, usize, usize)| {
        (bytes > bound).then_some(Exclusion::OversizedField { field, bytes })
    };
    names
        .into_iter()
        .filter_map(|(field, name)| Some((field, name?.len(), MAX_NAME_BYTES)))
        .chain(paths.map(|(field, path)| (field, path.len(), MAX_PATH_BYTES)))
        .find_map(too_long)
}

/// Materialises the publisher `key` from `store`.
pub(super) fn publisher(store: &Store, key: &PublisherKey) -> Option<Publisher> {
    let Claim::Unique(Entry { parsed: Parsed::Channel(channel), .. }) = store.claim(&Identity::Channel(key.clone()))
    else {
        return None;
    };
    let source = match store.claim(&Identity::Source(key.clone())) {
        Claim::Unique(Entry { parsed: Parsed::Source(source), .. }) if source.topic == channel.topic => Some(source),
        _ => None,
    };
    Some(describe_publisher(key, channel, source))
}

fn describe_publisher(key: &PublisherKey, channel: &ChannelRecord, source: Option<&SourceRecord>) -> Publisher {
    let worker_id = channel.lease.or(source.and_then(|s| s.worker_id));
    let dp_rank = match channel.topic {
        Topic::KvEvents => source.and_then(|s| s.dp_rank),
        Topic::KvMetrics => None,
    };
    Publisher {
        publisher_id: key.publisher_id,
        namespace: key.namespace.clone(),
        component: channel.component.clone(),
        endpoint: channel.endpoint.clone(),
        topic: channel.topic,
        worker: worker_id.map(|id| WorkerKey::new(key.namespace.clone(), id)),
        dp_rank,
        address: channel.address.clone(),
    }
}
