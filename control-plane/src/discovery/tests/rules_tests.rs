//! The rules that decide what becomes a worker and how its records join.

use continuum_proto::model::{Capacity, Role};
use serde_json::{Value, json};

use super::super::{EventKind, Exclusion};
use super::{NS, Sim, card_json, card_key, card_value, counts, endpoint_value, instance_key, kv, role_of, t};

const ID: u64 = 0x6a6c_a228_814c_9742;

#[test]
fn component_and_card_decide_the_role_together() {
    use Role::*;
    let disagree = |component, card| Some(Exclusion::RoleDisagreement { component, card });
    // (component, card worker_type or no card, role, exclusion)
    let cases: &[(&str, Option<&str>, Role, Option<Exclusion>)] = &[
        ("prefill", None, Prefill, None),
        ("decode", None, Decode, None),
        ("backend", None, Unknown, None),
        ("backend", Some("decode"), Decode, None),
        ("backend", Some("Prefill"), Prefill, None),
        ("backend", Some("aggregated"), Aggregated, None),
        ("prefill", Some("prefill"), Prefill, None),
        ("decode", Some("DECODE"), Decode, None),
        ("prefill", Some("decode"), Unknown, disagree(Prefill, Decode)),
        ("decode", Some("Prefill"), Unknown, disagree(Decode, Prefill)),
        ("prefill", Some("aggregated"), Unknown, disagree(Prefill, Aggregated)),
        ("decode", Some("encoder"), Decode, None),
        ("backend", Some("encoder"), Unknown, None),
    ];
    for &(component, worker_type, role, excluded) in cases {
        let mut sim = Sim::new();
        if let Some(worker_type) = worker_type {
            sim.put(card_key(NS, component, ID), &card_value(component, json!(ID), card_json(worker_type)));
        }
        sim.put(instance_key(NS, component, "generate", ID), &endpoint_value(component, "generate", json!(ID)));
        let worker = sim.worker(ID);
        let got = worker.as_ref().map(|w| (role_of(w), w.excluded));
        assert_eq!(got, Some((role, excluded)), "{component} + {worker_type:?}");
        let routable = sim.fleet().routable().count();
        assert_eq!(routable, usize::from(role != Unknown), "{component} + {worker_type:?}: routable");
    }
}

#[test]
fn only_generate_endpoints_become_workers() {
    let cases = [
        ("generate", Some(ID), EventKind::Put),
        ("load_metrics", None, EventKind::Skipped),
        ("clear_kv_blocks", None, EventKind::Skipped),
        ("worker_kv_query_source_1ee80a9960e440", None, EventKind::Skipped),
    ];
    for (endpoint, want, kind) in cases {
        let mut sim = Sim::new();
        let applied =
            sim.put(instance_key(NS, "prefill", endpoint, ID), &endpoint_value("prefill", endpoint, json!(ID)));
        assert_eq!(counts(&applied), vec![(kind, 1)], "{endpoint}");
        assert_eq!(sim.worker_ids().first().copied(), want, "{endpoint}");
    }
}

#[test]
fn hex_and_decimal_instance_ids_join_as_one_worker() {
    let hex = json!(format!("{ID:x}"));
    let cases = [(json!(ID), hex.clone()), (hex.clone(), json!(ID)), (hex.clone(), hex)];
    for (instance_id, card_id) in cases {
        let mut sim = Sim::new();
        sim.put(card_key(NS, "prefill", ID), &card_value("prefill", card_id.clone(), card_json("prefill")));
        sim.put(
            instance_key(NS, "prefill", "generate", ID),
            &endpoint_value("prefill", "generate", instance_id.clone()),
        );
        let worker = sim.worker(ID);
        assert_eq!(
            worker.map(|w| (w.worker.model, w.card.is_some())),
            Some(("tiny".into(), true)),
            "{instance_id} + {card_id}"
        );
    }
}

#[test]
fn ids_above_2_pow_53_stay_exact() {
    for id in [(1u64 << 53) + 1, 7_668_682_560_356_783_953, u64::MAX] {
        let mut sim = Sim::new();
        sim.register("prefill", id, "prefill");
        assert_eq!(sim.worker_ids(), vec![id], "{id}");
    }
}

