//! `${VAR}` substitution in every string value and mapping key of the document, before typed
//! parsing, so secrets (`password: "${ETCD_PASSWORD}"`) stay out of the file. What it yields
//! is a string, whatever the variable holds. `$${` is a literal `${`.
//! Substituted text is not scanned again, so a variable's value can never expand further.

use serde_yaml_ng::Value;

use super::diagnostic::Diagnostic;
use super::path::{KeyPath, is_within};

/// Looks a variable up; `None` when unset.
pub(super) type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Substitutes in place. A value that cannot be substituted is reported at its key path and
/// removed (a sequence item becomes `""`), so it takes its default and the rest of the
/// document is still checked. Returns those reports, and the keys substitution changed.
pub(super) fn substitute_document(value: &mut Value, env: Env<'_>) -> (Vec<Diagnostic>, SubstitutedKeys) {
    let (mut diagnostics, mut keys) = (Vec::new(), SubstitutedKeys::default());
    walk(value, &KeyPath::default(), env, (&mut diagnostics, &mut keys));
    (diagnostics, keys)
}

/// Mapping keys as substituted, with the text they were written as. A key written beside a
/// variable (`token:${ADMIN_TOKEN}:` under `admin`, the space after the first colon missing,
/// is one key `token:…` in YAML) holds its secret once substituted: a report naming that key
/// (unknown, or of the wrong type) names it as written instead.
#[derive(Debug, Default)]
pub(super) struct SubstitutedKeys(Vec<SubstitutedKey>);

/// One key substitution changed: its path and text as substituted, and as written.
#[derive(Debug)]
struct SubstitutedKey {
    path: String,
    path_as_written: String,
    key: String,
    key_as_written: String,
}

impl SubstitutedKeys {
    /// `diagnostic` with every substituted key put back as it was written: in its path, where
    /// it is the key's or below it, and in its message where it names the key (`` `key` ``).
    /// The deepest first, so that a key below another substituted one is found by the path
    /// substitution gave it.
    pub fn as_written(&self, mut diagnostic: Diagnostic) -> Diagnostic {
        for key in self.0.iter().rev() {
            if is_within(&diagnostic.path, &key.path) {
                diagnostic.path = format!("{}{}", key.path_as_written, &diagnostic.path[key.path.len()..]);
                let (named, as_written) = (format!("`{}`", key.key), format!("`{}`", key.key_as_written));
                diagnostic.message = diagnostic.message.replace(&named, &as_written);
            }
        }
        diagnostic
    }
}

fn walk(value: &mut Value, path: &KeyPath, env: Env<'_>, (out, keys): (&mut Vec<Diagnostic>, &mut SubstitutedKeys)) {
    match value {
        Value::String(text) => {
            if let Err(error) = substitute(text, env).map(|new| *text = new) {
                out.push(Diagnostic::error(path.to_string(), error.message(path.holds_secret())));
                text.clear();
            }
        }
        Value::Sequence(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                walk(item, &path.child_index(index), env, (out, keys));
            }
        }
        Value::Mapping(map) => {
            // Keys are substituted too (`model_map: {"${CLIENT_MODEL}": …}`); an entry whose key
            // cannot be is reported and dropped, and so is one whose value is a string that
            // cannot be.
            let entries = std::mem::take(map);
            for (mut key, mut item) in entries {
                if let Value::String(text) = &mut key {
                    match substitute(text, env) {
                        Ok(new) if new != *text => {
                            let (path_as_written, path_substituted) =
                                (path.child_key(text.clone()), path.child_key(new.clone()));
                            keys.0.push(SubstitutedKey {
                                path: path_substituted.to_string(),
                                path_as_written: path_as_written.to_string(),
                                key: new.clone(),
                                key_as_written: std::mem::replace(text, new),
                            });
                        }
                        Ok(_) => {}
                        Err(error) => {
                            out.push(Diagnostic::error(path.child_key(text.clone()).to_string(), error.message(false)));
                            continue;
                        }
                    }
                }
                let item_path = path.child_key(key_text(&key));
                let before = out.len();
                walk(&mut item, &item_path, env, (out, keys));
                if out.len() > before && item.is_string() {
                    continue;
                }
                if map.contains_key(&key) {
                    out.push(Diagnostic::error(item_path.to_string(), "is given twice once `${…}` is substituted"));
                    continue;
                }
                map.insert(key, item);
            }
        }
        Value::Tagged(tagged) => walk(&mut tagged.value, path, env, (out, keys)),
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// The text of a mapping key as it appears in a key path.
pub(super) fn key_text(key: &Value) -> String {
    match key {
        Value::String(text) => text.clone(),
        Value::Number(number) => number.to_string(),
        Value::Bool(flag) => flag.to_string(),
        _ => "?".to_owned(),
    }
}

/// Why a string could not be substituted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SubstituteError {
    Unterminated,
    /// The text between `${` and `}`, which is not a variable name.
    NotAReference(String),
    Unset(String),
}

impl SubstituteError {
    /// What is wrong and how to fix it. In a secret the text of a malformed reference is not
    /// quoted: it may be part of the secret (`pa${ss-w}rd`).
    pub(super) fn message(&self, in_secret: bool) -> String {
        const LITERAL: &str = "write `$${` for a literal `${`";
        match self {
            SubstituteError::Unterminated => format!("unterminated `${{`; close it with `}}` or {LITERAL}"),
            SubstituteError::NotAReference(_) if in_secret => {
                format!("a `${{…}}` in this secret is not a variable reference (not shown); {LITERAL}")
            }
            SubstituteError::NotAReference(name) => {
                format!("`${{{name}}}` is not a variable reference (names are letters, digits and `_`); {LITERAL}")
            }
            SubstituteError::Unset(name) => format!("environment variable `{name}` is not set"),
        }
    }
}

/// Substitutes one string.
pub(super) fn substitute(text: &str, env: Env<'_>) -> Result<String, SubstituteError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('$') {
        out.push_str(&rest[..start]);
        let tail = &rest[start..];
        if let Some(after) = tail.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = tail.strip_prefix("${") {
            let (name, after) = after.split_once('}').ok_or(SubstituteError::Unterminated)?;
            out.push_str(&lookup(name, env)?);
            rest = after;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

fn lookup(name: &str, env: Env<'_>) -> Result<String, SubstituteError> {
    let mut chars = name.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(SubstituteError::NotAReference(name.to_owned()));
    }
    env(name).ok_or_else(|| SubstituteError::Unset(name.to_owned()))
}
