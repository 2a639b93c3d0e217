//! The memory bounds on fleet-authored values, each hit exactly.

use continuum_proto::model::Role;
use serde_json::{Value, json};

use super::super::{
    EventKind, MAX_RECORD_BYTES, MAX_RECORDS_PER_KEYSPACE, MAX_RECORDS_PER_LEASE, MAX_RETAINED_CARD_BYTES,
    MAX_SET_ASIDE_PER_KEYSPACE, MAX_SMALL_RECORD_BYTES,
};
use super::{
    NS, Sim, card_json, card_key, card_value, channel_key, channel_value, counts, endpoint_value, instance_key, t, zmq,
};
use crate::discovery::{KeyValue, Listing, Reducer};

const ID: u64 = 0x6a6c_a228_814c_9742;

/// `value` with a `padding` string added at `pointer` so that it serialises to `bytes` exactly.
fn padded(mut value: Value, pointer: &str, bytes: usize) -> Vec<u8> {
    let base = {
        let mut probe = value.clone();
        if let Some(Value::Object(fields)) = probe.pointer_mut(pointer) {
            fields.insert("padding".into(), json!(""));
        }
        probe.to_string().len()
    };
    if let Some(Value::Object(fields)) = value.pointer_mut(pointer) {
        fields.insert("padding".into(), json!("x".repeat(bytes.saturating_sub(base))));
    }
    let out = value.to_string().into_bytes();
    assert_eq!(out.len(), bytes, "padding arithmetic");
    out
}

#[test]
fn records_above_their_keyspaces_bound_are_refused_unread_while_neighbours_apply() {
    let instance = |id: u64| instance_key(NS, "decode", "generate", id);
    let value = |id: u64| endpoint_value("decode", "generate", json!(id));
    // An instance record is a few hundred bytes: one past 64 KiB is junk, not held as text.
    let cases =
        [(MAX_SMALL_RECORD_BYTES + 1, EventKind::Oversized, false), (MAX_SMALL_RECORD_BYTES, EventKind::Put, true)];
    for (bytes, kind, kept) in cases {
        let mut sim = Sim::new();
        sim.put(instance(1), &value(1));
        sim.put(instance(2), &value(2));
        let applied = sim.put_raw(instance(2), padded(value(2), "", bytes));
        assert_eq!(counts(&applied), vec![(kind, 1)], "{bytes} bytes");
        sim.put(instance(3), &value(3));
        let want: Vec<u64> = if kept { vec![1, 2, 3] } else { vec![1, 3] };
        assert_eq!(sim.worker_ids(), want, "{bytes} bytes: the oversized value also drops what its key held");
    }
}

#[test]
fn model_cards_may_be_large_up_to_max_record_bytes() {
    let key = card_key(NS, "prefill", ID);
    let value = card_value("prefill", json!(ID), card_json("prefill"));
    for (bytes, kind) in [(MAX_RECORD_BYTES + 1, EventKind::Oversized), (MAX_RECORD_BYTES, EventKind::Put)] {
        let mut sim = Sim::new();
        let applied = sim.put_raw(key.clone(), padded(value.clone(), "", bytes));
        assert_eq!(counts(&applied), vec![(kind, 1)], "{bytes} bytes");
    }
}

#[test]
fn a_record_set_aside_keeps_an_excerpt_of_what_it_said_not_the_value() {
    use super::super::keys::classify;
    use super::super::records::{Parsed, parse};
    let namespaces = [std::sync::Arc::from(NS)];
    let key = instance_key(NS, "decode", "generate", 1);
    let key = classify(&namespaces, key.as_bytes()).ok().flatten().expect("an instance key");
    // serde quotes the value it refuses; the held record keeps a line of it.
    let wrong_type = json!({"type": "A".repeat(60_000), "instance_id": 1});
    let wrong_field = json!({"instance_id": "B".repeat(60_000)});
    for value in [wrong_type, wrong_field] {
        let Parsed::Malformed(error) = parse(&key, value.to_string().as_bytes(), None) else { panic!("malformed") };
        assert!(error.to_string().len() < 400, "{} bytes kept", error.to_string().len());
    }
}

