//! Identities claimed by several keys are refused together, reported once per key set, and
//! recover when the extra keys are deleted.

use continuum_proto::model::Role;
use serde_json::{Value, json};

use super::super::EventKind;
use super::{
    NS, Sim, card_json, card_key, card_value, channel_key, channel_value, endpoint_value, instance_key, source_key,
    source_value, zmq,
};

const ID: u64 = 0x6a6c_a228_814c_9750;
const PUBLISHER: u64 = 0x1ee80a9960e440;

/// What the fleet shows for the contested identity.
#[derive(Debug, PartialEq)]
enum Seen {
    NoWorker,
    /// Role and whether the card joined.
    Worker(Role, bool),
    NoPublisher,
    /// The publisher's dp rank.
    Publisher(Option<u32>),
}

fn worker_seen(sim: &Sim) -> Seen {
    sim.worker(ID).map_or(Seen::NoWorker, |w| Seen::Worker(w.worker.role, w.card.is_some()))
}

fn publisher_seen(sim: &Sim) -> Seen {
    sim.publisher(PUBLISHER).map_or(Seen::NoPublisher, |p| Seen::Publisher(p.dp_rank))
}

struct Case {
    what: &'static str,
    /// Records put before the conflict.
    base: Vec<(String, Value)>,
    /// The record that creates the conflict.
    extra: (String, Value),
    seen: fn(&Sim) -> Seen,
    before: Seen,
    during: Seen,
}

fn cases() -> Vec<Case> {
    let instance = (instance_key(NS, "decode", "generate", ID), endpoint_value("decode", "generate", json!(ID)));
    let card = (card_key(NS, "decode", ID), card_value("decode", json!(ID), card_json("decode")));
    let legacy = |name: &str| json!({"type": "Model", "instance_id": ID, "card_json": {"display_name": name}});
    let channel = (
        channel_key(NS, "backend", "kv-events", PUBLISHER),
        channel_value("kv-events", PUBLISHER, zmq("tcp://10.0.0.7:41000")),
    );
    let source = (source_key(NS, "backend", "kv-events", PUBLISHER), source_value(PUBLISHER, ID, 1));
    vec![
        Case {
            what: "generate instance id under a second key",
            base: vec![card.clone(), instance.clone()],
            extra: (instance_key(NS, "prefill", "generate", ID), endpoint_value("prefill", "generate", json!(ID))),
            seen: worker_seen,
            before: Seen::Worker(Role::Decode, true),
            during: Seen::NoWorker,
        },
        Case {
            what: "two scoped base cards for one worker",
            base: vec![card.clone(), instance.clone()],
            extra: (format!("{}/copy", card.0), card.1.clone()),
            seen: worker_seen,
            before: Seen::Worker(Role::Decode, true),
            during: Seen::Worker(Role::Decode, false),
        },
        Case {
            what: "two legacy cards for one worker",
            base: vec![(format!("v1/mdc/{NS}/a"), legacy("a")), instance.clone()],
            extra: (format!("v1/mdc/{NS}/b"), legacy("b")),
            seen: worker_seen,
            before: Seen::Worker(Role::Decode, true),
            during: Seen::Worker(Role::Decode, false),
        },
        Case {
            what: "one publisher id on two channel keys",
            base: vec![channel.clone(), source.clone()],
            extra: (channel_key(NS, "other", "kv-events", PUBLISHER), channel.1.clone()),
            seen: publisher_seen,
            before: Seen::Publisher(Some(1)),
            during: Seen::NoPublisher,
        },
        Case {
            what: "one publisher id on two event sources",
            base: vec![channel, source.clone()],
            extra: (source_key(NS, "other", "kv-events", PUBLISHER), source_value(PUBLISHER, ID, 0)),
            seen: publisher_seen,
            before: Seen::Publisher(Some(1)),
            during: Seen::Publisher(None),
        },
    ]
}

#[test]
fn duplicate_identities_are_refused_together_and_recover_when_the_extra_key_goes() {
    for case in cases() {
        let mut sim = Sim::new();
        for (key, value) in &case.base {
            sim.put(key, value);
        }
        assert_eq!((case.seen)(&sim), case.before, "{}: before", case.what);
        let applied = sim.put(&case.extra.0, &case.extra.1);
        assert_eq!(applied.count(EventKind::Duplicate), 1, "{}: counted", case.what);
        assert_eq!((case.seen)(&sim), case.during, "{}: refused", case.what);
        let again = sim.put(&case.extra.0, &case.extra.1);
        assert_eq!(again.count(EventKind::Duplicate), 0, "{}: the same key set is reported once", case.what);
        let deleted = sim.delete(&case.extra.0);
        assert_eq!(deleted.count(EventKind::Duplicate), 0, "{}", case.what);
        assert_eq!((case.seen)(&sim), case.before, "{}: recovered", case.what);
        let recurred = sim.put(&case.extra.0, &case.extra.1);
        assert_eq!(recurred.count(EventKind::Duplicate), 1, "{}: a recurrence is reported again", case.what);
    }
}

