//! Loads the real Dynamo 1.6.1 etcd captures from `tests/fixtures/dynamo-1.6.1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;

use super::super::{KeyValue, WatchEvent};
use crate::kv::fixtures::FIXTURES;

fn dir(run: &str) -> anyhow::Result<PathBuf> {
    let root = Path::new(FIXTURES);
    if !root.is_dir() {
        bail!("Dynamo 1.6.1 fixtures not found at {}: they are part of the workspace (tests/fixtures)", root.display());
    }
    Ok(root.join(run))
}

fn lines(run: &str, file: &str) -> anyhow::Result<Vec<Value>> {
    let path = dir(run)?.join(file);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(n, l)| serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), n + 1)))
        .collect()
}

fn text(record: &Value, field: &str) -> anyhow::Result<String> {
    record
        .get(field)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .with_context(|| format!("no string `{field}` in {record}"))
}

/// The value bytes as etcd held them. `json` values were captured parsed; serde_json keeps
/// integers as `u64`, so re-serialising is exact even above 2^53.
fn value_bytes(record: &Value) -> anyhow::Result<Vec<u8>> {
    let value = record.get("value").with_context(|| format!("no value in {record}"))?;
    match record.get("value_encoding").and_then(Value::as_str).unwrap_or("json") {
        "json" => Ok(serde_json::to_vec(value)?),
        "utf8" | "text" => Ok(value.as_str().context("text value is not a string")?.as_bytes().to_vec()),
        other => bail!("value_encoding {other:?} is not supported by this loader"),
    }
}

fn key_value(record: &Value) -> anyhow::Result<KeyValue> {
    let kv = KeyValue::new(text(record, "key")?, value_bytes(record)?);
    Ok(match record.get("lease_id_decimal").and_then(Value::as_u64) {
        Some(lease) => kv.with_lease(lease),
        None => kv,
    })
}

/// `etcd-dump.jsonl`: every key under `v1/` at the end of registration.
pub(super) fn dump(run: &str) -> anyhow::Result<Vec<KeyValue>> {
    lines(run, "etcd-dump.jsonl")?.iter().map(key_value).collect()
}

/// `etcd-watch.jsonl`: every event from before the workers started, with its revision.
pub(super) fn watch(run: &str) -> anyhow::Result<Vec<(u64, WatchEvent)>> {
    lines(run, "etcd-watch.jsonl")?
        .iter()
        .map(|record| {
            let revision = record.get("revision").and_then(Value::as_u64).context("no revision")?;
            let event = match text(record, "type")?.as_str() {
                "PUT" => WatchEvent::Put(key_value(record)?),
                "DELETE" => WatchEvent::Delete { key: text(record, "key")?.into_bytes() },
                other => bail!("unknown watch event type {other:?}"),
            };
            Ok((revision, event))
        })
        .collect()
}

/// `instance_ids.json`: decimal instance ids by component.
pub(super) fn instance_ids(run: &str) -> anyhow::Result<BTreeMap<String, Vec<u64>>> {
    let path = dir(run)?.join("instance_ids.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// The one instance id `instance_ids.json` lists for `component`.
pub(super) fn instance_id(run: &str, component: &str) -> anyhow::Result<u64> {
    match instance_ids(run)?.get(component).map(Vec::as_slice) {
        Some([id]) => Ok(*id),
        other => bail!("{run}/instance_ids.json: expected one {component} id, found {other:?}"),
    }
}
