//! Key paths into the YAML document (`dynamo.discovery.etcd.endpoints[2]`), built from what
//! serde_ignored and serde_path_to_error report, and navigable in a `serde_yaml_ng::Value`.

use std::fmt;

use serde_yaml_ng::Value;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Segment {
    Key(String),
    Index(usize),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct KeyPath(pub(super) Vec<Segment>);

impl KeyPath {
    pub(super) fn child_key(&self, key: impl Into<String>) -> Self {
        let mut segments = self.0.clone();
        segments.push(Segment::Key(key.into()));
        Self(segments)
    }

    pub(super) fn child_index(&self, index: usize) -> Self {
        let mut segments = self.0.clone();
        segments.push(Segment::Index(index));
        Self(segments)
    }

    /// Whether the value at this path is, or holds, a secret: etcd credentials and client
    /// key, the admin and Fleet tokens (the previous one too), the TLS private keys.
    pub(super) fn holds_secret(&self) -> bool {
        let keys: Vec<&str> = self
            .0
            .iter()
            .map(|segment| match segment {
                Segment::Key(key) => key.as_str(),
                Segment::Index(_) => "",
            })
            .collect();
        keys.iter().any(|k| matches!(*k, "auth" | "password" | "token" | "previous_token" | "client_key"))
            || keys.windows(2).any(|w| w == ["tls", "key"])
    }

    pub(super) fn split_last(&self) -> Option<(KeyPath, &Segment)> {
        let (last, parent) = self.0.split_last()?;
        Some((KeyPath(parent.to_vec()), last))
    }

    /// The ignored-key path serde_ignored reports; `Some` and newtype wrappers add no key.
    pub(super) fn from_ignored(path: &serde_ignored::Path<'_>) -> Self {
        use serde_ignored::Path;
        match path {
            Path::Root => Self::default(),
            Path::Seq { parent, index } => Self::from_ignored(parent).child_index(*index),
            Path::Map { parent, key } => Self::from_ignored(parent).child_key(key.clone()),
            Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => {
                Self::from_ignored(parent)
            }
        }
    }

    /// The failing path serde_path_to_error reports, as far as its segments have names (a
    /// mapping key that is not a string has none), and whether that is all of it.
    pub(super) fn from_error_path(path: &serde_path_to_error::Path) -> (Self, bool) {
        use serde_path_to_error::Segment as S;
        let mut segments = Vec::new();
        for segment in path.iter() {
            segments.push(match segment {
                S::Seq { index } => Segment::Index(*index),
                S::Map { key } => Segment::Key(key.clone()),
                S::Enum { .. } | S::Unknown => return (Self(segments), false),
            });
        }
        (Self(segments), true)
    }

    /// The node this path names, if the document has one there.
    pub(super) fn lookup_mut<'v>(&self, mut value: &'v mut Value) -> Option<&'v mut Value> {
        for segment in &self.0 {
            value = match (segment, value) {
                (Segment::Key(key), Value::Mapping(map)) => map.get_mut(key.as_str())?,
                (Segment::Index(index), Value::Sequence(seq)) => seq.get_mut(*index)?,
                _ => return None,
            };
        }
        Some(value)
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (position, segment) in self.0.iter().enumerate() {
            match segment {
                Segment::Key(key) if position == 0 => f.write_str(key)?,
                Segment::Key(key) => write!(f, ".{key}")?,
                Segment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// Whether `path` is `ancestor` itself or a key below it (`a.b` covers `a.b.c` and `a.b[0]`,
/// not `a.bc`).
pub(super) fn is_within(path: &str, ancestor: &str) -> bool {
    match path.strip_prefix(ancestor) {
        Some(rest) => rest.is_empty() || rest.starts_with('.') || rest.starts_with('['),
        None => false,
    }
}