#[test]
fn a_card_that_does_not_parse_keeps_an_excerpt_of_why() {
    let card = json!({"kv_cache_block_size": "C".repeat(60_000)});
    let parsed = super::super::card::Card::parse(card);
    let error = parsed.typed_error.expect("a refused field");
    assert!(error.contains("kv_cache_block_size") || error.contains("invalid type"), "{error}");
    assert!(error.len() < 400, "{} bytes kept", error.len());
}

#[test]
fn cards_above_max_retained_card_bytes_drop_the_blob_but_keep_typed_fields() -> anyhow::Result<()> {
    let card_of = |bytes: usize| serde_json::from_slice::<Value>(&padded(card_json("prefill"), "", bytes));
    let outside = padded(card_value("prefill", json!(ID), card_json("prefill")), "", MAX_RETAINED_CARD_BYTES + 200);
    // (what, Model record, raw card kept)
    let cases = [
        (
            "card one byte over",
            card_value("prefill", json!(ID), card_of(MAX_RETAINED_CARD_BYTES + 1)?).to_string().into_bytes(),
            false,
        ),
        (
            "card exactly at the bound",
            card_value("prefill", json!(ID), card_of(MAX_RETAINED_CARD_BYTES)?).to_string().into_bytes(),
            true,
        ),
        ("record over, card small", outside, true),
    ];
    for (what, record, kept) in cases {
        let mut sim = Sim::new();
        let applied = sim.put_raw(card_key(NS, "prefill", ID), record);
        sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
        assert_eq!(counts(&applied), vec![(EventKind::Put, 1)], "{what}");
        let worker = sim.worker(ID);
        let typed = worker
            .as_ref()
            .map(|w| (w.worker.role, w.worker.model.as_str(), w.worker.block_size, w.worker.capacity.total_kv_blocks));
        assert_eq!(typed, Some((Role::Prefill, "tiny", Some(16), Some(1024))), "{what}: typed fields");
        assert_eq!(worker.and_then(|w| w.card).is_some(), kept, "{what}: raw card");
    }
    Ok(())
}

#[test]
fn opaque_cards_share_one_byte_budget_and_the_first_held_keep_their_room() {
    let card_bytes = card_json("decode").to_string().len();
    let mut sim = Sim::new();
    sim.reducer = Reducer::new(vec![NS.into()]).with_card_budget(2 * card_bytes);
    for id in 1..=3 {
        sim.register("decode", id, "decode");
    }
    let kept = |sim: &Sim| -> Vec<(u64, bool)> {
        sim.fleet().workers.iter().map(|w| (w.worker.key.instance_id, w.card.is_some())).collect()
    };
    let typed = |sim: &Sim| {
        sim.fleet().workers.iter().all(|w| w.worker.role == Role::Decode && w.worker.block_size == Some(16))
    };
    assert_eq!(kept(&sim), [(1, true), (2, true), (3, false)], "the third card is over the budget");
    assert!(typed(&sim), "every worker keeps its typed fields");

    // A card re-written in place fits where it fitted; the one left out stays out.
    sim.put(card_key(NS, "decode", 2), &card_value("decode", json!(2), card_json("decode")));
    sim.put(card_key(NS, "decode", 3), &card_value("decode", json!(3), card_json("decode")));
    assert_eq!(kept(&sim), [(1, true), (2, true), (3, false)]);

    // A resync keeps the cards held before it; a departed worker's room goes to the next card.
    let listing: Vec<KeyValue> = (1..=3)
        .flat_map(|id| {
            [
                super::kv(card_key(NS, "decode", id), &card_value("decode", json!(id), card_json("decode"))),
                super::kv(instance_key(NS, "decode", "generate", id), &endpoint_value("decode", "generate", json!(id))),
            ]
        })
        .collect();
    sim.apply(crate::discovery::WatchEvent::Resync(listing));
    assert_eq!(kept(&sim), [(1, true), (2, true), (3, false)], "after a resync");
    sim.delete(card_key(NS, "decode", 1));
    sim.put(card_key(NS, "decode", 3), &card_value("decode", json!(3), card_json("decode")));
    assert_eq!(kept(&sim), [(1, false), (2, true), (3, true)]);
}

