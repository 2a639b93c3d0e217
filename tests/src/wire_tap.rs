//! The `wire-tap` binary in a test's namespace, in front of a server, and the HTTP/1.1 requests
//! it recorded: what that server was actually sent, header by header.

use std::path::PathBuf;

use anyhow::{Context, bail};

use crate::netns::NetNs;
use crate::tools;

/// A running tap; it dies with the namespace.
#[derive(Debug)]
pub struct WireTap {
    pub listen: &'static str,
    dir: PathBuf,
}

/// One request as it reached the upstream.
#[derive(Debug, Clone)]
pub struct Tapped {
    pub method: String,
    pub path: String,
    /// Names lowercased, in the order sent.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Tapped {
    /// Every value sent under `name` (any case).
    pub fn values(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.as_str()).collect()
    }
}

impl WireTap {
    /// Listens on `listen` inside `ns` and relays to `upstream`, waiting until it accepts.
    pub async fn start(ns: &NetNs, listen: &'static str, upstream: &str) -> anyhow::Result<Self> {
        let dir = ns.dir().join("wire-tap");
        let mut command = ns.command(tools::binary("wire-tap"));
        command.args(["--listen", listen, "--upstream", upstream, "--dir"]).arg(&dir);
        let pid = ns.spawn("wire-tap", command)?;
        for _ in 0..200 {
            if dir.join("listening").exists() {
                return Ok(Self { listen, dir });
            }
            if let Some(status) = ns.exited(pid)? {
                bail!("wire-tap exited ({status}) at start:\n{}", ns.log_tail("wire-tap"));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        bail!("wire-tap did not listen on {listen} within 10 s:\n{}", ns.log_tail("wire-tap"))
    }

    /// Every whole request recorded so far, connection by connection in the order each sent them.
    pub fn requests(&self) -> anyhow::Result<Vec<Tapped>> {
        let mut requests = Vec::new();
        let mut files: Vec<(u64, PathBuf)> = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let n = path.file_name().and_then(|n| n.to_str()?.strip_prefix("conn-")?.parse().ok());
            files.extend(n.map(|n| (n, path)));
        }
        files.sort();
        for (_, path) in files {
            let bytes = std::fs::read(&path)?;
            requests.extend(parse(&bytes).with_context(|| format!("{}", path.display()))?);
        }
        Ok(requests)
    }
}

/// The whole requests in one connection's bytes (a last one still arriving is left out).
fn parse(mut bytes: &[u8]) -> anyhow::Result<Vec<Tapped>> {
    let mut requests = Vec::new();
    loop {
        let mut slots = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut slots);
        let head = match request.parse(bytes)? {
            httparse::Status::Complete(length) => length,
            httparse::Status::Partial => return Ok(requests),
        };
        let headers: Vec<(String, String)> = request
            .headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), String::from_utf8_lossy(h.value).into_owned()))
            .collect();
        if headers.iter().any(|(name, _)| name == "transfer-encoding") {
            bail!("a chunked request body; the tap reads Content-Length framing only");
        }
        let length = match headers.iter().find(|(name, _)| name == "content-length") {
            Some((_, value)) => value.trim().parse::<usize>().context("content-length")?,
            None => 0,
        };
        let Some(body) = bytes.get(head..head + length) else { return Ok(requests) };
        requests.push(Tapped {
            method: request.method.unwrap_or_default().to_string(),
            path: request.path.unwrap_or_default().to_string(),
            headers,
            body: body.to_vec(),
        });
        bytes = &bytes[head + length..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_bytes_split_into_whole_requests() -> anyhow::Result<()> {
        let bytes = b"GET /live HTTP/1.1\r\nHost: a\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\nX-Dp-Rank: 5\r\ncontent-length: 2\r\n\r\n{}POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 9\r\n\r\n{\"a\"";
        let requests = parse(bytes)?;
        assert_eq!(requests.len(), 2, "the last one is not whole yet");
        assert_eq!((requests[0].method.as_str(), requests[0].path.as_str()), ("GET", "/live"));
        assert_eq!(requests[1].values("x-dp-rank"), ["5"]);
        assert_eq!(requests[1].body, b"{}");
        Ok(())
    }
}
