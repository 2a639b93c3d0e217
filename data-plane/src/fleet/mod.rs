//! The data plane's copy of the fleet, fed by the control plane's Watch stream.

mod backoff;
mod client;
mod handle;

pub use client::{FleetClientConfig, RECONNECT_INITIAL, RECONNECT_MAX, run};
pub use handle::{FleetHandle, FleetStatus};
