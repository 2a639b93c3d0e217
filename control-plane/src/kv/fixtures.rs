//! The real Dynamo 1.6.1 captures under `tests/fixtures/dynamo-1.6.1`, for the crate's tests.

use std::path::Path;

use anyhow::Context;
use serde_json::Value;

/// The captures, in the workspace (copied from the steering repository's `shared/fixtures`).
pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/dynamo-1.6.1");
/// The capture files holding ZMQ messages.
pub const CAPTURES: [&str; 3] =
    ["agg/zmq-messages.jsonl", "agg/zmq-messages-under-load-evictions.jsonl", "disagg/zmq-messages.jsonl"];
const SAMPLES: &str = "zmq-samples.json";

/// Every message of one capture file, in the order received.
pub fn captured(file: &str) -> anyhow::Result<Vec<Value>> {
    let path = Path::new(FIXTURES).join(file);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: a captured Dynamo 1.6.1 fixture", path.display()))?;
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| Ok(serde_json::from_str(l)?)).collect()
}

fn samples() -> anyhow::Result<serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(Path::new(FIXTURES).join(SAMPLES))?;
    match serde_json::from_str(&text)? {
        Value::Object(samples) => Ok(samples),
        _ => anyhow::bail!("{SAMPLES} is an object"),
    }
}

/// Every file with its messages: the three runs and the one-per-kind samples.
pub fn all_files() -> anyhow::Result<Vec<(&'static str, Vec<Value>)>> {
    let mut all = Vec::new();
    for file in CAPTURES {
        all.push((file, captured(file)?));
    }
    all.push((SAMPLES, samples()?.into_iter().map(|(_, v)| v).collect()));
    Ok(all)
}

/// One named sample, such as `agg/backend/kv-events/removed+stored`.
pub fn sample(name: &str) -> Value {
    samples().unwrap().remove(name).unwrap()
}

/// The raw frames of a captured message.
pub fn frames(message: &Value) -> Vec<Vec<u8>> {
    message["frames_hex"].as_array().unwrap().iter().map(|f| hex(f.as_str().unwrap())).collect()
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}
