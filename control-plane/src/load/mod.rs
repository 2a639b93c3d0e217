//! Load signals: how busy each worker rank is, from the ActiveLoad samples its `kv_metrics`
//! publisher sends whenever its load changes.
//!
//! * [`zmtp`]: a bounded ZMTP 3.x SUB client (every ceiling is in its header).
//! * [`decode`]: Dynamo's 4-frame message and msgpack envelope into a sample.
//! * [`store`]: the latest sample per (worker, dp rank), staleness, and the quiet reading.
//! * `subscription`: one task per publisher (dial, session, reconnect with backoff).
//! * [`supervisor`]: follows the registry, admits at most 1,024 subscriptions, reloads.
//! * [`events`], `gauges`, `status`: what is counted and exported.
//!
//! Samples go from the store through the fleet's `LoadCoalescer` to the data-plane replicas,
//! with their age. See docs/load-signals.md.

mod backoff;
pub mod decode;
pub mod dial;
pub mod events;
mod gauges;
mod status;
pub mod store;
mod subscription;
pub mod supervisor;
pub mod zmtp;

pub use backoff::{Backoff, RECONNECT_INITIAL, RECONNECT_MAX, STABLE_SESSION};
pub use events::LoadEvent;
pub use gauges::LoadGauges;
pub use status::{SubscriptionState, SubscriptionStatus, transport_label};
pub use store::{HeldSample, LoadStore, MAX_LOAD_ENTRIES, Reading, SharedLoadStore};
pub use supervisor::{LoadOptions, LoadSupervisor, LoadView, MAX_LOAD_SUBSCRIPTIONS, STOP_GRACE, Subscriptions};