fn legacy_card(id: u64, name: &str) -> serde_json::Value {
    json!({"type": "Model", "namespace": NS, "component": "", "endpoint": "", "instance_id": id,
           "card_json": {"display_name": name, "worker_type": "prefill"}})
}

#[test]
fn legacy_card_joins_on_instance_id_and_a_scoped_card_wins() {
    let mut sim = Sim::new();
    sim.put(format!("v1/mdc/{NS}/legacy-{ID:x}"), &legacy_card(ID, "legacy"));
    sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
    let model = |sim: &Sim| sim.worker(ID).map(|w| w.worker.model);
    assert_eq!(model(&sim).as_deref(), Some("legacy"));
    let scoped = card_key(NS, "prefill", ID);
    let applied = sim.put(&scoped, &card_value("prefill", json!(ID), card_json("prefill")));
    assert_eq!(applied.count(EventKind::Duplicate), 0, "a legacy and a scoped card do not conflict");
    assert_eq!(model(&sim).as_deref(), Some("tiny"));
    sim.delete(scoped);
    assert_eq!(model(&sim).as_deref(), Some("legacy"));
}

/// A card naming one of its component and endpoint (every field is optional across the N-2
/// window) takes the other from its key, as an instance record does, and joins its worker.
#[test]
fn a_card_naming_half_its_scope_takes_the_rest_from_its_key() {
    for missing in ["endpoint", "component"] {
        let mut sim = Sim::new();
        let mut card = card_value("prefill", json!(ID), card_json("prefill"));
        card.as_object_mut().expect("an object").remove(missing);
        sim.put(card_key(NS, "prefill", ID), &card);
        sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
        let model = sim.worker(ID).map(|w| w.worker.model);
        assert_eq!(model.as_deref(), Some("tiny"), "{missing} missing: the card joins");
    }
}

#[test]
fn scoped_card_for_another_component_does_not_join() {
    let mut sim = Sim::new();
    sim.put(card_key(NS, "decode", ID), &card_value("decode", json!(ID), card_json("decode")));
    sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
    let worker = sim.worker(ID);
    assert_eq!(worker.map(|w| (w.worker.role, w.card.is_some())), Some((Role::Prefill, false)));
}

#[test]
fn adapter_cards_with_a_model_suffix_never_join() {
    let mut top_level = card_value("prefill", json!(ID), json!({"display_name": "lora-a", "worker_type": "decode"}));
    top_level["model_suffix"] = json!("lora-a");
    let in_card = card_value("prefill", json!(ID), json!({"display_name": "lora-b", "model_suffix": "lora-b"}));
    let mut empty_suffix = card_value("prefill", json!(ID), card_json("prefill"));
    empty_suffix["model_suffix"] = json!("");
    let cases = [
        (top_level, EventKind::Skipped, false),
        (in_card, EventKind::Skipped, false),
        (empty_suffix, EventKind::Put, true),
    ];
    for (value, kind, joins) in cases {
        let mut sim = Sim::new();
        let applied = sim.put(format!("{}/suffix", card_key(NS, "prefill", ID)), &value);
        sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
        assert_eq!(counts(&applied), vec![(kind, 1)], "{value}");
        let worker = sim.worker(ID).map(|w| (w.worker.role, w.card.is_some()));
        assert_eq!(worker, Some((Role::Prefill, joins)), "{value}");
    }
}

#[test]
fn a_card_with_an_unreadable_field_keeps_its_other_fields_the_raw_card_and_the_worker() {
    let card = json!({"display_name": "tiny", "worker_type": "prefill", "kv_cache_block_size": "sixteen"});
    let mut sim = Sim::new();
    sim.put(card_key(NS, "prefill", ID), &card_value("prefill", json!(ID), card.clone()));
    sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
    let worker = sim.worker(ID);
    let got = worker.map(|w| (w.worker.role, w.worker.model, w.worker.block_size, w.excluded, w.card));
    assert_eq!(got, Some((Role::Prefill, "tiny".into(), None, None, Some(std::sync::Arc::from(card.to_string())))));
}

