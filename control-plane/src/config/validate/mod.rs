//! The product's validation rules, one module per section. Each check is a pure function of
//! the parsed configuration that adds errors and warnings at exact key paths.

mod etcd;
mod event_bus;
mod kubernetes;
mod listeners;
mod load_kv;
mod names;
mod shim;
mod simulator;
mod static_fleet;

pub use etcd::MAX_ETCD_ENDPOINTS;
pub use event_bus::MIN_SESSION_BUFFER_BYTES_PER_STREAM;
pub use kubernetes::MAX_KUBERNETES_MODELS;
pub use load_kv::{MAX_DIRECT_ALLOW_CIDRS, MAX_MAX_STALENESS, MAX_PROVISIONAL_TTL, MIN_MAX_STALENESS};
pub use names::MAX_DYNAMO_NAMESPACES;
pub use shim::{MAX_MODEL_MAP_ENTRIES, MAX_SHIM_BACKENDS};
pub use simulator::MAX_SIMULATED_WORKERS;
pub use static_fleet::MAX_STATIC_WORKERS;

use super::Config;
use super::diagnostic::Diagnostic;

/// Collects the diagnostics of one validation run.
#[derive(Debug, Default)]
struct Report(Vec<Diagnostic>);

impl Report {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Diagnostic::error(path, message));
    }

    fn warning(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Diagnostic::warning(path, message));
    }
}

/// Every rule violation and advisory for `config`.
pub(super) fn validate(config: &Config) -> Vec<Diagnostic> {
    let mut report = Report::default();
    etcd::check(config, &mut report);
    kubernetes::check(config, &mut report);
    static_fleet::check(config, &mut report);
    simulator::check(config, &mut report);
    shim::check(config, &mut report);
    load_kv::check(config, &mut report);
    event_bus::check(config, &mut report);
    listeners::check(config, &mut report);
    report.0
}
