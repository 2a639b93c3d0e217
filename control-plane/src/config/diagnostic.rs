//! What loading a configuration can report: per-key diagnostics (errors and warnings) and the
//! three ways a load fails.

use std::fmt;
use std::path::PathBuf;

/// Whether a diagnostic refuses the configuration or only advises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Severity {
    Error,
    Warning,
}

/// One finding about one key of the configuration.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Diagnostic {
    pub severity: Severity,
    /// The key path, e.g. `dynamo.discovery.etcd.endpoints[2]`.
    pub path: String,
    pub message: String,
}

impl Diagnostic {
    pub fn error(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { severity: Severity::Error, path: path.into(), message: message.into() }
    }

    pub fn warning(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { severity: Severity::Warning, path: path.into(), message: message.into() }
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let severity = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let path = if self.path.is_empty() { "(document)" } else { &self.path };
        write!(f, "{severity}: {path}: {}", self.message)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The text is not YAML. `line` and `column` are 1-based; 0 when the parser gave no position.
    #[error("configuration is not valid YAML: {source}")]
    Syntax {
        line: usize,
        column: usize,
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// Every type error, unknown key and rule violation found (warnings ride along so one run
    /// shows the operator everything).
    #[error("{}", render_invalid(.0))]
    Invalid(Vec<Diagnostic>),
}

fn render_invalid(diagnostics: &[Diagnostic]) -> String {
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    let mut text = format!("configuration has {errors} error(s):");
    for diagnostic in diagnostics {
        text.push_str("\n  ");
        text.push_str(&diagnostic.to_string());
    }
    text
}