/// A relist holds no more card text than the cards' budget for the keys held and as much for
/// new ones, whatever etcd holds: the text of cards past it is let go as they are listed (the
/// resync would drop it anyway), not held until the listing ends.
#[test]
fn a_listing_holds_card_text_within_the_budget() {
    let card_bytes = card_json("decode").to_string().len();
    let mut sim = Sim::new();
    sim.reducer = Reducer::new(vec![NS.into()]).with_card_budget(2 * card_bytes);
    for id in 1..=2 {
        sim.register("decode", id, "decode");
    }
    let card = |id: u64| super::kv(card_key(NS, "decode", id), &card_value("decode", json!(id), card_json("decode")));
    let mut listing = Listing::default();
    for id in (3..=100).chain(1..=2) {
        sim.reducer.list(&mut listing, card(id));
    }
    for id in 1..=2 {
        let instance = endpoint_value("decode", "generate", json!(id));
        sim.reducer.list(&mut listing, super::kv(instance_key(NS, "decode", "generate", id), &instance));
    }
    assert_eq!(listing.len(), 102, "every card is listed, and the instances");
    let held = listing.card_text_bytes();
    assert!(held <= 4 * card_bytes, "{held} bytes of card text held, against a budget of {}", 2 * card_bytes);
    let (_, logged) = crate::test_logs::captured(|| sim.reducer.resync(listing, t(100)));
    assert_eq!(crate::test_logs::warnings(&logged), 1, "the budget is warned of: {logged}");
    let kept: Vec<u64> =
        sim.fleet().workers.iter().filter(|w| w.card.is_some()).map(|w| w.worker.key.instance_id).collect();
    assert_eq!(kept, [1, 2], "the held keep their cards");
}

#[test]
fn endpoints_the_router_does_not_read_take_no_room() {
    let mut sim = Sim::new();
    // Each worker also registers a `worker_kv_query_source_0` instance, as Dynamo 1.6.1's do.
    for id in 1..=MAX_RECORDS_PER_KEYSPACE as u64 {
        let skipped = sim.put(
            instance_key(NS, "decode", "worker_kv_query_source_0", id),
            &endpoint_value("decode", "worker_kv_query_source_0", json!(id)),
        );
        assert_eq!(counts(&skipped), vec![(EventKind::Skipped, 1)]);
    }
    let id = MAX_RECORDS_PER_KEYSPACE as u64 + 1;
    let applied = sim.put(instance_key(NS, "decode", "generate", id), &endpoint_value("decode", "generate", json!(id)));
    assert_eq!(counts(&applied), vec![(EventKind::Put, 1)], "the keyspace holds none of them");
    assert_eq!(sim.worker_ids(), vec![id]);
}

