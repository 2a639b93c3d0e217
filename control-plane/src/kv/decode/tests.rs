//! Decoding against every kv-events message captured from real Dynamo 1.6.1 workers, and every
//! refusal label against hostile variations of them.

use anyhow::Context;
use serde_json::{Value, json};

use super::*;
use crate::kv::fixtures::{self, frames};
use crate::load::envelope::{Expected, FRAME_VERSION, MAX_MSGPACK_DEPTH, open};
use crate::load::zmtp::ZmtpLimits;

fn decode(frames: &[Vec<u8>], expected: u64) -> Result<KvEventBatch, DecodeError> {
    decode_kv_events(frames.iter().map(Vec::as_slice), expected)
}

/// What the capture tool recorded for one RouterEvent, read field by field.
fn recorded_event(v: &Value) -> anyhow::Result<KvEvent> {
    let event = &v["event"];
    let data = &event["data"];
    let data = if let Some(stored) = data.get("stored") {
        let blocks = stored["blocks"].as_array().context("blocks")?;
        for block in blocks {
            assert_eq!(block["mm_extra_info"], Value::Null, "1.6.1 text blocks carry no multimodal info");
        }
        KvEventData::Stored(Stored {
            parent_hash: stored["parent_hash"].as_u64(),
            start_position: stored["start_position"].as_u64().map(u32::try_from).transpose()?,
            blocks: blocks
                .iter()
                .map(|b| {
                    Ok(StoredBlock {
                        block_hash: b["block_hash"].as_u64().context("block_hash")?,
                        tokens_hash: b["tokens_hash"].as_u64().context("tokens_hash")?,
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    } else if let Some(removed) = data.get("removed") {
        KvEventData::Removed(
            removed["block_hashes"].as_array().context("hashes")?.iter().filter_map(Value::as_u64).collect(),
        )
    } else {
        anyhow::ensure!(data == "cleared", "unknown data {data}");
        KvEventData::Cleared
    };
    Ok(KvEvent {
        worker_id: v["worker_id"].as_u64().context("worker_id")?,
        dp_rank: u32::try_from(event["dp_rank"].as_u64().context("dp_rank")?)?,
        event_id: event["event_id"].as_u64().context("event_id")?,
        storage_tier: StorageTier::parse(v["storage_tier"].as_str()),
        residency_domain: ResidencyDomain::parse(v["residency_domain"].as_str()),
        data,
    })
}

#[test]
fn every_captured_kv_events_message_decodes_to_its_recorded_values() -> anyhow::Result<()> {
    let mut per_file = Vec::new();
    let mut above_i64 = 0;
    for (file, messages) in fixtures::all_files()? {
        let mut decoded_here = 0;
        for message in messages.iter().filter(|m| m["topic"] == KV_EVENTS_TOPIC) {
            let recorded = &message["decoded"];
            let publisher = recorded["publisher_id_frame_u64be"].as_u64().context("publisher id")?;
            let got =
                decode(&frames(message), publisher).map_err(|e| anyhow::anyhow!("{file}: {e:?} for {message}"))?;
            let want = KvEventBatch {
                publisher_id: publisher,
                sequence: recorded["sequence_frame_u64be"].as_u64().context("sequence")?,
                published_at: recorded["envelope"]["published_at"].as_u64().context("published_at")?,
                events: recorded["payload"]
                    .as_array()
                    .context("payload")?
                    .iter()
                    .map(recorded_event)
                    .collect::<anyhow::Result<_>>()?,
            };
            assert_eq!(got, want, "{file}: {message}");
            assert!(got.events.iter().all(KvEvent::is_worker_device), "1.6.1 mockers publish device, worker");
            above_i64 += got
                .events
                .iter()
                .filter_map(|e| match &e.data {
                    KvEventData::Stored(s) => Some(s.blocks.iter().filter(|b| b.block_hash > i64::MAX as u64).count()),
                    KvEventData::Removed(h) => Some(h.iter().filter(|h| **h > i64::MAX as u64).count()),
                    KvEventData::Cleared => None,
                })
                .sum::<usize>();
            decoded_here += 1;
        }
        per_file.push((file, decoded_here));
    }
    assert_eq!(
        per_file,
        [
            ("agg/zmq-messages.jsonl", 6),
            ("agg/zmq-messages-under-load-evictions.jsonl", 60),
            ("disagg/zmq-messages.jsonl", 4),
            ("zmq-samples.json", 4)
        ]
    );
    assert!(above_i64 > 0, "the captures include hashes above i64::MAX");
    Ok(())
}

#[test]
fn every_other_captured_topic_is_a_topic_mismatch() -> anyhow::Result<()> {
    let mut refused = 0;
    for (_, messages) in fixtures::all_files()? {
        for message in messages.iter().filter(|m| m["topic"] != KV_EVENTS_TOPIC) {
            let publisher = message["decoded"]["publisher_id_frame_u64be"].as_u64().unwrap_or_default();
            assert_eq!(decode(&frames(message), publisher), Err(DecodeError::TopicMismatch), "{}", message["topic"]);
            refused += 1;
        }
    }
    assert!(refused > 100, "kv_metrics, forward-pass-metrics and active_sequences_events: {refused}");
    Ok(())
}

/// A real captured message: the agg worker's batch of a removal and a store.
fn sample() -> (Vec<Vec<u8>>, u64) {
    let message = fixtures::sample("agg/backend/kv-events/removed+stored");
    (frames(&message), message["decoded"]["publisher_id_frame_u64be"].as_u64().unwrap())
}

/// msgpack `bin`, which serde_json cannot express.
struct Bin<'a>(&'a [u8]);

impl serde::Serialize for Bin<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

fn envelope(publisher: u64, sequence: u64, topic: &str, payload: &[u8]) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Envelope<'a> {
        publisher_id: u64,
        sequence: u64,
        published_at: u64,
        topic: &'a str,
        payload: Bin<'a>,
    }
    let envelope = Envelope { publisher_id: publisher, sequence, published_at: 1, topic, payload: Bin(payload) };
    rmp_serde::to_vec_named(&envelope).unwrap()
}

/// Dynamo's frame: version, length, envelope.
fn frame(publisher: u64, sequence: u64, topic: &str, payload: &[u8]) -> Vec<u8> {
    let envelope = envelope(publisher, sequence, topic, payload);
    let mut frame = vec![FRAME_VERSION];
    frame.extend_from_slice(&u32::try_from(envelope.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&envelope);
    frame
}

/// The four frames of a message carrying `payload` (raw msgpack) from publisher 9.
fn message_with(payload: &[u8]) -> Vec<Vec<u8>> {
    let frame = frame(9, 4, KV_EVENTS_TOPIC, payload);
    vec![KV_EVENTS_TOPIC.as_bytes().to_vec(), 9u64.to_be_bytes().to_vec(), 4u64.to_be_bytes().to_vec(), frame]
}

/// A message whose payload is `payload` as msgpack (JSON objects become maps).
fn message(payload: &Value) -> Vec<Vec<u8>> {
    message_with(&rmp_serde::to_vec(payload).unwrap())
}

fn stored_event(event_id: u64, parent: Option<u64>, hashes: &[u64]) -> Value {
    let blocks: Vec<Value> =
        hashes.iter().map(|h| json!({"block_hash": h, "tokens_hash": h ^ 1, "mm_extra_info": null})).collect();
    json!({"worker_id": 7, "storage_tier": "device", "residency_domain": "worker",
           "event": {"event_id": event_id, "data": {"stored": {"parent_hash": parent, "start_position": null, "blocks": blocks}}, "dp_rank": 1}})
}

fn removed_event(event_id: u64, hashes: &[u64]) -> Value {
    json!({"worker_id": 7, "storage_tier": "device",
           "event": {"event_id": event_id, "data": {"removed": {"block_hashes": hashes}}, "dp_rank": 1}})
}

#[test]
fn each_refusal_is_counted_under_its_label() {
    let (good, publisher) = sample();
    assert!(decode(&good, publisher).is_ok());
    let mutate = |f: &dyn Fn(&mut Vec<Vec<u8>>)| {
        let mut frames = good.clone();
        f(&mut frames);
        decode(&frames, publisher)
    };
    type Mutation = Box<dyn Fn(&mut Vec<Vec<u8>>)>;
    let over = u32::try_from(KV_EVENTS_MAX_ENVELOPE_BYTES + 1).unwrap();
    let cases: [(&str, Mutation, DecodeError); 13] = [
        ("version byte 2", Box::new(|f| f[3][0] = 2), DecodeError::UnknownVersion),
        ("1 MiB declared", Box::new(move |f| f[3][1..5].copy_from_slice(&over.to_be_bytes())), DecodeError::Oversized),
        (
            "u32::MAX declared",
            Box::new(|f| f[3][1..5].copy_from_slice(&u32::MAX.to_be_bytes())),
            DecodeError::Oversized,
        ),
        ("declared length disagrees", Box::new(|f| f[3][4] -= 1), DecodeError::Malformed),
        ("truncated envelope", Box::new(|f| f[3].truncate(40)), DecodeError::Malformed),
        ("no header", Box::new(|f| f[3].truncate(3)), DecodeError::Malformed),
        ("five frames", Box::new(|f| f.push(Vec::new())), DecodeError::Malformed),
        ("three frames", Box::new(|f| f.truncate(3)), DecodeError::Malformed),
        ("7-byte id frame", Box::new(|f| f[1].truncate(7)), DecodeError::Malformed),
        ("kv_metrics topic", Box::new(|f| f[0] = b"kv_metrics".to_vec()), DecodeError::TopicMismatch),
        ("frame publisher id", Box::new(|f| f[1][7] ^= 1), DecodeError::IdentityMismatch),
        ("frame sequence", Box::new(|f| f[2][7] ^= 1), DecodeError::Malformed),
        ("truncated payload", Box::new(|f| *f = truncated_payload(f)), DecodeError::Malformed),
    ];
    for (what, mutation, label) in cases {
        assert_eq!(mutate(mutation.as_ref()), Err(label), "{what}");
    }
    assert_eq!(decode(&good, publisher + 1), Err(DecodeError::IdentityMismatch), "not the discovery record's id");
}

/// The captured message re-enveloped with its payload cut short.
fn truncated_payload(frames: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let publisher = u64::from_be_bytes(frames[1].clone().try_into().unwrap());
    let expected =
        Expected { topic: KV_EVENTS_TOPIC, max_envelope_bytes: KV_EVENTS_MAX_ENVELOPE_BYTES, publisher_id: publisher };
    let opened = open(frames.iter().map(Vec::as_slice), expected).unwrap();
    let mut out = frames.to_vec();
    out[3] = frame(opened.publisher_id, opened.sequence, KV_EVENTS_TOPIC, &opened.payload[..opened.payload.len() - 3]);
    out
}

#[test]
fn the_envelope_topic_must_be_kv_events_too() {
    let mut frames = message(&json!([]));
    frames[3] = frame(9, 4, "kv_metrics", &rmp_serde::to_vec(&json!([])).unwrap());
    assert_eq!(decode(&frames, 9), Err(DecodeError::TopicMismatch));
    assert_eq!(decode(&message(&json!([])), 9).map(|b| b.events.len()), Ok(0), "an empty batch is fine");
}

#[test]
fn batches_at_the_ceilings_decode_and_one_past_them_are_refused() {
    let cleared = |id: u64| json!({"worker_id": 7, "event": {"event_id": id, "data": "cleared"}});
    let full: Vec<Value> = (0..MAX_EVENTS_PER_BATCH as u64).map(cleared).collect();
    assert_eq!(decode(&message(&json!(full)), 9).map(|b| b.events.len()), Ok(MAX_EVENTS_PER_BATCH));
    let over: Vec<Value> = (0..=MAX_EVENTS_PER_BATCH as u64).map(cleared).collect();
    assert_eq!(decode(&message(&json!(over)), 9), Err(DecodeError::TooManyEvents));

    let half: Vec<u64> = (0..MAX_BLOCKS_PER_BATCH as u64 / 2).collect();
    let at_ceiling = json!([stored_event(1, None, &half), removed_event(2, &half)]);
    let batch = decode(&message(&at_ceiling), 9).unwrap();
    assert_eq!(batch.events.iter().map(KvEvent::blocks).sum::<usize>(), MAX_BLOCKS_PER_BATCH);
    let one_more = json!([stored_event(1, None, &half), removed_event(2, &half), removed_event(3, &[5])]);
    assert_eq!(decode(&message(&one_more), 9), Err(DecodeError::TooManyBlocks), "across events");

    // Dynamo's publisher sends an event past the batch bound whole, alone in its message.
    let long: Vec<u64> = (0..=MAX_BLOCKS_PER_BATCH as u64).collect();
    let alone = decode(&message(&json!([stored_event(1, None, &long)])), 9).unwrap();
    assert_eq!(alone.events.iter().map(KvEvent::blocks).sum::<usize>(), long.len(), "a long prompt's chain");
    let beside = json!([stored_event(1, None, &long), removed_event(2, &[5])]);
    assert_eq!(decode(&message(&beside), 9), Err(DecodeError::TooManyBlocks), "not beside another event");
    let longest: Vec<u64> = (0..MAX_BLOCKS_PER_EVENT as u64).collect();
    assert!(decode(&message(&json!([removed_event(1, &longest)])), 9).is_ok());
    let past: Vec<u64> = (0..=MAX_BLOCKS_PER_EVENT as u64).collect();
    assert_eq!(decode(&message(&json!([removed_event(1, &past)])), 9), Err(DecodeError::TooManyBlocks), "one event");
}

#[test]
fn hostile_block_lists_are_skipped_not_kept() {
    // 900 KiB of one-byte hashes: far more elements than the ceiling, all within the frame.
    let many: Vec<u64> = vec![1; 900 * 1024];
    let frames = message(&json!([removed_event(1, &many)]));
    assert!(frames[3].len() <= ZmtpLimits::KV_EVENTS.max_frame_bytes);
    assert_eq!(decode(&frames, 9), Err(DecodeError::TooManyBlocks));
    // The list itself keeps no more than the ceiling while it counts every element.
    let list = rmp_serde::to_vec(&many).unwrap();
    let capped: Capped<u64> = rmp_serde::from_slice(&list).unwrap();
    assert_eq!((capped.items.len(), capped.seen), (MAX_BLOCKS_PER_EVENT, many.len()));
}

#[test]
fn positional_arrays_decode_like_named_maps() {
    let top = u64::MAX - 3;
    let named = json!([
        stored_event(5, Some(top), &[top, 12]),
        removed_event(6, &[top]),
        {"worker_id": 7, "storage_tier": "device", "event": {"event_id": 7, "data": "cleared", "dp_rank": 1}},
    ]);
    let positional = json!([
        [7, "device", "worker", [5, {"stored": [top, null, [[top, top ^ 1, null], [12, 13]]]}, 1]],
        [7, "device", null, [6, {"removed": [[top]]}, 1]],
        [7, "device", null, [7, "cleared", 1]],
    ]);
    let from_maps = decode(&message(&named), 9).unwrap();
    let mut from_arrays = decode(&message(&positional), 9).unwrap();
    assert_eq!(from_arrays.events[0].residency_domain, ResidencyDomain::Worker);
    from_arrays.events[0].residency_domain = ResidencyDomain::Worker;
    for event in &mut from_arrays.events[1..] {
        event.residency_domain = ResidencyDomain::Unspecified;
    }
    assert_eq!(from_arrays, from_maps);
    let stored = &from_maps.events[0];
    assert_eq!(
        stored.data,
        KvEventData::Stored(Stored {
            parent_hash: Some(top),
            start_position: None,
            blocks: vec![
                StoredBlock { block_hash: top, tokens_hash: top ^ 1 },
                StoredBlock { block_hash: 12, tokens_hash: 13 }
            ],
        })
    );
    assert_eq!((stored.worker_id, stored.dp_rank, stored.event_id), (7, 1, 5));
    assert_eq!(from_maps.events[2].data, KvEventData::Cleared);
}

#[test]
fn unknown_keys_are_ignored_and_missing_optional_ones_take_upstream_defaults() {
    let payload = json!([{
        "worker_id": 7,
        "future": {"nested": [1, 2, 3]},
        "state_source": {"pool": 1},
        "session_id": "s",
        "event": {"event_id": 3, "data": {"stored": {"blocks": [{"block_hash": 1, "tokens_hash": 2, "extra": 0,
                  "mm_extra_info": {"mm_objects": [{"mm_hash": 5, "offsets": [[0, 4]]}]}}]}}, "later": true},
    }]);
    let event = &decode(&message(&payload), 9).unwrap().events[0];
    assert_eq!(
        (event.dp_rank, event.storage_tier, event.residency_domain),
        (0, StorageTier::Device, ResidencyDomain::Unspecified)
    );
    assert_eq!(
        event.data,
        KvEventData::Stored(Stored {
            parent_hash: None,
            start_position: None,
            blocks: vec![StoredBlock { block_hash: 1, tokens_hash: 2 }]
        })
    );
    assert!(event.is_worker_device());
}

#[test]
fn tiers_and_domains_other_than_the_workers_device_are_told_apart() {
    let with = |tier: Value, domain: Value, data: Value| {
        let payload = json!([{"worker_id": 7, "storage_tier": tier, "residency_domain": domain,
                              "event": {"event_id": 1, "data": data}}]);
        decode(&message(&payload), 9).unwrap().events[0].clone()
    };
    let removed = json!({"removed": {"block_hashes": [1]}});
    for (tier, parsed) in [
        ("host_pinned", StorageTier::HostPinned),
        ("disk", StorageTier::Disk),
        ("external", StorageTier::External),
        ("GPU", StorageTier::Unknown),
    ] {
        let event = with(json!(tier), json!("worker"), removed.clone());
        assert_eq!(event.storage_tier, parsed);
        assert!(!event.is_worker_device(), "{tier}");
    }
    assert!(!with(json!("device"), json!("cache_owner"), removed.clone()).is_worker_device());
    assert!(!with(json!("device"), json!("tenant"), removed.clone()).is_worker_device());
    assert!(with(json!("disk"), json!("worker"), json!("cleared")).is_worker_device(), "a clear names a domain");
    assert!(!with(json!("device"), json!("cache_owner"), json!("cleared")).is_worker_device());
}

#[test]
fn wrong_types_are_malformed() {
    let cases = [
        ("payload is a map", json!({"worker_id": 7})),
        ("payload is a string", json!("events")),
        ("worker_id as string", json!([{"worker_id": "7", "event": {"event_id": 1, "data": "cleared"}}])),
        ("negative worker_id", json!([{"worker_id": -7, "event": {"event_id": 1, "data": "cleared"}}])),
        ("no event", json!([{"worker_id": 7}])),
        ("no event_id", json!([{"worker_id": 7, "event": {"data": "cleared"}}])),
        ("unknown variant", json!([{"worker_id": 7, "event": {"event_id": 1, "data": "evicted"}}])),
        (
            "two variants",
            json!([{"worker_id": 7, "event": {"event_id": 1, "data": {"stored": {"blocks": []}, "removed": {"block_hashes": []}}}}]),
        ),
        (
            "dp_rank above u32",
            json!([{"worker_id": 7, "event": {"event_id": 1, "data": "cleared", "dp_rank": 1u64 << 32}}]),
        ),
        (
            "storage_tier integer",
            json!([{"worker_id": 7, "storage_tier": 0, "event": {"event_id": 1, "data": "cleared"}}]),
        ),
        (
            "negative block hash",
            json!([{"worker_id": 7, "event": {"event_id": 1, "data": {"removed": {"block_hashes": [-1]}}}}]),
        ),
        (
            "block without tokens_hash",
            json!([{"worker_id": 7, "event": {"event_id": 1, "data": {"stored": {"blocks": [{"block_hash": 1}]}}}}]),
        ),
        (
            "blocks as map",
            json!([{"worker_id": 7, "event": {"event_id": 1, "data": {"stored": {"blocks": {"a": 1}}}}}]),
        ),
        ("positional event too long", json!([[7, "device", "worker", [1, "cleared", 0, "extra"]]])),
    ];
    for (what, payload) in cases {
        assert_eq!(decode(&message(&payload), 9), Err(DecodeError::Malformed), "{what}");
    }
    assert_eq!(decode(&message_with(&[0xc1, 0xc1]), 9), Err(DecodeError::Malformed), "invalid msgpack");
}

#[test]
fn deeply_nested_msgpack_is_refused_without_exhausting_the_stack() {
    // An unknown key whose value nests arrays until the frame ceiling.
    let mut payload = vec![0x91, 0x82];
    payload.extend(rmp_serde::to_vec(&"worker_id").unwrap());
    payload.push(7);
    payload.extend(rmp_serde::to_vec(&"deep").unwrap());
    payload.extend(std::iter::repeat_n(0x91, KV_EVENTS_MAX_ENVELOPE_BYTES - 200));
    assert_eq!(decode(&message_with(&payload), 9), Err(DecodeError::Malformed));
}

#[test]
fn nesting_is_capped_at_the_shared_depth_and_real_multimodal_blocks_fit_under_it() {
    let nested = |depth: usize| (0..depth).fold(json!(0), |inner, _| json!([inner]));
    // array > event > unknown value: the event map sits at depth 2.
    let with_extra =
        |depth: usize| json!([{"worker_id": 7, "event": {"event_id": 1, "data": "cleared"}, "x": nested(depth)}]);
    assert!(decode(&message(&with_extra(MAX_MSGPACK_DEPTH - 3)), 9).is_ok());
    assert_eq!(decode(&message(&with_extra(MAX_MSGPACK_DEPTH)), 9), Err(DecodeError::Malformed));
    // The deepest field upstream defines: a multimodal block's offsets.
    let mm = json!({"mm_objects": [{"mm_hash": 5, "offsets": [[0, 4]]}]});
    let block = json!({"block_hash": 1, "tokens_hash": 2, "mm_extra_info": mm});
    let payload = json!([{"worker_id": 7, "event": {"event_id": 1, "data": {"stored": {"blocks": [block]}}}}]);
    assert!(decode(&message(&payload), 9).is_ok());
}

#[test]
fn labels_are_distinct_snake_case() {
    let mut labels: Vec<_> = DecodeError::ALL.iter().map(|e| e.as_str()).collect();
    assert!(labels.iter().all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), DecodeError::ALL.len());
}

mod fuzz {
    //! Arbitrary frames, and real frames with arbitrary bytes flipped: decoding never panics,
    //! and what it accepts is within its bounds and names the publisher it was read from.

    use proptest::prelude::*;

    use super::*;

    /// What any accepted batch must be: the expected publisher's, within the batch bounds (one
    /// event alone may hold up to an event's).
    fn accepted_is_bounded(decoded: &Result<KvEventBatch, DecodeError>, publisher: u64) -> bool {
        let Ok(batch) = decoded else { return true };
        let blocks: usize = batch.events.iter().map(KvEvent::blocks).sum();
        let most = if batch.events.len() == 1 { MAX_BLOCKS_PER_EVENT } else { MAX_BLOCKS_PER_BATCH };
        batch.publisher_id == publisher && batch.events.len() <= MAX_EVENTS_PER_BATCH && blocks <= most
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn arbitrary_frames_never_panic(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6)) {
            prop_assert!(accepted_is_bounded(&decode(&frames, 1), 1));
        }

        #[test]
        fn corrupted_real_frames_never_panic(flips in proptest::collection::vec((0usize..4, any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
            let (mut frames, publisher) = sample();
            for (frame, at, byte) in flips {
                let target = &mut frames[frame];
                let i = at.index(target.len());
                target[i] = byte;
            }
            prop_assert!(accepted_is_bounded(&decode(&frames, publisher), publisher));
        }

        #[test]
        fn arbitrary_payloads_never_panic(payload in proptest::collection::vec(any::<u8>(), 0..600)) {
            prop_assert!(accepted_is_bounded(&decode(&message_with(&payload), 9), 9));
        }
    }
}
