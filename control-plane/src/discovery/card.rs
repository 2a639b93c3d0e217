//! A worker's model card: the typed subset the router reads, plus the full card kept opaquely
//! as its compact JSON text (bounded by [`MAX_RETAINED_CARD_BYTES`]) so later consumers can read
//! fields without a schema change. Text, not a parsed tree: a tree of small values takes tens of
//! times its text's bytes, and the bound is meant in bytes held.
//!
//! The typed subset follows Dynamo's N-2 window: every field optional, unknown fields ignored.
//! If the subset still fails to deserialise, the card keeps its raw form and no typed fields.

use std::sync::Arc;

use continuum_proto::model::{Capacity, CheckedFile, ModelArtifacts, PromptDefaults, Role};

use super::fleet::{MAX_NAME_BYTES, MAX_PATH_BYTES};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// The largest card kept opaquely. A larger card keeps only its typed subset.
pub const MAX_RETAINED_CARD_BYTES: usize = 1024 * 1024;
/// The most bytes of opaque cards held at once, every worker's together: 16 KiB for each of
/// [`MAX_RECORDS_PER_KEYSPACE`](super::MAX_RECORDS_PER_KEYSPACE) cards (Dynamo 1.6.1's are
/// under 2 KiB). Without it, cards just under the per-card bound would hold 16 GiB. A card
/// past it keeps only its typed subset, as an oversized one does, until others leave room.
pub const MAX_RETAINED_CARDS_BYTES: usize = 256 * 1024 * 1024;

/// A parsed model card.
#[derive(Clone, Debug, PartialEq)]
pub struct Card {
    pub typed: TypedCard,
    /// Why the typed subset could not be read, when it could not.
    pub typed_error: Option<String>,
    /// The card verbatim (compact JSON), unless it was larger than [`MAX_RETAINED_CARD_BYTES`].
    pub raw: Option<Arc<str>>,
    /// The card's serialised size when it was too large to keep.
    pub dropped_bytes: Option<usize>,
    /// The release the card names, for diagnostics (cut as an excerpt).
    pub release: Option<String>,
    /// The first typed field past its bound (`MAX_NAME_BYTES`, `MAX_PATH_BYTES`), as the
    /// worker's field it names, and its length. Such fields are not kept: a card may be as
    /// large as an etcd value, and the store holds it as long as its key lives.
    pub oversized: Option<(&'static str, usize)>,
}

/// The card fields the router uses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct TypedCard {
    pub display_name: Option<String>,
    /// The model's name where a card has no `display_name` (the seed: "display_name, then
    /// name"); 1.6.1's cards all have one.
    pub name: Option<String>,
    pub worker_type: Option<String>,
    pub kv_cache_block_size: Option<u32>,
    pub model_suffix: Option<String>,
    pub context_length: Option<u64>,
    /// The model's own limit from its config; what the card falls back to when the engine did
    /// not state a serving limit (the 1.6.1 mocker writes `context_length: 0` beside 4096 here).
    pub architectural_max_context_length: Option<u64>,
    pub runtime_config: Option<RuntimeConfig>,
    /// `{hf_tokenizer_json: CheckedFile}`.
    pub tokenizer: Option<ArtifactSlot>,
    /// `{hf_tokenizer_config_json: CheckedFile}`: the chat template and special tokens.
    pub prompt_formatter: Option<ArtifactSlot>,
    /// The chat template, when it lives in its own file.
    pub chat_template_file: Option<ArtifactSlot>,
}

