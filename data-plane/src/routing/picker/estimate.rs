//! The coarse prompt-size estimate of the load-based picker: characters and words, no
//! tokenizer. It only needs to rank workers, so being within a small factor is enough.

use std::fmt;

use serde::de::{Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::json_shape::{Checked, Key, Keys, UniqueObject};

/// English-like text runs about four characters per token…
const CHARS_PER_TOKEN: u64 = 4;
/// …and about four tokens per three words; short words and punctuation push it up.
const TOKENS_PER_WORD: (u64, u64) = (4, 3);

/// Fields whose strings are not prompt text: media (a base64 image is not a million tokens)
/// and content-part tags.
const SKIPPED_FIELDS: [&str; 6] = ["image_url", "input_audio", "image", "file", "source", "type"];

/// The estimated tokens of one prompt field of a request body (a chat body's `messages` and
/// `tools`, which its template renders; the tests read other fields the same way):
/// for every string in it, the larger of characters / 4 and words × 4 / 3, rounded up. Role
/// names and other short strings count too, which stands in for the chat template.
///
/// Read while the body is parsed, without building a tree of it. Nesting is bounded by
/// serde_json's parser (128 levels), so the recursion is too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptText {
    pub tokens: u64,
    /// The number of items when the field is an array.
    pub items: Option<usize>,
    /// It holds media (an image, audio, a file), which the estimate leaves out and the model
    /// counts: an answer's count of its prompt says nothing of how far the estimate is off.
    pub media: bool,
}

impl<'de> Deserialize<'de> for PromptText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Text { unique_keys: true }.deserialize(deserializer)
    }
}

/// Members whose values are free-form JSON (a tool's JSON-schema `parameters`, a call's
/// `arguments` sent as an object): the frontend keeps a repeated key's last copy there, while
/// the typed objects around them (a message, a content part, a tool) refuse one.
const FREE_FORM_FIELDS: [&str; 2] = ["parameters", "arguments"];

/// Reads a value as [`PromptText`]; `unique_keys`: its objects must not repeat a key.
#[derive(Clone, Copy)]
struct Text {
    unique_keys: bool,
}

