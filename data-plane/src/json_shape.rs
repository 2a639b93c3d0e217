//! Reading what a JSON value is without building it. A client's body reaches the ingress (and
//! its tool-call arguments the renderer) as text of up to 8 MiB, and a `serde_json::Value` tree
//! of it takes about forty times that (`[0,0,…]` is two bytes an element, a `Value` with
//! ordered maps 80): members that must be a string, a boolean or an object are read with these,
//! which skip anything else element by element without keeping it.
//!
//! Skipped is not unchecked: what is skipped is read as [`Checked`], as strictly as the
//! frontend's parser reads it (serde's `IgnoredAny` decodes no string nor number, so a lone
//! surrogate, `1e400` or a byte that is no UTF-8 would pass here and be refused there, answered
//! as a failed generation rather than the client's bad request). Keys may repeat inside a
//! skipped value, as a free-form one (`metadata`, a tool's `parameters`) keeps the last copy in
//! the frontend too; an object whose own keys must be unique is read as [`UniqueObject`] (and
//! the prompt's typed objects by `PromptText`, which keeps their keys unique the same way).

use std::borrow::Cow;
use std::collections::HashSet;

use serde::Deserialize;
use serde::de::{self, MapAccess, SeqAccess, Visitor};
use smallvec::SmallVec;

/// A value that must be a string or a boolean, kept only if it is one. (`null` in an `Option`
/// of it is `None`.) An object's own keys must not repeat: the members read so are typed in
/// the frontend (`tool_choice` may be an object naming a function).
#[derive(Debug, PartialEq, Eq)]
pub enum Scalar {
    Str(String),
    Bool(bool),
    /// A number, or an array or object skipped unbuilt.
    Other,
}

/// Whether a value is an object, read without building it.
#[derive(Debug, PartialEq, Eq)]
pub enum Shape {
    Object,
    Other,
}

impl Shape {
    /// Whether `text` is one JSON object (and nothing else).
    pub fn is_object(text: &str) -> bool {
        serde_json::from_str::<Shape>(text).is_ok_and(|shape| shape == Shape::Object)
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match deserializer.deserialize_any(KindOf { keep_text: true, unique_keys: true })? {
            Kind::Str(text) => Scalar::Str(text),
            Kind::Bool(value) => Scalar::Bool(value),
            Kind::Object | Kind::Other => Scalar::Other,
        })
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        shape(deserializer, false)
    }
}

/// A value's shape; `unique_keys`: an object's own keys must not repeat.
fn shape<'de, D: de::Deserializer<'de>>(deserializer: D, unique_keys: bool) -> Result<Shape, D::Error> {
    Ok(match deserializer.deserialize_any(KindOf { keep_text: false, unique_keys })? {
        Kind::Object => Shape::Object,
        _ => Shape::Other,
    })
}

/// A value's [`Shape`], an object's own keys refused when one comes twice (what it holds is
/// [`Checked`]): for an object the router strips fields from by name, where a second copy
/// would ride past the strip, or a rewrite keep only one.
#[derive(Debug, PartialEq, Eq)]
pub struct UniqueObject(pub Shape);

impl<'de> Deserialize<'de> for UniqueObject {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        shape(deserializer, true).map(UniqueObject)
    }
}

enum Kind {
    Str(String),
    Bool(bool),
    Object,
    Other,
}

/// Reads a value's kind, keeping a string's text only when asked to.
struct KindOf {
    keep_text: bool,
    /// An object's own keys must not repeat.
    unique_keys: bool,
}