impl TypedCard {
    /// Drops every field past its bound; the first one found, as the worker's field it names,
    /// with its length.
    fn drop_oversized(&mut self) -> Option<(&'static str, usize)> {
        let mut first = None;
        let mut check = |field: &mut Option<String>, name: &'static str, bound: usize| {
            if let Some(bytes) = field.as_ref().map(String::len).filter(|&bytes| bytes > bound) {
                *field = None;
                first.get_or_insert((name, bytes));
            }
        };
        check(&mut self.display_name, "model name", MAX_NAME_BYTES);
        check(&mut self.name, "model name", MAX_NAME_BYTES);
        // Read only for what it claims: no real value comes near the bound.
        check(&mut self.worker_type, "worker type", MAX_NAME_BYTES);
        // Read only for whether there is one (an adapter's card, skipped whatever its size).
        if let Some(suffix) = self.model_suffix.as_mut().filter(|suffix| suffix.len() > MAX_NAME_BYTES) {
            *suffix = "…".into();
        }
        if let Some(rc) = &mut self.runtime_config {
            check(&mut rc.disaggregated_endpoint, "disaggregated endpoint", MAX_NAME_BYTES);
        }
        for slot in [&mut self.tokenizer, &mut self.prompt_formatter, &mut self.chat_template_file] {
            let Some(ArtifactSlot(Some(file))) = slot else { continue };
            let (path, checksum) = (file.uri.len(), file.checksum.len());
            if path > MAX_PATH_BYTES || checksum > MAX_PATH_BYTES {
                first.get_or_insert(if path > MAX_PATH_BYTES {
                    ("artifact path", path)
                } else {
                    ("artifact checksum", checksum)
                });
                *slot = None;
            }
        }
        first
    }
}

/// One of a card's artifact slots: an externally tagged enum (`{"hf_tokenizer_json": {..}}`).
/// Only the Hugging Face kinds a replica can render with are kept; any other kind (GGUF, a
/// newer Dynamo's) reads as absent, so the model is scored without a KV term.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArtifactSlot(pub Option<CheckedFile>);

/// The slot kinds a replica renders with: tokenizer.json, tokenizer_config.json, a Jinja file.
const RENDERABLE_KINDS: [&str; 3] = ["hf_tokenizer_json", "hf_tokenizer_config_json", "hf_chat_template"];

impl<'de> Deserialize<'de> for ArtifactSlot {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Record {
            path: String,
            checksum: String,
            #[serde(default)]
            size: u64,
        }
        // Each kind's value as its text, not a tree: another kind's may be anything, of any size.
        let tagged = std::collections::BTreeMap::<String, Box<RawValue>>::deserialize(deserializer)?;
        let file = tagged
            .into_iter()
            .filter(|(kind, raw)| {
                RENDERABLE_KINDS.contains(&kind.as_str()) && raw.get().len() <= MAX_LENIENT_FIELD_BYTES
            })
            .find_map(|(_, raw)| serde_json::from_str::<Record>(raw.get()).ok());
        Ok(Self(file.map(|r| CheckedFile { uri: r.path, checksum: r.checksum, size: r.size })))
    }
}

/// `card_json.runtime_config`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct RuntimeConfig {
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub context_length: Option<u64>,
    pub data_parallel_size: Option<u32>,
    pub data_parallel_start_rank: Option<u32>,
    #[serde(deserialize_with = "disaggregated_endpoint")]
    pub disaggregated_endpoint: Option<String>,
    /// Dynamo's default is true; a value that is not a bool reads as absent.
    #[serde(deserialize_with = "lenient_bool")]
    pub exclude_tools_when_tool_choice_none: Option<bool>,
    /// `runtime_data.default_thinking_mode`: "enabled" or "disabled" (any other value is
    /// ignored, as the frontend ignores it).
    #[serde(rename = "runtime_data", deserialize_with = "default_thinking_mode")]
    pub default_thinking: Option<bool>,
}

/// The fields a card may name its release in, in the order [`Card::parse`] looks: borrowed as
/// written, so that a huge one costs nothing to skip.
#[derive(Deserialize, Default)]
#[serde(default)]
struct ReleaseFields<'a> {
    #[serde(borrow)]
    dynamo_version: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    runtime_version: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    version: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    release: Option<&'a serde_json::value::RawValue>,
}

impl ReleaseFields<'_> {
    /// The first that is a string, cut as an excerpt.
    fn first(&self) -> Option<String> {
        [self.dynamo_version, self.runtime_version, self.version, self.release]
            .into_iter()
            .flatten()
            .find_map(|raw| serde_json::from_str::<String>(raw.get()).ok())
            .map(|text| super::records::excerpt(&text))
    }
}

/// Fields of a card set aside as unreadable, at most, before the typed subset is given up.
const MAX_UNREADABLE_FIELDS: usize = 8;

