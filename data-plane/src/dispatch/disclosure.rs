//! Whether a backend's refusal of the client's request (a 4xx) may reach the client as it came.
//!
//! The seed relays such refusals directly, and the real direct-mode frontend's are JSON objects
//! that speak only of the client's own request. But whatever answers in its place (a proxy or
//! an ingress in front of the frontend, a backend serving the model unpinned) may answer in
//! HTML, or name hosts, pods, ports, files and workers; and no internal address may reach a
//! client, nor a worker's id unless it asked (`x-backend`). So a body is relayed only when it
//! is a JSON object none of whose keys or strings looks like an address, a path or a worker
//! id; any other refusal keeps its status and gets the router's words instead.

use std::net::{IpAddr, SocketAddr};

use serde_json::Value;

/// What becomes of a refusal's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalBody {
    /// Passed on as it came.
    Relayed,
    /// Empty, or not read whole (too large, too slow): the router explains instead.
    Unreadable,
    /// Read, but not a JSON object, or naming an address: the router explains instead.
    Withheld,
}

impl RefusalBody {
    pub const ALL: [RefusalBody; 3] = [RefusalBody::Relayed, RefusalBody::Unreadable, RefusalBody::Withheld];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalBody::Relayed => "relayed",
            RefusalBody::Unreadable => "unreadable",
            RefusalBody::Withheld => "withheld",
        }
    }
}

/// The body of a refusal (empty when it could not be read) that may be relayed: the JSON
/// object as it was checked, which is what goes out (re-encoded, not the bytes as they came:
/// a key written twice is checked as its last copy, and only that copy may pass); or why not.
pub fn relayable(body: &[u8]) -> Result<Value, RefusalBody> {
    if body.is_empty() {
        return Err(RefusalBody::Unreadable);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(value @ Value::Object(_)) if !names_an_address(&value) => Ok(value),
        _ => Err(RefusalBody::Withheld),
    }
}

/// The words of a refusal [`relayable`] lets through, when its body is not in OpenAI's shape
/// (`{"error":{"message"}}`) and must be put in it: its `message` (the shape of Dynamo's
/// frontend and vLLM), or `detail` (FastAPI's), or else the whole body. `None`: relayed as it
/// is.
pub fn backend_words(value: &Value) -> Option<String> {
    if value.pointer("/error/message").is_some_and(Value::is_string) {
        return None;
    }
    let said = ["message", "detail"].iter().find_map(|key| value.get(key).and_then(Value::as_str));
    Some(said.map_or_else(|| value.to_string(), str::to_string))
}

fn names_an_address(value: &Value) -> bool {
    match value {
        Value::String(text) => text_names_an_address(text),
        Value::Array(items) => items.iter().any(names_an_address),
        Value::Object(fields) => {
            fields.iter().any(|(key, value)| text_names_an_address(key) || names_an_address(value))
        }
        // A worker's id may come as a number too (`"decode_worker_id": 7668682560356784121`).
        Value::Number(number) => number.as_u64().is_some_and(|n| is_instance_id(&n.to_string())),
        Value::Null | Value::Bool(_) => false,
    }
}

/// Host names under these suffixes (and `localhost`) are a cluster's or a machine's own.
const INTERNAL_SUFFIXES: [&str; 6] = [".local", ".internal", ".svc", ".cluster", ".lan", ".localdomain"];

/// Whether `text` holds a URL, an IP address (with or without a port), a host with a port, a
/// host name of an internal zone, an absolute file path, or what may be a worker's instance id.
/// Errs toward yes: a false alarm costs the client the backend's wording, never its status.
pub fn text_names_an_address(text: &str) -> bool {
    text.contains("://")
        || text.split(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '(' | '[' | '=')).any(is_path)
        || text
            .split(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '_' | '[' | ']' | '%')))
            .any(|token| token_is_address(token) || token.split(['.', ':', '-', '_']).any(is_instance_id))
}