#[test]
fn a_full_keyspace_refuses_new_keys_but_updates_held_ones() {
    let mut sim = Sim::new();
    let key = |id: u64| instance_key(NS, "decode", "generate", id);
    let value = |id: u64| endpoint_value("decode", "generate", json!(id));
    for id in 1..=MAX_RECORDS_PER_KEYSPACE as u64 {
        sim.put(key(id), &value(id));
    }
    let full = MAX_RECORDS_PER_KEYSPACE as u64;
    let refused = sim.put(key(full + 1), &value(full + 1));
    assert_eq!(counts(&refused), vec![(EventKind::OverCapacity, 1)]);
    assert_eq!(sim.fleet().workers.len(), MAX_RECORDS_PER_KEYSPACE);

    let mut changed = value(7);
    changed["transport"] = json!({"tcp": "another"});
    let updated = sim.put(key(7), &changed);
    assert_eq!(counts(&updated), vec![(EventKind::Put, 1)], "held keys still update");
    assert!(sim.worker(7).is_some());

    let other_keyspace = sim.put(card_key(NS, "decode", 7), &card_value("decode", json!(7), card_json("decode")));
    assert_eq!(counts(&other_keyspace), vec![(EventKind::Put, 1)], "each keyspace has its own bound");

    assert!(!updated.relist_wanted() && !refused.relist_wanted());
    let freed = sim.delete(key(1));
    assert!(freed.relist_wanted(), "Dynamo writes a key once: what was refused comes back only by listing again");
    let admitted = sim.put(key(full + 1), &value(full + 1));
    assert_eq!(counts(&admitted), vec![(EventKind::Put, 1)], "a deleted key frees room");
    assert!(sim.worker(full + 1).is_some());
    assert!(!sim.delete(key(2)).relist_wanted(), "nothing was refused since");

    // Full again, then a held key replaced by a value that is no record (an endpoint its key
    // does not name): set aside, it gives its room back as a delete does.
    assert_eq!(counts(&sim.put(key(full + 2), &value(full + 2))), vec![(EventKind::Put, 1)]);
    assert_eq!(counts(&sim.put(key(full + 3), &value(full + 3))), vec![(EventKind::OverCapacity, 1)]);
    let replaced = sim.put(key(3), &endpoint_value("decode", "clear_kv_blocks", json!(3)));
    assert_eq!(counts(&replaced), vec![(EventKind::Malformed, 1)]);
    assert!(replaced.relist_wanted(), "its room is free again");

    // Full and refusing again: a set-aside value took no room, so neither its delete nor its
    // replacement frees any, and neither asks for a relist of the whole keyspace.
    assert_eq!(counts(&sim.put(key(full + 3), &value(full + 3))), vec![(EventKind::Put, 1)]);
    assert_eq!(counts(&sim.put(key(full + 4), &value(full + 4))), vec![(EventKind::OverCapacity, 1)]);
    assert!(!sim.delete(key(3)).relist_wanted(), "the set-aside value took no room");
    let junk = key(full + 5);
    assert_eq!(
        counts(&sim.put(junk.clone(), &endpoint_value("decode", "clear_kv_blocks", json!(full + 5)))),
        vec![(EventKind::Malformed, 1)]
    );
    assert!(!sim.put_raw(junk.clone(), vec![b'x'; MAX_SMALL_RECORD_BYTES + 1]).relist_wanted(), "replaced unread");
    assert_eq!(
        counts(&sim.put(junk.clone(), &endpoint_value("decode", "clear_kv_blocks", json!(full + 5)))),
        vec![(EventKind::Malformed, 1)]
    );
    assert!(!sim.delete(junk).relist_wanted());
    assert!(sim.delete(key(4)).relist_wanted(), "a record's delete still does");
}

/// One process writing records by the thousand under its lease (event channels of made-up
/// publisher ids, each a valid record) takes no more than its lease's share of the keyspace:
/// its keys past it are refused, its held keys still update, and every other process still
/// registers; a resync refuses the same keys. Keys with no lease are bounded by the keyspace
/// alone.
#[test]
fn one_lease_holds_no_more_than_its_share_of_a_keyspace() {
    let channel = |publisher: u64| {
        let value = channel_value("kv_metrics", publisher, zmq("tcp://10.0.0.7:41000"));
        super::kv(channel_key(NS, "backend", "kv_metrics", publisher), &value)
    };
    let share = MAX_RECORDS_PER_LEASE as u64;
    let mut sim = Sim::new();
    for publisher in 1..=share {
        let applied = sim.apply(super::WatchEvent::Put(channel(publisher).with_lease(ID)));
        assert_eq!(counts(&applied), vec![(EventKind::Put, 1)], "{publisher}: within the share");
    }
    let refused = sim.apply(super::WatchEvent::Put(channel(share + 1).with_lease(ID)));
    assert_eq!(counts(&refused), vec![(EventKind::OverCapacity, 1)], "past the lease's share");
    assert!(!refused.relist_wanted());
    let again = sim.apply(super::WatchEvent::Put(channel(1).with_lease(ID)));
    assert_eq!(counts(&again), vec![(EventKind::Put, 1)], "a held key still updates");
    let other = sim.apply(super::WatchEvent::Put(channel(10 * share).with_lease(ID + 1)));
    assert_eq!(counts(&other), vec![(EventKind::Put, 1)], "another process registers");
    sim.delete(channel_key(NS, "backend", "kv_metrics", 1));
    let room = sim.apply(super::WatchEvent::Put(channel(share + 1).with_lease(ID)));
    assert_eq!(counts(&room), vec![(EventKind::Put, 1)], "its own delete gave it room");

    // A resync listing more of the lease's keys than its share keeps the share, held keys
    // first, wherever they are listed.
    let relisted: Vec<KeyValue> = (1..=share + 10).rev().map(|p| channel(p).with_lease(ID)).collect();
    let applied = sim.apply(super::WatchEvent::Resync(relisted));
    assert_eq!(applied.count(EventKind::OverCapacity), 10);
    let kept: Vec<u64> =
        (1..=share + 10).filter(|p| sim.reducer.holds(&channel_key(NS, "backend", "kv_metrics", *p))).collect();
    assert_eq!(kept, (2..=share + 1).collect::<Vec<_>>(), "the keys it held are the ones it keeps");

    // Without a lease, only the keyspace bounds them.
    let mut sim = Sim::new();
    for publisher in 1..=share + 1 {
        let put = sim.apply(super::WatchEvent::Put(channel(publisher)));
        assert_eq!(counts(&put), vec![(EventKind::Put, 1)], "{publisher}");
    }
}

