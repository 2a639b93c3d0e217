//! Identity is (namespace, instance id) with the namespace from the key; several namespaces
//! can be watched and pruned; resyncs replace state but keep `first_seen`.

use serde_json::json;

use super::super::{EventKind, Reducer, WatchEvent};
use super::{
    NS, Sim, card_json, card_key, card_value, channel_key, channel_value, counts, endpoint_value, instance_key, kv, t,
    zmq,
};

const ID: u64 = 0x6a6c_a228_814c_9742;
const PUBLISHER: u64 = 0x8a4ab3feb5855;

fn register_in(sim: &mut Sim, ns: &str, id: u64) {
    sim.put(card_key(ns, "prefill", id), &card_value("prefill", json!(id), card_json("prefill")));
    sim.put(instance_key(ns, "prefill", "generate", id), &endpoint_value("prefill", "generate", json!(id)));
    sim.put(
        channel_key(ns, "prefill", "kv_metrics", PUBLISHER),
        &channel_value("kv_metrics", PUBLISHER, zmq("tcp://h:1")),
    );
}

/// (namespace, id) of each worker and each publisher.
type Identities = (Vec<(String, u64)>, Vec<(String, u64)>);

fn identities(sim: &Sim) -> Identities {
    let fleet = sim.fleet();
    let workers =
        fleet.workers.iter().map(|w| (w.worker.key.namespace.to_string(), w.worker.key.instance_id)).collect();
    let publishers = fleet.publishers.iter().map(|p| (p.namespace.to_string(), p.publisher_id)).collect();
    (workers, publishers)
}

fn pair(ns: &str, id: u64) -> (String, u64) {
    (ns.to_owned(), id)
}

#[test]
fn one_instance_id_in_two_namespaces_is_two_workers() {
    let mut sim = Sim::watching(&["prod", "canary"]);
    register_in(&mut sim, "prod", ID);
    register_in(&mut sim, "canary", ID);
    let (workers, publishers) = identities(&sim);
    assert_eq!(workers, vec![pair("canary", ID), pair("prod", ID)]);
    assert_eq!(publishers, vec![pair("canary", PUBLISHER), pair("prod", PUBLISHER)]);
}

#[test]
fn the_namespace_comes_from_the_key_never_the_payload() {
    let mut sim = Sim::watching(&["prod"]);
    let mut value = endpoint_value("prefill", "generate", json!(ID));
    value["namespace"] = json!("canary");
    sim.put(instance_key("prod", "prefill", "generate", ID), &value);
    let skipped = sim.put(instance_key("canary", "prefill", "generate", ID + 1), &value);
    assert_eq!(counts(&skipped), vec![(EventKind::Skipped, 1)], "unwatched namespaces are skipped");
    assert_eq!(identities(&sim).0, vec![pair("prod", ID)]);
}

#[test]
fn percent_encoded_namespaces_match_their_watched_name() {
    let mut sim = Sim::watching(&["ns.one"]);
    register_in(&mut sim, "ns.one", ID);
    let key = channel_key("ns.one", "prefill", "kv_metrics", PUBLISHER);
    assert!(key.contains("/namespace/ns%2Eone/"), "{key}");
    assert_eq!(identities(&sim), (vec![pair("ns.one", ID)], vec![pair("ns.one", PUBLISHER)]));
}

#[test]
fn resync_replaces_state_and_keeps_first_seen_for_persisting_identities() {
    let card = |name: &str| {
        let mut card = card_json("prefill");
        card["display_name"] = json!(name);
        kv(card_key(NS, "prefill", ID), &card_value("prefill", json!(ID), card))
    };
    let instance =
        |id: u64| kv(instance_key(NS, "prefill", "generate", id), &endpoint_value("prefill", "generate", json!(id)));
    let mut sim = Sim::new();
    sim.apply(WatchEvent::Resync(vec![card("tiny"), instance(ID), instance(ID + 1)]));
    // (what, resync contents, worker times expected after it as (id, first_seen, last_updated), fleet changed)
    let cases = [
        ("unchanged", vec![card("tiny"), instance(ID), instance(ID + 1)], vec![(ID, 1, 1), (ID + 1, 1, 1)], false),
        (
            "a changed card bumps last_updated only",
            vec![card("tiny-2"), instance(ID), instance(ID + 1)],
            vec![(ID, 1, 3), (ID + 1, 1, 1)],
            true,
        ),
        ("missing identities go", vec![card("tiny-2"), instance(ID)], vec![(ID, 1, 3)], true),
        (
            "returning identities are new",
            vec![card("tiny-2"), instance(ID), instance(ID + 1)],
            vec![(ID, 1, 3), (ID + 1, 5, 5)],
            true,
        ),
        ("an empty resync clears everything", vec![], vec![], true),
    ];
    for (what, kvs, want, changed) in cases {
        let applied = sim.apply(WatchEvent::Resync(kvs));
        let times: Vec<_> =
            sim.fleet().workers.iter().map(|w| (w.worker.key.instance_id, w.first_seen, w.last_updated)).collect();
        let want: Vec<_> = want.into_iter().map(|(id, first, last)| (id, t(first), t(last))).collect();
        assert_eq!(times, want, "{what}");
        assert_eq!((applied.count(EventKind::Resync), applied.fleet_changed()), (1, changed), "{what}");
    }
}

/// A reload that replaces the watcher starts a new reducer: the workers its first resync finds
/// again keep when they were first seen; a worker that comes back later is new.
#[test]
fn a_successor_keeps_first_seen_for_the_workers_its_first_resync_finds_again() {
    let instance =
        |id: u64| kv(instance_key(NS, "prefill", "generate", id), &endpoint_value("prefill", "generate", json!(id)));
    let mut sim = Sim::new();
    sim.apply(WatchEvent::Resync(vec![instance(ID), instance(ID + 1)]));
    let previous = sim.fleet();
    let mut successor = Sim { reducer: Reducer::succeeding(vec![NS.to_owned()], &previous), clock: 5 };
    successor.apply(WatchEvent::Resync(vec![instance(ID), instance(ID + 2)]));
    successor.apply(WatchEvent::Put(instance(ID + 1)));
    let first_seen: Vec<_> =
        successor.fleet().workers.iter().map(|w| (w.worker.key.instance_id, w.first_seen)).collect();
    assert_eq!(first_seen, [(ID, t(1)), (ID + 1, t(7)), (ID + 2, t(6))]);
}
