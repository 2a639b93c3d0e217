use proptest::prelude::*;
use tokenizers::Tokenizer;

use super::*;
use crate::kv::tests::fixture;

fn tiny() -> Tokenizer {
    Tokenizer::from_file(fixture("tinymodel/tokenizer.json")).expect("the fixture tokenizer")
}

fn whole(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).expect("encodes").get_ids().to_vec()
}

fn chatml(system: &str, turns: &[&str]) -> String {
    let mut text = format!("<|im_start|>system\n{system}<|im_end|>\n");
    for (i, turn) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        text.push_str(&format!("<|im_start|>{role}\n{turn}<|im_end|>\n"));
    }
    text + "<|im_start|>assistant\n"
}

#[test]
fn a_conversation_encodes_as_the_whole_does_and_its_pieces_are_reused() {
    let tokenizer = tiny();
    let cache = PieceCache::for_tokenizer(&tokenizer);
    assert!(cache.enabled(), "the fixture's markers match before normalization");
    assert!(cache.lean(), "new pieces are encoded without `tokenizers`");
    assert_eq!(cache.len(), 0, "the probe leaves nothing behind");
    let system = "You are a careful assistant. ".repeat(40);
    let first = chatml(&system, &["What is the capital of France? Answer briefly, please, in a single word."]);
    assert_eq!(cache.encode(&tokenizer, &first).unwrap(), whole(&tokenizer, &first));
    let held = cache.len();
    assert!(held >= 2, "the system prompt and the long turn are kept: {held}");
    let second = chatml(
        &system,
        &[
            "What is the capital of France? Answer briefly, please, in a single word.",
            "Paris.",
            "And of Italy? Answer just as briefly, and spell it out in full.",
        ],
    );
    assert_eq!(cache.encode(&tokenizer, &second).unwrap(), whole(&tokenizer, &second));
    assert_eq!(cache.len(), held + 1, "only the new long turn is new; short pieces are not kept");
}

/// A salted request's pieces are kept apart: it finds none an unsalted request or another
/// salt left (whether one was cached shows in how soon a request is routed), and its own again.
#[test]
fn a_salted_requests_pieces_are_kept_apart_from_everyone_elses() {
    let tokenizer = tiny();
    let cache = PieceCache::for_tokenizer(&tokenizer);
    let text = chatml(&"A system prompt another tenant may guess. ".repeat(8), &["hi"]);
    assert_eq!(cache.encode(&tokenizer, &text).unwrap(), whole(&tokenizer, &text));
    let unsalted = cache.len();
    assert!(unsalted >= 1);
    assert_eq!(cache.encode_within(&tokenizer, &text, Some(7)).unwrap(), whole(&tokenizer, &text));
    assert_eq!(cache.len(), 2 * unsalted, "encoded anew, kept under the salt");
    assert_eq!(cache.encode_within(&tokenizer, &text, Some(7)).unwrap(), whole(&tokenizer, &text));
    assert_eq!(cache.len(), 2 * unsalted, "its own found again");
    cache.encode_within(&tokenizer, &text, Some(8)).unwrap();
    assert_eq!(cache.len(), 3 * unsalted, "another salt's apart too");
    assert_eq!(crate::kv::hashing::SaltHash::default().isolation(), None);
    assert!(crate::kv::hashing::SaltHash::new(Some("tenant"), None).isolation().is_some());
}

#[test]
fn a_tokenizer_matching_added_tokens_after_normalization_encodes_prompts_whole() {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("tinymodel/tokenizer.json")).unwrap()).unwrap();
    json["added_tokens"][1]["normalized"] = true.into();
    let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).expect("still a tokenizer");
    let cache = PieceCache::for_tokenizer(&tokenizer);
    assert!(!cache.enabled());
    let text = chatml(&"Long system prompt. ".repeat(10), &["hello there, how are you doing today my friend?"]);
    assert_eq!(cache.encode(&tokenizer, &text).unwrap(), whole(&tokenizer, &text));
    assert_eq!(cache.len(), 0);
}

#[test]
fn a_piece_the_lean_encoder_leaves_is_encoded_by_tokenizers() {
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("tinymodel/tokenizer.json")).unwrap()).unwrap();
    // Under NFC the lean encoder takes ASCII pieces only; this prompt's turn is not ASCII.
    json["normalizer"] = serde_json::json!({"type": "NFC"});
    let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).expect("still a tokenizer");
    let cache = PieceCache::for_tokenizer(&tokenizer);
    assert!(cache.enabled() && cache.lean());
    let text = chatml(
        &"A plain ASCII system prompt. ".repeat(4),
        &["Cafe\u{301} cre\u{300}me bru\u{302}le\u{301}e, s'il vous plai\u{302}t!"],
    );
    assert_eq!(cache.encode(&tokenizer, &text).unwrap(), whole(&tokenizer, &text));
}

#[test]
fn the_cache_is_bounded_and_pieces_in_use_outlive_a_flood_of_new_ones() {
    let mut pieces = Pieces::default();
    let shared = "s".repeat(4096);
    pieces.insert(&shared, Arc::from(vec![7u32]));
    // A flood of pieces seen once, many times the bound, while the shared piece is used.
    let flood = |i: usize| format!("{i:08}{}", "x".repeat(1 << 20));
    for i in 0..4 * MAX_CACHED_BYTES / (1 << 20) {
        pieces.insert(&flood(i), Arc::from(vec![1u32]));
        assert!(pieces.bytes() <= MAX_CACHED_BYTES, "{} bytes held", pieces.bytes());
        assert_eq!(pieces.get(&shared).as_deref(), Some(&[7u32][..]), "the piece in use stays");
    }
    assert_eq!(pieces.get(&flood(0)), None, "the first of the flood went");
    assert!(pieces.get(&flood(4 * MAX_CACHED_BYTES / (1 << 20) - 1)).is_some(), "the last is kept");
    pieces.insert(&"y".repeat(MAX_CACHED_BYTES), Arc::from(vec![3u32]));
    assert_eq!(pieces.get(&"y".repeat(MAX_CACHED_BYTES)), None, "a piece past a generation is never kept");
}

fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("<|im_start|>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<|endoftext|>".to_string()),
        Just("<|im_start".to_string()),
        "[a-zA-Z0-9 ,.!?'\n\t]{0,40}",
        "[ \u{e9}\u{4e2d}\u{1f600}x]{0,12}",
        Just("The same long system prompt that many conversations share, word for word.\n".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the text, pieces cold or cached encode as the whole does.
    #[test]
    fn pieces_encode_as_the_whole_does(fragments in prop::collection::vec(fragment(), 0..24)) {
        let tokenizer = tiny();
        let cache = PieceCache::for_tokenizer(&tokenizer);
        let text: String = fragments.concat();
        let expected = whole(&tokenizer, &text);
        prop_assert_eq!(cache.encode(&tokenizer, &text).unwrap(), expected.clone());
        prop_assert_eq!(cache.encode(&tokenizer, &text).unwrap(), expected);
    }
}