#[test]
fn unknown_fields_are_ignored_everywhere() {
    let mut endpoint = endpoint_value("backend", "generate", json!(ID));
    endpoint["future_field"] = json!({"nested": [1, 2, 3]});
    let mut card = card_json("Decode");
    card["future_card_field"] = json!(true);
    card["runtime_config"]["future_knob"] = json!("x");
    card["runtime_config"]["disaggregated_endpoint"] = json!("dynamo/prefill/generate");
    let mut model = card_value("backend", json!(ID), card);
    model["future_model_field"] = json!(null);
    let mut sim = Sim::new();
    assert_eq!(counts(&sim.put(card_key(NS, "backend", ID), &model)), vec![(EventKind::Put, 1)]);
    assert_eq!(counts(&sim.put(instance_key(NS, "backend", "generate", ID), &endpoint)), vec![(EventKind::Put, 1)]);
    let worker = sim.worker(ID).map(|w| (w.worker.role, w.worker.disaggregated_endpoint));
    assert_eq!(worker, Some((Role::Decode, Some("dynamo/prefill/generate".into()))));
}

#[test]
fn card_fields_fill_the_worker() {
    let card = json!({
        "display_name": "Qwen/Qwen3-32B", "worker_type": "decode", "kv_cache_block_size": 64,
        "runtime_config": {"total_kv_blocks": 12000, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
                           "context_length": 32768, "data_parallel_start_rank": 2, "data_parallel_size": 4,
                           "disaggregated_endpoint": "dynamo/prefill/generate"}
    });
    let mut sim = Sim::new();
    sim.put(card_key(NS, "decode", ID), &card_value("decode", json!(ID), card));
    sim.put(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID)));
    let worker = sim.worker(ID).map(|w| w.worker);
    let want = Capacity {
        total_kv_blocks: Some(12000),
        max_num_batched_tokens: Some(8192),
        max_num_seqs: Some(256),
        context_length: Some(32768),
    };
    let got = worker
        .map(|w| (w.dp_ranks().collect::<Vec<_>>(), w.model, w.block_size, w.capacity, w.dp_start_rank, w.dp_size));
    assert_eq!(got, Some((vec![2, 3, 4, 5], "Qwen/Qwen3-32B".into(), Some(64), want, 2, 4)));
}

/// The model is the card's `display_name`, then its `name` (the seed's order).
#[test]
fn the_model_is_the_cards_display_name_then_its_name() {
    for (card, model) in [
        (json!({"display_name": "shown", "name": "named", "worker_type": "decode"}), "shown"),
        (json!({"name": "named", "worker_type": "decode"}), "named"),
        (json!({"worker_type": "decode"}), ""),
    ] {
        let mut sim = Sim::new();
        sim.put(card_key(NS, "decode", ID), &card_value("decode", json!(ID), card));
        sim.put(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID)));
        assert_eq!(sim.worker(ID).map(|w| w.worker.model), Some(model.to_string()));
    }
}

#[test]
fn a_cardless_worker_declares_no_data_parallelism() {
    let mut sim = Sim::new();
    sim.put(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID)));
    let worker = sim.worker(ID).map(|w| (w.worker.dp_size, w.worker.dp_start_rank, w.worker.model, w.card));
    assert_eq!(worker, Some((0, 0, String::new(), None)));
}

#[test]
fn malformed_values_are_set_aside_without_touching_neighbours() {
    let no_id = json!({"type": "Endpoint", "component": "prefill", "endpoint": "generate"});
    let wrong_type = card_value("prefill", json!(ID + 1), card_json("prefill"));
    let cases: [(&str, Vec<u8>); 5] = [
        ("not json", b"{not json".to_vec()),
        ("not an object", b"[1, 2]".to_vec()),
        ("no instance_id", no_id.to_string().into_bytes()),
        ("wrong record type", wrong_type.to_string().into_bytes()),
        ("float id", br#"{"type":"Endpoint","endpoint":"generate","instance_id":1.5}"#.to_vec()),
    ];
    for (what, value) in cases {
        let mut sim = Sim::new();
        sim.register("decode", ID, "decode");
        let applied = sim.put_raw(instance_key(NS, "prefill", "generate", ID + 1), value);
        assert_eq!(counts(&applied), vec![(EventKind::Malformed, 1)], "{what}");
        assert_eq!(sim.worker_ids(), vec![ID], "{what}: the neighbour stays");
    }
}

#[test]
fn a_malformed_put_replaces_what_its_key_held() {
    let mut sim = Sim::new();
    sim.register("decode", ID, "decode");
    sim.put_raw(instance_key(NS, "decode", "generate", ID), "garbage");
    assert_eq!(sim.worker_ids(), Vec::<u64>::new());
    sim.put(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID)));
    assert_eq!(sim.worker_ids(), vec![ID]);
}

