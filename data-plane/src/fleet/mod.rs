//! The data plane's copy of the fleet, fed by the control plane's Watch stream, and its KV
//! overlap lookups.

mod backoff;
mod client;
mod credentials;
mod handle;
mod matches;
mod reporter;

pub use client::{EndpointError, FleetClientConfig, RECONNECT_INITIAL, RECONNECT_MAX, REPLY_STALL_LIMIT, run};
pub use credentials::{
    ClientTls, Credentials, InvalidToken, TLS_HANDSHAKE_TIMEOUT, TlsFileError, TlsFiles, client_tls,
};
pub use handle::{FleetHandle, FleetStatus};
pub use matches::{FIND_MATCHES_DEADLINE, Matches, MatchesClient, MatchesError, TLS_RENEWAL_INTERVAL};
#[cfg(test)]
pub(crate) use reporter::batch;
pub use reporter::{
    DispatchReporter, InFlight, MAX_REPLAYED_HASHES, MAX_REPLAYED_PER_OPERATION, MAX_REPORT_BATCH, REPORT_QUEUE, Report,
};
