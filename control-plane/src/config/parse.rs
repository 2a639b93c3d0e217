//! Typed parsing that reports every type error and every unknown key, not just the first.
//!
//! serde stops at the first error, so after each one the offending value is taken out of the
//! document (a mapping entry is removed so the field takes its default; a sequence item is
//! replaced by an empty placeholder so later indices keep their meaning) and parsing runs
//! again. Every field of every config struct has a default, so this converges.

use std::collections::{BTreeSet, HashMap};

use serde_yaml_ng::{Mapping, Value};

use super::Config;
use super::diagnostic::Diagnostic;
use super::path::{KeyPath, Segment};
use super::unknown_keys;
use super::values::MASKED_READBACK;

/// Bounds the re-parse loop: a file this broken has shown the operator enough.
const MAX_TYPE_ERRORS: usize = 64;

/// The parsed configuration (absent when the document could not be made to parse) and the
/// type errors and unknown keys found on the way.
pub(super) fn parse_lenient(mut document: Value) -> (Option<Config>, Vec<Diagnostic>) {
    if document.is_null() {
        document = Value::Mapping(Mapping::new());
    }
    let mut diagnostics = Vec::new();
    let mut unknown = BTreeSet::new();
    let mut attempts: HashMap<KeyPath, usize> = HashMap::new();
    let mut config = None;
    while diagnostics.len() < MAX_TYPE_ERRORS {
        match parse_once(document.clone(), &mut unknown) {
            Ok(parsed) => {
                config = Some(parsed);
                break;
            }
            Err((path, message)) => {
                let attempt = attempts.entry(path.clone()).or_insert(0);
                if *attempt == 0 {
                    diagnostics.push(Diagnostic::error(path.to_string(), message));
                }
                if !neutralize(&mut document, &path, *attempt) {
                    break;
                }
                *attempt += 1;
            }
        }
    }
    if config.is_none() && diagnostics.len() >= MAX_TYPE_ERRORS {
        diagnostics.push(Diagnostic::error(
            "",
            format!("checking stopped after {MAX_TYPE_ERRORS} type errors: fix these and check again"),
        ));
    }
    diagnostics.extend(unknown_keys::describe(&unknown));
    (config, diagnostics)
}

type ParseError = (KeyPath, String);

fn parse_once(document: Value, unknown: &mut BTreeSet<KeyPath>) -> Result<Config, ParseError> {
    let mut record = |path: serde_ignored::Path<'_>| {
        unknown.insert(KeyPath::from_ignored(&path));
    };
    let deserializer = serde_ignored::Deserializer::new(document, &mut record);
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let (path, whole) = KeyPath::from_error_path(error.path());
        let mut message = error.into_inner().to_string();
        if !whole {
            // Reported, and taken out of the way, at the nearest key that has a name.
            message.push_str(" (under this key, at a key that is not a string: quote it)");
        }
        // serde quotes what it could not take ("invalid type: integer `20240101`"), which under
        // a secret is the secret, and a string where a whole section belongs may be that
        // section's secret (`admin: token:${ADMIN_TOKEN}`, the space after a colon missing):
        // say what is wrong without it.
        let message = match &path {
            // The secret's own refusal (it is the mask) carries no value.
            path if path.holds_secret() && message.contains(MASKED_READBACK) => MASKED_READBACK.to_string(),
            path if path.holds_secret() => SECRET_MISTYPED.to_string(),
            _ if string_for_section(&message) => SECTION_AS_STRING.to_string(),
            _ => message,
        };
        (path, message)
    })
}

const SECRET_MISTYPED: &str =
    "is not what this key takes (a secret is a string: quote a number); the value is not shown";
const SECTION_AS_STRING: &str = "is a string where a section (keys and values) or a list belongs; is a space missing \
     after a colon? The value is not shown: it may hold a secret";

/// Whether serde's message is about a string found where a struct, a map or a sequence was
/// expected (serde words these `invalid type: string "…", expected struct X` and the like).
fn string_for_section(message: &str) -> bool {
    message.starts_with("invalid type: string ")
        && [", expected struct ", ", expected a map", ", expected a sequence"].iter().any(|e| message.contains(e))
}

/// Takes the value at `path` out of the way; `false` when nothing more can be tried.
fn neutralize(document: &mut Value, path: &KeyPath, attempt: usize) -> bool {
    let Some((parent, last)) = path.split_last() else {
        return false;
    };
    match (parent.lookup_mut(document), last) {
        (Some(Value::Mapping(map)), Segment::Key(key)) if attempt == 0 => map.shift_remove(key.as_str()).is_some(),
        (Some(Value::Sequence(items)), Segment::Index(index)) => {
            let placeholders = [Value::Mapping(Mapping::new()), Value::String(String::new()), Value::Null];
            match (items.get_mut(*index), placeholders.into_iter().nth(attempt)) {
                (Some(item), Some(placeholder)) => {
                    *item = placeholder;
                    true
                }
                _ => false,
            }
        }
        _ => false,
    }
}
