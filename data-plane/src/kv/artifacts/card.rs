//! What a worker's model card says about its tokenizer and chat template: `CheckedFile` slots
//! (`{path, checksum: "blake3:<64 hex>", size}`) under `tokenizer.hf_tokenizer_json`,
//! `prompt_formatter.hf_tokenizer_config_json` and, optionally, `chat_template_file.hf_chat_template`.
//! Parsed into domain types here, at the edge; nothing is read or fetched.

use std::fmt;
use std::str::FromStr;

use continuum_proto::model::PromptDefaults;
use serde_json::Value;

/// A blake3 digest, written `blake3:<64 lowercase hex>` on cards and in `pinned_artifacts`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Checksum([u8; 32]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checksum {0:?} is not of the form blake3:<64 hex digits>")]
pub struct ChecksumError(pub String);

impl Checksum {
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Whether `bytes` hash to this checksum (compared in constant time by blake3).
    pub fn matches(&self, bytes: &[u8]) -> bool {
        blake3::hash(bytes) == blake3::Hash::from_bytes(self.0)
    }

    /// The 64 hex digits, which name the blob in the artifact cache.
    pub fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl FromStr for Checksum {
    type Err = ChecksumError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let error = || ChecksumError(s.chars().take(80).collect());
        let hex = s.strip_prefix("blake3:").ok_or_else(error)?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(error());
        }
        blake3::Hash::from_hex(hex.to_ascii_lowercase()).map(|h| Self(*h.as_bytes())).map_err(|_| error())
    }
}

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blake3:{}", self.hex())
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One artifact slot of a card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedFile {
    /// A local path, `file://`, `http(s)://` or `hf://` URI.
    pub path: String,
    pub checksum: Checksum,
    /// The size the card declares, if any; the checksum is what is trusted.
    pub size: Option<u64>,
}

/// The artifacts one worker's card names for its model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelArtifacts {
    /// `tokenizer.json`.
    pub tokenizer: CheckedFile,
    /// `tokenizer_config.json`: the chat template (unless `chat_template` is set) and bos/eos.
    pub tokenizer_config: CheckedFile,
    /// A separate `chat_template.jinja`, which takes precedence over the config's template.
    pub chat_template: Option<CheckedFile>,
    /// What the card's `runtime_config` asks of a request before the template renders it.
    pub defaults: PromptDefaults,
}

/// The identity of a loaded tokenizer and template: every checksum that shaped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ArtifactKey {
    pub tokenizer: Checksum,
    pub tokenizer_config: Checksum,
    pub chat_template: Option<Checksum>,
}

