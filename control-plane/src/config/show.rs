//! The effective configuration as YAML for `config show`, with every secret
//! replaced by the mask.
//!
//! Masking is structural: secrets are [`Secret`](super::Secret) values, whose only serialized
//! form is the mask, so no readback path can leak one.

use super::Config;

impl Config {
    /// The effective configuration (defaults filled in), secrets masked.
    pub fn to_masked_yaml(&self) -> String {
        serde_yaml_ng::to_string(self)
            .unwrap_or_else(|error| format!("# the configuration could not be rendered: {error}\n"))
    }
}
