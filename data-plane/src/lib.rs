//! A Continuum data-plane replica: stateless, configured with little more than its listen
//! address and the control plane's address. Everything else arrives on the Fleet stream.

mod boxed;
pub mod clear_text;
pub mod dispatch;
pub mod fleet;
pub mod http;
pub mod ingress;
pub mod json_shape;
pub mod kv;
pub mod memory;
pub mod metrics;
pub mod replica;
pub mod routing;
pub mod server;
mod tcp;

pub use continuum_proto::error_chain;