/// Why a card that is no JSON object has no typed fields.
const NOT_AN_OBJECT: &str = "a model card is a JSON object";

/// The card's typed subset, each unreadable field set aside rather than all of them (a newer
/// Dynamo writing `kv_cache_block_size: "16"` must not cost the card its role, and the worker
/// its routing), and why the first was unreadable.
fn typed_leniently(card_json: &Value) -> (TypedCard, Option<String>) {
    // serde reads a struct from an array too, field by field in order: a card is an object.
    if !card_json.is_object() {
        return (TypedCard::default(), Some(NOT_AN_OBJECT.to_string()));
    }
    let mut card = std::borrow::Cow::Borrowed(card_json);
    let mut first_error = None;
    for _ in 0..=MAX_UNREADABLE_FIELDS {
        match serde_path_to_error::deserialize::<_, TypedCard>(&*card) {
            Ok(typed) => return (typed, first_error),
            Err(error) => {
                // serde quotes the value it refused, which a card may make megabytes long.
                first_error.get_or_insert_with(|| super::records::excerpt(&error.to_string()));
                if !remove_field(card.to_mut(), error.path()) {
                    break;
                }
            }
        }
    }
    (TypedCard::default(), first_error)
}

/// Removes the object member `path` names from `value`; whether there was one.
fn remove_field(value: &mut Value, path: &serde_path_to_error::Path) -> bool {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let Some((Segment::Map { key }, parents)) = segments.split_last() else { return false };
    let mut at = value;
    for segment in parents {
        at = match (segment, at) {
            (Segment::Map { key }, Value::Object(members)) => match members.get_mut(key) {
                Some(member) => member,
                None => return false,
            },
            (Segment::Seq { index }, Value::Array(items)) => match items.get_mut(*index) {
                Some(item) => item,
                None => return false,
            },
            _ => return false,
        };
    }
    at.as_object_mut().is_some_and(|members| members.remove(key).is_some())
}

impl Card {
    /// Parses `card_json` (`null` when the record has none), a card at most
    /// [`MAX_RETAINED_CARD_BYTES`] as it came (a larger one is [`Self::unretained`]).
    pub fn parse(card_json: Value) -> Self {
        if card_json.is_null() {
            return Self {
                typed: TypedCard::default(),
                typed_error: None,
                raw: None,
                dropped_bytes: None,
                release: None,
                oversized: None,
            };
        }
        let (mut typed, typed_error) = typed_leniently(&card_json);
        let release = ["dynamo_version", "runtime_version", "version", "release"]
            .into_iter()
            .find_map(|field| card_json.get(field)?.as_str())
            .map(super::records::excerpt);
        // The size it came in vouches for a card only loosely (serde_json writes `1e15` back as
        // `1000000000000000.0`), so a card is kept only as long as it is written.
        let (raw, dropped_bytes) = match serde_json::to_string(&card_json) {
            Ok(text) if text.len() <= MAX_RETAINED_CARD_BYTES => (Some(Arc::from(text)), None),
            Ok(text) => (None, Some(text.len())),
            Err(_) => (None, Some(usize::MAX)),
        };
        let oversized = typed.drop_oversized();
        Self { typed, typed_error, raw, dropped_bytes, release, oversized }
    }

    /// The card of a value too large to keep it (past [`MAX_RETAINED_CARD_BYTES`]), from its
    /// text as written, without a tree: its typed subset read strictly (an unreadable field
    /// costs the whole subset, where [`Self::parse`] sets aside just that field, which takes a
    /// tree to do), its size as written.
    pub fn unretained(text: &str) -> Self {
        let (mut typed, typed_error) = match serde_json::from_str::<TypedCard>(text) {
            _ if !text.trim_ascii_start().starts_with('{') => (TypedCard::default(), Some(NOT_AN_OBJECT.to_string())),
            Ok(typed) => (typed, None),
            Err(error) => (TypedCard::default(), Some(super::records::excerpt(&error.to_string()))),
        };
        let release = serde_json::from_str::<ReleaseFields<'_>>(text).ok().and_then(|fields| fields.first());
        let oversized = typed.drop_oversized();
        Self { typed, typed_error, raw: None, dropped_bytes: Some(text.len()), release, oversized }
    }

