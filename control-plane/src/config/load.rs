//! Loading a configuration: read, parse YAML, substitute `${VAR}`, parse the typed config
//! (collecting every type error and unknown key), fill derived defaults and validate.

use std::path::Path;

use serde_yaml_ng::Value;

use super::Config;
use super::diagnostic::{ConfigError, Diagnostic};
use super::parse::parse_lenient;
use super::path::is_within;
use super::substitute::substitute_document;
use super::validate::validate;

/// The embedded default: a simulated fleet behind its own shim.
const DEFAULT_YAML: &str = include_str!("default.yaml");

/// A configuration that loaded without errors, and its warnings.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    pub config: Config,
    pub diagnostics: Vec<Diagnostic>,
}

/// Reads and loads a configuration file, substituting from the process environment.
pub fn load_file(path: &Path) -> Result<Loaded, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
    load_str(&text, &|name| std::env::var(name).ok())
}

/// Loads a configuration from text; `env` resolves `${VAR}` references.
///
/// Any error (substitution, type, unknown key or rule) fails the load with all of them.
pub fn load_str(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Loaded, ConfigError> {
    let mut document: Value = serde_yaml_ng::from_str(text).map_err(|source| {
        let (line, column) = source.location().map_or((0, 0), |at| (at.line(), at.column()));
        ConfigError::Syntax { line, column, source }
    })?;
    let (substitution_diagnostics, keys) = substitute_document(&mut document, env);
    let (config, parse_diagnostics) = parse_lenient(document);
    let mut diagnostics: Vec<Diagnostic> = substitution_diagnostics
        .into_iter()
        .chain(parse_diagnostics)
        .map(|diagnostic| keys.as_written(diagnostic))
        .collect();
    let Some(mut config) = config else {
        return Err(ConfigError::Invalid(diagnostics));
    };
    fill_derived_defaults(&mut config);
    // A value already reported as unusable was replaced by its default; rules about that
    // default would only repeat the report.
    let reported: Vec<String> = diagnostics.iter().map(|d| d.path.clone()).collect();
    let rules = validate(&config).into_iter();
    diagnostics.extend(rules.filter(|d| !reported.iter().any(|r| is_within(&d.path, r))));
    if diagnostics.iter().any(Diagnostic::is_error) {
        return Err(ConfigError::Invalid(diagnostics));
    }
    Ok(Loaded { config, diagnostics })
}

/// Defaults that depend on other values, written back so readbacks show the effective
/// configuration.
fn fill_derived_defaults(config: &mut Config) {
    for worker in &mut config.dynamo.discovery.static_fleet.workers {
        if worker.component.is_none() && worker.role.is_some() {
            worker.component = Some(worker.component().to_owned());
        }
    }
}

/// The embedded default configuration (`default.yaml`).
pub fn embedded_default() -> Config {
    // The file is compiled in and a test loads it without diagnostics, so the fallback is
    // unreachable; it only keeps this infallible without a panic path.
    load_str(DEFAULT_YAML, &|_| None).map(|loaded| loaded.config).unwrap_or_default()
}

/// The embedded default's text.
#[cfg(test)]
pub fn embedded_default_yaml() -> &'static str {
    DEFAULT_YAML
}

impl Config {
    /// Every rule violation and advisory for this configuration (as `load_str` checks it).
    pub fn validate(&self) -> Vec<Diagnostic> {
        validate(self)
    }
}
