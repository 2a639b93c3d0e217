//! Tests of the configuration module, by topic: the rule table, loading (substitution, unknown
//! keys, type errors, instance ids) and outputs (masking, the data-plane view).

mod loading;
mod output;
mod rules;

use super::{ConfigError, Diagnostic, Loaded, load_str};

fn no_env(_: &str) -> Option<String> {
    None
}

fn load(yaml: &str) -> Result<Loaded, ConfigError> {
    load_str(yaml, &no_env)
}

/// Every diagnostic a document produces, whether or not it loads.
fn diagnostics(yaml: &str) -> Vec<Diagnostic> {
    match load(yaml) {
        Ok(loaded) => loaded.diagnostics,
        Err(ConfigError::Invalid(diagnostics)) => diagnostics,
        Err(other) => panic!("expected diagnostics, got {other}"),
    }
}

fn loaded(yaml: &str) -> Loaded {
    match load(yaml) {
        Ok(loaded) => loaded,
        Err(error) => panic!("expected the configuration to load:\n{error}"),
    }
}
