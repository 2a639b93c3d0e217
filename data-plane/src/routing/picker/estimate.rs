//! The coarse prompt-size estimate of the load-based picker: characters and words, no
//! tokenizer. It only needs to rank workers, so being within a small factor is enough.

use serde_json::Value;

/// English-like text runs about four characters per token…
const CHARS_PER_TOKEN: u64 = 4;
/// …and about four tokens per three words; short words and punctuation push it up.
const TOKENS_PER_WORD: (u64, u64) = (4, 3);

/// Request fields whose text reaches the prompt: chat messages, completion prompts, Responses
/// input, an Anthropic system prompt, and tool definitions (which chat templates render).
const PROMPT_FIELDS: [&str; 5] = ["messages", "prompt", "input", "system", "tools"];

/// Fields whose strings are not prompt text: media (a base64 image is not a million tokens)
/// and content-part tags.
const SKIPPED_FIELDS: [&str; 6] = ["image_url", "input_audio", "image", "file", "source", "type"];

/// Estimated prompt tokens of an OpenAI (or Anthropic, or Responses) request body: for every
/// string in the prompt fields, the larger of characters / 4 and words × 4 / 3, rounded up.
/// Role names and other short strings count too, which stands in for the chat template.
pub fn estimate_prompt_tokens(body: &Value) -> u64 {
    PROMPT_FIELDS.iter().filter_map(|field| body.get(field)).map(text_tokens).fold(0, u64::saturating_add)
}

/// Nesting is bounded by serde_json's parser (128 levels), so this recursion is too.
fn text_tokens(value: &Value) -> u64 {
    match value {
        Value::String(text) => string_tokens(text),
        Value::Array(items) => items.iter().map(text_tokens).fold(0, u64::saturating_add),
        Value::Object(fields) => fields
            .iter()
            .filter(|(name, _)| !SKIPPED_FIELDS.contains(&name.as_str()))
            .map(|(_, value)| text_tokens(value))
            .fold(0, u64::saturating_add),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

fn string_tokens(text: &str) -> u64 {
    let chars = u64::try_from(text.chars().count()).unwrap_or(u64::MAX);
    let words = u64::try_from(text.split_whitespace().count()).unwrap_or(u64::MAX);
    let (per, words_per) = TOKENS_PER_WORD;
    chars.div_ceil(CHARS_PER_TOKEN).max(words.saturating_mul(per).div_ceil(words_per))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn estimates_follow_characters_or_words_whichever_is_larger() {
        let cases: &[(&str, Value, u64)] = &[
            ("no prompt fields", json!({"model": "tiny"}), 0),
            ("empty message", json!({"messages": [{"role": "", "content": ""}]}), 0),
            // "user": one word → 2; 32 characters → 8, 6 words → 8
            (
                "fixture prompt",
                json!({"messages": [{"role": "user", "content": "Hello world, the quick brown fox"}]}),
                2 + 8,
            ),
            // 12 one-letter words: 23 characters → 6, words → 16
            ("short words count by words", json!({"prompt": "a b c d e f g h i j k l"}), 16),
            // 40 characters without spaces: 10
            ("long words count by characters", json!({"prompt": "x".repeat(40)}), 10),
            (
                "text parts count, images do not",
                json!({"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "abcd"},
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(4000))}}
                ]}]}),
                2 + 2,
            ),
            ("responses input string", json!({"input": "abcdefgh"}), 2),
            ("numbers and booleans are not text", json!({"messages": [{"role": "u", "content": null, "n": 5}]}), 2),
        ];
        for (name, body, expected) in cases {
            assert_eq!(estimate_prompt_tokens(body), *expected, "{name}");
        }
    }

    #[test]
    fn multibyte_text_counts_characters_not_bytes() {
        assert_eq!(estimate_prompt_tokens(&json!({"prompt": "ééééé"})), 2);
    }
}