impl ArtifactKey {
    pub fn checksums(&self) -> impl Iterator<Item = Checksum> {
        [Some(self.tokenizer), Some(self.tokenizer_config), self.chat_template].into_iter().flatten()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CardError {
    #[error("the card has no {0} slot, so the router cannot tokenize for it")]
    Missing(&'static str),
    #[error("the card's {slot} is a {kind:?} artifact; only Hugging Face JSON and Jinja files are supported")]
    Unsupported { slot: &'static str, kind: String },
    #[error("the card's {slot} slot is malformed: {reason}")]
    Malformed { slot: &'static str, reason: String },
}

impl ModelArtifacts {
    /// Reads the slots of a card's JSON (`card_json` in the `v1/mdc/...` record), with Dynamo's
    /// prompt defaults (the control plane reads a card's own).
    pub fn from_card(card: &Value) -> Result<Self, CardError> {
        Ok(Self {
            tokenizer: slot(card, "tokenizer", "hf_tokenizer_json")?.ok_or(CardError::Missing("tokenizer"))?,
            tokenizer_config: slot(card, "prompt_formatter", "hf_tokenizer_config_json")?
                .ok_or(CardError::Missing("prompt_formatter"))?,
            chat_template: slot(card, "chat_template_file", "hf_chat_template")?,
            defaults: PromptDefaults::default(),
        })
    }

    /// The slots as the control plane streams them (already narrowed to the Hugging Face kinds).
    pub fn from_fleet(artifacts: &continuum_proto::model::ModelArtifacts) -> Result<Self, CardError> {
        let file = |slot: &'static str, f: &continuum_proto::model::CheckedFile| -> Result<CheckedFile, CardError> {
            let checksum =
                f.checksum.parse().map_err(|e: ChecksumError| CardError::Malformed { slot, reason: e.to_string() })?;
            Ok(CheckedFile { path: f.uri.clone(), checksum, size: Some(f.size) })
        };
        let required = |slot: &'static str, f: &Option<continuum_proto::model::CheckedFile>| {
            f.as_ref().ok_or(CardError::Missing(slot)).and_then(|f| file(slot, f))
        };
        Ok(Self {
            tokenizer: required("tokenizer", &artifacts.tokenizer)?,
            tokenizer_config: required("prompt_formatter", &artifacts.tokenizer_config)?,
            chat_template: artifacts.chat_template.as_ref().map(|f| file("chat_template_file", f)).transpose()?,
            defaults: artifacts.defaults,
        })
    }

    pub fn key(&self) -> ArtifactKey {
        ArtifactKey {
            tokenizer: self.tokenizer.checksum,
            tokenizer_config: self.tokenizer_config.checksum,
            chat_template: self.chat_template.as_ref().map(|f| f.checksum),
        }
    }

    pub fn files(&self) -> impl Iterator<Item = &CheckedFile> {
        [Some(&self.tokenizer), Some(&self.tokenizer_config), self.chat_template.as_ref()].into_iter().flatten()
    }
}

/// The key every worker serving a model agrees on, or `None` when there are no workers or they
/// disagree, on the files or on the prompt defaults (a rolling upgrade): then the model is
/// scored without a KV term. (A prefill worker's card carries the defaults its model renders
/// with, not its own: see `ingress::kv`.)
pub fn fleet_key<'a>(cards: impl IntoIterator<Item = &'a ModelArtifacts>) -> Option<ArtifactKey> {
    let mut keys = cards.into_iter().map(|card| (card.key(), card.defaults));
    let first = keys.next()?;
    keys.all(|k| k == first).then_some(first.0)
}

fn slot(card: &Value, slot: &'static str, kind: &str) -> Result<Option<CheckedFile>, CardError> {
    let Some(value) = card.get(slot).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let malformed = |reason: &str| CardError::Malformed { slot, reason: reason.to_string() };
    let object = value.as_object().ok_or_else(|| malformed("not an object"))?;
    let Some(file) = object.get(kind) else {
        let kind = object.keys().next().cloned().unwrap_or_default();
        return Err(CardError::Unsupported { slot, kind });
    };
    let path = file.get("path").and_then(Value::as_str).ok_or_else(|| malformed("no path"))?;
    let checksum = file.get("checksum").and_then(Value::as_str).ok_or_else(|| malformed("no checksum"))?;
    let checksum = checksum.parse().map_err(|e: ChecksumError| malformed(&e.to_string()))?;
    let size = file.get("size").and_then(Value::as_u64);
    Ok(Some(CheckedFile { path: path.to_string(), checksum, size }))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    pub(crate) fn fixture_card() -> Value {
        let dump = crate::kv::tests::fixture("agg/etcd-dump.jsonl");
        let text = std::fs::read_to_string(dump).expect("the captured agg etcd dump");
        text.lines()
            .map(|line| serde_json::from_str::<Value>(line).expect("a JSON line"))
            .find(|record| record["key"].as_str().is_some_and(|k| k.starts_with("v1/mdc/")))
            .map(|record| record["value"]["card_json"].clone())
            .expect("the agg dump holds a model card")
    }

    #[test]
    fn real_card_names_tokenizer_and_config() {
        let artifacts = ModelArtifacts::from_card(&fixture_card()).unwrap();
        assert_eq!(artifacts.tokenizer.path, "/tmp/dynpeer/tinymodel/tokenizer.json");
        assert_eq!(
            artifacts.tokenizer.checksum.to_string(),
            "blake3:4b790d1231b2081593931289dcc9559ead3dd4d6df27357da278e0c93ec60884"
        );
        assert_eq!(artifacts.tokenizer.size, Some(252_970));
        assert!(artifacts.tokenizer_config.path.ends_with("tokenizer_config.json"));
        assert_eq!(artifacts.chat_template, None);
    }

    #[test]
    fn checksums_parse_strictly() {
        let hex = "4b790d1231b2081593931289dcc9559ead3dd4d6df27357da278e0c93ec60884";
        assert!(format!("blake3:{hex}").parse::<Checksum>().is_ok());
        assert_eq!(format!("blake3:{}", hex.to_uppercase()).parse::<Checksum>().unwrap().hex(), hex);
        for bad in [hex.to_string(), format!("sha256:{hex}"), format!("blake3:{}", &hex[1..]), format!("blake3:{hex}0")]
        {
            assert!(bad.parse::<Checksum>().is_err(), "{bad}");
        }
        assert!(Checksum::of(b"abc").matches(b"abc") && !Checksum::of(b"abc").matches(b"abd"));
    }

    #[test]
    fn gguf_tokenizers_are_unsupported() {
        let card = json!({"tokenizer": {"gguf": "/m.gguf"}, "prompt_formatter": {"gguf": "/m.gguf"}});
        assert!(matches!(ModelArtifacts::from_card(&card), Err(CardError::Unsupported { slot: "tokenizer", .. })));
        assert_eq!(ModelArtifacts::from_card(&json!({})), Err(CardError::Missing("tokenizer")));
    }

    #[test]
    fn fleet_agrees_only_on_one_key() {
        let a = ModelArtifacts::from_card(&fixture_card()).unwrap();
        let mut b = a.clone();
        assert_eq!(fleet_key([&a, &b]), Some(a.key()));
        b.defaults.default_thinking = Some(false);
        assert_eq!(fleet_key([&a, &b]), None, "workers that would render the prompt differently");
        let mut b = a.clone();
        b.chat_template = Some(CheckedFile { path: "/t.jinja".into(), checksum: Checksum::of(b"t"), size: None });
        assert_eq!(fleet_key([&a, &b]), None);
        assert_eq!(fleet_key([]), None);
    }
}
