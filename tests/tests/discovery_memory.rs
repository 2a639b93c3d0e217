//! What reading a model card costs in memory, counted by this test binary's allocator: a card
//! is read from etcd values up to 16 MiB, and a card too large to keep must not take many times
//! its size while it is read (as a JSON tree, small values take some eighty times their text).

use std::alloc::System;
use std::time::SystemTime;

use continuum_control_plane::discovery::{KeyValue, MAX_RECORD_BYTES, Reducer, WatchEvent};
use continuum_proto::model::{Role, WorkerKey};
use serde_json::json;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const ID: u64 = 0x6a6c_a228_814c_9742;

/// Where a card's padding goes: an unknown field, which the router ignores, or a field of its
/// typed subset that is read leniently (through a tree of its own when it is small).
#[derive(Clone, Copy, Debug)]
enum Padded {
    Unknown,
    RuntimeData,
    OtherArtifactKind,
}

/// A card value of nearly the largest size read, its card padded with small numbers beside the
/// fields its typed subset reads.
fn large_card_record(padded: Padded) -> Vec<u8> {
    let numbers = (MAX_RECORD_BYTES - 4096) / 2;
    let pad = format!("[{}]", vec!["0"; numbers].join(","));
    let (unknown, runtime_data, tokenizer) = match padded {
        Padded::Unknown => (pad.as_str(), "{}", "{}"),
        Padded::RuntimeData => ("0", pad.as_str(), "{}"),
        Padded::OtherArtifactKind => ("0", "{}", pad.as_str()),
    };
    let tokenizer = format!(r#"{{"gguf":{tokenizer}}}"#);
    format!(
        r#"{{"type":"Model","namespace":"dynamo","component":"prefill","endpoint":"generate","instance_id":{ID},
           "card_json":{{"display_name":"tiny","worker_type":"prefill","kv_cache_block_size":16,
           "runtime_config":{{"total_kv_blocks":1024,"max_num_seqs":256,"max_num_batched_tokens":8192,
           "runtime_data":{runtime_data}}},"tokenizer":{tokenizer},"pad":{unknown}}}}}"#
    )
    .into_bytes()
}

#[test]
fn reading_a_card_too_large_to_keep_allocates_less_than_its_size() -> anyhow::Result<()> {
    let (record, allocated) = read_large_card(Padded::Unknown)?;
    assert!(allocated < record.len(), "reading a {} byte card allocated {allocated} bytes", record.len());
    Ok(())
}

/// A field read leniently (`runtime_data`, an artifact slot of a kind the router does not read)
/// that holds megabytes is read as absent: its text may be copied, but no tree of it is built
/// (one would take some eighty times the text).
#[test]
fn a_large_value_in_a_field_read_leniently_builds_no_tree() -> anyhow::Result<()> {
    for padded in [Padded::RuntimeData, Padded::OtherArtifactKind] {
        let (record, allocated) = read_large_card(padded)?;
        assert!(allocated < 2 * record.len(), "{padded:?}: a {} byte card allocated {allocated} bytes", record.len());
    }
    Ok(())
}

/// Reads the card padded as `padded`, then its worker's instance; the record and the bytes
/// allocated while the card was read.
fn read_large_card(padded: Padded) -> anyhow::Result<(Vec<u8>, usize)> {
    let mut reducer = Reducer::new(vec!["dynamo".into()]);
    let record = large_card_record(padded);
    assert!(record.len() <= MAX_RECORD_BYTES && record.len() > MAX_RECORD_BYTES / 2);
    let card = KeyValue::new(format!("v1/mdc/dynamo/prefill/generate/{ID:x}"), record.clone());
    let instance = json!({
        "type": "Endpoint", "namespace": "dynamo", "component": "prefill", "endpoint": "generate", "instance_id": ID,
    });
    let instance = KeyValue::new(format!("v1/instances/dynamo/prefill/generate/{ID:x}"), instance.to_string());

    let region = Region::new(GLOBAL);
    reducer.apply(WatchEvent::Put(card), SystemTime::now());
    let stats = region.change();
    reducer.apply(WatchEvent::Put(instance), SystemTime::now());

    // Everything allocated while it was read, whatever was freed meanwhile: more than its peak.
    let allocated = stats.bytes_allocated + stats.bytes_reallocated.max(0) as usize;
    let fleet = reducer.fleet();
    let worker =
        fleet.worker(&WorkerKey::new("dynamo", ID)).ok_or_else(|| anyhow::anyhow!("the worker is published"))?;
    assert_eq!(
        (worker.worker.role, worker.worker.block_size, worker.worker.capacity.total_kv_blocks),
        (Role::Prefill, Some(16), Some(1024)),
        "with its card's typed subset"
    );
    assert!(worker.card.is_none(), "but not the card itself, past the bound");
    Ok((record, allocated))
}