    /// A card with a non-empty `model_suffix` describes a LoRA adapter, not a worker's base model.
    pub fn is_adapter(&self) -> bool {
        self.typed.model_suffix.as_deref().is_some_and(|s| !s.is_empty())
    }

    /// The role `worker_type` claims, read case-insensitively; unknown values claim none.
    pub fn role_claim(&self) -> Option<Role> {
        let worker_type = self.typed.worker_type.as_deref()?;
        [Role::Prefill, Role::Decode, Role::Aggregated]
            .into_iter()
            .find(|r| r.as_str().eq_ignore_ascii_case(worker_type))
    }

    /// Advertised capacities. Dynamo writes 0 for "not known" (the 1.6.1 mocker's
    /// `context_length`), and no capacity of 0 is a usable limit, so 0 reads as absent.
    pub fn capacity(&self) -> Capacity {
        let rc = self.runtime_config();
        Capacity {
            total_kv_blocks: nonzero(rc.total_kv_blocks),
            max_num_batched_tokens: nonzero(rc.max_num_batched_tokens),
            max_num_seqs: nonzero(rc.max_num_seqs),
            context_length: nonzero(rc.context_length)
                .or(nonzero(self.typed.context_length))
                .or(nonzero(self.typed.architectural_max_context_length)),
        }
    }

    /// The files a replica renders prompts with; `None` when the card names none.
    pub fn artifacts(&self) -> Option<ModelArtifacts> {
        let slot = |s: &Option<ArtifactSlot>| s.as_ref().and_then(|s| s.0.clone());
        let artifacts = ModelArtifacts {
            tokenizer: slot(&self.typed.tokenizer),
            tokenizer_config: slot(&self.typed.prompt_formatter),
            chat_template: slot(&self.typed.chat_template_file),
            defaults: self.prompt_defaults(),
        };
        artifacts.has_files().then_some(artifacts)
    }

    fn prompt_defaults(&self) -> PromptDefaults {
        let rc = self.runtime_config();
        PromptDefaults {
            keep_tools_when_tool_choice_none: rc.exclude_tools_when_tool_choice_none == Some(false),
            default_thinking: rc.default_thinking,
        }
    }

    pub fn block_size(&self) -> Option<u32> {
        self.typed.kv_cache_block_size.filter(|&b| b > 0)
    }

    pub fn runtime_config(&self) -> &RuntimeConfig {
        static EMPTY: RuntimeConfig = RuntimeConfig {
            total_kv_blocks: None,
            max_num_batched_tokens: None,
            max_num_seqs: None,
            context_length: None,
            data_parallel_size: None,
            data_parallel_start_rank: None,
            disaggregated_endpoint: None,
            exclude_tools_when_tool_choice_none: None,
            default_thinking: None,
        };
        self.typed.runtime_config.as_ref().unwrap_or(&EMPTY)
    }
}

fn nonzero(value: Option<u64>) -> Option<u64> {
    value.filter(|&v| v > 0)
}

/// The text of a field read leniently (a name, a flag, a small object) past which it reads as
/// absent: such a field is read through a tree, which takes some eighty times its text, and a
/// card past [`MAX_RETAINED_CARD_BYTES`] is otherwise read without one. The bound is that size,
/// so no field costs more than a card read whole does.
const MAX_LENIENT_FIELD_BYTES: usize = MAX_RETAINED_CARD_BYTES;

/// A field's value as a tree, `None` if its text is past [`MAX_LENIENT_FIELD_BYTES`] (its text is
/// copied, but no tree is built) or it is no JSON value.
fn small_value<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    let raw = Box::<RawValue>::deserialize(deserializer)?;
    Ok(match raw.get().len() <= MAX_LENIENT_FIELD_BYTES {
        true => serde_json::from_str(raw.get()).ok(),
        false => None,
    })
}

