//! Reading what a JSON value is without building it. A client's body reaches the ingress (and
//! its tool-call arguments the renderer) as text of up to 8 MiB, and a `serde_json::Value` tree
//! of it takes about forty times that (`[0,0,…]` is two bytes an element, a `Value` with
//! ordered maps 80): members that must be a string, a boolean or an object are read with these,
//! which skip anything else element by element without keeping it.

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A value that must be a string or a boolean, kept only if it is one. (`null` in an `Option`
/// of it is `None`.)
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
        Ok(match deserializer.deserialize_any(KindOf { keep_text: true })? {
            Kind::Str(text) => Scalar::Str(text),
            Kind::Bool(value) => Scalar::Bool(value),
            Kind::Object | Kind::Other => Scalar::Other,
        })
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match deserializer.deserialize_any(KindOf { keep_text: false })? {
            Kind::Object => Shape::Object,
            _ => Shape::Other,
        })
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
}

impl<'de> Visitor<'de> for KindOf {
    type Value = Kind;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Kind, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Kind::Object)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Kind, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Kind::Other)
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
        for not in ["[]", r#""{}""#, "1", "null", "{} {}", "{"] {
            assert!(!Shape::is_object(not), "{not}");
        }
    }
}
