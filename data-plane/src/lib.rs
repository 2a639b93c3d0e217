//! A Continuum data-plane replica: stateless, configured with little more than its listen
//! address and the control plane's address. Everything else arrives on the Fleet stream.

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

/// An error and every cause under it. hyper's and tonic's own messages ("client error
/// (Connect)", "transport error") hide the cause, e.g. rustls's "invalid peer certificate:
/// UnknownIssuer"; the whole chain is what an operator needs.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        reason.push_str(": ");
        reason.push_str(&cause.to_string());
        source = cause.source();
    }
    reason
}
