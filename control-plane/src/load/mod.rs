//! Load signals: how busy each worker rank is, from the ActiveLoad samples its `kv_metrics`
//! publisher sends whenever its load changes.
//!
//! * [`zmtp`]: a bounded ZMTP 3.x SUB client (every ceiling is in its header).
//! * [`envelope`]: Dynamo's 4-frame message and msgpack envelope (kv-events shares it).
//! * [`decode`]: a kv_metrics payload into a sample.
//! * [`store`]: the latest sample per (worker, dp rank), staleness, and the quiet reading.
//! * [`subscription`]: one task per publisher (dial, session, reconnect with backoff), generic
//!   over the [`Feed`] its messages go to; `feed` is the kv_metrics one.
//! * [`supervisor`]: follows the registry, admits at most 1,024 subscriptions per feed, reloads.
//! * [`events`], `gauges`, `status`: what is counted and exported.
//!
//! Samples go from the store through the fleet's `LoadCoalescer` to the data-plane replicas,
//! with their age. See docs/load-signals.md.

mod backoff;
pub mod decode;
pub mod dial;
pub mod envelope;
pub mod events;
mod feed;
mod gauges;
mod status;
pub mod store;
pub mod subscription;
pub mod supervisor;
pub mod zmtp;

pub use events::LoadEvent;
pub use feed::live_ranks;
pub use gauges::LoadGauges;
pub use status::{SubscriptionState, SubscriptionStatus, transport_label};
pub use store::{Applied, HeldSample, LoadStore, MAX_LOAD_ENTRIES, Reading, SharedLoadStore};
pub use subscription::{DialPolicy, Dropped, EndReason, Feed, Refusal, SessionEnds};
pub use supervisor::{
    LoadOptions, LoadSupervisor, LoadView, MAX_LOAD_SUBSCRIPTIONS, STOP_GRACE, Subscriptions, Supervisor, dial_policy,
};