#[test]
fn a_third_claimant_is_a_new_key_set_and_deleting_the_original_also_recovers() {
    let mut sim = Sim::new();
    let keys: Vec<String> =
        ["decode", "prefill", "backend"].iter().map(|c| instance_key(NS, c, "generate", ID)).collect();
    let value = |component: &str| endpoint_value(component, "generate", json!(ID));
    sim.put(&keys[0], &value("decode"));
    assert_eq!(sim.put(&keys[1], &value("prefill")).count(EventKind::Duplicate), 1);
    assert_eq!(sim.put(&keys[2], &value("backend")).count(EventKind::Duplicate), 1);
    sim.delete(&keys[2]);
    sim.delete(&keys[0]);
    let survivor = sim.worker(ID).map(|w| w.worker.component);
    assert_eq!(survivor.as_deref(), Some("prefill"));
}

#[test]
fn a_conflict_present_in_a_resync_is_counted_once_across_resyncs() {
    let mut sim = Sim::new();
    let records = vec![
        super::kv(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID))),
        super::kv(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID))),
    ];
    let first = sim.apply(super::WatchEvent::Resync(records.clone()));
    let second = sim.apply(super::WatchEvent::Resync(records));
    assert_eq!((first.count(EventKind::Duplicate), second.count(EventKind::Duplicate)), (1, 0));
    assert!(sim.fleet().workers.is_empty());
}

/// Dynamo keys each record by its id (`…/{id:x}`): a value naming another id than its key's is
/// refused as malformed and contests nothing, so a record written under the wrong key cannot
/// hide the worker or publisher it names.
#[test]
fn a_record_whose_key_names_another_id_is_malformed_and_contests_nothing() {
    let stray = 0xdead;
    for case in cases() {
        let mut sim = Sim::new();
        for (key, value) in &case.base {
            sim.put(key, value);
        }
        // The conflicting record, under a key that ends in another id than its value names.
        let (key, value) = &case.extra;
        let mut segments: Vec<&str> = key.split('/').collect();
        let at = if key.starts_with("v1/event_") { segments.len() - 1 } else { 5 };
        // A legacy card's key names no id.
        let Some(segment) = segments.get_mut(at) else { continue };
        let stray_hex = format!("{stray:x}");
        *segment = &stray_hex;
        let applied = sim.put(segments.join("/"), value);
        assert_eq!(applied.count(EventKind::Malformed), 1, "{}: refused", case.what);
        assert_eq!(applied.count(EventKind::Duplicate), 0, "{}: no contest", case.what);
        assert_eq!((case.seen)(&sim), case.before, "{}: the named one is untouched", case.what);
    }
}

/// Nor can a record filed where Dynamo would not file it: an instance under a key without an
/// id, or an instance or card whose value names another component or endpoint than its key.
#[test]
fn a_record_filed_under_another_path_or_without_an_id_is_malformed_and_contests_nothing() {
    let instance = (instance_key(NS, "decode", "generate", ID), endpoint_value("decode", "generate", json!(ID)));
    let card = (card_key(NS, "decode", ID), card_value("decode", json!(ID), card_json("decode")));
    let strays: [(&str, String, Value); 4] = [
        ("an instance without an id in its key", format!("v1/instances/{NS}/x"), instance.1.clone()),
        ("an instance under another component", instance_key(NS, "other", "generate", ID), instance.1.clone()),
        ("an instance under another endpoint", format!("v1/instances/{NS}/decode/other/{ID:x}"), instance.1.clone()),
        ("a card under another path", format!("v1/mdc/{NS}/x/y/{ID:x}"), card.1.clone()),
    ];
    for (what, key, value) in strays {
        let mut sim = Sim::new();
        sim.put(&card.0, &card.1);
        sim.put(&instance.0, &instance.1);
        let applied = sim.put(&key, &value);
        assert_eq!(applied.count(EventKind::Malformed), 1, "{what}: refused");
        assert_eq!(applied.count(EventKind::Duplicate), 0, "{what}: no contest");
        assert_eq!(worker_seen(&sim), Seen::Worker(Role::Decode, true), "{what}: the worker is untouched");
    }
}

/// A worker's keys hang on its own lease (its id): a record naming it on another lease is
/// another process's claim, refused as malformed, contesting nothing. Its own lease, or none,
/// is taken as written.
#[test]
fn a_record_on_another_workers_lease_is_malformed_and_contests_nothing() {
    let other_lease = ID + 1;
    let instance = (instance_key(NS, "decode", "generate", ID), endpoint_value("decode", "generate", json!(ID)));
    let card = (card_key(NS, "decode", ID), card_value("decode", json!(ID), card_json("decode")));
    for (what, (key, value)) in [("instance", instance.clone()), ("card", card.clone())] {
        let mut sim = Sim::new();
        sim.apply(super::WatchEvent::Put(super::kv(&card.0, &card.1).with_lease(ID)));
        sim.apply(super::WatchEvent::Put(super::kv(&instance.0, &instance.1).with_lease(ID)));
        assert_eq!(worker_seen(&sim), Seen::Worker(Role::Decode, true), "{what}: on its own lease");
        let stray = format!("{key}/copy");
        let applied = sim.apply(super::WatchEvent::Put(super::kv(&stray, &value).with_lease(other_lease)));
        assert_eq!(applied.count(EventKind::Malformed), 1, "{what}: refused");
        assert_eq!(worker_seen(&sim), Seen::Worker(Role::Decode, true), "{what}: the worker is untouched");
    }
}
