//! The data plane's copy of the fleet, fed by the control plane's Watch stream.

mod backoff;
mod client;
mod handle;
mod reporter;

pub use client::{FleetClientConfig, RECONNECT_INITIAL, RECONNECT_MAX, run};
pub use handle::{FleetHandle, FleetStatus};
pub use reporter::{DispatchEvent, DispatchReporter, MAX_REPORT_BATCH, REPORT_QUEUE};
