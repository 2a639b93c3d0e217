//! Ids as Dynamo writes them: a JSON number (the etcd lease or publisher id, often above 2^53)
//! or a hexadecimal string. Both normalise to the same `u64`; neither passes through `f64`.

use std::fmt;

use serde::Deserializer;
use serde::de::{self, Visitor};

/// Deserialises an optional id; `null` and absence are `None`, anything else must be an id.
pub(super) fn optional<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    deserializer.deserialize_any(IdVisitor)
}

/// Parses the hexadecimal form used in etcd keys and in string-valued ids.
pub fn parse_hex(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")).unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

struct IdVisitor;

impl<'de> Visitor<'de> for IdVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an unsigned integer or a hexadecimal string")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u64::try_from(v).map(Some).map_err(|_| E::custom(format!("id {v} is negative")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Err(E::custom(format!("id {v} is not an integer (ids are never floats)")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        parse_hex(v).map(Some).ok_or_else(|| E::custom(format!("id {v:?} is not hexadecimal")))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Holder {
        #[serde(default, deserialize_with = "super::optional")]
        id: Option<u64>,
    }

    fn id(json: &str) -> Result<Option<u64>, String> {
        serde_json::from_str::<Holder>(json).map(|h| h.id).map_err(|e| e.to_string())
    }

    #[test]
    fn ids_parse_from_numbers_and_hex_strings_exactly() {
        let cases: &[(&str, Option<u64>)] = &[
            (r#"{"id": 7668682560356783938}"#, Some(7_668_682_560_356_783_938)),
            (r#"{"id": "6a6ca228814c9742"}"#, Some(7_668_682_560_356_783_938)),
            (r#"{"id": "0x6a6ca228814c9742"}"#, Some(7_668_682_560_356_783_938)),
            (r#"{"id": 18446744073709551615}"#, Some(u64::MAX)),
            (r#"{"id": 9007199254740993}"#, Some(9_007_199_254_740_993)),
            (r#"{"id": null}"#, None),
            (r#"{}"#, None),
        ];
        for (json, want) in cases {
            assert_eq!(id(json), Ok(*want), "{json}");
        }
    }

    #[test]
    fn ids_that_are_not_unsigned_integers_are_refused() {
        for json in
            [r#"{"id": -1}"#, r#"{"id": 1.5}"#, r#"{"id": 1e3}"#, r#"{"id": "zz"}"#, r#"{"id": ""}"#, r#"{"id": [1]}"#]
        {
            assert!(id(json).is_err(), "{json}");
        }
    }
}