#[test]
fn a_resync_larger_than_the_keyspace_keeps_the_first_keys() {
    let mut sim = Sim::new();
    let kvs: Vec<_> = (1..=MAX_RECORDS_PER_KEYSPACE as u64 + 2)
        .map(|id| {
            super::kv(instance_key(NS, "decode", "generate", id), &endpoint_value("decode", "generate", json!(id)))
        })
        .collect();
    let applied = sim.apply(super::WatchEvent::Resync(kvs));
    assert_eq!(applied.count(EventKind::OverCapacity), 2);
    assert_eq!(sim.fleet().workers.len(), MAX_RECORDS_PER_KEYSPACE);
}

#[test]
fn a_resync_of_a_full_keyspace_keeps_the_keys_held_and_stays_within_the_bound() {
    let mut sim = Sim::new();
    let full = MAX_RECORDS_PER_KEYSPACE as u64;
    let kv = |id: u64| {
        super::kv(instance_key(NS, "decode", "generate", id), &endpoint_value("decode", "generate", json!(id)))
    };
    let held: Vec<_> = (1..=full).map(kv).collect();
    sim.apply(super::WatchEvent::Resync(held));
    // The resync after a reconnect lists keys the store has never held before the ones it holds,
    // as a second namespace sorted first would.
    let newcomers = (full + 1..=full + 100).map(kv);
    let relisted = newcomers.chain((1..=full).map(kv)).collect();
    let applied = sim.apply(super::WatchEvent::Resync(relisted));
    assert_eq!(applied.count(EventKind::OverCapacity), 100, "the newcomers are refused");
    assert_eq!(sim.fleet().workers.len(), MAX_RECORDS_PER_KEYSPACE, "the bound holds across the resync");
    assert!(sim.worker(1).is_some() && sim.worker(full).is_some(), "the workers held are kept");
    assert!(sim.worker(full + 1).is_none());
}

/// Values that are no record (malformed, or of a kind the router cannot use) are held only to
/// log their refusal once: a keyspace full of them still takes every real worker, they have a
/// bound of their own, and a key that held one needs room like any new key once it holds a
/// record.
#[test]
fn junk_takes_no_room_from_records_and_has_a_bound_of_its_own() {
    let mut sim = Sim::new();
    let key = |id: u64| instance_key(NS, "decode", "generate", id);
    let value = |id: u64| endpoint_value("decode", "generate", json!(id));
    let junk = |id: u64| json!({"type": "Endpoint", "instance_id": id, "endpoint": ["not", "a", "name"]});
    for id in 1..=MAX_RECORDS_PER_KEYSPACE as u64 {
        let refused = sim.put(key(id), &junk(id));
        assert_eq!(counts(&refused), vec![(EventKind::Malformed, 1)], "{id}");
    }
    let id = MAX_RECORDS_PER_KEYSPACE as u64 + 1;
    assert_eq!(counts(&sim.put(key(id), &value(id))), vec![(EventKind::Put, 1)], "a real worker after all that junk");
    assert_eq!(sim.worker_ids(), vec![id]);
    let bound = MAX_SET_ASIDE_PER_KEYSPACE as u64;
    assert!(sim.reducer.holds(&key(bound)) && !sim.reducer.holds(&key(bound + 1)), "junk has its own bound");

    // Records fill the keyspace; a key set aside must find room when it turns into a record.
    for id in 100_001..100_000 + MAX_RECORDS_PER_KEYSPACE as u64 {
        sim.put(key(id), &value(id));
    }
    assert_eq!(sim.fleet().workers.len(), MAX_RECORDS_PER_KEYSPACE);
    let set_aside = 2;
    assert!((set_aside as usize) <= MAX_SET_ASIDE_PER_KEYSPACE);
    let refused = sim.put(key(set_aside), &value(set_aside));
    assert_eq!(counts(&refused), vec![(EventKind::OverCapacity, 1)], "held as junk, it held no room");
    assert_eq!(sim.fleet().workers.len(), MAX_RECORDS_PER_KEYSPACE);
}

