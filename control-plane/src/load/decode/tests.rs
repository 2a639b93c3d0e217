//! Decoding against every kv_metrics message captured from real Dynamo 1.6.1 workers, and
//! every refusal label against mutations of them.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

use super::*;
use crate::load::zmtp::ZmtpLimits;

use crate::kv::fixtures::{CAPTURES, FIXTURES, captured};

/// Every captured message: the three runs and the one-per-kind samples.
fn all_messages() -> anyhow::Result<Vec<Value>> {
    let mut all = Vec::new();
    for file in CAPTURES {
        all.extend(captured(file)?);
    }
    let samples: Value = serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURES).join("zmq-samples.json"))?)?;
    all.extend(samples.as_object().context("zmq-samples.json is an object")?.values().cloned());
    Ok(all)
}

fn frames(message: &Value) -> Vec<Vec<u8>> {
    message["frames_hex"].as_array().unwrap().iter().map(|f| hex(f.as_str().unwrap())).collect()
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}

fn decode(frames: &[Vec<u8>], expected: u64) -> Result<KvMetrics, LoadEvent> {
    decode_kv_metrics(frames.iter().map(Vec::as_slice), expected)
}

#[test]
fn every_captured_kv_metrics_frame_decodes_to_its_recorded_values() -> anyhow::Result<()> {
    let mut per_file = Vec::new();
    for file in CAPTURES.iter().copied().chain(["zmq-samples.json"]) {
        let messages = if file == "zmq-samples.json" {
            let samples: Value = serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURES).join(file))?)?;
            samples.as_object().context("object")?.values().cloned().collect()
        } else {
            captured(file)?
        };
        let mut decoded_here = 0;
        for message in messages.iter().filter(|m| m["topic"] == "kv_metrics") {
            let recorded = &message["decoded"];
            let publisher = recorded["publisher_id_frame_u64be"].as_u64().context("publisher id")?;
            let got =
                decode(&frames(message), publisher).map_err(|e| anyhow::anyhow!("{file}: {e:?} for {message}"))?;
            let payload = &recorded["payload"];
            let want = KvMetrics {
                publisher_id: publisher,
                sequence: recorded["sequence_frame_u64be"].as_u64().context("sequence")?,
                published_at: recorded["envelope"]["published_at"].as_u64().context("published_at")?,
                worker_id: payload["worker_id"].as_u64().context("worker_id")?,
                dp_rank: u32::try_from(payload["dp_rank"].as_u64().context("dp_rank")?)?,
                load: Load {
                    active_decode_blocks: payload["active_decode_blocks"].as_u64(),
                    active_prefill_tokens: payload["active_prefill_tokens"].as_u64(),
                    kv_used_blocks: payload["kv_used_blocks"].as_u64(),
                },
            };
            assert_eq!(got, want, "{file}: {message}");
            assert_eq!(got.load.active_decode_blocks, None, "1.6.1 workers leave it nil, and nil stays absent");
            assert!(got.load.kv_used_blocks.is_some());
            decoded_here += 1;
        }
        per_file.push((file, decoded_here));
    }
    assert_eq!(
        per_file,
        [
            ("agg/zmq-messages.jsonl", 18),
            ("agg/zmq-messages-under-load-evictions.jsonl", 69),
            ("disagg/zmq-messages.jsonl", 28),
            ("zmq-samples.json", 3)
        ]
    );
    Ok(())
}

#[test]
fn the_dp2_worker_publishes_both_ranks_on_one_channel() -> anyhow::Result<()> {
    let mut ranks = std::collections::BTreeSet::new();
    for message in
        captured("agg/zmq-messages-under-load-evictions.jsonl")?.iter().filter(|m| m["topic"] == "kv_metrics")
    {
        let publisher = message["decoded"]["publisher_id_frame_u64be"].as_u64().context("id")?;
        let got = decode(&frames(message), publisher).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        ranks.insert((got.publisher_id, got.worker_id, got.dp_rank));
    }
    assert_eq!(ranks.len(), 2, "one publisher, one worker, ranks 0 and 1: {ranks:?}");
    Ok(())
}

#[test]
fn every_other_captured_topic_is_a_topic_mismatch() -> anyhow::Result<()> {
    let mut refused = 0;
    for message in all_messages()?.iter().filter(|m| m["topic"] != "kv_metrics") {
        let publisher = message["decoded"]["publisher_id_frame_u64be"].as_u64().unwrap_or_default();
        assert_eq!(decode(&frames(message), publisher), Err(LoadEvent::TopicMismatch), "{}", message["topic"]);
        refused += 1;
    }
    assert_eq!(refused, 337, "forward-pass-metrics, kv-events and active_sequences_events");
    Ok(())
}