#[test]
fn deleting_the_instance_removes_the_worker_and_the_card_waits_for_it() {
    let mut sim = Sim::new();
    sim.register("prefill", ID, "prefill");
    let instance = instance_key(NS, "prefill", "generate", ID);
    let applied = sim.delete(&instance);
    assert_eq!((counts(&applied), applied.fleet_changed()), (vec![(EventKind::Delete, 1)], true));
    assert!(sim.worker(ID).is_none());
    sim.put(instance, &endpoint_value("prefill", "generate", json!(ID)));
    assert_eq!(sim.worker(ID).map(|w| (w.worker.model, w.first_seen)), Some(("tiny".into(), t(4))));
}

#[test]
fn last_updated_follows_the_latest_record_while_first_seen_stays() {
    let mut sim = Sim::new();
    sim.register("prefill", ID, "prefill");
    let card = kv(card_key(NS, "prefill", ID), &card_value("prefill", json!(ID), card_json("prefill")));
    sim.apply(super::WatchEvent::Put(card));
    let times = sim.worker(ID).map(|w| (w.first_seen, w.last_updated));
    assert_eq!(times, Some((t(2), t(3))));
}

#[test]
fn a_worker_whose_records_no_real_worker_has_is_listed_bare_and_never_routed() {
    use crate::discovery::{MAX_DATA_PARALLEL_SIZE, MAX_NAME_BYTES};
    let long_name = "m".repeat(MAX_NAME_BYTES + 1);
    let cases: [(&str, Value, Option<Exclusion>); 6] = [
        ("data_parallel_size", json!(MAX_DATA_PARALLEL_SIZE), None),
        ("data_parallel_size", json!(u32::MAX), Some(Exclusion::TooManyRanks { declared: u32::MAX })),
        ("data_parallel_start_rank", json!(u32::MAX - 1), None),
        ("data_parallel_start_rank", json!(u32::MAX), Some(Exclusion::RanksOutOfRange { start: u32::MAX, size: 1 })),
        (
            "disaggregated_endpoint",
            json!(long_name),
            Some(Exclusion::OversizedField { field: "disaggregated endpoint", bytes: MAX_NAME_BYTES + 1 }),
        ),
        (
            "display_name",
            json!(long_name),
            Some(Exclusion::OversizedField { field: "model name", bytes: MAX_NAME_BYTES + 1 }),
        ),
    ];
    for (field, value, excluded) in cases {
        let mut card = card_json("decode");
        match field {
            "display_name" => card[field] = value,
            _ => card["runtime_config"][field] = value,
        }
        let mut sim = Sim::new();
        sim.put(card_key(NS, "decode", ID), &card_value("decode", json!(ID), card));
        sim.put(instance_key(NS, "decode", "generate", ID), &endpoint_value("decode", "generate", json!(ID)));
        let Some(worker) = sim.worker(ID) else { panic!("{field}: the worker is listed") };
        assert_eq!(worker.excluded, excluded, "{field}");
        assert_eq!(sim.fleet().routable().count(), usize::from(excluded.is_none()), "{field}: routable");
        if excluded.is_some() {
            let bare = &worker.worker;
            assert_eq!((bare.dp_ranks().count(), bare.model.len(), bare.role), (1, 0, Role::Decode), "{field}");
            assert!(bare.disaggregated_endpoint.is_none() && bare.artifacts.is_none(), "{field}");
        }
    }
    // A card whose role disagrees with its component is excluded for that already; its
    // outsized name and ranks are dropped all the same.
    let mut card = card_json("decode");
    card["display_name"] = json!(long_name);
    card["runtime_config"]["data_parallel_size"] = json!(u32::MAX);
    let mut sim = Sim::new();
    sim.put(card_key(NS, "prefill", ID), &card_value("prefill", json!(ID), card));
    sim.put(instance_key(NS, "prefill", "generate", ID), &endpoint_value("prefill", "generate", json!(ID)));
    let Some(worker) = sim.worker(ID) else { panic!("the worker is listed") };
    assert_eq!(worker.excluded, Some(Exclusion::TooManyRanks { declared: u32::MAX }));
    assert_eq!((worker.worker.dp_ranks().count(), worker.worker.model.len()), (1, 0));
}
