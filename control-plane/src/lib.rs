//! The Continuum control plane: one per fleet. It discovers workers, follows their load and KV
//! signals, and streams one versioned fleet view to every data-plane replica.
pub mod admin;
pub mod app;
pub mod bearer;
pub mod config;
pub mod discovery;
pub mod fleet;
pub mod gauges;
pub mod grpc;
pub mod kv;
pub mod listen;
pub mod load;
pub mod metrics;
pub mod sources;
#[cfg(test)]
mod test_logs;