impl<'de> DeserializeSeed<'de> for Text {
    type Value = PromptText;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<PromptText, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Text {
    type Value = PromptText;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<PromptText, E> {
        Ok(PromptText { tokens: string_tokens(text), items: None, media: false })
    }

    fn visit_bool<E>(self, _: bool) -> Result<PromptText, E> {
        Ok(PromptText::default())
    }

    fn visit_i64<E>(self, _: i64) -> Result<PromptText, E> {
        Ok(PromptText::default())
    }

    fn visit_u64<E>(self, _: u64) -> Result<PromptText, E> {
        Ok(PromptText::default())
    }

    fn visit_f64<E>(self, _: f64) -> Result<PromptText, E> {
        Ok(PromptText::default())
    }

    fn visit_unit<E>(self) -> Result<PromptText, E> {
        Ok(PromptText::default())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<PromptText, A::Error> {
        let (mut tokens, mut count, mut media) = (0u64, 0usize, false);
        while let Some(item) = items.next_element_seed(self)? {
            tokens = tokens.saturating_add(item.tokens);
            media |= item.media;
            count += 1;
        }
        Ok(PromptText { tokens, items: Some(count), media })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<PromptText, A::Error> {
        let (mut tokens, mut keys, mut media) = (0u64, Keys::default(), false);
        while let Some(Key(name)) = fields.next_key()? {
            if SKIPPED_FIELDS.contains(&name.as_ref()) {
                media |= name != "type";
                // Not prompt text, but typed all the same (`image_url: {url, detail}`).
                if self.unique_keys {
                    fields.next_value::<UniqueObject>()?;
                } else {
                    fields.next_value::<Checked>()?;
                }
            } else {
                let free = FREE_FORM_FIELDS.contains(&name.as_ref());
                let text = fields.next_value_seed(Text { unique_keys: self.unique_keys && !free })?;
                tokens = tokens.saturating_add(text.tokens);
                media |= text.media;
            }
            if self.unique_keys {
                keys.insert(name)?;
            }
        }
        Ok(PromptText { tokens, items: None, media })
    }
}

fn string_tokens(text: &str) -> u64 {
    let (chars, words) = if text.is_ascii() {
        // Most prompt text: a byte is a character, and a word starts where a byte that is not
        // whitespace follows one that is (or the start). The same counts as below, a fraction
        // of the work.
        let (words, _) = text.bytes().fold((0usize, true), |(words, after_space), byte| {
            // As `char::is_whitespace` (Unicode's White_Space) reads ASCII: tab to carriage
            // return, vertical tab included (`u8::is_ascii_whitespace` leaves it out), and space.
            let space = matches!(byte, b'\t'..=b'\r' | b' ');
            (words + usize::from(after_space && !space), space)
        });
        (text.len(), words)
    } else {
        (text.chars().count(), text.split_whitespace().count())
    };
    let (chars, words) = (u64::try_from(chars).unwrap_or(u64::MAX), u64::try_from(words).unwrap_or(u64::MAX));
    let (per, words_per) = TOKENS_PER_WORD;
    chars.div_ceil(CHARS_PER_TOKEN).max(words.saturating_mul(per).div_ceil(words_per))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::{Value, json};

    use super::*;

    /// Every field a body may carry prompt text in, each read as [`PromptText`], summed.
    fn estimate(body: &Value) -> u64 {
        #[derive(Deserialize)]
        struct Fields {
            messages: Option<PromptText>,
            prompt: Option<PromptText>,
            input: Option<PromptText>,
            system: Option<PromptText>,
            tools: Option<PromptText>,
        }
        let fields: Fields = serde_json::from_str(&body.to_string()).unwrap();
        [fields.messages, fields.prompt, fields.input, fields.system, fields.tools]
            .iter()
            .flatten()
            .map(|f| f.tokens)
            .sum()
    }

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
            assert_eq!(estimate(body), *expected, "{name}");
        }
    }

    /// A prompt holding media says so, however deep its part; text parts and their `type`
    /// tags are no media.
    #[test]
    fn media_anywhere_in_the_messages_is_told() {
        let media =
            |messages: Value| serde_json::from_value::<PromptText>(messages).map(|text| text.media).expect("messages");
        let part = |part: Value| json!([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]);
        assert!(!media(json!([{"role": "user", "content": "hi"}])));
        assert!(!media(part(json!({"type": "text", "text": "more"}))));
        for field in ["image_url", "input_audio", "image", "file", "source"] {
            assert!(media(part(json!({"type": field, field: {"url": "data:…"}}))), "{field}");
        }
    }

    /// The ASCII count is the general one's, on every shape of spacing.
    #[test]
    fn ascii_text_counts_as_any_text_does() {
        let general = |text: &str| {
            let chars = text.chars().count() as u64;
            let words = text.split_whitespace().count() as u64;
            chars.div_ceil(CHARS_PER_TOKEN).max((words * TOKENS_PER_WORD.0).div_ceil(TOKENS_PER_WORD.1))
        };
        let texts = [
            "",
            " ",
            "a",
            " a",
            "a ",
            "  a  b  ",
            "a\tb\nc\r\nd",
            "\x0c form feed",
            "one two three",
            "x\u{b}y",
            "hello there",
        ];
        for text in texts {
            assert_eq!(string_tokens(text), general(text), "{text:?}");
        }
        // Every ASCII byte as the only separator of two words.
        for byte in 0..=127u8 {
            let text = format!("ab{}cd", char::from(byte));
            assert_eq!(string_tokens(&text), general(&text), "{text:?}");
        }
    }

    #[test]
    fn arrays_report_their_length() {
        let text: PromptText = serde_json::from_str(r#"[{"role":"user","content":"hi"},{"x":[1,2]}]"#).unwrap();
        assert_eq!(text.items, Some(2));
        assert_eq!(serde_json::from_str::<PromptText>(r#""hi""#).unwrap().items, None);
    }

    #[test]
    fn multibyte_text_counts_characters_not_bytes() {
        assert_eq!(estimate(&json!({"prompt": "ééééé"})), 2);
        let escaped: PromptText = serde_json::from_str(r#""\u00e9\u00e9\u00e9\u00e9\u00e9""#).unwrap();
        assert_eq!(escaped.tokens, 2, "escaped text counts as decoded");
    }
}