/// A relist read page by page holds what a resync can use, whatever etcd holds: every key
/// held, and no more new keys than each keyspace has room for; junk refused whatever the room
/// (skipped endpoints, values too large to read) is counted and let go as it is listed.
#[test]
fn a_listing_holds_no_more_than_the_keyspaces_have_room_for() {
    let mut sim = Sim::new();
    let full = MAX_RECORDS_PER_KEYSPACE as u64;
    let key = |id: u64| instance_key(NS, "decode", "generate", id);
    let record = |id: u64| super::kv(key(id), &endpoint_value("decode", "generate", json!(id)));
    sim.apply(super::WatchEvent::Resync((1..=10).map(record).collect()));

    let mut listing = Listing::default();
    for id in 100..100 + full + 50 {
        sim.reducer.list(&mut listing, record(id));
    }
    for id in 1..=10 {
        sim.reducer.list(&mut listing, record(id));
    }
    let set_aside = MAX_SET_ASIDE_PER_KEYSPACE as u64;
    for id in 0..set_aside + 5 {
        let junk = endpoint_value("decode", "clear_kv_blocks", json!(1_000_000 + id));
        sim.reducer.list(&mut listing, super::kv(key(1_000_000 + id), &junk));
    }
    for id in 0..100 {
        let skipped = endpoint_value("decode", "worker_kv_query_source_0", json!(2_000_000 + id));
        sim.reducer.list(
            &mut listing,
            super::kv(instance_key(NS, "decode", "worker_kv_query_source_0", 2_000_000 + id), &skipped),
        );
        let oversized = KeyValue::new(key(3_000_000 + id), vec![b' '; MAX_SMALL_RECORD_BYTES + 1]);
        sim.reducer.list(&mut listing, oversized);
    }
    assert_eq!(
        listing.len() as u64,
        full + 10 + set_aside,
        "the new records that fit, the held ones, the set-aside room"
    );

    let applied = sim.reducer.resync(listing, t(100));
    // 50 left out while listing, 10 more at admission: the held keys took their room first.
    assert_eq!(applied.count(EventKind::OverCapacity), 60);
    assert_eq!(applied.count(EventKind::Malformed), set_aside + 5);
    assert_eq!((applied.count(EventKind::Skipped), applied.count(EventKind::Oversized)), (100, 100));
    assert_eq!(sim.fleet().workers.len() as u64, full);
    assert!((1..=10).all(|id| sim.worker(id).is_some()), "the held keys are kept");
    assert!(sim.delete(key(1)).relist_wanted(), "keys were refused: room freed asks for a relist");
}

/// A key longer than any Dynamo key is refused before it is held.
#[test]
fn a_key_past_the_bound_is_refused_unread() {
    let mut sim = Sim::new();
    let long = instance_key(NS, "decode", &"e".repeat(super::super::keys::MAX_KEY_BYTES), 7);
    let applied = sim.put(long.clone(), &endpoint_value("decode", "generate", json!(7)));
    assert_eq!(counts(&applied), vec![(EventKind::Malformed, 1)]);
    assert!(!sim.reducer.holds(&long));
}