/// The seed documents a string (`dynamo/decode/generate`); SGLang prefill workers write
/// `{bootstrap_host, bootstrap_port}`. Both are kept as text; other shapes read as absent
/// rather than failing the whole typed subset.
fn disaggregated_endpoint<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    Ok(match small_value(deserializer)? {
        Some(Value::String(text)) => Some(text),
        Some(Value::Object(fields)) => match (fields.get("bootstrap_host"), fields.get("bootstrap_port")) {
            (Some(Value::String(host)), Some(Value::Number(port))) => Some(format!("{host}:{port}")),
            (Some(Value::String(host)), _) => Some(host.clone()),
            _ => None,
        },
        _ => None,
    })
}

fn lenient_bool<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<bool>, D::Error> {
    Ok(small_value(deserializer)?.and_then(|value| value.as_bool()))
}

fn default_thinking_mode<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<bool>, D::Error> {
    let data = small_value(deserializer)?.unwrap_or_default();
    Ok(match data.get("default_thinking_mode").and_then(Value::as_str) {
        Some("enabled") => Some(true),
        Some("disabled") => Some(false),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_card_is_kept_only_as_long_as_it_is_written_whatever_the_value_it_came_in() {
        // `1e15` is 4 bytes in the etcd value and 18 as serde_json writes it back.
        let numbers = Value::from(vec![1e15; MAX_RETAINED_CARD_BYTES / 5]);
        let card = Card::parse(json!({ "pad": numbers }));
        assert!(card.raw.is_none(), "a card written past the bound is not kept");
        assert!(card.dropped_bytes.is_some_and(|size| size > MAX_RETAINED_CARD_BYTES), "{:?}", card.dropped_bytes);
        let small = Card::parse(json!({"worker_type": "decode"}));
        assert_eq!(small.raw.as_deref(), Some(r#"{"worker_type":"decode"}"#));
    }

    #[test]
    fn worker_type_claims_a_role_case_insensitively() {
        let cases = [
            (json!({"worker_type": "prefill"}), Some(Role::Prefill)),
            (json!({"worker_type": "Prefill"}), Some(Role::Prefill)),
            (json!({"worker_type": "DECODE"}), Some(Role::Decode)),
            (json!({"worker_type": "aggregated"}), Some(Role::Aggregated)),
            (json!({"worker_type": "encoder"}), None),
            (json!({"worker_type": null}), None),
            (json!({}), None),
        ];
        for (card, want) in cases {
            assert_eq!(Card::parse(card.clone()).role_claim(), want, "{card}");
        }
    }

    #[test]
    fn prompt_defaults_follow_the_runtime_config_and_ignore_what_the_frontend_ignores() {
        let tokenizer = json!({"hf_tokenizer_json": {"path": "/m/tokenizer.json", "checksum": "blake3:00", "size": 2}});
        let keep = |defaults: PromptDefaults| defaults.keep_tools_when_tool_choice_none;
        let cases = [
            (json!({}), false, None),
            (
                json!({"exclude_tools_when_tool_choice_none": true, "runtime_data": {"output_replay_consumer": true}}),
                false,
                None,
            ),
            (json!({"exclude_tools_when_tool_choice_none": false}), true, None),
            (json!({"exclude_tools_when_tool_choice_none": "no"}), false, None),
            (json!({"runtime_data": {"default_thinking_mode": "enabled"}}), false, Some(true)),
            (json!({"runtime_data": {"default_thinking_mode": "disabled"}}), false, Some(false)),
            (json!({"runtime_data": {"default_thinking_mode": "Enabled"}}), false, None),
            (json!({"runtime_data": null}), false, None),
        ];
        for (runtime_config, keeps_tools, thinking) in cases {
            let card = Card::parse(json!({"runtime_config": runtime_config, "tokenizer": tokenizer}));
            assert_eq!(card.typed_error, None, "{runtime_config}");
            let defaults = card.artifacts().expect("a tokenizer").defaults;
            assert_eq!(keep(defaults), keeps_tools, "{runtime_config}");
            assert_eq!(defaults.default_thinking, thinking, "{runtime_config}");
        }
        let no_files = Card::parse(json!({"runtime_config": {"exclude_tools_when_tool_choice_none": false}}));
        assert_eq!(no_files.artifacts(), None, "defaults alone render nothing");
    }

    /// A field past its bound is not kept, whatever the card's size: only its name and length,
    /// which exclude the worker.
    #[test]
    fn a_field_past_its_bound_is_dropped_and_named() {
        let long = "n".repeat(4 << 20);
        let card = Card::parse(json!({"display_name": long, "worker_type": "decode"}));
        assert_eq!(card.typed.display_name, None);
        assert_eq!(card.oversized, Some(("model name", 4 << 20)));
        assert_eq!(card.role_claim(), Some(Role::Decode), "the rest of the card stands");

        let path = "p".repeat(MAX_PATH_BYTES + 1);
        let file = json!({"hf_tokenizer_json": {"path": path, "checksum": "blake3:00"}});
        let card = Card::parse(json!({"display_name": "tiny", "tokenizer": file}));
        assert_eq!(card.oversized, Some(("artifact path", MAX_PATH_BYTES + 1)));
        assert_eq!((card.typed.tokenizer, card.typed.display_name.as_deref()), (None, Some("tiny")));

        let card = Card::parse(json!({"display_name": "n".repeat(MAX_NAME_BYTES)}));
        assert_eq!((card.oversized, card.typed.display_name.map(|n| n.len())), (None, Some(MAX_NAME_BYTES)));

        // An adapter's card stays one, however long its suffix: skipped, not a worker excluded.
        let card = Card::parse(json!({"display_name": "tiny", "model_suffix": "s".repeat(4 << 10)}));
        assert!(card.is_adapter());
        assert_eq!((card.oversized, card.typed.model_suffix.map(|s| s.len() <= MAX_NAME_BYTES)), (None, Some(true)));
    }

    #[test]
    fn disaggregated_endpoint_accepts_text_and_bootstrap_objects() {
        let cases = [
            (json!("dynamo/decode/generate"), Some("dynamo/decode/generate")),
            (json!({"bootstrap_host": "10.0.0.4", "bootstrap_port": 8998}), Some("10.0.0.4:8998")),
            (json!({"bootstrap_host": "10.0.0.4", "bootstrap_port": null}), Some("10.0.0.4")),
            (json!(42), None),
            (json!(null), None),
        ];
        for (value, want) in cases {
            let card = Card::parse(json!({"runtime_config": {"disaggregated_endpoint": value}}));
            assert_eq!(card.typed_error, None);
            assert_eq!(card.runtime_config().disaggregated_endpoint.as_deref(), want, "{value}");
        }
    }

    #[test]
    fn zero_capacities_read_as_absent() {
        let card = Card::parse(json!({"kv_cache_block_size": 0, "context_length": 4096,
                   "runtime_config": {"total_kv_blocks": 0, "max_num_seqs": 8, "context_length": 0}}));
        let want = Capacity { max_num_seqs: Some(8), context_length: Some(4096), ..Capacity::default() };
        assert_eq!((card.capacity(), card.block_size()), (want, None));
    }

    #[test]
    fn an_unreadable_field_costs_only_itself_and_the_raw_card_is_kept() {
        let raw = json!({"display_name": "tiny", "kv_cache_block_size": "sixteen", "worker_type": "prefill",
                         "runtime_config": {"total_kv_blocks": "many", "max_num_seqs": 8}});
        let card = Card::parse(raw.clone());
        assert!(
            card.typed_error.as_deref().is_some_and(|e| e.contains("kv_cache_block_size")),
            "{:?}",
            card.typed_error
        );
        assert_eq!(card.role_claim(), Some(Role::Prefill), "the other fields are read");
        assert_eq!(card.block_size(), None);
        assert_eq!(card.capacity(), Capacity { max_num_seqs: Some(8), ..Capacity::default() });
        let kept: Option<Value> = card.raw.as_deref().and_then(|text| serde_json::from_str(text).ok());
        assert_eq!(kept, Some(raw), "kept whole, as compact text");
        // A card that is no object at all has no typed subset.
        // (serde would read one from an array, field by field).
        let card = Card::parse(json!(["not", "a", "card"]));
        assert!(card.typed_error.is_some());
        assert_eq!(card.typed, TypedCard::default());
        let card = Card::unretained(r#" ["shown", "named", "decode"]"#);
        assert_eq!((card.typed_error.as_deref(), card.typed), (Some(NOT_AN_OBJECT), TypedCard::default()));
    }
}