/// An absolute path of two parts or more (`/models/tiny/tokenizer.json`, `~/.cache/x`).
fn is_path(word: &str) -> bool {
    let word = word.strip_prefix('~').unwrap_or(word);
    word.strip_prefix('/').is_some_and(|rest| {
        let mut parts = rest.split('/');
        parts.next().is_some_and(|first| !first.is_empty()) && parts.next().is_some_and(|second| !second.is_empty())
    })
}

/// Dynamo names a worker by its etcd lease id: a 64-bit number, written in decimal (up to 20
/// digits; ids in practice have 19) or in hex in its keys (16 digits, 15 when the first is a
/// zero left out). A run of 16 or more digits is taken for one, and so is one of 15 or 16 hex
/// digits with a digit among them; glued to a word (`decode_7668682560356784121`,
/// `generate:694d9a3f2d3e7f11`), too.
fn is_instance_id(token: &str) -> bool {
    let decimal = token.len() >= 16 && token.bytes().all(|b| b.is_ascii_digit());
    let hex = (15..=16).contains(&token.len())
        && token.bytes().all(|b| b.is_ascii_hexdigit())
        && token.bytes().any(|b| b.is_ascii_digit());
    decimal || hex
}

fn token_is_address(token: &str) -> bool {
    // Sentence punctuation around a token ("… at 10.0.0.7.") is not part of it.
    let token = token.trim_end_matches(['.', ':']);
    let unzoned = token.split('%').next().unwrap_or(token);
    unzoned.trim_matches(['[', ']']).parse::<IpAddr>().is_ok()
        || token.parse::<SocketAddr>().is_ok()
        || is_host_with_port(token)
        || is_internal_host(token)
}

/// `name:port`, where the name has a letter and the port is a number (`decode-0:8000`).
fn is_host_with_port(token: &str) -> bool {
    token.rsplit_once(':').is_some_and(|(host, port)| {
        is_host_name(host) && !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
    })
}

fn is_internal_host(token: &str) -> bool {
    let name = token.to_ascii_lowercase();
    is_host_name(&name) && (name == "localhost" || INTERNAL_SUFFIXES.iter().any(|suffix| name.ends_with(suffix)))
}