/// A real captured sample: the disagg decode worker's sequence 0.
fn sample() -> (Vec<Vec<u8>>, u64) {
    let samples: Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURES).join("zmq-samples.json")).unwrap()).unwrap();
    let message = &samples["disagg/backend/kv_metrics"];
    (frames(message), message["decoded"]["publisher_id_frame_u64be"].as_u64().unwrap())
}

/// The captured message with its envelope replaced.
fn with_envelope(envelope: &[u8]) -> Vec<Vec<u8>> {
    let (mut frames, _) = sample();
    let mut frame = vec![FRAME_VERSION];
    frame.extend_from_slice(&u32::try_from(envelope.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(envelope);
    frames[3] = frame;
    frames
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
    let cases: [(&str, Mutation, LoadEvent); 12] = [
        ("version byte 2", Box::new(|f| f[3][0] = 2), LoadEvent::UnknownVersion),
        (
            "17 KiB declared",
            Box::new(|f| f[3][1..5].copy_from_slice(&(17u32 * 1024).to_be_bytes())),
            LoadEvent::Oversized,
        ),
        ("u32::MAX declared", Box::new(|f| f[3][1..5].copy_from_slice(&u32::MAX.to_be_bytes())), LoadEvent::Oversized),
        ("declared length disagrees", Box::new(|f| f[3][4] -= 1), LoadEvent::Malformed),
        ("invalid msgpack", Box::new(|f| *f = with_envelope(&[0xc1, 0xc1, 0xc1])), LoadEvent::Malformed),
        ("five frames", Box::new(|f| f.push(Vec::new())), LoadEvent::Malformed),
        ("three frames", Box::new(|f| f.truncate(3)), LoadEvent::Malformed),
        ("7-byte id frame", Box::new(|f| f[1].truncate(7)), LoadEvent::Malformed),
        ("topic frame", Box::new(|f| f[0] = b"kv_metricsX".to_vec()), LoadEvent::TopicMismatch),
        ("frame publisher id", Box::new(|f| f[1][7] ^= 1), LoadEvent::IdentityMismatch),
        ("frame sequence", Box::new(|f| f[2][7] ^= 1), LoadEvent::Malformed),
        ("no header", Box::new(|f| f[3].truncate(3)), LoadEvent::Malformed),
    ];
    for (what, mutation, label) in cases {
        assert_eq!(mutate(mutation.as_ref()), Err(label), "{what}");
    }
    assert_eq!(decode(&good, publisher + 1), Err(LoadEvent::IdentityMismatch), "not the discovery record's id");
}

/// Just enough msgpack to build envelopes by hand.
mod mp {
    pub fn map(n: u8) -> Vec<u8> {
        vec![0x80 | n]
    }
    pub fn array(n: u8) -> Vec<u8> {
        vec![0x90 | n]
    }
    pub fn str(s: &str) -> Vec<u8> {
        let mut out = vec![0xd9, u8::try_from(s.len()).unwrap()];
        out.extend_from_slice(s.as_bytes());
        out
    }
    pub fn uint(v: u64) -> Vec<u8> {
        let mut out = vec![0xcf];
        out.extend_from_slice(&v.to_be_bytes());
        out
    }
    pub fn nil() -> Vec<u8> {
        vec![0xc0]
    }
    pub fn bin(b: &[u8]) -> Vec<u8> {
        let mut out = vec![0xc5];
        out.extend_from_slice(&u16::try_from(b.len()).unwrap().to_be_bytes());
        out.extend_from_slice(b);
        out
    }
    pub fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }
}

fn envelope_map(publisher: u64, sequence: u64, topic: &str, payload: &[u8]) -> Vec<u8> {
    use mp::*;
    cat(&[
        map(5),
        str("publisher_id"),
        uint(publisher),
        str("sequence"),
        uint(sequence),
        str("published_at"),
        uint(1_795_976_071_340),
        str("topic"),
        str(topic),
        str("payload"),
        bin(payload),
    ])
}

fn frames_for(envelope: Vec<u8>, publisher: u64, sequence: u64) -> Vec<Vec<u8>> {
    let mut frames = with_envelope(&envelope);
    frames[1] = publisher.to_be_bytes().to_vec();
    frames[2] = sequence.to_be_bytes().to_vec();
    frames
}

#[test]
fn positional_arrays_decode_like_named_maps_and_nil_stays_absent() {
    use mp::*;
    let payload = cat(&[array(5), uint(7), uint(1), nil(), uint(12), uint(3)]);
    let envelope = cat(&[array(5), uint(9), uint(4), uint(1), str("kv_metrics"), bin(&payload)]);
    let got = decode(&frames_for(envelope, 9, 4), 9).unwrap();
    assert_eq!((got.worker_id, got.dp_rank, got.sequence), (7, 1, 4));
    assert_eq!(got.load, Load { active_decode_blocks: None, active_prefill_tokens: Some(12), kv_used_blocks: Some(3) });

    let older = cat(&[array(4), uint(7), uint(0), uint(5), nil()]);
    let got = decode(&frames_for(envelope_map(9, 5, "kv_metrics", &older), 9, 5), 9).unwrap();
    assert_eq!(
        got.load,
        Load { active_decode_blocks: Some(5), active_prefill_tokens: None, kv_used_blocks: None },
        "a missing trailing field is absent"
    );
}

#[test]
fn unknown_map_keys_are_ignored_and_missing_ones_are_absent() {
    use mp::*;
    let payload = cat(&[
        map(3),
        str("worker_id"),
        uint(7),
        str("future_field"),
        cat(&[array(2), uint(1), str("x")]),
        str("kv_used_blocks"),
        uint(9),
    ]);
    let got = decode(&frames_for(envelope_map(9, 0, "kv_metrics", &payload), 9, 0), 9).unwrap();
    assert_eq!((got.worker_id, got.dp_rank), (7, 0), "no dp_rank reads as rank 0");
    assert_eq!(got.load, Load { kv_used_blocks: Some(9), ..Load::default() });
}

#[test]
fn envelope_disagreements_are_refused() {
    use mp::*;
    let payload = cat(&[map(1), str("worker_id"), uint(7)]);
    let wrong_topic = envelope_map(9, 0, "kv-events", &payload);
    assert_eq!(decode(&frames_for(wrong_topic, 9, 0), 9), Err(LoadEvent::TopicMismatch));
    let other_publisher = envelope_map(8, 0, "kv_metrics", &payload);
    assert_eq!(decode(&frames_for(other_publisher, 9, 0), 9), Err(LoadEvent::IdentityMismatch));
    let no_worker = envelope_map(9, 0, "kv_metrics", &cat(&[map(1), str("kv_used_blocks"), uint(1)]));
    assert_eq!(decode(&frames_for(no_worker, 9, 0), 9), Err(LoadEvent::Malformed));
    let negative = envelope_map(9, 0, "kv_metrics", &cat(&[map(1), str("worker_id"), vec![0xd0, 0xff]]));
    assert_eq!(decode(&frames_for(negative, 9, 0), 9), Err(LoadEvent::Malformed));
}

#[test]
fn deeply_nested_msgpack_is_refused_without_exhausting_the_stack() {
    use mp::*;
    let budget = KV_METRICS_MAX_PAYLOAD_BYTES - 200;
    let mut payload = cat(&[map(2), str("worker_id"), uint(7), str("deep")]);
    payload.extend(std::iter::repeat_n(0x91, budget - payload.len()));
    let result = decode(&frames_for(envelope_map(9, 0, "kv_metrics", &payload), 9, 0), 9);
    assert_eq!(result, Err(LoadEvent::Malformed));
}

#[test]
fn the_largest_payload_fits_the_transport_frame_ceiling() {
    let (_, publisher) = sample();
    // An envelope at the decoder's ceiling is read (this one is junk, so malformed), and its
    // frame is one the transport buffers; one byte more is refused unread.
    let largest = with_envelope(&vec![0xc1; KV_METRICS_MAX_PAYLOAD_BYTES]);
    assert_eq!(decode(&largest, publisher), Err(LoadEvent::Malformed));
    assert!(largest[3].len() <= ZmtpLimits::KV_METRICS.max_frame_bytes, "{} bytes", largest[3].len());
    let over = with_envelope(&vec![0xc1; KV_METRICS_MAX_PAYLOAD_BYTES + 1]);
    assert_eq!(decode(&over, publisher), Err(LoadEvent::Oversized));
}

mod fuzz {
    //! Arbitrary frames, and real frames with arbitrary bytes flipped: decoding never panics,
    //! and a sample it accepts names the publisher it was read from.

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn arbitrary_frames_never_panic(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6)) {
            prop_assert!(decode(&frames, 1).ok().is_none_or(|sample| sample.publisher_id == 1));
        }

        #[test]
        fn corrupted_real_frames_never_panic(flips in proptest::collection::vec((0usize..4, any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
            let (mut frames, publisher) = sample();
            for (frame, at, byte) in flips {
                let target = &mut frames[frame];
                let i = at.index(target.len());
                target[i] = byte;
            }
            prop_assert!(decode(&frames, publisher).ok().is_none_or(|sample| sample.publisher_id == publisher));
        }
    }
}
