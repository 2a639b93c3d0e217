use std::sync::LazyLock;

use proptest::prelude::*;
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::*;
use crate::kv::tests::fixture;

/// Llama 3's pre-tokenizer regex (Qwen 2's differs only in `\p{N}` against `\p{N}{1,3}`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tiny_json() -> Value {
    serde_json::from_slice(&std::fs::read(fixture("tinymodel/tokenizer.json")).unwrap()).unwrap()
}

/// The fixture's vocabulary and merges under Llama 3's pre-tokenizer and `ignore_merges`.
fn llama3_json() -> Value {
    let mut json = tiny_json();
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    json["model"]["ignore_merges"] = true.into();
    json
}

fn tokenizer(json: &Value) -> Tokenizer {
    Tokenizer::from_bytes(serde_json::to_vec(json).unwrap()).expect("a tokenizer")
}

fn theirs(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).expect("encodes").get_ids().to_vec()
}

fn mine(bpe: &ByteLevelBpe, text: &str) -> Option<Vec<u32>> {
    let mut ids = vec![7];
    bpe.encode(text, &mut ids)?;
    assert_eq!(ids.remove(0), 7, "appends after what was there");
    Some(ids)
}

#[test]
fn the_fixture_tokenizer_and_a_llama3_shaped_one_are_reproduced() {
    for json in [tiny_json(), llama3_json()] {
        let tokenizer = tokenizer(&json);
        let bpe = ByteLevelBpe::for_tokenizer(&tokenizer).expect("a configuration it reproduces");
        for text in ["", " ", "hello", "Hello world, it's me.\n\n  And you?  ", PROBE, &"lorem ipsum ".repeat(300)] {
            assert_eq!(mine(&bpe, text), Some(theirs(&tokenizer, text)), "{text:?}");
        }
    }
}

#[test]
fn ignore_merges_takes_a_word_in_the_vocabulary_whole() {
    let mut json = llama3_json();
    // The longest all-lowercase word of the vocabulary, and the last merge that makes it gone:
    // only `ignore_merges` can give it as one token now.
    let vocab = json["model"]["vocab"].as_object().unwrap().clone();
    let word =
        vocab.keys().filter(|token| token.bytes().all(|b| b.is_ascii_lowercase())).max_by_key(|t| t.len()).unwrap();
    let id = vocab[word].as_u64().unwrap() as u32;
    let merges = json["model"]["merges"].as_array_mut().unwrap();
    merges.retain(|merge| merge_pair(merge).is_none_or(|(left, right)| format!("{left}{right}") != *word));
    let tokenizer = tokenizer(&json);
    let bpe = ByteLevelBpe::for_tokenizer(&tokenizer).unwrap();
    assert_eq!(theirs(&tokenizer, word), vec![id]);
    assert_eq!(mine(&bpe, word), Some(vec![id]));
    json["model"]["ignore_merges"] = false.into();
    let merged_only = ByteLevelBpe::from_config(&json).unwrap();
    assert!(mine(&merged_only, word).is_some_and(|ids| ids.len() > 1), "{word:?} is not one merge away");
}

#[test]
fn an_nfc_normalizer_leaves_non_ascii_pieces_to_tokenizers() {
    let mut json = tiny_json();
    json["normalizer"] = json!({"type": "NFC"});
    let tokenizer = tokenizer(&json);
    let bpe = ByteLevelBpe::for_tokenizer(&tokenizer).expect("NFC is reproduced on ASCII");
    assert_eq!(mine(&bpe, "plain ascii text"), Some(theirs(&tokenizer, "plain ascii text")));
    assert_eq!(mine(&bpe, "Cafe\u{301}"), None, "a combining accent NFC would compose");
}

#[test]
fn a_byte_without_a_symbol_is_left_to_tokenizers() {
    let mut json = tiny_json();
    // U+0100 is byte 0x00's symbol; no merge of the fixture uses it.
    json["model"]["vocab"].as_object_mut().unwrap().remove("\u{100}");
    let bpe = ByteLevelBpe::from_config(&json).expect("still a configuration it reads");
    let mut ids = vec![1, 2];
    assert_eq!(bpe.encode("ab\0cd", &mut ids), None);
    assert_eq!(ids, vec![1, 2], "nothing appended");
    assert!(mine(&bpe, "abcd").is_some());
}

#[test]
fn other_configurations_are_declined_with_a_reason() {
    type Edit = fn(&mut Value);
    let cases: [(&str, Edit); 7] = [
        ("pre-tokenizer", |json| json["pre_tokenizer"]["add_prefix_space"] = true.into()),
        ("pre-tokenizer", |json| json["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁"})),
        ("pre-tokenizer", |json| {
            json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
            ]})
        }),
        ("normalizer", |json| json["normalizer"] = json!({"type": "Lowercase"})),
        ("dropout", |json| json["model"]["dropout"] = 0.1.into()),
        ("continuing_subword_prefix", |json| json["model"]["continuing_subword_prefix"] = "##".into()),
        ("model", |json| json["model"]["type"] = "WordPiece".into()),
    ];
    for (reason, edit) in cases {
        let mut json = tiny_json();
        edit(&mut json);
        let why = ByteLevelBpe::from_config(&json).expect_err(reason).to_string();
        assert!(why.contains(reason), "{why:?} names {reason}");
    }
}

/// A loaded tokenizer whose model is no BPE is declined before its configuration is turned
/// into a tree (several times the size of its file).
#[test]
fn a_tokenizer_of_another_model_is_declined_from_its_model_alone() {
    let word_level = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}
    });
    let why = ByteLevelBpe::for_tokenizer(&tokenizer(&word_level)).expect_err("declined").to_string();
    assert!(why.contains("model other than BPE"), "{why}");
    assert!(ByteLevelBpe::for_tokenizer(&tokenizer(&tiny_json())).is_ok(), "the fixture's BPE is taken");
}

#[test]
fn the_byte_alphabet_is_gpt2s() {
    let symbols = byte_symbols();
    assert_eq!(symbols[usize::from(b'a')], 'a');
    assert_eq!(symbols[usize::from(b' ')], '\u{120}', "space is Ġ");
    assert_eq!(symbols[usize::from(b'\n')], '\u{10a}', "newline is Ċ");
    assert_eq!(symbols[0xAD], '\u{143}', "the soft hyphen is the last shifted byte");
    let distinct: std::collections::HashSet<char> = symbols.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            "[a-zA-Z0-9 ,.!?'\n\t\r-]{0,24}",
            "[ \u{e9}\u{301}\u{4e2d}\u{1f600}\u{661}x'sS]{0,12}",
            "\\PC{0,8}",
            Just("'re 'LL 's  \n\n   ".to_string()),
        ],
        0..12,
    )
    .prop_map(|parts| parts.concat())
}

/// Both configurations, built once for the property test.
static BOTH: LazyLock<[(Tokenizer, ByteLevelBpe); 2]> = LazyLock::new(|| {
    [tiny_json(), llama3_json()].map(|json| {
        let tokenizer = tokenizer(&json);
        let bpe = ByteLevelBpe::for_tokenizer(&tokenizer).unwrap();
        (tokenizer, bpe)
    })
});

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the text, the lean encoder gives `tokenizers`' ids.
    #[test]
    fn encodes_as_tokenizers_does(text in text()) {
        for (tokenizer, bpe) in BOTH.iter() {
            prop_assert_eq!(mine(bpe, &text), Some(theirs(tokenizer, &text)));
        }
    }
}
