//! The join rules: which held records make a worker or a publisher, and what they say.
//!
//! * A worker is exactly one `generate` Endpoint record for its identity; contested → none.
//! * Its card is the base card scoped to the same component and endpoint, else a legacy card
//!   for the same instance. A contested card set leaves the worker cardless, never excluded.
//! * Component and card must agree on the role; a disagreement excludes the worker.
//! * A publisher is exactly one supported channel for its id; its event source, when exactly
//!   one, gives the dp rank (and the worker, when the key had no lease).

use std::sync::Arc;
use std::time::SystemTime;

use continuum_proto::model::{Role, Worker, WorkerKey};

use super::card::Card;
use super::fleet::{DiscoveredWorker, Exclusion, Publisher, PublisherKey, Topic};
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
        model: card.and_then(|c| c.typed.display_name.clone()).unwrap_or_default(),
        component: instance.component.clone(),
        endpoint: instance.endpoint.clone(),
        block_size: card.and_then(Card::block_size),
        capacity: card.map(Card::capacity).unwrap_or_default(),
        dp_start_rank: rc.and_then(|rc| rc.data_parallel_start_rank).unwrap_or(0),
        dp_size: rc.and_then(|rc| rc.data_parallel_size).unwrap_or(0),
        disaggregated_endpoint: rc.and_then(|rc| rc.disaggregated_endpoint.clone()),
        artifacts: card.and_then(Card::artifacts).map(Arc::new),
    };
    (worker, excluded)
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