/// A key under a watched prefix that is no Dynamo discovery key is counted as malformed each
/// time it is written, deleted or listed, and warned of at most once a minute: nothing about it
/// changes by its coming again, and a writer repeating it would otherwise flood the log.
#[test]
fn stray_keys_are_counted_each_time_and_warned_of_once_a_minute() {
    use crate::test_logs::{captured, warnings};
    let stray = "v1/event_channels/namespace/dynamo/odd/shape";
    let mut sim = Sim::new();
    let (counted, text) = captured(|| {
        let mut counted = Vec::new();
        // The clock ticks a second an event: ten puts and a delete, then a minute's events.
        for _ in 0..10 {
            counted.push(counts(&sim.put(stray, &json!({}))));
        }
        counted.push(counts(&sim.delete(stray)));
        for id in 0..60 {
            sim.put(instance_key(NS, "decode", "generate", id), &endpoint_value("decode", "generate", json!(id)));
        }
        counted.push(counts(&sim.put(stray, &json!({}))));
        counted
    });
    assert!(counted.iter().all(|c| c == &vec![(EventKind::Malformed, 1)]), "{counted:?}");
    assert_eq!(warnings(&text), 2, "once, and again a minute later:\n{text}");
    assert!(text.contains("strays=11"), "the second says how many came since the first:\n{text}");
}

/// Records a writer turns to junk take the set-aside room like new junk does: only a key
/// already set aside keeps its place past the bound, so a writer cannot hold more and more
/// junk by writing records and then spoiling them, round after round.
#[test]
fn records_turned_to_junk_stay_within_the_set_aside_bound() {
    let mut sim = Sim::new();
    let key = |id| instance_key(NS, "decode", "generate", id);
    let over = MAX_SET_ASIDE_PER_KEYSPACE as u64 + 5;
    for id in 1..=over {
        sim.put(key(id), &endpoint_value("decode", "generate", json!(id)));
    }
    let mut refused = 0;
    for id in 1..=over {
        refused += sim.put_raw(key(id), "not json").count(EventKind::Malformed);
    }
    let held = (1..=over).filter(|id| sim.reducer.holds(&key(*id))).count();
    assert_eq!(held, MAX_SET_ASIDE_PER_KEYSPACE, "at most the bound is held");
    assert_eq!(refused, over, "every spoiled record is counted");
    assert!(sim.fleet().workers.is_empty(), "and none is a worker any more");
    // One already set aside is still replaced in its place.
    sim.put_raw(key(1), "still not json");
    assert!(sim.reducer.holds(&key(1)));
}

/// A card's component and endpoint are kept with it and again as its identity: under a key
/// that names neither (a legacy card's), a name longer than any is malformed, not held.
#[test]
fn a_record_naming_a_component_longer_than_any_name_is_malformed() {
    use super::super::MAX_NAME_BYTES;
    use super::super::keys::classify;
    use super::super::records::{Parsed, RecordError, parse};
    let namespaces = [std::sync::Arc::from(NS)];
    let legacy = classify(&namespaces, format!("v1/mdc/{NS}/tiny").as_bytes()).ok().flatten().expect("a card key");
    let long = "a".repeat(MAX_NAME_BYTES + 1);
    let cases = [
        (&legacy, card_value(&long, json!(ID), card_json("prefill")), "component"),
        (&legacy, json!({"type": "Model", "component": "c", "endpoint": long, "instance_id": ID}), "endpoint"),
    ];
    for (key, value, field) in cases {
        let parsed = parse(key, value.to_string().as_bytes(), None);
        let Parsed::Malformed(RecordError::NameTooLong { field: named, len, .. }) = parsed else {
            panic!("{field}: not refused for its length")
        };
        assert_eq!((named, len), (field, MAX_NAME_BYTES + 1));
    }
    let longest = "a".repeat(MAX_NAME_BYTES);
    let fits = parse(&legacy, card_value(&longest, json!(ID), card_json("prefill")).to_string().as_bytes(), None);
    assert!(matches!(fits, Parsed::Model(_)), "a name at the bound is read");
    let instance = instance_key(NS, &long, "generate", ID);
    let instance = classify(&namespaces, instance.as_bytes()).ok().flatten().expect("an instance key");
    let value = endpoint_value(&long, "generate", json!(ID));
    let parsed = parse(&instance, value.to_string().as_bytes(), None);
    let Parsed::Malformed(RecordError::NameTooLong { field: "component", len, .. }) = parsed else {
        panic!("an instance naming a long component: not refused for its length")
    };
    assert_eq!(len, MAX_NAME_BYTES + 1, "instances too");
}