impl<'de> Visitor<'de> for KindOf {
    type Value = Kind;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Kind, A::Error> {
        CheckedVisitor { unique_keys: self.unique_keys }.visit_map(map).map(|()| Kind::Object)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Kind, A::Error> {
        CheckedVisitor { unique_keys: false }.visit_seq(seq).map(|()| Kind::Other)
    }

    fn visit_bool<E>(self, value: bool) -> Result<Kind, E> {
        Ok(Kind::Bool(value))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Kind, E> {
        Ok(Kind::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Kind, E> {
        Ok(Kind::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Kind, E> {
        Ok(Kind::Other)
    }

    fn visit_unit<E>(self) -> Result<Kind, E> {
        Ok(Kind::Other)
    }

    fn visit_str<E>(self, text: &str) -> Result<Kind, E> {
        Ok(if self.keep_text { Kind::Str(text.to_owned()) } else { Kind::Other })
    }
}

/// Any JSON value, checked and kept nowhere (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(CheckedVisitor { unique_keys: false }).map(|()| Checked)
    }
}

struct CheckedVisitor {
    /// The object's own keys must not repeat (what it holds is checked without the rule).
    unique_keys: bool,
}

impl<'de> Visitor<'de> for CheckedVisitor {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut keys = Keys::default();
        while let Some(Key(key)) = map.next_key()? {
            if self.unique_keys {
                keys.insert(key)?;
            }
            map.next_value::<Checked>()?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
}

/// An object's key, borrowed from the body unless it holds an escape.
#[derive(Debug)]
pub struct Key<'de>(pub Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("an object key")
            }

            fn visit_borrowed_str<E>(self, key: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(key)))
            }

            fn visit_str<E>(self, key: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(key.to_owned())))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// The keys one object has shown so far, to refuse the second of any: a list while they are
/// few (on the stack for the first eight: a request and each of its messages is an object), a
/// set past that, up to [`MAX_UNIQUE_KEYS`].
#[derive(Debug, Default)]
pub struct Keys<'de> {
    few: SmallVec<[Cow<'de, str>; 8]>,
    many: HashSet<Cow<'de, str>>,
}

/// Keys an object whose keys must be unique may hold. The request, its messages and their
/// parts, `nvext` and the typed options have a few dozen fields at most; without a bound, a body
/// of one object with a million short keys would build a set six times the body's size, off
/// every memory budget the parse is under.
pub const MAX_UNIQUE_KEYS: usize = 1024;

impl<'de> Keys<'de> {
    const FEW: usize = 16;

    pub fn insert<E: de::Error>(&mut self, key: Cow<'de, str>) -> Result<(), E> {
        if self.many.len() >= MAX_UNIQUE_KEYS {
            return Err(E::custom(format_args!(
                "an object holds more than {MAX_UNIQUE_KEYS} keys; a chat completion request's own objects have a few dozen"
            )));
        }
        let seen = match self.few.len() < Self::FEW {
            true => self.few.contains(&key),
            false => self.many.contains(&key),
        };
        if seen {
            let shown: String = key.chars().take(64).collect();
            return Err(E::custom(format_args!("an object holds the key `{shown}` twice")));
        }
        if self.few.len() < Self::FEW {
            self.few.push(key);
            if self.few.len() == Self::FEW {
                self.many.extend(self.few.iter().cloned());
            }
        } else {
            self.many.insert(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_expected_kinds_are_kept() {
        let scalar = |text: &str| serde_json::from_str::<Scalar>(text).ok();
        assert_eq!(scalar(r#""tiny""#), Some(Scalar::Str("tiny".into())));
        assert_eq!(scalar("true"), Some(Scalar::Bool(true)));
        for other in ["1", "-1", "1.5", "null", "[0,[1]]", r#"{"a":[0]}"#] {
            assert_eq!(scalar(other), Some(Scalar::Other), "{other}");
        }
        assert_eq!(scalar("[0,"), None, "invalid JSON is still an error");
        assert!(Shape::is_object(r#" {"a": [1, {"b": 2}]} "#));
        let object =
            |keys: usize| format!("{{{}}}", (0..keys).map(|k| format!("\"k{k}\":0")).collect::<Vec<_>>().join(","));
        assert!(serde_json::from_str::<UniqueObject>(&object(MAX_UNIQUE_KEYS)).is_ok());
        let refused = serde_json::from_str::<UniqueObject>(&object(MAX_UNIQUE_KEYS + 1)).unwrap_err().to_string();
        assert!(refused.contains("more than 1024 keys"), "{refused}");
        assert!(
            serde_json::from_str::<Checked>(&object(MAX_UNIQUE_KEYS * 4)).is_ok(),
            "free-form objects are not bounded here"
        );
        for not in ["[]", r#""{}""#, "1", "null", "{} {}", "{"] {
            assert!(!Shape::is_object(not), "{not}");
        }
    }
}