fn is_host_name(name: &str) -> bool {
    name.bytes().any(|b| b.is_ascii_alphabetic())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_refusals_naming_no_address_are_relayed_and_everything_else_is_withheld() {
        use RefusalBody::*;
        let rows: [(&str, RefusalBody); 38] = [
            // The real 1.6.1 frontend's refusal of a client's malformed body.
            (
                r#"{"message":"Failed to deserialize the JSON body into the target type: key must be a string at line 1 column 2","type":"Bad Request","code":400}"#,
                Relayed,
            ),
            (r#"{"error":{"message":"max_tokens must be at least 1","type":"invalid_request_error"}}"#, Relayed),
            (r#"{"message":"expected `:` at line 1 column 9","code":400}"#, Relayed),
            (r#"{"message":"the 3.5 model: no such thing","code":422}"#, Relayed),
            ("", Unreadable),
            ("<html><body><h1>413 Request Entity Too Large</h1><hr>nginx</body></html>", Withheld),
            ("Bad Request", Withheld),
            (r#"["a list"]"#, Withheld),
            (r#""a string""#, Withheld),
            (r#"{"message":"truncated"#, Withheld),
            (r#"{"message":"upstream 10.0.3.7 refused"}"#, Withheld),
            (r#"{"message":"upstream 10.0.3.7:8000 refused"}"#, Withheld),
            (r#"{"message":"upstream at 10.0.3.7."}"#, Withheld),
            (r#"{"message":"no route to fd00:10::7"}"#, Withheld),
            (r#"{"message":"no route to [fd00::7]:9000"}"#, Withheld),
            (r#"{"message":"no route to fe80::1%eth0"}"#, Withheld),
            (r#"{"message":"see http://decode-0/health"}"#, Withheld),
            (r#"{"message":"decode-0:8000 refused"}"#, Withheld),
            (r#"{"message":"decode-0.dynamo.svc refused"}"#, Withheld),
            (r#"{"message":"localhost said no"}"#, Withheld),
            (r#"{"detail":{"hosts":["ok","frontend-1.internal"]}}"#, Withheld),
            (r#"{"decode-0:8000":"a key names it"}"#, Withheld),
            // A worker's id, in decimal as 1.6.1 logs it or in hex as its etcd keys do.
            (r#"{"message":"nvext.prefill_worker_id=7668682560356784121 does not identify a known worker"}"#, Withheld),
            (r#"{"message":"no instance 694d9a3f2d3e7f11"}"#, Withheld),
            (r#"{"error":{"message":"bad request","decode_worker_id":7668682560356784121}}"#, Withheld),
            (r#"{"decode_worker_id":7668682560356784121}"#, Withheld),
            (r#"{"message":"no worker decode_7668682560356784121"}"#, Withheld),
            (r#"{"message":"endpoint generate:694d9a3f2d3e7f11 is gone"}"#, Withheld),
            (r#"{"message":"no instance 94d9a3f2d3e7f11"}"#, Withheld),
            // A key written twice is checked as its last copy: see `a_key_written_twice_goes_out_as_checked`.
            (r#"{"message":"upstream 10.0.3.7:8000 refused","message":"bad"}"#, Relayed),
            (r#"{"message":"too long","code":400,"limit":131072}"#, Relayed),
            (r#"{"message":"max_tokens 4096 exceeds 2048 for request 1234"}"#, Relayed),
            // Paths on the frontend's or a worker's machine.
            (r#"{"message":"failed to read /tmp/dynpeer/tinymodel/tokenizer_config.json"}"#, Withheld),
            (r#"{"message":"no such file: '/models/tiny'"}"#, Withheld),
            (r#"{"message":"see ~/.cache/huggingface"}"#, Withheld),
            (r#"{"message":"content must be text and/or image_url"}"#, Relayed),
            (r#"{"message":"expected application/json, not text/plain"}"#, Relayed),
            (r#"{"message":"a / on its own, or 1/2"}"#, Relayed),
        ];
        for (body, expected) in rows {
            assert_eq!(relayable(body.as_bytes()).err().unwrap_or(Relayed), expected, "{body}");
        }
    }

    /// Of a key written twice, a JSON reader takes one copy (serde_json the last, others the
    /// first): the body relayed is the one checked, so the other never reaches the client.
    #[test]
    fn a_key_written_twice_goes_out_as_checked() -> anyhow::Result<()> {
        let body = br#"{"error":{"message":"upstream 10.0.3.7:8000 refused","message":"bad request"}}"#;
        let relayed = relayable(body).map_err(|fate| anyhow::anyhow!("{fate:?}"))?.to_string();
        assert_eq!(relayed, r#"{"error":{"message":"bad request"}}"#);
        Ok(())
    }

    #[test]
    fn refusals_not_in_openais_shape_are_put_in_it_with_their_own_words() {
        let rows: [(&str, Option<&str>); 5] = [
            (r#"{"error":{"message":"max_tokens must be at least 1","type":"invalid_request_error"}}"#, None),
            (
                r#"{"message":"Failed to deserialize the JSON body","type":"Bad Request","code":400}"#,
                Some("Failed to deserialize the JSON body"),
            ),
            (r#"{"object":"error","message":"bad n","type":"BadRequestError","code":400}"#, Some("bad n")),
            (r#"{"detail":"Not Found"}"#, Some("Not Found")),
            (r#"{"error":"no"}"#, Some(r#"{"error":"no"}"#)),
        ];
        for (body, words) in rows {
            let value: Value = serde_json::from_str(body).unwrap_or_default();
            assert_eq!(backend_words(&value).as_deref(), words, "{body}");
        }
    }
}
